//! Parsing of comma-separated token id lists (`--ids 1,2,3`).

use anyhow::{Context, bail};

/// Parses `1,2,3` (spaces allowed) into ids.
pub fn parse_ids(text: &str) -> anyhow::Result<Vec<u32>> {
    let ids = text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<u32>()
                .with_context(|| format!("`{s}` is not a token id"))
        })
        .collect::<anyhow::Result<Vec<u32>>>()?;
    if ids.is_empty() {
        bail!("no token ids given");
    }
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_rejects() {
        assert_eq!(parse_ids("1, 2,3").expect("valid"), vec![1, 2, 3]);
        assert!(parse_ids("1,x").is_err());
        assert!(parse_ids("").is_err());
    }
}
