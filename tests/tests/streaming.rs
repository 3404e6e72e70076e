//! Streaming installs against a fake hub on 127.0.0.1 (`deltafin_tests::hub`): logits bit-identical to the full
//! install, one range request per distinct expert plus the spine spans, every injected fault survived with nothing
//! corrupt used, corrupt cache entries refetched, a SIGKILLed fetch resumed to completion, and the token kept to the
//! hub's own origin and out of errors and logs.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use deltafin_runtime::{Engine, EngineOptions};
use deltafin_storage::install::{SetupOptions, setup};
use deltafin_storage::{
    HubOptions, InstallMode, MANIFEST_FILE, NoProgress, SPINE_VERIFIED_FILE, STATE_DIR, Secret,
    SpanManifest, StorageError,
};
use deltafin_tests::hub::{FAKE_COMMIT, FakeHub, Fault};
use deltafin_tests::{Golden, fixture};
use serde_json::Value;

const REPO: &str = "moonshotai/Kimi-K3";
const REVISION: &str = "main";
const TOKEN: &str = "hf_TESTtokenNEVERprint3d";

/// Collects every log line of this test binary, to check that the token never appears.
fn log_buffer() -> Arc<Mutex<Vec<u8>>> {
    static BUF: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    BUF.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let writer = LogWriter(Arc::clone(&buf));
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new("debug"))
            .with_writer(move || writer.clone())
            .finish();
        // Only this function installs a subscriber; if it somehow failed, the log check sees an empty buffer
        // and the other checks still run.
        let _ = tracing::subscriber::set_global_default(subscriber);
        buf
    })
    .clone()
}

#[derive(Clone)]
struct LogWriter(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for LogWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn hub_opts(endpoint: &str, token: Option<&str>) -> HubOptions {
    HubOptions {
        endpoint: Some(endpoint.to_string()),
        token: Some(Secret::new(token.map(str::to_string))),
        max_in_flight: 4,
        max_attempts: 10,
        backoff: Duration::from_millis(5),
        idle_timeout: Duration::from_millis(700),
        connect_timeout: Duration::from_secs(5),
    }
}

fn k3b() -> PathBuf {
    fixture("k3/k3-tiny-b")
}

fn stream_setup(hub: &FakeHub, dest: &Path, token: Option<&str>) {
    let opts = SetupOptions {
        repo: REPO.to_string(),
        revision: REVISION.to_string(),
        dest: dest.to_path_buf(),
        mode: Some(InstallMode::Stream),
        hub: hub_opts(&hub.endpoint, token),
    };
    let report = setup(&opts, &NoProgress, &|_| {}).expect("stream setup");
    assert_eq!(report.mode, InstallMode::Stream);
    assert!(report.missing.experts > 0);
}

fn open(dir: &Path, hub: Option<&FakeHub>) -> Engine {
    let options = EngineOptions {
        ram_gb: Some(1.0),
        read_threads: None,
        hub: hub.map_or_else(HubOptions::default, |h| hub_opts(&h.endpoint, None)),
        ..EngineOptions::default()
    };
    Engine::open(dir, options).expect("engine opens")
}

fn golden_ids() -> Vec<u32> {
    Golden::load(&k3b())
        .expect("golden")
        .ids("input_ids")
        .expect("ids")
}

/// Logits of the full install, and how many distinct experts that prefill read.
fn full_reference() -> (Vec<f32>, u64) {
    static REF: OnceLock<(Vec<f32>, u64)> = OnceLock::new();
    REF.get_or_init(|| {
        let engine = open(&k3b(), None);
        let logits = engine
            .session()
            .prefill(&golden_ids())
            .expect("prefill")
            .data;
        let stats = engine.expert_stats();
        assert_eq!(
            stats.cache.evictions, 0,
            "budget large enough to count distinct experts"
        );
        (logits, stats.cache.misses)
    })
    .clone()
}

/// Spine spans computed independently from the fixture's headers: maximal runs of adjacent non-expert tensors.
fn count_spine_spans(dir: &Path) -> usize {
    let mut spans = 0;
    for entry in std::fs::read_dir(dir).expect("fixture dir") {
        let path = entry.expect("entry").path();
        if path.extension().is_none_or(|e| e != "safetensors")
            || path.ends_with("golden.safetensors")
        {
            continue;
        }
        let bytes = std::fs::read(&path).expect("shard");
        let n = u64::from_le_bytes(bytes[..8].try_into().expect("prefix")) as usize;
        let header: Value = serde_json::from_slice(&bytes[8..8 + n]).expect("header");
        let mut tensors: Vec<(u64, u64, bool)> = header
            .as_object()
            .expect("object")
            .iter()
            .filter(|(k, _)| *k != "__metadata__")
            .map(|(k, v)| {
                let o = &v["data_offsets"];
                let (a, b) = (o[0].as_u64().expect("a"), o[1].as_u64().expect("b"));
                (a, b, k.contains(".block_sparse_moe.experts."))
            })
            .filter(|(a, b, _)| b > a)
            .collect();
        tensors.sort();
        let mut prev: Option<(u64, bool)> = None;
        for (a, b, expert) in tensors {
            if !expert && prev != Some((a, false)) {
                spans += 1;
            }
            prev = Some((b, expert));
        }
    }
    spans
}

fn n_shards(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .expect("dir")
        .filter(|e| {
            e.as_ref()
                .is_ok_and(|e| e.file_name().to_string_lossy().starts_with("model-"))
        })
        .count()
}

/// Every sparse shard has its original length; returns how many shards were checked.
fn check_shard_lengths(dest: &Path) -> usize {
    let files = deltafin_storage::ModelFiles::open(dest).expect("files");
    for shard in files.shards() {
        let ours = std::fs::metadata(&shard.path).expect("sparse shard").len();
        let theirs = std::fs::metadata(k3b().join(&shard.file_name))
            .expect("original")
            .len();
        assert_eq!(ours, theirs, "{}", shard.file_name);
    }
    files.shards().len()
}

#[test]
fn stream_install_gives_identical_logits_with_one_request_per_expert() {
    let _logs = log_buffer();
    let hub = FakeHub::start(&k3b(), REPO, REVISION).expect("hub");
    let tmp = tempfile::tempdir().expect("tmp");
    let dest = tmp.path().join("Kimi-K3");
    stream_setup(&hub, &dest, None);
    let setup_ranges = hub.ranges_served().len();
    let shards = n_shards(&k3b());
    let spine = count_spine_spans(&k3b());
    // Two requests per shard header (the 8-byte length, then the JSON) plus one per spine span.
    assert_eq!(
        setup_ranges,
        2 * shards + spine,
        "range requests during setup"
    );
    // Every range request went through the hub's redirect to the CDN.
    assert!(hub.seen().iter().any(|s| s.status == 302));
    // The install is pinned to the commit the revision resolved to, and asks for that commit from then on.
    let info = deltafin_storage::InstallInfo::read(&dest)
        .expect("install.json")
        .expect("present");
    assert_eq!(info.commit.as_deref(), Some(FAKE_COMMIT));
    let pinned = format!("/{REPO}/resolve/{FAKE_COMMIT}/");
    assert!(
        hub.seen()
            .iter()
            .filter(|s| !s.cdn && s.range.is_some())
            .all(|s| s.path.starts_with(&pinned)),
        "range requests use the pinned commit"
    );

    hub.clear_seen();
    let (reference, distinct) = full_reference();
    let engine = open(&dest, Some(&hub));
    assert!(engine.missing_experts().is_some());
    let logits = engine
        .session()
        .prefill(&golden_ids())
        .expect("prefill")
        .data;
    assert!(
        logits == reference,
        "streamed logits differ from the full install's"
    );
    let ranges = hub.ranges_served();
    assert_eq!(
        ranges.len() as u64,
        distinct,
        "one range request per distinct expert"
    );
    assert!(
        hub.seen()
            .iter()
            .filter(|s| !s.cdn)
            .all(|s| s.path.starts_with(&pinned))
    );
    let mut unique: Vec<_> = ranges
        .iter()
        .map(|s| (s.path.clone(), s.range.clone()))
        .collect();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), ranges.len(), "no expert fetched twice");
    assert_eq!(engine.expert_stats().reader.fetched_spans, distinct);
    drop(engine);

    // A second engine on the same install reads the fetched experts from the disk cache: no new requests.
    hub.clear_seen();
    let engine = open(&dest, Some(&hub));
    let again = engine
        .session()
        .prefill(&golden_ids())
        .expect("prefill")
        .data;
    assert!(again == reference);
    assert!(
        hub.ranges_served().is_empty(),
        "cached experts are not fetched again"
    );
    assert_eq!(check_shard_lengths(&dest), shards);
}

#[test]
fn every_fault_is_survived_and_nothing_corrupt_is_used() {
    let _logs = log_buffer();
    let hub = FakeHub::start(&k3b(), REPO, REVISION).expect("hub");
    let tmp = tempfile::tempdir().expect("tmp");
    let dest = tmp.path().join("Kimi-K3");
    // Faults during setup (headers and spine) ...
    hub.inject(&[
        Fault::ResetMidBody,
        Fault::Status500,
        Fault::WrongContentRange,
    ]);
    stream_setup(&hub, &dest, None);
    // ... and during on-demand expert fetches.
    let faults = [
        Fault::ResetMidBody,
        Fault::Status500,
        Fault::Status416,
        Fault::ShortBody,
        Fault::WrongContentRange,
        Fault::Trickle,
        Fault::Stall,
    ];
    hub.inject(&faults);
    let (reference, _) = full_reference();
    let engine = open(&dest, Some(&hub));
    let logits = engine
        .session()
        .prefill(&golden_ids())
        .expect("prefill survives faults")
        .data;
    assert_eq!(hub.pending_faults(), 0, "every fault was served");
    assert!(logits == reference, "logits differ after faults");
    let applied: Vec<Fault> = hub.seen().iter().filter_map(|s| s.fault).collect();
    for f in faults {
        assert!(applied.contains(&f), "{f:?} applied");
    }
    drop(engine);
    // Every byte the cache recorded is the original byte.
    let manifest = SpanManifest::open(&dest.join(STATE_DIR).join(MANIFEST_FILE)).expect("manifest");
    assert!(!manifest.is_empty());
    let files = deltafin_storage::ModelFiles::open(&dest).expect("files");
    let map = deltafin_storage::ExpertMap::build(&files).expect("map");
    let mut spans = deltafin_storage::spine_spans(&files, &map);
    for layer in map.layers() {
        for e in 0..map.n_experts(layer) {
            let s = map.span(layer, e).expect("span");
            spans.push(deltafin_storage::SpanKey {
                shard: s.shard,
                offset: s.offset,
                len: s.len,
            });
        }
    }
    let mut verified = 0;
    for key in spans {
        if !manifest.contains(key) {
            continue;
        }
        let shard = &files.shards()[key.shard];
        let ours = std::fs::read(&shard.path).expect("ours");
        let theirs = std::fs::read(k3b().join(&shard.file_name)).expect("theirs");
        let r = key.offset as usize..(key.offset + key.len) as usize;
        assert!(
            ours[r.clone()] == theirs[r],
            "recorded span {key:?} differs from the original"
        );
        verified += 1;
    }
    assert!(verified > 0);
}

#[test]
fn corrupt_cache_entries_and_a_damaged_manifest_are_detected() {
    let _logs = log_buffer();
    let hub = FakeHub::start(&k3b(), REPO, REVISION).expect("hub");
    let tmp = tempfile::tempdir().expect("tmp");
    let dest = tmp.path().join("Kimi-K3");
    stream_setup(&hub, &dest, None);
    let (reference, _) = full_reference();
    {
        let engine = open(&dest, Some(&hub));
        engine.session().prefill(&golden_ids()).expect("prefill");
    }
    // Damage one cached expert's bytes (without touching the manifest), and tear the manifest's last record.
    let files = deltafin_storage::ModelFiles::open(&dest).expect("files");
    let map = deltafin_storage::ExpertMap::build(&files).expect("map");
    let layer = map.layers()[0];
    let span = map.span(layer, 0).expect("span").clone();
    let path = files.shards()[span.shard].path.clone();
    let mut bytes = std::fs::read(&path).expect("read");
    bytes[span.offset as usize + 17] ^= 0x5a;
    std::fs::write(&path, &bytes).expect("write");
    let manifest_path = dest.join(STATE_DIR).join(MANIFEST_FILE);
    let mut log = std::fs::read(&manifest_path).expect("manifest");
    let cut = log.len() - 5;
    log.truncate(cut);
    std::fs::write(&manifest_path, &log).expect("tear manifest");
    // Damage a spine byte too. The spine was verified at the first open and that was recorded, so the next open
    // would not read it back; without the record the open verifies the spine again and refetches the span.
    let spine = deltafin_storage::spine_spans(&files, &map)[0];
    let spine_path = files.shards()[spine.shard].path.clone();
    let mut sb = std::fs::read(&spine_path).expect("read");
    sb[spine.offset as usize] ^= 0x01;
    std::fs::write(&spine_path, &sb).expect("write");
    drop(files);
    std::fs::remove_file(dest.join(STATE_DIR).join(SPINE_VERIFIED_FILE))
        .expect("recorded verification");

    hub.clear_seen();
    let engine = open(&dest, Some(&hub));
    let logits = engine
        .session()
        .prefill(&golden_ids())
        .expect("prefill")
        .data;
    assert!(logits == reference, "logits after repairing the cache");
    let stats = engine.expert_stats();
    assert!(stats.reader.corrupt_spans >= 1, "{stats}");
    // The corrupt expert, the spine span and the expert whose record was torn were fetched again.
    let refetched = hub.ranges_served().len();
    assert!(refetched >= 3, "refetched {refetched}");
    assert!(
        refetched < 10,
        "only the damaged spans were fetched, not {refetched}"
    );
}

#[test]
fn the_spine_is_verified_once_and_the_verification_recorded() {
    let _logs = log_buffer();
    let hub = FakeHub::start(&k3b(), REPO, REVISION).expect("hub");
    let tmp = tempfile::tempdir().expect("tmp");
    let dest = tmp.path().join("Kimi-K3");
    stream_setup(&hub, &dest, None);
    let marker = dest.join(STATE_DIR).join(SPINE_VERIFIED_FILE);
    drop(open(&dest, Some(&hub)));
    let recorded = std::fs::read_to_string(&marker).expect("the verification is recorded");
    // With the record, a second open does not read the spine back: a span damaged on disk meanwhile goes unnoticed
    // (this is what not re-hashing the spine at every open means), and nothing is fetched.
    let files = deltafin_storage::ModelFiles::open(&dest).expect("files");
    let map = deltafin_storage::ExpertMap::build(&files).expect("map");
    let spine = deltafin_storage::spine_spans(&files, &map)[0];
    let spine_path = files.shards()[spine.shard].path.clone();
    drop(files);
    let original = std::fs::read(&spine_path).expect("read");
    let mut damaged = original.clone();
    damaged[spine.offset as usize] ^= 0x01;
    std::fs::write(&spine_path, &damaged).expect("write");
    hub.clear_seen();
    drop(open(&dest, Some(&hub)));
    assert!(
        hub.ranges_served().is_empty(),
        "a recorded verification is not repeated"
    );
    assert_eq!(std::fs::read_to_string(&marker).expect("record"), recorded);
    // A change to the spine's records (here: the record removed, as a forced check does) brings it back: the
    // damaged span is found and fetched again.
    std::fs::remove_file(&marker).expect("remove record");
    drop(open(&dest, Some(&hub)));
    assert_eq!(
        hub.ranges_served().len(),
        1,
        "the damaged span was fetched again"
    );
    assert_eq!(std::fs::read(&spine_path).expect("read"), original);
    assert_eq!(
        std::fs::read_to_string(&marker).expect("record again"),
        recorded
    );
}

#[test]
fn token_goes_only_to_the_hub_origin_and_never_into_errors_or_logs() {
    let logs = log_buffer();
    let hub = FakeHub::start(&k3b(), REPO, REVISION).expect("hub");
    let tmp = tempfile::tempdir().expect("tmp");
    let dest = tmp.path().join("Kimi-K3");
    stream_setup(&hub, &dest, Some(TOKEN));
    let seen = hub.seen();
    let bearer = format!("Bearer {TOKEN}");
    assert!(
        seen.iter()
            .any(|s| !s.cdn && s.authorization.as_deref() == Some(bearer.as_str()))
    );
    assert!(seen.iter().filter(|s| s.cdn).count() > 0);
    assert!(
        seen.iter().all(|s| !s.cdn || s.authorization.is_none()),
        "token sent to the cdn"
    );

    // Errors that name URLs: a missing file, a persistent 416, and a refused connection.
    let opts = hub_opts(&hub.endpoint, Some(TOKEN));
    let client = deltafin_storage::Hub::new(
        deltafin_storage::RepoRef {
            endpoint: hub.endpoint.clone(),
            repo: REPO.to_string(),
            revision: REVISION.to_string(),
        },
        &HubOptions {
            max_attempts: 2,
            ..opts.clone()
        },
    )
    .expect("client");
    let mut errors: Vec<String> = Vec::new();
    let e = client
        .get_range("absent.safetensors", 0, 8)
        .expect_err("404");
    errors.push(e.to_string());
    hub.inject(&[Fault::Status416, Fault::Status416]);
    let e = client
        .get_range("model-00001-of-000010.safetensors", 0, 8)
        .expect_err("416");
    assert!(matches!(e, StorageError::Http { .. }));
    errors.push(e.to_string());
    let dead = deltafin_storage::Hub::new(
        deltafin_storage::RepoRef {
            endpoint: "http://127.0.0.1:9".to_string(),
            repo: REPO.to_string(),
            revision: REVISION.to_string(),
        },
        &HubOptions {
            max_attempts: 1,
            ..opts
        },
    )
    .expect("client");
    errors.push(
        dead.get_range("config.json", 0, 8)
            .expect_err("refused")
            .to_string(),
    );
    errors.push(format!("{:?}", dead));
    for e in &errors {
        assert!(!e.contains(TOKEN), "token in error: {e}");
        assert!(e.contains("127.0.0.1"), "error names the url: {e}");
    }
    let text = String::from_utf8_lossy(&logs.lock().unwrap_or_else(|e| e.into_inner())).to_string();
    assert!(!text.contains(TOKEN), "token in logs");
}

#[test]
fn killed_fetch_resumes_and_completes_with_every_span_verified() {
    let hub = FakeHub::start(&k3b(), REPO, REVISION).expect("hub");
    let tmp = tempfile::tempdir().expect("tmp");
    let dest = tmp.path().join("Kimi-K3");
    stream_setup(&hub, &dest, None);
    let child_bin = env!("CARGO_BIN_EXE_fetch_child");
    let spawn = || {
        std::process::Command::new(child_bin)
            .arg(&dest)
            .arg(&hub.endpoint)
            .env("HF_TOKEN", TOKEN)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn fetch_child")
    };
    // Slow bodies, so the child is mid-download when it is killed.
    hub.set_slow(4);
    let before = hub.completed_ranges();
    let mut child = spawn();
    let deadline = Instant::now() + Duration::from_secs(60);
    while hub.completed_ranges() < before + 4 {
        assert!(Instant::now() < deadline, "child made no progress");
        assert!(
            child.try_wait().expect("poll").is_none(),
            "child ended early"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().expect("SIGKILL");
    let status = child.wait().expect("wait");
    assert!(!status.success());
    let stderr = deltafin_tests::hub::read_all(child.stderr.take().expect("stderr"));
    assert!(!stderr.contains(TOKEN), "token in the child's logs");

    let manifest_path = dest.join(STATE_DIR).join(MANIFEST_FILE);
    let partial = SpanManifest::open(&manifest_path).expect("manifest after kill");
    let after_kill = partial.len();
    drop(partial);

    hub.set_slow(0);
    let out = spawn().wait_with_output().expect("second run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "second run failed: {stderr}");
    assert!(!stderr.contains(TOKEN), "token in the child's logs");
    assert!(
        hub.seen()
            .iter()
            .any(|s| !s.cdn && s.authorization.as_deref() == Some(&format!("Bearer {TOKEN}")[..])),
        "the child used HF_TOKEN"
    );

    // Complete: nothing missing, more spans than after the kill, and every byte of every shard original.
    let files = deltafin_storage::ModelFiles::open(&dest).expect("files");
    let manifest = SpanManifest::open(&manifest_path).expect("manifest");
    assert!(manifest.len() > after_kill);
    let map = deltafin_storage::ExpertMap::build(&files).expect("map");
    for layer in map.layers() {
        for e in 0..map.n_experts(layer) {
            let s = map.span(layer, e).expect("span");
            let key = deltafin_storage::SpanKey {
                shard: s.shard,
                offset: s.offset,
                len: s.len,
            };
            let crc = manifest.crc_of(key).expect("every expert recorded");
            let mut buf = vec![0u8; s.len as usize];
            files
                .read_span(s.shard, s.offset, s.len, &mut buf)
                .expect("read");
            assert_eq!(crc32(&buf), crc, "layer {layer} expert {e} verifies");
        }
    }
    for shard in files.shards() {
        let ours = std::fs::read(&shard.path).expect("ours");
        let theirs = std::fs::read(k3b().join(&shard.file_name)).expect("theirs");
        assert!(
            ours == theirs,
            "{} is byte-identical after the fill",
            shard.file_name
        );
    }
    let dry = deltafin_storage::install::fetch_experts_all(
        &dest,
        None,
        true,
        &hub_opts(&hub.endpoint, None),
        &NoProgress,
    )
    .expect("dry run");
    assert_eq!(dry.experts, 0);
}

#[test]
fn full_setup_downloads_every_file_and_auto_mode_says_why() {
    let hub = FakeHub::start(&k3b(), REPO, REVISION).expect("hub");
    let tmp = tempfile::tempdir().expect("tmp");
    let dest = tmp.path().join("Kimi-K3");
    // A partial shard from an interrupted run is resumed, not restarted.
    std::fs::create_dir_all(&dest).expect("dest");
    let first = "model-00001-of-000010.safetensors";
    let original = std::fs::read(k3b().join(first)).expect("shard");
    std::fs::write(dest.join(format!("{first}.partial")), &original[..1000]).expect("partial");
    let said = Mutex::new(String::new());
    let opts = SetupOptions {
        repo: REPO.to_string(),
        revision: REVISION.to_string(),
        dest: dest.clone(),
        mode: None,
        hub: hub_opts(&hub.endpoint, None),
    };
    let report = setup(&opts, &NoProgress, &|s| {
        said.lock().expect("lock").push_str(s)
    })
    .expect("setup");
    assert_eq!(report.mode, InstallMode::Full);
    let said = said.into_inner().expect("said");
    assert!(said.contains("free"), "says why: {said}");
    assert!(
        hub.seen()
            .iter()
            .any(|s| s.range.as_deref() == Some("bytes=1000-"))
    );
    for name in [
        "config.json",
        "tiktoken.model",
        "tokenizer_config.json",
        first,
        "model-00010-of-000010.safetensors",
    ] {
        let a = std::fs::read(dest.join(name)).expect("ours");
        let b = std::fs::read(k3b().join(name)).expect("theirs");
        assert!(a == b, "{name} identical");
    }
    let (reference, _) = full_reference();
    let engine = open(&dest, None);
    assert!(engine.missing_experts().is_none());
    assert!(
        engine
            .session()
            .prefill(&golden_ids())
            .expect("prefill")
            .data
            == reference
    );
}

#[test]
fn shard_names_from_the_remote_index_are_validated() {
    let served = tempfile::tempdir().expect("tmp");
    for entry in std::fs::read_dir(k3b()).expect("fixture") {
        let entry = entry.expect("entry");
        std::fs::copy(entry.path(), served.path().join(entry.file_name())).expect("copy");
    }
    let index_path = served.path().join("model.safetensors.index.json");
    let mut index: Value =
        serde_json::from_slice(&std::fs::read(&index_path).expect("index")).expect("json");
    let first = index["weight_map"]
        .as_object()
        .and_then(|m| m.keys().next().cloned())
        .expect("a tensor");
    index["weight_map"][&first] = Value::String("../../escape.safetensors".to_string());
    std::fs::write(&index_path, serde_json::to_vec(&index).expect("encode")).expect("write");
    let hub = FakeHub::start(served.path(), REPO, REVISION).expect("hub");
    let tmp = tempfile::tempdir().expect("tmp");
    let opts = SetupOptions {
        repo: REPO.to_string(),
        revision: REVISION.to_string(),
        dest: tmp.path().join("m"),
        mode: Some(InstallMode::Stream),
        hub: hub_opts(&hub.endpoint, None),
    };
    let err = setup(&opts, &NoProgress, &|_| {}).expect_err("unsafe shard name");
    assert!(matches!(err, StorageError::UnsafeShardName { .. }), "{err}");
    assert!(!tmp.path().join("escape.safetensors").exists());
}

/// CRC-32 (IEEE), bitwise reference.
fn crc32(bytes: &[u8]) -> u32 {
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
