//! The read path: lookups (pinning a memory value or locating one in the
//! tier below memory, through the tier seam), presence checks, and batched
//! gets whose hits below memory the tier reads
//! and verifies together.

use super::{check_buffer, mismatched, Inner};
use crate::error::Result;
use crate::key::{validate_key, KeyDigest, Namespace};
use crate::pool::PoolSlot;
use crate::stats::Counters;
use crate::tier::{Destination, ReadOutcome, TierRead};
use std::sync::Arc;

/// A value located by a lookup, pinned if in memory.
enum Found {
    Memory(Arc<PoolSlot>),
    /// In the tier below memory, with the sequence number of the index
    /// entry (a read that fails verification drops that entry and no
    /// newer one).
    Lower(TierRead, u64),
    Miss,
}

impl Inner {
    /// Presence of each key; invalid keys are absent.
    pub(super) fn contains_many<K: AsRef<[u8]>>(&self, ns: &Namespace, keys: &[K]) -> Vec<bool> {
        self.contains_many_then(ns, keys, |_| {})
    }

    /// `contains_many`, handing the digests to `seen` first.
    pub(super) fn contains_many_then<K: AsRef<[u8]>>(
        &self,
        ns: &Namespace,
        keys: &[K],
        seen: impl FnOnce(&[KeyDigest]),
    ) -> Vec<bool> {
        let valid: Vec<bool> = keys
            .iter()
            .map(|k| validate_key(k.as_ref()).is_ok())
            .collect();
        let digests = ns.digest_many(keys);
        seen(&digests);
        let mut found = self.index.contains_many(&digests);
        for (present, valid) in found.iter_mut().zip(valid) {
            *present &= valid;
        }
        found
    }

    fn lookup(&self, digest: KeyDigest) -> Found {
        let mut shard = self.index.lock(digest);
        let Some(entry) = shard.get(digest) else {
            return Found::Miss;
        };
        let found = if let Some(slot) = entry.mem() {
            slot.record_hit();
            Found::Memory(Arc::clone(slot))
        } else if let Some(loc) = entry.disk() {
            let located = self.lower.as_ref().and_then(|lower| {
                lower.locate(digest, loc, entry.value_len() as usize, entry.checksum())
            });
            match located {
                Some(read) => Found::Lower(read, entry.seq()),
                None => Found::Miss,
            }
        } else {
            Found::Miss
        };
        if !matches!(found, Found::Miss) {
            shard.mark_accessed(digest);
        }
        found
    }

    pub(crate) fn get_into<K: AsRef<[u8]>, D: Destination>(
        &self,
        ns: &Namespace,
        keys: &[K],
        bufs: &mut [D],
    ) -> Vec<Result<Option<usize>>> {
        if keys.len() != bufs.len() {
            return mismatched(keys.len(), "buffers", bufs.len());
        }
        if let Err(e) = self.check_open() {
            return keys.iter().map(|_| Err(e.duplicate())).collect();
        }
        // Write-back yields to reads (`Config::flush_yield`).
        self.log.note_read();
        let mut results: Vec<Result<Option<usize>>> = Vec::with_capacity(keys.len());
        let mut disk_reads: Vec<Option<TierRead>> = Vec::with_capacity(keys.len());
        // The index entry each disk read came from.
        let mut seqs: Vec<u64> = Vec::with_capacity(keys.len());
        // Memory hits are copied once the batch's size is known: a batch
        // of 16 MiB or more is copied with non-temporal stores (the rule
        // leased copies follow, `bulk_copy::worth_streaming`).
        let mut memory_hits: Vec<(usize, Arc<PoolSlot>)> = Vec::new();
        let digests = ns.digest_many(keys);
        for ((key, buf), &digest) in keys.iter().zip(bufs.iter()).zip(&digests) {
            let key = key.as_ref();
            let mut disk_read = None;
            let mut seq = 0;
            let result = validate_key(key).and_then(|()| match self.lookup(digest) {
                Found::Miss => {
                    Counters::add(&self.counters.misses, 1);
                    Ok(None)
                }
                Found::Memory(slot) => {
                    check_buffer(slot.len(), buf.capacity())?;
                    let len = slot.len();
                    memory_hits.push((results.len(), slot));
                    Counters::add(&self.counters.memory_hits, 1);
                    Ok(Some(len))
                }
                Found::Lower(read, entry_seq) => {
                    check_buffer(read.len, buf.capacity())?;
                    let len = read.len;
                    disk_read = Some(read);
                    seq = entry_seq;
                    Ok(Some(len))
                }
            });
            results.push(result);
            disk_reads.push(disk_read);
            seqs.push(seq);
        }
        let streamed =
            crate::bulk_copy::worth_streaming(memory_hits.iter().map(|(_, s)| s.len()).sum());
        for (i, slot) in memory_hits {
            if streamed {
                bufs[i].fill_streamed(slot.bytes());
            } else {
                bufs[i].fill_from(slot.bytes());
            }
        }
        if disk_reads.iter().any(Option::is_some) {
            self.read_from_lower(bufs, &disk_reads, &seqs, &mut results);
        }
        results
    }

    /// Has the tier below memory read and verify every hit of a batch in
    /// it at once; a value that fails verification is a miss, counted, and
    /// its index entry is dropped (unless a newer put replaced it
    /// meanwhile).
    fn read_from_lower<D: Destination>(
        &self,
        bufs: &mut [D],
        reads: &[Option<TierRead>],
        seqs: &[u64],
        results: &mut [Result<Option<usize>>],
    ) {
        let lower = self
            .lower
            .as_ref()
            .expect("reads below memory imply a tier there");
        let mut dests: Vec<&mut dyn Destination> =
            bufs.iter_mut().map(|d| d as &mut dyn Destination).collect();
        let outcomes = lower.read_verified(reads, &mut dests);
        for (i, outcome) in outcomes.into_iter().enumerate() {
            let (Some(outcome), Some(read)) = (outcome, &reads[i]) else {
                continue;
            };
            match outcome {
                ReadOutcome::Verified => {
                    Counters::add(&self.counters.disk_hits, 1);
                    if lower.is_others(read.loc) {
                        Counters::add(&self.counters.shared_reads, 1);
                    }
                }
                ReadOutcome::Rejected(_) => {
                    Counters::add(&self.counters.checksum_failures, 1);
                    Counters::add(&self.counters.misses, 1);
                    self.index
                        .lock(read.digest)
                        .clear_disk(read.digest, seqs[i], read.loc);
                    results[i] = Ok(None);
                }
                // The file system did not answer within the storage
                // deadline (counted by the disk tier): a miss, and the
                // entry stays (the value is not known to be bad).
                ReadOutcome::TimedOut => {
                    Counters::add(&self.counters.misses, 1);
                    results[i] = Ok(None);
                }
                ReadOutcome::Failed(e) if lower.is_others(read.loc) => {
                    // Another writer's file: it may have been reclaimed (or
                    // replaced) since this node last looked, which some
                    // file systems report as EIO rather than keep the
                    // unlinked file readable. A miss, never an error; the
                    // next follow pass drops the region's entries.
                    tracing::debug!(error = %e, region = read.loc.region(), "a read of another writer's region failed; a miss");
                    Counters::add(&self.counters.shared_read_failures, 1);
                    Counters::add(&self.counters.misses, 1);
                    results[i] = Ok(None);
                }
                ReadOutcome::Failed(e) => results[i] = Err(e),
            }
        }
    }
}
