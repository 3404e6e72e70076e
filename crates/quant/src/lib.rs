//! Weight formats and the kernels that multiply by them without materialising the weights.
//!
//! This crate knows byte slices and `f32` vectors only: no files, no async, no model. Every kernel has a
//! plain scalar reference (`*_ref`) that faster paths are tested against.
#![deny(missing_docs)]

pub mod error;
pub mod mxfp4;

pub use error::{QuantError, Result};
pub use mxfp4::{MXFP4_GROUP, Mxfp4Matrix, e2m1_value, e8m0_scale};
