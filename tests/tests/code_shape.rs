//! The shape the code keeps (issue 28): no product file over 1,500 lines and no product
//! function over 150, not counting tests; declarative tables are named below with why.
//! Read from the sources as rustfmt lays them out (an item ends at the first line that
//! closes it at its own indentation).

use std::path::{Path, PathBuf};

const MAX_FILE_LINES: usize = 1500;
const MAX_FN_LINES: usize = 150;

/// Functions allowed past the limit: (file, function, why).
const TABLES: &[(&str, &str, &str)] = &[(
    "worker/src/metrics.rs",
    "register",
    "one registration per metric, a declarative table",
)];

/// The crates whose `src/` is product code.
const CRATES: &[&str] = &[
    "proto",
    "common",
    "client",
    "master",
    "worker",
    "fuse-client",
    "cli",
];

/// Files that are test modules as a whole (declared under `#[cfg(test)]`).
const TEST_FILES: &[&str] = &["tests.rs", "proptests.rs", "adversarial.rs"];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace")
        .to_path_buf()
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n != "tests") {
                sources(&p, out);
            }
        } else if p.extension().is_some_and(|x| x == "rs")
            && !TEST_FILES.contains(&p.file_name().and_then(|n| n.to_str()).unwrap_or(""))
        {
            out.push(p);
        }
    }
}

fn indent(line: &str) -> usize {
    line.len() - line.trim_start().len()
}

/// The index of the line that closes the item starting at `start` (the first later line
/// that is a `}` at the item's own indentation), or `start` for a one-line item.
fn item_end(lines: &[&str], start: usize) -> usize {
    let first = lines[start].trim_end();
    if first.ends_with(';') || (first.ends_with('}') && first.contains('{')) {
        return start;
    }
    let at = indent(lines[start]);
    (start + 1..lines.len())
        .find(|&i| indent(lines[i]) == at && lines[i].trim_start().starts_with('}'))
        .unwrap_or(lines.len() - 1)
}

fn fn_name(line: &str) -> Option<&str> {
    let t = line.trim_start();
    let after = t.split_once("fn ")?;
    let before = after.0.trim();
    let allowed = before
        .split_whitespace()
        .all(|w| w.starts_with("pub") || matches!(w, "async" | "const" | "unsafe"));
    if !allowed {
        return None;
    }
    let name: &str = after.1.split(['(', '<']).next()?;
    (!name.is_empty() && name.chars().all(|c| c.is_alphanumeric() || c == '_')).then_some(name)
}

struct Shape {
    product_lines: usize,
    long_fns: Vec<(String, usize)>,
}

fn shape(text: &str) -> Shape {
    let lines: Vec<&str> = text.lines().collect();
    let mut product_lines = 0;
    let mut long_fns = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let t = lines[i].trim_start();
        if t.starts_with("#[cfg(test)]") {
            // The test item that follows (a module, a function, an import).
            let mut j = i + 1;
            while j < lines.len() && lines[j].trim_start().starts_with("#[") {
                j += 1;
            }
            i = item_end(&lines, j.min(lines.len() - 1)) + 1;
            continue;
        }
        product_lines += 1;
        if let Some(name) = fn_name(lines[i]) {
            // A signature may span lines: the body ends at the `}` at its indentation.
            let end = item_end(&lines, i);
            let n = end - i + 1;
            if n > MAX_FN_LINES {
                long_fns.push((name.to_string(), n));
            }
        }
        i += 1;
    }
    Shape {
        product_lines,
        long_fns,
    }
}

#[test]
fn no_product_file_or_function_is_longer_than_the_limits() {
    let root = root();
    let mut files = Vec::new();
    for c in CRATES {
        sources(&root.join(c).join("src"), &mut files);
    }
    assert!(files.len() > 50, "found only {} sources", files.len());
    let mut over = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(&root).unwrap_or(f).display().to_string();
        let text = std::fs::read_to_string(f).expect("a source file");
        let s = shape(&text);
        if s.product_lines > MAX_FILE_LINES {
            over.push(format!(
                "{rel}: {} lines outside tests (at most {MAX_FILE_LINES})",
                s.product_lines
            ));
        }
        for (name, n) in s.long_fns {
            if !TABLES.iter().any(|(file, f, _)| *file == rel && *f == name) {
                over.push(format!(
                    "{rel}: fn {name} is {n} lines (at most {MAX_FN_LINES})"
                ));
            }
        }
    }
    assert!(over.is_empty(), "split these:\n{}", over.join("\n"));
}

#[test]
fn the_shape_reader_measures_what_it_claims() {
    let long_body = "    x();\n".repeat(MAX_FN_LINES);
    let text = format!(
        "pub fn short() {{\n    a();\n}}\n\nasync fn long(\n    a: u8,\n) {{\n{long_body}}}\n\n#[cfg(test)]\nmod tests {{\n    fn in_tests() {{\n{long_body}    }}\n}}\n"
    );
    let s = shape(&text);
    assert_eq!(s.long_fns.len(), 1, "{:?}", s.long_fns);
    assert_eq!(s.long_fns[0].0, "long");
    assert_eq!(s.long_fns[0].1, MAX_FN_LINES + 4);
    // The test module is not product code.
    assert_eq!(s.product_lines, 4 + (MAX_FN_LINES + 4) + 1);
}

/// `docs/architecture.md`'s crate table names files and folders that exist, and names every
/// module of the crates whose rows list their files.
#[test]
fn the_architecture_crate_table_matches_the_tree() {
    let doc = std::fs::read_to_string(root().join("docs/architecture.md")).expect("the doc");
    let mut problems = Vec::new();
    let mut rows = 0;
    for line in doc.lines() {
        let Some(rest) = line.strip_prefix("| `") else {
            continue;
        };
        let Some((krate, text)) = rest.split_once("` | ") else {
            continue;
        };
        let src = root().join(krate).join("src");
        if !CRATES.contains(&krate) || !src.is_dir() {
            continue;
        }
        rows += 1;
        let mut files = Vec::new();
        sources(&src, &mut files);
        let rel: Vec<String> = files
            .iter()
            .filter_map(|f| f.strip_prefix(&src).ok())
            .map(|f| f.to_string_lossy().replace('\\', "/"))
            .collect();
        let named: Vec<&str> = text
            .split('`')
            .skip(1)
            .step_by(2)
            .filter(|t| t.ends_with(".rs") || (t.ends_with('/') && t.len() > 1))
            .filter(|t| !t.contains('*'))
            .collect();
        for t in &named {
            let found = rel.iter().any(|r| {
                r == t
                    || r.ends_with(&format!("/{t}"))
                    || r.starts_with(t)
                    || r.contains(&format!("/{t}"))
            });
            if !found {
                problems.push(format!("{krate}: `{t}` is not in {}", src.display()));
            }
        }
        // Rows that list their modules list them all.
        if ["client", "master", "worker", "fuse-client"].contains(&krate) {
            for r in &rel {
                let top = match r.split_once('/') {
                    Some((dir, _)) => format!("{dir}/"),
                    None => r.clone(),
                };
                let test = TEST_FILES.iter().any(|t| r.ends_with(t));
                let dir_of_file = top.ends_with('/')
                    && named.iter().any(|n| {
                        n.starts_with(&top) || *n == format!("{}.rs", top.trim_end_matches('/'))
                    });
                if test || ["lib.rs", "main.rs"].contains(&top.as_str()) || dir_of_file {
                    continue;
                }
                if !named.iter().any(|n| *n == top) {
                    problems.push(format!("{krate}: `{top}` is not in the table"));
                }
            }
        }
    }
    assert!(rows >= 6, "the crate table was not found ({rows} rows)");
    problems.sort();
    problems.dedup();
    assert!(
        problems.is_empty(),
        "docs/architecture.md's crate table: {problems:#?}"
    );
}
