//! Token sampling: greedy at temperature 0 (the default), else temperature, top-k and top-p over a seeded
//! ChaCha8 stream, so the same seed gives the same tokens.

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{Result, RuntimeError};

/// How the next token is chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax); otherwise logits are divided by it.
    pub temperature: f32,
    /// Nucleus: keep the smallest set of most likely tokens whose probability reaches `top_p` (1 = off).
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens (0 = off).
    pub top_k: usize,
    /// Seed of the random stream.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Whether this is plain argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Rejects values outside their ranges with a message naming the parameter.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(RuntimeError::Usage(format!(
                "temperature must be a finite number >= 0, got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(RuntimeError::Usage(format!(
                "top_p must be in (0, 1], got {}",
                self.top_p
            )));
        }
        Ok(())
    }
}

/// The id of the largest logit (the lowest id on exact ties).
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Draws tokens from logits according to [`SamplingParams`].
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
}

impl Sampler {
    /// A sampler whose random stream starts at `params.seed`.
    pub fn new(params: SamplingParams) -> Self {
        Self {
            rng: ChaCha8Rng::seed_from_u64(params.seed),
            params,
        }
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Chooses the next token after `logits`.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.is_greedy() {
            return argmax(logits);
        }
        let t = self.params.temperature as f64;
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        if self.params.top_k > 0 {
            order.truncate(self.params.top_k);
        }
        let max = logits[order[0]] as f64;
        let mut probs: Vec<f64> = order
            .iter()
            .map(|&i| ((logits[i] as f64 - max) / t).exp())
            .collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        if self.params.top_p < 1.0 {
            let mut cum = 0.0;
            let mut keep = probs.len();
            for (i, p) in probs.iter().enumerate() {
                cum += p;
                if cum >= self.params.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep);
            let total: f64 = probs.iter().sum();
            probs.iter_mut().for_each(|p| *p /= total);
        }
        let u: f64 = self.rng.random::<f64>();
        let mut cum = 0.0;
        for (i, p) in probs.iter().enumerate() {
            cum += p;
            if u < cum {
                return order[i] as u32;
            }
        }
        order[probs.len() - 1] as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_is_argmax() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&[0.1, 3.0, 2.0]), 1);
    }

    #[test]
    fn same_seed_same_tokens_and_top_k_one_is_greedy() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let p = SamplingParams {
            temperature: 1.0,
            top_p: 0.9,
            top_k: 20,
            seed: 42,
        };
        let draw = |p| {
            let mut s = Sampler::new(p);
            (0..30).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(p), draw(p));
        assert_ne!(draw(p), draw(SamplingParams { seed: 43, ..p }));
        let k1 = SamplingParams { top_k: 1, ..p };
        assert!(draw(k1).iter().all(|&t| t == argmax(&logits)));
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // One token holds ~all the mass: with top_p 0.5 only it can be drawn.
        let mut logits = vec![0.0f32; 10];
        logits[7] = 20.0;
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_p: 0.5,
            top_k: 0,
            seed: 1,
        });
        assert!((0..100).all(|_| s.sample(&logits) == 7));
    }

    #[test]
    fn rejects_bad_parameters() {
        let bad_t = SamplingParams {
            temperature: -1.0,
            ..Default::default()
        };
        assert!(bad_t.validate().is_err());
        let bad_p = SamplingParams {
            top_p: 0.0,
            ..Default::default()
        };
        assert!(
            bad_p
                .validate()
                .expect_err("top_p 0")
                .to_string()
                .contains("top_p")
        );
    }
}
