//! Shared helpers for the workspace tests: fixture paths and the reference outputs in `golden.safetensors`.

pub mod corrupt;
pub mod hub;

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use safetensors::{Dtype, SafeTensors};

/// `tests/fixtures` inside the repository.
pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

/// A fixture model directory, e.g. `fixture("k3/k3-tiny-a")`.
pub fn fixture(name: &str) -> PathBuf {
    fixtures_dir().join(name)
}

/// The reference outputs of one fixture.
pub struct Golden {
    bytes: Vec<u8>,
}

impl Golden {
    /// Reads `golden.safetensors` of the fixture in `dir`.
    pub fn load(dir: &Path) -> anyhow::Result<Self> {
        let path = dir.join("golden.safetensors");
        let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        SafeTensors::deserialize(&bytes).with_context(|| format!("parsing {}", path.display()))?;
        Ok(Self { bytes })
    }

    fn view(&self) -> anyhow::Result<SafeTensors<'_>> {
        Ok(SafeTensors::deserialize(&self.bytes)?)
    }

    /// Whether the golden file has `key`.
    pub fn has(&self, key: &str) -> bool {
        self.view().is_ok_and(|v| v.tensor(key).is_ok())
    }

    /// An i64 tensor as token ids.
    pub fn ids(&self, key: &str) -> anyhow::Result<Vec<u32>> {
        let v = self.view()?;
        let t = v.tensor(key).with_context(|| format!("golden key {key}"))?;
        if t.dtype() != Dtype::I64 {
            bail!("golden key {key} is {:?}, expected I64", t.dtype());
        }
        t.data()
            .chunks_exact(8)
            .map(|b| {
                let v = i64::from_le_bytes(b.try_into().context("8-byte chunk")?);
                u32::try_from(v).context("id out of range")
            })
            .collect()
    }

    /// An f32 tensor as (shape, values).
    pub fn f32s(&self, key: &str) -> anyhow::Result<(Vec<usize>, Vec<f32>)> {
        let v = self.view()?;
        let t = v.tensor(key).with_context(|| format!("golden key {key}"))?;
        if t.dtype() != Dtype::F32 {
            bail!("golden key {key} is {:?}, expected F32", t.dtype());
        }
        let vals = t
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        Ok((t.shape().to_vec(), vals))
    }
}

/// Largest |a - b| over two equal-length slices; NaN when either side has a NaN anywhere, so that every
/// `max_abs_diff(..) <= tol` check fails on NaN (equal infinities differ by 0).
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    let mut worst = 0.0f32;
    for (x, y) in a.iter().zip(b) {
        let d = if x == y { 0.0 } else { (x - y).abs() };
        if d.is_nan() {
            return f32::NAN;
        }
        worst = worst.max(d);
    }
    worst
}

/// Index of the largest value (lowest index on ties). Panics on a NaN: a row with one has no answer to compare.
pub fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        assert!(!v.is_nan(), "NaN at index {i} of a logits row");
        if v > row[best] {
            best = i;
        }
    }
    best
}

/// Mean of `-log softmax(rows[t])[ids[t+1]]`, in f64.
pub fn mean_nll(rows: &[f32], vocab: usize, ids: &[u32]) -> f64 {
    let mut total = 0.0;
    for t in 0..ids.len() - 1 {
        let row = &rows[t * vocab..(t + 1) * vocab];
        let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let lse = max
            + row
                .iter()
                .map(|&x| (x as f64 - max).exp())
                .sum::<f64>()
                .ln();
        total += lse - row[ids[t + 1] as usize] as f64;
    }
    total / (ids.len() - 1) as f64
}
