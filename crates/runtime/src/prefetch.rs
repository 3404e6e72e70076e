//! Look-ahead expert prefetch (`K3_PREFETCH`): the model guesses the next MoE layer's experts from the current
//! layer's input, and the store starts reading the guessed experts it does not hold, behind the reads already
//! queued, so the disk stays busy across the layer boundary. Landed experts wait here for their layer; a guessed
//! expert that is still being read when its layer asks for it is waited for rather than read twice. Recall and
//! wasted reads are counted.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use deltafin_model::ExpertWeights;

/// `on`/`off` (also `1`/`0`, `true`/`false`, `yes`/`no`, any case); `None` for anything else.
pub fn parse_on_off(s: &str) -> Option<bool> {
    match s.to_ascii_lowercase().as_str() {
        "on" | "1" | "true" | "yes" => Some(true),
        "off" | "0" | "false" | "no" => Some(false),
        _ => None,
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
    /// Prefetch reads whose expert was then asked for (the RAM cache counts these as misses: the token did read
    /// them, only earlier).
    pub used: u64,
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

/// What [`PrefetchState::claim`] found.
pub(crate) enum Claim {
    /// Read ahead of time: the weights.
    Landed(Arc<ExpertWeights>),
    /// Still being read (now marked as awaited).
    Pending,
    /// Not prefetched.
    Nothing,
}

/// Reads in flight, experts landed but not yet asked for, and experts a layer is waiting for.
#[derive(Debug, Default)]
struct Flight {
    pending: HashSet<(usize, usize)>,
    landed: HashMap<(usize, usize), Arc<ExpertWeights>>,
    awaited: HashSet<(usize, usize)>,
}

/// Shared between the store and its prefetch thread. Landed experts are held here (not in the RAM cache, which may
/// be too small or evict them) until their layer asks, and dropped when the layer did not want them. Locks are
/// taken in the order `guesses`, then `flight`.
#[derive(Debug, Default)]
pub(crate) struct PrefetchState {
    guesses: Mutex<HashMap<usize, Guess>>,
    flight: Mutex<Flight>,
    changed: Condvar,
    stats: Mutex<PrefetchStats>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Plain sets and counters: consistent between statements even if a holder panicked.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl PrefetchState {
    /// Records a guess for `layer`; `read` are the guessed experts that will be read (marked in flight here).
    pub fn record_guess(&self, layer: usize, guessed: &[usize], read: &[usize]) {
        let mut guesses = lock(&self.guesses);
        let old = guesses.insert(
            layer,
            Guess {
                guessed: guessed.to_vec(),
                read: read.iter().copied().collect(),
            },
        );
        let mut f = lock(&self.flight);
        // What an earlier guess for this layer left behind is stale now.
        f.landed.retain(|&(l, _), _| l != layer);
        f.pending.extend(read.iter().map(|&e| (layer, e)));
        drop(f);
        drop(guesses);
        let mut s = lock(&self.stats);
        s.guesses += 1;
        s.guessed += guessed.len() as u64;
        s.reads += read.len() as u64;
        // A guess that was never asked for (the layer was skipped) wasted its reads.
        if let Some(old) = old {
            s.wasted += old.read.len() as u64;
        }
    }

    /// Whether `(layer, expert)` is being read by the prefetcher.
    pub fn is_pending(&self, layer: usize, expert: usize) -> bool {
        lock(&self.flight).pending.contains(&(layer, expert))
    }

    /// Marks a prefetch read finished: `weights` when it succeeded, kept while its layer's guess is outstanding or
    /// the layer is waiting for it.
    pub fn finish(&self, layer: usize, expert: usize, weights: Option<Arc<ExpertWeights>>) {
        let outstanding = lock(&self.guesses)
            .get(&layer)
            .is_some_and(|g| g.read.contains(&expert));
        let mut f = lock(&self.flight);
        f.pending.remove(&(layer, expert));
        if let Some(w) = weights
            && (outstanding || f.awaited.contains(&(layer, expert)))
        {
            f.landed.insert((layer, expert), w);
        }
        drop(f);
        self.changed.notify_all();
    }

    /// The landed expert, if the prefetcher has it; its layer now owns it.
    pub fn take_landed(&self, layer: usize, expert: usize) -> Option<Arc<ExpertWeights>> {
        let mut f = lock(&self.flight);
        f.awaited.remove(&(layer, expert));
        f.landed.remove(&(layer, expert))
    }

    /// What the prefetcher has of `(layer, expert)` for its layer: the landed weights (handed over), `Pending`
    /// (marked as awaited, so it is kept when it lands: wait, then take it), or nothing. One lock, so a read cannot
    /// land unseen in between.
    pub fn claim(&self, layer: usize, expert: usize) -> Claim {
        let mut f = lock(&self.flight);
        if let Some(w) = f.landed.remove(&(layer, expert)) {
            return Claim::Landed(w);
        }
        if f.pending.contains(&(layer, expert)) {
            f.awaited.insert((layer, expert));
            return Claim::Pending;
        }
        Claim::Nothing
    }

    /// Blocks until `(layer, expert)` is no longer being read.
    pub fn wait(&self, layer: usize, expert: usize) {
        let mut f = lock(&self.flight);
        while f.pending.contains(&(layer, expert)) {
            f = self.changed.wait(f).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Scores `layer`'s guess against the experts it asked for, and drops landed guesses it did not ask for.
    pub fn score(&self, layer: usize, wanted: &[usize]) {
        let Some(g) = lock(&self.guesses).remove(&layer) else {
            return;
        };
        lock(&self.flight)
            .landed
            .retain(|&(l, e), _| l != layer || wanted.contains(&e));
        let mut s = lock(&self.stats);
        s.wanted += wanted.len() as u64;
        s.recalled += wanted.iter().filter(|e| g.guessed.contains(e)).count() as u64;
        let used = wanted.iter().filter(|e| g.read.contains(e)).count();
        s.used += used as u64;
        s.wasted += (g.read.len() - used) as u64;
    }

    /// The counters so far.
    pub fn stats(&self) -> PrefetchStats {
        *lock(&self.stats)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weights() -> Arc<ExpertWeights> {
        Arc::new(ExpertWeights::Dense {
            w1: vec![1.0],
            w2: vec![2.0],
            w3: vec![3.0],
        })
    }

    #[test]
    fn scores_recall_use_and_waste_and_keeps_only_wanted_experts() {
        let p = PrefetchState::default();
        // Guess 1, 2, 3; 3 was already cached, so only 1 and 2 are read.
        p.record_guess(4, &[1, 2, 3], &[1, 2]);
        assert!(p.is_pending(4, 1));
        p.finish(4, 1, Some(weights()));
        p.finish(4, 2, Some(weights()));
        // The layer asks for 2, 3, 9: recall 2 of 3, one read used, one wasted (and dropped).
        p.score(4, &[2, 3, 9]);
        assert!(p.take_landed(4, 2).is_some());
        assert!(
            p.take_landed(4, 1).is_none(),
            "an unwanted guess is dropped"
        );
        let s = p.stats();
        assert_eq!(
            (
                s.guesses, s.guessed, s.wanted, s.recalled, s.reads, s.used, s.wasted
            ),
            (1, 3, 3, 2, 2, 1, 1)
        );
        assert!((s.recall() - 2.0 / 3.0).abs() < 1e-12);
        // A layer without a guess is not scored.
        p.score(5, &[1]);
        assert_eq!(p.stats().wanted, 3);
    }

    #[test]
    fn a_read_landing_after_its_layer_asked_is_kept_only_if_awaited() {
        let p = PrefetchState::default();
        p.record_guess(0, &[7, 8], &[7, 8]);
        p.score(0, &[7]);
        assert!(matches!(p.claim(0, 7), Claim::Pending));
        p.finish(0, 7, Some(weights()));
        p.finish(0, 8, Some(weights()));
        assert!(p.take_landed(0, 7).is_some());
        assert!(
            p.take_landed(0, 8).is_none(),
            "not awaited, guess scored: dropped"
        );
    }

    #[test]
    fn wait_returns_once_the_read_finishes() {
        let p = std::sync::Arc::new(PrefetchState::default());
        p.record_guess(0, &[7], &[7]);
        let q = std::sync::Arc::clone(&p);
        let t = std::thread::spawn(move || q.finish(0, 7, None));
        p.wait(0, 7);
        t.join().expect("finisher thread");
        assert!(!p.is_pending(0, 7));
    }
}
