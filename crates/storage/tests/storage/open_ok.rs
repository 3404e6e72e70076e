//! Positive tests: every fixture opens, tensors resolve to the right place, expert spans are sound.

use deltafin_storage::{Dtype, ExpertFormat, ExpertMap, ModelFiles, StorageError};

use crate::common::{K3_A, K3_B, KL_NOQLORA, KL_QLORA, fixture};

/// What one fixture must look like once opened.
struct Expected {
    fixture: &'static str,
    n_shards: usize,
    /// A tensor with its shard index, dtype and shape.
    probe: (&'static str, usize, Dtype, &'static [usize]),
    /// An F32 tensor whose bytes are read back.
    f32_tensor: &'static str,
    expert_layers: &'static [usize],
    n_experts: usize,
    format: ExpertFormat,
}

fn check(exp: Expected) {
    let dir = fixture(exp.fixture);
    let files = ModelFiles::open(&dir).unwrap_or_else(|e| panic!("{}: {e}", exp.fixture));
    assert_eq!(files.dir(), dir.as_path());
    assert_eq!(files.shards().len(), exp.n_shards, "{}", exp.fixture);
    for shard in files.shards() {
        let on_disk = std::fs::metadata(&shard.path)
            .expect("shard metadata")
            .len();
        assert_eq!(shard.file_len, on_disk, "{}", shard.file_name);
        assert!(shard.data_start > 8 && shard.data_start <= shard.file_len);
    }

    // Lookup.
    let (name, shard, dtype, shape) = exp.probe;
    let info = files.tensor(name).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        (info.shard, info.dtype, info.shape.as_slice()),
        (shard, dtype, shape)
    );
    assert_eq!(info.name, name);
    assert!(files.get("no.such.tensor").is_none());
    assert!(matches!(
        files.tensor("no.such.tensor"),
        Err(StorageError::MissingTensor { .. })
    ));

    // Every tensor lies inside the data region of its shard, in file order without overlap.
    let mut prev: Option<(usize, u64)> = None;
    for t in files.tensors() {
        let s = &files.shards()[t.shard];
        assert!(
            t.offset >= s.data_start && t.offset + t.len <= s.file_len,
            "{}",
            t.name
        );
        let expected_len = t.shape.iter().product::<usize>() * t.dtype.size_bytes();
        assert_eq!(t.len, expected_len as u64, "{}", t.name);
        if let Some((shard, end)) = prev
            && shard == t.shard
        {
            assert!(t.offset >= end, "{} overlaps its predecessor", t.name);
        }
        prev = Some((t.shard, t.offset + t.len));
    }
    assert_eq!(
        files.total_tensor_bytes(),
        files.tensors().map(|t| t.len).sum::<u64>()
    );

    // An f32 tensor reads back with the right length and the bytes that are on disk.
    let f32_info = files
        .tensor(exp.f32_tensor)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(f32_info.dtype, Dtype::F32);
    let bytes = files
        .read_tensor(f32_info)
        .unwrap_or_else(|e| panic!("{e}"));
    let n_elems: usize = f32_info.shape.iter().product();
    assert_eq!(bytes.len(), n_elems * 4);
    let raw = std::fs::read(&files.shards()[f32_info.shard].path).expect("read shard");
    let at = f32_info.offset as usize;
    assert_eq!(bytes, raw[at..at + bytes.len()]);

    // Experts.
    let experts = ExpertMap::build(&files).unwrap_or_else(|e| panic!("{}: {e}", exp.fixture));
    assert!(!experts.is_empty());
    assert_eq!(experts.layers(), exp.expert_layers);
    assert_eq!(experts.n_experts(0), 0, "layer 0 is dense");
    for &layer in exp.expert_layers {
        assert_eq!(experts.n_experts(layer), exp.n_experts, "layer {layer}");
        for expert in 0..exp.n_experts {
            let span = experts
                .span(layer, expert)
                .unwrap_or_else(|e| panic!("{e}"));
            check_span(&files, span, exp.format);
        }
        assert!(experts.get(layer, exp.n_experts).is_none());
    }
}

/// A span is the concatenation of its parts, and reading it equals reading each part tensor.
fn check_span(files: &ModelFiles, span: &deltafin_storage::ExpertSpan, format: ExpertFormat) {
    assert_eq!(span.format, format);
    let n_parts = match format {
        ExpertFormat::Mxfp4 => 6,
        ExpertFormat::Dense(_) => 3,
    };
    assert_eq!(span.parts.len(), n_parts);
    assert_eq!(span.len, span.parts.iter().map(|p| p.len).sum::<u64>());
    let mut at = 0;
    for p in &span.parts {
        assert_eq!(
            p.rel_offset, at,
            "layer {} expert {}",
            span.layer, span.expert
        );
        at += p.len;
    }
    let mut buf = vec![0u8; span.len as usize];
    files
        .read_span(span.shard, span.offset, span.len, &mut buf)
        .unwrap_or_else(|e| panic!("{e}"));
    // The first part is the w1 tensor: check it byte for byte against a tensor read.
    let w1_name = files
        .tensors()
        .find(|t| t.shard == span.shard && t.offset == span.offset && t.len > 0)
        .expect("a tensor starts where the span starts");
    assert!(w1_name.name.contains(&format!(
        "layers.{}.block_sparse_moe.experts.{}.w1.",
        span.layer, span.expert
    )));
    let w1 = files.read_tensor(w1_name).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(&buf[..w1.len()], w1.as_slice());
}

#[test]
fn k3_tiny_a() {
    check(Expected {
        fixture: K3_A,
        n_shards: 7,
        probe: (
            "language_model.model.layers.2.block_sparse_moe.experts.0.w1.weight_packed",
            2,
            Dtype::U8,
            &[32, 16],
        ),
        f32_tensor: "language_model.model.layers.1.self_attn.dt_bias",
        expert_layers: &[1, 2, 3, 4, 5],
        n_experts: 16,
        format: ExpertFormat::Mxfp4,
    });
}

#[test]
fn k3_tiny_b() {
    check(Expected {
        fixture: K3_B,
        n_shards: 10,
        probe: ("language_model.lm_head.weight", 9, Dtype::BF16, &[912, 96]),
        f32_tensor: "language_model.model.layers.1.block_sparse_moe.gate.e_score_correction_bias",
        expert_layers: &[1, 2, 3, 4, 5, 6, 7, 8],
        n_experts: 32,
        format: ExpertFormat::Mxfp4,
    });
}

#[test]
fn kimi_linear_qlora() {
    check(Expected {
        fixture: KL_QLORA,
        n_shards: 1,
        probe: (
            "model.layers.1.block_sparse_moe.experts.0.w2.weight",
            0,
            Dtype::F32,
            &[64, 32],
        ),
        f32_tensor: "lm_head.weight",
        expert_layers: &[1, 2, 3, 4, 5],
        n_experts: 8,
        format: ExpertFormat::Dense(Dtype::F32),
    });
}

#[test]
fn kimi_linear_noqlora() {
    check(Expected {
        fixture: KL_NOQLORA,
        n_shards: 1,
        probe: (
            "model.layers.0.mlp.down_proj.weight",
            0,
            Dtype::F32,
            &[64, 128],
        ),
        f32_tensor: "model.layers.1.self_attn.dt_bias",
        expert_layers: &[1, 2, 3, 4, 5],
        n_experts: 8,
        format: ExpertFormat::Dense(Dtype::F32),
    });
}

/// K3 stores experts in string order (0, 1, 10, 11, ..., 2, ...): the map must follow the header.
#[test]
fn k3_experts_follow_header_not_numeric_order() {
    let files = ModelFiles::open(&fixture(K3_A)).unwrap_or_else(|e| panic!("{e}"));
    let experts = ExpertMap::build(&files).unwrap_or_else(|e| panic!("{e}"));
    let e2 = experts.span(1, 2).unwrap_or_else(|e| panic!("{e}"));
    let e10 = experts.span(1, 10).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        e10.offset < e2.offset,
        "expert 10 precedes expert 2 on disk"
    );
    let p = &e2.parts;
    assert_eq!(p[0].shape, [32, 16]);
    assert_eq!(p[1].shape, [32, 1]);
    assert!(p.iter().all(|p| p.dtype == Dtype::U8));
}

/// Reader threads share one `ModelFiles` and one `ExpertMap`.
#[test]
fn shareable_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<ModelFiles>();
    assert_send_sync::<ExpertMap>();
}

#[test]
fn forged_tensor_info_is_refused_before_allocating() {
    let files = ModelFiles::open(&fixture(KL_QLORA)).unwrap_or_else(|e| panic!("{e}"));
    let mut info = files
        .tensor("lm_head.weight")
        .unwrap_or_else(|e| panic!("{e}"))
        .clone();
    info.len = u64::MAX / 2;
    let e = files.read_tensor(&info).expect_err("forged length");
    assert!(matches!(e, StorageError::OutOfRange { .. }), "{e}");
}
