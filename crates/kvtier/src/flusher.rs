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

use crate::disk::format;
use crate::error::{Error, Result};
use crate::events::{BlockEvent, EventSink, Medium, QualifiedKey};
use crate::index::Index;
use crate::key::value_checksum;
use crate::stats::Counters;
use crate::tier::{PendingBatch, RecordEntry, RecordKind, TierWriter};
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

/// The flusher thread's work: a function of its handles. It writes what
/// the write log queues to the tier below memory, through the seam's
/// writing half (`tier::TierWriter`); what a tier does to make room or lay
/// out a batch is the tier's (the region log's: `region_writer`).
pub(crate) struct Flusher {
    log: Arc<WriteLog>,
    writer: Box<dyn TierWriter>,
    index: Arc<Index>,
    counters: Arc<Counters>,
    /// `Config::flush_batch_bytes`: the most bytes one batch may take.
    batch_bytes: u64,
    /// Run on this thread after each batch that landed, between batches
    /// (a shared directory's index checkpoints).
    after_batch: Option<AfterBatch>,
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
        writer: Box<dyn TierWriter>,
        index: Arc<Index>,
        counters: Arc<Counters>,
        batch_bytes: u64,
        after_batch: Option<AfterBatch>,
        events: Option<Arc<EventSink>>,
    ) -> Self {
        Flusher {
            log,
            writer,
            index,
            counters,
            batch_bytes,
            after_batch,
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
        self.writer.prepare();
        let limit = self.batch_bytes.min(self.writer.max_batch_len());
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
        self.writer.make_room(&batch);
        let first_seq = self.log.next_seq();
        let outcome = match self.writer.write_batch(&mut batch, first_seq) {
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
        if full {
            self.writer.on_full();
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
