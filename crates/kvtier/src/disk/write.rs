//! Appending batches to the log: one vectored write per batch, values
//! synced before the record that commits them (docs/design.md, section 4),
//! and new region files with their headers and the log head.

use super::format::{self, RegionHeader, REGION_HEADER_LEN};
use super::{sync_dir, DiskTier, Region};
use crate::disk::DiskLoc;
use crate::error::{Error, Result};
use crate::io::AlignedBuf;
use crate::tier::PendingBatch;
use crate::units::{page_round_up, PAGE_SIZE};
use std::fs;
use std::io::IoSlice;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// See `DiskTier::set_write_guard`.
pub type WriteGuard = Arc<dyn Fn() -> Result<()> + Send + Sync>;

#[derive(Default)]
pub(super) struct WriteGuardSlot(pub(super) std::sync::OnceLock<WriteGuard>);

impl std::fmt::Debug for WriteGuardSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.get().is_some() {
            "WriteGuard(set)"
        } else {
            "WriteGuard(none)"
        })
    }
}

impl PendingBatch<'_> {
    /// Bytes the batch will take on disk.
    pub fn disk_len(&self) -> u64 {
        let record = format::record_len(self.entries.iter().map(|e| e.key.len())) as u64;
        page_round_up(record) + self.values.iter().map(|v| v.len() as u64).sum::<u64>()
    }
}

#[derive(Debug)]
pub(super) struct WriterState {
    /// The region batches are appended to (`None`: the next batch opens a
    /// new one).
    pub(super) active: Option<Arc<Region>>,
    pub(super) next_region: u32,
}

impl DiskTier {
    /// Installs the check asked before every batch (once; later calls are
    /// ignored): with a shared directory, that this node still holds its
    /// writer lock, so a second writer that took the lock file's name never
    /// writes beside this one.
    pub fn set_write_guard(&self, guard: WriteGuard) {
        let _ = self.write_guard.0.set(guard);
    }

    /// Writes one batch and makes it durable. On return, each put entry's
    /// value is at the returned location (in `entries` order, puts only).
    pub fn write_batch(
        &self,
        batch: &mut PendingBatch<'_>,
        first_seq: u64,
    ) -> Result<Vec<DiskLoc>> {
        if let Some(guard) = self.write_guard.0.get() {
            guard()?;
        }
        let record_len = format::record_len(batch.entries.iter().map(|e| e.key.len()));
        let record_pages = page_round_up(record_len as u64);
        let batch_len = batch.disk_len();
        let mut writer = self.writer.lock().unwrap();
        let region = match &writer.active {
            Some(region) if region.is_empty() || region.len() + batch_len <= self.region_size => {
                Arc::clone(region)
            }
            _ => {
                writer.active = None;
                let region = self.create_region(&mut writer, first_seq)?;
                writer.active = Some(Arc::clone(&region));
                region
            }
        };
        let start = region.len();
        // Assign value offsets in order.
        let mut offset = record_pages;
        let mut values = batch.values.iter();
        let mut locs = Vec::with_capacity(batch.values.len());
        for entry in batch.entries.iter_mut() {
            if entry.kind == format::RecordKind::Put {
                let value = values.next().expect("one value per put entry");
                entry.value_offset = offset;
                locs.push(DiskLoc::new(
                    region.id,
                    ((start + offset) / PAGE_SIZE) as u32,
                ));
                offset += value.len() as u64;
            }
        }
        debug_assert_eq!(offset, batch_len);
        let mut record = AlignedBuf::zeroed(record_pages as usize);
        format::encode_record(
            record.as_mut_slice(),
            &self.own_origin(region.path(), region.id),
            start,
            batch_len,
            &batch.entries,
            &self.secret,
        );
        // The crash protocol (docs/design.md, section 4): values first,
        // synced; only then the record that commits them, synced. A record
        // that survives a power loss therefore names values that did too;
        // a batch whose record did not survive was never acknowledged.
        let values: Vec<IoSlice<'_>> = batch.values.iter().map(|v| IoSlice::new(v)).collect();
        let written = if self.single_sync {
            let mut iov = vec![IoSlice::new(record.as_slice())];
            iov.extend(values.iter().copied());
            self.engine
                .write_vectored_at(&region.file, start, &iov)
                .and_then(|()| self.engine.sync_data(&region.file))
        } else {
            let values_written = if values.is_empty() {
                Ok(())
            } else {
                self.engine
                    .write_vectored_at(&region.file, start + record_pages, &values)
                    .and_then(|()| self.engine.sync_data(&region.file))
            };
            values_written
                .and_then(|()| {
                    crate::fail::fail_point!("disk-values-synced");
                    self.engine.write_vectored_at(
                        &region.file,
                        start,
                        &[IoSlice::new(record.as_slice())],
                    )
                })
                .and_then(|()| self.engine.sync_data(&region.file))
        };
        // Whatever happened, those bytes may be on disk now.
        region.len.store(start + batch_len, Ordering::Release);
        self.used.fetch_add(batch_len, Ordering::AcqRel);
        if let Err(e) = written {
            // Never append after a batch that may be half written: a later
            // scan stops there and would miss everything behind it.
            writer.active = None;
            return Err(Error::io(
                format!(
                    "writing a {batch_len}-byte batch to {}",
                    region.path().display()
                ),
                e,
            ));
        }
        Ok(locs)
    }

    fn create_region(&self, writer: &mut WriterState, first_seq: u64) -> Result<Arc<Region>> {
        let id = writer.next_region;
        if id > self.max_region_id {
            return Err(Error::new(
                crate::ErrorKind::NoSpace,
                format!(
                    "the region log in {} has used every region id (up to {}); \
                     move the directory aside and start empty",
                    self.dir.display(),
                    self.max_region_id
                ),
            ));
        }
        writer.next_region = id + 1;
        let path = self.region_path(id);
        let (file, direct) = self.open_file(&path, true)?;
        let mut page = AlignedBuf::zeroed(REGION_HEADER_LEN as usize);
        RegionHeader {
            region: id,
            first_seq,
        }
        .encode(page.as_mut_slice());
        let bounded = self.bounds_reads_of(&file);
        let region = Arc::new(Region::new(
            id,
            file,
            path.clone(),
            REGION_HEADER_LEN,
            direct,
            &self.engine,
            bounded,
        ));
        self.regions
            .write()
            .unwrap()
            .insert(id, Arc::clone(&region));
        self.used.fetch_add(REGION_HEADER_LEN, Ordering::AcqRel);
        let written = self
            .engine
            .write_vectored_at(&region.file, 0, &[IoSlice::new(page.as_slice())])
            .and_then(|()| self.engine.sync_data(&region.file))
            .and_then(|()| sync_dir(&self.dir))
            .and_then(|()| self.write_head(id));
        if let Err(e) = written {
            // Nothing was committed to it: take it back out, so that a long
            // outage (a retry a second) does not pile up files and
            // descriptors. If the unlink fails too, recovery removes the
            // file (an empty or header-less region holds nothing).
            self.regions.write().unwrap().remove(&id);
            self.used.fetch_sub(REGION_HEADER_LEN, Ordering::AcqRel);
            drop(region);
            if fs::remove_file(&path).is_ok() {
                // Nothing of it is left: the id is free again, so the ids
                // of the log's regions stay contiguous (a gap reads as a
                // missing region at the next recovery).
                writer.next_region = id;
            }
            return Err(Error::io(
                format!("creating region file {}", path.display()),
                e,
            ));
        }
        Ok(region)
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_log::{put, tombstone, TestLog};
    use super::super::RecoveryChecks;
    use super::*;
    use crate::io::pread_full;

    #[test]
    fn values_land_page_aligned_where_the_locations_say() {
        let log = TestLog::new(1 << 20);
        let (tier, _, _) = log.open(RecoveryChecks::default());
        let items = [
            put(b"a", 1, 5000, 0xA1),
            tombstone(b"z", 2),
            put(b"b", 3, 4096, 0xB2),
        ];
        let locs = log.write(&tier, &items).unwrap();
        assert_eq!(locs.len(), 2, "puts only");
        let region = tier.region(0).unwrap();
        for (loc, (len, fill)) in locs.iter().zip([(5000usize, 0xA1u8), (4096, 0xB2)]) {
            assert_eq!(loc.region(), 0);
            let mut buf = AlignedBuf::zeroed(page_round_up(len as u64) as usize);
            pread_full(
                &region.file,
                u64::from(loc.page()) * PAGE_SIZE,
                buf.as_mut_slice(),
            )
            .unwrap();
            assert!(buf.as_slice()[..len].iter().all(|&b| b == fill));
        }
        // Record page, 2 pages, 1 page.
        assert_eq!(region.len(), REGION_HEADER_LEN + 4 * PAGE_SIZE);
        assert_eq!(tier.used(), region.len());
    }

    #[test]
    fn a_batch_that_does_not_fit_opens_the_next_region() {
        let log = TestLog::new(64 << 10);
        let (tier, _, _) = log.open(RecoveryChecks::default());
        let first = log.write(&tier, &[put(b"a", 1, 30 << 10, 1)]).unwrap();
        let second = log.write(&tier, &[put(b"b", 2, 30 << 10, 2)]).unwrap();
        let third = log.write(&tier, &[put(b"c", 3, 30 << 10, 3)]).unwrap();
        assert_eq!(
            (first[0].region(), second[0].region(), third[0].region()),
            (0, 1, 2)
        );
        // A batch larger than a region still goes into an empty one.
        let big = log.write(&tier, &[put(b"d", 4, 200 << 10, 4)]).unwrap();
        assert_eq!(big[0].region(), 3);
        assert_eq!(tier.region_count(), 4);
        assert_eq!(log.region_files().len(), 4);
        assert_eq!(
            tier.read_head(),
            Some(3),
            "the log head names the newest region"
        );
    }

    #[test]
    fn a_refusing_write_guard_fails_the_batch_before_anything_is_written() {
        let log = TestLog::new(1 << 20);
        let (tier, _, _) = log.open(RecoveryChecks::default());
        log.write(&tier, &[put(b"a", 1, 100, 1)]).unwrap();
        let used = tier.used();
        tier.set_write_guard(Arc::new(|| {
            Err(crate::error::Error::invalid(
                "this log is another writer's now",
            ))
        }));
        let err = log.write(&tier, &[put(b"b", 2, 100, 2)]).unwrap_err();
        assert!(err.to_string().contains("another writer's"), "{err}");
        assert_eq!(tier.used(), used);
        // Installed once: a later guard is ignored.
        tier.set_write_guard(Arc::new(|| Ok(())));
        assert!(log.write(&tier, &[put(b"c", 3, 100, 3)]).is_err());
    }

    #[test]
    fn region_ids_run_out_with_a_clear_error() {
        let log = TestLog::new(64 << 10);
        let (tier, _, _) = log.open(RecoveryChecks::default());
        tier.writer.lock().unwrap().next_region = tier.max_region_id;
        log.write(&tier, &[put(b"a", 1, 40 << 10, 1)]).unwrap();
        let err = log.write(&tier, &[put(b"b", 2, 40 << 10, 2)]).unwrap_err();
        assert_eq!(err.kind(), crate::ErrorKind::NoSpace);
        assert!(err.to_string().contains("every region id"), "{err}");
    }
}
