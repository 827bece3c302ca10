//! The background flusher: drains the write queue into large batches,
//! writes each with one vectored write plus `fdatasync`, and reclaims
//! whole regions, oldest first, to keep the disk tier under capacity.
//!
//! One thread does all disk writes, so batches land in sequence order and
//! "durable up to sequence N" is a single number.
//!
//! Both workers are built from the handles they need (the write log, the
//! disk tier, the index, the counters) and never hold the store: the store
//! builds them, and nothing here names it.

use crate::disk::format::{self, RecordEntry, RecordKind};
use crate::disk::{DiskTier, PendingBatch, ReadOutcome, RecoveredEntry, Region, ValueRead};
use crate::error::{Error, Result};
use crate::events::{BlockEvent, EventSink, Medium, QualifiedKey};
use crate::index::Index;
use crate::io::AlignedBuf;
use crate::key::{value_checksum, KeyDigest};
use crate::stats::Counters;
use crate::units::page_round_up;
use crate::write_log::{QueuedWrite, Work, WriteLog};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Most record entries in one batch, which bounds a record to ~2.4 MiB.
pub const MAX_BATCH_ENTRIES: usize = 8192;

/// The flusher's rule for what one batch takes, as a pure function of the
/// items offered in order (the bench replays the same rule): an item joins
/// while the batch's record (page-rounded) plus its padded values stay
/// within `limit` and it holds fewer than [`MAX_BATCH_ENTRIES`] entries.
/// The first item always joins (a batch is never empty).
#[derive(Debug, Clone)]
pub struct BatchBudget {
    limit: u64,
    entries: usize,
    key_bytes: usize,
    value_bytes: u64,
}

impl BatchBudget {
    pub fn new(limit: u64) -> Self {
        BatchBudget {
            limit,
            entries: 0,
            key_bytes: 0,
            value_bytes: 0,
        }
    }

    /// Offers an item whose qualified key is `key_len` bytes and whose value
    /// takes `padded` bytes on disk (0 for a tombstone); counts it and
    /// returns true if it joins the batch.
    pub fn admit(&mut self, key_len: usize, padded: u64) -> bool {
        if self.entries > 0 {
            let record = page_round_up(
                (format::record_len([])
                    + self.key_bytes
                    + (self.entries + 1) * format::ENTRY_FIXED_LEN
                    + key_len) as u64,
            );
            if record + self.value_bytes + padded > self.limit || self.entries >= MAX_BATCH_ENTRIES
            {
                return false;
            }
        }
        self.entries += 1;
        self.key_bytes += key_len;
        self.value_bytes += padded;
        true
    }
}

/// The flusher thread's work: a function of its handles.
pub(crate) struct Flusher {
    log: Arc<WriteLog>,
    disk: Arc<DiskTier>,
    index: Arc<Index>,
    counters: Arc<Counters>,
    reclaimer: Reclaimer,
    /// `Config::flush_batch_bytes`: the most bytes one batch may take.
    batch_bytes: u64,
    /// Run on this thread after each batch that landed, between batches
    /// (a shared directory's index checkpoints).
    after_batch: Option<AfterBatch>,
    /// Collecting a dead writer's log: every region below this id (all it
    /// had at open) is reclaimed before anything else.
    reclaim_before: Option<u32>,
    /// `Config::events`: a value is announced once its batch is durable.
    events: Option<Arc<EventSink>>,
    /// Failed batch writes since the last one that landed, and when one
    /// was last said: a failure that lasts (a lost writer lock, a full or
    /// stalled file system) is retried without end, and said once, then
    /// at most every `FAILURE_REPEAT` with how many attempts failed since.
    failures: std::sync::Mutex<(u64, Option<std::time::Instant>)>,
}

/// How often a batch write failure that lasts is said again.
const FAILURE_REPEAT: std::time::Duration = std::time::Duration::from_secs(10);

/// See `Flusher::after_batch`.
pub(crate) type AfterBatch = Box<dyn Fn() + Send>;

/// Tells this node's follower of a removal the reclaimer wrote (a
/// reclaimed put's shadow), so a put of another writer that it outranks,
/// read later, is not indexed.
pub(crate) struct NoteRemoval(pub Box<dyn Fn(KeyDigest, u64) + Send>);

impl std::fmt::Debug for NoteRemoval {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NoteRemoval")
    }
}

/// What a log that is one writer's of a shared directory adds to the
/// flusher (docs/design.md, "Shared directory").
pub(crate) struct SharedHooks {
    /// The reclaim floor (`shared::Follower`): the reclaimer keeps this
    /// log's removals at or above it, and leaves a removal in place of a
    /// put it drops at or above it.
    pub floor: Arc<std::sync::atomic::AtomicU64>,
    pub note_removal: NoteRemoval,
    /// Collecting a dead writer's log: reclaim every region below this id
    /// first.
    pub reclaim_before: Option<u32>,
    /// Run after each batch that landed (index checkpoints).
    pub after_batch: AfterBatch,
}

/// The running flusher thread; joined by [`FlusherHandle::join`].
#[derive(Debug)]
pub(crate) struct FlusherHandle(JoinHandle<()>);

impl FlusherHandle {
    pub(crate) fn join(self) {
        let _ = self.0.join();
    }
}

impl Flusher {
    pub(crate) fn new(
        log: Arc<WriteLog>,
        disk: Arc<DiskTier>,
        index: Arc<Index>,
        counters: Arc<Counters>,
        batch_bytes: u64,
        shared: Option<SharedHooks>,
        events: Option<Arc<EventSink>>,
    ) -> Self {
        let (shared_floor, note_removal, reclaim_before, after_batch) = match shared {
            Some(h) => (
                Some(h.floor),
                Some(h.note_removal),
                h.reclaim_before,
                Some(h.after_batch),
            ),
            None => (None, None, None, None),
        };
        let reclaimer = Reclaimer {
            log: Arc::clone(&log),
            disk: Arc::clone(&disk),
            index: Arc::clone(&index),
            counters: Arc::clone(&counters),
            shared_floor,
            note_removal,
            events: events.clone(),
        };
        Flusher {
            log,
            disk,
            index,
            counters,
            reclaimer,
            batch_bytes,
            after_batch,
            reclaim_before,
            events,
            failures: std::sync::Mutex::new((0, None)),
        }
    }

    /// Starts the thread. A panic in it must not leave callers waiting for
    /// a thread that is gone: the log turns every wait into an error
    /// naming it.
    pub(crate) fn spawn(self) -> Result<FlusherHandle> {
        std::thread::Builder::new()
            .name("kvtier-flusher".into())
            .spawn(move || {
                let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run()));
                if let Err(panic) = run {
                    let why = panic
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "a panic".to_string());
                    tracing::error!(%why, "the flusher thread died");
                    self.log.mark_dead(why);
                }
            })
            .map(FlusherHandle)
            .map_err(|e| Error::io("starting the flusher thread", e))
    }

    fn run(&self) {
        let disk = &*self.disk;
        if let Some(before) = self.reclaim_before {
            let _quiet = self.log.hold_flusher();
            while disk.oldest_region().is_some_and(|r| r.id < before)
                && self.reclaimer.reclaim_oldest()
            {}
        }
        // A smaller configured capacity than the files on disk: shrink now.
        while disk.used() > disk.capacity() && self.reclaimer.reclaim_oldest() {}
        let limit = self.batch_bytes.min(disk.max_batch_len());
        loop {
            let mut budget = BatchBudget::new(limit);
            let work = self.log.next_batch(|item, taken| {
                if taken.len() == 1 {
                    let (key_len, padded) = queued_size(&taken[0]);
                    budget.admit(key_len, padded);
                }
                let (key_len, padded) = queued_size(item);
                budget.admit(key_len, padded)
            });
            match work {
                Work::Batch(batch) => {
                    let _quiet = self.log.hold_flusher();
                    self.flush_one_batch(batch);
                }
                Work::Stop => return,
            }
        }
    }

    fn flush_one_batch(&self, taken: Vec<QueuedWrite>) {
        let disk = &*self.disk;
        // Every queued put is written, even one replaced since: the newer
        // value may be memory-only (or already evicted), and a restart must
        // then bring back the newest write-through value. Recovery keeps the
        // highest sequence number, so replaced values lose there.
        let mut batch = PendingBatch::default();
        let mut written_puts = Vec::new();
        for item in &taken {
            match item {
                QueuedWrite::Put {
                    digest,
                    key,
                    seq,
                    slot,
                    checksum,
                } => {
                    let checksum = *checksum;
                    debug_assert_eq!(checksum, value_checksum(*digest, slot.bytes()));
                    batch.entries.push(RecordEntry {
                        kind: RecordKind::Put,
                        seq: *seq,
                        digest: *digest,
                        value_offset: 0,
                        value_len: slot.len() as u32,
                        checksum,
                        key: key.to_vec(),
                    });
                    batch.values.push(slot.padded_bytes());
                    written_puts.push((*digest, *seq, checksum, slot, key));
                }
                QueuedWrite::Tombstone { digest, key, seq } => batch.entries.push(RecordEntry {
                    kind: RecordKind::Tombstone,
                    seq: *seq,
                    digest: *digest,
                    value_offset: 0,
                    value_len: 0,
                    checksum: 0,
                    key: key.to_vec(),
                }),
            }
        }
        let batch_len = batch.disk_len();
        while disk.needs_reclaim(batch_len) && self.reclaimer.reclaim_oldest() {}
        let first_seq = self.log.next_seq();
        let outcome = match disk.write_batch(&mut batch, first_seq) {
            Ok(locs) => {
                let mut shared_prefix = PrefixCache::default();
                for ((digest, seq, checksum, slot, key), loc) in written_puts.iter().zip(locs) {
                    let current = self
                        .index
                        .lock(*digest)
                        .set_disk(*digest, *seq, loc, *checksum);
                    slot.set_evictable();
                    // Durable and still this key's value: announced.
                    if let (true, Some(events)) = (current, &self.events) {
                        if let Some(qualified) = shared_prefix.key(key) {
                            events.emit(BlockEvent::Stored {
                                medium: Medium::Storage,
                                digest: *digest,
                                qualified,
                            });
                        }
                    }
                }
                Counters::add(&self.counters.flushed_batches, 1);
                let failed = std::mem::take(&mut *self.failures.lock().unwrap()).0;
                if failed > 0 {
                    tracing::warn!(failed_attempts = failed, "batch writes land again");
                }
                if let Some(after) = &self.after_batch {
                    after();
                }
                Ok(())
            }
            Err(e) => {
                let mut failures = self.failures.lock().unwrap();
                failures.0 += 1;
                if failures
                    .1
                    .is_none_or(|said| said.elapsed() >= FAILURE_REPEAT)
                {
                    failures.1 = Some(std::time::Instant::now());
                    tracing::error!(error = %e, entries = batch.entries.len(), failed_attempts = failures.0, "batch write failed; will retry (said again at most every 10 s while it lasts; flush_errors counts every attempt)");
                }
                drop(failures);
                Counters::add(&self.counters.flush_errors, 1);
                Err(e)
            }
        };
        drop(written_puts);
        drop(batch);
        // The file system is fuller than the configured capacity allows
        // for: make room the way a cache does, by dropping the oldest
        // region, before the retry. (Never the region being written.)
        let full = outcome
            .as_ref()
            .err()
            .and_then(|e| e.io_error())
            .and_then(|e| e.raw_os_error())
            == Some(libc::ENOSPC);
        if full && disk.region_count() > 1 {
            self.reclaimer.reclaim_oldest();
        }
        // A failed batch goes back to the queue for another attempt in a
        // new region (its values stay pinned). Only at shutdown is a batch
        // given up: its values then stay in memory only, evictable.
        for item in self.log.finish_batch(taken, outcome) {
            if let QueuedWrite::Put { slot, .. } = item {
                slot.set_evictable();
            }
        }
    }
}

/// The namespace prefix of the last key announced, shared by the events
/// of a batch's keys of one namespace (most batches hold one).
#[derive(Default)]
struct PrefixCache(Option<Arc<[u8]>>);

impl PrefixCache {
    fn key(&mut self, qualified: &[u8]) -> Option<QualifiedKey> {
        let (ns, key) = crate::key::split_qualified(qualified)?;
        if key == crate::key::MANIFEST_KEY {
            // A namespace's manifest is not a KV block: never announced.
            return None;
        }
        let prefix = &qualified[..1 + ns.len()];
        let shared = match &self.0 {
            Some(p) if &p[..] == prefix => Arc::clone(p),
            _ => {
                let p: Arc<[u8]> = Arc::from(prefix);
                self.0 = Some(Arc::clone(&p));
                p
            }
        };
        Some(QualifiedKey::with_prefix(shared, key))
    }
}

/// Reclaims whole regions, oldest first, for the flusher (which alone
/// writes, so reclaim and carried writes stay in log order).
#[derive(Debug)]
pub(crate) struct Reclaimer {
    log: Arc<WriteLog>,
    disk: Arc<DiskTier>,
    index: Arc<Index>,
    counters: Arc<Counters>,
    /// Set when the log is one writer's of a shared directory: the lowest
    /// sequence number in any other writer's followed region (see
    /// `shared::Follower`).
    shared_floor: Option<Arc<std::sync::atomic::AtomicU64>>,
    note_removal: Option<NoteRemoval>,
    /// `Config::events`: a disk copy dropped is announced.
    events: Option<Arc<EventSink>>,
}

impl Reclaimer {
    /// Reclaims the oldest region: entries read since they were written get
    /// a second chance (rewritten at the log head, up to three quarters of
    /// the region's bytes, and always the first such entry); the rest leave
    /// the disk tier. Carrying clears the read mark, so an entry is carried
    /// again only if it is read again. Returns false if there was no
    /// region to reclaim.
    fn reclaim_oldest(&self) -> bool {
        let disk = &*self.disk;
        let Some(region) = disk.oldest_region() else {
            return false;
        };
        let (entries, complete) = match disk.region_entries(&region) {
            Ok(found) => found,
            Err(e) => {
                tracing::warn!(region = region.id, error = %e, "could not read region records; dropping its entries");
                (Vec::new(), false)
            }
        };
        let budget = region.len() / 4 * 3;
        let mut carried_bytes = 0u64;
        let mut carry: Vec<RecoveredEntry> = Vec::new();
        let mut dropped = 0u64;
        // In a shared directory: no second chance for values (a copy would
        // get a new sequence number, which could outrank a remove another
        // node issued and this one has not read yet), tombstones that may
        // still shadow a put in another writer's log are kept, and a put
        // dropped at or above the floor leaves a tombstone at its own
        // number: it outranked older puts of its key in other logs, and
        // without it the older version would be the newest left (an
        // overwrite undone by reclaim).
        let shared_floor = self
            .shared_floor
            .as_ref()
            .map(|f| f.load(std::sync::atomic::Ordering::Acquire));
        let mut kept_tombstones: Vec<RecordEntry> = Vec::new();
        for recovered in entries {
            let entry = &recovered.entry;
            if entry.kind != RecordKind::Put {
                if shared_floor.is_some_and(|floor| entry.seq >= floor) {
                    kept_tombstones.push(entry.clone());
                }
                continue;
            }
            let mut shard = self.index.lock(entry.digest);
            let Some(current) = shard.get(entry.digest) else {
                continue;
            };
            if current.seq() != entry.seq || current.disk() != Some(recovered.loc) {
                continue;
            }
            let padded = page_round_up(u64::from(entry.value_len));
            if shared_floor.is_none()
                && current.accessed()
                && (carried_bytes == 0 || carried_bytes + padded <= budget)
            {
                carried_bytes += padded;
                drop(shard);
                carry.push(recovered);
            } else {
                shard.clear_disk(entry.digest, entry.seq, recovered.loc);
                dropped += 1;
                if shared_floor.is_some_and(|floor| entry.seq >= floor) {
                    // Noted under the key's shard lock, as removals are.
                    if let Some(note) = &self.note_removal {
                        (note.0)(entry.digest, entry.seq);
                    }
                    kept_tombstones.push(RecordEntry {
                        kind: RecordKind::Tombstone,
                        value_offset: 0,
                        value_len: 0,
                        checksum: 0,
                        ..entry.clone()
                    });
                }
                drop(shard);
                self.removed_from_disk(entry.digest);
            }
        }
        if !kept_tombstones.is_empty() {
            // Rewritten with their own sequence numbers before the region
            // goes, so no instant exists where a restart would miss them.
            let kept = kept_tombstones.len() as u64;
            let mut batch = PendingBatch {
                entries: kept_tombstones,
                values: Vec::new(),
            };
            if let Err(e) = disk.write_batch(&mut batch, self.log.next_seq()) {
                tracing::error!(region = region.id, error = %e, "rewriting removals another writer's log may still need; the region stays until it succeeds");
                return false;
            }
            Counters::add(&self.counters.carried_entries, kept);
        }
        // Remove first so the carried batch has room; the open file handle
        // still reads the unlinked region. A crash in between loses only
        // entries that reclaim was entitled to drop.
        if let Err(e) = disk.remove_region(region.id) {
            // The region stays (as the oldest); nothing newer is reclaimed
            // until its removal succeeds.
            tracing::error!(region = region.id, error = %e, "removing a reclaimed region; will retry");
            drop(carry);
            return false;
        }
        if !complete {
            // Records that no longer read (damaged since they were indexed)
            // still have index entries pointing here: sweep them, so that
            // `exists` and `prefix_len` never count a region that is gone.
            let swept = self.index.clear_disk_where_each(
                |r, _| r == region.id,
                |digest| self.removed_from_disk(digest),
            );
            if swept > 0 {
                tracing::warn!(region = region.id, entries = swept, "dropped index entries of a reclaimed region whose records could not all be read");
            }
            dropped += swept;
        }
        let carried = self.carry_forward(&region, carry);
        Counters::add(&self.counters.reclaimed_regions, 1);
        Counters::add(&self.counters.reclaimed_entries, dropped);
        Counters::add(&self.counters.carried_entries, carried);
        true
    }

    fn removed_from_disk(&self, digest: KeyDigest) {
        if let Some(events) = &self.events {
            events.emit(BlockEvent::Removed {
                medium: Medium::Storage,
                digest,
            });
        }
    }

    /// Reads, verifies and rewrites second-chance entries at the log head.
    /// Returns how many made it.
    fn carry_forward(&self, region: &Arc<Region>, carry: Vec<RecoveredEntry>) -> u64 {
        let disk = &*self.disk;
        if carry.is_empty() {
            return 0;
        }
        let from_region = region.id;
        let mut bufs: Vec<AlignedBuf> = carry
            .iter()
            .map(|c| AlignedBuf::zeroed(c.entry.value_len as usize))
            .collect();
        let reads: Vec<Option<ValueRead>> = carry
            .iter()
            .map(|c| {
                Some(ValueRead {
                    digest: c.entry.digest,
                    region: Arc::clone(region),
                    loc: c.loc,
                    len: c.entry.value_len as usize,
                    checksum: c.entry.checksum,
                })
            })
            .collect();
        let outcomes = {
            let mut dests: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
            disk.read_values(&reads, &mut dests)
        };
        let mut batch = PendingBatch::default();
        let mut renumbered: Vec<(KeyDigest, u64, u64)> = Vec::new();
        {
            // New sequence numbers keep log order equal to sequence order,
            // so a later remove's tombstone always outranks the copy.
            self.log.with_next_seq(|next_seq| {
                for ((c, buf), outcome) in carry.iter().zip(&bufs).zip(outcomes) {
                    let e = &c.entry;
                    let valid = matches!(outcome, Some(ReadOutcome::Verified));
                    let mut shard = self.index.lock(e.digest);
                    if !valid {
                        Counters::add(&self.counters.checksum_failures, 1);
                        tracing::warn!(
                            region = from_region,
                            page = c.loc.page(),
                            "second-chance read failed verification; dropping the entry"
                        );
                        shard.clear_disk(e.digest, e.seq, c.loc);
                        continue;
                    }
                    let new_seq = *next_seq;
                    if !shard.renumber(e.digest, e.seq, c.loc, new_seq) {
                        continue;
                    }
                    *next_seq += 1;
                    batch.entries.push(RecordEntry {
                        seq: new_seq,
                        ..e.clone()
                    });
                    batch.values.push(buf.as_slice());
                    renumbered.push((e.digest, new_seq, e.checksum));
                }
            });
        }
        if batch.entries.is_empty() {
            return 0;
        }
        let first_seq = self.log.next_seq();
        let locs = if disk.needs_reclaim(batch.disk_len()) {
            Err(Error::no_space("no room to carry entries forward"))
        } else {
            disk.write_batch(&mut batch, first_seq)
        };
        let mut carried = 0;
        match locs {
            Ok(locs) => {
                for ((digest, seq, _), loc) in renumbered.iter().zip(locs) {
                    if self.index.lock(*digest).move_disk(*digest, *seq, loc) {
                        carried += 1;
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "second-chance write failed; dropping those entries");
                for (digest, seq, _) in &renumbered {
                    self.index.lock(*digest).forget_disk(*digest, *seq);
                }
            }
        }
        carried
    }
}

/// A queued write's key bytes and padded value bytes in a batch.
fn queued_size(item: &QueuedWrite) -> (usize, u64) {
    match item {
        QueuedWrite::Put { key, slot, .. } => (key.len(), slot.padded_bytes().len() as u64),
        QueuedWrite::Tombstone { key, .. } => (key.len(), 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::units::{MIB, PAGE_SIZE};

    /// The batching rule: the first item always joins, later ones while the
    /// record plus the padded values fit the limit, never more than
    /// `MAX_BATCH_ENTRIES`.
    #[test]
    fn batch_budget_cuts_by_bytes_and_entries() {
        let mut alone = BatchBudget::new(MIB);
        assert!(
            alone.admit(40, 8 * MIB),
            "a first value larger than the limit still goes"
        );
        assert!(!alone.admit(40, PAGE_SIZE));

        // One record page plus three 256 KiB values fit 1 MiB; a fourth does not.
        let mut bytes = BatchBudget::new(MIB);
        let value = 256 * 1024;
        assert!((0..3).all(|_| bytes.admit(40, value)));
        assert!(!bytes.admit(40, value));
        // A tombstone (no value bytes) still fits in the record page.
        assert!(bytes.admit(40, 0));

        let mut entries = BatchBudget::new(u64::MAX);
        let admitted = (0..MAX_BATCH_ENTRIES + 10)
            .take_while(|_| entries.admit(16, 0))
            .count();
        assert_eq!(admitted, MAX_BATCH_ENTRIES);
    }
}
