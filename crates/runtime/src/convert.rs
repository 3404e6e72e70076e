//! Conversion of stored dense tensors (f32, bf16, f16) to f32.

use deltafin_quant::{DenseData, collect_on_huge_pages};
use deltafin_storage::Dtype;
use half::{bf16, f16};

/// Little-endian bytes of a dense weight in the precision the engine keeps it: bf16 stays bf16 (half the memory
/// of f32, converted exactly inside the kernels), f32 stays f32, f16 becomes f32. `None` for non-float dtypes.
pub fn dense_data(bytes: &[u8], dtype: Dtype) -> Option<DenseData> {
    match dtype {
        Dtype::BF16 => Some(DenseData::Bf16(collect_on_huge_pages(
            bytes
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]])),
        ))),
        _ => to_f32(bytes, dtype).map(DenseData::F32),
    }
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
