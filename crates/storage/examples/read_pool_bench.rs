//! Read-pool throughput on expert-sized spans at random offsets of a large file, for
//! `scripts/bench-read-pool.sh` (which runs fio on the same file for comparison).
//!
//! `read_pool_bench FILE SPAN_LEN THREADS SECONDS [MODE [PIECE_BYTES [HOLD]]]`: MODE `stream` (default) keeps
//! 2 × THREADS reads queued, like fio's constant queue depth; `layer` submits batches of 16 spans (a K3 layer's
//! experts) and waits for each batch. HOLD (`layer` mode, default 0) keeps the last HOLD spans read before their
//! buffers go back to the pool, as the engine's RAM expert cache does, so each read lands in a buffer last written
//! HOLD spans ago (out of every CPU cache once HOLD spans exceed it) instead of one just freed; timing starts once HOLD
//! spans are held. Offsets are random and not aligned (real expert spans are not), so every
//! read covers up to one extra 4 KiB block; only span bytes are counted. PIECE_BYTES (default 0: whole spans, one
//! request each, like fio's reads) splits spans over the workers as the engine does. Prints one line:
//! `GB/s=<x> reads=<n> bytes=<n> direct=<bool>`, in `layer` mode also the mean time from a batch's submission to its
//! first span and to its last.

use std::sync::Arc;
use std::sync::mpsc::channel;
use std::time::{Duration, Instant};

use deltafin_storage::{PoolFile, ReadPool, ReadPoolOptions, ReadRequest};

/// Experts per layer batch in `layer` mode (K3's top-16).
const LAYER_BATCH: usize = 16;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 4 {
        return Err(
            "usage: read_pool_bench FILE SPAN_LEN THREADS SECONDS [stream|layer [PIECE_BYTES]]"
                .into(),
        );
    }
    let path = std::path::PathBuf::from(&args[0]);
    let span: u64 = args[1].parse()?;
    let threads: usize = args[2].parse()?;
    let seconds: f64 = args[3].parse()?;
    let layer_mode = args.get(4).is_some_and(|m| m == "layer");
    let piece_bytes: usize = args.get(5).map_or(Ok(0), |p| p.parse())?;
    let hold: usize = args.get(6).map_or(Ok(0), |h| h.parse())?;
    let file = Arc::new(PoolFile::open(&path, true)?);
    let file_len = std::fs::metadata(&path)?.len();
    if file_len <= span {
        return Err("file shorter than one span".into());
    }
    let pool = ReadPool::new(&ReadPoolOptions {
        threads,
        max_idle_buffers: 2 * threads + LAYER_BATCH,
        buffer_hook: None,
        piece_bytes,
    })?;
    let mut seed = 0x2545_f491_4f6c_dd1du64 ^ std::process::id() as u64;
    let mut next_offset = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % (file_len - span)
    };
    let request = |tag: usize, offset: u64| ReadRequest {
        tag,
        file: Arc::clone(&file),
        offset,
        len: span,
        expect_crc: None,
    };
    let limit = Duration::from_secs_f64(seconds);
    // Spans held back from the pool (`HOLD`), oldest first.
    let mut held = std::collections::VecDeque::with_capacity(hold + LAYER_BATCH);
    if layer_mode {
        while held.len() < hold {
            let batch = (0..LAYER_BATCH)
                .map(|t| request(t, next_offset()))
                .collect();
            for done in pool.submit(batch) {
                held.push_back(done.result?);
            }
        }
    }
    let start = Instant::now();
    let mut bytes = 0u64;
    let mut reads = 0u64;
    let (mut first_s, mut last_s, mut batches) = (0.0, 0.0, 0u32);
    if layer_mode {
        while start.elapsed() < limit {
            let batch = (0..LAYER_BATCH)
                .map(|t| request(t, next_offset()))
                .collect();
            let submitted = Instant::now();
            for (i, done) in pool.submit(batch).enumerate() {
                let span = done.result?;
                bytes += span.len() as u64;
                reads += 1;
                if i == 0 {
                    first_s += submitted.elapsed().as_secs_f64();
                }
                if hold > 0 {
                    held.push_back(span);
                }
            }
            while held.len() > hold {
                held.pop_front();
            }
            last_s += submitted.elapsed().as_secs_f64();
            batches += 1;
        }
    } else {
        let (tx, rx) = channel();
        let depth = 2 * threads.max(1);
        pool.submit_to((0..depth).map(|t| request(t, next_offset())).collect(), &tx);
        let mut in_flight = depth;
        while in_flight > 0 {
            let done = rx.recv()?;
            bytes += done.result?.len() as u64;
            reads += 1;
            in_flight -= 1;
            if start.elapsed() < limit {
                pool.submit_to(vec![request(0, next_offset())], &tx);
                in_flight += 1;
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    print!(
        "GB/s={:.3} reads={reads} bytes={bytes} direct={}",
        bytes as f64 / secs / 1e9,
        file.is_direct()
    );
    if batches > 0 {
        let n = f64::from(batches);
        print!(
            " first_ms={:.2} last_ms={:.2}",
            first_s / n * 1e3,
            last_s / n * 1e3
        );
    }
    println!();
    Ok(())
}
