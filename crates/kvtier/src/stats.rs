//! Counters the store keeps and the snapshot `Store::stats` returns.

use std::sync::atomic::{AtomicU64, Ordering};

/// A point-in-time view of the store.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// Keys in the index (in any tier).
    pub entries: u64,
    /// Values held in the memory pool (including ones pinned by readers or
    /// waiting for the flusher after being replaced).
    pub memory_entries: u64,
    pub memory_bytes: u64,
    pub memory_capacity: u64,
    /// Keys with a durable copy on disk, and those values' bytes.
    pub disk_entries: u64,
    pub disk_value_bytes: u64,
    /// Bytes of region files (values, records, padding, dead space).
    pub disk_used_bytes: u64,
    pub disk_capacity: u64,
    pub disk_regions: u64,
    /// Region files moved to `quarantine/` at open (their header could not
    /// be read or verified), and regions where recovery skipped pages
    /// without a valid batch: counted by the last open, not since creation.
    pub quarantined_regions: u64,
    pub damaged_regions: u64,
    /// What else the last open decided (see `RecoveryReport`): regions
    /// kept despite a damaged header, regions quarantined because their
    /// records were keyed with another secret, files under region names it
    /// could neither use nor move, regions read without O_DIRECT because
    /// their file refused it, regions whose entries were not indexed
    /// because a region newer than them is missing, and values the tail
    /// scrub dropped after an unclean shutdown.
    pub damaged_headers: u64,
    pub foreign_regions: u64,
    pub skipped_region_files: u64,
    pub buffered_regions: u64,
    pub regions_behind_gap: u64,
    pub scrub_dropped: u64,
    pub memory_hits: u64,
    pub disk_hits: u64,
    pub misses: u64,
    /// Values dropped from the memory pool to make room.
    pub evictions: u64,
    /// Regions reclaimed, and the entries dropped or carried with them.
    pub reclaimed_regions: u64,
    pub reclaimed_entries: u64,
    pub carried_entries: u64,
    /// Disk reads whose checksum or key digest did not match: each was
    /// reported as a miss and its entry dropped.
    pub checksum_failures: u64,
    pub puts: u64,
    pub removes: u64,
    /// Batches written by the flusher, and those that failed.
    pub flushed_batches: u64,
    /// Failed batch write attempts (each batch is retried until it lands).
    pub flush_errors: u64,
    /// Writes whose last attempt failed and that wait for the next: not
    /// durable yet; `flush` fails while any of its writes is among them.
    pub retrying_writes: u64,
    /// Bytes the index's hash tables occupy.
    pub index_bytes: u64,
    /// Bytes the eviction policy's queues, ghosts and (adaptive) miniature
    /// simulations occupy.
    pub policy_bytes: u64,
    /// What the pool's eviction does now: `lru`, or `s3fifo-N` (S3-FIFO with
    /// an N% probation queue); the adaptive policy moves between them.
    pub eviction_mode: String,
    /// Nanoseconds spent in the eviction policy (queue updates, victim
    /// choice, simulations); counted only with `Config::time_policy`.
    pub policy_ns: u64,
    pub io_engine: &'static str,
    /// The io engine's queue depth and disk read piece in effect
    /// (`Config::io_depth`, `Config::read_piece`): the shape of the store's
    /// disk reads.
    pub io_depth: u32,
    pub read_piece: u64,
    /// Whether region files are read and written with O_DIRECT (false where
    /// the file system refused it and buffered I/O is used).
    pub direct_io: bool,
    /// Whether the io engine writes from the memory pool as io_uring fixed
    /// buffers (pinned once at open, not per write).
    pub io_fixed_buffers: bool,
    /// Whether the io engine names region files by registered slots.
    pub io_registered_files: bool,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub policy_ns: AtomicU64,
    pub memory_hits: AtomicU64,
    pub disk_hits: AtomicU64,
    pub misses: AtomicU64,
    pub evictions: AtomicU64,
    pub reclaimed_regions: AtomicU64,
    pub reclaimed_entries: AtomicU64,
    pub carried_entries: AtomicU64,
    pub checksum_failures: AtomicU64,
    pub puts: AtomicU64,
    pub removes: AtomicU64,
    pub flushed_batches: AtomicU64,
    pub flush_errors: AtomicU64,
}

impl Counters {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}
