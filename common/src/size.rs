//! Human sizes: `10GiB`, `512MiB`, `1.5G`, `4096`.

use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
#[error("invalid size {input:?}: expected a number of bytes with an optional unit such as 512MiB, 10GiB or 4096")]
pub struct SizeError {
    pub input: String,
}

/// Parses a size. Binary units (`KiB`, `MiB`, …) and decimal units (`KB`, `MB`, …) are
/// honoured as written; a bare `K`/`M`/`G`/`T` means binary, as in most Unix tools.
pub fn parse_size(input: &str) -> Result<u64, SizeError> {
    let err = || SizeError {
        input: input.to_string(),
    };
    let s = input.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    if num.is_empty() {
        return Err(err());
    }
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return Err(err()),
    };
    if num.contains('.') {
        let v: f64 = num.parse().map_err(|_| err())?;
        let bytes = v * mult as f64;
        if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
            return Err(err());
        }
        Ok(bytes.round() as u64)
    } else {
        let v: u64 = num.parse().map_err(|_| err())?;
        v.checked_mul(mult).ok_or_else(err)
    }
}

/// Formats bytes with a binary unit, e.g. `1.5 GiB`; exact below 1 KiB.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("10GiB"), Ok(10 << 30));
        assert_eq!(parse_size("10 GiB"), Ok(10 << 30));
        assert_eq!(parse_size("1.5k"), Ok(1536));
        assert_eq!(parse_size("2MB"), Ok(2_000_000));
        assert_eq!(parse_size("0"), Ok(0));
    }

    #[test]
    fn rejects_garbage() {
        for bad in [
            "",
            "abc",
            "10XB",
            "-1",
            "1..2G",
            "99999999999999999999",
            "GiB",
        ] {
            assert!(parse_size(bad).is_err(), "{bad} should be rejected");
        }
    }

    #[test]
    fn formats() {
        assert_eq!(format_size(12), "12 B");
        assert_eq!(format_size(1536), "1.5 KiB");
        assert_eq!(format_size(10 << 30), "10.0 GiB");
    }
}
