//! Look-ahead expert prefetch (`K3_PREFETCH`): the model guesses the next MoE layer's experts from the current
//! layer's input, and the store starts reading the guessed experts it does not hold, behind the reads already
//! queued, so the disk stays busy across the layer boundary. A guessed expert that is still being read when its
//! layer asks for it is waited for rather than read twice. Recall and wasted reads are counted.

use std::collections::{HashMap, HashSet};
use std::sync::{Condvar, Mutex, MutexGuard};

/// `on`/`off` for `K3_PREFETCH` (default off: a wrong guess costs a read the token did not need).
pub fn prefetch_from_env() -> crate::error::Result<bool> {
    match std::env::var("K3_PREFETCH") {
        Err(_) => Ok(false),
        Ok(v) => match v.to_ascii_lowercase().as_str() {
            "on" | "1" | "true" | "yes" => Ok(true),
            "off" | "0" | "false" | "no" => Ok(false),
            other => Err(crate::error::RuntimeError::Usage(format!(
                "K3_PREFETCH must be on or off, got `{other}`"
            ))),
        },
    }
}

/// What the prefetcher did, for the end-of-run report and the benchmark.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefetchStats {
    /// Layers a guess was made for.
    pub guesses: u64,
    /// Experts guessed (distinct per guess).
    pub guessed: u64,
    /// Experts the guessed layers then asked for.
    pub wanted: u64,
    /// Of those, how many were in the guess.
    pub recalled: u64,
    /// Prefetch reads issued (guessed experts not already held).
    pub reads: u64,
    /// Prefetch reads whose expert was then asked for.
    pub used: u64,
    /// Of the used ones, those that had already landed in the cache when asked for (the cache counted them as
    /// hits, though the token read them).
    pub used_landed: u64,
    /// Prefetch reads never asked for by their layer (bytes read for nothing).
    pub wasted: u64,
}

impl PrefetchStats {
    /// Share of the experts asked for that had been guessed.
    pub fn recall(&self) -> f64 {
        if self.wanted == 0 {
            0.0
        } else {
            self.recalled as f64 / self.wanted as f64
        }
    }
}

/// One layer's outstanding guess.
#[derive(Debug, Default)]
struct Guess {
    guessed: Vec<usize>,
    read: HashSet<usize>,
}

/// Shared between the store and its prefetch thread.
#[derive(Debug, Default)]
pub(crate) struct PrefetchState {
    /// (layer, expert) reads in flight.
    pending: Mutex<HashSet<(usize, usize)>>,
    landed: Condvar,
    guesses: Mutex<HashMap<usize, Guess>>,
    stats: Mutex<PrefetchStats>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Plain sets and counters: consistent between statements even if a holder panicked.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl PrefetchState {
    /// Records a guess for `layer`; `read` are the guessed experts that will be read (marked in flight here).
    pub fn record_guess(&self, layer: usize, guessed: &[usize], read: &[usize]) {
        {
            let mut pending = lock(&self.pending);
            pending.extend(read.iter().map(|&e| (layer, e)));
        }
        let mut s = lock(&self.stats);
        s.guesses += 1;
        s.guessed += guessed.len() as u64;
        s.reads += read.len() as u64;
        drop(s);
        let old = lock(&self.guesses).insert(
            layer,
            Guess {
                guessed: guessed.to_vec(),
                read: read.iter().copied().collect(),
            },
        );
        // A guess that was never asked for (the layer was skipped) wasted its reads.
        if let Some(old) = old {
            lock(&self.stats).wasted += old.read.len() as u64;
        }
    }

    /// Whether `(layer, expert)` is being read by the prefetcher.
    pub fn is_pending(&self, layer: usize, expert: usize) -> bool {
        lock(&self.pending).contains(&(layer, expert))
    }

    /// Marks a prefetch read finished (landed in the cache, or failed).
    pub fn finish(&self, layer: usize, expert: usize) {
        lock(&self.pending).remove(&(layer, expert));
        self.landed.notify_all();
    }

    /// Blocks until `(layer, expert)` is no longer being read.
    pub fn wait(&self, layer: usize, expert: usize) {
        let mut pending = lock(&self.pending);
        while pending.contains(&(layer, expert)) {
            pending = self.landed.wait(pending).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Scores `layer`'s guess against the experts it asked for; `cached` says which were already in the cache.
    pub fn score(&self, layer: usize, wanted: &[usize], cached: impl Fn(usize) -> bool) {
        let Some(g) = lock(&self.guesses).remove(&layer) else {
            return;
        };
        let mut s = lock(&self.stats);
        s.wanted += wanted.len() as u64;
        s.recalled += wanted.iter().filter(|e| g.guessed.contains(e)).count() as u64;
        let used: Vec<usize> = wanted
            .iter()
            .copied()
            .filter(|e| g.read.contains(e))
            .collect();
        s.used += used.len() as u64;
        s.used_landed += used
            .iter()
            .filter(|&&e| !self.is_pending(layer, e) && cached(e))
            .count() as u64;
        s.wasted += (g.read.len() - used.len()) as u64;
    }

    /// The counters so far.
    pub fn stats(&self) -> PrefetchStats {
        *lock(&self.stats)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scores_recall_use_and_waste() {
        let p = PrefetchState::default();
        // Guess 1, 2, 3; 3 was already cached, so only 1 and 2 are read.
        p.record_guess(4, &[1, 2, 3], &[1, 2]);
        assert!(p.is_pending(4, 1));
        p.finish(4, 1);
        p.finish(4, 2);
        // The layer asks for 2, 3, 9: recall 2 of 3, one read used (landed), one wasted.
        p.score(4, &[2, 3, 9], |e| e == 2 || e == 3);
        let s = p.stats();
        assert_eq!(
            (
                s.guesses,
                s.guessed,
                s.wanted,
                s.recalled,
                s.reads,
                s.used,
                s.used_landed,
                s.wasted
            ),
            (1, 3, 3, 2, 2, 1, 1, 1)
        );
        assert!((s.recall() - 2.0 / 3.0).abs() < 1e-12);
        // A layer without a guess is not scored.
        p.score(5, &[1], |_| false);
        assert_eq!(p.stats().wanted, 3);
    }

    #[test]
    fn wait_returns_once_the_read_finishes() {
        let p = std::sync::Arc::new(PrefetchState::default());
        p.record_guess(0, &[7], &[7]);
        let q = std::sync::Arc::clone(&p);
        let t = std::thread::spawn(move || q.finish(0, 7));
        p.wait(0, 7);
        t.join().expect("finisher thread");
        assert!(!p.is_pending(0, 7));
    }
}
