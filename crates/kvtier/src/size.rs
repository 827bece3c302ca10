//! Byte sizes as people write them, for every front end (the command
//! line, serve.toml, the Python package): one parser, one meaning.

/// Parses `65536`, `64KiB`, `16 MiB`, `1.5GiB`. Units are binary, and
/// `KB`, `MB`, `GB`, `TB` and `K`, `M`, `G`, `T` are read as binary too:
/// every buffer and capacity in this domain is a power-of-two multiple.
pub fn parse_size(text: &str) -> Result<u64, String> {
    parse_size::Config::new()
        .with_binary()
        .parse_size(text.trim())
        .map_err(|e| {
            format!("{text:?} is not a size ({e}): give bytes or a number and a unit, like 64MiB")
        })
}

/// `1.50 GiB`-style rendering for output.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("65536").unwrap(), 65536);
        assert_eq!(parse_size("64KiB").unwrap(), 65536);
        assert_eq!(parse_size("16MiB").unwrap(), 16 << 20);
        assert_eq!(parse_size("1.5GiB").unwrap(), 3 << 29);
        assert_eq!(parse_size("2g").unwrap(), 2 << 30);
        assert!(parse_size("MiB").is_err());
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("").is_err());
        assert!(parse_size("-1MiB").is_err());
        assert_eq!(parse_size(" 16 MB ").unwrap(), 16 << 20);
        assert_eq!(parse_size("4kb").unwrap(), 4096);
        assert_eq!(parse_size("1TiB").unwrap(), 1 << 40);
        assert_eq!(format_size(3 << 29), "1.50 GiB");
        assert_eq!(format_size(100), "100 B");
    }
}
