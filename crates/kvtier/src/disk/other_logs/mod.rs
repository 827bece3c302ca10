//! The mechanics of following other writers' logs of a shared directory:
//! listing a writer's region files (with the gap rule its own recovery
//! applies), a handle per followed file (the region id the index names it
//! by, from `OTHERS_BASE` up), and a cursor per file (where the next scan
//! starts, the length read, whether its tail did not verify). Reading a
//! region opens it afresh (a new open is what makes a distributed file
//! system show another client's appends: close-to-open consistency) and
//! hands back the batches past the cursor, each record verified.
//!
//! What the entries mean (clocks, removals, shares, the reclaim floor) is
//! the follower's (`shared::follow`); nothing here touches the index.
//! `files` opens another writer's files read-only under the descriptor
//! budget and scans the batches appended past a cursor.

mod files;

use crate::disk::format::RecordEntry;
use crate::disk::names::parse_region_name;
use crate::disk::{DiskTier, OTHERS_BASE, REGION_DIR};
use crate::units::PAGE_SIZE;
pub(crate) use files::read_other_head;
use files::{first_id_past_gaps, scan_new_batches};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The handle no region ever gets (handles are exhausted there).
pub(crate) const NO_HANDLE: u32 = u32::MAX;

/// One other writer's region file as this node follows it.
#[derive(Debug)]
struct FollowedRegion {
    handle: u32,
    file_name: String,
    /// Where the next scan starts.
    scanned_to: u64,
    /// The file's length when last opened.
    len: u64,
    /// Its tail did not verify at the last scan (read again next time,
    /// grown or not: a record is written in place after its values).
    stuck: bool,
}

/// Every other writer's followed region files, by writer and region id.
#[derive(Debug)]
pub(super) struct OtherLogs {
    writers: BTreeMap<String, BTreeMap<u32, FollowedRegion>>,
    next_handle: u32,
}

impl Default for OtherLogs {
    fn default() -> Self {
        OtherLogs {
            writers: BTreeMap::new(),
            next_handle: OTHERS_BASE,
        }
    }
}

impl OtherLogs {
    fn new_handle(&mut self) -> Option<u32> {
        let handle = self.next_handle;
        if handle == NO_HANDLE {
            tracing::error!(
                "this process has followed 2^31 regions of other writers; restart it to follow more"
            );
            return None;
        }
        self.next_handle += 1;
        Some(handle)
    }
}

/// A writer directory's region files as one listing saw them.
#[derive(Debug)]
pub(crate) struct RegionListing {
    pub region_dir: PathBuf,
    /// Region id -> (file name, length) of the files followed: of two
    /// names for one id (a copy made by hand), the longer file (its writer
    /// keeps the longest too); none behind a gap.
    pub files: BTreeMap<u32, (String, u64)>,
    /// Region files not followed because a region between them and the
    /// writer's head is missing.
    pub behind_gap: u64,
}

impl RegionListing {
    /// The newest region listed.
    pub fn newest(&self) -> Option<u32> {
        self.files.keys().next_back().copied()
    }
}

/// What comparing a listing with the regions followed gave.
#[derive(Debug, Default)]
pub(crate) struct Reconciled {
    /// Handles of regions no longer followed: gone (reclaimed by their
    /// writer), behind a gap, replaced by another file under the same id,
    /// or cut shorter than this node has read.
    pub dropped: Vec<u32>,
    /// Of those, the ones whose id is still listed (cut short or
    /// replaced): their entries must go before the file is read again, or
    /// the same entries read again (same numbers) would not replace them.
    pub reread: Vec<u32>,
    /// Region ids to read at this pass (new, grown, or stuck), in order,
    /// with whether a newer region exists (the writer moved on: nothing
    /// more is appended, so a bad page is damage, not a write in flight).
    pub to_read: Vec<(u32, bool)>,
}

/// What reading one region of another writer gave.
#[derive(Debug)]
pub(crate) enum RegionRead {
    /// Not followed yet and no descriptor left in the budget.
    OverBudget,
    /// Gone since the listing.
    Gone,
    /// It could not be opened (retried next pass).
    Failed(std::io::Error),
    /// No handle is left for it (this process followed 2^31 regions).
    NoHandle,
    /// Shorter than what was read of it: no writer truncates a region, so
    /// this is damage or a replacement. No longer followed; its entries
    /// must go.
    Shrunk {
        handle: u32,
        len: u64,
        scanned_to: u64,
    },
    /// Read from its cursor on: each verified batch's offset and entries
    /// (the index names the region by `handle`).
    Read {
        handle: u32,
        batches: Vec<(u64, Vec<RecordEntry>)>,
        /// Pages without a valid batch skipped (a sealed region only).
        skipped_pages: u64,
    },
}

/// A writer's followed regions, for stats: how many, their bytes, and how
/// many have a tail that did not verify.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FollowedSizes {
    pub regions: u64,
    pub bytes: u64,
    pub stuck: u64,
}

impl DiskTier {
    /// Lists the region files of writer `node` in its directory `dir`
    /// whose log head reads `head`: `None` while it has created no region.
    pub(crate) fn list_other_regions(
        &self,
        node: &str,
        dir: &Path,
        head: Option<u32>,
    ) -> std::io::Result<Option<RegionListing>> {
        let region_dir = dir.join(REGION_DIR);
        let listing = match std::fs::read_dir(&region_dir) {
            Ok(listing) => listing,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let mut files: BTreeMap<u32, (String, u64)> = BTreeMap::new();
        for item in listing.flatten() {
            let name = item.file_name().to_string_lossy().into_owned();
            let Some(parsed) = parse_region_name(&name) else {
                continue;
            };
            if parsed.node != Some(node) || parsed.id >= OTHERS_BASE {
                continue;
            }
            let len = item.metadata().map_or(0, |m| m.len());
            let id = parsed.id;
            match files.get(&id) {
                Some((_, held)) if *held >= len => {}
                _ => {
                    files.insert(id, (name, len));
                }
            }
        }
        // The gap rule its writer applies to its own log at recovery: no
        // region older than a missing one is indexed (the missing one may
        // have held the removals of their puts).
        let ids: Vec<u32> = files.keys().copied().collect();
        let first_indexed = first_id_past_gaps(&ids, head);
        let before = files.len();
        files.retain(|id, _| first_indexed.is_some_and(|first| *id >= first));
        let behind_gap = (before - files.len()) as u64;
        Ok(Some(RegionListing {
            region_dir,
            files,
            behind_gap,
        }))
    }

    /// Brings the regions followed of `node` in line with `listing` (see
    /// [`Reconciled`]).
    pub(crate) fn reconcile_other(&self, node: &str, listing: &RegionListing) -> Reconciled {
        let mut logs = self.other_logs.lock().unwrap();
        let regions = logs.writers.entry(node.to_string()).or_default();
        let mut out = Reconciled::default();
        let doomed: Vec<u32> = regions
            .iter()
            .filter(|(id, r)| {
                listing
                    .files
                    .get(id)
                    .is_none_or(|(name, len)| *name != r.file_name || *len < r.len)
            })
            .map(|(id, _)| *id)
            .collect();
        for id in doomed {
            if let Some(region) = regions.remove(&id) {
                out.dropped.push(region.handle);
                if listing.files.contains_key(&id) {
                    out.reread.push(region.handle);
                }
            }
        }
        let newest = listing.newest();
        for (&id, (_, listed_len)) in &listing.files {
            // Read again when it grew, or when its tail did not verify
            // last time: the record is written after the values, in place,
            // so a batch becomes whole without the file growing.
            let unchanged = regions
                .get(&id)
                .is_some_and(|r| !r.stuck && *listed_len <= r.len);
            if !unchanged {
                out.to_read.push((id, newest.is_some_and(|n| n > id)));
            }
        }
        out
    }

    /// Opens region `id` of `node` (file `name` of `listing`) afresh and
    /// reads the batches past its cursor; the cursor moves past them.
    /// `sealed`: a newer region exists, so a page without a valid batch is
    /// skipped (damage) instead of waited for (a write in flight).
    pub(crate) fn read_other_region(
        &self,
        node: &str,
        id: u32,
        listing: &RegionListing,
        sealed: bool,
    ) -> RegionRead {
        let Some((name, _)) = listing.files.get(&id) else {
            return RegionRead::Gone;
        };
        let path = listing.region_dir.join(name);
        let known = self.other_region_handle(node, id).is_some();
        if !known && !self.room_for_other_file() {
            return RegionRead::OverBudget;
        }
        let opened = match self.open_other(&path) {
            Ok(opened) => opened,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return RegionRead::Gone,
            Err(e) => return RegionRead::Failed(e),
        };
        let (handle, from) = {
            let mut logs = self.other_logs.lock().unwrap();
            let existing = logs
                .writers
                .get(node)
                .and_then(|regions| regions.get(&id))
                .map(|r| (r.handle, r.scanned_to));
            match existing {
                Some(found) => found,
                None => {
                    let Some(handle) = logs.new_handle() else {
                        return RegionRead::NoHandle;
                    };
                    logs.writers.entry(node.to_string()).or_default().insert(
                        id,
                        FollowedRegion {
                            handle,
                            file_name: name.clone(),
                            scanned_to: PAGE_SIZE,
                            len: 0,
                            stuck: false,
                        },
                    );
                    (handle, PAGE_SIZE)
                }
            }
        };
        let len = opened.len;
        if len < from {
            if let Some(regions) = self.other_logs.lock().unwrap().writers.get_mut(node) {
                regions.remove(&id);
            }
            return RegionRead::Shrunk {
                handle,
                len,
                scanned_to: from,
            };
        }
        // Bound to the writer this directory is (the listing takes only
        // files its name names) and the open its file name gives.
        let origin = super::names::record_origin(&path, id, node, false);
        let scan = scan_new_batches(&opened.file, &origin, len, from, &self.secret, sealed);
        // Reads of values go through this fresh descriptor from now on.
        self.set_other(handle, opened, path);
        if let Some(region) = self
            .other_logs
            .lock()
            .unwrap()
            .writers
            .get_mut(node)
            .and_then(|regions| regions.get_mut(&id))
        {
            region.scanned_to = scan.end;
            region.len = len;
            region.stuck = scan.stuck.is_some();
        }
        RegionRead::Read {
            handle,
            batches: scan.batches,
            skipped_pages: scan.skipped_pages,
        }
    }

    /// Follows region `id` of `node` (file `name` in `region_dir`) from
    /// `covered` on, what an index checkpoint already holds of it; its
    /// handle, or `None` if it cannot be opened (its records are then
    /// read instead) or no handle is left. The caller checks the budget.
    pub(crate) fn adopt_other_region(
        &self,
        node: &str,
        id: u32,
        region_dir: &Path,
        name: &str,
        covered: u64,
    ) -> Option<u32> {
        let path = region_dir.join(name);
        let opened = self.open_other(&path).ok()?;
        let handle = {
            let mut logs = self.other_logs.lock().unwrap();
            let handle = logs.new_handle()?;
            logs.writers.entry(node.to_string()).or_default().insert(
                id,
                FollowedRegion {
                    handle,
                    file_name: name.to_string(),
                    scanned_to: covered,
                    len: covered,
                    stuck: false,
                },
            );
            handle
        };
        self.set_other(handle, opened, path);
        Some(handle)
    }

    /// The handle of region `id` of `node`, if it is followed.
    pub(crate) fn other_region_handle(&self, node: &str, id: u32) -> Option<u32> {
        let logs = self.other_logs.lock().unwrap();
        logs.writers.get(node)?.get(&id).map(|r| r.handle)
    }

    /// Stops following `node`'s log (its directory went); the handles of
    /// its regions (their readers stay until `drop_other`).
    pub(crate) fn forget_other_writer(&self, node: &str) -> Vec<u32> {
        let mut logs = self.other_logs.lock().unwrap();
        logs.writers
            .remove(node)
            .map(|regions| regions.values().map(|r| r.handle).collect())
            .unwrap_or_default()
    }

    /// Every followed region is read from its first batch at its next
    /// read (its handle kept, so entries stay readable meanwhile).
    pub(crate) fn rewind_others(&self) {
        let mut logs = self.other_logs.lock().unwrap();
        for regions in logs.writers.values_mut() {
            for region in regions.values_mut() {
                region.scanned_to = PAGE_SIZE;
                region.len = 0;
            }
        }
    }

    /// Every followed region of every other writer: its handle, its own
    /// region id, and how far its records were read (what the index may
    /// hold of it).
    pub(crate) fn followed_regions(&self) -> Vec<(u32, u32, u64)> {
        let logs = self.other_logs.lock().unwrap();
        logs.writers
            .values()
            .flat_map(|regions| regions.iter().map(|(id, r)| (r.handle, *id, r.scanned_to)))
            .collect()
    }

    /// Stops following the newest regions past `budget` files; their
    /// handles (their readers stay until `drop_other`).
    pub(crate) fn close_others_past(&self, budget: usize) -> Vec<u32> {
        let mut logs = self.other_logs.lock().unwrap();
        let mut held: Vec<(u32, String, u32)> = logs
            .writers
            .iter()
            .flat_map(|(node, regions)| {
                regions
                    .iter()
                    .map(move |(id, r)| (r.handle, node.clone(), *id))
            })
            .collect();
        if held.len() <= budget {
            return Vec::new();
        }
        held.sort_unstable_by_key(|h| std::cmp::Reverse(h.0));
        let excess = held.len() - budget;
        let mut closed = Vec::with_capacity(excess);
        for (handle, node, id) in held.into_iter().take(excess) {
            if let Some(regions) = logs.writers.get_mut(&node) {
                regions.remove(&id);
            }
            closed.push(handle);
        }
        closed
    }

    /// Each writer's followed regions (for stats), with their handles.
    pub(crate) fn followed_sizes(&self) -> BTreeMap<String, (FollowedSizes, Vec<u32>)> {
        let logs = self.other_logs.lock().unwrap();
        logs.writers
            .iter()
            .map(|(node, regions)| {
                let sizes = FollowedSizes {
                    regions: regions.len() as u64,
                    bytes: regions.values().map(|r| r.len).sum(),
                    stuck: regions.values().filter(|r| r.stuck).count() as u64,
                };
                let handles = regions.values().map(|r| r.handle).collect();
                (node.clone(), (sizes, handles))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_log::{put, TestLog, NODE};
    use super::super::RecoveryChecks;
    use super::*;

    /// A writer's log of three regions (one 40 KiB put each) and a reader.
    fn writer_and_reader() -> (TestLog, DiskTier, DiskTier) {
        let writer = TestLog::new(64 << 10);
        let (log, _, _) = writer.open(RecoveryChecks::default());
        for i in 0..3u8 {
            writer
                .write(&log, &[put(&[b'k', i], u64::from(i) + 1, 40 << 10, i)])
                .unwrap();
        }
        let mut reader_dir = TestLog::new(64 << 10);
        // A log of a shared directory: handles from OTHERS_BASE up name
        // other writers' regions.
        reader_dir.config = reader_dir.config.clone().shared_dir(reader_dir.path());
        let (reader, _, _) = reader_dir.open(RecoveryChecks::default());
        // The reader's directory may go: its tier holds what it needs.
        std::mem::forget(reader_dir);
        (writer, log, reader)
    }

    #[test]
    fn a_listing_keeps_only_the_writers_own_region_files() {
        let (writer, log, reader) = writer_and_reader();
        let regions = writer.regions_dir();
        // Format 2's names (no node in them) and another node's names are
        // not this writer's files.
        std::fs::write(regions.join("00000001.kvr"), b"x").unwrap();
        let elsewhere = "ffffffffffffffffffffffffffffffff-0000000000000001-00000001.kvr";
        std::fs::write(regions.join(elsewhere), b"x").unwrap();
        let listing = reader
            .list_other_regions(NODE, writer.path(), Some(2))
            .unwrap()
            .unwrap();
        assert_eq!(
            listing.files.keys().copied().collect::<Vec<_>>(),
            vec![0, 1, 2]
        );
        assert_eq!(listing.newest(), Some(2));
        assert_eq!(listing.behind_gap, 0);
        let (name, len) = &listing.files[&1];
        assert_eq!(regions.join(name), log.region(1).unwrap().path());
        assert_eq!(*len, log.region(1).unwrap().len());
        // No regions directory yet: nothing to follow.
        let empty = tempfile::tempdir().unwrap();
        assert!(reader
            .list_other_regions(NODE, empty.path(), None)
            .unwrap()
            .is_none());
    }

    #[test]
    fn reads_resume_at_the_cursor_and_dropped_regions_are_reported() {
        let (writer, log, reader) = writer_and_reader();
        let listing = reader
            .list_other_regions(NODE, writer.path(), Some(2))
            .unwrap()
            .unwrap();
        let first = reader.reconcile_other(NODE, &listing);
        assert!(first.dropped.is_empty());
        assert_eq!(first.to_read, vec![(0, true), (1, true), (2, false)]);
        let mut handles = Vec::new();
        for (id, sealed) in first.to_read {
            match reader.read_other_region(NODE, id, &listing, sealed) {
                RegionRead::Read {
                    handle, batches, ..
                } => {
                    assert_eq!(batches.len(), 1);
                    assert!(handle >= OTHERS_BASE);
                    assert_eq!(
                        reader.region(handle).unwrap().path(),
                        log.region(id).unwrap().path()
                    );
                    handles.push(handle);
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(reader.other_region_handle(NODE, 1), Some(handles[1]));
        // Unchanged: nothing to read.
        let again = reader.reconcile_other(NODE, &listing);
        assert!(again.to_read.is_empty() && again.dropped.is_empty());
        // Region 0 reclaimed by its writer; region 2 grows.
        log.remove_region(0).unwrap();
        writer.write(&log, &[put(b"z", 9, 100, 9)]).unwrap();
        let listing = reader
            .list_other_regions(NODE, writer.path(), Some(2))
            .unwrap()
            .unwrap();
        let changed = reader.reconcile_other(NODE, &listing);
        assert_eq!(changed.dropped, vec![handles[0]]);
        assert!(changed.reread.is_empty());
        assert_eq!(changed.to_read, vec![(2, false)], "it grew");
        let sizes = reader.followed_sizes();
        assert_eq!(sizes[NODE].0.regions, 2);
        // Rewound: every region is read from its first batch again.
        reader.rewind_others();
        let listing = reader
            .list_other_regions(NODE, writer.path(), Some(2))
            .unwrap()
            .unwrap();
        let rewound = reader.reconcile_other(NODE, &listing);
        assert_eq!(rewound.to_read, vec![(1, true), (2, false)]);
        match reader.read_other_region(NODE, 1, &listing, true) {
            RegionRead::Read {
                handle, batches, ..
            } => {
                assert_eq!(handle, handles[1], "the handle is kept");
                assert_eq!(batches.len(), 1);
            }
            other => panic!("{other:?}"),
        }
        // A head naming a region with no file: a gap, so none is
        // followed any more, and the files still listed are read again.
        let listing = reader
            .list_other_regions(NODE, writer.path(), Some(3))
            .unwrap()
            .unwrap();
        assert_eq!(listing.behind_gap, 2);
        assert!(listing.files.is_empty());
        // The newest handles close first past a budget.
        assert_eq!(reader.close_others_past(1), vec![handles[2]]);
        assert_eq!(reader.forget_other_writer(NODE), vec![handles[1]]);
        assert!(reader.followed_sizes().is_empty());
    }

    #[test]
    fn a_region_shorter_than_what_was_read_is_dropped() {
        let (writer, log, reader) = writer_and_reader();
        let listing = reader
            .list_other_regions(NODE, writer.path(), Some(2))
            .unwrap()
            .unwrap();
        let RegionRead::Read { handle, .. } = reader.read_other_region(NODE, 2, &listing, false)
        else {
            panic!("region 2 reads");
        };
        let path = log.region(2).unwrap().path().to_path_buf();
        drop(log);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(4096)
            .unwrap();
        match reader.read_other_region(NODE, 2, &listing, false) {
            RegionRead::Shrunk { handle: h, len, .. } => {
                assert_eq!((h, len), (handle, 4096));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(reader.other_region_handle(NODE, 2), None);
    }

    #[test]
    fn a_region_not_yet_followed_waits_for_room_in_the_budget() {
        let (writer, _log, reader) = writer_and_reader();
        reader.set_other_files_budget(0);
        let listing = reader
            .list_other_regions(NODE, writer.path(), Some(2))
            .unwrap()
            .unwrap();
        assert!(matches!(
            reader.read_other_region(NODE, 0, &listing, true),
            RegionRead::OverBudget
        ));
        assert!(matches!(
            reader.read_other_region(NODE, 7, &listing, true),
            RegionRead::Gone
        ));
    }
}
