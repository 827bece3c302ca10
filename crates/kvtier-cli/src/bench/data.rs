//! Bench values: the key-derived pattern from `kvtier::pattern` (never
//! zeros), so every read can be verified against what was written.

pub use kvtier::pattern::{fill, verify};

pub fn key(op: &str, value_size: u64, batch: usize, i: u64) -> Vec<u8> {
    format!("bench/{op}/{value_size}/{batch}/{i}").into_bytes()
}
