//! Malformed checkpoints and configs give a clear error naming the file, tensor or key at fault, never a panic.
//! Each case damages a copy of the `k3-tiny-a` fixture on disk and opens it through the real engine.

use deltafin_runtime::{Engine, EngineOptions};
use deltafin_tests::corrupt::ScratchModel;
use deltafin_tests::fixture;

const LAYER1: &str = "language_model.model.layers.1.block_sparse_moe.experts";

fn scratch() -> ScratchModel {
    ScratchModel::copy_of(&fixture("k3/k3-tiny-a")).expect("copy fixture")
}

/// Opens the model and runs one token; returns the error text.
fn error_of(m: &ScratchModel) -> String {
    let result = Engine::open(&m.dir, EngineOptions::default())
        .and_then(|e| e.session().prefill(&[1, 2, 3]).map(|_| ()));
    match result {
        Ok(()) => panic!("a broken model at {} was accepted", m.dir.display()),
        Err(e) => e.to_string(),
    }
}

fn assert_mentions(err: &str, needles: &[&str]) {
    for n in needles {
        assert!(err.contains(n), "error `{err}` does not mention `{n}`");
    }
}

#[test]
fn missing_shard() {
    let m = scratch();
    std::fs::remove_file(m.path("model-00003-of-000007.safetensors")).expect("remove");
    assert_mentions(&error_of(&m), &["model-00003-of-000007.safetensors"]);
}

#[test]
fn truncated_header() {
    let m = scratch();
    let name = "model-00002-of-000007.safetensors";
    let bytes = std::fs::read(m.path(name)).expect("read");
    std::fs::write(m.path(name), &bytes[..100]).expect("truncate");
    assert_mentions(&error_of(&m), &[name]);
}

#[test]
fn non_json_header() {
    let m = scratch();
    let name = "model-00002-of-000007.safetensors";
    let mut bytes = std::fs::read(m.path(name)).expect("read");
    bytes[8..40].fill(b'#');
    std::fs::write(m.path(name), bytes).expect("write");
    assert_mentions(&error_of(&m), &[name]);
}

#[test]
fn data_offsets_past_end_of_file() {
    let m = scratch();
    let name = "model-00004-of-000007.safetensors";
    let bytes = std::fs::read(m.path(name)).expect("read");
    std::fs::write(m.path(name), &bytes[..bytes.len() - 64]).expect("truncate");
    assert_mentions(&error_of(&m), &[name]);
}

#[test]
fn unknown_dtype() {
    let m = scratch();
    let tensor = "language_model.model.layers.0.input_layernorm.weight";
    let shard = m.shard_of(tensor).expect("shard");
    let (mut header, data) = m.read_shard(&shard).expect("read");
    header[tensor]["dtype"] = "Q4_K".into();
    m.write_shard(&shard, &header, &data).expect("write");
    assert_mentions(&error_of(&m), &[tensor, "Q4_K"]);
}

#[test]
fn wrong_shape_for_the_config() {
    let m = scratch();
    m.edit_config(|c| c["text_config"]["kv_lora_rank"] = 20.into())
        .expect("edit");
    assert_mentions(
        &error_of(&m),
        &["layers.3.self_attn.kv_b_proj.weight", "expected shape"],
    );
}

#[test]
fn e8m0_scale_byte_255() {
    let m = scratch();
    // Every expert of layer 1 gets a NaN scale, so whichever the router picks fails.
    let shard = m
        .shard_of(&format!("{LAYER1}.0.w1.weight_scale"))
        .expect("shard");
    let (header, mut data) = m.read_shard(&shard).expect("read");
    for e in 0..16 {
        let offsets = &header[format!("{LAYER1}.{e}.w1.weight_scale")]["data_offsets"];
        let start = offsets[0].as_u64().expect("offset") as usize;
        data[start] = 255;
    }
    m.write_shard(&shard, &header, &data).expect("write");
    assert_mentions(&error_of(&m), &["layer 1 expert", "255"]);
}

#[test]
fn expert_tensors_not_contiguous() {
    let m = scratch();
    let (a, b) = (
        format!("{LAYER1}.3.w1.weight_scale"),
        format!("{LAYER1}.3.w3.weight_scale"),
    );
    let shard = m.shard_of(&a).expect("shard");
    let (mut header, data) = m.read_shard(&shard).expect("read");
    let offs_a = header[&a]["data_offsets"].clone();
    header[&a]["data_offsets"] = header[&b]["data_offsets"].clone();
    header[&b]["data_offsets"] = offs_a;
    m.write_shard(&shard, &header, &data).expect("write");
    let err = error_of(&m);
    assert_mentions(&err, &["3"]);
    assert!(
        err.contains("contiguous") || err.contains("order"),
        "error `{err}` does not say the expert is out of order"
    );
}

#[test]
fn config_missing_a_required_key() {
    let m = scratch();
    m.edit_config(|c| {
        c["text_config"]
            .as_object_mut()
            .expect("object")
            .remove("num_experts");
    })
    .expect("edit");
    assert_mentions(&error_of(&m), &["config.json", "num_experts"]);
}

#[test]
fn config_not_json() {
    let m = scratch();
    std::fs::write(m.path("config.json"), b"{ not json").expect("write");
    assert_mentions(&error_of(&m), &["config.json", "JSON"]);
}

#[test]
fn token_outside_the_vocabulary() {
    let engine = Engine::open(&fixture("k3/k3-tiny-a"), EngineOptions::default()).expect("open");
    let err = engine
        .session()
        .prefill(&[1, 999_999])
        .expect_err("must fail");
    assert_mentions(&err.to_string(), &["999999"]);
}
