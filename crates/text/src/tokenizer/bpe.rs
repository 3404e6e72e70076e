//! Rank BPE as in tiktoken: repeatedly merge the adjacent pair whose
//! concatenation has the lowest rank (leftmost on ties) until no pair is a token.
//!
//! Two implementations of the same merge order: a plain scan for short pieces
//! (what almost every piece of natural text is; it has the smallest constant
//! factor) and a heap over a linked list for long pieces, which keeps a
//! megabyte-long piece (say, one giant base64 blob) at O(n log n) instead of
//! the scan's O(n²). `merge_ref` is the scalar twin both are tested against.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use rustc_hash::FxHashMap;

/// Pieces at least this long (in bytes) use the heap merge.
const HEAP_MIN_LEN: usize = 128;

/// Rank of "no such token": never merged.
const NO_RANK: u32 = u32::MAX;

/// Byte string to rank (= token id) for the mergeable ranks.
pub(crate) type RankMap = FxHashMap<Box<[u8]>, u32>;

/// The mergeable ranks, with direct tables for one- and two-byte strings: the
/// initial pair ranks of every piece are two-byte lookups, so most lookups
/// skip hashing.
pub(crate) struct Vocab {
    map: RankMap,
    /// Rank of each single byte (`NO_RANK` if absent).
    bytes: Vec<u32>,
    /// Rank of each byte pair, indexed `first * 256 + second`.
    pairs: Vec<u32>,
}

impl Vocab {
    pub(crate) fn new(map: RankMap) -> Self {
        let mut bytes = vec![NO_RANK; 256];
        let mut pairs = vec![NO_RANK; 256 * 256];
        for (token, &rank) in &map {
            match **token {
                [b] => bytes[usize::from(b)] = rank,
                [b0, b1] => pairs[usize::from(b0) * 256 + usize::from(b1)] = rank,
                _ => {}
            }
        }
        Self { map, bytes, pairs }
    }

    /// The rank of `token`, or `NO_RANK`.
    #[inline]
    pub(crate) fn rank(&self, token: &[u8]) -> u32 {
        match *token {
            [b] => self.bytes[usize::from(b)],
            [b0, b1] => self.pairs[usize::from(b0) * 256 + usize::from(b1)],
            _ => self.map.get(token).copied().unwrap_or(NO_RANK),
        }
    }

    /// The rank of `token`, if it is a mergeable token.
    pub(crate) fn get(&self, token: &[u8]) -> Option<u32> {
        Some(self.rank(token)).filter(|&r| r != NO_RANK)
    }
}

impl std::fmt::Debug for Vocab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Vocab({} ranks)", self.map.len())
    }
}

/// Encodes one pre-tokenized piece, appending its token ids to `out`.
///
/// `scratch` is reused between calls to avoid an allocation per piece.
/// Every single byte must be in `ranks` (checked when the vocabulary is loaded).
pub(crate) fn encode_piece(
    ranks: &Vocab,
    piece: &[u8],
    scratch: &mut Vec<(usize, u32)>,
    out: &mut Vec<u32>,
) {
    if piece.is_empty() {
        return;
    }
    if let Some(id) = ranks.get(piece) {
        out.push(id);
        return;
    }
    if piece.len() >= HEAP_MIN_LEN {
        merge_heap(ranks, piece, out);
    } else {
        merge_scan(ranks, piece, scratch, out);
    }
}

#[inline]
fn rank_of(ranks: &Vocab, bytes: &[u8]) -> u32 {
    ranks.rank(bytes)
}

fn push_part(ranks: &Vocab, bytes: &[u8], out: &mut Vec<u32>) {
    // Every final part is a single byte or the result of a merge, and both are
    // in `ranks` (single bytes are checked at load); NO_RANK is unreachable.
    out.push(rank_of(ranks, bytes));
}

/// tiktoken's `_byte_pair_merge`: `parts[i] = (start of part i, rank of the pair
/// starting at part i)`, with a sentinel at the end. O(n·m) for m merges.
fn merge_scan(ranks: &Vocab, piece: &[u8], parts: &mut Vec<(usize, u32)>, out: &mut Vec<u32>) {
    let n = piece.len();
    parts.clear();
    for i in 0..n - 1 {
        parts.push((i, rank_of(ranks, &piece[i..i + 2])));
    }
    parts.push((n - 1, NO_RANK));
    parts.push((n, NO_RANK));

    // Rank of the pair made by parts i and i+1 (needs parts i+2 to exist).
    let pair_rank = |parts: &[(usize, u32)], i: usize| -> u32 {
        if i + 3 < parts.len() {
            rank_of(ranks, &piece[parts[i].0..parts[i + 3].0])
        } else {
            NO_RANK
        }
    };

    loop {
        let mut min = (NO_RANK, 0usize);
        for (i, &(_, rank)) in parts[..parts.len() - 1].iter().enumerate() {
            if rank < min.0 {
                min = (rank, i);
            }
        }
        if min.0 == NO_RANK {
            break;
        }
        let i = min.1;
        // Merge parts i and i+1: the pair ranks of i and i-1 change.
        parts[i].1 = pair_rank(parts, i);
        if i > 0 {
            parts[i - 1].1 = pair_rank(parts, i - 1);
        }
        parts.remove(i + 1);
    }

    for w in parts.windows(2) {
        push_part(ranks, &piece[w[0].0..w[1].0], out);
    }
}

/// The same merges as [`merge_scan`], driven by a min-heap of `(rank, start)`.
///
/// Parts form a linked list over byte offsets. A heap entry is stale when its
/// part was merged away or its pair rank changed since it was pushed; a rank
/// names a unique byte string, so comparing ranks detects any change.
fn merge_heap(ranks: &Vocab, piece: &[u8], out: &mut Vec<u32>) {
    let n = piece.len();
    // next[i]/prev[i]: neighbouring part starts; n is the end sentinel.
    let mut next: Vec<usize> = (1..=n).collect();
    let mut prev: Vec<usize> = (0..n).map(|i| i.wrapping_sub(1)).collect();
    let mut alive = vec![true; n];
    let mut pair: Vec<u32> = vec![NO_RANK; n];
    let mut heap = BinaryHeap::with_capacity(n);
    for i in 0..n - 1 {
        let rank = rank_of(ranks, &piece[i..i + 2]);
        pair[i] = rank;
        if rank != NO_RANK {
            heap.push(Reverse((rank, i)));
        }
    }

    let pair_rank = |next: &[usize], i: usize| -> u32 {
        let j = next[i];
        if j >= n {
            NO_RANK
        } else {
            rank_of(ranks, &piece[i..next[j]])
        }
    };

    while let Some(Reverse((rank, i))) = heap.pop() {
        if !alive[i] || pair[i] != rank {
            continue;
        }
        // Merge part i with its successor j.
        let j = next[i];
        alive[j] = false;
        next[i] = next[j];
        if next[j] < n {
            prev[next[j]] = i;
        }
        pair[i] = pair_rank(&next, i);
        if pair[i] != NO_RANK {
            heap.push(Reverse((pair[i], i)));
        }
        let p = prev[i];
        if p < n {
            pair[p] = pair_rank(&next, p);
            if pair[p] != NO_RANK {
                heap.push(Reverse((pair[p], p)));
            }
        }
    }

    let mut i = 0;
    while i < n {
        push_part(ranks, &piece[i..next[i]], out);
        i = next[i];
    }
}

/// Scalar reference: tiktoken's algorithm written as plainly as possible.
#[cfg(test)]
pub(crate) fn merge_ref(ranks: &Vocab, piece: &[u8]) -> Vec<u32> {
    let mut parts: Vec<Vec<u8>> = piece.iter().map(|&b| vec![b]).collect();
    loop {
        let best = (0..parts.len().saturating_sub(1))
            .map(|i| {
                (
                    rank_of(
                        ranks,
                        &[parts[i].as_slice(), parts[i + 1].as_slice()].concat(),
                    ),
                    i,
                )
            })
            .min();
        match best {
            Some((rank, i)) if rank != NO_RANK => {
                let right = parts.remove(i + 1);
                parts[i].extend(right);
            }
            _ => break,
        }
    }
    parts.iter().map(|p| rank_of(ranks, p)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small vocabulary with overlapping merges, to exercise tie-breaking.
    fn toy_ranks() -> Vocab {
        let mut ranks = RankMap::default();
        for b in 0..=255u8 {
            ranks.insert(vec![b].into_boxed_slice(), u32::from(b));
        }
        for (i, tok) in ["aa", "ab", "ba", "aaa", "aab", "abab", "bb", "aaaa", "abba"]
            .iter()
            .enumerate()
        {
            ranks.insert(tok.as_bytes().to_vec().into_boxed_slice(), 256 + i as u32);
        }
        Vocab::new(ranks)
    }

    #[test]
    fn scan_and_heap_agree_with_reference() {
        let ranks = toy_ranks();
        // Deterministic pseudo-random strings over {a, b} of many lengths.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for len in 1..400 {
            let piece: Vec<u8> = (0..len)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    if state & 1 == 0 { b'a' } else { b'b' }
                })
                .collect();
            let expected = merge_ref(&ranks, &piece);
            let mut scan = Vec::new();
            merge_scan(&ranks, &piece, &mut Vec::new(), &mut scan);
            let mut heap = Vec::new();
            merge_heap(&ranks, &piece, &mut heap);
            assert_eq!(
                scan,
                expected,
                "scan, piece {:?}",
                String::from_utf8_lossy(&piece)
            );
            assert_eq!(
                heap,
                expected,
                "heap, piece {:?}",
                String::from_utf8_lossy(&piece)
            );
        }
    }
}
