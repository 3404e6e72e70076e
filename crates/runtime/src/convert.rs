//! Conversion of stored dense tensors (f32, bf16, f16, int8) to the precision the engine keeps them in, in place
//! where the bytes allow.

use std::sync::Arc;

use deltafin_quant::{DenseData, SharedBytes, Words, collect_on_huge_pages};
use deltafin_storage::{Dtype, SpanBytes};
use half::{bf16, f16};

/// Little-endian bytes of a dense weight in the precision the engine keeps it: bf16 stays bf16 (half the memory
/// of f32, converted exactly inside the kernels), f32 stays f32, f16 becomes f32. `None` for non-float dtypes.
pub fn dense_data(bytes: &[u8], dtype: Dtype) -> Option<DenseData> {
    match dtype {
        Dtype::BF16 => Some(DenseData::Bf16(
            collect_on_huge_pages(
                bytes
                    .chunks_exact(2)
                    .map(|b| u16::from_le_bytes([b[0], b[1]])),
            )
            .into(),
        )),
        _ => to_f32(bytes, dtype).map(DenseData::F32),
    }
}

/// As [`dense_data`], but bf16 bytes in a read pool's buffer are used in place (no copy) when they are aligned:
/// the buffer then lives as long as the weight (and as long as any other holder of `bytes`: the spine's host tier
/// keeps a layer's buffers for every pass). Other bytes are copied: a plain vector is not on huge pages, and the
/// kernels read weights on 4 KiB pages more slowly (misaligned bytes, a checkpoint whose tensors start at odd
/// offsets, are copied too).
pub fn dense_data_in_place(bytes: Arc<SpanBytes>, dtype: Dtype) -> Option<DenseData> {
    let aligned = (bytes.as_ptr() as usize).is_multiple_of(2) && cfg!(target_endian = "little");
    if dtype == Dtype::BF16 && aligned && matches!(*bytes, SpanBytes::Pooled(_)) {
        let n = bytes.len() / 2;
        let owner: SharedBytes = bytes;
        return Some(match Words::<u16>::in_place(Arc::clone(&owner), 0, n) {
            Some(w) => DenseData::Bf16(w),
            // Not reached after the checks above; copying keeps it correct if it were.
            None => dense_data(&owner, dtype)?,
        });
    }
    dense_data(&bytes, dtype)
}

/// int8 values stored in `bytes`, in place when they are in a read pool's buffer (one-byte elements are always
/// aligned; see [`dense_data_in_place`]), else copied onto huge pages.
pub fn int8_in_place(bytes: Arc<SpanBytes>) -> Words<i8> {
    if cfg!(target_endian = "little") && matches!(*bytes, SpanBytes::Pooled(_)) {
        let n = bytes.len();
        let owner: SharedBytes = bytes;
        if let Some(w) = Words::<i8>::in_place(Arc::clone(&owner), 0, n) {
            return w;
        }
        // Not reached on a little-endian machine; copying keeps it correct if it were.
        return collect_on_huge_pages(owner.iter().map(|&b| b as i8)).into();
    }
    collect_on_huge_pages(bytes.iter().map(|&b| b as i8)).into()
}

/// Little-endian bytes of `dtype` as f32 values, or `None` for a dtype that is not a float.
pub fn to_f32(bytes: &[u8], dtype: Dtype) -> Option<Vec<f32>> {
    let halves = |convert: fn([u8; 2]) -> f32| {
        collect_on_huge_pages(bytes.chunks_exact(2).map(move |b| convert([b[0], b[1]])))
    };
    match dtype {
        Dtype::F32 => Some(collect_on_huge_pages(
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        )),
        Dtype::BF16 => Some(halves(|b| bf16::from_le_bytes(b).to_f32())),
        Dtype::F16 => Some(halves(|b| f16::from_le_bytes(b).to_f32())),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn converts_each_float_dtype() {
        assert_eq!(to_f32(&1.5f32.to_le_bytes(), Dtype::F32), Some(vec![1.5]));
        assert_eq!(
            to_f32(&bf16::from_f32(-2.0).to_le_bytes(), Dtype::BF16),
            Some(vec![-2.0])
        );
        assert_eq!(
            to_f32(&f16::from_f32(0.25).to_le_bytes(), Dtype::F16),
            Some(vec![0.25])
        );
        assert_eq!(to_f32(&[1, 2], Dtype::U8), None);
    }
}
