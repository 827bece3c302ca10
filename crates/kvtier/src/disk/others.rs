//! Other writers' regions of a shared directory, as this node reads them:
//! opened read-only, named in the index by handles from `OTHERS_BASE` up
//! (so an index entry stays 32 bytes and the read path is the same for
//! every region), and scanned for the batches their writers append.
//!
//! Only the writer of a file ever changes it; this side never writes,
//! renames or removes another writer's file.

use super::{read_batch_at, DiskTier, Region, RegionReader, OTHERS_BASE};
use crate::disk::format::{RecordEntry, RecordFault};
use crate::key::KeySecret;
use crate::units::PAGE_SIZE;
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
    /// Pages skipped while resynchronising, and batches keyed with another
    /// secret (stepped over).
    pub skipped_pages: u64,
    pub foreign_batches: u64,
}

impl DiskTier {
    /// Opens another writer's region file for reading: O_DIRECT unless this
    /// node's `direct_io` is off or the file system refuses it.
    pub(crate) fn open_other(&self, path: &Path) -> std::io::Result<OtherFile> {
        // Another writer's file is hostile until verified: no links, no
        // blocking open (a FIFO), regular files only.
        let mut options = OpenOptions::new();
        options.read(true);
        let open = |extra| crate::private::open_untrusted(path, &options, extra);
        let mut direct = false;
        let file = if self.direct_io() {
            match open(libc::O_DIRECT) {
                Ok(file) => {
                    direct = true;
                    file
                }
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => open(0)?,
                Err(e) => return Err(e),
            }
        } else {
            open(0)?
        };
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
        let region = Region::new(
            handle,
            opened.file,
            path,
            opened.len,
            opened.direct,
            &self.engine,
        );
        self.others
            .write()
            .unwrap()
            .insert(handle, Arc::new(region));
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
    id: u32,
    file_len: u64,
    from: u64,
    secret: &KeySecret,
    resync: bool,
) -> NewBatches {
    let mut reader = RegionReader::new(file, file_len);
    let mut out = NewBatches {
        end: from,
        ..NewBatches::default()
    };
    let mut offset = from;
    let mut resyncing = false;
    while offset
        .checked_add(PAGE_SIZE)
        .is_some_and(|end| end <= file_len)
    {
        match read_batch_at(&mut reader, id, secret, offset, resyncing) {
            Ok((batch_len, entries)) => {
                out.batches.push((offset, entries));
                offset += batch_len;
                out.end = offset;
                resyncing = false;
            }
            Err((RecordFault::ForeignDigests, batch_len)) => {
                out.foreign_batches += 1;
                offset += batch_len.unwrap_or(PAGE_SIZE);
                out.end = offset;
            }
            Err((fault, _)) => {
                if !resync {
                    out.stuck = Some(fault.reason());
                    return out;
                }
                out.skipped_pages += 1;
                offset += PAGE_SIZE;
                out.end = offset;
                resyncing = true;
            }
        }
    }
    out
}
