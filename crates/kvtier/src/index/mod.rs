//! The in-memory index: key digest → where the value lives. Public for
//! benchmarks and tools; applications use [`crate::Store`].
//!
//! Sharded so that lookups on different keys rarely meet on a lock; each
//! shard keeps its own tier counters so `stats()` needs no global atomics on
//! the data path. Every change to an entry's tiers goes through `Shard`
//! methods, which keep those counters true.

mod table;

#[cfg(feature = "internals")]
pub use table::prefetch;

use crate::key::KeyDigest;
use crate::pool::PoolSlot;
use crate::tier::Location;
use std::mem::ManuallyDrop;
use std::sync::{Arc, Mutex, MutexGuard};

const SHARDS: usize = 64;

/// Bytes one entry holds in its shard's table before load-factor slack:
/// the digest and the entry in the arena, and the table's slot.
pub const SLOT_BYTES: usize = table::STORED_BYTES + table::SLOT_BYTES;

/// One index entry: 32 bytes, so with its digest 48 in the table's arena
/// (plus an 8-byte slot, see `table`). At 10 million entries every byte here
/// is 10 MB of resident memory, so fields are packed:
/// - the sequence number shares a word with the `accessed` flag;
/// - the value length lives in the pool slot while there is a memory copy,
///   and in the memory-copy word (tagged) while there is none.
pub struct Entry {
    /// `seq << 1 | accessed`. Sequence numbers stay below 2^63.
    seq_accessed: u64,
    /// `value_checksum` of the value; meaningful once `disk` is set.
    checksum: u64,
    mem_or_len: MemOrLen,
    disk: Option<Location>,
}

impl Entry {
    /// A new entry of put `seq`. With a memory copy, `len` must be the
    /// slot's length.
    pub fn new(
        seq: u64,
        checksum: u64,
        mem: Option<Arc<PoolSlot>>,
        disk: Option<Location>,
        len: u32,
    ) -> Self {
        debug_assert!(seq < 1 << 63, "sequence numbers stay below 2^63");
        debug_assert!(mem.as_ref().is_none_or(|m| m.len() == len as usize));
        Entry {
            seq_accessed: seq << 1,
            checksum,
            mem_or_len: MemOrLen::new(mem, len),
            disk,
        }
    }

    /// Sequence number of the put that wrote this value; higher wins.
    pub fn seq(&self) -> u64 {
        self.seq_accessed >> 1
    }

    /// Read since written or last carried: earns a second chance when its
    /// region is reclaimed.
    pub fn accessed(&self) -> bool {
        self.seq_accessed & 1 == 1
    }

    pub fn checksum(&self) -> u64 {
        self.checksum
    }

    pub fn mem(&self) -> Option<&Arc<PoolSlot>> {
        self.mem_or_len.slot()
    }

    pub fn disk(&self) -> Option<Location> {
        self.disk
    }

    /// The value's length in bytes.
    pub fn value_len(&self) -> u32 {
        self.mem_or_len.len()
    }
}

impl std::fmt::Debug for Entry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Entry")
            .field("seq", &self.seq())
            .field("accessed", &self.accessed())
            .field("checksum", &self.checksum)
            .field("mem", &self.mem())
            .field("disk", &self.disk)
            .field("len", &self.value_len())
            .finish()
    }
}

/// Either the memory copy (an `Arc<PoolSlot>`, whose pointer is 8-aligned,
/// so its low bit is 0) or, without one, `len << 1 | 1`.
union MemOrLen {
    slot: ManuallyDrop<Arc<PoolSlot>>,
    tagged_len: usize,
}

// SAFETY: a `MemOrLen` is an `Option<Arc<PoolSlot>>` plus a length, and
// `Arc<PoolSlot>` is `Send + Sync`.
unsafe impl Send for MemOrLen {}
// SAFETY: as above; shared access only reads the word or clones the `Arc`.
unsafe impl Sync for MemOrLen {}

const _: () = assert!(std::mem::align_of::<PoolSlot>() >= 2);
const _: () = assert!(std::mem::size_of::<Arc<PoolSlot>>() == std::mem::size_of::<usize>());

impl MemOrLen {
    fn new(mem: Option<Arc<PoolSlot>>, len: u32) -> Self {
        match mem {
            Some(slot) => MemOrLen {
                slot: ManuallyDrop::new(slot),
            },
            None => MemOrLen {
                tagged_len: (len as usize) << 1 | 1,
            },
        }
    }

    fn bits(&self) -> usize {
        // SAFETY: both variants are one machine word with no padding, so
        // the word can always be read as an integer.
        unsafe { self.tagged_len }
    }

    fn slot(&self) -> Option<&Arc<PoolSlot>> {
        if self.bits() & 1 == 1 {
            None
        } else {
            // SAFETY: an untagged word is the `Arc` written by `new`.
            Some(unsafe { &self.slot })
        }
    }

    fn len(&self) -> u32 {
        match self.slot() {
            Some(slot) => slot.len() as u32,
            None => (self.bits() >> 1) as u32,
        }
    }

    /// Drops the memory copy, keeping the length.
    fn clear_slot(&mut self) {
        if let Some(slot) = self.slot() {
            let len = slot.len() as u32;
            // SAFETY: the word holds an `Arc` (checked above); it is
            // replaced right after, so it is dropped exactly once.
            unsafe { ManuallyDrop::drop(&mut self.slot) };
            self.tagged_len = (len as usize) << 1 | 1;
        }
    }
}

impl Drop for MemOrLen {
    fn drop(&mut self) {
        self.clear_slot();
    }
}

/// A digest as the tables hold it: two u64 halves, so an arena entry is
/// 8-aligned (a u128 would align it to 16).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DigestKey {
    low: u64,
    high: u64,
}

impl From<KeyDigest> for DigestKey {
    fn from(digest: KeyDigest) -> Self {
        DigestKey {
            low: digest.0 as u64,
            high: (digest.0 >> 64) as u64,
        }
    }
}

impl From<DigestKey> for KeyDigest {
    fn from(key: DigestKey) -> Self {
        KeyDigest(u128::from(key.high) << 64 | u128::from(key.low))
    }
}

#[derive(Debug, Default)]
pub struct Shard {
    table: table::DigestTable,
    disk_entries: u64,
    disk_bytes: u64,
}

impl Shard {
    pub fn get(&self, digest: KeyDigest) -> Option<&Entry> {
        self.table.get(DigestKey::from(digest))
    }

    pub fn mark_accessed(&mut self, digest: KeyDigest) {
        if let Some(entry) = self.table.get_mut(DigestKey::from(digest)) {
            entry.seq_accessed |= 1;
        }
    }

    pub fn insert(&mut self, digest: KeyDigest, entry: Entry) -> Option<Entry> {
        self.count_in(&entry);
        let old = self.table.insert(DigestKey::from(digest), entry);
        if let Some(old) = &old {
            self.count_out(old);
        }
        old
    }

    pub fn remove(&mut self, digest: KeyDigest) -> Option<Entry> {
        let old = self.table.remove(DigestKey::from(digest));
        if let Some(old) = &old {
            self.count_out(old);
        }
        old
    }

    /// Records that the put `seq` is now durable at `loc`, unless a newer
    /// put or a remove replaced it meanwhile. Returns whether it applied.
    pub fn set_disk(&mut self, digest: KeyDigest, seq: u64, loc: Location, checksum: u64) -> bool {
        let Some(entry) = self.table.get_mut(DigestKey::from(digest)) else {
            return false;
        };
        if entry.seq() != seq {
            return false;
        }
        if entry.disk.is_none() {
            self.disk_entries += 1;
            self.disk_bytes += u64::from(entry.value_len());
        }
        entry.disk = Some(loc);
        entry.checksum = checksum;
        true
    }

    /// Forgets the disk copy of put `seq` if it is still at `loc`; an entry
    /// left in no tier is removed. Returns whether it applied.
    pub fn clear_disk(&mut self, digest: KeyDigest, seq: u64, loc: Location) -> bool {
        let Some(entry) = self.table.get_mut(DigestKey::from(digest)) else {
            return false;
        };
        if entry.seq() != seq || entry.disk != Some(loc) {
            return false;
        }
        entry.disk = None;
        self.disk_entries -= 1;
        self.disk_bytes -= u64::from(entry.value_len());
        match entry.mem() {
            // Its only durable copy is gone: from now on the memory copy
            // is a droppable cache entry.
            Some(slot) => slot.set_evictable(),
            None => {
                self.table.remove(DigestKey::from(digest));
            }
        }
        true
    }

    /// Points put `seq` at a new disk location (a carried value).
    pub fn move_disk(&mut self, digest: KeyDigest, seq: u64, loc: Location) -> bool {
        match self.table.get_mut(DigestKey::from(digest)) {
            Some(entry) if entry.seq() == seq && entry.disk.is_some() => {
                entry.disk = Some(loc);
                true
            }
            _ => false,
        }
    }

    /// Forgets put `seq`'s disk copy wherever it is.
    pub fn forget_disk(&mut self, digest: KeyDigest, seq: u64) -> bool {
        let loc = match self.table.get(DigestKey::from(digest)) {
            Some(entry) if entry.seq() == seq => entry.disk,
            _ => None,
        };
        loc.is_some_and(|loc| self.clear_disk(digest, seq, loc))
    }

    /// Gives a carried value a new sequence number, if it is still the
    /// put `old_seq` at `loc`. Returns whether it applied.
    pub fn renumber(
        &mut self,
        digest: KeyDigest,
        old_seq: u64,
        loc: Location,
        new_seq: u64,
    ) -> bool {
        match self.table.get_mut(DigestKey::from(digest)) {
            Some(entry) if entry.seq() == old_seq && entry.disk == Some(loc) => {
                debug_assert!(new_seq < 1 << 63);
                entry.seq_accessed = new_seq << 1;
                true
            }
            _ => false,
        }
    }

    /// Drops the memory copy if the entry still holds `slot`; an entry left
    /// in no tier is removed. Returns whether it applied.
    pub fn drop_mem(&mut self, digest: KeyDigest, slot: &Arc<PoolSlot>) -> bool {
        let Some(entry) = self.table.get_mut(DigestKey::from(digest)) else {
            return false;
        };
        if !entry.mem().is_some_and(|m| Arc::ptr_eq(m, slot)) {
            return false;
        }
        entry.mem_or_len.clear_slot();
        if entry.disk.is_none() {
            self.table.remove(DigestKey::from(digest));
        }
        true
    }

    fn count_in(&mut self, entry: &Entry) {
        if entry.disk.is_some() {
            self.disk_entries += 1;
            self.disk_bytes += u64::from(entry.value_len());
        }
    }

    fn count_out(&mut self, entry: &Entry) {
        if entry.disk.is_some() {
            self.disk_entries -= 1;
            self.disk_bytes -= u64::from(entry.value_len());
        }
    }
}

/// Totals over all shards.
#[derive(Debug, Default, Clone, Copy)]
pub struct IndexCounts {
    pub entries: u64,
    pub disk_entries: u64,
    pub disk_bytes: u64,
    /// Bytes the shards' tables hold (slots and arenas), for the per-entry
    /// memory figure.
    pub table_bytes: u64,
}

#[derive(Debug)]
pub struct Index {
    shards: Box<[Mutex<Shard>]>,
}

impl Default for Index {
    fn default() -> Self {
        Index {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
        }
    }
}

impl Index {
    pub fn shard_of(&self, digest: KeyDigest) -> usize {
        (digest.shard_bits() % SHARDS as u64) as usize
    }

    pub fn lock(&self, digest: KeyDigest) -> MutexGuard<'_, Shard> {
        self.lock_shard(self.shard_of(digest))
    }

    pub fn lock_shard(&self, shard: usize) -> MutexGuard<'_, Shard> {
        self.shards[shard].lock().unwrap()
    }

    /// Whether each digest is present, taking each shard's lock once for
    /// the whole batch.
    pub fn contains_many(&self, digests: &[KeyDigest]) -> Vec<bool> {
        self.map_many(digests, false, |_| true)
    }

    /// `look(entry)` for each digest present, `missing` for the others,
    /// taking each shard's lock once for the whole batch, with the batch's
    /// cache misses overlapped within each shard (see `table`).
    pub fn map_many<T: Clone>(
        &self,
        digests: &[KeyDigest],
        missing: T,
        look: impl Fn(&Entry) -> T,
    ) -> Vec<T> {
        let mut found = vec![missing; digests.len()];
        // The batch by shard, by counting: two passes, no sort.
        let mut starts = [0usize; SHARDS + 1];
        for &digest in digests {
            starts[self.shard_of(digest) + 1] += 1;
        }
        for shard in 0..SHARDS {
            starts[shard + 1] += starts[shard];
        }
        let mut next = starts;
        let mut order = vec![(DigestKey { low: 0, high: 0 }, 0usize); digests.len()];
        for (i, &digest) in digests.iter().enumerate() {
            let shard = self.shard_of(digest);
            order[next[shard]] = (DigestKey::from(digest), i);
            next[shard] += 1;
        }
        for shard in 0..SHARDS {
            let group = &order[starts[shard]..starts[shard + 1]];
            if group.is_empty() {
                continue;
            }
            let locked = self.lock_shard(shard);
            locked
                .table
                .get_batch(group, |i, entry| found[i] = look(entry));
        }
        found
    }

    /// What `pick` makes of every entry, handed to `sink` a shard at a
    /// time: each shard is locked only while `pick` copies out of it, never
    /// while `sink` runs (which may write to a file).
    pub fn visit_by_shard<T>(
        &self,
        mut pick: impl FnMut(KeyDigest, &Entry) -> Option<T>,
        mut sink: impl FnMut(Vec<T>),
    ) {
        for shard in 0..SHARDS {
            let picked: Vec<T> = {
                let shard = self.lock_shard(shard);
                shard
                    .table
                    .iter()
                    .filter_map(|(key, entry)| pick(KeyDigest::from(key), entry))
                    .collect()
            };
            sink(picked);
        }
    }

    /// Drops the disk location of every entry in a region `doomed` says is
    /// gone (one pass over the index for any number of regions); returns
    /// how many.
    pub fn clear_regions(&self, doomed: impl Fn(u32) -> bool) -> u64 {
        self.clear_disk_where(|region, _| doomed(region))
    }

    /// `clear_regions` by region and key digest: drops the disk location
    /// of every entry for which `doomed(region, digest)` holds.
    pub fn clear_disk_where(&self, doomed: impl Fn(u32, KeyDigest) -> bool) -> u64 {
        self.clear_disk_where_each(doomed, |_| {})
    }

    /// `clear_disk_where`, calling `cleared` with each digest it applied to
    /// (outside the shard's lock).
    pub fn clear_disk_where_each(
        &self,
        doomed: impl Fn(u32, KeyDigest) -> bool,
        mut on_cleared: impl FnMut(KeyDigest),
    ) -> u64 {
        let mut cleared = 0;
        for shard in 0..SHARDS {
            let mut shard = self.lock_shard(shard);
            let hits: Vec<(KeyDigest, u64, Location)> = shard
                .table
                .iter()
                .filter_map(|(key, entry)| {
                    let loc = entry.disk?;
                    let digest = KeyDigest::from(key);
                    doomed(loc.region(), digest).then(|| (digest, entry.seq(), loc))
                })
                .collect();
            let mut applied = Vec::new();
            for (digest, seq, loc) in hits {
                if shard.clear_disk(digest, seq, loc) {
                    cleared += 1;
                    applied.push(digest);
                }
            }
            drop(shard);
            applied.into_iter().for_each(&mut on_cleared);
        }
        cleared
    }

    /// Drops every entry (and with them the pool leases they hold).
    pub fn clear(&self) {
        for shard in 0..SHARDS {
            *self.lock_shard(shard) = Shard::default();
        }
    }

    pub fn counts(&self) -> IndexCounts {
        let mut counts = IndexCounts::default();
        for shard in 0..SHARDS {
            let shard = self.lock_shard(shard);
            counts.entries += shard.table.len() as u64;
            counts.disk_entries += shard.disk_entries;
            counts.disk_bytes += shard.disk_bytes;
            counts.table_bytes += shard.table.memory_bytes() as u64;
        }
        counts
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::PoolCore;

    /// The packed entry holds the memory copy's `Arc` exactly once: cloned
    /// out on reads, released when the copy is dropped or the entry goes,
    /// and the length survives the memory copy.
    #[test]
    fn packed_entry_owns_its_memory_copy() {
        assert_eq!(std::mem::size_of::<Entry>(), 32);
        assert_eq!(SLOT_BYTES, 56);
        let pool = PoolCore::new(1 << 20).unwrap();
        let digest = crate::key::test_namespace("").digest(b"k");
        let slot = Arc::new(
            pool.try_allocate(5000, digest, Arc::from(&[0u8][..]))
                .unwrap(),
        );
        let mut shard = Shard::default();
        shard.insert(
            digest,
            Entry::new(7, 0, Some(Arc::clone(&slot)), None, 5000),
        );
        assert_eq!(Arc::strong_count(&slot), 2);
        let entry = shard.get(digest).unwrap();
        assert_eq!(
            (entry.seq(), entry.value_len(), entry.accessed()),
            (7, 5000, false)
        );
        assert!(Arc::ptr_eq(entry.mem().unwrap(), &slot));
        shard.mark_accessed(digest);
        assert!(shard.get(digest).unwrap().accessed());
        assert_eq!(shard.get(digest).unwrap().seq(), 7);
        // Durable on disk, then the memory copy goes: the length stays.
        assert!(shard.set_disk(digest, 7, Location::new(3, 9), 0xABCD));
        assert!(shard.drop_mem(digest, &slot));
        assert_eq!(Arc::strong_count(&slot), 1);
        let entry = shard.get(digest).unwrap();
        assert!(entry.mem().is_none());
        assert_eq!((entry.value_len(), entry.checksum()), (5000, 0xABCD));
        assert_eq!(entry.disk(), Some(Location::new(3, 9)));
        // An entry dropped with its memory copy releases it.
        let other = crate::key::test_namespace("").digest(b"other");
        shard.insert(other, Entry::new(8, 0, Some(Arc::clone(&slot)), None, 5000));
        assert_eq!(Arc::strong_count(&slot), 2);
        drop(shard.remove(other));
        assert_eq!(Arc::strong_count(&slot), 1);
        shard.insert(other, Entry::new(9, 0, Some(Arc::clone(&slot)), None, 5000));
        drop(shard);
        assert_eq!(Arc::strong_count(&slot), 1);
    }

    /// Measures the index's memory per entry through a whole growth cycle
    /// of the shards' tables (they grow by 1.5x, so sizes a tenth apart
    /// from 1 to 2.5 million entries meet every point of the cycle): at
    /// most 64 bytes per entry at every one.
    #[test]
    fn memory_per_entry() {
        let index = Index::default();
        let mut samples = Vec::new();
        let mut inserted = 0u64;
        let targets = (10..=25).map(|tenths| tenths * 100_000u64);
        for target in std::iter::once(250_000).chain(targets) {
            while inserted < target {
                let digest = crate::key::test_namespace("").digest(&inserted.to_le_bytes());
                index.lock(digest).insert(
                    digest,
                    Entry::new(inserted, 0, None, Some(Location::new(1, 1)), 65536),
                );
                inserted += 1;
            }
            let counts = index.counts();
            assert_eq!(counts.entries, target);
            assert_eq!(counts.disk_entries, target);
            let per_entry = counts.table_bytes as f64 / target as f64;
            samples.push((target, per_entry));
        }
        for (n, per_entry) in &samples {
            println!("index: {n} entries, {per_entry:.1} bytes per entry");
        }
        let at_scale: Vec<_> = samples.iter().filter(|s| s.0 >= 1_000_000).collect();
        assert!(at_scale.iter().all(|s| s.1 <= 64.0), "{samples:?}");
        // Below that, the shards' partly filled arena chunks show.
        assert!(samples.iter().all(|s| s.1 <= 80.0), "{samples:?}");
    }
}
