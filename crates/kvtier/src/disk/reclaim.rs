//! Taking regions out of the log: the oldest region for the reclaimer,
//! its entries, removing its file (with the directory synced, so a removed
//! region cannot come back after a crash), and quarantine for files
//! recovery cannot use (kept for inspection, never deleted).

use super::format::REGION_HEADER_LEN;
use super::recovery::RecoveredEntry;
use super::scan::{scan_batches, value_loc, BadPage, RegionReader};
use super::{sync_dir, DiskTier, Region};
use crate::error::{Error, Result};
use std::fs;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

impl DiskTier {
    /// Every record entry of a region with its value's location, for the
    /// reclaimer, and whether every page of it was read (if not, entries
    /// the index holds may point into it unseen: the caller sweeps).
    pub fn region_entries(&self, region: &Region) -> Result<(Vec<RecoveredEntry>, bool)> {
        let mut out = Vec::new();
        let mut unlocated = false;
        let mut reader = RegionReader::new(&region.file, region.len());
        let from = REGION_HEADER_LEN;
        let scan = scan_batches(
            &mut reader,
            &self.own_origin(region.path(), region.id),
            &self.secret,
            from,
            BadPage::Resync,
            |batch_start, entries| {
                for entry in entries {
                    match value_loc(region.id, batch_start, &entry) {
                        Some(loc) => out.push(RecoveredEntry {
                            entry,
                            loc,
                            value_lost: false,
                        }),
                        // Not an entry the index can hold: the caller
                        // sweeps instead of trusting the list.
                        None => unlocated = true,
                    }
                }
            },
        );
        Ok((out, scan.first_problem.is_none() && !unlocated))
    }

    /// The oldest region, for the reclaimer. The active region is sealed
    /// first if it is the only one left.
    pub fn oldest_region(&self) -> Option<Arc<Region>> {
        let oldest = self.regions.read().unwrap().values().next().cloned()?;
        let mut writer = self.writer.lock().unwrap();
        if writer.active.as_ref().is_some_and(|a| a.id == oldest.id) {
            writer.active = None;
        }
        Some(oldest)
    }

    /// Deletes a region file. The directory is synced so that a removed
    /// region (perhaps holding tombstones' older values) cannot come back
    /// after a crash while a newer one stays removed.
    pub fn remove_region(&self, id: u32) -> Result<()> {
        let Some(region) = self.regions.write().unwrap().remove(&id) else {
            return Ok(());
        };
        {
            let mut writer = self.writer.lock().unwrap();
            if writer.active.as_ref().is_some_and(|a| a.id == id) {
                writer.active = None;
            }
        }
        if let Err(e) = self.unlink(region.path()) {
            // Keep it as the oldest region: reclaim retries its removal
            // before any newer region goes. Removing a newer region first
            // could drop a tombstone while the value it removed stays on
            // disk, and bring the value back at the next restart.
            self.regions.write().unwrap().insert(id, region);
            return Err(e);
        }
        self.used.fetch_sub(region.len(), Ordering::AcqRel);
        crate::fail::fail_point!("reclaim-region-unlinked");
        sync_dir(&self.dir).map_err(|e| Error::io(format!("syncing {}", self.dir.display()), e))
    }

    /// Removes a file; one already gone (deleted by hand under a running
    /// store) counts as removed, or reclaim would retry it forever.
    pub(super) fn unlink(&self, path: &Path) -> Result<()> {
        match fs::remove_file(path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                tracing::warn!(path = %path.display(), "a region file was already gone when reclaimed");
                Ok(())
            }
            Err(e) => Err(Error::io(format!("removing {}", path.display()), e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_log::{put, tombstone, TestLog};
    use super::super::RecoveryChecks;
    use super::*;

    #[test]
    fn the_oldest_region_goes_first_and_its_file_with_it() {
        let log = TestLog::new(64 << 10);
        let (tier, _, _) = log.open(RecoveryChecks::default());
        let a = log
            .write(&tier, &[put(b"a", 1, 40 << 10, 1), tombstone(b"x", 2)])
            .unwrap();
        log.write(&tier, &[put(b"b", 3, 40 << 10, 2)]).unwrap();
        let oldest = tier.oldest_region().unwrap();
        assert_eq!(oldest.id, 0);
        let (entries, whole) = tier.region_entries(&oldest).unwrap();
        assert!(whole);
        let listed: Vec<_> = entries
            .iter()
            .map(|e| (e.entry.key.clone(), e.entry.seq))
            .collect();
        assert_eq!(listed, vec![(b"\0a".to_vec(), 1), (b"\0x".to_vec(), 2)]);
        assert_eq!(entries[0].loc, a[0]);
        let used = tier.used();
        let len = oldest.len();
        let path = oldest.path().to_path_buf();
        drop(oldest);
        tier.remove_region(0).unwrap();
        assert!(!path.exists());
        assert_eq!(tier.used(), used - len);
        assert_eq!(tier.oldest_region().unwrap().id, 1);
        // Removing it again, or a file already gone, is not an error.
        tier.remove_region(0).unwrap();
        std::fs::remove_file(tier.region(1).unwrap().path()).unwrap();
        tier.remove_region(1).unwrap();
        assert_eq!(tier.region_count(), 0);
    }

    #[test]
    fn the_only_region_is_sealed_before_it_is_reclaimed() {
        let log = TestLog::new(1 << 20);
        let (tier, _, _) = log.open(RecoveryChecks::default());
        log.write(&tier, &[put(b"a", 1, 100, 1)]).unwrap();
        assert_eq!(tier.oldest_region().unwrap().id, 0);
        // The next batch may not append to the region being reclaimed.
        let b = log.write(&tier, &[put(b"b", 2, 100, 2)]).unwrap();
        assert_eq!(b[0].region(), 1);
    }

    #[test]
    fn a_damaged_region_lists_what_verifies_and_says_it_is_not_whole() {
        use std::os::unix::fs::FileExt;
        let log = TestLog::new(1 << 20);
        let (tier, _, _) = log.open(RecoveryChecks::default());
        log.write(&tier, &[put(b"a", 1, 100, 1)]).unwrap();
        log.write(&tier, &[put(b"b", 2, 100, 2)]).unwrap();
        let region = tier.region(0).unwrap();
        // Through a buffered descriptor: the region's is O_DIRECT.
        let buffered = std::fs::OpenOptions::new()
            .write(true)
            .open(region.path())
            .unwrap();
        buffered
            .write_all_at(&[0xFF; 8], REGION_HEADER_LEN + 64)
            .unwrap();
        let (entries, whole) = tier.region_entries(&region).unwrap();
        assert!(!whole, "the caller must sweep");
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].entry.key, b"\0b");
    }
}
