//! Per-conversation decode state: KDA recurrent states and conv windows, MLA latent caches.
//!
//! State is passed explicitly (`&mut SessionState`), so a snapshot is a clone and a rollback is keeping the old
//! value. KDA states sit behind `Arc`, so a clone shares them until one side writes (copy on write).

use std::sync::{Arc, Mutex, OnceLock};

use deltafin_quant::aligned::Lines;

use crate::config::{AttnKind, ModelConfig};

/// Idle KDA state matrices kept for reuse, at most this many (two per KDA layer of K3, with room to spare).
const MAX_IDLE_STATE_BUFFERS: usize = 160;

/// State matrices of dropped KDA states. A forward pass writes every layer's new state into a buffer taken from
/// here, so the pages are already the process's: a fresh 6.3 MB allocation per layer and pass would be zeroed (or
/// faulted in page by page) first, which cost more than the recurrence itself at K3's size.
static IDLE_STATE_BUFFERS: Mutex<Vec<Vec<f32>>> = Mutex::new(Vec::new());

/// A buffer of `len` values whose contents are unspecified (the caller overwrites every value): an idle one of that
/// length, or a new one zeroed on every thread and on huge pages (`deltafin_quant::zeroed`), so a prompt's heads do
/// not fault its pages in one by one.
pub(crate) fn state_buffer(len: usize) -> Vec<f32> {
    let mut idle = IDLE_STATE_BUFFERS.lock().unwrap_or_else(|e| e.into_inner());
    match idle.iter().position(|b| b.len() == len) {
        Some(i) => idle.swap_remove(i),
        None => deltafin_quant::zeroed::zeroed(len),
    }
}

/// The state of one KDA layer.
///
/// The recurrent matrices and conv windows live on the host, or, when the model runs on CUDA, on the GPU only: a
/// forward pass there leaves the new state on the device (no transfer per token) and [`Self::s`] and [`Self::conv`]
/// bring it to the host the first time someone reads it (a snapshot file, a CPU pass, a test). Either way a state
/// never changes once built.
#[derive(Clone, Debug)]
pub struct KdaState {
    /// The last `kernel - 1` pre-conv projection rows of q, k and v, oldest first (`[(K-1) * C]` each; unset while
    /// only the device has them).
    conv: OnceLock<[Vec<f32>; 3]>,
    /// Recurrent states on the host, `[heads, head_dim (k), head_dim (v)]` (unset while only the device has them).
    s: OnceLock<Vec<f32>>,
    /// The same state on the GPU, when a CUDA pass made it.
    #[cfg(feature = "cuda")]
    device: Option<crate::gpu::DeviceKdaState>,
    /// Known to be all zeros (a new conversation's): the GPU clears its buffers instead of uploading these.
    zero: bool,
}

impl KdaState {
    /// A state with host windows `conv` and matrices `s`.
    pub fn new(conv: [Vec<f32>; 3], s: Vec<f32>) -> Self {
        Self {
            conv: OnceLock::from(conv),
            s: OnceLock::from(s),
            #[cfg(feature = "cuda")]
            device: None,
            zero: false,
        }
    }

    /// The state before any token: three windows of `window` zeros and `s_len` zero matrix values.
    pub fn zeroed(window: usize, s_len: usize) -> Self {
        let mut state = Self::new(
            [vec![0.0; window], vec![0.0; window], vec![0.0; window]],
            vec![0.0; s_len],
        );
        state.zero = true;
        state
    }

    /// Whether the state is known to be all zeros (a new conversation's).
    pub(crate) fn is_zero(&self) -> bool {
        self.zero
    }

    /// A state on the GPU only.
    #[cfg(feature = "cuda")]
    pub(crate) fn on_device(device: crate::gpu::DeviceKdaState) -> Self {
        Self {
            conv: OnceLock::new(),
            s: OnceLock::new(),
            device: Some(device),
            zero: false,
        }
    }

    /// The state on the GPU, when it is there.
    #[cfg(feature = "cuda")]
    pub(crate) fn device(&self) -> Option<&crate::gpu::DeviceKdaState> {
        self.device.as_ref()
    }

    /// Whether a CUDA pass made this state (it is on the GPU, and on the host only once read there).
    pub fn is_on_device(&self) -> bool {
        #[cfg(feature = "cuda")]
        if self.device.is_some() {
            return true;
        }
        false
    }

    /// The recurrent states `[heads, head_dim (k), head_dim (v)]`, copied from the GPU on first use when only it
    /// has them.
    pub fn s(&self) -> crate::Result<&[f32]> {
        if let Some(s) = self.s.get() {
            return Ok(s);
        }
        #[cfg(feature = "cuda")]
        if let Some(d) = &self.device {
            let host = d.download()?;
            return Ok(self.s.get_or_init(|| host));
        }
        Err(crate::ModelError::Device(
            "a KDA state without matrices".to_string(),
        ))
    }

    /// The conv windows of q, k and v (`[(K-1) * C]` each), copied from the GPU on first use when only it has them.
    pub fn conv(&self) -> crate::Result<&[Vec<f32>; 3]> {
        if let Some(c) = self.conv.get() {
            return Ok(c);
        }
        #[cfg(feature = "cuda")]
        if let Some(d) = &self.device {
            let host = d.download_conv()?;
            return Ok(self.conv.get_or_init(|| host));
        }
        Err(crate::ModelError::Device(
            "a KDA state without conv windows".to_string(),
        ))
    }
}

impl PartialEq for KdaState {
    /// Equal values (compared on the host; a state that cannot be read equals nothing).
    fn eq(&self, other: &Self) -> bool {
        match (self.conv(), other.conv(), self.s(), other.s()) {
            (Ok(ca), Ok(cb), Ok(a), Ok(b)) => ca == cb && a == b,
            _ => false,
        }
    }
}

impl Drop for KdaState {
    /// The host matrices go back to the idle buffers (see `state_buffer`), except a zero state's: its pages may be
    /// untouched or mapped to the kernel's zero page, so a pass writing into them would fault each one in.
    fn drop(&mut self) {
        let s = self.s.take().unwrap_or_default();
        if s.is_empty() || self.zero {
            return;
        }
        let mut idle = IDLE_STATE_BUFFERS.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < MAX_IDLE_STATE_BUFFERS {
            idle.push(s);
        }
    }
}

/// The latent cache of one MLA layer: per token the normalised `c` (kv_lora values) followed by the shared `k_pe`
/// (rope values), `kv_lora + rope` values a token.
///
/// Rows live in immutable blocks (one per forward call) behind `Arc`, so cloning a cache — a snapshot, or the
/// state kept while a speculative draft is verified — copies pointers, never rows.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MlaCache {
    blocks: Vec<Arc<CacheBlock>>,
    row: usize,
    len: usize,
}

/// One block of a latent cache's rows, stored from the start of a cache line: at K3's width (576 values, 36 lines)
/// every row then starts a line, so the attention's full-width loads of a row never straddle two lines (a large `Vec`
/// from the allocator starts 16 bytes off one, and every load of its rows then touches two).
#[derive(Debug, PartialEq)]
pub struct CacheBlock {
    lines: Lines,
    len: usize,
}

impl CacheBlock {
    /// A block holding a copy of `rows`.
    fn copy_of(rows: &[f32]) -> Self {
        CacheBlock {
            lines: Lines::copy_of(rows),
            len: rows.len(),
        }
    }
}

impl std::ops::Deref for CacheBlock {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        &self.lines[..self.len]
    }
}

impl MlaCache {
    /// Cached tokens.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends a copy of `rows` (`[n, row_width]`) as one block.
    pub fn push_block(&mut self, rows: &[f32], row_width: usize) {
        if rows.is_empty() || row_width == 0 {
            return;
        }
        self.row = row_width;
        self.len += rows.len() / row_width;
        self.blocks.push(Arc::new(CacheBlock::copy_of(rows)));
    }

    /// Every cached row in order, each `row_width` values.
    pub fn rows(&self) -> impl Iterator<Item = &[f32]> {
        let w = self.row.max(1);
        self.blocks.iter().flat_map(move |b| b.chunks_exact(w))
    }

    /// The blocks, oldest first (for serialisation).
    pub fn blocks(&self) -> &[Arc<CacheBlock>] {
        &self.blocks
    }

    /// Values per row.
    pub fn row_width(&self) -> usize {
        self.row
    }
}

/// The state of one layer.
#[derive(Clone, Debug, PartialEq)]
pub enum LayerState {
    /// KDA layer.
    Kda(Arc<KdaState>),
    /// MLA layer.
    Mla(MlaCache),
}

/// The whole decode state of one conversation.
#[derive(Clone, Debug, PartialEq)]
pub struct SessionState {
    /// One entry per layer.
    pub layers: Vec<LayerState>,
    /// Tokens consumed so far.
    pub n_tokens: usize,
}

impl SessionState {
    /// The empty state for a model.
    pub fn new(cfg: &ModelConfig) -> Self {
        let c = cfg.kda.n_heads * cfg.kda.head_dim;
        let window = (cfg.kda.conv_kernel - 1) * c;
        let layers = cfg
            .layer_kinds
            .iter()
            .map(|kind| match kind {
                AttnKind::Kda => LayerState::Kda(Arc::new(KdaState::zeroed(
                    window,
                    cfg.kda.n_heads * cfg.kda.head_dim * cfg.kda.head_dim,
                ))),
                AttnKind::Mla => LayerState::Mla(MlaCache::default()),
            })
            .collect();
        Self {
            layers,
            n_tokens: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cache keeps each block's rows as given, in order, and at K3's width (576 values) every row starts a cache
    /// line; a clone shares the blocks.
    #[test]
    fn latent_cache_rows_are_kept_in_order_on_cache_lines() {
        let width = 576;
        let block = |n: usize, base: f32| -> Vec<f32> {
            (0..n * width).map(|i| base + i as f32 * 0.5).collect()
        };
        let (a, b) = (block(3, 1.0), block(2, -7.0));
        let mut cache = MlaCache::default();
        cache.push_block(&a, width);
        cache.push_block(&[], width);
        cache.push_block(&b, width);
        assert_eq!(cache.len(), 5);
        let rows: Vec<&[f32]> = cache.rows().collect();
        let want: Vec<&[f32]> = a.chunks_exact(width).chain(b.chunks_exact(width)).collect();
        assert_eq!(rows, want);
        assert!(
            rows.iter()
                .all(|r| (r.as_ptr() as usize).is_multiple_of(64))
        );
        let copy = cache.clone();
        assert!(
            copy.blocks()
                .iter()
                .zip(cache.blocks())
                .all(|(x, y)| Arc::ptr_eq(x, y))
        );
    }
}
