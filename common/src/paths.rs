//! Granary namespace paths.

use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum PathError {
    #[error("invalid path {path:?}: {reason}")]
    Invalid { path: String, reason: &'static str },
}

/// Longest accepted path and path component, as on Linux.
pub const MAX_PATH_LEN: usize = 4096;
pub const MAX_NAME_LEN: usize = 255;

/// A path as an error shows it: at most its first 256 bytes (a refused path may be
/// megabytes long, and error messages travel in gRPC headers).
pub fn shown(path: &str) -> String {
    const SHOWN: usize = 256;
    if path.len() <= SHOWN {
        return path.to_string();
    }
    let mut end = SHOWN;
    while !path.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes)", &path[..end], path.len())
}

/// A name or path as a terminal should print it: control characters (escape sequences,
/// carriage returns, newlines — a name may hold any of them) as `\xNN` and backslashes
/// doubled, as `ls -b` does; everything else as it is. A name cannot then rewrite what a
/// terminal shows, nor forge lines for a script reading the output.
pub fn printable(s: &str) -> std::borrow::Cow<'_, str> {
    if !s.chars().any(|c| c.is_control() || c == '\\') {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            // Control characters are U+0000–U+001F and U+007F–U+009F: two digits each.
            c if c.is_control() => out.push_str(&format!("\\x{:02x}", c as u32)),
            c => out.push(c),
        }
    }
    std::borrow::Cow::Owned(out)
}

/// Splits an absolute Granary path into its components, rejecting what the namespace
/// cannot hold. `/` yields no components.
pub fn components(path: &str) -> Result<Vec<&str>, PathError> {
    let invalid = |reason| PathError::Invalid {
        path: shown(path),
        reason,
    };
    if !path.starts_with('/') {
        return Err(invalid("must be absolute (start with /)"));
    }
    if path.len() > MAX_PATH_LEN {
        return Err(invalid("longer than 4096 bytes"));
    }
    let mut out = Vec::new();
    for part in path.split('/').filter(|p| !p.is_empty()) {
        validate_name(part).map_err(|_| invalid("contains an invalid component"))?;
        out.push(part);
    }
    Ok(out)
}

/// Checks a single entry name.
pub fn validate_name(name: &str) -> Result<(), PathError> {
    let invalid = |reason| PathError::Invalid {
        path: shown(name),
        reason,
    };
    if name.is_empty() || name == "." || name == ".." {
        return Err(invalid("'.', '..' and empty names are not allowed"));
    }
    if name.contains('/') || name.contains('\0') {
        return Err(invalid("names cannot contain '/' or NUL"));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(invalid("name longer than 255 bytes"));
    }
    Ok(())
}

/// Normalises a path: `//a/./b/` becomes `/a/b` (`.` components are dropped, `..` rejected).
pub fn normalize(path: &str) -> Result<String, PathError> {
    let cleaned: Vec<&str> = path
        .split('/')
        .filter(|p| !p.is_empty() && *p != ".")
        .collect();
    let joined = format!("/{}", cleaned.join("/"));
    let parts = components(if path.starts_with('/') { &joined } else { path })?;
    Ok(format!("/{}", parts.join("/")))
}

/// Joins a parent path and a child name.
pub fn join(parent: &str, name: &str) -> String {
    if parent == "/" {
        format!("/{name}")
    } else {
        format!("{parent}/{name}")
    }
}

/// True when `inner` equals `outer` or lies below it.
pub fn is_within(inner: &str, outer: &str) -> bool {
    outer == "/"
        || inner == outer
        || (inner.starts_with(outer) && inner.as_bytes().get(outer.len()) == Some(&b'/'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn printable_names_cannot_drive_a_terminal() {
        assert_eq!(printable("plain 名前.txt"), "plain 名前.txt");
        assert_eq!(
            printable("a\u{1b}]52;c;x\u{7}\r\nb\\c\u{9b}"),
            "a\\x1b]52;c;x\\x07\\x0d\\x0ab\\\\c\\x9b"
        );
    }

    #[test]
    fn a_refused_path_is_shown_short() {
        let long = format!("/{}", "é".repeat(1 << 19));
        let e = normalize(&long).unwrap_err().to_string();
        assert!(e.len() < 400, "{}", e.len());
        assert!(
            e.contains("(1048577 bytes)") && e.contains("longer than 4096"),
            "{e}"
        );
        assert_eq!(shown("/a/b"), "/a/b");
    }

    #[test]
    fn normalizes() {
        assert_eq!(normalize("/").unwrap(), "/");
        assert_eq!(normalize("//a/./b/").unwrap(), "/a/b");
        assert!(normalize("a/b").is_err());
        assert!(normalize("/a/../b").is_err());
    }

    #[test]
    fn within() {
        assert!(is_within("/a/b", "/a"));
        assert!(is_within("/a", "/a"));
        assert!(!is_within("/ab", "/a"));
        assert!(is_within("/x", "/"));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 2000, ..Default::default() })]

        /// Path parsing of hostile text: never panics; what it accepts is absolute, short
        /// enough, free of `.`/`..`/empty/NUL components, and already normal.
        #[test]
        fn normalize_accepts_only_clean_paths(s in "[/a.\\\u{0}\u{202e}é]{0,64}|/[a-z/.]{0,5000}") {
            if let Ok(n) = normalize(&s) {
                proptest::prop_assert!(n.starts_with('/') && n.len() <= MAX_PATH_LEN);
                proptest::prop_assert!(!n.contains('\0'));
                for part in n.split('/').skip(1).filter(|p| !p.is_empty()) {
                    proptest::prop_assert!(part != "." && part != ".." && part.len() <= MAX_NAME_LEN);
                }
                proptest::prop_assert_eq!(normalize(&n).unwrap(), n.clone());
                proptest::prop_assert!(!s.split('/').any(|p| p == ".."));
            }
        }
    }
}
