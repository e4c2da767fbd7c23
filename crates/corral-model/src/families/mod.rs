//! Model families, one file each, reading top-down like the reference modeling files.

pub(crate) mod qwen3;
pub(crate) mod qwen3_next;
