//! The in-memory index: key digest → where the value lives. Public for
//! benchmarks and tools; applications use [`crate::Store`].
//!
//! Sharded so that lookups on different keys rarely meet on a lock; each
//! shard keeps its own tier counters so `stats()` needs no global atomics on
//! the data path. Every change to an entry's tiers goes through `Shard`
//! methods, which keep those counters true.

use crate::key::KeyDigest;
use crate::pool::PoolSlot;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hash, Hasher};
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex, MutexGuard};

const SHARDS: usize = 64;

/// Bytes of one hash-table slot: key, entry and the control byte.
pub const SLOT_BYTES: usize = std::mem::size_of::<(DigestKey, Entry)>() + 1;

/// Where a value lives in the disk tier: a region and the value's offset
/// in it, in 4 KiB pages. Stored as region + 1 so that `Option<DiskLoc>`
/// costs no extra bytes in every index entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskLoc {
    region_plus_one: NonZeroU32,
    page: u32,
}

impl DiskLoc {
    /// Region ids stop below `u32::MAX` (the region allocator refuses it).
    pub fn new(region: u32, page: u32) -> Self {
        DiskLoc {
            region_plus_one: NonZeroU32::new(region.wrapping_add(1))
                .expect("region id below u32::MAX"),
            page,
        }
    }

    pub fn region(self) -> u32 {
        self.region_plus_one.get() - 1
    }

    pub fn page(self) -> u32 {
        self.page
    }
}

#[derive(Debug)]
pub struct Entry {
    /// Sequence number of the put that wrote this value; higher wins.
    pub seq: u64,
    /// `value_checksum` of the value; meaningful once `disk` is set.
    pub checksum: u64,
    pub mem: Option<Arc<PoolSlot>>,
    pub disk: Option<DiskLoc>,
    pub len: u32,
    /// Read since written or last carried: earns a second chance when its
    /// region is reclaimed.
    pub accessed: bool,
}

/// The map key: the digest as two u64 halves, so a slot is 8-aligned
/// (a u128 would pad every slot to 16 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct DigestKey {
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

impl Hash for DigestKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.low);
    }
}

/// The digest is already uniformly random; its low 64 bits are the hash.
#[derive(Debug, Default)]
pub struct DigestHasher(u64);

impl Hasher for DigestHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, value: u64) {
        self.0 = value;
    }

    fn write_u128(&mut self, value: u128) {
        self.0 = value as u64;
    }
}

type DigestMap = HashMap<DigestKey, Entry, BuildHasherDefault<DigestHasher>>;

#[derive(Debug, Default)]
pub struct Shard {
    map: DigestMap,
    disk_entries: u64,
    disk_bytes: u64,
}

impl Shard {
    pub fn get(&self, digest: KeyDigest) -> Option<&Entry> {
        self.map.get(&DigestKey::from(digest))
    }

    pub fn mark_accessed(&mut self, digest: KeyDigest) {
        if let Some(entry) = self.map.get_mut(&DigestKey::from(digest)) {
            entry.accessed = true;
        }
    }

    pub fn insert(&mut self, digest: KeyDigest, entry: Entry) -> Option<Entry> {
        self.count_in(&entry);
        let old = self.map.insert(DigestKey::from(digest), entry);
        if let Some(old) = &old {
            self.count_out(old);
        }
        old
    }

    pub fn remove(&mut self, digest: KeyDigest) -> Option<Entry> {
        let old = self.map.remove(&DigestKey::from(digest));
        if let Some(old) = &old {
            self.count_out(old);
        }
        old
    }

    /// Records that the put `seq` is now durable at `loc`, unless a newer
    /// put or a remove replaced it meanwhile. Returns whether it applied.
    pub fn set_disk(&mut self, digest: KeyDigest, seq: u64, loc: DiskLoc, checksum: u64) -> bool {
        let Some(entry) = self.map.get_mut(&DigestKey::from(digest)) else {
            return false;
        };
        if entry.seq != seq {
            return false;
        }
        if entry.disk.is_none() {
            self.disk_entries += 1;
            self.disk_bytes += u64::from(entry.len);
        }
        entry.disk = Some(loc);
        entry.checksum = checksum;
        true
    }

    /// Forgets the disk copy of put `seq` if it is still at `loc`; an entry
    /// left in no tier is removed. Returns whether it applied.
    pub fn clear_disk(&mut self, digest: KeyDigest, seq: u64, loc: DiskLoc) -> bool {
        let Some(entry) = self.map.get_mut(&DigestKey::from(digest)) else {
            return false;
        };
        if entry.seq != seq || entry.disk != Some(loc) {
            return false;
        }
        entry.disk = None;
        self.disk_entries -= 1;
        self.disk_bytes -= u64::from(entry.len);
        if entry.mem.is_none() {
            self.map.remove(&DigestKey::from(digest));
        } else if let Some(slot) = &entry.mem {
            // Its only durable copy is gone: from now on the memory copy
            // is a droppable cache entry.
            slot.set_evictable();
        }
        true
    }

    /// Points put `seq` at a new disk location (a carried value).
    pub fn move_disk(&mut self, digest: KeyDigest, seq: u64, loc: DiskLoc) -> bool {
        match self.map.get_mut(&DigestKey::from(digest)) {
            Some(entry) if entry.seq == seq && entry.disk.is_some() => {
                entry.disk = Some(loc);
                true
            }
            _ => false,
        }
    }

    /// Forgets put `seq`'s disk copy wherever it is.
    pub fn forget_disk(&mut self, digest: KeyDigest, seq: u64) -> bool {
        let loc = match self.map.get(&DigestKey::from(digest)) {
            Some(entry) if entry.seq == seq => entry.disk,
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
        loc: DiskLoc,
        new_seq: u64,
    ) -> bool {
        match self.map.get_mut(&DigestKey::from(digest)) {
            Some(entry) if entry.seq == old_seq && entry.disk == Some(loc) => {
                entry.seq = new_seq;
                entry.accessed = false;
                true
            }
            _ => false,
        }
    }

    /// Drops the memory copy if the entry still holds `slot`; an entry left
    /// in no tier is removed. Returns whether it applied.
    pub fn drop_mem(&mut self, digest: KeyDigest, slot: &Arc<PoolSlot>) -> bool {
        let Some(entry) = self.map.get_mut(&DigestKey::from(digest)) else {
            return false;
        };
        if !entry.mem.as_ref().is_some_and(|m| Arc::ptr_eq(m, slot)) {
            return false;
        }
        entry.mem = None;
        if entry.disk.is_none() {
            self.map.remove(&DigestKey::from(digest));
        }
        true
    }

    fn count_in(&mut self, entry: &Entry) {
        if entry.disk.is_some() {
            self.disk_entries += 1;
            self.disk_bytes += u64::from(entry.len);
        }
    }

    fn count_out(&mut self, entry: &Entry) {
        if entry.disk.is_some() {
            self.disk_entries -= 1;
            self.disk_bytes -= u64::from(entry.len);
        }
    }
}

/// Totals over all shards.
#[derive(Debug, Default, Clone, Copy)]
pub struct IndexCounts {
    pub entries: u64,
    pub disk_entries: u64,
    pub disk_bytes: u64,
    /// Bytes the hash tables hold (slots and control bytes), for the
    /// per-entry memory figure.
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
        let mut found = vec![false; digests.len()];
        let mut order: Vec<(usize, usize)> = digests
            .iter()
            .enumerate()
            .map(|(i, &d)| (self.shard_of(d), i))
            .collect();
        order.sort_unstable();
        for group in order.chunk_by(|a, b| a.0 == b.0) {
            let shard = self.lock_shard(group[0].0);
            for &(_, i) in group {
                found[i] = shard.get(digests[i]).is_some();
            }
        }
        found
    }

    /// Drops every entry (and with them the pool leases they hold).
    pub fn clear(&self) {
        for shard in self.shards.iter() {
            *shard.lock().unwrap() = Shard::default();
        }
    }

    pub fn counts(&self) -> IndexCounts {
        let slot = std::mem::size_of::<(DigestKey, Entry)>() as u64 + 1;
        let mut counts = IndexCounts::default();
        for shard in self.shards.iter() {
            let shard = shard.lock().unwrap();
            counts.entries += shard.map.len() as u64;
            counts.disk_entries += shard.disk_entries;
            counts.disk_bytes += shard.disk_bytes;
            // The table holds capacity * 8 / 7 buckets (its load factor),
            // rounded to a power of two.
            let capacity = shard.map.capacity() as u64;
            let buckets = if capacity == 0 {
                0
            } else {
                (capacity * 8).div_ceil(7).next_power_of_two()
            };
            counts.table_bytes += buckets * slot;
        }
        counts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Measures the index's memory per entry across a range of sizes (the
    /// hash table doubles, so bytes per entry swing with the load factor).
    #[test]
    fn memory_per_entry() {
        let index = Index::default();
        let mut samples = Vec::new();
        let mut inserted = 0u64;
        for target in [250_000u64, 500_000, 1_000_000, 1_500_000, 2_000_000] {
            while inserted < target {
                let digest = crate::key::test_namespace("").digest(&inserted.to_le_bytes());
                index.lock(digest).insert(
                    digest,
                    Entry {
                        seq: inserted,
                        checksum: 0,
                        mem: None,
                        disk: Some(DiskLoc::new(1, 1)),
                        len: 65536,
                        accessed: false,
                    },
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
        let mean = samples.iter().map(|s| s.1).sum::<f64>() / samples.len() as f64;
        println!(
            "index: mean {mean:.1} bytes per entry, slot {} bytes",
            std::mem::size_of::<(DigestKey, Entry)>() + 1
        );
        assert!(samples.iter().all(|s| s.1 < 160.0), "{samples:?}");
    }
}
