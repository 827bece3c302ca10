//! The apply rules of what a follow pass reads: per key the highest
//! sequence number wins, a tombstone on a tie; numbers too far ahead of
//! this node's clock are refused; what this node does not own under the
//! index share is noted, not indexed.

use super::*;

impl Follower {
    /// Whether an entry numbered `seq` reads too far ahead of this node's
    /// clock (counted; the first one warned about): a put is then not
    /// indexed.
    pub(super) fn refuse_ahead_of_clock(&self, seq: u64) -> bool {
        if !self.log.ahead_of_clock(seq) {
            return false;
        }
        if self.counters.clock_ahead.fetch_add(1, Ordering::Relaxed) == 0 {
            tracing::warn!(
                seq,
                "another writer's entries are numbered more than 5 minutes ahead of this \
                 node's clock (its clock is wrong, or this one's): its puts are not indexed, its \
                 removals still apply (shared_clock_ahead_entries)"
            );
        }
        true
    }

    /// Applies one record entry of another writer (whose region is
    /// `handle`).
    pub(super) fn apply(&self, handle: u32, batch_start: u64, entry: &RecordEntry) {
        match entry.kind {
            RecordKind::Tombstone => self.apply_tombstone(handle, entry.digest, entry.seq),
            RecordKind::Put => {
                let Some(loc) = value_loc(handle, batch_start, entry) else {
                    return;
                };
                self.apply_put(
                    entry.digest,
                    entry.seq,
                    entry.checksum,
                    loc,
                    entry.value_len,
                );
            }
        }
    }

    /// Per key the highest sequence number wins, a tombstone on a tie.
    pub(super) fn apply_put(
        &self,
        digest: KeyDigest,
        seq: u64,
        checksum: u64,
        loc: DiskLoc,
        len: u32,
    ) {
        if self.refuse_ahead_of_clock(seq) {
            return;
        }
        if !self.owns(digest) {
            self.counters.outside_share.fetch_add(1, Ordering::Relaxed);
            self.outranks_unshared(digest, seq, false);
            return;
        }
        let mut shard = self.index.lock(digest);
        let current = shard.get(digest).map(Entry::seq);
        let removed_after = self
            .state
            .lock()
            .unwrap()
            .tombstones
            .get(&digest.0)
            .is_some_and(|(removed, _)| *removed >= seq);
        if removed_after || current.is_some_and(|s| s >= seq) {
            return;
        }
        shard.insert(digest, Entry::new(seq, checksum, None, Some(loc), len));
    }

    /// A put (or removal) of another writer for a key outside this node's
    /// share still outranks the entry this node may hold of it from its
    /// own log (indexed whole): that entry goes, so a read here asks the
    /// share's owner, which holds the newer state, instead of answering
    /// with a value removed or replaced elsewhere.
    pub(super) fn outranks_unshared(&self, digest: KeyDigest, seq: u64, tombstone: bool) {
        let mut shard = self.index.lock(digest);
        let outranked = shard
            .get(digest)
            .map(Entry::seq)
            .is_some_and(|current| current < seq || (tombstone && current == seq));
        if outranked {
            shard.remove(digest);
        }
    }

    /// Remembers a removal (from `origin`, a region handle) and drops an
    /// entry it outranks.
    pub(super) fn apply_tombstone(&self, origin: u32, digest: KeyDigest, seq: u64) {
        // Counted, but applied all the same: a removal is never ignored (a
        // miss is always safe). Until this node's clock catches up with its
        // number, the key misses here even after later puts.
        let _ = self.refuse_ahead_of_clock(seq);
        if !self.owns(digest) {
            // Another node's share: that node indexes the key and keeps
            // the removal.
            self.outranks_unshared(digest, seq, true);
            return;
        }
        let mut shard = self.index.lock(digest);
        let current = shard.get(digest).map(Entry::seq);
        {
            let mut state = self.state.lock().unwrap();
            let slot = state.tombstones.entry(digest.0).or_insert((0, origin));
            if slot.0 <= seq {
                *slot = (seq, origin);
            }
        }
        if current.is_some_and(|s| s <= seq) {
            shard.remove(digest);
        }
    }
}
