//! Sizes every layer agrees on: the page that aligns everything on disk and
//! in the memory pool, and the binary units. A leaf: it imports nothing of
//! the crate, so the io engines, the disk format and the configuration can
//! all use it without importing each other.

pub const KIB: u64 = 1024;
pub const MIB: u64 = 1024 * KIB;
pub const GIB: u64 = 1024 * MIB;

/// The alignment of everything on disk and in the memory pool.
pub const PAGE_SIZE: u64 = 4096;

/// Largest value size the format can describe (value lengths are u32 on disk).
pub const MAX_VALUE_SIZE_LIMIT: u64 = u32::MAX as u64 - PAGE_SIZE + 1;

/// Rounds `n` up to a multiple of [`PAGE_SIZE`].
pub(crate) fn page_round_up(n: u64) -> u64 {
    n.div_ceil(PAGE_SIZE) * PAGE_SIZE
}
