//! The RAM expert cache: decoded experts kept under a byte budget, evicted by frequency and recency.
//!
//! Routing is skewed: some experts are chosen far more often than others, and a token's experts repeat
//! in the next tokens. Plain LRU lets one long prompt flush the hot set; plain LFU never forgets an
//! expert that was hot an hour ago. So each entry counts its uses, every count is halved after as many
//! uses as the cache has entries times `AGING_PERIOD_FACTOR` (aging), and the victim is the entry with
//! the lowest count, the least recently used among equals. The victim search is a linear scan: a budget
//! of 20 GiB holds about 1,200 K3 experts, and one scan costs far less than the 17.5 MB read it avoids.

use std::collections::HashMap;
use std::sync::Arc;

use deltafin_model::ExpertWeights;

/// Counts are halved after `entries × AGING_PERIOD_FACTOR` uses.
const AGING_PERIOD_FACTOR: u64 = 8;

/// Counters of the cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Lookups that found the expert.
    pub hits: u64,
    /// Lookups that did not.
    pub misses: u64,
    /// Entries dropped to make room.
    pub evictions: u64,
    /// Bytes held now.
    pub bytes: u64,
    /// Entries held now.
    pub entries: u64,
    /// The byte budget.
    pub budget: u64,
}

impl CacheStats {
    /// Hits over lookups (0 when there were none).
    pub fn hit_rate(&self) -> f64 {
        let total = self.hits + self.misses;
        if total == 0 {
            0.0
        } else {
            self.hits as f64 / total as f64
        }
    }
}

struct Entry {
    weights: Arc<ExpertWeights>,
    bytes: u64,
    uses: u64,
    last_use: u64,
}

/// A byte-bounded map from (layer, expert) to decoded weights.
pub struct ExpertCache {
    budget: u64,
    /// Bytes of the budget lent out for now ([`ExpertCache::lend`]).
    lent: u64,
    entries: HashMap<(usize, usize), Entry>,
    clock: u64,
    since_aging: u64,
    stats: CacheStats,
}

impl std::fmt::Debug for ExpertCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertCache")
            .field("stats", &self.stats())
            .finish()
    }
}

/// Bytes an expert occupies in RAM.
pub fn weights_bytes(w: &ExpertWeights) -> u64 {
    match w {
        ExpertWeights::Mxfp4(p) => p.bytes.len() as u64,
        ExpertWeights::Dense { w1, w2, w3 } => ((w1.len() + w2.len() + w3.len()) * 4) as u64,
    }
}

impl ExpertCache {
    /// An empty cache that holds at most `budget` bytes (0 disables it).
    pub fn new(budget: u64) -> Self {
        Self {
            budget,
            lent: 0,
            entries: HashMap::new(),
            clock: 0,
            since_aging: 0,
            stats: CacheStats {
                budget,
                ..CacheStats::default()
            },
        }
    }

    /// The expert, if cached; counts a hit or a miss.
    pub fn get(&mut self, layer: usize, expert: usize) -> Option<Arc<ExpertWeights>> {
        self.tick();
        let now = self.clock;
        match self.entries.get_mut(&(layer, expert)) {
            Some(e) => {
                e.uses += 1;
                e.last_use = now;
                self.stats.hits += 1;
                Some(Arc::clone(&e.weights))
            }
            None => {
                self.stats.misses += 1;
                None
            }
        }
    }

    /// Lends `bytes` of the budget out (a long prefill pass's scratch), evicting the least used entries until the
    /// rest fits in what is left; `0` gives the budget back. Lending replaces any earlier loan.
    pub fn lend(&mut self, bytes: u64) {
        self.lent = bytes.min(self.budget);
        self.evict_to(self.budget - self.lent);
    }

    /// Evicts least-used-then-least-recent entries until at most `limit` bytes are held.
    fn evict_to(&mut self, limit: u64) {
        while self.stats.bytes > limit {
            let Some(victim) = self
                .entries
                .iter()
                .min_by_key(|(_, e)| (e.uses, e.last_use))
                .map(|(k, _)| *k)
            else {
                break;
            };
            if let Some(e) = self.entries.remove(&victim) {
                self.stats.bytes -= e.bytes;
                self.stats.evictions += 1;
            }
        }
    }

    /// Drops every entry (the counters stay).
    pub fn clear(&mut self) {
        self.entries.clear();
        self.stats.bytes = 0;
    }

    /// Whether the expert is cached (counts nothing, changes nothing).
    pub fn contains(&self, layer: usize, expert: usize) -> bool {
        self.entries.contains_key(&(layer, expert))
    }

    /// Adds an expert just loaded (after a miss), evicting others to stay within the budget. An expert
    /// larger than the whole budget is not kept.
    pub fn insert(&mut self, layer: usize, expert: usize, weights: Arc<ExpertWeights>) {
        let bytes = weights_bytes(&weights);
        let available = self.budget - self.lent;
        if bytes > available {
            return;
        }
        if let Some(old) = self.entries.remove(&(layer, expert)) {
            self.stats.bytes -= old.bytes;
        }
        self.evict_to(available - bytes);
        self.entries.insert(
            (layer, expert),
            Entry {
                weights,
                bytes,
                uses: 1,
                last_use: self.clock,
            },
        );
        self.stats.bytes += bytes;
    }

    /// Advances the use clock and halves every count once per aging period.
    fn tick(&mut self) {
        self.clock += 1;
        self.since_aging += 1;
        let period = (self.entries.len() as u64).max(1) * AGING_PERIOD_FACTOR;
        if self.since_aging >= period {
            self.since_aging = 0;
            for e in self.entries.values_mut() {
                e.uses /= 2;
            }
        }
    }

    /// Counters so far.
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            entries: self.entries.len() as u64,
            ..self.stats
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltafin_model::PackedExpert;

    fn expert(len: usize) -> Arc<ExpertWeights> {
        Arc::new(ExpertWeights::Mxfp4(
            PackedExpert::new(
                vec![0; len].into(),
                [0..0, 0..0, 0..0, 0..0, 0..0, 0..0],
                [(0, 32); 3],
            )
            .expect("empty matrices are valid"),
        ))
    }

    #[test]
    fn stays_within_budget_and_keeps_the_frequent() {
        let mut c = ExpertCache::new(300);
        for e in 0..3 {
            assert!(c.get(0, e).is_none());
            c.insert(0, e, expert(100));
        }
        // Expert 0 is used often, 1 and 2 once more each.
        for _ in 0..5 {
            assert!(c.get(0, 0).is_some());
        }
        assert!(c.get(0, 1).is_some());
        assert!(c.get(0, 2).is_some());
        // A newcomer evicts the least used, least recent: expert 1.
        assert!(c.get(0, 3).is_none());
        c.insert(0, 3, expert(100));
        let s = c.stats();
        assert_eq!(s.bytes, 300);
        assert_eq!(s.evictions, 1);
        assert!(c.get(0, 0).is_some());
        assert!(c.get(0, 1).is_none());
        assert!(c.get(0, 2).is_some());
    }

    #[test]
    fn aging_lets_a_formerly_hot_expert_go() {
        let mut c = ExpertCache::new(200);
        c.insert(0, 0, expert(100));
        for _ in 0..20 {
            c.get(0, 0);
        }
        c.insert(0, 1, expert(100));
        // Many uses of expert 1 while expert 0 sits idle: aging halves 0's count until 1 wins.
        for _ in 0..200 {
            c.get(0, 1);
        }
        c.insert(0, 2, expert(100));
        assert!(c.get(0, 1).is_some());
        assert!(c.get(0, 0).is_none());
    }

    #[test]
    fn zero_budget_caches_nothing() {
        let mut c = ExpertCache::new(0);
        c.insert(0, 0, expert(1));
        assert!(c.get(0, 0).is_none());
        assert_eq!(c.stats().bytes, 0);
    }

    #[test]
    fn a_loan_evicts_what_no_longer_fits_and_ends() {
        let mut c = ExpertCache::new(10_000);
        for e in 0..4 {
            c.insert(0, e, expert(2_000));
        }
        assert_eq!(c.stats().bytes, 8_000);
        c.lend(5_000);
        assert!(c.stats().bytes <= 5_000, "{:?}", c.stats());
        // While lent, an insert stays within what is left.
        c.insert(1, 0, expert(2_000));
        assert!(c.stats().bytes <= 5_000);
        c.insert(1, 1, expert(6_000));
        assert!(!c.contains(1, 1), "larger than what is left");
        c.lend(0);
        c.insert(1, 1, expert(6_000));
        assert!(c.contains(1, 1));
        assert!(c.stats().bytes <= 10_000);
    }
}
