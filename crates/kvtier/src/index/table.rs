//! One shard's hash table from key digest to entry, laid out for memory
//! per entry and for batches that overlap their cache misses.
//!
//! - **The arena** holds the entries densely, each with its digest (48
//!   bytes), in chunks of [`CHUNK`] entries: memory follows the entry count
//!   with at most one partly filled chunk and one spare, never a doubling.
//!   A removal moves the last entry into the hole.
//! - **The table** holds 8-byte slots, eight to a 64-byte bucket (one cache
//!   line): a slot is the entry's arena position + 1 in its low 32 bits and
//!   a tag, 32 bits of the digest that choose neither the bucket nor the
//!   shard, in its high 32. A lookup reads one bucket and, on a tag match,
//!   one arena entry, whose whole digest decides.
//! - The table is rebuilt when its used slots (entries and tombstones)
//!   would pass 7/8 of them, to 1.5x the live entries' need, so it costs
//!   between 9.1 and 13.7 bytes per entry: with the arena, at most 62 bytes
//!   per entry at scale (a map holding the entry beside the digest and
//!   doubling would cost 56 to 112).
//!
//! Buckets are probed linearly from the digest's home bucket; a probe
//! stops at the first bucket with an empty slot. A removed slot becomes
//! empty when its bucket has another empty slot (no key was ever placed
//! past a bucket with an empty slot, and a bucket never regains one until
//! the next rebuild), a tombstone otherwise.

use super::{DigestKey, Entry};

/// Entries per arena chunk: 48 KiB, below the allocator's mmap threshold
/// so a chunk freed and allocated again at a boundary stays cheap.
pub(super) const CHUNK: usize = 1024;

const SLOTS_PER_BUCKET: usize = 8;
const EMPTY: u64 = 0;
/// A removed slot on a probe path: no position (low 32 bits zero), not
/// empty.
const TOMBSTONE: u64 = u64::MAX << 32;
const TAG_MASK: u64 = u64::MAX << 32;
/// Positions are stored + 1 in 32 bits.
const MAX_ENTRIES: usize = u32::MAX as usize - 1;

/// One cache line of slots.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Bucket([u64; SLOTS_PER_BUCKET]);

/// Bytes one entry occupies in the arena: its digest and the entry.
pub(super) const STORED_BYTES: usize = std::mem::size_of::<Stored>();
/// Bytes of one table slot.
pub(super) const SLOT_BYTES: usize = std::mem::size_of::<u64>();

struct Stored {
    key: DigestKey,
    entry: Entry,
}

#[derive(Default)]
pub(super) struct DigestTable {
    buckets: Vec<Bucket>,
    /// Slots holding an entry or a tombstone.
    used: usize,
    arena: Vec<Vec<Stored>>,
    len: usize,
}

fn tag(key: DigestKey) -> u64 {
    // The shard is the high word's low bits and the bucket the low word:
    // the high word's high half is free for the tag.
    key.high & TAG_MASK
}

fn is_full(slot: u64) -> bool {
    slot as u32 != 0
}

fn position(slot: u64) -> usize {
    (slot as u32 - 1) as usize
}

/// The bucket a digest starts probing at, uniform over `buckets`.
fn home(key: DigestKey, buckets: usize) -> usize {
    ((u128::from(key.low) * buckets as u128) >> 64) as usize
}

/// Buckets for `live` entries at 7/12 load (7/8 divided by 1.5).
fn buckets_for(live: usize) -> usize {
    (live * 3).div_ceil(14).max(1)
}

impl DigestTable {
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Bytes the table and the arena hold.
    pub(super) fn memory_bytes(&self) -> usize {
        self.buckets.len() * std::mem::size_of::<Bucket>()
            + self.arena.iter().map(Vec::capacity).sum::<usize>() * STORED_BYTES
            + self.arena.capacity() * std::mem::size_of::<Vec<Stored>>()
    }

    fn stored(&self, pos: usize) -> &Stored {
        &self.arena[pos / CHUNK][pos % CHUNK]
    }

    fn stored_mut(&mut self, pos: usize) -> &mut Stored {
        &mut self.arena[pos / CHUNK][pos % CHUNK]
    }

    fn next_bucket(&self, bucket: usize) -> usize {
        if bucket + 1 == self.buckets.len() {
            0
        } else {
            bucket + 1
        }
    }

    /// The slot index (bucket * 8 + slot) and arena position of `key`.
    fn find(&self, key: DigestKey) -> Option<(usize, usize)> {
        self.probe(key, |slot, table| {
            slot & TAG_MASK == tag(key) && table.stored(position(slot)).key == key
        })
    }

    /// The first full slot on `key`'s probe path for which `matches`
    /// holds, as (slot index, arena position).
    fn probe(
        &self,
        key: DigestKey,
        matches: impl Fn(u64, &Self) -> bool,
    ) -> Option<(usize, usize)> {
        if self.buckets.is_empty() {
            return None;
        }
        let mut bucket = home(key, self.buckets.len());
        for _ in 0..self.buckets.len() {
            let mut has_empty = false;
            for (i, &slot) in self.buckets[bucket].0.iter().enumerate() {
                if slot == EMPTY {
                    has_empty = true;
                } else if is_full(slot) && matches(slot, self) {
                    return Some((bucket * SLOTS_PER_BUCKET + i, position(slot)));
                }
            }
            if has_empty {
                return None;
            }
            bucket = self.next_bucket(bucket);
        }
        None
    }

    pub(super) fn get(&self, key: DigestKey) -> Option<&Entry> {
        self.find(key).map(|(_, pos)| &self.stored(pos).entry)
    }

    pub(super) fn get_mut(&mut self, key: DigestKey) -> Option<&mut Entry> {
        let (_, pos) = self.find(key)?;
        Some(&mut self.stored_mut(pos).entry)
    }

    /// Inserts or replaces `key`'s entry; returns the one replaced.
    pub(super) fn insert(&mut self, key: DigestKey, entry: Entry) -> Option<Entry> {
        if let Some((_, pos)) = self.find(key) {
            return Some(std::mem::replace(&mut self.stored_mut(pos).entry, entry));
        }
        assert!(
            self.len < MAX_ENTRIES,
            "an index shard holds at most 2^32 - 2 entries"
        );
        if self.buckets.is_empty()
            || (self.used + 1) * 8 > self.buckets.len() * SLOTS_PER_BUCKET * 7
        {
            self.rebuild(self.len + 1);
        }
        let pos = self.len;
        if pos / CHUNK == self.arena.len() {
            self.arena.push(Vec::with_capacity(CHUNK));
        }
        self.arena[pos / CHUNK].push(Stored { key, entry });
        self.len += 1;
        self.place(key, pos);
        None
    }

    /// Puts `key`'s slot in the first free slot of its probe path.
    fn place(&mut self, key: DigestKey, pos: usize) {
        let value = tag(key) | (pos as u64 + 1);
        let mut bucket = home(key, self.buckets.len());
        loop {
            for slot in self.buckets[bucket].0.iter_mut() {
                if !is_full(*slot) {
                    if *slot == EMPTY {
                        self.used += 1;
                    }
                    *slot = value;
                    return;
                }
            }
            // A rebuild leaves free slots, so the loop ends.
            bucket = self.next_bucket(bucket);
        }
    }

    /// A fresh table sized for `live` entries, without tombstones.
    fn rebuild(&mut self, live: usize) {
        self.buckets = vec![Bucket([EMPTY; SLOTS_PER_BUCKET]); buckets_for(live)];
        self.used = 0;
        for pos in 0..self.len {
            let key = self.stored(pos).key;
            self.place(key, pos);
        }
    }

    pub(super) fn remove(&mut self, key: DigestKey) -> Option<Entry> {
        let (index, pos) = self.find(key)?;
        let bucket = &mut self.buckets[index / SLOTS_PER_BUCKET].0;
        bucket[index % SLOTS_PER_BUCKET] = if bucket.contains(&EMPTY) {
            self.used -= 1;
            EMPTY
        } else {
            TOMBSTONE
        };
        let last = self.len - 1;
        let tail = self.arena[last / CHUNK].pop().expect("the last entry");
        self.len = last;
        let removed = if pos == last {
            tail
        } else {
            let moved = tail.key;
            let removed = std::mem::replace(self.stored_mut(pos), tail);
            // The moved entry's slot still says `last`: point it at `pos`.
            let (index, _) = self
                .probe(moved, |slot, _| position(slot) == last)
                .expect("every entry has a slot");
            self.buckets[index / SLOTS_PER_BUCKET].0[index % SLOTS_PER_BUCKET] =
                tag(moved) | (pos as u64 + 1);
            removed
        };
        // Keep one spare chunk, so a count going up and down across a
        // chunk boundary does not allocate each time.
        self.arena.truncate(self.len.div_ceil(CHUNK) + 1);
        Some(removed.entry)
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (DigestKey, &Entry)> {
        self.arena
            .iter()
            .flatten()
            .map(|stored| (stored.key, &stored.entry))
    }

    /// Looks up a batch of (digest, caller's index) pairs, calling
    /// `found(index, entry)` for each digest present, with the cache misses
    /// of a group of keys overlapped: the group's buckets are prefetched,
    /// then the arena entries their tags point at, then the digests
    /// compared.
    pub(super) fn get_batch(
        &self,
        keys: &[(DigestKey, usize)],
        mut found: impl FnMut(usize, &Entry),
    ) {
        const GROUP: usize = 16;
        if self.buckets.is_empty() {
            return;
        }
        let buckets = self.buckets.len();
        for group in keys.chunks(GROUP) {
            for &(key, _) in group {
                prefetch(&self.buckets[home(key, buckets)]);
            }
            let mut candidates = [None; GROUP];
            for (candidate, &(key, _)) in candidates.iter_mut().zip(group) {
                *candidate =
                    self.probe(key, |slot, _| slot & TAG_MASK == tag(key))
                        .map(|(_, pos)| {
                            prefetch(self.stored(pos));
                            pos
                        });
            }
            for (&candidate, &(key, caller)) in candidates.iter().zip(group) {
                // No slot with the tag: absent.
                let Some(candidate) = candidate else {
                    continue;
                };
                let stored = self.stored(candidate);
                if stored.key == key {
                    found(caller, &stored.entry);
                } else if let Some(entry) = self.get(key) {
                    // Another digest shares the tag (one in 2^32): the
                    // full probe decides.
                    found(caller, entry);
                }
            }
        }
    }
}

impl std::fmt::Debug for DigestTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DigestTable")
            .field("len", &self.len)
            .field("buckets", &self.buckets.len())
            .field("used", &self.used)
            .finish()
    }
}

/// Asks the CPU to start loading `item`'s cache line (public through
/// `internals` for the bench's floor, which reads as the index does).
#[inline(always)]
pub fn prefetch<T>(item: &T) {
    prefetch_address((item as *const T).cast::<i8>());
}

#[inline(always)]
fn prefetch_address(address: *const i8) {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    // SAFETY: a prefetch is a hint: it reads nothing the program sees,
    // dereferences nothing in the language's sense, and cannot fault on
    // any address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(address);
    }
    #[cfg(not(all(target_arch = "x86_64", not(miri))))]
    let _ = address;
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn entry(seq: u64) -> Entry {
        Entry::new(seq, seq ^ 0x55, None, None, seq as u32)
    }

    /// Keys from a small space so that operations meet, with digests whose
    /// tag and home are chosen adversarially: `crowd` keys share one home
    /// bucket and one tag, so probes cross buckets and tags collide.
    fn key(n: u16, crowd: bool) -> DigestKey {
        if crowd {
            DigestKey {
                low: 7,
                high: 0xABCD_0000_0000_0000 | u64::from(n) << 8,
            }
        } else {
            let mixed = u64::from(n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            DigestKey {
                low: mixed,
                high: mixed.rotate_left(29) ^ u64::from(n),
            }
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u16, bool, u64),
        Remove(u16, bool),
        Batch(Vec<(u16, bool)>),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u16..600, any::<bool>(), 1u64..1 << 40).prop_map(|(k, c, s)| Op::Insert(k, c, s)),
            3 => (0u16..600, any::<bool>()).prop_map(|(k, c)| Op::Remove(k, c)),
            1 => proptest::collection::vec((0u16..600, any::<bool>()), 0..40).prop_map(Op::Batch),
        ]
    }

    proptest! {
        /// The table against a `HashMap` model: every insert, remove, get,
        /// batch and iteration agrees, through rebuilds, tombstones, probe
        /// runs across buckets and shared tags.
        #[test]
        fn table_matches_a_map(ops in proptest::collection::vec(op(), 1..1500)) {
            let mut table = DigestTable::default();
            let mut model: HashMap<(u64, u64), u64> = HashMap::new();
            for op in ops {
                match op {
                    Op::Insert(k, crowd, seq) => {
                        let key = key(k, crowd);
                        let old = table.insert(key, entry(seq)).map(|e| e.seq());
                        prop_assert_eq!(old, model.insert((key.low, key.high), seq));
                    }
                    Op::Remove(k, crowd) => {
                        let key = key(k, crowd);
                        let old = table.remove(key).map(|e| e.seq());
                        prop_assert_eq!(old, model.remove(&(key.low, key.high)));
                    }
                    Op::Batch(keys) => {
                        let keys: Vec<(DigestKey, usize)> = keys
                            .iter()
                            .enumerate()
                            .map(|(i, &(k, c))| (key(k, c), i))
                            .collect();
                        let mut seen = vec![None; keys.len()];
                        table.get_batch(&keys, |i, e| seen[i] = Some(e.seq()));
                        for (i, (key, _)) in keys.iter().enumerate() {
                            prop_assert_eq!(seen[i], model.get(&(key.low, key.high)).copied());
                        }
                    }
                }
                prop_assert_eq!(table.len(), model.len());
                prop_assert!(table.used <= table.buckets.len() * SLOTS_PER_BUCKET * 7 / 8 + 1);
            }
            for (&(low, high), &seq) in &model {
                prop_assert_eq!(table.get(DigestKey { low, high }).map(Entry::seq), Some(seq));
            }
            let mut listed: Vec<(u64, u64, u64)> =
                table.iter().map(|(k, e)| (k.low, k.high, e.seq())).collect();
            listed.sort_unstable();
            let mut expected: Vec<(u64, u64, u64)> =
                model.iter().map(|(&(l, h), &s)| (l, h, s)).collect();
            expected.sort_unstable();
            prop_assert_eq!(listed, expected);
            prop_assert!(table.arena.len() <= table.len().div_ceil(CHUNK) + 1);
        }
    }

    /// Tags that collide on every key still find each key by its digest,
    /// in single and batch lookups.
    #[test]
    fn shared_tags_and_one_home_bucket_still_find_each_key() {
        let mut table = DigestTable::default();
        for n in 0..200 {
            table.insert(key(n, true), entry(u64::from(n) + 1));
        }
        for n in 0..200 {
            assert_eq!(
                table.get(key(n, true)).map(Entry::seq),
                Some(u64::from(n) + 1)
            );
        }
        let keys: Vec<(DigestKey, usize)> =
            (0..300).map(|n| (key(n, true), usize::from(n))).collect();
        let mut hits = 0;
        table.get_batch(&keys, |i, e| {
            assert_eq!(e.seq(), i as u64 + 1);
            hits += 1;
        });
        assert_eq!(hits, 200);
    }
}
