//! The TOML config file (`--config FILE` or `GRANARY_CONFIG`).
//!
//! Keys are the long flag names of a command (`data-dir` or `data_dir`), in a table named
//! after the command (`[master]`, `[worker]`, `[fuse]`, `[local]`); keys at the top level
//! apply to every command that has such a flag. A value from the file is used only when
//! neither the command line nor the environment sets that flag: the file fills in each
//! flag's `GRANARY_*` variable before the command line is parsed.
//!
//! ```toml
//! masters = "m1:19998,m2:19998,m3:19998"   # --master of every client command
//! [master]
//! id = 1
//! data-dir = "/var/lib/granary/master"
//! listen = "0.0.0.0:19998"
//! peers = { 1 = "m1:19998", 2 = "m2:19998", 3 = "m3:19998" }
//! ```

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// Finds `--config FILE` / `--config=FILE` in `args`, else `GRANARY_CONFIG`.
pub fn config_path(args: &[OsString]) -> Option<PathBuf> {
    let mut it = args.iter().skip(1);
    while let Some(a) = it.next() {
        let s = a.to_string_lossy();
        if s == "--config" {
            return it.next().map(PathBuf::from);
        }
        if let Some(v) = s.strip_prefix("--config=") {
            return Some(PathBuf::from(v));
        }
    }
    std::env::var_os("GRANARY_CONFIG").map(PathBuf::from)
}

/// The subcommand path of `args` (e.g. `["master"]`, `["mount", "add"]`).
fn subcommand_path(cmd: &clap::Command, args: &[OsString]) -> Vec<String> {
    let mut path = Vec::new();
    let mut cur = cmd;
    let mut it = args.iter().skip(1);
    while let Some(a) = it.next() {
        let s = a.to_string_lossy();
        if s == "--config" {
            it.next();
            continue;
        }
        if s.starts_with('-') {
            continue;
        }
        match cur.find_subcommand(s.as_ref()) {
            Some(sub) => {
                path.push(sub.get_name().to_string());
                cur = sub;
            }
            None => break,
        }
    }
    path
}

fn value_string(v: &toml::Value) -> Result<String, String> {
    Ok(match v {
        toml::Value::String(s) => s.clone(),
        toml::Value::Integer(i) => i.to_string(),
        toml::Value::Float(f) => f.to_string(),
        toml::Value::Boolean(b) => b.to_string(),
        toml::Value::Array(items) => items
            .iter()
            .map(value_string)
            .collect::<Result<Vec<_>, _>>()?
            .join(","),
        // `peers = { 1 = "host:port", ... }`
        toml::Value::Table(t) => t
            .iter()
            .map(|(k, v)| value_string(v).map(|v| format!("{k}={v}")))
            .collect::<Result<Vec<_>, _>>()?
            .join(","),
        toml::Value::Datetime(d) => d.to_string(),
    })
}

/// Reads the config file and exports its settings for the command in `args` as the
/// flags' environment variables (where not already set). Errors are one sentence.
pub fn apply(cmd: &clap::Command, args: &[OsString], file: &Path) -> Result<(), String> {
    let text = std::fs::read_to_string(file)
        .map_err(|e| format!("cannot read the config file {}: {e}", file.display()))?;
    for (env, value) in settings(cmd, args, &text, &file.display().to_string())? {
        std::env::set_var(env, value);
    }
    Ok(())
}

/// The `(variable, value)` pairs a config file's text sets for the command in `args`,
/// leaving out variables already in the environment. `file` names the file in errors.
pub fn settings(
    cmd: &clap::Command,
    args: &[OsString],
    text: &str,
    file: &str,
) -> Result<Vec<(String, String)>, String> {
    let doc: toml::Table = text.parse().map_err(|e: toml::de::Error| {
        format!(
            "the config file {file} is not valid TOML: {}",
            e.message().trim().replace('\n', "; ")
        )
    })?;
    let path = subcommand_path(cmd, args);
    let mut target = cmd;
    for name in &path {
        if let Some(sub) = target.find_subcommand(name) {
            target = sub;
        }
    }
    let section = path.first().map(String::as_str).unwrap_or("");
    let mut settings: Vec<(String, &toml::Value, bool)> = Vec::new();
    let mut out = Vec::new();
    for (k, v) in &doc {
        match v {
            toml::Value::Table(t) if cmd.find_subcommand(k).is_some() => {
                if k == section {
                    for (k2, v2) in t {
                        settings.push((k2.clone(), v2, true));
                    }
                }
            }
            _ => settings.push((k.clone(), v, false)),
        }
    }
    for (key, value, in_section) in settings {
        let long = key.replace('_', "-");
        let arg = target.get_arguments().find(|a| {
            a.get_long() == Some(long.as_str())
                || a.get_all_aliases()
                    .is_some_and(|al| al.contains(&long.as_str()))
        });
        let Some(arg) = arg else {
            // A setting of the section's own command (e.g. [master] data-dir) means nothing
            // to one of its actions (`granary master list`): skip it there.
            let of_section = cmd.find_subcommand(section).is_some_and(|c| {
                c.get_arguments()
                    .any(|a| a.get_long() == Some(long.as_str()))
            });
            if in_section && long != "config" && !of_section {
                return Err(format!(
                    "unknown setting {key:?} in [{section}] of {}; see `granary {section} --help`",
                    file
                ));
            }
            continue; // a top-level key for other commands
        };
        let Some(env) = arg.get_env() else { continue };
        if std::env::var_os(env).is_some() {
            continue; // the environment wins over the file
        }
        let v = value_string(value).map_err(|e| format!("setting {key:?} in {}: {e}", file))?;
        out.push((env.to_string_lossy().into_owned(), v));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn args(a: &[&str]) -> Vec<OsString> {
        a.iter().map(OsString::from).collect()
    }

    #[test]
    fn a_table_sets_its_command_and_top_level_keys_every_command() {
        let cmd = crate::args::Cli::command();
        let text = "masters = \"m1:1\"\n[master]\ndata-dir = \"/d\"\nid = 2\n";
        let got = settings(&cmd, &args(&["granary", "master"]), text, "f").unwrap();
        assert!(
            got.contains(&("GRANARY_DATA_DIR".into(), "/d".into())),
            "{got:?}"
        );
        assert!(
            got.contains(&("GRANARY_MASTER_ID".into(), "2".into())),
            "{got:?}"
        );
        let e = settings(
            &cmd,
            &args(&["granary", "master"]),
            "[master]\nnope = 1\n",
            "f",
        )
        .unwrap_err();
        assert!(e.contains("unknown setting \"nope\""), "{e}");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 512, ..Default::default() })]

        /// Config parsing of hostile text never panics: it yields settings or one sentence.
        #[test]
        fn arbitrary_config_text_is_parsed_or_refused_in_one_sentence(
            text in "(\\[?(master|worker|fuse|x)\\]?|[a-z_-]{1,12} ?= ?(\"[^\"\n]{0,12}\"|[0-9]{1,22}|true|\\[1, ?2\\]|\\{ ?1 ?= ?\"a\" ?\\})|[^\n]{0,20})(\n(\\[(master|worker|local)\\]|[a-z-]{1,12} ?= ?(\"[^\"]{0,8}\"|[0-9.e+-]{1,8}|\\{\\}))){0,8}",
            sub in proptest::sample::select(vec!["master", "worker", "fuse", "local", "report", "mount"]),
        ) {
            let cmd = crate::args::Cli::command();
            match settings(&cmd, &args(&["granary", sub]), &text, "f") {
                Ok(pairs) => for (k, _) in pairs { proptest::prop_assert!(k.starts_with("GRANARY_")) },
                Err(e) => proptest::prop_assert!(!e.contains('\n'), "{}", e),
            }
        }
    }
}
