//! The read pool against plain buffered reads of the same file: same bytes for aligned and unaligned
//! spans, spans that end at the end of the file, direct I/O where the filesystem allows it, and reused
//! buffers.
//!
//! The file lives under Cargo's target tmp dir (a real disk here), not in `/tmp`, which may be tmpfs
//! where `O_DIRECT` is refused.

use std::io::Write;
use std::sync::Arc;

use std::collections::BTreeMap;
use std::sync::Mutex;

use deltafin_storage::{
    BufferHook, PoolFile, ReadPool, ReadPoolOptions, ReadRequest, StorageError,
};

/// Deterministic pseudo-random bytes (xorshift), so a misplaced read cannot match by accident.
fn noise(len: usize, mut seed: u64) -> Vec<u8> {
    (0..len)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed as u8
        })
        .collect()
}

/// One request per `(offset, len)` of `spans`, tagged with its index.
fn requests(file: &Arc<PoolFile>, spans: &[(u64, u64)]) -> Vec<ReadRequest> {
    spans
        .iter()
        .enumerate()
        .map(|(tag, &(offset, len))| ReadRequest {
            tag,
            file: Arc::clone(file),
            offset,
            len,
            expect_crc: None,
        })
        .collect()
}

fn scratch_file(name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("read-pool");
    std::fs::create_dir_all(&dir).expect("scratch dir");
    let path = dir.join(name);
    let mut f = std::fs::File::create(&path).expect("create");
    f.write_all(bytes).expect("write");
    f.sync_all().expect("sync");
    path
}

/// Reads spans of a file through a pool of three workers (spans of two pieces or more split over them when
/// `piece_bytes` is not 0) and compares every byte with the file, twice.
fn check(direct: bool, name: &str, piece_bytes: usize) {
    // Odd length, so the last span ends off the 4096 grid.
    let data = noise(3 * 1024 * 1024 + 1234, 0x9e37_79b9_7f4a_7c15);
    let path = scratch_file(name, &data);
    let file = Arc::new(PoolFile::open(&path, direct).expect("open"));
    if direct {
        eprintln!("{}: direct = {}", path.display(), file.is_direct());
    }
    let pool = ReadPool::new(&ReadPoolOptions {
        threads: 3,
        max_idle_buffers: 8,
        buffer_hook: None,
        piece_bytes,
    })
    .expect("pool");
    let n = data.len() as u64;
    let spans: Vec<(u64, u64)> = vec![
        (0, 4096),
        (4096, 8192),
        (1, 10),
        (4095, 2),
        (12_345, 1_000_000),
        (n - 1, 1),
        (n - 777, 777),
        (n - 1_500_000, 1_500_000),
        (0, n),
    ];
    // Twice, so the second round reuses the first round's buffers.
    for round in 0..2 {
        let batch = requests(&file, &spans);
        let mut seen = 0;
        for done in pool.submit(batch) {
            let (offset, len) = spans[done.tag];
            let bytes = done.result.expect("read");
            assert_eq!(bytes.len() as u64, len, "round {round} span {offset}+{len}");
            assert!(
                bytes[..] == data[offset as usize..(offset + len) as usize],
                "round {round}: bytes differ for span {offset}+{len}"
            );
            seen += 1;
        }
        assert_eq!(seen, spans.len());
    }
    let stats = pool.stats();
    assert_eq!(stats.reads, 2 * spans.len() as u64);
    assert!(
        stats.buffers_allocated < stats.reads,
        "buffers are reused: {stats:?}"
    );
    if file.is_direct() {
        assert_eq!(stats.buffered_reads, 0, "{stats:?}");
        assert!(stats.device_bytes >= stats.bytes);
    } else {
        assert_eq!(stats.buffered_reads, stats.reads);
    }
    std::fs::remove_file(&path).expect("cleanup");
}

#[test]
fn direct_reads_match_buffered_reads() {
    check(true, "direct.bin", 0);
}

#[test]
fn buffered_reads_match() {
    check(false, "buffered.bin", 0);
}

/// Spans read in pieces by several workers give the same bytes: pieces of one page (spans of hundreds of pieces,
/// unaligned starts and a tail that ends off the page grid) and of 1 MiB.
#[test]
fn spans_read_in_pieces_match() {
    check(true, "pieces-4k.bin", 4096);
    check(true, "pieces-1m.bin", 1 << 20);
    check(false, "pieces-buffered.bin", 4096);
}

#[cfg(target_os = "linux")]
#[test]
fn direct_io_is_used_on_a_real_disk() {
    // The target dir is on the project's disk (ext4 here); tmpfs would refuse O_DIRECT and fall back,
    // which `check` covers.
    let path = scratch_file("probe.bin", &noise(8192, 1));
    let file = PoolFile::open(&path, true).expect("open");
    let fs_refuses = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags_direct()
        .open(&path)
        .is_err();
    assert_eq!(file.is_direct(), !fs_refuses);
    std::fs::remove_file(&path).expect("cleanup");
}

/// `custom_flags(O_DIRECT)` without a libc dependency in the test: 0o40000 on x86-64, 0o200000 on arm64.
#[cfg(target_os = "linux")]
trait DirectFlag {
    fn custom_flags_direct(&mut self) -> &mut Self;
}

#[cfg(target_os = "linux")]
impl DirectFlag for std::fs::OpenOptions {
    fn custom_flags_direct(&mut self) -> &mut Self {
        use std::os::unix::fs::OpenOptionsExt;
        #[cfg(target_arch = "aarch64")]
        const O_DIRECT: i32 = 0o200000;
        #[cfg(not(target_arch = "aarch64"))]
        const O_DIRECT: i32 = 0o40000;
        self.custom_flags(O_DIRECT)
    }
}

/// Records the buffers a pool maps and unmaps, as a GPU's page-locking hook would.
#[derive(Debug, Default)]
struct Recorder {
    /// Address -> length of the buffers mapped and not yet unmapped.
    live: Mutex<BTreeMap<usize, usize>>,
    mapped: Mutex<usize>,
    errors: Mutex<Vec<String>>,
}

impl BufferHook for Recorder {
    fn mapped(&self, addr: usize, len: usize) {
        *self.mapped.lock().expect("lock") += 1;
        if self.live.lock().expect("lock").insert(addr, len).is_some() {
            self.errors
                .lock()
                .expect("lock")
                .push(format!("{addr:#x} mapped twice"));
        }
    }
    fn unmapping(&self, addr: usize, len: usize) {
        if self.live.lock().expect("lock").remove(&addr) != Some(len) {
            self.errors
                .lock()
                .expect("lock")
                .push(format!("{addr:#x}+{len} unmapped unheard of"));
        }
    }
}

impl Recorder {
    /// Whether `bytes` lie inside one live buffer.
    fn holds(&self, bytes: &[u8]) -> bool {
        let start = bytes.as_ptr() as usize;
        let live = self.live.lock().expect("lock");
        live.range(..=start)
            .next_back()
            .is_some_and(|(&a, &l)| start + bytes.len() <= a + l)
    }
}

/// Every span lands in a buffer the hook was told of; each buffer is told once, and told again before it is
/// unmapped: when the pool's free list overflows and when the pool and the last bytes are dropped.
#[test]
fn the_buffer_hook_hears_of_every_buffer() {
    let data = noise(2 * 1024 * 1024 + 77, 11);
    let path = scratch_file("hook.bin", &data);
    let file = Arc::new(PoolFile::open(&path, true).expect("open"));
    let hook = Arc::new(Recorder::default());
    let pool = ReadPool::new(&ReadPoolOptions {
        threads: 2,
        max_idle_buffers: 1,
        buffer_hook: Some(hook.clone()),
        piece_bytes: 64 << 10,
    })
    .expect("pool");
    let n = data.len() as u64;
    let spans = [(0, n), (5, 3 << 20 >> 1), (n - 1000, 1000), (4096, 4096)];
    let mut kept = Vec::new();
    for round in 0..3 {
        let batch = requests(&file, &spans);
        // Hold every read of a round, so the free list (one buffer) overflows when they come back.
        let got: Vec<_> = pool.submit(batch).collect();
        for done in got {
            let (offset, len) = spans[done.tag];
            let bytes = done.result.expect("read");
            assert!(bytes[..] == data[offset as usize..(offset + len) as usize]);
            assert!(
                hook.holds(&bytes),
                "round {round}: span {offset}+{len} outside every hooked buffer"
            );
            kept.push(bytes);
        }
        if round < 2 {
            kept.clear();
        }
    }
    assert_eq!(
        *hook.mapped.lock().expect("lock") as u64,
        pool.stats().buffers_allocated
    );
    assert!(
        hook.errors.lock().expect("lock").is_empty(),
        "{:?}",
        hook.errors
    );
    drop(pool);
    assert!(
        !hook.live.lock().expect("lock").is_empty(),
        "the held spans keep their buffers"
    );
    drop(kept);
    assert!(
        hook.live.lock().expect("lock").is_empty(),
        "every buffer unmapped: {:?}",
        hook.live
    );
    assert!(
        hook.errors.lock().expect("lock").is_empty(),
        "{:?}",
        hook.errors
    );
    std::fs::remove_file(&path).expect("cleanup");
}

#[test]
fn crc_mismatch_is_reported() {
    let data = noise(10_000, 7);
    let path = scratch_file("crc.bin", &data);
    let file = Arc::new(PoolFile::open(&path, true).expect("open"));
    // Whole, and in pieces of a page (the span is then three pieces).
    for piece_bytes in [0, 4096] {
        let pool = ReadPool::new(&ReadPoolOptions {
            piece_bytes,
            ..ReadPoolOptions::default()
        })
        .expect("pool");
        let good = crc32fast_like(&data[100..9100]);
        let req = |crc| ReadRequest {
            tag: 0,
            file: Arc::clone(&file),
            offset: 100,
            len: 9000,
            expect_crc: Some(crc),
        };
        let ok: Vec<_> = pool.submit(vec![req(good)]).collect();
        assert!(ok[0].result.is_ok(), "pieces of {piece_bytes}");
        let bad: Vec<_> = pool.submit(vec![req(good ^ 1)]).collect();
        assert!(
            matches!(bad[0].result, Err(StorageError::CorruptSpan { .. })),
            "pieces of {piece_bytes}"
        );
    }
    std::fs::remove_file(&path).expect("cleanup");
}

/// CRC-32 (IEEE), bitwise: the reference the pool's SIMD CRC must agree with.
fn crc32fast_like(bytes: &[u8]) -> u32 {
    let mut crc = 0xffff_ffffu32;
    for &b in bytes {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xedb8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}
