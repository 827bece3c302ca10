//! The one reader of batch records: recovery, the reclaimer and the
//! follower of other writers' logs all walk a region with `scan_batches`,
//! and turn a record entry's offset into an index location with
//! `value_loc`. Every record verifies (checksum and keyed digests) before
//! its entries are handed over.

use super::format::{self, BatchHeader, RecordEntry, RecordFault, RecordOrigin};
use crate::disk::DiskLoc;
use crate::io::{pread_full, AlignedBuf};
use crate::key::KeySecret;
use crate::units::{page_round_up, PAGE_SIZE};
use std::fs::File;

/// Scans read region files in windows this large once they are
/// resynchronising through damage (a page at a time would crawl).
const SCAN_WINDOW: usize = 8 << 20;
/// Scans read at least this much wherever they read: a batch's first page
/// and the rest of its record (a few hundred entries) in one read instead
/// of two, each a round trip to the device that the scan waits for.
const RECORD_READ: usize = 64 << 10;

/// Reads a region file through one aligned window: pieces the window
/// holds are served from it; a miss reads a new window at the requested
/// offset, the bytes asked for (healthy logs: a record's pages) or, while
/// resynchronising through damage, `SCAN_WINDOW` bytes, so that an
/// unreadable region is crossed in big reads instead of one page each.
pub(crate) struct RegionReader<'f> {
    file: &'f File,
    file_len: u64,
    buf: AlignedBuf,
    /// File offset of `buf[0]` and how many bytes of it are valid.
    start: u64,
    valid: usize,
}

impl<'f> RegionReader<'f> {
    pub(crate) fn new(file: &'f File, file_len: u64) -> Self {
        RegionReader {
            file,
            file_len,
            buf: AlignedBuf::zeroed(PAGE_SIZE as usize),
            start: 0,
            valid: 0,
        }
    }

    /// `len` bytes at page-aligned `offset`, which must lie inside the file.
    pub(crate) fn read(&mut self, offset: u64, len: usize, ahead: bool) -> std::io::Result<&[u8]> {
        let end = offset
            .checked_add(len as u64)
            .filter(|&end| end <= self.file_len)
            .ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("{len} bytes at {offset} lie past the end of the file"),
                )
            })?;
        let held = offset >= self.start && end <= self.start + self.valid as u64;
        if !held {
            // Callers ask for whole pages inside the file; a window reaches
            // further, up to the last whole page.
            let whole_pages_end = self.file_len / PAGE_SIZE * PAGE_SIZE;
            let mut want = page_round_up(len as u64).max(RECORD_READ as u64);
            if ahead {
                want = want.max(SCAN_WINDOW as u64);
            }
            let want = want
                .min(whole_pages_end.saturating_sub(offset))
                .max(len as u64) as usize;
            if self.buf.len() < want {
                self.buf = AlignedBuf::zeroed(want);
            }
            self.valid = 0;
            pread_full(self.file, offset, &mut self.buf.as_mut_slice()[..want])?;
            self.start = offset;
            self.valid = want;
        }
        let from = (offset - self.start) as usize;
        Ok(&self.buf.as_slice()[from..from + len])
    }
}

/// What a scan does at a page where no valid batch starts (torn, corrupt,
/// unreadable, or past the end of the file).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BadPage {
    /// Skip it and resynchronise on the next page that starts a valid
    /// batch, so one bad record never hides the good ones (or the
    /// tombstones) after it: recovery, the reclaimer, and another writer's
    /// region once that writer has moved on.
    Resync,
    /// Stop there: another writer may be writing that batch now (values
    /// first, then the record), so it is read again next time.
    Stop,
}

/// How a scan went.
#[derive(Debug, Default)]
pub(crate) struct ScanEnd {
    /// Where a later scan of the same region starts: after the last batch
    /// read (verified, or whole but keyed with another secret), or past
    /// the pages skipped while resynchronising.
    pub end: u64,
    /// Pages where no valid batch started (skipped by resynchronising).
    pub skipped_pages: u64,
    /// Batches that verified, and batches that were whole but keyed with
    /// another secret (stepped over).
    pub verified_batches: u64,
    pub foreign_batches: u64,
    /// The first page where no valid batch started and why (with
    /// `BadPage::Stop`, where the scan stopped), or a partial page at the
    /// end of the file.
    pub first_problem: Option<(u64, String)>,
    /// Whether the scan stopped at a bad page (`BadPage::Stop`).
    pub stopped: bool,
}

/// Visits each valid batch of the region file `origin` names from offset
/// `from` (a page boundary, the region header's end for a whole scan) in
/// order, with the batch's offset. A record cannot be forged (inside a
/// value, or by anyone who writes the file without the directory's
/// secret), nor moved from another writer, region or offset: its MAC binds
/// all of them. Every offset is checked arithmetic and strictly increases,
/// so no content can make the scan loop or wrap.
pub(crate) fn scan_batches(
    reader: &mut RegionReader<'_>,
    origin: &RecordOrigin,
    secret: &KeySecret,
    from: u64,
    bad_page: BadPage,
    mut visit: impl FnMut(u64, Vec<RecordEntry>),
) -> ScanEnd {
    let file_len = reader.file_len;
    let mut scan = ScanEnd {
        end: from,
        ..ScanEnd::default()
    };
    let mut offset = from;
    let mut resyncing = false;
    while offset
        .checked_add(PAGE_SIZE)
        .is_some_and(|end| end <= file_len)
    {
        match read_batch_at(reader, origin, secret, offset, resyncing) {
            Ok((batch_len, entries)) => {
                visit(offset, entries);
                scan.verified_batches += 1;
                // read_batch_at checked that the batch lies in the file.
                offset += batch_len;
                resyncing = false;
            }
            Err((RecordFault::ForeignDigests, batch_len)) => {
                // Whole, but not ours: step over it as a batch.
                scan.foreign_batches += 1;
                offset += batch_len.unwrap_or(PAGE_SIZE);
            }
            Err((fault, _)) => {
                if scan.first_problem.is_none() {
                    scan.first_problem = Some((offset, fault.reason()));
                }
                if bad_page == BadPage::Stop {
                    scan.stopped = true;
                    return scan;
                }
                scan.skipped_pages += 1;
                offset += PAGE_SIZE;
                resyncing = true;
            }
        }
        scan.end = offset;
    }
    if offset < file_len && scan.first_problem.is_none() {
        scan.first_problem = Some((offset, "partial page at the end of the file".into()));
    }
    scan
}

/// Reads the batch at `offset` alone, if it is valid: its entries go to
/// `visit`.
pub(crate) fn first_batch(
    reader: &mut RegionReader<'_>,
    origin: &RecordOrigin,
    secret: &KeySecret,
    offset: u64,
    visit: impl FnOnce(Vec<RecordEntry>),
) {
    if offset
        .checked_add(PAGE_SIZE)
        .is_some_and(|end| end <= reader.file_len)
    {
        if let Ok((_, entries)) = read_batch_at(reader, origin, secret, offset, false) {
            visit(entries);
        }
    }
}

/// The index location of the value a put entry names, in the batch at
/// `batch_start` of the region the index calls `region` (this log's id, or
/// the handle of another writer's region); `None` if it lies past what a
/// location can name (no verified record of a file this size does).
pub(crate) fn value_loc(region: u32, batch_start: u64, entry: &RecordEntry) -> Option<DiskLoc> {
    let page = batch_start.checked_add(entry.value_offset)? / PAGE_SIZE;
    Some(DiskLoc::new(region, u32::try_from(page).ok()?))
}

/// Reads and verifies the batch starting at `offset`: its length and
/// record entries. On failure, the batch's length where its header was
/// whole enough to tell it.
fn read_batch_at(
    reader: &mut RegionReader<'_>,
    origin: &RecordOrigin,
    secret: &KeySecret,
    offset: u64,
    resyncing: bool,
) -> std::result::Result<(u64, Vec<RecordEntry>), (RecordFault, Option<u64>)> {
    let file_len = reader.file_len;
    let first = reader
        .read(offset, PAGE_SIZE as usize, resyncing)
        .map_err(|e| (format!("read failed: {e}").into(), None))?;
    let header = BatchHeader::decode(first, origin).map_err(|e| (e.into(), None))?;
    if offset
        .checked_add(header.batch_len)
        .is_none_or(|end| end > file_len)
    {
        return Err(("batch extends past the end of the file".into(), None));
    }
    let padded = header.padded_record_len() as usize;
    let record = reader
        .read(offset, padded, resyncing)
        .map_err(|e| (format!("read failed: {e}").into(), None))?;
    let entries = format::decode_record(record, &header, secret, origin, offset)
        .map_err(|fault| (fault, Some(header.batch_len)))?;
    Ok((header.batch_len, entries))
}

#[cfg(test)]
mod tests {
    use super::super::format::REGION_HEADER_LEN;
    use super::super::test_log::{put, tombstone, TestLog, NODE};
    use super::super::RecoveryChecks;
    use super::*;
    use std::os::unix::fs::FileExt;

    /// Each batch's offset and its entries' keys.
    type Batches = Vec<(u64, Vec<Vec<u8>>)>;

    /// Scans the file of region `id` from `from`; the batches with the
    /// scan's end.
    fn scan_file(
        path: &std::path::Path,
        id: u32,
        secret: &KeySecret,
        from: u64,
        bad_page: BadPage,
    ) -> (Batches, ScanEnd) {
        let file = File::open(path).unwrap();
        let len = file.metadata().unwrap().len();
        let mut reader = RegionReader::new(&file, len);
        let mut batches = Vec::new();
        let origin = super::super::names::record_origin(path, id, NODE, false);
        let end = scan_batches(
            &mut reader,
            &origin,
            secret,
            from,
            bad_page,
            |at, entries| batches.push((at, entries.into_iter().map(|e| e.key).collect())),
        );
        (batches, end)
    }

    /// Three batches in one region: (the tier, the region's path, each
    /// batch's locations).
    fn three_batches(
        log: &TestLog,
    ) -> (
        super::super::DiskTier,
        std::path::PathBuf,
        Vec<Vec<DiskLoc>>,
    ) {
        let (tier, _, _) = log.open(RecoveryChecks::default());
        let locs = vec![
            log.write(&tier, &[put(b"a", 1, 5000, 1), put(b"b", 2, 10, 2)])
                .unwrap(),
            log.write(&tier, &[tombstone(b"a", 3)]).unwrap(),
            log.write(&tier, &[put(b"c", 4, 70_000, 3)]).unwrap(),
        ];
        let files = log.region_files();
        assert_eq!(files.len(), 1);
        (tier, files[0].1.clone(), locs)
    }

    #[test]
    fn a_whole_region_scans_batch_by_batch_and_locates_as_the_writer_did() {
        let log = TestLog::new(1 << 20);
        let (tier, path, locs) = three_batches(&log);
        let file = File::open(&path).unwrap();
        let mut reader = RegionReader::new(&file, file.metadata().unwrap().len());
        let mut located = Vec::new();
        let mut offsets = Vec::new();
        let scan = scan_batches(
            &mut reader,
            &super::super::names::record_origin(&path, 0, NODE, false),
            &log.secret,
            REGION_HEADER_LEN,
            BadPage::Resync,
            |at, entries| {
                offsets.push(at);
                for entry in entries {
                    if entry.kind == format::RecordKind::Put {
                        located.push(value_loc(0, at, &entry).unwrap());
                    }
                }
            },
        );
        assert_eq!(offsets.len(), 3);
        assert_eq!(offsets[0], REGION_HEADER_LEN);
        assert_eq!(scan.verified_batches, 3);
        assert_eq!((scan.skipped_pages, scan.foreign_batches), (0, 0));
        assert!(scan.first_problem.is_none() && !scan.stopped);
        assert_eq!(scan.end, tier.region(0).unwrap().len());
        // The scanner's locations are the writer's.
        let written: Vec<DiskLoc> = locs.into_iter().flatten().collect();
        assert_eq!(located, written);
    }

    #[test]
    fn a_damaged_record_is_skipped_with_resync_and_stops_the_scan_without() {
        let log = TestLog::new(1 << 20);
        let (_tier, path, _) = three_batches(&log);
        let (whole, _) = scan_file(&path, 0, &log.secret, REGION_HEADER_LEN, BadPage::Resync);
        let second = whole[1].0;
        // One byte of the second batch's record (a tombstone: one page).
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        file.write_all_at(&[0xFF], second + 40).unwrap();
        drop(file);
        let (batches, scan) = scan_file(&path, 0, &log.secret, REGION_HEADER_LEN, BadPage::Resync);
        let keys: Vec<_> = batches.iter().map(|(_, keys)| keys.clone()).collect();
        assert_eq!(
            keys,
            vec![
                vec![b"\0a".to_vec(), b"\0b".to_vec()],
                vec![b"\0c".to_vec()]
            ]
        );
        assert_eq!(batches[1].0, whole[2].0, "resynchronised on the next batch");
        assert_eq!(scan.skipped_pages, 1);
        assert_eq!(scan.first_problem.as_ref().unwrap().0, second);
        assert!(!scan.stopped);
        let (batches, scan) = scan_file(&path, 0, &log.secret, REGION_HEADER_LEN, BadPage::Stop);
        assert_eq!(batches.len(), 1);
        assert!(scan.stopped);
        assert_eq!(scan.end, second, "the next scan starts at the bad page");
        assert_eq!(scan.skipped_pages, 0);
    }

    #[test]
    fn records_under_another_secret_are_stepped_over_as_batches() {
        let log = TestLog::new(1 << 20);
        let (tier, path, _) = three_batches(&log);
        let other = KeySecret::from_bytes([9; crate::key::KEY_SECRET_LEN]);
        let (batches, scan) = scan_file(&path, 0, &other, REGION_HEADER_LEN, BadPage::Stop);
        assert!(batches.is_empty());
        assert_eq!((scan.verified_batches, scan.foreign_batches), (0, 3));
        assert!(!scan.stopped && scan.first_problem.is_none());
        assert_eq!(scan.end, tier.region(0).unwrap().len());
        // Another region id in the records is damage, not foreign.
        let (batches, scan) = scan_file(&path, 1, &log.secret, REGION_HEADER_LEN, BadPage::Resync);
        assert!(batches.is_empty());
        assert_eq!(scan.verified_batches, 0);
        assert!(scan.skipped_pages > 0);
    }

    #[test]
    fn a_scan_resumes_where_the_last_one_ended() {
        let log = TestLog::new(1 << 20);
        let (tier, path, _) = three_batches(&log);
        let (_, first) = scan_file(&path, 0, &log.secret, REGION_HEADER_LEN, BadPage::Stop);
        log.write(&tier, &[put(b"d", 5, 100, 4)]).unwrap();
        let (batches, scan) = scan_file(&path, 0, &log.secret, first.end, BadPage::Stop);
        assert_eq!(batches.len(), 1);
        assert_eq!(batches[0], (first.end, vec![b"\0d".to_vec()]));
        assert_eq!(scan.end, tier.region(0).unwrap().len());
        // Nothing new: nothing visited, the end stays.
        let (batches, again) = scan_file(&path, 0, &log.secret, scan.end, BadPage::Stop);
        assert!(batches.is_empty());
        assert_eq!(again.end, scan.end);
    }

    #[test]
    fn a_partial_page_at_the_end_is_a_problem_but_no_stop() {
        let log = TestLog::new(1 << 20);
        let (tier, path, _) = three_batches(&log);
        let len = tier.region(0).unwrap().len();
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        file.write_all_at(&[1; 100], len).unwrap();
        drop(file);
        let (batches, scan) = scan_file(&path, 0, &log.secret, REGION_HEADER_LEN, BadPage::Stop);
        assert_eq!(batches.len(), 3);
        assert!(!scan.stopped);
        assert_eq!(scan.end, len);
        let (at, reason) = scan.first_problem.unwrap();
        assert_eq!(at, len);
        assert!(reason.contains("partial page"), "{reason}");
    }

    #[test]
    fn locations_past_what_an_index_entry_names_are_refused() {
        let entry = RecordEntry {
            kind: format::RecordKind::Put,
            seq: 1,
            digest: KeySecret::from_bytes([1; crate::key::KEY_SECRET_LEN]).digest_qualified(b"\0k"),
            value_offset: PAGE_SIZE,
            value_len: 1,
            checksum: 0,
            key: vec![0],
        };
        assert_eq!(
            value_loc(3, 2 * PAGE_SIZE, &entry),
            Some(DiskLoc::new(3, 3))
        );
        assert_eq!(value_loc(3, u64::MAX, &entry), None);
        assert_eq!(value_loc(3, u64::from(u32::MAX) * PAGE_SIZE, &entry), None);
    }
}
