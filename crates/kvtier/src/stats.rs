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
    /// The storage deadline in milliseconds (`Config::io_deadline`; 0:
    /// none).
    pub io_deadline_ms: u64,
    /// Values answered as a miss because their read did not complete
    /// within the deadline (or was not started while too many reads were
    /// held past it).
    pub io_deadline_misses: u64,
    /// Flushes, and puts and removes waiting for the disk, answered with a
    /// `TimedOut` error past the deadline (their writes stay queued).
    pub io_deadline_write_errors: u64,
    /// Times reads went from all answering to some held past the deadline.
    pub io_stalls: u64,
    /// Read batches held past their deadline now (the kernel has not
    /// returned them), and the bytes of the store's buffers they hold.
    pub io_stalled_reads: u64,
    pub io_stalled_read_bytes: u64,
    /// Whether the log lives in a shared directory (`Config::shared_dir`).
    pub shared_dir: bool,
    /// Other writers of the shared directory followed, their region files
    /// and those files' bytes.
    pub shared_writers: u64,
    pub shared_regions: u64,
    pub shared_bytes: u64,
    /// Their batches indexed since open.
    pub shared_batches: u64,
    /// Their regions whose newest page does not hold a whole batch record
    /// yet (a flush in progress, or a writer that died in one).
    pub shared_stuck_regions: u64,
    /// Removes remembered so that an older put read later is not indexed.
    pub shared_tombstones: u64,
    /// Other writers' entries not indexed because their numbers read more
    /// than 5 minutes ahead of this node's clock (a writer's clock is wrong).
    pub shared_clock_ahead_entries: u64,
    /// Other writers' region files not followed because a region between
    /// them and their writer's head is missing (their writer, restarted,
    /// does not index them either: the missing region may have removed
    /// their puts).
    pub shared_regions_behind_gap: u64,
    /// Other writers' region files not followed at the last pass because
    /// the descriptors kept for them were spent (`Store::set_shared_file_budget`):
    /// their blocks are misses.
    pub shared_regions_over_file_budget: u64,
    /// Directories under the shared directory's `nodes/` not followed at
    /// the last pass because they never held a writer's `LOCK` (planted,
    /// or left by an interrupted collection).
    pub shared_dirs_without_lock: u64,
    /// Other writers' index checkpoints loaded since open, and the entries
    /// they gave (instead of reading those writers' records).
    pub shared_checkpoints_loaded: u64,
    pub shared_checkpoint_entries: u64,
    /// Follow passes since open, and milliseconds since the last began.
    pub shared_polls: u64,
    pub shared_follow_age_ms: u64,
    /// Disk hits served from other writers' files.
    pub shared_reads: u64,
    /// Reads of other writers' files that failed (a file reclaimed or
    /// replaced under the read): each was a miss.
    pub shared_read_failures: u64,
    /// Bounded index mode (`Config::shared_index_share`): on, other
    /// writers' put entries passed over as another node's share, and the
    /// times a new share made this node read their records again.
    pub shared_index_share: bool,
    pub shared_outside_share: u64,
    pub shared_share_rereads: u64,
}

/// One field of [`Stats`], for serialisers that need no per-field code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StatValue {
    Count(u64),
    Flag(bool),
    Name(String),
}

impl Stats {
    /// Every field with its name, in declaration order: the one list the
    /// server's STATS reply and the Python binding's dict are made from.
    pub fn fields(&self) -> Vec<(&'static str, StatValue)> {
        vec![
            ("entries", StatValue::Count(self.entries)),
            ("memory_entries", StatValue::Count(self.memory_entries)),
            ("memory_bytes", StatValue::Count(self.memory_bytes)),
            ("memory_capacity", StatValue::Count(self.memory_capacity)),
            ("disk_entries", StatValue::Count(self.disk_entries)),
            ("disk_value_bytes", StatValue::Count(self.disk_value_bytes)),
            ("disk_used_bytes", StatValue::Count(self.disk_used_bytes)),
            ("disk_capacity", StatValue::Count(self.disk_capacity)),
            ("disk_regions", StatValue::Count(self.disk_regions)),
            (
                "quarantined_regions",
                StatValue::Count(self.quarantined_regions),
            ),
            ("damaged_regions", StatValue::Count(self.damaged_regions)),
            ("damaged_headers", StatValue::Count(self.damaged_headers)),
            ("foreign_regions", StatValue::Count(self.foreign_regions)),
            (
                "skipped_region_files",
                StatValue::Count(self.skipped_region_files),
            ),
            ("buffered_regions", StatValue::Count(self.buffered_regions)),
            (
                "regions_behind_gap",
                StatValue::Count(self.regions_behind_gap),
            ),
            ("scrub_dropped", StatValue::Count(self.scrub_dropped)),
            ("memory_hits", StatValue::Count(self.memory_hits)),
            ("disk_hits", StatValue::Count(self.disk_hits)),
            ("misses", StatValue::Count(self.misses)),
            ("evictions", StatValue::Count(self.evictions)),
            (
                "reclaimed_regions",
                StatValue::Count(self.reclaimed_regions),
            ),
            (
                "reclaimed_entries",
                StatValue::Count(self.reclaimed_entries),
            ),
            ("carried_entries", StatValue::Count(self.carried_entries)),
            (
                "checksum_failures",
                StatValue::Count(self.checksum_failures),
            ),
            ("puts", StatValue::Count(self.puts)),
            ("removes", StatValue::Count(self.removes)),
            ("flushed_batches", StatValue::Count(self.flushed_batches)),
            ("flush_errors", StatValue::Count(self.flush_errors)),
            ("retrying_writes", StatValue::Count(self.retrying_writes)),
            ("index_bytes", StatValue::Count(self.index_bytes)),
            ("policy_bytes", StatValue::Count(self.policy_bytes)),
            ("eviction_mode", StatValue::Name(self.eviction_mode.clone())),
            ("policy_ns", StatValue::Count(self.policy_ns)),
            ("io_engine", StatValue::Name(self.io_engine.to_string())),
            ("io_depth", StatValue::Count(u64::from(self.io_depth))),
            ("read_piece", StatValue::Count(self.read_piece)),
            ("direct_io", StatValue::Flag(self.direct_io)),
            ("io_fixed_buffers", StatValue::Flag(self.io_fixed_buffers)),
            (
                "io_registered_files",
                StatValue::Flag(self.io_registered_files),
            ),
            ("io_deadline_ms", StatValue::Count(self.io_deadline_ms)),
            (
                "io_deadline_misses",
                StatValue::Count(self.io_deadline_misses),
            ),
            (
                "io_deadline_write_errors",
                StatValue::Count(self.io_deadline_write_errors),
            ),
            ("io_stalls", StatValue::Count(self.io_stalls)),
            ("io_stalled_reads", StatValue::Count(self.io_stalled_reads)),
            (
                "io_stalled_read_bytes",
                StatValue::Count(self.io_stalled_read_bytes),
            ),
            ("shared_dir", StatValue::Flag(self.shared_dir)),
            ("shared_writers", StatValue::Count(self.shared_writers)),
            ("shared_regions", StatValue::Count(self.shared_regions)),
            ("shared_bytes", StatValue::Count(self.shared_bytes)),
            ("shared_batches", StatValue::Count(self.shared_batches)),
            (
                "shared_stuck_regions",
                StatValue::Count(self.shared_stuck_regions),
            ),
            (
                "shared_clock_ahead_entries",
                StatValue::Count(self.shared_clock_ahead_entries),
            ),
            (
                "shared_regions_over_file_budget",
                StatValue::Count(self.shared_regions_over_file_budget),
            ),
            (
                "shared_dirs_without_lock",
                StatValue::Count(self.shared_dirs_without_lock),
            ),
            (
                "shared_regions_behind_gap",
                StatValue::Count(self.shared_regions_behind_gap),
            ),
            (
                "shared_tombstones",
                StatValue::Count(self.shared_tombstones),
            ),
            (
                "shared_checkpoints_loaded",
                StatValue::Count(self.shared_checkpoints_loaded),
            ),
            (
                "shared_checkpoint_entries",
                StatValue::Count(self.shared_checkpoint_entries),
            ),
            ("shared_polls", StatValue::Count(self.shared_polls)),
            (
                "shared_follow_age_ms",
                StatValue::Count(self.shared_follow_age_ms),
            ),
            ("shared_reads", StatValue::Count(self.shared_reads)),
            (
                "shared_read_failures",
                StatValue::Count(self.shared_read_failures),
            ),
            (
                "shared_index_share",
                StatValue::Flag(self.shared_index_share),
            ),
            (
                "shared_outside_share",
                StatValue::Count(self.shared_outside_share),
            ),
            (
                "shared_share_rereads",
                StatValue::Count(self.shared_share_rereads),
            ),
        ]
    }
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
    pub shared_reads: AtomicU64,
    pub shared_read_failures: AtomicU64,
}

impl Counters {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}
