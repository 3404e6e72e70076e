//! [`TokenMask`]: the hook through which a caller restricts which tokens generation may choose (constrained
//! decoding: a JSON schema, a tool-call grammar).
//!
//! The runtime knows nothing of what the constraint means. Before each token [`Session::generate_with`] hands the
//! mask a copy of the logits row, the mask sets every forbidden logit to negative infinity, the sampler chooses
//! among what is left (greedy or sampled, unchanged), and the mask is told which token was chosen. While a mask is
//! in use n-gram speculation is off: a draft is only ever checked by argmax over unmasked logits, so keeping it
//! lossless would need the mask at every draft position; generation with a mask is one token per pass.
//!
//! [`Session::generate_with`]: crate::Session::generate_with

use crate::error::{Result, RuntimeError};

/// Restricts the next token of a generation.
pub trait TokenMask {
    /// Sets the logits of the tokens that may not come next to negative infinity (leaving the others untouched).
    /// An error ends the generation.
    fn restrict(&mut self, logits: &mut [f32]) -> std::result::Result<(), String>;

    /// Records the token chosen next (one that [`Self::restrict`] allowed). An error ends the generation.
    fn accept(&mut self, id: u32) -> std::result::Result<(), String>;
}

/// Applies `mask` to a copy of `row`; fails when the mask forbids every token.
pub(crate) fn masked_row(mask: &mut dyn TokenMask, row: &[f32]) -> Result<Vec<f32>> {
    let mut masked = row.to_vec();
    mask.restrict(&mut masked)
        .map_err(RuntimeError::Constraint)?;
    if masked.iter().all(|&v| v == f32::NEG_INFINITY) {
        return Err(RuntimeError::Constraint(
            "the constraint allows no token here".to_owned(),
        ));
    }
    Ok(masked)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Allows only ids divisible by `.0` (none when it is 0).
    struct Multiples(usize);

    impl TokenMask for Multiples {
        fn restrict(&mut self, logits: &mut [f32]) -> std::result::Result<(), String> {
            let m = self.0;
            logits
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| m == 0 || i % m != 0)
                .for_each(|(_, v)| *v = f32::NEG_INFINITY);
            Ok(())
        }

        fn accept(&mut self, _id: u32) -> std::result::Result<(), String> {
            Ok(())
        }
    }

    #[test]
    fn masked_row_keeps_allowed_logits_and_refuses_an_empty_set() {
        let mut mask = Multiples(2);
        let row = [1.0, 9.0, 2.0, 8.0];
        let masked = masked_row(&mut mask, &row).expect("some allowed");
        assert_eq!(masked[0], 1.0);
        assert_eq!(masked[2], 2.0);
        assert_eq!(masked[1], f32::NEG_INFINITY);
        assert_eq!(crate::argmax(&masked), 2);
        let e = masked_row(&mut Multiples(0), &row).expect_err("nothing allowed");
        assert!(e.to_string().contains("allows no token"), "{e}");
    }
}
