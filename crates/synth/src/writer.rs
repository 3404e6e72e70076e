//! Writes a synthetic model: one shard per layer plus one for the embedding and head, the index, the config and
//! the tokenizer. Every file is written to a temporary name and renamed, so a crash leaves no half file behind.

use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use rand::{Rng, RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use serde_json::{Map, Value, json};

use crate::params::SynthParams;

/// The tokenizer every synthetic model ships (the toy K3 tokenizer: 556 ranks + 256 specials).
const TIKTOKEN: &[u8] = include_bytes!("../../../tests/fixtures/k3/k3-tiny-a/tiktoken.model");
const TOKENIZER_CONFIG: &[u8] =
    include_bytes!("../../../tests/fixtures/k3/k3-tiny-a/tokenizer_config.json");
/// Mergeable ranks of that tokenizer; the vocabulary adds 256 special slots.
const N_RANKS: usize = 556;
const BOS: usize = N_RANKS;
const EOS: usize = N_RANKS + 2;
const PAD: usize = crate::params::TOY_VOCAB - 1;
/// Random tensors larger than this are generated in pieces on every core (each piece seeded by its index).
const PIECE_BYTES: usize = 64 << 20;
/// In a sparse model, bf16 matrices with at least this many values are holes (except router, embedding, head).
const SPARSE_MIN_VALUES: usize = 1 << 22;

/// Experts generated in parallel before being written in order.
const EXPERT_BATCH: usize = 16;

/// A failure while writing a synthetic model.
#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    /// A file could not be written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The parameters describe an impossible model.
    #[error("invalid synthetic model: {0}")]
    Params(String),
}

type Result<T> = std::result::Result<T, SynthError>;

/// How a tensor's bytes are generated.
#[derive(Clone, Debug)]
enum Gen {
    /// bf16 uniform in ±a.
    Bf16 { a: f32 },
    /// bf16 `1 + uniform(±0.1)` (norm weights).
    Bf16Norm,
    /// f32 uniform in [lo, hi).
    F32 { lo: f32, hi: f32 },
    /// f32 uniform in [lo, hi) for the first `n` values, zeros after (padded `A_log`).
    F32Padded { lo: f32, hi: f32, n: usize },
    /// MXFP4 packed nibbles (uniform codes).
    Packed,
    /// E8M0 scales around `center`, jittered by one.
    Scales { center: u8 },
    /// Bytes computed beforehand.
    Bytes(Vec<u8>),
    /// One whole expert: six tensors back to back.
    Expert(Vec<Spec>),
    /// Zeros left as a file hole (sparse models): nothing is written.
    Hole,
}

#[derive(Clone, Debug)]
struct Spec {
    name: String,
    dtype: &'static str,
    shape: Vec<usize>,
    len: usize,
    fill: Gen,
}

fn seed_of(base: u64, name: &str) -> u64 {
    // FNV-1a over the name, mixed with the base seed.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ base;
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

fn generate(fill: &Gen, len: usize, rng: &mut ChaCha8Rng) -> Vec<u8> {
    match fill {
        Gen::Bf16 { a } => (0..len / 2)
            .flat_map(|_| half::bf16::from_f32(rng.random_range(-*a..*a)).to_le_bytes())
            .collect(),
        Gen::Bf16Norm => (0..len / 2)
            .flat_map(|_| half::bf16::from_f32(1.0 + rng.random_range(-0.1f32..0.1)).to_le_bytes())
            .collect(),
        Gen::F32 { lo, hi } => (0..len / 4)
            .flat_map(|_| rng.random_range(*lo..*hi).to_le_bytes())
            .collect(),
        Gen::F32Padded { lo, hi, n } => (0..len / 4)
            .flat_map(|i| {
                let v = if i < *n {
                    rng.random_range(*lo..*hi)
                } else {
                    0.0f32
                };
                v.to_le_bytes()
            })
            .collect(),
        Gen::Packed => {
            let mut v = vec![0u8; len];
            rng.fill_bytes(&mut v);
            v
        }
        Gen::Scales { center } => (0..len)
            .map(|_| {
                center
                    .saturating_add(rng.random_range(0u8..3))
                    .saturating_sub(1)
                    .min(254)
            })
            .collect(),
        Gen::Bytes(b) => b.clone(),
        Gen::Hole => vec![0; len],
        Gen::Expert(parts) => {
            let mut v = Vec::with_capacity(len);
            for part in parts {
                v.extend(generate(&part.fill, part.len, rng));
            }
            v
        }
    }
}

/// The E8M0 byte whose scale makes E2M1 weights have std ≈ 1/sqrt(fan_in).
fn scale_center(fan_in: usize) -> u8 {
    let target = (2.5 * (fan_in as f64).sqrt()).log2().round() as i32;
    (127 - target).clamp(1, 250) as u8
}

fn bf16_matrix(name: String, rows: usize, cols: usize) -> Spec {
    let a = (3.0 / cols as f32).sqrt();
    Spec {
        name,
        dtype: "BF16",
        shape: vec![rows, cols],
        len: rows * cols * 2,
        fill: Gen::Bf16 { a },
    }
}

fn bf16_norm(name: String, n: usize) -> Spec {
    Spec {
        name,
        dtype: "BF16",
        shape: vec![n],
        len: n * 2,
        fill: Gen::Bf16Norm,
    }
}

fn f32_vec(name: String, shape: Vec<usize>, lo: f32, hi: f32) -> Spec {
    let n: usize = shape.iter().product();
    Spec {
        name,
        dtype: "F32",
        shape,
        len: n * 4,
        fill: Gen::F32 { lo, hi },
    }
}

fn res_pair(prefix: String, h: usize) -> [Spec; 2] {
    [
        bf16_norm(format!("{prefix}_res_norm.weight"), h),
        Spec {
            name: format!("{prefix}_res_proj.weight"),
            dtype: "BF16",
            shape: vec![1, h],
            len: h * 2,
            fill: Gen::Bf16 { a: 0.05 },
        },
    ]
}

/// The non-expert tensors of layer `l`.
fn layer_specs(p: &SynthParams, l: usize) -> Vec<Spec> {
    let h = p.hidden;
    let pre = |s: &str| format!("language_model.model.layers.{l}.{s}");
    let mut v = vec![
        bf16_norm(pre("input_layernorm.weight"), h),
        bf16_norm(pre("post_attention_layernorm.weight"), h),
    ];
    v.extend(res_pair(pre("self_attention"), h));
    v.extend(res_pair(pre("mlp"), h));
    if p.mla_layers.contains(&(l + 1)) {
        let (nh, qk) = (p.mla_heads, p.nope + p.rope);
        v.push(bf16_matrix(pre("self_attn.q_a_proj.weight"), p.q_lora, h));
        v.push(bf16_norm(pre("self_attn.q_a_layernorm.weight"), p.q_lora));
        v.push(bf16_matrix(
            pre("self_attn.q_b_proj.weight"),
            nh * qk,
            p.q_lora,
        ));
        v.push(bf16_matrix(
            pre("self_attn.kv_a_proj_with_mqa.weight"),
            p.kv_lora + p.rope,
            h,
        ));
        v.push(bf16_norm(pre("self_attn.kv_a_layernorm.weight"), p.kv_lora));
        v.push(bf16_matrix(
            pre("self_attn.kv_b_proj.weight"),
            nh * (p.nope + p.v),
            p.kv_lora,
        ));
        v.push(bf16_matrix(pre("self_attn.g_proj.weight"), nh * p.v, h));
        v.push(bf16_matrix(pre("self_attn.o_proj.weight"), h, nh * p.v));
    } else {
        let (nh, d) = (p.kda_heads, p.kda_head_dim);
        let c = nh * d;
        for n in ["q_proj", "k_proj", "v_proj", "g_proj"] {
            v.push(bf16_matrix(pre(&format!("self_attn.{n}.weight")), c, h));
        }
        v.push(bf16_matrix(pre("self_attn.o_proj.weight"), h, c));
        for n in ["q_conv1d", "k_conv1d", "v_conv1d"] {
            v.push(f32_vec(
                pre(&format!("self_attn.{n}.weight")),
                vec![c, 1, 4],
                -0.5,
                0.5,
            ));
        }
        v.push(bf16_matrix(pre("self_attn.f_a_proj.weight"), d, h));
        v.push(bf16_matrix(pre("self_attn.f_b_proj.weight"), c, d));
        v.push(bf16_matrix(pre("self_attn.b_proj.weight"), nh, h));
        let pad = (nh + 1).next_power_of_two();
        v.push(Spec {
            name: pre("self_attn.A_log"),
            dtype: "F32",
            shape: vec![pad],
            len: pad * 4,
            fill: Gen::F32Padded {
                lo: 0.0,
                hi: 2.7,
                n: nh,
            },
        });
        v.push(f32_vec(pre("self_attn.dt_bias"), vec![c], -1.0, 1.0));
        v.push(f32_vec(pre("self_attn.o_norm.weight"), vec![d], 0.9, 1.1));
    }
    if l == 0 {
        v.push(bf16_matrix(pre("mlp.gate_proj.weight"), p.dense_inter, h));
        v.push(bf16_matrix(pre("mlp.up_proj.weight"), p.dense_inter, h));
        v.push(bf16_matrix(pre("mlp.down_proj.weight"), h, p.dense_inter));
    } else {
        let moe = |s: &str| pre(&format!("block_sparse_moe.{s}"));
        let sh = p.shared * p.moe_inter;
        v.push(bf16_matrix(moe("gate.weight"), p.experts, h));
        v.push(f32_vec(
            moe("gate.e_score_correction_bias"),
            vec![p.experts],
            -0.01,
            0.01,
        ));
        v.push(bf16_matrix(
            moe("routed_expert_down_proj.weight"),
            p.latent,
            h,
        ));
        v.push(bf16_norm(moe("routed_expert_norm.weight"), p.latent));
        v.push(bf16_matrix(
            moe("routed_expert_up_proj.weight"),
            h,
            p.latent,
        ));
        v.push(bf16_matrix(moe("shared_experts.gate_proj.weight"), sh, h));
        v.push(bf16_matrix(moe("shared_experts.up_proj.weight"), sh, h));
        v.push(bf16_matrix(moe("shared_experts.down_proj.weight"), h, sh));
    }
    if p.cycle > 0 {
        quiet_outputs(&mut v);
    }
    if p.sparse {
        make_sparse(&mut v);
    }
    v.sort_by(|a, b| a.name.cmp(&b.name));
    v
}

/// For cyclic models: shrinks every projection that writes into the residual stream, so the final hidden state
/// stays close to the token's embedding and the cyclic head decides the next token.
fn quiet_outputs(specs: &mut [Spec]) {
    const QUIET: f32 = 0.02;
    for s in specs.iter_mut() {
        let writes_residual = [
            "o_proj.weight",
            "down_proj.weight",
            "routed_expert_up_proj.weight",
        ]
        .iter()
        .any(|suffix| s.name.ends_with(suffix));
        if let (true, Gen::Bf16 { a }) = (writes_residual, &s.fill) {
            s.fill = Gen::Bf16 { a: a * QUIET };
        }
    }
}

/// Whether a spec is all hole (a hole, or an expert whose parts all are).
fn is_hole(s: &Spec) -> bool {
    match &s.fill {
        Gen::Hole => true,
        Gen::Expert(parts) => parts.iter().all(is_hole),
        _ => false,
    }
}

/// A spec's bytes: in one piece, or for a large random bf16 tensor in pieces of [`PIECE_BYTES`] generated on every
/// core, each from its own seed (so the bytes do not depend on the thread count).
fn generate_spec(seed: u64, s: &Spec) -> Vec<Vec<u8>> {
    let base = seed_of(seed, &s.name);
    if s.len <= PIECE_BYTES || !matches!(s.fill, Gen::Bf16 { .. }) {
        let mut rng = ChaCha8Rng::seed_from_u64(base);
        return vec![generate(&s.fill, s.len, &mut rng)];
    }
    let pieces: Vec<(usize, usize)> = (0..s.len)
        .step_by(PIECE_BYTES)
        .map(|at| (at, PIECE_BYTES.min(s.len - at)))
        .collect();
    pieces
        .par_iter()
        .map(|&(at, len)| {
            let mut rng =
                ChaCha8Rng::seed_from_u64(base ^ (at as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            generate(&s.fill, len, &mut rng)
        })
        .collect()
}

/// In a sparse model: every large matrix except the router, the embedding and the head becomes a hole.
fn make_sparse(specs: &mut [Spec]) {
    for s in specs.iter_mut() {
        let keep = s.name.ends_with("gate.weight") && s.name.contains("block_sparse_moe")
            || s.name.ends_with("embed_tokens.weight")
            || s.name.ends_with("lm_head.weight");
        if !keep && matches!(s.fill, Gen::Bf16 { .. }) && s.len / 2 >= SPARSE_MIN_VALUES {
            s.fill = Gen::Hole;
        }
    }
}

/// One expert of layer `l`: its six tensors in storage order, as one spec (a hole in a sparse model).
fn expert_spec(p: &SynthParams, l: usize, e: usize) -> Spec {
    let (lat, inn) = (p.latent, p.moe_inter);
    let pre = format!("language_model.model.layers.{l}.block_sparse_moe.experts.{e}");
    let mut parts = Vec::new();
    for (w, rows, cols) in [("w1", inn, lat), ("w2", lat, inn), ("w3", inn, lat)] {
        parts.push(Spec {
            name: format!("{pre}.{w}.weight_packed"),
            dtype: "U8",
            shape: vec![rows, cols / 2],
            len: rows * cols / 2,
            fill: Gen::Packed,
        });
        parts.push(Spec {
            name: format!("{pre}.{w}.weight_scale"),
            dtype: "U8",
            shape: vec![rows, cols / 32],
            len: rows * cols / 32,
            fill: Gen::Scales {
                center: scale_center(cols),
            },
        });
    }
    let len = parts.iter().map(|x| x.len).sum();
    if p.sparse {
        for part in &mut parts {
            part.fill = Gen::Hole;
        }
    }
    Spec {
        name: pre,
        dtype: "U8",
        shape: Vec::new(),
        len,
        fill: Gen::Expert(parts),
    }
}

/// The tensors a spec puts in the header: itself, or an expert's six parts.
fn header_entries(s: &Spec) -> Vec<&Spec> {
    match &s.fill {
        Gen::Expert(parts) => parts.iter().collect(),
        _ => vec![s],
    }
}

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> SynthError + '_ {
    move |source| SynthError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes one shard from `specs`; experts (if any) follow the dense tensors in string order of their ids.
fn write_shard(path: &Path, seed: u64, specs: &[Spec], experts: &[Spec]) -> Result<u64> {
    let mut header = Map::new();
    let mut offset = 0usize;
    for s in specs.iter().chain(experts).flat_map(header_entries) {
        header.insert(
            s.name.clone(),
            json!({"dtype": s.dtype, "shape": s.shape, "data_offsets": [offset, offset + s.len]}),
        );
        offset += s.len;
    }
    header.insert("__metadata__".to_string(), json!({"format": "pt"}));
    let mut json = serde_json::to_vec(&Value::Object(header))
        .map_err(|e| SynthError::Params(e.to_string()))?;
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let tmp = path.with_extension("tmp");
    let file = File::create(&tmp).map_err(io_err(&tmp))?;
    let mut w = BufWriter::with_capacity(8 << 20, file);
    w.write_all(&(json.len() as u64).to_le_bytes())
        .map_err(io_err(&tmp))?;
    w.write_all(&json).map_err(io_err(&tmp))?;
    for s in specs {
        if is_hole(s) {
            w.seek(SeekFrom::Current(s.len as i64))
                .map_err(io_err(&tmp))?;
            continue;
        }
        for piece in generate_spec(seed, s) {
            w.write_all(&piece).map_err(io_err(&tmp))?;
        }
    }
    for batch in experts.chunks(EXPERT_BATCH) {
        if batch.iter().all(is_hole) {
            let len: usize = batch.iter().map(|s| s.len).sum();
            w.seek(SeekFrom::Current(len as i64))
                .map_err(io_err(&tmp))?;
            continue;
        }
        let bufs: Vec<Vec<u8>> = batch
            .par_iter()
            .map(|s| {
                let mut rng = ChaCha8Rng::seed_from_u64(seed_of(seed, &s.name));
                generate(&s.fill, s.len, &mut rng)
            })
            .collect();
        for b in bufs {
            w.write_all(&b).map_err(io_err(&tmp))?;
        }
    }
    w.flush().map_err(io_err(&tmp))?;
    let file = w.into_inner().map_err(|e| io_err(&tmp)(e.into_error()))?;
    // A hole at the end is not written: the length makes it.
    file.set_len((8 + json.len() + offset) as u64)
        .map_err(io_err(&tmp))?;
    drop(file);
    std::fs::rename(&tmp, path).map_err(io_err(path))?;
    Ok(offset as u64)
}

/// Replaces `lm_head` by `HEAD_GAIN ×` the embedding with rows permuted in cycles of `p.cycle`: the row of token
/// `j` is the embedding of the token before `j` in its cycle, so a hidden state close to `emb[t]` favours the next
/// token of `t`'s cycle.
fn cyclic_head(p: &SynthParams, specs: &mut [Spec]) {
    const HEAD_GAIN: f32 = 4.0;
    let h = p.hidden;
    let Some(embed) = specs
        .iter()
        .find(|s| s.name.ends_with("embed_tokens.weight"))
    else {
        return;
    };
    let emb: Vec<f32> = generate_spec(p.seed, embed)
        .concat()
        .chunks_exact(2)
        .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
        .collect();
    let k = p.cycle;
    let vocab = p.vocab;
    let mut head = Vec::with_capacity(embed.len);
    for j in 0..vocab {
        let base = j / k * k;
        let prev = (base + (j - base + k - 1) % k).min(vocab - 1);
        for d in 0..h {
            head.extend(half::bf16::from_f32(HEAD_GAIN * emb[prev * h + d]).to_le_bytes());
        }
    }
    if let Some(s) = specs
        .iter_mut()
        .find(|s| s.name.ends_with("lm_head.weight"))
    {
        s.fill = Gen::Bytes(head);
    }
}

fn config(p: &SynthParams) -> Value {
    let kda: Vec<usize> = (1..=p.layers)
        .filter(|l| !p.mla_layers.contains(l))
        .collect();
    json!({
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD,
        "tie_word_embeddings": false,
        "dtype": "bfloat16",
        "text_config": {
            "architectures": ["KimiLinearForCausalLM"],
            "model_type": "kimi_linear",
            "hidden_size": p.hidden,
            "num_hidden_layers": p.layers,
            "vocab_size": p.vocab,
            "intermediate_size": p.dense_inter,
            "hidden_act": "situ",
            "activation_situ_beta": 4.0,
            "activation_situ_linear_beta": 25.0,
            "linear_attn_config": {
                "full_attn_layers": p.mla_layers, "kda_layers": kda,
                "num_heads": p.kda_heads, "head_dim": p.kda_head_dim,
                "short_conv_kernel_size": 4, "gate_lower_bound": -5.0, "use_full_rank_gate": true
            },
            "num_attention_heads": p.mla_heads, "num_key_value_heads": p.mla_heads,
            "q_lora_rank": p.q_lora, "kv_lora_rank": p.kv_lora,
            "qk_nope_head_dim": p.nope, "qk_rope_head_dim": p.rope, "v_head_dim": p.v,
            "mla_use_nope": true, "mla_use_output_gate": true,
            "num_experts": p.experts, "num_experts_per_token": p.top_k,
            "moe_intermediate_size": p.moe_inter, "num_shared_experts": p.shared,
            "routed_expert_hidden_size": p.latent, "latent_moe_use_norm": true,
            "first_k_dense_replace": 1, "moe_layer_freq": 1, "moe_renormalize": true,
            "moe_router_activation_func": "sigmoid", "routed_scaling_factor": 1.0,
            "num_expert_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "use_grouped_topk": true,
            "attn_res_block_size": p.block,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 1048576,
            "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD,
            "tie_word_embeddings": false,
            "quantization_config": {
                "quant_method": "compressed-tensors",
                "format": "mxfp4-pack-quantized",
                "quantization_status": "compressed",
                "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"],
                    "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                        "symmetric": true, "scale_dtype": "torch.uint8", "dynamic": false}}},
                "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*"]
            }
        }
    })
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).map_err(io_err(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io_err(path))
}

/// Writes the model described by `p` into `out` (created if needed). Returns the total tensor bytes.
pub fn write_model(p: &SynthParams, out: &Path) -> Result<u64> {
    if !p.latent.is_multiple_of(32)
        || !p.moe_inter.is_multiple_of(32)
        || p.top_k == 0
        || p.top_k > p.experts
        || p.layers < 2
        || p.vocab < crate::params::TOY_VOCAB
    {
        return Err(SynthError::Params(
            "latent and moe_inter must be multiples of 32, 0 < top_k <= experts, layers >= 2, vocab >= 812"
                .to_string(),
        ));
    }
    std::fs::create_dir_all(out).map_err(io_err(out))?;
    let n_shards = p.layers + 1;
    let shard_name = |i: usize| format!("model-{i:05}-of-{n_shards:06}.safetensors");
    let mut weight_map = Map::new();
    let mut total = 0u64;
    for l in 0..p.layers {
        let specs = layer_specs(p, l);
        let mut ids: Vec<usize> = if l == 0 {
            Vec::new()
        } else {
            (0..p.experts).collect()
        };
        ids.sort_by_key(|e| e.to_string());
        let experts: Vec<Spec> = ids.iter().map(|&e| expert_spec(p, l, e)).collect();
        let file = shard_name(l + 1);
        for s in specs.iter().chain(&experts).flat_map(header_entries) {
            weight_map.insert(s.name.clone(), json!(file));
        }
        total += write_shard(&out.join(&file), p.seed, &specs, &experts)?;
    }
    let h = p.hidden;
    let mut last = vec![
        bf16_matrix(
            "language_model.model.embed_tokens.weight".to_string(),
            p.vocab,
            h,
        ),
        bf16_matrix("language_model.lm_head.weight".to_string(), p.vocab, h),
        bf16_norm("language_model.model.norm.weight".to_string(), h),
    ];
    last.extend(res_pair("language_model.model.output_attn".to_string(), h));
    if p.cycle > 0 {
        cyclic_head(p, &mut last);
    }
    last.sort_by(|a, b| a.name.cmp(&b.name));
    let file = shard_name(n_shards);
    for s in &last {
        weight_map.insert(s.name.clone(), json!(file));
    }
    total += write_shard(&out.join(&file), p.seed, &last, &[])?;
    let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    let pretty =
        |v: &Value| serde_json::to_vec_pretty(v).map_err(|e| SynthError::Params(e.to_string()));
    write_atomic(&out.join("model.safetensors.index.json"), &pretty(&index)?)?;
    write_atomic(&out.join("config.json"), &pretty(&config(p))?)?;
    write_atomic(&out.join("tiktoken.model"), TIKTOKEN)?;
    write_atomic(&out.join("tokenizer_config.json"), TOKENIZER_CONFIG)?;
    Ok(total)
}
