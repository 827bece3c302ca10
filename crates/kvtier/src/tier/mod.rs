//! The seam between the store and the tiers below its memory pool
//! (docs/design.md, "Tiers"). The store keeps the policy: where a put goes,
//! what a lookup found, what a failed or rejected read means for the index
//! and the caller. A tier keeps the mechanism: where its values are (a
//! [`Location`] the index stores and the store never reads into), reading
//! them verified into the caller's memory within the storage deadline,
//! scanning what it recorded, and reporting its usage. The store talks to
//! a tier only through [`LowerTier`]; the concrete tier is named in the
//! store's composition (`store/open.rs`) alone.
//!
//! What a tier must guarantee is the contract below, method by method; the
//! region log (`disk::DiskTier`) implements it, and the store's tests run
//! its read policy against a model tier (`store/model_tier.rs`).

mod batch;
mod location;

pub use batch::{PendingBatch, RecordEntry, RecordKind};
pub use location::Location;

use crate::error::{Error, Result};
use crate::key::KeyDigest;
use std::any::Any;
use std::sync::Arc;

/// Where a read writes one value: a single buffer, or segments filled in
/// order (the multi-buffer form).
pub(crate) trait Destination {
    /// Bytes the destination holds in all.
    fn capacity(&self) -> usize;
    /// The destination as one slice, when it is one (direct reads need it).
    fn contiguous(&mut self) -> Option<&mut [u8]>;
    /// Copies `bytes` (at most `capacity()`) to the front of the destination.
    fn fill_from(&mut self, bytes: &[u8]) {
        self.fill_at(0, bytes);
    }
    /// Copies `bytes` to the destination from byte `at` on (`at +
    /// bytes.len()` at most `capacity()`).
    fn fill_at(&mut self, at: usize, bytes: &[u8]);
    /// `fill_at` for a copy bound elsewhere (the caller's other threads,
    /// its device): large pieces with non-temporal stores
    /// (`bulk_copy::copy_for_elsewhere`), where the destination allows.
    fn fill_at_streamed(&mut self, at: usize, bytes: &[u8]) {
        self.fill_at(at, bytes);
    }
    /// `fill_at_streamed` to the front of the destination.
    fn fill_streamed(&mut self, bytes: &[u8]) {
        self.fill_at_streamed(0, bytes);
    }
}

impl Destination for &mut [u8] {
    fn capacity(&self) -> usize {
        self.len()
    }
    fn contiguous(&mut self) -> Option<&mut [u8]> {
        Some(&mut self[..])
    }
    fn fill_at(&mut self, at: usize, bytes: &[u8]) {
        self[at..at + bytes.len()].copy_from_slice(bytes);
    }
    fn fill_at_streamed(&mut self, at: usize, bytes: &[u8]) {
        crate::bulk_copy::copy_for_elsewhere(&mut self[at..at + bytes.len()], bytes);
    }
}

impl Destination for &mut [&mut [u8]] {
    fn capacity(&self) -> usize {
        self.iter().map(|s| s.len()).sum()
    }
    fn contiguous(&mut self) -> Option<&mut [u8]> {
        match self {
            [only] => Some(&mut only[..]),
            _ => None,
        }
    }
    fn fill_at(&mut self, at: usize, bytes: &[u8]) {
        fill_segments(self, at, bytes, |to, from| to.copy_from_slice(from));
    }
    fn fill_at_streamed(&mut self, at: usize, bytes: &[u8]) {
        fill_segments(self, at, bytes, crate::bulk_copy::copy_for_elsewhere);
    }
}

/// Copies `bytes` into `segments` laid end to end, from byte `at` on, with
/// `copy` (equal lengths) for each segment's part.
fn fill_segments(
    segments: &mut [&mut [u8]],
    mut at: usize,
    mut bytes: &[u8],
    copy: impl Fn(&mut [u8], &[u8]),
) {
    for segment in segments.iter_mut() {
        if bytes.is_empty() {
            break;
        }
        if at >= segment.len() {
            at -= segment.len();
            continue;
        }
        let n = (segment.len() - at).min(bytes.len());
        copy(&mut segment[at..at + n], &bytes[..n]);
        at = 0;
        bytes = &bytes[n..];
    }
}

/// A destination seen through the seam: the store hands a batch's
/// destinations to a tier as trait objects, whatever their kind.
impl Destination for &mut (dyn Destination + '_) {
    fn capacity(&self) -> usize {
        (**self).capacity()
    }
    fn contiguous(&mut self) -> Option<&mut [u8]> {
        (**self).contiguous()
    }
    fn fill_from(&mut self, bytes: &[u8]) {
        (**self).fill_from(bytes);
    }
    fn fill_at(&mut self, at: usize, bytes: &[u8]) {
        (**self).fill_at(at, bytes);
    }
    fn fill_at_streamed(&mut self, at: usize, bytes: &[u8]) {
        (**self).fill_at_streamed(at, bytes);
    }
    fn fill_streamed(&mut self, bytes: &[u8]) {
        (**self).fill_streamed(bytes);
    }
}

/// What became of one value read from a tier.
#[derive(Debug)]
pub(crate) enum ReadOutcome {
    /// The destination's first `len` bytes are the value: read in full,
    /// checksum and key digest verified.
    Verified,
    /// The bytes read are not this key's value (checksum or digest
    /// mismatch, or the value lies past the end of its file). Whatever
    /// landed in the destination has been zeroed.
    Rejected(String),
    /// The read itself failed; the destination's contents are undefined.
    Failed(Error),
    /// The read did not complete within the storage deadline
    /// (`Config::io_deadline`): the destination holds none of the value's
    /// bytes (what was copied before the deadline has been zeroed), and
    /// the read goes on into memory of the store's own.
    TimedOut,
}

/// One value a tier located for reading: what the index says about it,
/// and what the tier holds to keep its bytes readable until the read is
/// done (the region log: its region file, kept open while a reclaim
/// unlinks it). Taken under the index shard's lock, so that nothing the
/// tier reclaims meanwhile can take the bytes.
#[derive(Clone)]
pub(crate) struct TierRead {
    pub digest: KeyDigest,
    pub loc: Location,
    pub len: usize,
    pub checksum: u64,
    /// The tier's own; only the tier that located the value looks inside.
    pub held: Arc<dyn Any + Send + Sync>,
}

impl std::fmt::Debug for TierRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierRead")
            .field("loc", &self.loc)
            .field("len", &self.len)
            .finish()
    }
}

/// What a tier reports of itself (`Store::stats`).
#[derive(Debug, Clone, Default)]
pub(crate) struct TierUsage {
    /// Bytes it holds (files included whole).
    pub used_bytes: u64,
    /// Units it holds (the region log: regions).
    pub units: u64,
    /// Its io engine's name.
    pub io_engine: &'static str,
    pub direct_io: bool,
    pub fixed_buffers: bool,
    pub registered_files: bool,
    /// Reads past the storage deadline since open, stalls seen, and the
    /// read batches (and their buffer bytes) the kernel still holds.
    pub deadline_misses: u64,
    pub stalls: u64,
    pub stalled_reads: u64,
    pub stalled_read_bytes: u64,
    /// Units of other writers read through the page cache.
    pub buffered_other_units: u64,
}

/// Where a value's durable copy lies (see [`crate::NamespacedStore::disk_location`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskLocation {
    /// The region file.
    pub path: std::path::PathBuf,
    /// Byte offset of the value in the file (a multiple of 4096).
    pub offset: u64,
    pub len: u32,
    /// The key's digest, which seeds the value checksum.
    pub digest: crate::key::KeyDigest,
    /// `value_checksum(digest, value)`.
    pub checksum: u64,
}

/// A tier below the memory pool, as the store sees it. Every method may be
/// called from many threads at once.
pub(crate) trait LowerTier: Send + Sync + std::fmt::Debug {
    /// Locates the value at `loc` for a read, holding what keeps it
    /// readable (`TierRead::held`); `None` when the tier no longer has the
    /// unit `loc` names (reclaimed, or another writer's and dropped): the
    /// store answers a miss. Called under the index shard's lock: must not
    /// block on I/O.
    fn locate(
        &self,
        digest: KeyDigest,
        loc: Location,
        len: usize,
        checksum: u64,
    ) -> Option<TierRead>;

    /// Reads every `Some` of `reads` into the destination of the same
    /// index, all at once, and verifies each (checksum and key digest)
    /// before it counts. Per read: `Verified` (the destination's first
    /// `len` bytes are the value), `Rejected` (the bytes are not this
    /// key's value; nothing of them is left in the destination), `Failed`
    /// (the read failed), or `TimedOut` (not within the storage deadline;
    /// nothing of the value is left in the destination, and nothing lands
    /// in it later). `None` where `reads` has `None`. Every destination
    /// holds at least its value's length (the store checked it).
    fn read_verified(
        &self,
        reads: &[Option<TierRead>],
        dests: &mut [&mut dyn Destination],
    ) -> Vec<Option<ReadOutcome>>;

    /// Whether `loc` holds another writer's bytes (a shared directory's):
    /// a read that fails there is a miss, never an error (the writer may
    /// have reclaimed it since this node looked).
    fn is_others(&self, loc: Location) -> bool;

    /// Visits every entry the tier recorded, with the location of each
    /// put it still holds, within the storage deadline: a scan given up on
    /// is an error (`TimedOut`), and the caller must not act on the part
    /// it saw.
    fn visit_records(
        self: Arc<Self>,
        visit: &mut dyn FnMut(Option<Location>, RecordEntry),
    ) -> Result<()>;

    /// Where `loc`'s bytes lie in a file, for tools that read the files
    /// themselves; `None` when the tier keeps no such file or no longer
    /// has the unit.
    fn file_location(
        &self,
        loc: Location,
        len: u32,
        digest: KeyDigest,
        checksum: u64,
    ) -> Option<DiskLocation>;

    /// What the tier holds and how it reads (`Store::stats`).
    fn usage(&self) -> TierUsage;

    /// The most other writers' files it keeps open at once (a shared
    /// directory's; no effect elsewhere).
    fn set_open_files_budget(&self, files: usize);

    /// The store closes: nothing writes to the tier any more, and the
    /// directory `dir` is about to be unlocked. Releases what the tier's
    /// io engine held on it.
    fn closing(&self, dir: &std::fs::File);
}

/// The writing half of a tier: what the flusher (`flusher::Flusher`, the
/// one thread that writes below memory) asks of it, batch after batch, in
/// sequence order. Only the flusher calls it.
pub(crate) trait TierWriter: Send + std::fmt::Debug {
    /// The largest batch, in the bytes `batch_len` counts, the tier can
    /// take in one write.
    fn max_batch_len(&self) -> u64;

    /// Runs once before the first batch (the region log: a dead writer's
    /// regions reclaimed first when collecting it, a capacity smaller than
    /// what the files hold shrunk to).
    fn prepare(&self);

    /// Makes room for `batch` before its sequence numbers' base is read
    /// (the region log reclaims whole regions, oldest first, and may write
    /// carried values and kept removals while it does).
    fn make_room(&self, batch: &PendingBatch<'_>);

    /// Writes `batch` durably (on return it survives a crash and a power
    /// cut); `first_seq` is the lowest sequence number it may hold. The
    /// location of each put, in order. On an error nothing of the batch
    /// counts: the flusher retries it whole.
    fn write_batch(&self, batch: &mut PendingBatch<'_>, first_seq: u64) -> Result<Vec<Location>>;

    /// A write failed because the file system is full: make room the way
    /// a cache does (drop the oldest unit) before the retry.
    fn on_full(&self);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A destination of segments, seen through the seam as a trait object
    /// (as the store hands a batch's destinations to a tier): every fill
    /// lands at its byte, across segment boundaries, by either copy.
    #[test]
    fn segmented_destinations_fill_across_boundaries_through_a_trait_object() {
        let bytes: Vec<u8> = (0..=255).collect();
        for streamed in [false, true] {
            let (mut a, mut b, mut c) = (vec![0u8; 100], vec![0u8; 1], vec![0u8; 200]);
            let mut segments: Vec<&mut [u8]> = vec![&mut a[..], &mut b[..], &mut c[..]];
            let mut segmented: &mut [&mut [u8]] = &mut segments[..];
            let seen: &mut dyn Destination = &mut segmented;
            assert_eq!(seen.capacity(), 301);
            assert!(
                seen.contiguous().is_none(),
                "three segments are not one slice"
            );
            if streamed {
                seen.fill_at_streamed(40, &bytes);
            } else {
                seen.fill_at(40, &bytes);
            }
            let whole: Vec<u8> = [&a[..], &b[..], &c[..]].concat();
            assert!(whole[..40].iter().all(|&x| x == 0));
            assert_eq!(&whole[40..296], &bytes[..]);
            assert!(whole[296..].iter().all(|&x| x == 0));
        }
        let mut one = vec![0u8; 8];
        let mut slice: &mut [u8] = &mut one[..];
        let seen: &mut dyn Destination = &mut slice;
        assert_eq!(seen.contiguous().map(|s| s.len()), Some(8));
        seen.fill_streamed(&[9, 9]);
        seen.fill_from(&[7]);
        assert_eq!(one, [7, 9, 0, 0, 0, 0, 0, 0]);
    }
}
