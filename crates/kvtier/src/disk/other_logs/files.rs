//! Other writers' region files of a shared directory, as this node reads them:
//! opened read-only, named in the index by handles from `OTHERS_BASE` up
//! (so an index entry stays 32 bytes and the read path is the same for
//! every region), and scanned for the batches their writers append.
//!
//! Only the writer of a file ever changes it; this side never writes,
//! renames or removes another writer's file.

use crate::disk::format::{RecordEntry, RecordOrigin};
use crate::disk::mount::ReadMode;
use crate::disk::scan::{scan_batches, BadPage, RegionReader};
use crate::disk::{DiskTier, Region, OTHERS_BASE};
use crate::key::KeySecret;
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// An opened region file of another writer.
pub(crate) struct OtherFile {
    pub file: File,
    pub len: u64,
    /// Opened with O_DIRECT (decided per file: the file system may refuse).
    pub direct: bool,
}

/// What a scan of a region's new pages found.
#[derive(Debug, Default)]
pub(crate) struct NewBatches {
    /// Where the next scan starts: after the last batch that verified, or
    /// past skipped pages when resynchronising.
    pub end: u64,
    /// Each verified batch's record entries, with the batch's offset.
    pub batches: Vec<(u64, Vec<RecordEntry>)>,
    /// Why the scan stopped before the end of the file (a record not yet
    /// whole: its writer is mid-flush, or died in one).
    pub stuck: Option<String>,
    /// Pages skipped while resynchronising.
    pub skipped_pages: u64,
}

impl DiskTier {
    /// Opens another writer's region file for reading, in the read mode
    /// its mount does best (`crate::disk::mount::read_mode`): O_DIRECT on a local
    /// disk, buffered (with sequential readahead) on a network or FUSE
    /// file system, unless `shared_read_mode` says otherwise, this node's
    /// `direct_io` is off, or the file system refuses O_DIRECT.
    pub(crate) fn open_other(&self, path: &Path) -> std::io::Result<OtherFile> {
        // Another writer's file is hostile until verified: no links, no
        // blocking open (a FIFO), regular files only.
        let mut options = OpenOptions::new();
        options.read(true);
        let file = crate::private::open_untrusted(path, &options, 0)?;
        let direct = self.direct_io()
            && crate::disk::mount::read_mode(&file, self.shared_read_mode) == ReadMode::Direct
            && crate::disk::mount::set_direct(&file);
        if !direct {
            crate::disk::mount::advise_sequential(&file);
        }
        let meta = file.metadata()?;
        Ok(OtherFile {
            file,
            len: meta.len(),
            direct,
        })
    }

    /// Makes `handle` name another writer's region read through `file`
    /// (replacing an earlier descriptor of it: readers in flight keep the
    /// one they hold).
    pub(crate) fn set_other(&self, handle: u32, opened: OtherFile, path: PathBuf) {
        debug_assert!(handle >= OTHERS_BASE);
        let bounded = self.bounds_reads_of(&opened.file);
        let region = Region::new(
            handle,
            opened.file,
            path,
            opened.len,
            opened.direct,
            &self.engine,
            bounded,
        );
        self.others
            .write()
            .unwrap()
            .insert(handle, Arc::new(region));
    }

    /// Whether another writer's region not yet held may be opened: its
    /// descriptor fits the budget (`set_other_files_budget`).
    pub(crate) fn room_for_other_file(&self) -> bool {
        self.others.read().unwrap().len()
            < self
                .other_files_budget
                .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Other writers' region files held open that are read through the
    /// page cache (`Config::shared_read_mode`).
    pub(crate) fn buffered_other_files(&self) -> u64 {
        self.others
            .read()
            .unwrap()
            .values()
            .filter(|r| !r.direct_io())
            .count() as u64
    }

    /// Most other writers' region files held open at once; regions past
    /// it are not followed (their blocks are misses) until there is room.
    pub(crate) fn set_other_files_budget(&self, files: usize) {
        self.other_files_budget
            .store(files, std::sync::atomic::Ordering::Relaxed);
    }

    /// The budget of `set_other_files_budget`.
    pub(crate) fn other_files_budget(&self) -> usize {
        self.other_files_budget
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Forgets another writer's region (its file is gone).
    pub(crate) fn drop_other(&self, handle: u32) {
        self.others.write().unwrap().remove(&handle);
    }

    /// The secret every record's digests are checked against.
    pub(crate) fn secret(&self) -> &KeySecret {
        &self.secret
    }
}

/// Reads the batches of region `id` (another writer's, whose file is
/// `file_len` bytes now) from offset `from` on. A page where no valid batch
/// starts stops the scan (`stuck`): its writer may be writing that batch
/// now (values first, then the record), so it is read again next time;
/// with `resync` (the writer has moved on to a newer region, so nothing
/// more will be appended here) the scan skips the page and resynchronises
/// as recovery does. Every record verifies before its entries are handed
/// over: a torn or half-visible record is never indexed.
pub(crate) fn scan_new_batches(
    file: &File,
    origin: &RecordOrigin,
    file_len: u64,
    from: u64,
    secret: &KeySecret,
    resync: bool,
) -> NewBatches {
    let mut reader = RegionReader::new(file, file_len);
    let mut batches = Vec::new();
    let bad_page = if resync {
        BadPage::Resync
    } else {
        BadPage::Stop
    };
    let scan = scan_batches(
        &mut reader,
        origin,
        secret,
        from,
        bad_page,
        |at, entries| batches.push((at, entries)),
    );
    // What the scan read of a buffered file may have been read before its
    // writer's bytes landed (a record page mid-flush): never keep it for
    // the next scan or a value read (`mount::drop_cached`).
    crate::disk::mount::drop_cached(file, from, file_len.saturating_sub(from));
    NewBatches {
        end: scan.end,
        batches,
        stuck: scan
            .stopped
            .then(|| scan.first_problem.map(|(_, reason)| reason))
            .flatten(),
        skipped_pages: scan.skipped_pages,
    }
}

/// Another writer's `log-head` (docs/design.md, "Log head and missing
/// regions"): the newest region id it created, `None` if the file is
/// missing. Opened as any other writer's file is (no links, no blocking,
/// regular files only) and read at most 256 bytes; a head that does not
/// parse is an error (the caller then cannot tell a deleted newest region
/// from a quiet log, and says so).
pub(crate) fn read_other_head(writer_dir: &Path) -> std::io::Result<Option<u32>> {
    use std::io::Read;
    let path = writer_dir.join(crate::disk::HEAD_FILE);
    let mut options = OpenOptions::new();
    options.read(true);
    let file = match crate::private::open_untrusted(&path, &options, 0) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut text = String::new();
    file.take(256).read_to_string(&mut text)?;
    crate::disk::names::parse_head(&text)
        .map(Some)
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{} does not parse as a log head", path.display()),
            )
        })
}

/// Of a writer's region ids (its files) and its head, the ids its own
/// recovery would index: those newer than every missing id between the
/// oldest and the head (docs/design.md, "Log head and missing regions").
/// A region behind a gap may hold puts the missing region's tombstones
/// removed, so its writer, restarted, indexes none of it, and neither may
/// a follower. Returns the lowest id indexed (`None`: no region is).
pub(crate) fn first_id_past_gaps(ids: &[u32], head: Option<u32>) -> Option<u32> {
    let mut sorted: Vec<u32> = ids.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut expected = head;
    let mut first = None;
    for &id in sorted.iter().rev() {
        if expected.is_some_and(|e| id < e) {
            return first;
        }
        if expected.is_none_or(|e| id <= e) {
            expected = id.checked_sub(1);
        }
        first = Some(id);
    }
    first
}

#[cfg(test)]
mod gap_tests {
    use super::first_id_past_gaps;

    #[test]
    fn regions_behind_a_missing_one_are_not_indexed() {
        // Contiguous up to the head: all of them.
        assert_eq!(first_id_past_gaps(&[3, 4, 5], Some(5)), Some(3));
        // The head not yet rewritten for the newest region: all of them.
        assert_eq!(first_id_past_gaps(&[3, 4, 5, 6], Some(5)), Some(3));
        // No head (a writer of an older release, or a damaged one): the
        // files alone.
        assert_eq!(first_id_past_gaps(&[3, 4, 5], None), Some(3));
        // A middle region deleted: only those after it.
        assert_eq!(first_id_past_gaps(&[3, 5, 6], Some(6)), Some(5));
        assert_eq!(first_id_past_gaps(&[3, 5, 6], None), Some(5));
        // The newest region deleted: none.
        assert_eq!(first_id_past_gaps(&[3, 4, 5], Some(7)), None);
        assert_eq!(first_id_past_gaps(&[], Some(7)), None);
        assert_eq!(first_id_past_gaps(&[], None), None);
        // Id 0 at the bottom does not wrap.
        assert_eq!(first_id_past_gaps(&[0, 1], Some(1)), Some(0));
    }
}
