//! Counters the store keeps and the snapshot `Store::stats` returns.

use std::sync::atomic::{AtomicU64, Ordering};

/// Declares `Stats` and its `fields()` from one list, so a field is named
/// once: its doc comment, name and type.
macro_rules! stats {
    ($($(#[$doc:meta])* $name:ident: $ty:ty,)*) => {
        /// A point-in-time view of the store.
        #[derive(Debug, Clone, Default, PartialEq, Eq)]
        pub struct Stats {
            $($(#[$doc])* pub $name: $ty,)*
        }

        impl Stats {
            /// Every field with its name, in declaration order: the one
            /// list the server's STATS reply and the Python binding's dict
            /// are made from.
            pub fn fields(&self) -> Vec<(&'static str, StatValue)> {
                vec![$((stringify!($name), self.$name.stat_value()),)*]
            }
        }
    };
}

stats! {
    /// Keys in the index (in any tier).
    entries: u64,
    /// Values held in the memory pool (including ones pinned by readers or
    /// waiting for the flusher after being replaced).
    memory_entries: u64,
    memory_bytes: u64,
    memory_capacity: u64,
    /// Keys with a durable copy on disk, and those values' bytes.
    disk_entries: u64,
    disk_value_bytes: u64,
    /// Bytes of region files (values, records, padding, dead space).
    disk_used_bytes: u64,
    disk_capacity: u64,
    disk_regions: u64,
    /// Region files moved to `quarantine/` at open (their header could not
    /// be read or verified), and regions where recovery skipped pages
    /// without a valid batch: counted by the last open, not since creation.
    quarantined_regions: u64,
    damaged_regions: u64,
    /// What else the last open decided (see `RecoveryReport`): regions
    /// kept despite a damaged header, regions quarantined because their
    /// records were keyed with another secret, files under region names it
    /// could neither use nor move, regions read without O_DIRECT because
    /// their file refused it, regions whose entries were not indexed
    /// because a region newer than them is missing, and values the tail
    /// scrub dropped after an unclean shutdown.
    damaged_headers: u64,
    foreign_regions: u64,
    skipped_region_files: u64,
    buffered_regions: u64,
    regions_behind_gap: u64,
    scrub_dropped: u64,
    /// Entries the last open indexed from a local index checkpoint instead
    /// of reading batch records (0: it read every record).
    checkpoint_entries_loaded: u64,
    memory_hits: u64,
    disk_hits: u64,
    misses: u64,
    /// Values dropped from the memory pool to make room.
    evictions: u64,
    /// Regions reclaimed, and the entries dropped or carried with them.
    reclaimed_regions: u64,
    reclaimed_entries: u64,
    carried_entries: u64,
    /// Disk reads whose checksum or key digest did not match: each was
    /// reported as a miss and its entry dropped.
    checksum_failures: u64,
    puts: u64,
    removes: u64,
    /// Batches written by the flusher, and those that failed.
    flushed_batches: u64,
    /// Failed batch write attempts (each batch is retried until it lands).
    flush_errors: u64,
    /// Writes whose last attempt failed and that wait for the next: not
    /// durable yet; `flush` fails while any of its writes is among them.
    retrying_writes: u64,
    /// Bytes the index's hash tables occupy.
    index_bytes: u64,
    /// Bytes the eviction policy's queues, ghosts and (adaptive) miniature
    /// simulations occupy.
    policy_bytes: u64,
    /// What the pool's eviction does now: `lru`, or `s3fifo-N` (S3-FIFO with
    /// an N% probation queue); the adaptive policy moves between them.
    eviction_mode: String,
    /// Nanoseconds spent in the eviction policy (queue updates, victim
    /// choice, simulations); counted only with `Config::time_policy`.
    policy_ns: u64,
    io_engine: &'static str,
    /// The io engine's queue depth and disk read piece in effect
    /// (`Config::io_depth`, `Config::read_piece`): the shape of the store's
    /// disk reads.
    io_depth: u32,
    read_piece: u64,
    /// Whether region files are read and written with O_DIRECT (false where
    /// the file system refused it and buffered I/O is used).
    direct_io: bool,
    /// Whether the io engine writes from the memory pool as io_uring fixed
    /// buffers (pinned once at open, not per write).
    io_fixed_buffers: bool,
    /// Whether the io engine names region files by registered slots.
    io_registered_files: bool,
    /// The storage deadline in milliseconds (`Config::io_deadline`; 0:
    /// none).
    io_deadline_ms: u64,
    /// Values answered as a miss because their read did not complete
    /// within the deadline (or was not started while too many reads were
    /// held past it).
    io_deadline_misses: u64,
    /// Flushes, and puts and removes waiting for the disk, answered with a
    /// `TimedOut` error past the deadline (their writes stay queued).
    io_deadline_write_errors: u64,
    /// Times reads went from all answering to some held past the deadline.
    io_stalls: u64,
    /// Read batches held past their deadline now (the kernel has not
    /// returned them), and the bytes of the store's buffers they hold.
    io_stalled_reads: u64,
    io_stalled_read_bytes: u64,
    /// Whether the log lives in a shared directory (`Config::shared_dir`).
    shared_dir: bool,
    /// Other writers of the shared directory followed, their region files
    /// and those files' bytes.
    shared_writers: u64,
    shared_regions: u64,
    /// Those held open read through the page cache (`shared_read_mode`:
    /// buffered on network and FUSE file systems by default); the rest
    /// are read O_DIRECT.
    shared_buffered_regions: u64,
    shared_bytes: u64,
    /// Their batches indexed since open.
    shared_batches: u64,
    /// Their regions whose newest page does not hold a whole batch record
    /// yet (a flush in progress, or a writer that died in one).
    shared_stuck_regions: u64,
    /// Removes remembered so that an older put read later is not indexed.
    shared_tombstones: u64,
    /// Other writers' entries not indexed because their numbers read more
    /// than 5 minutes ahead of this node's clock (a writer's clock is wrong).
    shared_clock_ahead_entries: u64,
    /// Other writers' region files not followed because a region between
    /// them and their writer's head is missing (their writer, restarted,
    /// does not index them either: the missing region may have removed
    /// their puts).
    shared_regions_behind_gap: u64,
    /// Other writers' region files not followed at the last pass because
    /// the descriptors kept for them were spent (`Store::set_shared_file_budget`):
    /// their blocks are misses.
    shared_regions_over_file_budget: u64,
    /// Directories under the shared directory's `nodes/` not followed at
    /// the last pass because they never held a writer's `LOCK` (planted,
    /// or left by an interrupted collection).
    shared_dirs_without_lock: u64,
    /// Other writers whose files did not answer within the storage
    /// deadline (`Config::io_deadline`) at the last pass and still do not:
    /// their logs are not followed meanwhile (their new blocks are misses).
    shared_writers_stalled: u64,
    /// Other writers' index checkpoints loaded since open, and the entries
    /// they gave (instead of reading those writers' records).
    shared_checkpoints_loaded: u64,
    shared_checkpoint_entries: u64,
    /// Follow passes since open, and milliseconds since the last began.
    shared_polls: u64,
    shared_follow_age_ms: u64,
    /// Disk hits served from other writers' files.
    shared_reads: u64,
    /// Reads of other writers' files that failed (a file reclaimed or
    /// replaced under the read): each was a miss.
    shared_read_failures: u64,
    /// Bounded index mode (`Config::shared_index_share`): on, other
    /// writers' put entries passed over as another node's share, and the
    /// times a new share made this node read their records again.
    shared_index_share: bool,
    shared_outside_share: u64,
    shared_share_rereads: u64,
}

/// One field of [`Stats`], for serialisers that need no per-field code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StatValue {
    Count(u64),
    Flag(bool),
    Name(String),
}

/// How a field's type shows in `fields()`.
trait AsStatValue {
    fn stat_value(&self) -> StatValue;
}

impl AsStatValue for u64 {
    fn stat_value(&self) -> StatValue {
        StatValue::Count(*self)
    }
}

impl AsStatValue for u32 {
    fn stat_value(&self) -> StatValue {
        StatValue::Count(u64::from(*self))
    }
}

impl AsStatValue for bool {
    fn stat_value(&self) -> StatValue {
        StatValue::Flag(*self)
    }
}

impl AsStatValue for String {
    fn stat_value(&self) -> StatValue {
        StatValue::Name(self.clone())
    }
}

impl AsStatValue for &'static str {
    fn stat_value(&self) -> StatValue {
        StatValue::Name((*self).to_string())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_name_every_field_once_with_its_value() {
        let stats = Stats {
            entries: 7,
            io_depth: 64,
            direct_io: true,
            io_engine: "uring",
            eviction_mode: "lru".into(),
            shared_share_rereads: 3,
            ..Stats::default()
        };
        let fields = stats.fields();
        let names: std::collections::HashSet<&str> = fields.iter().map(|(n, _)| *n).collect();
        assert_eq!(names.len(), fields.len(), "a name twice");
        for (name, value) in [
            ("entries", StatValue::Count(7)),
            ("io_depth", StatValue::Count(64)),
            ("direct_io", StatValue::Flag(true)),
            ("io_engine", StatValue::Name("uring".into())),
            ("eviction_mode", StatValue::Name("lru".into())),
            ("shared_share_rereads", StatValue::Count(3)),
            ("misses", StatValue::Count(0)),
        ] {
            assert!(fields.contains(&(name, value.clone())), "{name}: {value:?}");
        }
        assert_eq!(fields.first().map(|f| f.0), Some("entries"));
    }
}
