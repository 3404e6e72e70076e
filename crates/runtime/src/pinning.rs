//! `K3_PIN_LAYERS`: which decoder layers stay in RAM, and the rule that splits the RAM budget between the
//! resident spine and the expert cache.
//!
//! Syntax: `auto` (default), `all`, `none` (or `0`), a count `N` (layers `0..N`), or a comma-separated list of
//! layers and inclusive ranges (`0-9,90-92`). Under `auto` the whole spine stays resident when it fits the budget;
//! otherwise layers are pinned from layer 0 while they fit and the rest are streamed. The embedding, final norm,
//! head and output mix are always resident and are charged to the budget first.

use std::ops::RangeInclusive;

use crate::error::{Result, RuntimeError};

/// Which decoder layers stay in RAM.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum PinLayers {
    /// Everything when the spine fits the budget, else as many layers as fit, from layer 0.
    #[default]
    Auto,
    /// Every layer (the whole spine resident, whatever the budget).
    All,
    /// No layer: every layer is streamed.
    None,
    /// Layers `0..n` (every layer when `n` is at least the layer count).
    First(usize),
    /// The listed layers (inclusive ranges).
    Ranges(Vec<RangeInclusive<usize>>),
}

/// The environment variable that sets [`PinLayers`] (read by `EngineOptions::from_env`).
pub const PIN_LAYERS_ENV: &str = "K3_PIN_LAYERS";

impl PinLayers {
    /// Parses `auto`, `all`, `none`, `N` or `A-B,C,…` (see the module docs).
    pub fn parse(s: &str) -> Result<Self> {
        let s = s.trim();
        let bad = |why: String| {
            RuntimeError::Usage(format!(
                "{PIN_LAYERS_ENV}={s:?}: {why} (expected auto, all, none, a count N, or layers and ranges \
                 such as 0-9,90-92)"
            ))
        };
        match s.to_ascii_lowercase().as_str() {
            "auto" => return Ok(Self::Auto),
            "all" => return Ok(Self::All),
            "none" | "0" => return Ok(Self::None),
            _ => {}
        }
        if !s.contains([',', '-'])
            && let Ok(n) = s.parse::<usize>()
        {
            return Ok(Self::First(n));
        }
        let layer = |t: &str| {
            t.trim()
                .parse::<usize>()
                .map_err(|_| bad(format!("`{}` is not a layer number", t.trim())))
        };
        let mut ranges = Vec::new();
        for part in s.split(',') {
            let range = match part.split_once('-') {
                Some((a, b)) => layer(a)?..=layer(b)?,
                None => layer(part)?..=layer(part)?,
            };
            if range.is_empty() {
                return Err(bad(format!("range `{}` runs backwards", part.trim())));
            }
            ranges.push(range);
        }
        Ok(Self::Ranges(ranges))
    }

    /// One flag per layer: `true` keeps the layer resident. `layer_bytes` are the layers' spine bytes,
    /// `fixed_bytes` the always-resident rest of the spine, `budget` the RAM for weights. A listed layer past the
    /// last one is an error.
    pub fn resolve(&self, layer_bytes: &[u64], fixed_bytes: u64, budget: u64) -> Result<Vec<bool>> {
        let n = layer_bytes.len();
        Ok(match self {
            Self::All => vec![true; n],
            Self::None => vec![false; n],
            Self::First(k) => (0..n).map(|l| l < *k).collect(),
            Self::Ranges(ranges) => {
                if let Some(r) = ranges.iter().find(|r| *r.end() >= n) {
                    return Err(RuntimeError::Usage(format!(
                        "{PIN_LAYERS_ENV}: layer {} does not exist (the model has {n} layers, 0-{})",
                        r.end(),
                        n.saturating_sub(1)
                    )));
                }
                (0..n)
                    .map(|l| ranges.iter().any(|r| r.contains(&l)))
                    .collect()
            }
            Self::Auto => {
                let mut used = fixed_bytes;
                let mut fits = true;
                layer_bytes
                    .iter()
                    .map(|&b| {
                        fits = fits && used.saturating_add(b) <= budget;
                        if fits {
                            used += b;
                        }
                        fits
                    })
                    .collect()
            }
        })
    }
}

impl std::str::FromStr for PinLayers {
    type Err = RuntimeError;

    fn from_str(s: &str) -> Result<Self> {
        Self::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(text: &str, expected: PinLayers) {
        assert_eq!(PinLayers::parse(text).expect(text), expected, "{text}");
    }

    #[test]
    fn parses_every_form() {
        check("auto", PinLayers::Auto);
        check(" AUTO ", PinLayers::Auto);
        check("all", PinLayers::All);
        check("none", PinLayers::None);
        check("0", PinLayers::None);
        check("12", PinLayers::First(12));
        check("3", PinLayers::First(3));
        check("0-9,90-92", PinLayers::Ranges(vec![0..=9, 90..=92]));
        check("5", PinLayers::First(5));
        check("5,7", PinLayers::Ranges(vec![5..=5, 7..=7]));
        check(" 1 - 2 , 4 ", PinLayers::Ranges(vec![1..=2, 4..=4]));
    }

    #[test]
    fn rejects_bad_values() {
        for text in ["", "some", "-1", "3-", "9-2", "1,,2", "1;2", "x-3", "2.5"] {
            let err = PinLayers::parse(text).expect_err(text);
            assert!(err.to_string().contains("K3_PIN_LAYERS"), "{text}: {err}");
        }
    }

    #[test]
    fn resolves_against_the_budget() {
        let layers = [10, 10, 10, 10];
        assert_eq!(
            PinLayers::All.resolve(&layers, 5, 0).expect("all"),
            [true; 4]
        );
        assert_eq!(
            PinLayers::None.resolve(&layers, 5, 1000).expect("none"),
            [false; 4]
        );
        assert_eq!(
            PinLayers::First(2).resolve(&layers, 5, 0).expect("first"),
            [true, true, false, false]
        );
        assert_eq!(
            PinLayers::First(9).resolve(&layers, 5, 0).expect("first"),
            [true; 4]
        );
        assert_eq!(
            PinLayers::Ranges(vec![1..=1, 3..=3])
                .resolve(&layers, 5, 0)
                .expect("list"),
            [false, true, false, true]
        );
        let err = PinLayers::Ranges(vec![2..=4])
            .resolve(&layers, 5, 0)
            .expect_err("past the end");
        assert!(err.to_string().contains("layer 4 does not exist"), "{err}");
        // auto: all when everything fits, else a prefix that fits, else nothing.
        assert_eq!(
            PinLayers::Auto.resolve(&layers, 5, 45).expect("auto"),
            [true; 4]
        );
        assert_eq!(
            PinLayers::Auto.resolve(&layers, 5, 44).expect("auto"),
            [true, true, true, false]
        );
        assert_eq!(
            PinLayers::Auto.resolve(&layers, 5, 25).expect("auto"),
            [true, true, false, false]
        );
        assert_eq!(
            PinLayers::Auto.resolve(&layers, 5, 4).expect("auto"),
            [false; 4]
        );
    }
}
