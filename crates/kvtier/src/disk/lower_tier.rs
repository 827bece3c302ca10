//! The region log as the store sees it: `DiskTier` behind the tier seam
//! (`tier::LowerTier`). Each method forwards to the concern that owns it;
//! what crosses the seam is translated here (a located value's region is
//! what the read holds, a batch record's entry is what a scan shows).

use super::read::ValueRead;
use super::{DiskLoc, DiskTier, Region};
use crate::error::Result;
use crate::key::KeyDigest;
use crate::tier::{
    Destination, DiskLocation, LowerTier, ReadOutcome, RecordEntry, TierRead, TierUsage,
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
                // the region `locate` took. Anything else is a bug that must
                // not pass as a hit with an unfilled buffer.
                let region = Arc::clone(&read.held)
                    .downcast::<Region>()
                    .expect("a read the region log located holds its region");
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
        visit: &mut dyn FnMut(Option<DiskLoc>, RecordEntry),
    ) -> Result<()> {
        self.visit_records_within(visit)
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

#[cfg(test)]
mod tests {
    //! The region log through the seam alone, as the store sees it.
    use super::super::test_log::{put, qualified, tombstone, TestLog};
    use super::super::RecoveryChecks;
    use super::*;
    use crate::key::value_checksum;
    use crate::tier::RecordKind;
    use std::io::{Seek, SeekFrom, Write};

    fn tier_of(log: &TestLog) -> Arc<dyn LowerTier> {
        let (tier, _, _) = log.open(RecoveryChecks::default());
        Arc::new(tier)
    }

    #[test]
    fn a_located_value_reads_verified_and_a_damaged_one_is_rejected_and_zeroed() {
        let log = TestLog::new(64 << 10);
        let (disk, _, _) = log.open(RecoveryChecks::default());
        let locs = log
            .write(&disk, &[put(b"a", 1, 5000, 0xa1), put(b"b", 2, 3000, 0xb2)])
            .unwrap();
        let tier: Arc<dyn LowerTier> = Arc::new(disk);
        let read = |key: &[u8], loc: DiskLoc, len: usize, fill: u8| {
            let digest = log.secret.digest_qualified(&qualified(key));
            let checksum = value_checksum(digest, &vec![fill; len]);
            tier.locate(digest, loc, len, checksum)
                .expect("the region is there")
        };
        let reads = [
            Some(read(b"a", locs[0], 5000, 0xa1)),
            None,
            Some(read(b"b", locs[1], 3000, 0xb2)),
        ];
        let (mut a, mut skipped, mut b) = (vec![0u8; 8192], vec![7u8; 16], vec![0u8; 4096]);
        let (mut a_s, mut skipped_s, mut b_s) = (&mut a[..], &mut skipped[..], &mut b[..]);
        let mut dests: Vec<&mut dyn Destination> = vec![&mut a_s, &mut skipped_s, &mut b_s];
        let outcomes = tier.read_verified(&reads, &mut dests);
        assert!(matches!(outcomes[0], Some(ReadOutcome::Verified)));
        assert!(outcomes[1].is_none(), "no read where the batch has none");
        assert!(matches!(outcomes[2], Some(ReadOutcome::Verified)));
        assert!(a[..5000].iter().all(|&x| x == 0xa1) && b[..3000].iter().all(|&x| x == 0xb2));
        assert!(
            skipped.iter().all(|&x| x == 7),
            "a destination without a read is untouched"
        );
        assert!(!tier.is_others(locs[0]));

        // A byte of b's value changed on disk: rejected, and nothing of it
        // is left in the destination.
        let (_, path) = log.region_files().pop().unwrap();
        let mut file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        let at = u64::from(locs[1].page()) * crate::units::PAGE_SIZE + 10;
        file.seek(SeekFrom::Start(at)).unwrap();
        file.write_all(&[0]).unwrap();
        file.sync_all().unwrap();
        let reads = [Some(read(b"b", locs[1], 3000, 0xb2))];
        let mut b = vec![0x55u8; 4096];
        let mut b_s = &mut b[..];
        let mut dests: Vec<&mut dyn Destination> = vec![&mut b_s];
        let outcomes = tier.read_verified(&reads, &mut dests);
        assert!(
            matches!(outcomes[0], Some(ReadOutcome::Rejected(_))),
            "{:?}",
            outcomes[0]
        );
        assert!(
            !b[..3000].contains(&0xb2),
            "a rejected value's bytes stay out"
        );
    }

    #[test]
    fn a_removed_region_is_not_located_but_a_read_already_located_still_reads() {
        let log = TestLog::new(64 << 10);
        let (disk, _, _) = log.open(RecoveryChecks::default());
        let a = log.write(&disk, &[put(b"a", 1, 40 << 10, 3)]).unwrap()[0];
        log.write(&disk, &[put(b"b", 2, 40 << 10, 4)]).unwrap();
        let disk = Arc::new(disk);
        let tier: Arc<dyn LowerTier> = Arc::clone(&disk) as _;
        let digest = log.secret.digest_qualified(&qualified(b"a"));
        let checksum = value_checksum(digest, &vec![3u8; 40 << 10]);
        let located = tier.locate(digest, a, 40 << 10, checksum).unwrap();
        disk.remove_region(a.region()).unwrap();
        assert!(tier.locate(digest, a, 40 << 10, checksum).is_none());
        assert!(tier.file_location(a, 40 << 10, digest, checksum).is_none());
        // What was located before the reclaim holds its file open.
        let mut buf = vec![0u8; 40 << 10];
        let mut buf_s = &mut buf[..];
        let mut dests: Vec<&mut dyn Destination> = vec![&mut buf_s];
        let outcomes = tier.read_verified(&[Some(located)], &mut dests);
        assert!(matches!(outcomes[0], Some(ReadOutcome::Verified)));
        assert!(buf.iter().all(|&x| x == 3));
    }

    #[test]
    fn a_scan_shows_puts_with_their_locations_and_removals_without() {
        let log = TestLog::new(64 << 10);
        let tier = {
            let (disk, _, _) = log.open(RecoveryChecks::default());
            log.write(&disk, &[put(b"a", 1, 100, 1), tombstone(b"gone", 2)])
                .unwrap();
            drop(disk);
            tier_of(&log)
        };
        let mut seen = Vec::new();
        Arc::clone(&tier)
            .visit_records(&mut |loc, entry| {
                seen.push((
                    loc.is_some(),
                    entry.kind == RecordKind::Put,
                    entry.seq,
                    entry.key,
                ))
            })
            .unwrap();
        seen.sort_by_key(|s| s.2);
        assert_eq!(
            seen,
            vec![
                (true, true, 1, qualified(b"a")),
                (false, false, 2, qualified(b"gone"))
            ]
        );
        let usage = tier.usage();
        assert_eq!(usage.units, 1);
        assert!(usage.used_bytes > 0);
        assert_eq!(usage.io_engine, "psync");
    }
}
