//! The region log's writing half behind the tier seam (`tier::TierWriter`):
//! batches appended at the log head, room made by reclaiming whole regions,
//! oldest first, with a second chance for values read since they were
//! written (carried forward to the head), and, in a shared directory, the
//! removals another writer's log may still need kept (docs/design.md,
//! "Disk capacity and reclaim", "Removes and reclaim across writers").
//!
//! Built from the handles it needs (the write log, the region log, the
//! index, the counters) and never holds the store; only the flusher's
//! thread calls it, so reclaim and carried writes stay in log order.

use crate::disk::{DiskTier, ReadOutcome, RecoveredEntry, Region, ValueRead};
use crate::error::{Error, Result};
use crate::events::{BlockEvent, EventSink, Medium};
use crate::flusher::AfterBatch;
use crate::index::Index;
use crate::io::AlignedBuf;
use crate::key::KeyDigest;
use crate::stats::Counters;
use crate::tier::{Location, PendingBatch, RecordEntry, RecordKind, TierWriter};
use crate::units::page_round_up;
use crate::write_log::WriteLog;
use std::sync::Arc;

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

/// The region log as the flusher writes it: the reclaimer holds the log
/// and the region log it writes to.
#[derive(Debug)]
pub(crate) struct RegionLogWriter {
    reclaimer: Reclaimer,
    /// Collecting a dead writer's log: every region below this id (all it
    /// had at open) is reclaimed before anything else.
    reclaim_before: Option<u32>,
}

impl RegionLogWriter {
    /// `shared` (a log that is one writer's of a shared directory) gives
    /// the reclaim floor, how removals are noted and what to collect
    /// first; its `after_batch` is the flusher's, returned for it.
    pub(crate) fn new(
        log: Arc<WriteLog>,
        disk: Arc<DiskTier>,
        index: Arc<Index>,
        counters: Arc<Counters>,
        shared: Option<SharedHooks>,
        events: Option<Arc<EventSink>>,
    ) -> (RegionLogWriter, Option<AfterBatch>) {
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
            log,
            disk,
            index,
            counters,
            shared_floor,
            note_removal,
            events,
        };
        let writer = RegionLogWriter {
            reclaimer,
            reclaim_before,
        };
        (writer, after_batch)
    }
}

impl TierWriter for RegionLogWriter {
    fn max_batch_len(&self) -> u64 {
        self.reclaimer.disk.max_batch_len()
    }

    fn prepare(&self) {
        let disk = &*self.reclaimer.disk;
        if let Some(before) = self.reclaim_before {
            let _quiet = self.reclaimer.log.hold_flusher();
            while disk.oldest_region().is_some_and(|r| r.id < before)
                && self.reclaimer.reclaim_oldest()
            {}
        }
        // A smaller configured capacity than the files on disk: shrink now.
        while disk.used() > disk.capacity() && self.reclaimer.reclaim_oldest() {}
    }

    fn make_room(&self, batch: &PendingBatch<'_>) {
        let batch_len = batch.disk_len();
        while self.reclaimer.disk.needs_reclaim(batch_len) && self.reclaimer.reclaim_oldest() {}
    }

    fn write_batch(&self, batch: &mut PendingBatch<'_>, first_seq: u64) -> Result<Vec<Location>> {
        self.reclaimer.disk.write_batch(batch, first_seq)
    }

    fn on_full(&self) {
        // Never the region being written.
        if self.reclaimer.disk.region_count() > 1 {
            self.reclaimer.reclaim_oldest();
        }
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
