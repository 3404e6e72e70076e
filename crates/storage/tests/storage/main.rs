//! Integration tests for `deltafin-storage`, driven through the real `ModelFiles::open` on real files:
//! the repository's fixtures, and broken copies of them written to temporary directories.

mod bad_experts;
mod bad_files;
mod common;
mod open_ok;
mod read_pool;
