//! Where a forward pass spends its time, accumulated across calls: attention, dense FFN, the MoE's router and
//! shared experts, waiting for routed experts to arrive, multiplying them, and waiting for a streamed spine layer.
//! Printed by `--stats`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Accumulated nanoseconds per phase (interior mutability: the model is shared).
#[derive(Debug, Default)]
pub struct Profile {
    kda: AtomicU64,
    kda_proj: AtomicU64,
    mla: AtomicU64,
    mla_proj: AtomicU64,
    attn_device: AtomicU64,
    shared_experts: AtomicU64,
    dense_ffn: AtomicU64,
    moe_trunk: AtomicU64,
    expert_wait: AtomicU64,
    expert_compute: AtomicU64,
    head: AtomicU64,
    spine_wait: AtomicU64,
}

/// A copy of the counters.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ProfileSnapshot {
    /// KDA blocks: projections, conv, recurrence, gated norm, output projection.
    pub kda: Duration,
    /// Of [`Self::kda`], the dense projections (q, k, v, the gates' projections, β, the output projection).
    pub kda_proj: Duration,
    /// MLA blocks: projections and attention over the latent cache.
    pub mla: Duration,
    /// Of [`Self::mla`], the dense projections (query, compressed KV, gate, output); the rest is attention over
    /// the latent cache with the absorbed per-head matrices.
    pub mla_proj: Duration,
    /// Of [`Self::attention`], the device's time for the attention work queued on the GPU: from the first copy or
    /// launch of a block to its last, by device events (zero on the CPU). What is left of the block's time is the
    /// host's: launching, waiting for the result, the CPU-side glue.
    pub attn_device: Duration,
    /// The MoE layers' shared experts (a dense MLP each).
    pub shared_experts: Duration,
    /// Dense MLP layers.
    pub dense_ffn: Duration,
    /// MoE router, latent projections, norm and combine (the shared experts are counted apart).
    pub moe_trunk: Duration,
    /// Blocked waiting for routed experts (RAM cache, disk or network).
    pub expert_wait: Duration,
    /// Multiplying routed experts.
    pub expert_compute: Duration,
    /// Embedding, AttnRes mixes, final norm and the head.
    pub head: Duration,
    /// Blocked waiting for a streamed spine layer to be read (zero when the whole spine is resident).
    pub spine_wait: Duration,
}

impl ProfileSnapshot {
    /// KDA and MLA together.
    pub fn attention(&self) -> Duration {
        self.kda + self.mla
    }

    /// Every phase of dense spine compute outside attention: dense FFN, the MoE trunk, shared experts, head.
    pub fn spine_compute(&self) -> Duration {
        self.dense_ffn + self.moe_trunk + self.shared_experts + self.head
    }

    /// The time spent in each phase between `earlier` and `self`.
    pub fn since(&self, earlier: &ProfileSnapshot) -> ProfileSnapshot {
        ProfileSnapshot {
            kda: self.kda.saturating_sub(earlier.kda),
            kda_proj: self.kda_proj.saturating_sub(earlier.kda_proj),
            mla: self.mla.saturating_sub(earlier.mla),
            mla_proj: self.mla_proj.saturating_sub(earlier.mla_proj),
            attn_device: self.attn_device.saturating_sub(earlier.attn_device),
            shared_experts: self.shared_experts.saturating_sub(earlier.shared_experts),
            dense_ffn: self.dense_ffn.saturating_sub(earlier.dense_ffn),
            moe_trunk: self.moe_trunk.saturating_sub(earlier.moe_trunk),
            expert_wait: self.expert_wait.saturating_sub(earlier.expert_wait),
            expert_compute: self.expert_compute.saturating_sub(earlier.expert_compute),
            head: self.head.saturating_sub(earlier.head),
            spine_wait: self.spine_wait.saturating_sub(earlier.spine_wait),
        }
    }
}

/// The phases [`Profile`] tracks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// KDA attention blocks.
    Kda,
    /// The dense projections inside KDA blocks (also counted in [`Phase::Kda`]).
    KdaProj,
    /// MLA attention blocks.
    Mla,
    /// The dense projections inside MLA blocks (also counted in [`Phase::Mla`]).
    MlaProj,
    /// The device's time for attention blocks run on the GPU (also counted in [`Phase::Kda`] or [`Phase::Mla`]).
    AttnDevice,
    /// Shared experts.
    SharedExperts,
    /// Dense MLP.
    DenseFfn,
    /// MoE router, latent projections, norm and combine.
    MoeTrunk,
    /// Waiting for experts.
    ExpertWait,
    /// Routed expert math.
    ExpertCompute,
    /// Everything else (embedding, mixes, head).
    Head,
    /// Waiting for the background read of a streamed spine layer.
    SpineWait,
}

/// Every phase, in report order.
const PHASES: [Phase; 12] = [
    Phase::Kda,
    Phase::KdaProj,
    Phase::Mla,
    Phase::MlaProj,
    Phase::AttnDevice,
    Phase::SharedExperts,
    Phase::DenseFfn,
    Phase::MoeTrunk,
    Phase::ExpertWait,
    Phase::ExpertCompute,
    Phase::Head,
    Phase::SpineWait,
];

impl Profile {
    fn counter(&self, phase: Phase) -> &AtomicU64 {
        match phase {
            Phase::Kda => &self.kda,
            Phase::KdaProj => &self.kda_proj,
            Phase::Mla => &self.mla,
            Phase::MlaProj => &self.mla_proj,
            Phase::AttnDevice => &self.attn_device,
            Phase::SharedExperts => &self.shared_experts,
            Phase::DenseFfn => &self.dense_ffn,
            Phase::MoeTrunk => &self.moe_trunk,
            Phase::ExpertWait => &self.expert_wait,
            Phase::ExpertCompute => &self.expert_compute,
            Phase::Head => &self.head,
            Phase::SpineWait => &self.spine_wait,
        }
    }

    /// Adds `d` to `phase`.
    pub fn add(&self, phase: Phase, d: Duration) {
        self.counter(phase)
            .fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Runs `f`, charging its time to `phase`.
    pub fn time<T>(&self, phase: Phase, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let out = f();
        self.add(phase, t.elapsed());
        out
    }

    /// The counters now.
    pub fn snapshot(&self) -> ProfileSnapshot {
        let d = |p| Duration::from_nanos(self.counter(p).load(Ordering::Relaxed));
        ProfileSnapshot {
            kda: d(Phase::Kda),
            kda_proj: d(Phase::KdaProj),
            mla: d(Phase::Mla),
            mla_proj: d(Phase::MlaProj),
            attn_device: d(Phase::AttnDevice),
            shared_experts: d(Phase::SharedExperts),
            dense_ffn: d(Phase::DenseFfn),
            moe_trunk: d(Phase::MoeTrunk),
            expert_wait: d(Phase::ExpertWait),
            expert_compute: d(Phase::ExpertCompute),
            head: d(Phase::Head),
            spine_wait: d(Phase::SpineWait),
        }
    }

    /// Zeroes every counter.
    pub fn reset(&self) {
        for p in PHASES {
            self.counter(p).store(0, Ordering::Relaxed);
        }
    }
}
