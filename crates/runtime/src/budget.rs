//! [`MemoryPlan`]: how the engine's memory budget (`K3_RAM_GB`) is spent. Everything the engine keeps in memory
//! is charged to it, not only weights: the resident spine, the streamed layers in flight, the session's attention
//! state at its reserved context, expert read buffers, compute scratch, and the expert cache, which gets what is
//! left. Layers are pinned (kept resident) only after the rest has its share, so a budget that fits on paper fits
//! in the process too.

use deltafin_model::{AttnKind, ModelConfig};

use crate::error::{Result, RuntimeError};
use crate::pinning::PinLayers;
use crate::spine_batch::READ_AHEAD_LAYERS;

/// Streamed layers in memory at once: the one computing, the next one built and waiting, and the reads ahead.
pub const STREAMED_LAYERS_IN_MEMORY: u64 = 2 + READ_AHEAD_LAYERS as u64;

/// Copies of the KDA states during a forward pass: the committed ones (kept for a rollback) and the new ones.
const KDA_STATE_COPIES: u64 = 2;

/// Activation rows of scratch per token of a prefill chunk, in units of the widest activation: the layer's
/// inputs and outputs, projections, the AttnRes bank and the MoE's per-expert rows. At K3's size a token's live
/// activations come to about 12 rows of the widest (the dense FFN's 33,792): KDA's raw and per-head q, k, v and
/// gate, the top-16 experts' gate, up and activation rows, MLA's queries and outputs; this leaves room for copies.
const SCRATCH_ROWS_PER_TOKEN: u64 = 24;

/// What the plan is computed from.
#[derive(Clone, Debug)]
pub struct PlanInputs<'a> {
    /// The budget in bytes.
    pub budget: u64,
    /// Spine bytes of each decoder layer, as served (bf16 shards or the int8 copy).
    pub layer_bytes: &'a [u64],
    /// The embedding table's bytes (kept resident only when every layer is).
    pub embed_bytes: u64,
    /// The rest of the always-resident spine: head, final norm, output mix.
    pub fixed_bytes: u64,
    /// Bytes of one routed expert as read (0 for a model without experts).
    pub expert_bytes: u64,
    /// Expert reads that can hold a buffer at once (in flight, landed and not yet multiplied, idle for reuse).
    pub expert_buffers: u64,
    /// Tokens of context reserved for a session.
    pub context: usize,
    /// Tokens per prefill pass.
    pub prefill_chunk: usize,
}

/// How the budget is spent, in bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryPlan {
    /// The budget.
    pub budget: u64,
    /// `true` per decoder layer kept resident.
    pub resident: Vec<bool>,
    /// Always-resident spine (head, final norm, output mix; the embedding when every layer is resident).
    pub fixed_spine: u64,
    /// Resident decoder layers.
    pub pinned_layers: u64,
    /// Streamed layers in flight.
    pub streaming: u64,
    /// The session's KDA states (two copies during a pass) and conv windows, and the MLA cache at the context.
    pub session_state: u64,
    /// Expert read buffers outside the cache.
    pub expert_reads: u64,
    /// Activations and logits of a prefill chunk.
    pub scratch: u64,
    /// What is left for the expert cache.
    pub expert_cache: u64,
}

impl MemoryPlan {
    /// Everything but the expert cache.
    pub fn committed(&self) -> u64 {
        self.fixed_spine
            + self.pinned_layers
            + self.streaming
            + self.session_state
            + self.expert_reads
            + self.scratch
    }

    /// Decoder layers streamed from disk at every forward pass.
    pub fn streamed(&self) -> usize {
        self.resident.iter().filter(|r| !**r).count()
    }
}

impl std::fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let g = |b: u64| b as f64 / GIB;
        write!(
            f,
            "{:.2} GiB: spine {:.2} resident ({} of {} layers pinned) + {:.2} streaming, session state {:.2}, \
             expert reads {:.2}, scratch {:.2}, expert cache {:.2}",
            g(self.budget),
            g(self.fixed_spine + self.pinned_layers),
            self.resident.len() - self.streamed(),
            self.resident.len(),
            g(self.streaming),
            g(self.session_state),
            g(self.expert_reads),
            g(self.scratch),
            g(self.expert_cache),
        )
    }
}

const GIB: f64 = (1u64 << 30) as f64;

/// Bytes of a session's state at `context` tokens, counting the KDA states twice (a pass writes new ones while the
/// committed ones are kept).
pub fn session_state_bytes(cfg: &ModelConfig, context: usize) -> u64 {
    let f = std::mem::size_of::<f32>() as u64;
    let (h, d) = (cfg.kda.n_heads as u64, cfg.kda.head_dim as u64);
    let kda_one = h * d * d * f + 3 * (cfg.kda.conv_kernel.saturating_sub(1) as u64) * h * d * f;
    let mla_row = (cfg.mla.kv_lora_rank + cfg.mla.rope_dim) as u64 * f;
    cfg.layer_kinds
        .iter()
        .map(|k| match k {
            AttnKind::Kda => KDA_STATE_COPIES * kda_one,
            AttnKind::Mla => context as u64 * mla_row,
        })
        .sum()
}

/// Logit rows a pass that returns every row's logits (`Session::prefill`, speculative verification) covers at most:
/// such passes are cut to this many tokens, so a long pass's scratch holds one row of logits per token of this
/// many, not of the whole pass.
pub const ALL_LOGITS_CHUNK: usize = 64;

/// Largest pass `auto` picks: beyond it a pass reads no fewer bytes for any model this engine runs (every expert of
/// a layer is already needed), and its scratch would only take memory from the expert cache.
const MAX_AUTO_CHUNK: usize = 4096;

/// The pass length whose scratch the memory plan reserves under `auto`; longer passes borrow the difference from the
/// expert cache while they run ([`auto_prefill_chunk`]).
pub const BASE_PREFILL_CHUNK: usize = 64;

/// `K3_PREFILL_CHUNK=auto`: the longest pass (a power of two from [`BASE_PREFILL_CHUNK`] up to `MAX_AUTO_CHUNK` and
/// the context) whose scratch beyond the reserved base pass's fits in three quarters of the expert cache's bytes,
/// `cache`. Such a pass shrinks the cache by that much while it runs, so the engine stays inside its budget, decode
/// keeps every pinned layer, and a long prompt still reads each streamed layer and each expert once per pass: while
/// a prompt is fed, a pass reads every expert it needs once per layer anyway, so the cache is worth least then.
pub fn auto_prefill_chunk(cfg: &ModelConfig, cache: u64, context: usize) -> usize {
    let base = scratch_bytes(cfg, BASE_PREFILL_CHUNK);
    let mut t = BASE_PREFILL_CHUNK;
    while t * 2 <= MAX_AUTO_CHUNK.min(context.max(BASE_PREFILL_CHUNK))
        && scratch_bytes(cfg, t * 2) - base <= cache / 4 * 3
    {
        t *= 2;
    }
    t
}

/// Scratch a pass of `tokens` needs beyond what the plan reserved for `reserved_chunk` tokens (0 when it needs no
/// more): what it borrows from the expert cache.
pub fn extra_scratch(cfg: &ModelConfig, tokens: usize, reserved_chunk: usize) -> u64 {
    scratch_bytes(cfg, tokens).saturating_sub(scratch_bytes(cfg, reserved_chunk))
}

/// Scratch of one prefill pass of `prefill_chunk` tokens: activation rows of the widest block per token, plus the
/// logits of the rows a pass returns (at most [`ALL_LOGITS_CHUNK`]).
pub fn scratch_bytes(cfg: &ModelConfig, prefill_chunk: usize) -> u64 {
    let widest = [
        cfg.hidden_size,
        cfg.kda.n_heads * cfg.kda.head_dim,
        cfg.intermediate_size,
        cfg.moe.n_shared * cfg.moe.inter,
        cfg.mla.n_heads * (cfg.mla.nope_dim + cfg.mla.rope_dim + cfg.mla.v_dim),
    ]
    .into_iter()
    .max()
    .unwrap_or(0) as u64;
    let t = prefill_chunk.max(1) as u64;
    let logit_rows = t.min(ALL_LOGITS_CHUNK as u64);
    4 * (logit_rows * cfg.vocab_size as u64 + t * SCRATCH_ROWS_PER_TOKEN * widest)
}

/// Spends `inputs.budget` as `pins` asks: under [`PinLayers::Auto`] every layer stays resident if everything fits,
/// else layers are pinned from layer 0 while the streaming that is left still fits, and a budget too small even to
/// stream every layer is refused with the least it needs. Explicit pins are honoured as given (the expert cache
/// then gets whatever remains, possibly nothing); `over` reports by how much they overrun the budget.
pub fn plan(
    inputs: &PlanInputs<'_>,
    cfg: &ModelConfig,
    pins: &PinLayers,
) -> Result<(MemoryPlan, u64)> {
    let n = inputs.layer_bytes.len();
    let session_state = session_state_bytes(cfg, inputs.context);
    let scratch = scratch_bytes(cfg, inputs.prefill_chunk);
    let expert_reads = inputs.expert_buffers * inputs.expert_bytes.next_multiple_of(2 << 20);
    let build = |resident: Vec<bool>| {
        let all = resident.iter().all(|&r| r);
        let streamed_max = (0..n)
            .filter(|&l| !resident[l])
            .map(|l| inputs.layer_bytes[l])
            .max()
            .unwrap_or(0);
        let pinned_layers = (0..n)
            .filter(|&l| resident[l])
            .map(|l| inputs.layer_bytes[l])
            .sum();
        MemoryPlan {
            budget: inputs.budget,
            fixed_spine: inputs.fixed_bytes + if all { inputs.embed_bytes } else { 0 },
            pinned_layers,
            streaming: STREAMED_LAYERS_IN_MEMORY * streamed_max,
            session_state,
            expert_reads,
            scratch,
            expert_cache: 0,
            resident,
        }
    };
    let finish = |mut p: MemoryPlan| {
        let over = p.committed().saturating_sub(p.budget);
        p.expert_cache = p.budget.saturating_sub(p.committed());
        (p, over)
    };
    let resident = match pins {
        PinLayers::Auto => {
            let all = build(vec![true; n]);
            if all.committed() <= inputs.budget {
                return Ok(finish(all));
            }
            // Pin the longest prefix of layers that still leaves room to stream the rest.
            let mut best = None;
            for k in 0..n {
                let p = build((0..n).map(|l| l < k).collect());
                if p.committed() > inputs.budget {
                    break;
                }
                best = Some(p);
            }
            let Some(p) = best else {
                let least = build(vec![false; n]);
                return Err(RuntimeError::Budget(format!(
                    "a memory budget of {:.2} GiB cannot run this model: with every layer streamed it still needs \
                     {:.2} GiB (spine always resident {:.2}, streamed layers in flight {:.2}, session state at \
                     {} tokens of context {:.2}, expert read buffers {:.2}, scratch {:.2}); raise K3_RAM_GB or \
                     lower K3_CONTEXT",
                    inputs.budget as f64 / GIB,
                    least.committed() as f64 / GIB,
                    least.fixed_spine as f64 / GIB,
                    least.streaming as f64 / GIB,
                    inputs.context,
                    least.session_state as f64 / GIB,
                    least.expert_reads as f64 / GIB,
                    least.scratch as f64 / GIB,
                )));
            };
            return Ok(finish(p));
        }
        other => other.resolve(inputs.layer_bytes, 0, u64::MAX)?,
    };
    Ok(finish(build(resident)))
}

/// On a GPU, the layers it streams that the host keeps in RAM (the host tier, uploaded from there at every pass).
/// The plan charged its pinned layers to the budget as host memory, but a layer the GPU holds keeps no host copy:
/// under [`PinLayers::Auto`] the tier takes the streamed layers, in order, while their bytes fit in what the plan
/// pinned (`plan.pinned_layers`), so the RAM goes where the GPU is short; explicit pins keep the streamed layers
/// they name. What the tier does not use of `plan.pinned_layers` is free for the expert cache.
pub fn host_tier(
    plan: &MemoryPlan,
    pins: &PinLayers,
    streamed: &[usize],
    layer_bytes: &[u64],
) -> Vec<usize> {
    if !matches!(pins, PinLayers::Auto) {
        return (streamed.iter().copied())
            .filter(|&l| plan.resident.get(l).copied().unwrap_or(false))
            .collect();
    }
    let mut left = plan.pinned_layers;
    let mut tier = Vec::new();
    for &l in streamed {
        let b = layer_bytes.get(l).copied().unwrap_or(u64::MAX);
        if b > left {
            break;
        }
        left -= b;
        tier.push(l);
    }
    tier
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k3() -> ModelConfig {
        let text = include_str!("../../../tests/fixtures/k3/k3-tiny-a/config.json");
        let mut v: serde_json::Value = serde_json::from_str(text).expect("fixture config");
        // The released K3 text configuration's sizes over the fixture's structure keys.
        let t = &mut v["text_config"];
        t["hidden_size"] = 7168.into();
        t["vocab_size"] = 163_840.into();
        t["intermediate_size"] = 33792.into();
        t["linear_attn_config"]["num_heads"] = 96.into();
        t["linear_attn_config"]["head_dim"] = 128.into();
        t["num_attention_heads"] = 96.into();
        t["kv_lora_rank"] = 512.into();
        t["qk_rope_head_dim"] = 64.into();
        t["qk_nope_head_dim"] = 128.into();
        t["v_head_dim"] = 128.into();
        t["moe_intermediate_size"] = 3072.into();
        ModelConfig::from_json_str(&v.to_string(), "config.json").expect("parses")
    }

    fn inputs(budget_gib: u64, layers: &[u64]) -> PlanInputs<'_> {
        PlanInputs {
            budget: budget_gib << 30,
            layer_bytes: layers,
            embed_bytes: 2 << 30,
            fixed_bytes: 2 << 30,
            expert_bytes: 17_547_264,
            expert_buffers: 40,
            context: 8192,
            prefill_chunk: 64,
        }
    }

    #[test]
    fn state_and_scratch_at_k3_size() {
        let cfg = k3();
        let kda = cfg
            .layer_kinds
            .iter()
            .filter(|k| **k == AttnKind::Kda)
            .count() as u64;
        // Two copies of 96 × 128 × 128 f32 per KDA layer, plus conv windows.
        let per_kda = 2 * (96 * 128 * 128 * 4 + 3 * 3 * 96 * 128 * 4);
        let mla = cfg.layer_kinds.len() as u64 - kda;
        assert_eq!(
            session_state_bytes(&cfg, 8192),
            kda * per_kda + mla * 8192 * 576 * 4
        );
        // The chunk's logits alone are 64 × 163,840 floats.
        assert!(scratch_bytes(&cfg, 64) > 64 * 163_840 * 4);
    }

    #[test]
    fn auto_chunk_borrows_at_most_three_quarters_of_the_cache() {
        let cfg = k3();
        let base = scratch_bytes(&cfg, BASE_PREFILL_CHUNK);
        for gib in [0u64, 1, 4, 16, 64, 1024] {
            let cache = gib << 30;
            let t = auto_prefill_chunk(&cfg, cache, 8192);
            assert!(
                t.is_power_of_two() && (BASE_PREFILL_CHUNK..=MAX_AUTO_CHUNK).contains(&t),
                "{gib}: {t}"
            );
            // This pass's extra scratch fits, the next power of two's would not (unless the cap stopped it).
            assert!(
                scratch_bytes(&cfg, t) - base <= cache / 4 * 3,
                "{gib} GiB cache: {t}"
            );
            assert!(t == MAX_AUTO_CHUNK || scratch_bytes(&cfg, 2 * t) - base > cache / 4 * 3);
            assert_eq!(
                extra_scratch(&cfg, t, BASE_PREFILL_CHUNK),
                scratch_bytes(&cfg, t) - base
            );
        }
        assert_eq!(auto_prefill_chunk(&cfg, 0, 8192), BASE_PREFILL_CHUNK);
        assert!(auto_prefill_chunk(&cfg, 16 << 30, 8192) > auto_prefill_chunk(&cfg, 1 << 30, 8192));
        // Never past the context.
        assert_eq!(auto_prefill_chunk(&cfg, 1 << 40, 256), 256);
        // A pass's logits count at most ALL_LOGITS_CHUNK rows: past them scratch grows by activations alone.
        let step =
            scratch_bytes(&cfg, 4 * ALL_LOGITS_CHUNK) - scratch_bytes(&cfg, 3 * ALL_LOGITS_CHUNK);
        assert_eq!(
            scratch_bytes(&cfg, 5 * ALL_LOGITS_CHUNK) - scratch_bytes(&cfg, 4 * ALL_LOGITS_CHUNK),
            step
        );
        assert_eq!(
            step,
            // The widest row at K3's size is the dense layer's 33,792-wide FFN activation.
            ALL_LOGITS_CHUNK as u64 * SCRATCH_ROWS_PER_TOKEN * 33_792 * 4
        );
    }

    #[test]
    fn everything_resident_when_it_fits() {
        let cfg = k3();
        let layers = vec![1 << 30; cfg.n_layers];
        let (p, over) = plan(&inputs(64, &layers), &cfg, &PinLayers::Auto).expect("fits");
        assert_eq!(over, 0);
        assert!(p.resident.iter().all(|&r| r));
        assert_eq!(p.streaming, 0);
        assert_eq!(p.fixed_spine, 4 << 30, "the embedding is resident");
        assert_eq!(p.committed() + p.expert_cache, p.budget);
    }

    #[test]
    fn streaming_is_paid_for_before_layers_are_pinned() {
        let cfg = k3();
        // A model whose layers do not all fit: 40 layers of 1 GiB in a 16 GiB budget.
        let layers = vec![1 << 30; 40];
        let (p, over) = plan(&inputs(16, &layers), &cfg, &PinLayers::Auto).expect("fits streamed");
        assert_eq!(over, 0);
        assert!(p.streamed() > 0);
        assert_eq!(p.fixed_spine, 2 << 30, "the embedding is read by rows");
        assert_eq!(p.streaming, STREAMED_LAYERS_IN_MEMORY << 30);
        assert!(p.committed() <= p.budget, "{p}");
        // Pinning one more layer would not fit.
        let pinned = p.resident.iter().filter(|&&r| r).count();
        let one_more: Vec<bool> = (0..40).map(|l| l <= pinned).collect();
        let (q, over) = plan(
            &inputs(16, &layers),
            &cfg,
            &PinLayers::Ranges(vec![0..=pinned]),
        )
        .expect("explicit pins are honoured");
        assert_eq!(q.resident, one_more);
        assert!(over > 0 || q.expert_cache == 0 || q.committed() + q.expert_cache == q.budget);
    }

    /// The settings docs/PLATFORMS.md gives for Macs ("Running on a Mac"), from the memory size `hw.memsize`
    /// reports through to the plan: the budget the machine allows, the spine `K3_SPINE=auto` picks, and what is
    /// pinned, streamed and cached. K3's int8 spine is taken as 57 GB (docs/PERFORMANCE.md): the embedding
    /// (163,840 × 7168 bf16, not quantised) and the head (int8) always resident, the rest spread over the layers.
    #[test]
    fn mac_settings_plan_as_the_docs_say() {
        use crate::memory::macos_memory;
        use crate::options::ram_budget;
        use crate::spine::auto_uses_int8;
        const GB: u64 = 1_000_000_000;
        let cfg = k3();
        let n = 93;
        let (embed, head) = (163_840 * 7168 * 2, 163_840 * 7168 + 163_840 * 4);
        let layers = vec![(57 * GB - embed - head) / n; n as usize];
        let bf16_spine = 114 * GB;
        let mac = |gib: u64| macos_memory(gib << 30, None).expect("a memory size");
        let plan_at = |budget: u64| {
            let inputs = PlanInputs {
                budget,
                embed_bytes: embed,
                fixed_bytes: head,
                ..inputs(0, &layers)
            };
            plan(&inputs, &cfg, &PinLayers::Auto).expect("fits").0
        };
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;

        // 64 GB: the default budget is half of it; 50 GiB is allowed (at most 90%, 57.6 GiB), 58 is not.
        assert_eq!(ram_budget(None, Some(&mac(64))).ok(), Some(32 << 30));
        assert!(ram_budget(Some(58.0), Some(&mac(64))).is_err());
        let budget = ram_budget(Some(50.0), Some(&mac(64))).expect("50 GiB fits 64 GB");
        assert!(
            auto_uses_int8(true, bf16_spine, Some(budget)),
            "auto picks int8"
        );
        assert!(
            !auto_uses_int8(false, bf16_spine, Some(budget)),
            "without the copy, bf16"
        );
        let p = plan_at(budget);
        let pinned = p.resident.iter().filter(|&&r| r).count();
        eprintln!("64 GB Mac, 50 GiB: {p}");
        // Without settings (32 GiB, where auto also picks int8): about half of the layers streamed, some 20 GB more
        // per token.
        assert!(auto_uses_int8(true, bf16_spine, Some(32 << 30)));
        let default = plan_at(32 << 30);
        eprintln!("64 GB Mac, default: {default}");
        let more = (default.streamed() - p.streamed()) as u64 * layers[0];
        assert!((15 * GB..=25 * GB).contains(&more), "{default}");
        // The projection: 48 GB of layers pinned, 5.5 GB streamed, no expert cache to speak of (this stand-in's
        // layers are all of one size, so its split differs by a layer or two).
        assert!(pinned > 80 && p.streamed() > 0, "{p}");
        assert!((45 * GB..=51 * GB).contains(&p.pinned_layers), "{p}");
        assert!(gib(p.expert_cache) < 1.0, "{p}");

        // 128 GB: the default budget is 64 GiB; 110 GiB is allowed (at most 115.2), 116 is not. At 110 GiB the
        // stored spine (106.2 GiB) is below the budget, so auto keeps bf16 and K3_SPINE=int8 must be asked for.
        assert_eq!(ram_budget(None, Some(&mac(128))).ok(), Some(64 << 30));
        assert!(ram_budget(Some(116.0), Some(&mac(128))).is_err());
        let budget = ram_budget(Some(110.0), Some(&mac(128))).expect("110 GiB fits 128 GB");
        assert!(!auto_uses_int8(true, bf16_spine, Some(budget)));
        assert!(
            auto_uses_int8(true, bf16_spine, Some(64 << 30)),
            "the default budget"
        );
        let p = plan_at(budget);
        eprintln!("128 GB Mac, 110 GiB: {p}");
        assert_eq!(p.streamed(), 0, "{p}");
        assert!(gib(p.expert_cache) > 50.0, "{p}");
        // Without settings (64 GiB): the int8 spine resident with about 9 GiB of expert cache.
        let default = plan_at(64 << 30);
        eprintln!("128 GB Mac, default: {default}");
        assert_eq!(default.streamed(), 0, "{default}");
        assert!(
            (7.0..=11.0).contains(&gib(default.expert_cache)),
            "{default}"
        );
    }

    #[test]
    fn a_budget_too_small_to_stream_is_refused_with_what_it_needs() {
        let cfg = k3();
        let layers = vec![1 << 30; 40];
        let err = plan(&inputs(4, &layers), &cfg, &PinLayers::Auto).expect_err("too small");
        let msg = err.to_string();
        assert!(msg.contains("needs") && msg.contains("K3_RAM_GB"), "{msg}");
    }

    #[test]
    fn host_tier_takes_what_the_gpu_streams_within_the_pinned_bytes() {
        let layers = [4u64 << 30; 8];
        // 30 GiB: the spine (36 GiB with the fixed tensors) does not fit; a prefix of layers is pinned.
        let cfg = k3();
        let (p, _) = plan(&inputs(30, &layers), &cfg, &PinLayers::Auto).expect("plan");
        let pinned = p.resident.iter().filter(|&&r| r).count() as u64;
        assert!(pinned > 0 && pinned < 8, "{p}");
        // The GPU holds layers 0..3 and streams 3..8: the tier takes as many of those as the pinned bytes hold.
        let tier = host_tier(&p, &PinLayers::Auto, &[3, 4, 5, 6, 7], &layers);
        let want: Vec<usize> = (3..8).take(pinned as usize).collect();
        assert_eq!(tier, want);
        // Explicit pins keep the streamed layers they name, and no others.
        let pins = PinLayers::Ranges(vec![0..=0, 4..=5]);
        let (p, _) = plan(&inputs(64, &layers), &cfg, &pins).expect("plan");
        assert_eq!(host_tier(&p, &pins, &[3, 4, 5, 6, 7], &layers), vec![4, 5]);
        // Nothing streamed on the GPU: no tier.
        assert!(host_tier(&p, &PinLayers::Auto, &[], &layers).is_empty());
    }
}
