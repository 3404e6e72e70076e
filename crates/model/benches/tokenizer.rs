//! Tokenizer benchmark (placeholder).
fn main() {}
