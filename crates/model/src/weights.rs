//! How weights reach the graph. The model does no I/O: the runtime implements these traits over storage.

use std::ops::Range;
use std::sync::Arc;

use deltafin_quant::{DenseData, DenseMatrix};

use crate::error::{ModelError, Result};

/// A dense weight in its stored precision, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    /// Shape as stored in the checkpoint.
    pub shape: Vec<usize>,
    /// Values, row-major.
    pub data: DenseData,
}

impl HostTensor {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values as f32 (exact for f32 and bf16; dequantised for int8).
    pub fn to_f32(&self) -> Vec<f32> {
        match &self.data {
            DenseData::F32(v) => v.clone(),
            DenseData::Bf16(v) => v
                .iter()
                .map(|&b| deltafin_quant::dot::bf16_to_f32(b))
                .collect(),
            DenseData::Int8 { q, scales } => {
                let cols = q.len() / scales.len().max(1);
                q.iter()
                    .enumerate()
                    .map(|(i, &v)| v as f32 * scales[i / cols.max(1)])
                    .collect()
            }
        }
    }
}

/// Supplies dense (spine) weights by checkpoint name.
pub trait WeightSource {
    /// The tensor called `name` in its stored precision, or `None` when the checkpoint has no such tensor.
    fn load(&self, name: &str) -> Result<Option<HostTensor>>;

    /// The shape of `name` without reading its values, or `None` when the checkpoint has no such tensor. The
    /// default loads the tensor; sources that know shapes from headers override it, so that probing a tensor
    /// (optional weights, ranks) reads no bytes.
    fn shape(&self, name: &str) -> Result<Option<Vec<usize>>> {
        Ok(self.load(name)?.map(|t| t.shape))
    }

    /// Rows `rows` of the 2-D tensor `name` as f32 (`[rows.len(), cols]`, row-major), or `None` when the
    /// checkpoint has no such tensor. The default loads the whole tensor; sources over files override it to read
    /// only those rows (how the embedding is read when it is not kept in memory).
    fn rows_f32(&self, name: &str, rows: &[usize]) -> Result<Option<Vec<f32>>> {
        let Some(t) = self.load(name)? else {
            return Ok(None);
        };
        let [n, cols] = t.shape[..] else {
            return Err(ModelError::BadWeight {
                name: name.to_string(),
                msg: format!("rows of a tensor of shape {:?}", t.shape),
            });
        };
        let m = DenseMatrix::new(n, cols, t.data).map_err(|e| ModelError::BadWeight {
            name: name.to_string(),
            msg: e.to_string(),
        })?;
        let mut out = Vec::with_capacity(rows.len() * cols);
        for &r in rows {
            if r >= n {
                return Err(ModelError::BadWeight {
                    name: name.to_string(),
                    msg: format!("row {r} of {n}"),
                });
            }
            out.extend(m.row_f32(r));
        }
        Ok(Some(out))
    }
}

/// A weight source a background thread can read from: how a streamed spine reaches the model (see
/// [`crate::streamed_layers`]).
pub type SharedWeightSource = Arc<dyn WeightSource + Send + Sync>;

/// One routed expert, as read from the checkpoint.
#[derive(Clone, Debug)]
pub enum ExpertWeights {
    /// MXFP4: one contiguous span of six tensors (see [`PackedExpert`]).
    Mxfp4(PackedExpert),
    /// Plain weights already in f32: `w1` (gate) `[inter, width]`, `w2` (down) `[width, inter]`, `w3` (up)
    /// `[inter, width]`, row-major.
    Dense {
        /// Gate projection.
        w1: Vec<f32>,
        /// Down projection.
        w2: Vec<f32>,
        /// Up projection.
        w3: Vec<f32>,
    },
}

/// Bytes owned by whoever read them (a read pool's reusable buffer, or a plain vector), shared without copying.
#[derive(Clone)]
pub struct ExpertBytes(Arc<dyn std::ops::Deref<Target = [u8]> + Send + Sync>);

impl ExpertBytes {
    /// Wraps any owner of bytes (the buffer stays where it was read: a 17.5 MB expert is not copied).
    pub fn new(owner: impl std::ops::Deref<Target = [u8]> + Send + Sync + 'static) -> Self {
        Self(Arc::new(owner))
    }
}

impl From<Vec<u8>> for ExpertBytes {
    fn from(v: Vec<u8>) -> Self {
        Self::new(v)
    }
}

impl std::ops::Deref for ExpertBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for ExpertBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ExpertBytes({} bytes)", self.len())
    }
}

/// The raw bytes of an MXFP4 expert and where each of its six tensors lies in them, checked once when built
/// ([`PackedExpert::new`]: lengths and every scale byte), so the products that use it do not check again.
#[derive(Clone, Debug)]
pub struct PackedExpert {
    /// The expert's span, exactly as in the shard.
    pub bytes: ExpertBytes,
    /// Byte ranges in `bytes` of w1.packed, w1.scale, w2.packed, w2.scale, w3.packed, w3.scale.
    pub parts: [Range<usize>; 6],
    /// Logical `[rows, cols]` of w1, w2 and w3.
    shapes: [(usize, usize); 3],
}

impl PackedExpert {
    /// Checks `parts` of `bytes` as MXFP4 matrices of the logical shapes `shapes` (w1, w2, w3): every range inside
    /// `bytes`, lengths matching, no NaN scale byte.
    pub fn new(
        bytes: ExpertBytes,
        parts: [Range<usize>; 6],
        shapes: [(usize, usize); 3],
    ) -> std::result::Result<Self, deltafin_quant::QuantError> {
        for (i, &(rows, cols)) in shapes.iter().enumerate() {
            let part = |k: usize| bytes.get(parts[k].clone()).unwrap_or(&[]);
            deltafin_quant::Mxfp4Matrix::new(part(2 * i), part(2 * i + 1), rows, cols)?;
        }
        Ok(Self {
            bytes,
            parts,
            shapes,
        })
    }

    /// w1, w2 and w3 as matrices, without scanning the scales again.
    pub fn matrices(
        &self,
    ) -> std::result::Result<[deltafin_quant::Mxfp4Matrix<'_>; 3], deltafin_quant::QuantError> {
        let part = |k: usize| self.bytes.get(self.parts[k].clone()).unwrap_or(&[]);
        let m = |i: usize| {
            let (rows, cols) = self.shapes[i];
            deltafin_quant::Mxfp4Matrix::with_checked_scales(
                part(2 * i),
                part(2 * i + 1),
                rows,
                cols,
            )
        };
        Ok([m(0)?, m(1)?, m(2)?])
    }

    /// Logical `[rows, cols]` of w1, w2 and w3.
    pub fn shapes(&self) -> [(usize, usize); 3] {
        self.shapes
    }
}

/// Called with `(position in the requested list, weights)` pairs as experts become available: several at once
/// when they are ready together (RAM-cache hits), so the caller can multiply them in one threaded pass.
pub type OnExperts<'a> = dyn FnMut(Vec<(usize, Arc<ExpertWeights>)>) -> Result<()> + 'a;

/// Expert fetches started by [`ExpertSource::begin`], handed over by [`ExpertFetch::finish`].
pub trait ExpertFetch {
    /// Hands every requested expert to `on_expert` as soon as it is available (in any order, some together).
    fn finish(self: Box<Self>, on_expert: &mut OnExperts<'_>) -> Result<()>;
}

/// The default [`ExpertFetch`]: nothing starts early; `finish` runs [`ExpertSource::for_each_expert`].
struct Deferred<'s, S: ?Sized> {
    source: &'s S,
    layer: usize,
    experts: Vec<usize>,
}

impl<S: ExpertSource + ?Sized> ExpertFetch for Deferred<'_, S> {
    fn finish(self: Box<Self>, on_expert: &mut OnExperts<'_>) -> Result<()> {
        self.source
            .for_each_expert(self.layer, &self.experts, on_expert)
    }
}

/// Supplies routed experts: the runtime decides whether they come from RAM, disk or the network.
pub trait ExpertSource: Send + Sync {
    /// The weights of `experts` (distinct ids) of layer `layer`, in the same order.
    fn load_experts(&self, layer: usize, experts: &[usize]) -> Result<Vec<Arc<ExpertWeights>>>;

    /// Hands each of `experts` to `on_expert` as soon as it is available (in any order; those ready together in
    /// one call), so the caller can multiply one expert while the next is still being read. The default loads
    /// all, then hands them over in one call.
    fn for_each_expert(
        &self,
        layer: usize,
        experts: &[usize],
        on_expert: &mut OnExperts<'_>,
    ) -> Result<()> {
        on_expert(
            self.load_experts(layer, experts)?
                .into_iter()
                .enumerate()
                .collect(),
        )
    }

    /// Whether this source wants guesses of upcoming layers' experts ([`Self::prefetch`]); the model only
    /// computes them when asked, since a guess costs a router product.
    fn wants_prefetch(&self) -> bool {
        false
    }

    /// A guess that `experts` of `layer` will be asked for soon: a source may start reading them now, behind the
    /// reads already asked for. The default ignores it.
    fn prefetch(&self, layer: usize, experts: &[usize]) -> Result<()> {
        let _ = (layer, experts);
        Ok(())
    }

    /// Starts fetching `experts` (distinct ids) of `layer` now, so the reads run while the caller does other
    /// work (the shared experts, the latent projection); [`ExpertFetch::finish`] then hands them over as
    /// [`Self::for_each_expert`] would. The default starts nothing early.
    fn begin<'s>(&'s self, layer: usize, experts: &[usize]) -> Result<Box<dyn ExpertFetch + 's>> {
        Ok(Box::new(Deferred {
            source: self,
            layer,
            experts: experts.to_vec(),
        }))
    }
}

/// Matrices only the host reads (by rows) even when the model runs on CUDA: the embedding and KDA's low-rank decay
/// projection. They are not uploaded and keep their host values.
#[cfg(feature = "cuda")]
const HOST_READ_BY_ROWS: [&str; 1] = ["embed_tokens.weight"];

/// Loads weights with shape checks, naming the tensor in every error.
pub(crate) struct Loader<'a> {
    pub src: &'a dyn WeightSource,
    /// Check names and shapes only: every tensor comes back as zeros of its stored shape, and no values are read
    /// (how a streamed layer is checked at open without reading it). The zeros are never written, so the memory
    /// behind them is never touched.
    shapes_only: bool,
    /// When the model runs on CUDA: every matrix is uploaded as it is loaded.
    #[cfg(feature = "cuda")]
    pub gpu: Option<crate::gpu::GpuHandles>,
}

impl<'a> Loader<'a> {
    /// A loader for the CPU.
    pub fn new(src: &'a dyn WeightSource) -> Self {
        Self {
            src,
            shapes_only: false,
            #[cfg(feature = "cuda")]
            gpu: None,
        }
    }

    /// A CPU loader that checks names and shapes but reads no values (see `shapes_only`).
    pub fn shapes_only(src: &'a dyn WeightSource) -> Self {
        Self {
            shapes_only: true,
            ..Self::new(src)
        }
    }

    /// Whether this loader only checks names and shapes (`shapes_only`): what a block builds from the values
    /// (derived matrices, layouts) is then skipped, as the block is dropped unused.
    pub fn checks_only(&self) -> bool {
        self.shapes_only
    }

    /// The raw tensor, or `MissingWeight`.
    pub fn host(&self, name: &str) -> Result<HostTensor> {
        if self.shapes_only {
            let shape = self.shape(name)?;
            let n = shape.iter().product();
            return Ok(HostTensor {
                shape,
                data: DenseData::F32(vec![0.0; n]),
            });
        }
        self.src
            .load(name)?
            .ok_or_else(|| ModelError::MissingWeight(name.to_string()))
    }

    /// The tensor as f32 values, checked against `shape`.
    pub fn vec(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let t = self.host(name)?;
        check_shape(name, &t.shape, shape)?;
        Ok(t.to_f32())
    }

    /// A 2-D weight `[rows, cols]` in its stored precision, on the host only (for a block that runs on the CPU
    /// even when the model runs on CUDA).
    pub fn host_matrix(&self, name: &str, rows: usize, cols: usize) -> Result<DenseMatrix> {
        let t = self.host(name)?;
        check_shape(name, &t.shape, &[rows, cols])?;
        DenseMatrix::new(rows, cols, t.data).map_err(|e| ModelError::BadWeight {
            name: name.to_string(),
            msg: e.to_string(),
        })
    }

    /// A 2-D weight `[rows, cols]` in its stored precision.
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<DenseMatrix> {
        let m = self.host_matrix(name, rows, cols)?;
        self.on_device(name, m)
    }

    /// A 2-D weight `[rows, cols]` that a GPU kernel reads as floats itself (no int8 there): as
    /// [`Self::matrix`], but on CUDA row-wise int8 values go up dequantised to f32.
    pub fn float_matrix(&self, name: &str, rows: usize, cols: usize) -> Result<DenseMatrix> {
        #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
        let mut m = self.host_matrix(name, rows, cols)?;
        #[cfg(feature = "cuda")]
        if self.gpu.is_some() && matches!(m.data(), DenseData::Int8 { .. }) {
            let vals = m.to_f32();
            m = Self::f32_matrix(name, rows, cols, vals)?;
        }
        self.on_device(name, m)
    }

    /// `m` (weight `name`) as the model uses it: on CUDA every matrix multiplies on the device and its host values
    /// are freed once uploaded (no second copy of the spine in host RAM), except the embedding, which the host
    /// reads by rows.
    fn on_device(&self, name: &str, m: DenseMatrix) -> Result<DenseMatrix> {
        #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
        let mut m = m;
        #[cfg(feature = "cuda")]
        if let Some(g) = &self.gpu
            && !HOST_READ_BY_ROWS.iter().any(|s| name.ends_with(s))
        {
            let on_device = m
                .attach_cuda(&g.gpu)
                .map_err(|e| ModelError::Device(format!("{name}: {e}")))?;
            if on_device {
                m.release_host();
            }
        }
        #[cfg(not(feature = "cuda"))]
        let _ = name;
        Ok(m)
    }

    /// An f32 matrix built from values already loaded (int8 rows dequantised for a GPU kernel that reads floats).
    #[cfg(feature = "cuda")]
    pub fn f32_matrix(name: &str, rows: usize, cols: usize, data: Vec<f32>) -> Result<DenseMatrix> {
        DenseMatrix::new(rows, cols, DenseData::F32(data)).map_err(|e| ModelError::BadWeight {
            name: name.to_string(),
            msg: e.to_string(),
        })
    }

    /// Whether the checkpoint has `name` (reads no values where the source knows shapes).
    pub fn has(&self, name: &str) -> Result<bool> {
        Ok(self.src.shape(name)?.is_some())
    }

    /// The stored shape of `name`, or `MissingWeight` (reads no values where the source knows shapes).
    pub fn shape(&self, name: &str) -> Result<Vec<usize>> {
        self.src
            .shape(name)?
            .ok_or_else(|| ModelError::MissingWeight(name.to_string()))
    }
}

/// Fails with a `Shape` error naming `name` when `actual != expected`.
pub(crate) fn check_shape(name: &str, actual: &[usize], expected: &[usize]) -> Result<()> {
    if actual == expected {
        Ok(())
    } else {
        Err(ModelError::Shape {
            name: name.to_string(),
            expected: expected.to_vec(),
            actual: actual.to_vec(),
        })
    }
}
