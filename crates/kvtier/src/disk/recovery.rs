//! Recovery: rebuilding what the log holds from its batch records,
//! newest region first (docs/design.md, "Recovery"). The rules (the gap
//! rule, the tail scrub, setting aside what cannot be read, refusing a
//! directory whose records verify under no secret of its own) live here;
//! the reads are `scan`'s, on `parallel_scan`'s threads.

use super::format::{self, RecordEntry};
use super::names::{parse_region_name, RegionName};
use super::recorded::RecordedRegion;
use super::recovery_report::RecoveryReport;
use super::{parallel_scan, value_loc, DiskTier, Region};
use crate::disk::DiskLoc;
use crate::error::{Error, Result};
use crate::io::{pread_full, AlignedBuf};
use crate::key::ValueChecksum;
use crate::units::page_round_up;
use std::collections::BTreeMap;
use std::fs::{self, File};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// How often recovery logs its progress.
const RECOVERY_PROGRESS_EVERY: std::time::Duration = std::time::Duration::from_secs(2);
/// Piece size of the tail scrub's value reads.
const SCRUB_PIECE: usize = 8 << 20;

/// What recovery may assume, decided by the store from the data
/// directory's files before the disk tier opens.
#[derive(Debug, Clone, Default)]
pub struct RecoveryChecks {
    /// The key-secret matched its check value: no need to refuse a
    /// directory where no record verifies (older directories have no check
    /// value, and are refused when nothing verifies but something would
    /// under another secret).
    pub identity_confirmed: bool,
    /// The previous run did not close cleanly: verify the values of the
    /// newest region's batches before indexing them.
    pub scrub_tail: bool,
    /// The regions an index checkpoint written at the last clean close
    /// recorded: if the directory holds exactly those, they are opened
    /// without reading their records (the caller indexes the
    /// checkpoint's entries); see `recorded`.
    pub recorded: Option<Arc<[RecordedRegion]>>,
}

/// A put that recovery found in a valid batch record.
#[derive(Debug)]
pub struct RecoveredEntry {
    pub entry: RecordEntry,
    pub loc: DiskLoc,
    /// The tail scrub found this put's value lost: handed over as a
    /// tombstone at the put's sequence (so no older value of the key comes
    /// back either), for the store to log as a remove.
    pub value_lost: bool,
}

/// What recovery carries from one region to the next, newest first.
struct RecoveryPass {
    report: RecoveryReport,
    /// The log head: the newest region the log had written.
    head: Option<u32>,
    /// The id the next older region should have (a gap below it hides
    /// the removals the missing regions may have held).
    expected: Option<u32>,
    behind_gap: bool,
    newest_seen: bool,
    /// Regions whose records verify only under another secret: decided
    /// once every region is scanned.
    foreign_only: Vec<(u32, PathBuf)>,
    verified_batches: u64,
    foreign_batches: u64,
    scrub_time: std::time::Duration,
    /// Verify the newest region's values before indexing them.
    scrub_tail: bool,
}

impl DiskTier {
    /// Rebuilds what the log holds, newest region first (see docs/design.md,
    /// "Recovery"). Nothing is deleted on recovery's own judgement except
    /// empty files; what it cannot use is quarantined or skipped, and the
    /// entries of regions older than a missing one are not indexed (a
    /// missing region may have held the tombstones that removed them).
    pub(super) fn recover(
        &self,
        checks: RecoveryChecks,
        apply: &mut impl FnMut(RecoveredEntry),
    ) -> Result<RecoveryReport> {
        let mut report = RecoveryReport::default();
        if let Some(recorded) = &checks.recorded {
            match self.open_recorded(recorded, &mut report) {
                Ok(()) => {
                    report.from_checkpoint = true;
                    return Ok(report);
                }
                Err(reason) => {
                    report = RecoveryReport::default();
                    tracing::info!(%reason, "the index checkpoint does not match the log; reading every record instead");
                }
            }
        }
        let candidates = self.region_candidates(&mut report)?;
        let mut pass = RecoveryPass {
            report,
            head: self.read_head(),
            expected: None,
            behind_gap: false,
            newest_seen: false,
            foreign_only: Vec::new(),
            verified_batches: 0,
            foreign_batches: 0,
            scrub_time: std::time::Duration::ZERO,
            scrub_tail: checks.scrub_tail,
        };
        pass.expected = pass.head;
        self.scan_regions(candidates, &mut pass, apply)?;
        self.finish_recovery(pass, checks.identity_confirmed)
    }

    /// The region files of this directory by id (more than one file may
    /// claim an id); what cannot be a region of this log is ignored or set
    /// aside.
    fn region_candidates(
        &self,
        report: &mut RecoveryReport,
    ) -> Result<BTreeMap<u32, Vec<PathBuf>>> {
        let mut candidates: BTreeMap<u32, Vec<PathBuf>> = BTreeMap::new();
        let listing = fs::read_dir(&self.dir)
            .map_err(|e| Error::io(format!("listing {}", self.dir.display()), e))?;
        for item in listing {
            let item = item.map_err(|e| Error::io(format!("listing {}", self.dir.display()), e))?;
            let name = item.file_name();
            let name = name.to_string_lossy();
            match parse_region_name(&name) {
                Some(RegionName {
                    node: Some(node), ..
                }) if node != self.node_id => {
                    // Kept, never read: this directory's index must hold
                    // only what it wrote and verified.
                    tracing::warn!(file = %name, "ignoring a region file of another node")
                }
                Some(RegionName { id, .. }) if id > self.max_region_id => {
                    // No writer of this directory gets here (ids are handed
                    // out in order and refused past MAX_REGION_ID): a name
                    // that would stop every later write must not count.
                    self.set_aside(&item.path(), "region id out of range", report);
                }
                Some(RegionName { id, .. }) => {
                    candidates.entry(id).or_default().push(item.path());
                }
                None => {
                    tracing::warn!(file = %name, "ignoring unknown file in the region directory")
                }
            }
        }
        Ok(candidates)
    }

    /// Opens every candidate, scans them on `parallel_scan`'s threads and
    /// hands each to `recover_region` newest first: a missing region is
    /// noticed before any older entry is applied (per key, the highest
    /// sequence wins in any order).
    fn scan_regions(
        &self,
        candidates: BTreeMap<u32, Vec<PathBuf>>,
        pass: &mut RecoveryPass,
        apply: &mut impl FnMut(RecoveredEntry),
    ) -> Result<()> {
        let total = candidates.len();
        let started = std::time::Instant::now();
        let mut reported = started;
        let mut opened = Vec::with_capacity(candidates.len());
        for (id, paths) in candidates.into_iter().rev() {
            if let Some((path, file, direct, file_len)) =
                self.open_candidate(id, paths, &mut pass.report)?
            {
                opened.push(parallel_scan::Candidate {
                    id,
                    origin: self.own_origin(&path, id),
                    path,
                    file,
                    direct,
                    file_len,
                });
            }
        }
        let mut done = 0usize;
        let threads = parallel_scan::scan_threads();
        parallel_scan::scan_in_order(opened, &self.secret, threads, |scanned| {
            if reported.elapsed() >= RECOVERY_PROGRESS_EVERY {
                reported = std::time::Instant::now();
                tracing::info!(
                    regions_scanned = done,
                    regions = total,
                    records = pass.report.records,
                    elapsed_s = started.elapsed().as_secs(),
                    "recovering the disk tier: {done} of {total} regions scanned"
                );
            }
            done += 1;
            self.recover_region(scanned, pass, apply)
        })
    }

    /// One scanned region, newest first: the gap rule, what to set aside,
    /// the tail scrub, and its entries handed to `apply`.
    fn recover_region(
        &self,
        scanned: parallel_scan::Scanned,
        pass: &mut RecoveryPass,
        apply: &mut impl FnMut(RecoveredEntry),
    ) -> Result<()> {
        let parallel_scan::Scanned {
            candidate:
                parallel_scan::Candidate {
                    id,
                    path,
                    file,
                    direct,
                    file_len,
                    ..
                },
            header,
            scan,
            entries: entries_here,
        } = scanned;
        // A regular file holds this id: the region is not missing, even
        // if nothing in it verifies (its unreadable records are damage
        // like any other). Only ids with no such file are gaps.
        match pass.expected {
            Some(e) if id < e && !pass.behind_gap => {
                pass.behind_gap = true;
                tracing::error!(
                    region = id,
                    missing_from = id + 1,
                    missing_to = e,
                    "region files are missing from the middle of the log (deleted, renamed \
                     or unreadable): entries of this region and older ones are not indexed, \
                     since the missing regions may have removed them"
                );
            }
            _ => {}
        }
        if pass.expected.is_none_or(|e| id <= e) {
            pass.expected = id.checked_sub(1);
        }
        if header.is_err() && file_len == 0 {
            // Created, but its header never written: it holds nothing
            // (headers are synced before any batch).
            drop(file);
            self.unlink(&path)?;
            pass.report.empty_regions_removed += 1;
            return Ok(());
        }
        // A bad header hides nothing: every batch names its region and
        // verifies on its own, so the batches are read either way.
        let scrub = pass.scrub_tail && !pass.newest_seen;
        let mut scrub_buf = None;
        if scan.verified_batches == 0 && scan.foreign_batches > 0 {
            // Intact records keyed with another secret, and none of
            // ours: decided once every region is scanned.
            pass.foreign_only.push((id, path));
            pass.foreign_batches += scan.foreign_batches;
            return Ok(());
        }
        if let (0, Err(reason)) = (scan.verified_batches, &header) {
            // Never deleted on recovery's own judgement: a read error
            // may be transient, and the bytes may matter to whoever
            // investigates.
            drop(file);
            // Only a member of the log (below its head or a region kept
            // above it) keeps its place; anything above is not one.
            let member = pass.newest_seen || pass.head.is_some_and(|h| id <= h);
            self.set_aside_region(id, &path, reason, member, &mut pass.report);
            return Ok(());
        }
        pass.verified_batches += scan.verified_batches;
        pass.foreign_batches += scan.foreign_batches;
        if let Err(reason) = &header {
            pass.report.damaged_headers += 1;
            tracing::warn!(region = id, path = %path.display(), %reason, batches = scan.verified_batches, "region header damaged; its batches verify on their own and are kept");
        }
        if scan.foreign_batches > 0 {
            tracing::warn!(
                region = id,
                batches = scan.foreign_batches,
                "region holds records keyed with another secret; skipped them"
            );
        }
        pass.report.regions += 1;
        if !direct {
            pass.report.buffered_regions += 1;
        }
        if let Ok(header) = &header {
            pass.report.max_seq = pass.report.max_seq.max(header.first_seq.saturating_sub(1));
        }
        if let Some((offset, reason)) = &scan.first_problem {
            pass.report.damaged_regions += 1;
            pass.report.skipped_pages += scan.skipped_pages;
            tracing::warn!(region = id, offset, file_len, skipped_pages = scan.skipped_pages, %reason, "pages without a valid batch (a torn tail or damage); resynchronised past them");
        }
        for (batch_start, entry) in entries_here {
            pass.report.records += 1;
            pass.report.max_seq = pass.report.max_seq.max(entry.seq);
            if pass.behind_gap {
                pass.report.entries_behind_gap += 1;
                continue;
            }
            if scrub && entry.kind == format::RecordKind::Put {
                // The previous run did not close: a device that
                // acknowledged a flush it did not do may have kept
                // this record and lost its values. Read them first.
                let buf = scrub_buf.get_or_insert_with(|| AlignedBuf::zeroed(SCRUB_PIECE));
                pass.report.scrubbed_entries += 1;
                let scrub_started = std::time::Instant::now();
                let verifies = value_verifies(&file, batch_start, &entry, buf);
                pass.scrub_time += scrub_started.elapsed();
                if !verifies {
                    pass.report.scrub_dropped += 1;
                    tracing::warn!(region = id, seq = entry.seq, "the newest region names a value that does not verify (lost by the device after an unclean shutdown); not indexed");
                    let loc = DiskLoc::new(id, 0);
                    let entry = RecordEntry {
                        kind: format::RecordKind::Tombstone,
                        value_offset: 0,
                        value_len: 0,
                        checksum: 0,
                        ..entry
                    };
                    apply(RecoveredEntry {
                        entry,
                        loc,
                        value_lost: true,
                    });
                    continue;
                }
            }
            let Some(loc) = value_loc(id, batch_start, &entry) else {
                // No verified record of a file this size names such a
                // page; counted as damage rather than indexed wrong.
                pass.report.skipped_pages += 1;
                continue;
            };
            apply(RecoveredEntry {
                entry,
                loc,
                value_lost: false,
            });
        }
        if pass.behind_gap {
            pass.report.regions_behind_gap += 1;
        }
        pass.newest_seen = true;
        self.used.fetch_add(file_len, Ordering::AcqRel);
        let bounded = self.bounds_reads_of(&file);
        let region = Region::new(id, file, path, file_len, direct, &self.engine, bounded);
        self.regions.write().unwrap().insert(id, Arc::new(region));
        Ok(())
    }

    /// After every region: refuses a directory whose records verify only
    /// under another secret, sets aside regions keyed with one, and sets
    /// the next region id.
    fn finish_recovery(
        &self,
        pass: RecoveryPass,
        identity_confirmed: bool,
    ) -> Result<RecoveryReport> {
        let RecoveryPass {
            mut report,
            head,
            foreign_only,
            verified_batches,
            foreign_batches,
            scrub_time,
            ..
        } = pass;
        if !identity_confirmed && verified_batches == 0 && foreign_batches > 0 {
            // Nothing here verifies under this secret and something would
            // under another: the key-secret file is wrong, not the regions.
            // Refuse before anything is moved (or later reclaimed).
            return Err(Error::new(
                crate::ErrorKind::Corruption,
                format!(
                    "no batch record in {} verifies under this directory's key-secret, and {} \
                     intact ones were keyed with another: the key-secret file is damaged or \
                     belongs to another directory; restore it (nothing was changed)",
                    self.dir.display(),
                    foreign_batches
                ),
            ));
        }
        let newest_kept = self.regions.read().unwrap().keys().next_back().copied();
        for (id, path) in foreign_only {
            let member = head.is_some_and(|h| id <= h) || newest_kept.is_some_and(|k| id < k);
            tracing::error!(region = id, "region records are keyed with another secret");
            self.set_aside_region(
                id,
                &path,
                "records keyed with another secret (not this directory's)",
                member,
                &mut report,
            );
            report.foreign_regions += 1;
        }
        report.batches = verified_batches;
        report.scrub_ms = scrub_time.as_millis() as u64;
        // The next id follows every region file still here (kept, or left
        // in place because it could not be moved) and the log head; ids of
        // files set aside are free again (the new file's name differs by
        // node and incarnation), so they leave no gap.
        let mut next_region = head.map_or(0, |head| head.saturating_add(1));
        for item in fs::read_dir(&self.dir)
            .map_err(|e| Error::io(format!("listing {}", self.dir.display()), e))?
            .flatten()
        {
            if let Some(RegionName { id, node, .. }) =
                parse_region_name(&item.file_name().to_string_lossy())
            {
                if id <= self.max_region_id && node.is_none_or(|node| node == self.node_id) {
                    next_region = next_region.max(id + 1);
                }
            }
        }
        self.writer.lock().unwrap().next_region = next_region;
        Ok(report)
    }
}

/// Whether the value a put entry names (in the batch at `batch_start`)
/// reads back and matches its checksum; `buf` is scratch, at least a page.
fn value_verifies(
    file: &File,
    batch_start: u64,
    entry: &RecordEntry,
    buf: &mut AlignedBuf,
) -> bool {
    let Some(mut at) = batch_start.checked_add(entry.value_offset) else {
        return false;
    };
    let mut left = u64::from(entry.value_len);
    let mut checksum = ValueChecksum::new(entry.digest);
    while left > 0 {
        let piece = left.min(buf.len() as u64);
        let padded = page_round_up(piece) as usize;
        if pread_full(file, at, &mut buf.as_mut_slice()[..padded]).is_err() {
            // The last page of a value may end the file (buffered files):
            // fall back to the exact length.
            if pread_full(file, at, &mut buf.as_mut_slice()[..piece as usize]).is_err() {
                return false;
            }
        }
        checksum.update(&buf.as_slice()[..piece as usize]);
        at += piece;
        left -= piece;
    }
    checksum.finish() == entry.checksum
}

#[cfg(test)]
mod tests {
    use super::super::format::REGION_HEADER_LEN;
    use super::super::test_log::{keys_and_seqs, put, tombstone, TestLog};
    use super::super::QUARANTINE_DIR;
    use super::*;
    use crate::key::{KeySecret, KEY_SECRET_LEN};
    use crate::units::PAGE_SIZE;
    use std::os::unix::fs::FileExt;

    fn checks() -> RecoveryChecks {
        RecoveryChecks::default()
    }

    /// Regions of 64 KiB, one batch of a 40 KiB value each: region `i`
    /// holds key `k<i>` at sequence `i + 1`.
    fn log_of(regions: u32) -> TestLog {
        let log = TestLog::new(64 << 10);
        let (tier, _, _) = log.open(checks());
        for i in 0..regions {
            let key = format!("k{i}");
            log.write(
                &tier,
                &[put(key.as_bytes(), u64::from(i) + 1, 40 << 10, i as u8)],
            )
            .unwrap();
        }
        assert_eq!(log.region_files().len(), regions as usize);
        log
    }

    #[test]
    fn reopening_applies_what_was_written_at_the_same_locations() {
        let log = TestLog::new(1 << 20);
        let (tier, applied, report) = log.open(checks());
        assert!(applied.is_empty());
        assert_eq!(report.regions, 0);
        let first = log
            .write(&tier, &[put(b"a", 1, 5000, 1), put(b"b", 2, 9000, 2)])
            .unwrap();
        let second = log
            .write(&tier, &[tombstone(b"a", 3), put(b"c", 4, 1, 3)])
            .unwrap();
        drop(tier);
        let (tier, applied, report) = log.open(checks());
        assert_eq!(
            keys_and_seqs(&applied),
            vec![
                (b"a".to_vec(), 1),
                (b"b".to_vec(), 2),
                (b"a".to_vec(), 3),
                (b"c".to_vec(), 4)
            ]
        );
        let puts: Vec<DiskLoc> = applied
            .iter()
            .filter(|e| e.entry.kind == format::RecordKind::Put)
            .map(|e| e.loc)
            .collect();
        assert_eq!(puts, [first, second].concat());
        assert!(applied.iter().all(|e| !e.value_lost));
        assert_eq!((report.regions, report.batches, report.records), (1, 2, 4));
        assert_eq!(report.max_seq, 4);
        assert_eq!(tier.used(), tier.region(0).unwrap().len());
        // The next region id follows the one recovered.
        assert_eq!(tier.next_region_id(), 1);
    }

    #[test]
    fn regions_behind_a_missing_one_are_not_indexed() {
        let log = log_of(4);
        std::fs::remove_file(&log.region_files()[1].1).unwrap();
        let (_tier, applied, report) = log.open(checks());
        let keys: Vec<_> = keys_and_seqs(&applied)
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        assert_eq!(
            keys,
            vec![b"k3".to_vec(), b"k2".to_vec()],
            "newest first, none behind the gap"
        );
        assert_eq!(
            (report.regions_behind_gap, report.entries_behind_gap),
            (1, 1)
        );
        // A missing newest region (the head names it) hides them all.
        std::fs::remove_file(&log.region_files().last().unwrap().1).unwrap();
        let (_tier, applied, _) = log.open(checks());
        assert!(applied.is_empty(), "{:?}", keys_and_seqs(&applied));
    }

    #[test]
    fn the_tail_scrub_hands_a_lost_value_over_as_a_tombstone() {
        let log = log_of(2);
        let (_, newest) = log.region_files().pop().unwrap();
        // The value of the newest region's batch (after its one-page
        // record) lost, as a device that skipped a flush would lose it.
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&newest)
            .unwrap();
        file.write_all_at(&[0xEE; 100], REGION_HEADER_LEN + PAGE_SIZE)
            .unwrap();
        drop(file);
        // A clean shutdown's open trusts the records.
        let (tier, applied, report) = log.open(checks());
        drop(tier);
        assert_eq!(report.scrubbed_entries, 0);
        assert!(applied.iter().all(|e| !e.value_lost));
        let scrub = RecoveryChecks {
            scrub_tail: true,
            ..checks()
        };
        let (_tier, applied, report) = log.open(scrub);
        assert_eq!((report.scrubbed_entries, report.scrub_dropped), (1, 1));
        let lost: Vec<_> = applied.iter().filter(|e| e.value_lost).collect();
        assert_eq!(lost.len(), 1);
        assert_eq!(lost[0].entry.kind, format::RecordKind::Tombstone);
        assert_eq!(
            (&lost[0].entry.key[1..], lost[0].entry.seq),
            (&b"k1"[..], 2)
        );
        // Only the newest region is scrubbed: the older put stays.
        assert!(applied
            .iter()
            .any(|e| &e.entry.key[1..] == b"k0" && !e.value_lost));
    }

    #[test]
    fn a_directory_keyed_with_another_secret_is_refused_untouched() {
        let log = log_of(2);
        let before = log.region_files();
        let other = Arc::new(KeySecret::from_bytes([9; KEY_SECRET_LEN]));
        let err = log.try_open(&other, checks()).map(|_| ()).unwrap_err();
        assert_eq!(err.kind(), crate::ErrorKind::Corruption);
        assert!(err.to_string().contains("key-secret"), "{err}");
        assert_eq!(log.region_files(), before, "nothing was moved");
        // Once the secret is confirmed, regions keyed otherwise are
        // quarantined and empty regions keep the ids contiguous.
        let confirmed = RecoveryChecks {
            identity_confirmed: true,
            ..checks()
        };
        let (_tier, applied, report) = log.try_open(&other, confirmed).unwrap();
        assert!(applied.is_empty());
        assert_eq!((report.foreign_regions, report.quarantined_regions), (2, 2));
        assert_eq!(
            log.region_files().len(),
            2,
            "empty regions left in their place"
        );
        let (_tier, applied, report) = log.open(checks());
        assert!(applied.is_empty());
        assert_eq!(report.regions_behind_gap, 0);
    }

    #[test]
    fn files_recovery_cannot_use_are_set_aside_not_deleted() {
        let log = log_of(2);
        let regions = log.regions_dir();
        // A header-less empty file is removed; a second file claiming
        // region 1 and a region named past the id range are quarantined;
        // a directory under a region name is not a region.
        std::fs::write(
            regions.join(format!(
                "{}-0000000000000001-00000002.kvr",
                super::super::test_log::NODE
            )),
            b"",
        )
        .unwrap();
        std::fs::write(regions.join("00000001.kvr"), b"short").unwrap();
        std::fs::write(regions.join("ffffffff.kvr"), vec![0; 4096]).unwrap();
        std::fs::create_dir(regions.join("00000005.kvr")).unwrap();
        std::fs::write(regions.join("notes.txt"), b"ignored").unwrap();
        let (tier, applied, report) = log.open(checks());
        assert_eq!(applied.len(), 2);
        assert_eq!(report.empty_regions_removed, 1);
        assert_eq!(report.quarantined_regions, 3);
        let quarantined = std::fs::read_dir(log.path().join(QUARANTINE_DIR))
            .unwrap()
            .count();
        assert_eq!(quarantined, 6, "each file with its .why");
        assert!(regions.join("notes.txt").exists());
        // Ids of files set aside are free again; the id past the range
        // does not count.
        assert_eq!(tier.next_region_id(), 2);
    }
}
