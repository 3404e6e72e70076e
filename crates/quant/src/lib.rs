//! Weight formats and the kernels that multiply by them without materialising the weights.
//!
//! This crate knows byte slices and `f32` vectors only: no files, no async, no model. Every kernel has a plain
//! scalar reference (`*_ref`); the SIMD paths follow the same accumulation order (see [`dot`]) and are tested bit
//! for bit against it.
#![deny(missing_docs)]

pub mod aligned;
pub mod allocator;
pub mod bf16_contract;
pub mod bf16_lanes;
mod by_input;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dense;
pub mod dot;
pub mod error;
pub mod flops;
pub mod int8_contract;
pub mod membw;
pub mod mxfp4;
pub mod mxfp4_bf16_contract;
pub mod mxfp4_contract;
pub mod mxfp4_i16_contract;
pub mod mxfp4_lanes;
pub mod pages;
pub mod quantise;
pub mod simd;
pub mod words;
pub mod zeroed;

pub use dense::{DenseData, DenseMatrix, OutputLayout, gemm_many, gemm_many_laid_out};
pub use error::{QuantError, Result};
pub use mxfp4::{MXFP4_GROUP, Mxfp4Input, Mxfp4Matrix, e2m1_value, e8m0_scale};
pub use pages::{collect_on_huge_pages, huge_page_vec};
pub use words::{SharedBytes, Words};
