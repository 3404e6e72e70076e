//! Counting wrapper around an expert source: how many experts each layer requested, and which distinct ones.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use deltafin_model::weights::OnExperts;
use deltafin_model::{ExpertSource, ExpertWeights};

/// Expert requests per layer since the last reset.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExpertReadStats {
    /// Experts requested per layer (one per expert per call).
    pub reads: Vec<u64>,
    /// Distinct experts requested per layer.
    pub distinct: Vec<BTreeSet<usize>>,
}

impl ExpertReadStats {
    /// All reads over all layers.
    pub fn total_reads(&self) -> u64 {
        self.reads.iter().sum()
    }
}

/// Counts every request that passes through to `inner`.
pub struct CountingExperts<S> {
    inner: S,
    stats: Mutex<ExpertReadStats>,
}

impl<S> CountingExperts<S> {
    /// Wraps `inner` for a model of `n_layers` layers.
    pub fn new(inner: S, n_layers: usize) -> Self {
        Self {
            inner,
            stats: Mutex::new(ExpertReadStats {
                reads: vec![0; n_layers],
                distinct: vec![BTreeSet::new(); n_layers],
            }),
        }
    }

    /// A copy of the counters.
    pub fn stats(&self) -> ExpertReadStats {
        self.stats.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Zeroes the counters.
    pub fn reset(&self) {
        if let Ok(mut s) = self.stats.lock() {
            let n = s.reads.len();
            *s = ExpertReadStats {
                reads: vec![0; n],
                distinct: vec![BTreeSet::new(); n],
            };
        }
    }

    /// The wrapped source.
    pub fn inner(&self) -> &S {
        &self.inner
    }
}

impl<S> CountingExperts<S> {
    fn count(&self, layer: usize, experts: &[usize]) {
        if let Ok(mut s) = self.stats.lock()
            && layer < s.reads.len()
        {
            s.reads[layer] += experts.len() as u64;
            s.distinct[layer].extend(experts.iter().copied());
        }
    }
}

impl<S: ExpertSource> ExpertSource for CountingExperts<S> {
    fn load_experts(
        &self,
        layer: usize,
        experts: &[usize],
    ) -> deltafin_model::Result<Vec<Arc<ExpertWeights>>> {
        self.count(layer, experts);
        self.inner.load_experts(layer, experts)
    }

    fn for_each_expert(
        &self,
        layer: usize,
        experts: &[usize],
        on_expert: &mut OnExperts<'_>,
    ) -> deltafin_model::Result<()> {
        self.count(layer, experts);
        self.inner.for_each_expert(layer, experts, on_expert)
    }

    fn begin<'s>(
        &'s self,
        layer: usize,
        experts: &[usize],
    ) -> deltafin_model::Result<Box<dyn deltafin_model::ExpertFetch + 's>> {
        self.count(layer, experts);
        self.inner.begin(layer, experts)
    }

    fn wants_prefetch(&self) -> bool {
        self.inner.wants_prefetch()
    }

    fn prefetch(&self, layer: usize, experts: &[usize]) -> deltafin_model::Result<()> {
        self.inner.prefetch(layer, experts)
    }
}
