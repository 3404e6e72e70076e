//! placeholder

pub mod chat;
pub mod tokenizer;
