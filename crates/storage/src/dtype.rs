//! Element types as named in safetensors headers.

use std::fmt;

/// The element type of a stored tensor, as spelled in a safetensors header.
///
/// Only the types a deltafin checkpoint can contain are listed; FP8 and other exotic
/// safetensors types are rejected at open time with [`crate::StorageError::UnknownDtype`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// Boolean, one byte.
    Bool,
    /// Unsigned 8-bit integer (MXFP4 packed nibbles and E8M0 scales are stored as this).
    U8,
    /// Signed 8-bit integer.
    I8,
    /// Unsigned 16-bit integer.
    U16,
    /// Signed 16-bit integer.
    I16,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// Unsigned 32-bit integer.
    U32,
    /// Signed 32-bit integer.
    I32,
    /// IEEE single precision.
    F32,
    /// Unsigned 64-bit integer.
    U64,
    /// Signed 64-bit integer.
    I64,
    /// IEEE double precision.
    F64,
}

impl Dtype {
    /// Every dtype, for tests and tables.
    pub const ALL: [Dtype; 13] = [
        Dtype::Bool,
        Dtype::U8,
        Dtype::I8,
        Dtype::U16,
        Dtype::I16,
        Dtype::F16,
        Dtype::BF16,
        Dtype::U32,
        Dtype::I32,
        Dtype::F32,
        Dtype::U64,
        Dtype::I64,
        Dtype::F64,
    ];

    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            Dtype::Bool | Dtype::U8 | Dtype::I8 => 1,
            Dtype::U16 | Dtype::I16 | Dtype::F16 | Dtype::BF16 => 2,
            Dtype::U32 | Dtype::I32 | Dtype::F32 => 4,
            Dtype::U64 | Dtype::I64 | Dtype::F64 => 8,
        }
    }

    /// The dtype's spelling in a safetensors header (`"BF16"`, `"U8"`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            Dtype::Bool => "BOOL",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::U16 => "U16",
            Dtype::I16 => "I16",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::U32 => "U32",
            Dtype::I32 => "I32",
            Dtype::F32 => "F32",
            Dtype::U64 => "U64",
            Dtype::I64 => "I64",
            Dtype::F64 => "F64",
        }
    }

    /// Parses a safetensors dtype string; `None` for anything this crate does not know.
    ///
    /// The caller turns `None` into [`crate::StorageError::UnknownDtype`], which also names the file
    /// and tensor, context this function does not have.
    pub fn from_safetensors(s: &str) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|d| d.as_str() == s)
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_every_dtype() {
        for d in Dtype::ALL {
            assert_eq!(Dtype::from_safetensors(d.as_str()), Some(d));
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(Dtype::U8.size_bytes(), 1);
        assert_eq!(Dtype::BF16.size_bytes(), 2);
        assert_eq!(Dtype::F32.size_bytes(), 4);
        assert_eq!(Dtype::I64.size_bytes(), 8);
    }

    #[test]
    fn rejects_unknown_and_lower_case() {
        assert_eq!(Dtype::from_safetensors("F8_E4M3"), None);
        assert_eq!(Dtype::from_safetensors("bf16"), None);
        assert_eq!(Dtype::from_safetensors(""), None);
    }
}
