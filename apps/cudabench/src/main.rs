//! `deltafin-cudabench`: placeholder, filled in below.
fn main() {}
