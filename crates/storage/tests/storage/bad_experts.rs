//! Broken expert layouts: the checkpoint opens, but `ExpertMap::build` must refuse it, naming the layer
//! and expert (and tensor) at fault.

use deltafin_storage::{ExpertMap, StorageError};
use serde_json::json;

use crate::common::{Broken, K3_A, KL_QLORA, assert_names, k3_expert, kl_expert};

#[test]
fn mxfp4_part_missing() {
    let b = Broken::copy(K3_A);
    let victim = k3_expert(2, 5, "w2.weight_scale");
    b.remove_tensor(&victim);
    let e = b.experts_err();
    assert!(matches!(e, StorageError::MissingExpertPart { .. }), "{e}");
    assert_names(&e, &["layer 2", "expert 5", &victim]);
}

#[test]
fn mxfp4_parts_out_of_order() {
    let b = Broken::copy(K3_A);
    // Same length, so the headers stay valid; only the order within the expert is wrong.
    b.swap_offsets(
        &k3_expert(2, 7, "w1.weight_scale"),
        &k3_expert(2, 7, "w3.weight_scale"),
    );
    let e = b.experts_err();
    assert!(matches!(e, StorageError::ExpertNotContiguous { .. }), "{e}");
    assert_names(&e, &["layer 2", "expert 7"]);
}

#[test]
fn mxfp4_parts_not_contiguous() {
    let b = Broken::copy(K3_A);
    // Expert 3's w2 now lives inside expert 4's bytes and vice versa.
    b.swap_offsets(
        &k3_expert(2, 3, "w2.weight_packed"),
        &k3_expert(2, 4, "w2.weight_packed"),
    );
    let e = b.experts_err();
    assert!(matches!(e, StorageError::ExpertNotContiguous { .. }), "{e}");
    assert_names(
        &e,
        &["layer 2", "expert 3", &k3_expert(2, 3, "w2.weight_packed")],
    );
}

#[test]
fn mxfp4_packed_and_scale_must_be_u8() {
    for part in ["w1.weight_packed", "w2.weight_scale"] {
        let b = Broken::copy(K3_A);
        let victim = k3_expert(3, 9, part);
        b.set_field(&victim, "dtype", json!("I8"));
        let e = b.experts_err();
        assert!(matches!(e, StorageError::ExpertDtype { .. }), "{part}: {e}");
        assert_names(&e, &["layer 3", "expert 9", &victim, "U8"]);
    }
}

#[test]
fn mxfp4_scale_shape_inconsistent_with_packed() {
    let b = Broken::copy(K3_A);
    let victim = k3_expert(1, 11, "w2.weight_scale");
    b.set_field(&victim, "shape", json!([1, 32]));
    let e = b.experts_err();
    assert!(matches!(e, StorageError::ExpertShape { .. }), "{e}");
    assert_names(&e, &["layer 1", "expert 11", &victim, "[latent, inter/32]"]);
}

#[test]
fn mxfp4_dims_must_be_multiples_of_32() {
    let b = Broken::copy(K3_A);
    let victim = k3_expert(1, 0, "w1.weight_packed");
    // [inter 64, latent 16]: same byte count, but latent is not a multiple of the group size.
    b.set_field(&victim, "shape", json!([64, 8]));
    let e = b.experts_err();
    assert!(matches!(e, StorageError::ExpertShape { .. }), "{e}");
    assert_names(&e, &["layer 1", "expert 0", &victim, "latent size 16"]);
}

#[test]
fn mixed_formats_in_one_layer() {
    let b = Broken::copy(K3_A);
    for w in ["w1", "w2", "w3"] {
        b.rename_tensor(
            &k3_expert(4, 5, &format!("{w}.weight_packed")),
            &k3_expert(4, 5, &format!("{w}.weight")),
        );
        b.remove_tensor(&k3_expert(4, 5, &format!("{w}.weight_scale")));
    }
    let e = b.experts_err();
    assert!(matches!(e, StorageError::MixedExpertFormats { .. }), "{e}");
    assert_names(&e, &["layer 4", "expert 5", "dense", "mxfp4"]);
}

#[test]
fn mixed_formats_in_one_expert() {
    let b = Broken::copy(K3_A);
    b.rename_tensor(
        &k3_expert(4, 12, "w1.weight_packed"),
        &k3_expert(4, 12, "w1.weight"),
    );
    let e = b.experts_err();
    assert!(matches!(e, StorageError::MixedExpertFormats { .. }), "{e}");
    assert_names(&e, &["layer 4", "expert 12", "mix"]);
}

#[test]
fn dense_dtype_mismatch_within_expert() {
    let b = Broken::copy(KL_QLORA);
    let victim = kl_expert(2, 6, "w2.weight");
    b.set_field(&victim, "dtype", json!("I32"));
    let e = b.experts_err();
    assert!(matches!(e, StorageError::ExpertDtype { .. }), "{e}");
    assert_names(&e, &["layer 2", "expert 6", &victim, "F32"]);
}

#[test]
fn dense_dtype_must_be_a_float() {
    let b = Broken::copy(KL_QLORA);
    for w in ["w1", "w2", "w3"] {
        b.set_field(
            &kl_expert(2, 0, &format!("{w}.weight")),
            "dtype",
            json!("I32"),
        );
    }
    let e = b.experts_err();
    assert!(matches!(e, StorageError::ExpertDtype { .. }), "{e}");
    assert_names(
        &e,
        &["layer 2", "expert 0", &kl_expert(2, 0, "w1.weight"), "BF16"],
    );
}

#[test]
fn dense_dtype_differs_between_experts() {
    let b = Broken::copy(KL_QLORA);
    // F32 [32, 64] has the bytes of BF16 [32, 128] and [64, 128]; keep the expert self-consistent.
    let e3 = |w: &str| kl_expert(3, 1, w);
    b.edit_header("model.safetensors", |h| {
        for (w, shape) in [
            ("w1.weight", [32, 128]),
            ("w2.weight", [128, 32]),
            ("w3.weight", [32, 128]),
        ] {
            h[&e3(w)]["dtype"] = json!("BF16");
            h[&e3(w)]["shape"] = json!(shape);
        }
    });
    let e = b.experts_err();
    assert!(matches!(e, StorageError::MixedExpertFormats { .. }), "{e}");
    assert_names(&e, &["layer 3", "expert 1", "BF16", "F32"]);
}

#[test]
fn dense_parts_out_of_order() {
    let b = Broken::copy(KL_QLORA);
    b.swap_offsets(&kl_expert(1, 1, "w1.weight"), &kl_expert(1, 1, "w3.weight"));
    let e = b.experts_err();
    assert!(matches!(e, StorageError::ExpertNotContiguous { .. }), "{e}");
    assert_names(&e, &["layer 1", "expert 1"]);
}

#[test]
fn dense_part_missing() {
    let b = Broken::copy(KL_QLORA);
    let victim = kl_expert(5, 7, "w2.weight");
    b.remove_tensor(&victim);
    let e = b.experts_err();
    assert!(matches!(e, StorageError::MissingExpertPart { .. }), "{e}");
    assert_names(&e, &["layer 5", "expert 7", &victim]);
}

#[test]
fn dense_w2_shape_must_transpose_w1() {
    let b = Broken::copy(KL_QLORA);
    let victim = kl_expert(1, 4, "w2.weight");
    b.set_field(&victim, "shape", json!([32, 64]));
    let e = b.experts_err();
    assert!(matches!(e, StorageError::ExpertShape { .. }), "{e}");
    assert_names(&e, &["layer 1", "expert 4", &victim, "[hidden, inter]"]);
}

#[test]
fn shapes_differ_between_experts_of_a_layer() {
    let b = Broken::copy(KL_QLORA);
    // Self-consistent [inter 64, hidden 32] with the same bytes, unlike the layer's [32, 64].
    b.set_field(&kl_expert(4, 3, "w1.weight"), "shape", json!([64, 32]));
    b.set_field(&kl_expert(4, 3, "w2.weight"), "shape", json!([32, 64]));
    b.set_field(&kl_expert(4, 3, "w3.weight"), "shape", json!([64, 32]));
    let e = b.experts_err();
    assert!(matches!(e, StorageError::ExpertShape { .. }), "{e}");
    assert_names(
        &e,
        &[
            "layer 4",
            "expert 3",
            &kl_expert(4, 3, "w1.weight"),
            "expert 0",
        ],
    );
}

#[test]
fn gap_in_expert_ids() {
    let b = Broken::copy(KL_QLORA);
    for w in ["w1", "w2", "w3"] {
        b.remove_tensor(&kl_expert(2, 3, &format!("{w}.weight")));
    }
    let e = b.experts_err();
    assert!(matches!(e, StorageError::MissingExpert { .. }), "{e}");
    assert_names(&e, &["layer 2", "expert 3"]);
}

#[test]
fn unknown_expert_tensor_name() {
    let b = Broken::copy(K3_A);
    let odd = k3_expert(1, 2, "w1.weight_zero_point");
    b.rename_tensor(&k3_expert(1, 2, "w1.weight_scale"), &odd);
    let e = b.experts_err();
    assert!(matches!(e, StorageError::UnknownExpertTensor { .. }), "{e}");
    assert_names(&e, &[&odd]);
}

#[test]
fn missing_expert_lookup_names_layer_and_expert() {
    let b = Broken::copy(KL_QLORA);
    let map = ExpertMap::build(&b.open()).unwrap_or_else(|e| panic!("{e}"));
    for (layer, expert) in [(0, 0), (1, 8), (99, 1)] {
        assert!(map.get(layer, expert).is_none());
        let e = map.span(layer, expert).expect_err("no such expert");
        assert!(matches!(e, StorageError::NoSuchExpert { .. }), "{e}");
        assert_names(
            &e,
            &[&format!("layer {layer}"), &format!("expert {expert}")],
        );
    }
}
