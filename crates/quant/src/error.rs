//! The error type of the quant crate.

/// Everything that can go wrong when decoding a packed weight.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum QuantError {
    /// An E8M0 scale byte of 255, which the OCP microscaling spec reserves for NaN.
    #[error("e8m0 scale byte 255 (NaN) at row {row}, group {group}")]
    NanScale {
        /// Row of the weight matrix.
        row: usize,
        /// Group (block of 32 inputs) within the row.
        group: usize,
    },
    /// A buffer whose length does not match the declared matrix shape.
    #[error("{what}: expected {expected} bytes for a {rows}x{cols} matrix, got {actual}")]
    BadLength {
        /// Which buffer (packed or scale).
        what: &'static str,
        /// Rows of the logical matrix.
        rows: usize,
        /// Columns of the logical matrix.
        cols: usize,
        /// Bytes the shape requires.
        expected: usize,
        /// Bytes supplied.
        actual: usize,
    },
    /// A column count that is not a multiple of the group size.
    #[error("mxfp4 columns {cols} are not a multiple of {group}")]
    BadColumns {
        /// Columns of the logical matrix.
        cols: usize,
        /// Required multiple.
        group: usize,
    },
    /// An activation vector of the wrong length.
    #[error("input has {actual} values, the matrix has {expected} columns")]
    BadInput {
        /// Columns of the matrix.
        expected: usize,
        /// Length supplied.
        actual: usize,
    },
    /// An output layout that does not fit its matrix (heads that do not divide its rows, or one layout too few).
    #[error("output layout: {0}")]
    BadLayout(String),
    /// A host product of a matrix whose values live only on the GPU (see `DenseMatrix::release_host`).
    #[error("the {rows}x{cols} matrix's values are on the GPU only")]
    HostReleased {
        /// Rows of the matrix.
        rows: usize,
        /// Columns of the matrix.
        cols: usize,
    },
    /// CUDA was asked for but cannot be used here: no driver, no NVRTC library or no device.
    #[error("CUDA is unavailable: {0}")]
    CudaUnavailable(String),
    /// A CUDA call or kernel failed.
    #[error("cuda: {0}")]
    Cuda(String),
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, QuantError>;
