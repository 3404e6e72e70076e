//! The rate at which the read pool reads a run of expert spans, for benchmarks' storage bounds: the same read path
//! (direct I/O, the pool's queue depth) as the engine's reads, on bytes a benchmark can pick so that the bound and
//! the measurement it bounds do not read the same bytes (which a host's cache would then serve).

use std::sync::Arc;
use std::time::Instant;

use crate::error::Result;
use crate::experts::ExpertMap;
use crate::files::ModelFiles;
use crate::read_pool::{PoolFile, ReadPool, ReadPoolOptions, ReadRequest};

/// Reads `count` expert spans in map order starting at the `skip`-th (layer by layer, expert by expert; wrapping
/// around), all queued at once on a default read pool, and returns bytes per second (0 when the model has no
/// experts).
pub fn expert_spans_read_rate(
    files: &ModelFiles,
    map: &ExpertMap,
    skip: usize,
    count: usize,
) -> Result<f64> {
    let mut layers = map.layers();
    layers.sort_unstable();
    let spans: Vec<_> = layers
        .iter()
        .flat_map(|&l| (0..map.n_experts(l)).filter_map(move |e| map.get(l, e)))
        .collect();
    if spans.is_empty() || count == 0 {
        return Ok(0.0);
    }
    let mut handles: Vec<Option<Arc<PoolFile>>> = vec![None; files.shards().len()];
    let mut requests = Vec::with_capacity(count);
    for i in 0..count {
        let span = spans[(skip + i) % spans.len()];
        let file = match &handles[span.shard] {
            Some(f) => Arc::clone(f),
            None => {
                let f = Arc::new(PoolFile::open(&files.shards()[span.shard].path, true)?);
                handles[span.shard] = Some(Arc::clone(&f));
                f
            }
        };
        requests.push(ReadRequest {
            tag: i,
            file,
            offset: span.offset,
            len: span.len,
            expect_crc: None,
        });
    }
    let pool = ReadPool::new(&ReadPoolOptions::default())?;
    let started = Instant::now();
    let mut bytes = 0u64;
    for done in pool.submit(requests) {
        bytes += done.result?.len() as u64;
    }
    Ok(bytes as f64 / started.elapsed().as_secs_f64())
}
