//! n-gram drafts for speculative decoding: the longest recent suffix of the token history that occurred earlier
//! proposes the tokens that followed it then.

/// Longest suffix tried when looking for a match.
pub const MAX_NGRAM: usize = 4;

/// Up to `depth` tokens that followed the most recent earlier occurrence of the longest suffix (length
/// `MAX_NGRAM` down to 1) of `history`. Empty when nothing matches.
pub fn draft(history: &[u32], depth: usize) -> Vec<u32> {
    if depth == 0 || history.len() < 2 {
        return Vec::new();
    }
    for n in (1..=MAX_NGRAM.min(history.len() - 1)).rev() {
        let suffix = &history[history.len() - n..];
        // Latest earlier occurrence whose continuation exists.
        let last_start = history.len() - n;
        for start in (0..last_start).rev() {
            if &history[start..start + n] == suffix {
                let from = start + n;
                let to = (from + depth).min(history.len());
                if from < to {
                    return history[from..to].to_vec();
                }
            }
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_what_followed_the_longest_match() {
        // ... 1 2 3 9 ... 1 2 3 -> 9 (and then what followed it)
        let h = [5, 1, 2, 3, 9, 8, 7, 1, 2, 3];
        assert_eq!(draft(&h, 1), vec![9]);
        assert_eq!(draft(&h, 3), vec![9, 8, 7]);
    }

    #[test]
    fn prefers_the_latest_occurrence_and_handles_no_match() {
        let h = [4, 1, 5, 4, 1, 6, 4, 1];
        assert_eq!(draft(&h, 1), vec![6]);
        assert!(draft(&[1, 2, 3], 2).is_empty());
        assert!(draft(&[], 2).is_empty());
    }
}
