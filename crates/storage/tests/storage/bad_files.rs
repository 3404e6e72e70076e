//! Broken checkpoints: each test damages a copy of a fixture on disk and checks that `open` (or a
//! read) fails with the right error, naming the file or tensor at fault.

use deltafin_storage::{ModelFiles, StorageError};
use serde_json::json;
use tempfile::TempDir;

use crate::common::{Broken, INDEX, K3_A, KL_QLORA, assert_names};

/// A K3 shard and an F32 tensor inside it.
const SHARD: &str = "model-00002-of-000007.safetensors";
const DT_BIAS: &str = "language_model.model.layers.1.self_attn.dt_bias";
/// Stored right before [`DT_BIAS`] in [`SHARD`].
const A_LOG: &str = "language_model.model.layers.1.self_attn.A_log";

#[test]
fn missing_shard_file() {
    let b = Broken::copy(K3_A);
    std::fs::remove_file(b.file("model-00003-of-000007.safetensors")).expect("remove shard");
    let e = b.open_err();
    assert!(matches!(e, StorageError::MissingShard { .. }), "{e}");
    assert_names(&e, &["model-00003-of-000007.safetensors", INDEX]);
}

#[test]
fn header_length_larger_than_file() {
    let b = Broken::copy(K3_A);
    let mut bytes = std::fs::read(b.file(SHARD)).expect("read shard");
    let too_long = bytes.len() as u64;
    bytes[..8].copy_from_slice(&too_long.to_le_bytes());
    std::fs::write(b.file(SHARD), bytes).expect("write shard");
    let e = b.open_err();
    assert!(matches!(e, StorageError::TruncatedHeader { .. }), "{e}");
    assert_names(&e, &[SHARD]);
}

#[test]
fn header_truncated_mid_json() {
    let b = Broken::copy(K3_A);
    let bytes = std::fs::read(b.file(SHARD)).expect("read shard");
    std::fs::write(b.file(SHARD), &bytes[..100]).expect("truncate shard");
    let e = b.open_err();
    assert!(matches!(e, StorageError::TruncatedHeader { .. }), "{e}");
    assert_names(&e, &[SHARD, "100"]);
}

#[test]
fn file_shorter_than_length_prefix() {
    let b = Broken::copy(KL_QLORA);
    std::fs::write(b.file("model.safetensors"), [1, 2, 3]).expect("write");
    let e = b.open_err();
    assert!(matches!(e, StorageError::TruncatedHeader { .. }), "{e}");
    assert_names(&e, &["model.safetensors"]);
}

#[test]
fn absurd_header_length() {
    let b = Broken::copy(KL_QLORA);
    let mut bytes = std::fs::read(b.file("model.safetensors")).expect("read");
    bytes[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(b.file("model.safetensors"), bytes).expect("write");
    let e = b.open_err();
    assert!(matches!(e, StorageError::HeaderTooLarge { .. }), "{e}");
    assert_names(&e, &["model.safetensors"]);
}

#[test]
fn header_not_json() {
    let b = Broken::copy(K3_A);
    let data = b.data_of(SHARD);
    b.write_shard(SHARD, b"{\"a\": not json at all", &data);
    let e = b.open_err();
    assert!(matches!(e, StorageError::HeaderJson { .. }), "{e}");
    assert_names(&e, &[SHARD, "not valid json"]);
}

#[test]
fn header_not_an_object() {
    let b = Broken::copy(K3_A);
    let data = b.data_of(SHARD);
    b.write_shard(SHARD, b"[1, 2, 3]", &data);
    let e = b.open_err();
    assert!(matches!(e, StorageError::HeaderNotObject { .. }), "{e}");
    assert_names(&e, &[SHARD]);
}

#[test]
fn entry_missing_a_field() {
    for field in ["dtype", "shape", "data_offsets"] {
        let b = Broken::copy(K3_A);
        b.edit_entry(DT_BIAS, |e| {
            e.remove(field);
        });
        let e = b.open_err();
        assert!(matches!(e, StorageError::BadEntry { .. }), "{e}");
        assert_names(&e, &[SHARD, DT_BIAS, &format!("no {field}")]);
    }
}

#[test]
fn entry_fields_of_the_wrong_type() {
    let cases = [
        ("dtype", json!(4)),
        ("shape", json!("64")),
        ("shape", json!([64, -1])),
        ("data_offsets", json!([96])),
        ("data_offsets", json!(["96", "352"])),
    ];
    for (field, value) in cases {
        let b = Broken::copy(K3_A);
        b.set_field(DT_BIAS, field, value.clone());
        let e = b.open_err();
        assert!(
            matches!(e, StorageError::BadEntry { .. }),
            "{field}={value}: {e}"
        );
        assert_names(&e, &[SHARD, DT_BIAS]);
    }
    let b = Broken::copy(K3_A);
    b.edit_header(SHARD, |h| {
        h.insert(DT_BIAS.to_string(), json!("F32"));
    });
    let e = b.open_err();
    assert!(matches!(e, StorageError::BadEntry { .. }), "{e}");
    assert_names(&e, &[DT_BIAS, "not a json object"]);
}

#[test]
fn data_offsets_out_of_order() {
    let b = Broken::copy(K3_A);
    let (begin, end) = b.offsets(DT_BIAS);
    b.set_field(DT_BIAS, "data_offsets", json!([end, begin]));
    let e = b.open_err();
    assert!(matches!(e, StorageError::BadOffsets { .. }), "{e}");
    assert_names(&e, &[SHARD, DT_BIAS, "begin is after end"]);
}

#[test]
fn data_offsets_into_the_header() {
    let b = Broken::copy(K3_A);
    let (begin, end) = b.offsets(DT_BIAS);
    let len = (end - begin) as i64;
    b.set_field(DT_BIAS, "data_offsets", json!([-len, 0]));
    let e = b.open_err();
    assert!(matches!(e, StorageError::BadOffsets { .. }), "{e}");
    assert_names(&e, &[SHARD, DT_BIAS, "header"]);
}

#[test]
fn data_offsets_overlap_another_tensor() {
    let b = Broken::copy(K3_A);
    let (a_begin, _) = b.offsets(A_LOG);
    let (begin, end) = b.offsets(DT_BIAS);
    // Same length, so only the overlap is wrong.
    let shifted = a_begin + 4;
    b.set_field(
        DT_BIAS,
        "data_offsets",
        json!([shifted, shifted + end - begin]),
    );
    let e = b.open_err();
    assert!(matches!(e, StorageError::OverlappingTensors { .. }), "{e}");
    assert_names(&e, &[SHARD, A_LOG, DT_BIAS]);
}

#[test]
fn data_offsets_past_end_of_file() {
    let b = Broken::copy(K3_A);
    let data_len = b.data_of(SHARD).len() as u64;
    let (begin, end) = b.offsets(DT_BIAS);
    b.set_field(
        DT_BIAS,
        "data_offsets",
        json!([data_len - 4, data_len - 4 + end - begin]),
    );
    let e = b.open_err();
    assert!(matches!(e, StorageError::BadOffsets { .. }), "{e}");
    assert_names(&e, &[SHARD, DT_BIAS, "past the end of the file"]);
}

#[test]
fn file_truncated_after_header() {
    let b = Broken::copy(KL_QLORA);
    let path = b.file("model.safetensors");
    let bytes = std::fs::read(&path).expect("read");
    std::fs::write(&path, &bytes[..bytes.len() - 10]).expect("truncate");
    let e = b.open_err();
    assert!(matches!(e, StorageError::BadOffsets { .. }), "{e}");
    assert_names(&e, &["model.safetensors", "past the end of the file"]);
}

#[test]
fn byte_length_disagrees_with_shape() {
    let b = Broken::copy(K3_A);
    b.set_field(DT_BIAS, "shape", json!([65]));
    let e = b.open_err();
    assert!(matches!(e, StorageError::ByteLength { .. }), "{e}");
    assert_names(&e, &[SHARD, DT_BIAS, "256", "260"]);
}

#[test]
fn byte_length_disagrees_with_dtype() {
    let b = Broken::copy(KL_QLORA);
    b.set_field("lm_head.weight", "dtype", json!("BF16"));
    let e = b.open_err();
    assert!(matches!(e, StorageError::ByteLength { .. }), "{e}");
    assert_names(&e, &["model.safetensors", "lm_head.weight"]);
}

#[test]
fn shape_overflowing_u64() {
    let b = Broken::copy(K3_A);
    b.set_field(DT_BIAS, "shape", json!([u64::MAX, 2]));
    let e = b.open_err();
    assert!(matches!(e, StorageError::BadEntry { .. }), "{e}");
    assert_names(&e, &[DT_BIAS, "overflow"]);
}

#[test]
fn unknown_dtype() {
    let b = Broken::copy(K3_A);
    b.set_field(DT_BIAS, "dtype", json!("F8_E4M3"));
    let e = b.open_err();
    assert!(matches!(e, StorageError::UnknownDtype { .. }), "{e}");
    assert_names(&e, &[SHARD, DT_BIAS, "F8_E4M3"]);
}

#[test]
fn index_not_json() {
    let b = Broken::copy(K3_A);
    std::fs::write(b.file(INDEX), "{\"weight_map\": ").expect("write index");
    let e = b.open_err();
    assert!(matches!(e, StorageError::IndexJson { .. }), "{e}");
    assert_names(&e, &[INDEX]);
}

#[test]
fn index_malformed() {
    let cases = [
        (json!([1, 2]), "not a json object"),
        (json!("model.safetensors"), "not a json object"),
        (json!(null), "not a json object"),
        (json!({"metadata": {}}), "no weight_map"),
        (json!({"weight_map": ["a"]}), "weight_map is not an object"),
        (json!({"weight_map": "a"}), "weight_map is not an object"),
        (json!({"weight_map": {}}), "names no tensors"),
        (json!({"weight_map": {"x": 3}}), "weight_map entry for x"),
        (
            json!({"weight_map": {"y": {"shard": "a"}}}),
            "weight_map entry for y",
        ),
        (json!({"weight_map": {"z": null}}), "weight_map entry for z"),
    ];
    for (index, reason) in cases {
        let b = Broken::copy(K3_A);
        std::fs::write(b.file(INDEX), index.to_string()).expect("write index");
        let e = b.open_err();
        assert!(
            matches!(e, StorageError::IndexFormat { .. }),
            "{index}: {e}"
        );
        assert_names(&e, &[INDEX, reason]);
    }
}

/// Members of the index other than `weight_map` and `metadata`, of any shape and before or after it, are skipped:
/// the copy opens with the same tensors as the original.
#[test]
fn index_members_the_engine_does_not_read_are_skipped() {
    let b = Broken::copy(K3_A);
    let want: Vec<String> = ModelFiles::open(b.path())
        .expect("open the copy")
        .tensors()
        .map(|t| t.name.clone())
        .collect();
    b.edit_index(|i| {
        let map = i.as_object_mut().expect("an index object");
        let weight_map = map.remove("weight_map").expect("a weight_map");
        map.insert("a_list".into(), json!([1, {"b": [null, true, 2.5]}, "c"]));
        map.insert("weight_map".into(), weight_map);
        map.insert("zz_object".into(), json!({"weight_map": 7, "d": {"e": []}}));
    });
    let got: Vec<String> = ModelFiles::open(b.path())
        .expect("open with extra members")
        .tensors()
        .map(|t| t.name.clone())
        .collect();
    assert_eq!(got, want);
}

#[test]
fn index_puts_tensor_in_the_wrong_shard() {
    let b = Broken::copy(K3_A);
    let wrong = "model-00003-of-000007.safetensors";
    b.edit_index(|i| i["weight_map"][DT_BIAS] = json!(wrong));
    let e = b.open_err();
    assert!(matches!(e, StorageError::TensorNotInShard { .. }), "{e}");
    assert_names(&e, &[INDEX, DT_BIAS, wrong]);
}

#[test]
fn index_names_a_tensor_no_shard_has() {
    let b = Broken::copy(K3_A);
    let ghost = "language_model.model.layers.1.self_attn.ghost.weight";
    b.edit_index(|i| i["weight_map"][ghost] = json!(SHARD));
    let e = b.open_err();
    assert!(matches!(e, StorageError::TensorNotInShard { .. }), "{e}");
    assert_names(&e, &[ghost, SHARD]);
}

/// The reverse direction is tolerated: a shard tensor missing from the index is kept (and warned about).
#[test]
fn tensor_missing_from_index_is_kept() {
    let b = Broken::copy(K3_A);
    b.edit_index(|i| {
        i["weight_map"]
            .as_object_mut()
            .expect("weight_map object")
            .remove(DT_BIAS);
    });
    let files = b.open();
    let info = files.tensor(DT_BIAS).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(files.shards()[info.shard].file_name, SHARD);
}

#[test]
fn shard_names_outside_the_model_dir() {
    for name in [
        "/etc/model-00002-of-000007.safetensors",
        "../model-00002-of-000007.safetensors",
        "sub/../../model-00002-of-000007.safetensors",
    ] {
        let b = Broken::copy(K3_A);
        b.edit_index(|i| i["weight_map"][DT_BIAS] = json!(name));
        let e = b.open_err();
        assert!(
            matches!(e, StorageError::UnsafeShardName { .. }),
            "{name}: {e}"
        );
        assert_names(&e, &[INDEX, name]);
    }
}

#[test]
fn directory_without_model_files() {
    let dir = TempDir::new().expect("temp dir");
    let e = ModelFiles::open(dir.path()).expect_err("empty dir must not open");
    assert!(matches!(e, StorageError::NoModelFiles { .. }), "{e}");
    assert_names(&e, &[&dir.path().display().to_string()]);
}

#[test]
fn reads_outside_a_shard_are_refused() {
    let b = Broken::copy(KL_QLORA);
    let files = b.open();
    let file_len = files.shards()[0].file_len;
    let mut buf = vec![0u8; 16];

    let e = files
        .read_span(0, file_len - 8, 16, &mut buf)
        .expect_err("read past end");
    assert!(matches!(e, StorageError::OutOfRange { .. }), "{e}");
    assert_names(&e, &["model.safetensors"]);

    let e = files
        .read_span(0, u64::MAX, 16, &mut buf)
        .expect_err("overflowing read");
    assert!(matches!(e, StorageError::OutOfRange { .. }), "{e}");

    let e = files.read_span(1, 0, 16, &mut buf).expect_err("no shard 1");
    assert!(matches!(e, StorageError::OutOfRange { .. }), "{e}");
    assert_names(&e, &["shard 1"]);

    let e = files
        .read_span(0, 0, 8, &mut buf)
        .expect_err("buffer too big");
    assert!(matches!(e, StorageError::BufferSize { .. }), "{e}");

    // The header prefix itself is readable: spans are raw shard bytes.
    let mut prefix = [0u8; 8];
    files
        .read_span(0, 0, 8, &mut prefix)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(u64::from_le_bytes(prefix) + 8, files.shards()[0].data_start);
}

#[test]
fn read_of_a_file_that_shrank_after_open_fails_cleanly() {
    let b = Broken::copy(KL_QLORA);
    let files = b.open();
    let info = files
        .tensor("lm_head.weight")
        .unwrap_or_else(|e| panic!("{e}"))
        .clone();
    let path = b.file("model.safetensors");
    let bytes = std::fs::read(&path).expect("read");
    std::fs::write(&path, &bytes[..info.offset as usize]).expect("shrink");
    let e = files.read_tensor(&info).expect_err("short read");
    assert!(matches!(e, StorageError::Io { .. }), "{e}");
    assert_names(&e, &["model.safetensors"]);
}
