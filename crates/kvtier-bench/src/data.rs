//! Bench values: the key-derived pattern from `kvtier::pattern` (never
//! zeros), so every read can be verified against what was written.

pub use kvtier::pattern::{fill, verify};

pub fn key(op: &str, value_size: u64, batch: usize, i: u64) -> Vec<u8> {
    format!("bench/{op}/{value_size}/{batch}/{i}").into_bytes()
}

/// A page-aligned buffer with every page already written, as an engine's
/// pinned host pool is: the kernel's first-touch zeroing and page faults
/// would otherwise land inside whichever timed call uses it first.
pub fn touched_buffer(len: usize) -> kvtier::AlignedBuf {
    let mut buf = kvtier::AlignedBuf::zeroed(len);
    buf.as_mut_slice().fill(0xa5);
    buf
}
