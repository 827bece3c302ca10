//! The region log as the store sees it: `DiskTier` behind the tier seam
//! (`tier::LowerTier`). Each method forwards to the concern that owns it;
//! what crosses the seam is translated here (a located value's region is
//! what the read holds, a batch record's entry is what a scan shows).

use super::format::RecordKind;
use super::read::ValueRead;
use super::{DiskLoc, DiskTier, Region};
use crate::error::Result;
use crate::key::KeyDigest;
use crate::tier::{
    Destination, DiskLocation, LowerTier, ReadOutcome, RecordedEntry, TierRead, TierUsage,
};
use std::sync::atomic::Ordering;
use std::sync::Arc;

impl LowerTier for DiskTier {
    fn locate(
        &self,
        digest: KeyDigest,
        loc: DiskLoc,
        len: usize,
        checksum: u64,
    ) -> Option<TierRead> {
        let region = self.region(loc.region())?;
        Some(TierRead {
            digest,
            loc,
            len,
            checksum,
            held: region,
        })
    }

    fn read_verified(
        &self,
        reads: &[Option<TierRead>],
        dests: &mut [&mut dyn Destination],
    ) -> Vec<Option<ReadOutcome>> {
        let reads: Vec<Option<ValueRead>> = reads
            .iter()
            .map(|read| {
                let read = read.as_ref()?;
                // Only this tier locates what it reads: the held value is
                // the region `locate` took.
                let region = Arc::clone(&read.held).downcast::<Region>().ok()?;
                Some(ValueRead {
                    digest: read.digest,
                    region,
                    loc: read.loc,
                    len: read.len,
                    checksum: read.checksum,
                })
            })
            .collect();
        self.read_values(&reads, dests)
    }

    fn is_others(&self, loc: DiskLoc) -> bool {
        self.is_other_writers(loc)
    }

    fn visit_records(
        self: Arc<Self>,
        visit: &mut dyn FnMut(Option<DiskLoc>, RecordedEntry),
    ) -> Result<()> {
        self.visit_records_within(|loc, entry| {
            visit(
                loc,
                RecordedEntry {
                    put: entry.kind == RecordKind::Put,
                    seq: entry.seq,
                    digest: entry.digest,
                    value_len: entry.value_len,
                    key: entry.key,
                },
            )
        })
    }

    fn file_location(
        &self,
        loc: DiskLoc,
        len: u32,
        digest: KeyDigest,
        checksum: u64,
    ) -> Option<DiskLocation> {
        self.file_location_of(loc, len, digest, checksum)
    }

    fn usage(&self) -> TierUsage {
        let (deadline_misses, stalls, stalled_reads, stalled_read_bytes) = self.deadline_counts();
        TierUsage {
            used_bytes: self.used(),
            units: self.region_count() as u64,
            io_engine: self.engine_name(),
            direct_io: self.direct_io.load(Ordering::Relaxed),
            fixed_buffers: self.engine.uses_fixed_buffers(),
            registered_files: self.engine.uses_registered_files(),
            deadline_misses,
            stalls,
            stalled_reads,
            stalled_read_bytes,
            buffered_other_units: self.buffered_other_files(),
        }
    }

    fn set_open_files_budget(&self, files: usize) {
        self.set_other_files_budget(files);
    }

    fn closing(&self, dir: &std::fs::File) {
        self.engine.release_hold(dir);
    }
}
