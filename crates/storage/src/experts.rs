//! The expert span map: (layer, expert) → one contiguous byte span holding all of an expert's tensors.
//!
//! K3 stores each routed expert as six MXFP4 tensors back to back (w1.packed, w1.scale, w2.packed,
//! w2.scale, w3.packed, w3.scale), so one positional read fetches a whole expert. Kimi Linear stores
//! plain `w1`, `w2`, `w3` weights, also back to back. Experts are not in numeric order within a shard
//! (they sort as strings: 0, 1, 10, ...), so every offset comes from the header. This module checks the
//! layout once, at open, so readers can trust a span blindly.

use std::collections::BTreeMap;

use crate::dtype::Dtype;
use crate::error::{Result, StorageError};
use crate::files::{ModelFiles, TensorInfo};

/// Marker that identifies routed-expert tensors in a name.
const EXPERTS_MARKER: &str = ".block_sparse_moe.experts.";
/// What must precede `.{L}` + [`EXPERTS_MARKER`].
const LAYERS_PREFIX: &str = "model.layers";
/// MXFP4 group size: one E8M0 scale per this many inputs.
const MXFP4_GROUP: usize = 32;
/// MXFP4 elements per packed byte.
const MXFP4_PER_BYTE: usize = 2;

/// MXFP4 part names, in storage order.
const MXFP4_PARTS: [&str; 6] = [
    "w1.weight_packed",
    "w1.weight_scale",
    "w2.weight_packed",
    "w2.weight_scale",
    "w3.weight_packed",
    "w3.weight_scale",
];
/// Dense part names, in storage order.
const DENSE_PARTS: [&str; 3] = ["w1.weight", "w2.weight", "w3.weight"];

/// How an expert's weights are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertFormat {
    /// Compressed-tensors MXFP4: per matrix a U8 `weight_packed` `[out, in/2]` (element 2j in the low
    /// nibble) and a U8 E8M0 `weight_scale` `[out, in/32]`.
    Mxfp4,
    /// Plain `weight` matrices of one float dtype (BF16, F16 or F32).
    Dense(Dtype),
}

impl ExpertFormat {
    fn describe(self) -> String {
        match self {
            ExpertFormat::Mxfp4 => "mxfp4".to_string(),
            ExpertFormat::Dense(d) => format!("dense {d}"),
        }
    }
}

/// One tensor inside an expert span.
#[derive(Clone, Debug)]
pub struct ExpertPart {
    /// Byte offset from the start of the span.
    pub rel_offset: u64,
    /// Length in bytes.
    pub len: u64,
    /// Stored shape (for MXFP4, the packed or scale shape, not the logical one).
    pub shape: Vec<usize>,
    /// Stored element type.
    pub dtype: Dtype,
}

/// Where one routed expert lives: a single contiguous span of one shard.
#[derive(Clone, Debug)]
pub struct ExpertSpan {
    /// MoE layer (0-based, as in tensor names).
    pub layer: usize,
    /// Expert id within the layer.
    pub expert: usize,
    /// Index into [`ModelFiles::shards`].
    pub shard: usize,
    /// Absolute byte offset of the first part.
    pub offset: u64,
    /// Total length: the sum of the parts' lengths.
    pub len: u64,
    /// Storage format, identical for every expert of a layer.
    pub format: ExpertFormat,
    /// Mxfp4: 6 parts in order w1.packed, w1.scale, w2.packed, w2.scale, w3.packed, w3.scale;
    /// Dense: 3 parts w1, w2, w3.
    pub parts: Vec<ExpertPart>,
}

/// Every routed expert of a checkpoint, validated.
#[derive(Clone, Debug, Default)]
pub struct ExpertMap {
    /// Layer → spans indexed by expert id (ids are checked to be exactly `0..n`).
    layers: BTreeMap<usize, Vec<ExpertSpan>>,
}

impl ExpertMap {
    /// Scans tensor names `{anything}model.layers.{L}.block_sparse_moe.experts.{E}.w{1,2,3}.{weight_packed|weight_scale|weight}`.
    ///
    /// Checks, per expert: every part present, one dtype rule per format, consistent shapes, and all
    /// parts stored back to back in the documented order within one shard. Per layer: one format, the
    /// same shapes for every expert, and expert ids `0..n` without gaps. Any other tensor under
    /// `block_sparse_moe.experts.` is an error.
    pub fn build(files: &ModelFiles) -> Result<Self> {
        let mut found: BTreeMap<usize, BTreeMap<usize, Pending>> = BTreeMap::new();
        for info in files.tensors() {
            let Some(name) = parse_name(&info.name)? else {
                continue;
            };
            let pending = found
                .entry(name.layer)
                .or_default()
                .entry(name.expert)
                .or_insert_with(|| Pending::new(name.prefix));
            pending.insert(name.layer, name.expert, name.slot, info)?;
        }
        let mut layers = BTreeMap::new();
        for (layer, experts) in found {
            layers.insert(layer, build_layer(layer, experts)?);
        }
        Ok(ExpertMap { layers })
    }

    /// The span of one expert, if the map holds it.
    pub fn get(&self, layer: usize, expert: usize) -> Option<&ExpertSpan> {
        self.layers.get(&layer).and_then(|l| l.get(expert))
    }

    /// The span of one expert; [`StorageError::NoSuchExpert`] naming layer and expert if absent.
    pub fn span(&self, layer: usize, expert: usize) -> Result<&ExpertSpan> {
        self.get(layer, expert)
            .ok_or(StorageError::NoSuchExpert { layer, expert })
    }

    /// Sorted MoE layers that have experts.
    pub fn layers(&self) -> Vec<usize> {
        self.layers.keys().copied().collect()
    }

    /// Number of experts in `layer` (0 for a layer without experts).
    pub fn n_experts(&self, layer: usize) -> usize {
        self.layers.get(&layer).map_or(0, Vec::len)
    }

    /// True when the checkpoint has no routed experts at all.
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }
}

/// Which part of an expert a tensor is.
#[derive(Clone, Copy, Debug)]
enum Slot {
    /// Index into [`MXFP4_PARTS`].
    Mxfp4(usize),
    /// Index into [`DENSE_PARTS`].
    Dense(usize),
}

/// A parsed expert tensor name.
struct ExpertName<'a> {
    layer: usize,
    expert: usize,
    slot: Slot,
    /// Everything up to and including `experts.{E}.`, to name missing siblings in errors.
    prefix: &'a str,
}

/// `Ok(None)` for names outside `block_sparse_moe.experts.`; an error for names inside it that do not
/// follow the scheme.
fn parse_name(name: &str) -> Result<Option<ExpertName<'_>>> {
    let Some(marker) = name.find(EXPERTS_MARKER) else {
        return Ok(None);
    };
    let unknown = || StorageError::UnknownExpertTensor {
        tensor: name.to_string(),
    };
    let (head, tail) = (&name[..marker], &name[marker + EXPERTS_MARKER.len()..]);
    let (layers, layer) = head.rsplit_once('.').ok_or_else(unknown)?;
    if !layers.ends_with(LAYERS_PREFIX) {
        return Err(unknown());
    }
    let layer = parse_id(layer).ok_or_else(unknown)?;
    let mut fields = tail.split('.');
    // Exactly `{E}.w{k}.{kind}`; the last two fields are matched as one part name below.
    let (Some(expert), Some(_), Some(_), None) =
        (fields.next(), fields.next(), fields.next(), fields.next())
    else {
        return Err(unknown());
    };
    let expert_num = parse_id(expert).ok_or_else(unknown)?;
    let part = &tail[expert.len() + 1..];
    let slot = if let Some(i) = MXFP4_PARTS.iter().position(|p| *p == part) {
        Slot::Mxfp4(i)
    } else if let Some(i) = DENSE_PARTS.iter().position(|p| *p == part) {
        Slot::Dense(i)
    } else {
        return Err(unknown());
    };
    Ok(Some(ExpertName {
        layer,
        expert: expert_num,
        slot,
        prefix: &name[..name.len() - part.len()],
    }))
}

/// A canonical decimal id: digits only, no sign, no leading zeros (so `1` and `01` cannot both name
/// the same expert).
fn parse_id(s: &str) -> Option<usize> {
    let canonical = !s.is_empty()
        && s.bytes().all(|b| b.is_ascii_digit())
        && (s.len() == 1 || !s.starts_with('0'));
    if canonical { s.parse().ok() } else { None }
}

/// The tensors found so far for one expert.
struct Pending<'a> {
    prefix: &'a str,
    mxfp4: [Option<&'a TensorInfo>; 6],
    dense: [Option<&'a TensorInfo>; 3],
}

impl<'a> Pending<'a> {
    fn new(prefix: &'a str) -> Self {
        Pending {
            prefix,
            mxfp4: [None; 6],
            dense: [None; 3],
        }
    }

    fn insert(
        &mut self,
        layer: usize,
        expert: usize,
        slot: Slot,
        info: &'a TensorInfo,
    ) -> Result<()> {
        let cell = match slot {
            Slot::Mxfp4(i) => &mut self.mxfp4[i],
            Slot::Dense(i) => &mut self.dense[i],
        };
        if let Some(other) = cell {
            return Err(StorageError::DuplicateExpertTensor {
                layer,
                expert,
                tensor: info.name.clone(),
                other: other.name.clone(),
            });
        }
        *cell = Some(info);
        Ok(())
    }

    /// Which format the present tensors belong to; `None` if they mix both.
    fn kind(&self) -> Option<Kind> {
        let mx = self.mxfp4.iter().any(Option::is_some);
        let dense = self.dense.iter().any(Option::is_some);
        match (mx, dense) {
            (true, false) => Some(Kind::Mxfp4),
            (false, true) => Some(Kind::Dense),
            // (false, false) cannot happen: a Pending is created for a tensor it then holds.
            _ => None,
        }
    }
}

/// Format family, before the dense dtype is known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Mxfp4,
    Dense,
}

impl Kind {
    fn describe(self) -> &'static str {
        match self {
            Kind::Mxfp4 => "mxfp4",
            Kind::Dense => "dense",
        }
    }
}

/// Validates one layer's experts and turns them into spans indexed by id.
fn build_layer(layer: usize, experts: BTreeMap<usize, Pending<'_>>) -> Result<Vec<ExpertSpan>> {
    // Format family first, so a stray format is reported as such rather than as a dtype error.
    let mut layer_kind = None;
    for (&expert, pending) in &experts {
        let kind = pending
            .kind()
            .ok_or_else(|| StorageError::MixedExpertFormats {
                layer,
                expert,
                found: "a mix of mxfp4 and dense tensors".to_string(),
                expected: "one format".to_string(),
            })?;
        match layer_kind {
            None => layer_kind = Some(kind),
            Some(k) if k != kind => {
                return Err(StorageError::MixedExpertFormats {
                    layer,
                    expert,
                    found: kind.describe().to_string(),
                    expected: k.describe().to_string(),
                });
            }
            Some(_) => {}
        }
    }

    let max = experts.keys().next_back().copied().unwrap_or(0);
    let mut spans: Vec<ExpertSpan> = Vec::with_capacity(experts.len());
    for (i, (expert, pending)) in experts.into_iter().enumerate() {
        if expert != i {
            return Err(StorageError::MissingExpert {
                layer,
                expert: i,
                max,
            });
        }
        let span = match pending.kind() {
            Some(Kind::Mxfp4) => mxfp4_span(layer, expert, &pending)?,
            _ => dense_span(layer, expert, &pending)?,
        };
        if let Some(first) = spans.first() {
            check_same_as_first(first, &span, &pending)?;
        }
        spans.push(span);
    }
    Ok(spans)
}

/// Every expert of a layer must match expert 0 in format (dense dtype included) and shapes.
fn check_same_as_first(first: &ExpertSpan, span: &ExpertSpan, pending: &Pending<'_>) -> Result<()> {
    if first.format != span.format {
        return Err(StorageError::MixedExpertFormats {
            layer: span.layer,
            expert: span.expert,
            found: span.format.describe(),
            expected: first.format.describe(),
        });
    }
    let names = part_tensors(span.format, pending);
    for ((a, b), name) in first.parts.iter().zip(&span.parts).zip(names) {
        if a.shape != b.shape {
            return Err(StorageError::ExpertShape {
                layer: span.layer,
                expert: span.expert,
                tensor: name.name.clone(),
                shape: b.shape.clone(),
                reason: format!(
                    "expert {} of the same layer has {:?}; all experts of a layer must match",
                    first.expert, a.shape
                ),
            });
        }
    }
    Ok(())
}

/// The part tensors in storage order. Only called after the span was built, when all are present.
fn part_tensors<'a>(format: ExpertFormat, pending: &Pending<'a>) -> Vec<&'a TensorInfo> {
    match format {
        ExpertFormat::Mxfp4 => pending.mxfp4.iter().flatten().copied().collect(),
        ExpertFormat::Dense(_) => pending.dense.iter().flatten().copied().collect(),
    }
}

/// Shape, dtype and layout checks for one MXFP4 expert.
fn mxfp4_span(layer: usize, expert: usize, pending: &Pending<'_>) -> Result<ExpertSpan> {
    let parts = require_all(layer, expert, pending.prefix, &MXFP4_PARTS, &pending.mxfp4)?;
    for t in &parts {
        if t.dtype != Dtype::U8 {
            return Err(StorageError::ExpertDtype {
                layer,
                expert,
                tensor: t.name.clone(),
                dtype: t.dtype,
                expected: "U8".to_string(),
            });
        }
    }
    let [w1p, w1s, w2p, w2s, w3p, w3s] =
        [parts[0], parts[1], parts[2], parts[3], parts[4], parts[5]];
    let shape_err = |t: &TensorInfo, reason: String| StorageError::ExpertShape {
        layer,
        expert,
        tensor: t.name.clone(),
        shape: t.shape.clone(),
        reason,
    };
    // w1 packed is [inter, latent/2]: it fixes both dimensions.
    let &[inter, half_latent] = w1p.shape.as_slice() else {
        return Err(shape_err(
            w1p,
            "expected 2 dimensions [inter, latent/2]".to_string(),
        ));
    };
    let latent = half_latent * MXFP4_PER_BYTE;
    for (dim, what) in [(latent, "latent"), (inter, "intermediate")] {
        if dim == 0 || dim % MXFP4_GROUP != 0 {
            return Err(shape_err(
                w1p,
                format!("{what} size {dim} is not a positive multiple of {MXFP4_GROUP}"),
            ));
        }
    }
    let expected: [(&TensorInfo, [usize; 2], &str); 5] = [
        (w1s, [inter, latent / MXFP4_GROUP], "[inter, latent/32]"),
        (w2p, [latent, inter / MXFP4_PER_BYTE], "[latent, inter/2]"),
        (w2s, [latent, inter / MXFP4_GROUP], "[latent, inter/32]"),
        (
            w3p,
            [inter, latent / MXFP4_PER_BYTE],
            "[inter, latent/2] like w1",
        ),
        (
            w3s,
            [inter, latent / MXFP4_GROUP],
            "[inter, latent/32] like w1",
        ),
    ];
    for (t, shape, what) in expected {
        if t.shape != shape {
            return Err(shape_err(
                t,
                format!("expected {what} = {shape:?} (inter {inter}, latent {latent})"),
            ));
        }
    }
    contiguous_span(layer, expert, ExpertFormat::Mxfp4, &parts)
}

/// Shape, dtype and layout checks for one dense expert.
fn dense_span(layer: usize, expert: usize, pending: &Pending<'_>) -> Result<ExpertSpan> {
    let parts = require_all(layer, expert, pending.prefix, &DENSE_PARTS, &pending.dense)?;
    let [w1, w2, w3] = [parts[0], parts[1], parts[2]];
    let dtype = w1.dtype;
    if !matches!(dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32) {
        return Err(StorageError::ExpertDtype {
            layer,
            expert,
            tensor: w1.name.clone(),
            dtype,
            expected: "BF16, F16 or F32".to_string(),
        });
    }
    for t in [w2, w3] {
        if t.dtype != dtype {
            return Err(StorageError::ExpertDtype {
                layer,
                expert,
                tensor: t.name.clone(),
                dtype: t.dtype,
                expected: format!("{dtype} like w1.weight"),
            });
        }
    }
    let shape_err = |t: &TensorInfo, reason: String| StorageError::ExpertShape {
        layer,
        expert,
        tensor: t.name.clone(),
        shape: t.shape.clone(),
        reason,
    };
    let &[inter, hidden] = w1.shape.as_slice() else {
        return Err(shape_err(
            w1,
            "expected 2 dimensions [inter, hidden]".to_string(),
        ));
    };
    if inter == 0 || hidden == 0 {
        return Err(shape_err(
            w1,
            "expected non-empty [inter, hidden]".to_string(),
        ));
    }
    if w2.shape != [hidden, inter] {
        return Err(shape_err(
            w2,
            format!("expected [hidden, inter] = {:?}", [hidden, inter]),
        ));
    }
    if w3.shape != w1.shape {
        return Err(shape_err(
            w3,
            format!("expected [inter, hidden] = {:?} like w1", w1.shape),
        ));
    }
    contiguous_span(layer, expert, ExpertFormat::Dense(dtype), &parts)
}

/// All parts present, or an error naming the first missing tensor in full.
fn require_all<'a>(
    layer: usize,
    expert: usize,
    prefix: &str,
    names: &[&str],
    found: &[Option<&'a TensorInfo>],
) -> Result<Vec<&'a TensorInfo>> {
    names
        .iter()
        .zip(found)
        .map(|(name, t)| {
            t.ok_or_else(|| StorageError::MissingExpertPart {
                layer,
                expert,
                part: format!("{prefix}{name}"),
            })
        })
        .collect()
}

/// Checks that `parts` sit back to back in one shard, in the given order, and builds the span.
fn contiguous_span(
    layer: usize,
    expert: usize,
    format: ExpertFormat,
    parts: &[&TensorInfo],
) -> Result<ExpertSpan> {
    let not_contiguous = |detail: String| StorageError::ExpertNotContiguous {
        layer,
        expert,
        detail,
    };
    let Some(first) = parts.first() else {
        return Err(not_contiguous("expert has no tensors".to_string()));
    };
    for pair in parts.windows(2) {
        let (prev, next) = (pair[0], pair[1]);
        if next.shard != prev.shard {
            return Err(not_contiguous(format!(
                "{} is in shard {} but {} is in shard {}",
                prev.name, prev.shard, next.name, next.shard
            )));
        }
        let prev_end = prev.offset + prev.len;
        if next.offset != prev_end {
            return Err(not_contiguous(format!(
                "{} ends at byte {} but {} starts at byte {}",
                prev.name, prev_end, next.name, next.offset
            )));
        }
    }
    // Contiguity was just checked, so offsets ascend from `first` and the subtraction cannot wrap.
    let parts: Vec<ExpertPart> = parts
        .iter()
        .map(|t| ExpertPart {
            rel_offset: t.offset - first.offset,
            len: t.len,
            shape: t.shape.clone(),
            dtype: t.dtype,
        })
        .collect();
    Ok(ExpertSpan {
        layer,
        expert,
        shard: first.shard,
        offset: first.offset,
        len: parts.iter().map(|p| p.len).sum(),
        format,
        parts,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(name: &str) -> Option<(usize, usize, String)> {
        let n = parse_name(name).ok()??;
        Some((n.layer, n.expert, n.prefix.to_string()))
    }

    #[test]
    fn parses_k3_and_kimi_linear_names() {
        assert_eq!(
            parsed("language_model.model.layers.12.block_sparse_moe.experts.305.w2.weight_scale"),
            Some((
                12,
                305,
                "language_model.model.layers.12.block_sparse_moe.experts.305.".to_string()
            ))
        );
        assert_eq!(
            parsed("model.layers.1.block_sparse_moe.experts.0.w3.weight"),
            Some((
                1,
                0,
                "model.layers.1.block_sparse_moe.experts.0.".to_string()
            ))
        );
    }

    #[test]
    fn ignores_other_tensors() {
        for name in [
            "model.layers.1.block_sparse_moe.shared_experts.up_proj.weight",
            "model.layers.1.block_sparse_moe.gate.weight",
            "lm_head.weight",
        ] {
            assert!(matches!(parse_name(name), Ok(None)), "{name}");
        }
    }

    #[test]
    fn rejects_odd_expert_names() {
        for name in [
            "model.layers.1.block_sparse_moe.experts.0.w4.weight",
            "model.layers.1.block_sparse_moe.experts.0.w1.bias",
            "model.layers.1.block_sparse_moe.experts.01.w1.weight",
            "model.layers.x.block_sparse_moe.experts.0.w1.weight",
            "model.layers.1.block_sparse_moe.experts.0.w1.weight.extra",
            "model.blocks.1.block_sparse_moe.experts.0.w1.weight",
        ] {
            assert!(
                matches!(
                    parse_name(name),
                    Err(StorageError::UnknownExpertTensor { .. })
                ),
                "{name}"
            );
        }
    }
}
