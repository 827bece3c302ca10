//! Opening a log as an index checkpoint recorded it (docs/design.md,
//! "Local index checkpoints"): after a clean close, when the region files
//! are exactly the ones the checkpoint lists (the same ids, incarnations
//! and lengths, ids without a gap, the log head on the newest), every
//! region is opened without reading its records, and the checkpoint's
//! entries are the index. Anything else (a region grown, gone, added or
//! renamed, a file under a region's name that is not a regular file, a
//! file of another node) and recovery reads every record instead, as if
//! there were no checkpoint.

use super::names::{parse_region_name, RegionName};
use super::recovery_report::RecoveryReport;
use super::{DiskTier, Region};
use std::collections::BTreeMap;
use std::fs;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// A region as an index checkpoint recorded it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordedRegion {
    pub id: u32,
    /// The incarnation in the region file's name.
    pub incarnation: u64,
    /// The file's length when the checkpoint was written.
    pub len: u64,
}

impl DiskTier {
    /// Opens every region `recorded` lists, if the directory holds exactly
    /// those files; otherwise says why not, having opened and changed
    /// nothing.
    pub(super) fn open_recorded(
        &self,
        recorded: &[RecordedRegion],
        report: &mut RecoveryReport,
    ) -> std::result::Result<(), String> {
        let wanted: BTreeMap<u32, RecordedRegion> = recorded.iter().map(|r| (r.id, *r)).collect();
        if wanted.len() != recorded.len() {
            return Err("the checkpoint lists a region twice".into());
        }
        if let (Some(first), Some(last)) = (wanted.keys().next(), wanted.keys().next_back()) {
            if u64::from(last - first) + 1 != wanted.len() as u64 {
                return Err("the checkpoint's regions have a gap".into());
            }
        }
        let newest = wanted.keys().next_back().copied();
        let head = self.read_head();
        if head.is_some_and(|head| Some(head) != newest) {
            return Err(format!(
                "the log head names region {} and the checkpoint's newest is {newest:?}",
                head.unwrap_or_default()
            ));
        }
        let listing = fs::read_dir(&self.dir).map_err(|e| format!("listing the regions: {e}"))?;
        let mut opened = Vec::with_capacity(wanted.len());
        for item in listing {
            let item = item.map_err(|e| format!("listing the regions: {e}"))?;
            let name = item.file_name();
            let name = name.to_string_lossy();
            let Some(RegionName {
                id,
                node,
                incarnation,
            }) = parse_region_name(&name)
            else {
                // Unknown files are ignored by recovery too.
                continue;
            };
            let Some(want) = wanted.get(&id) else {
                return Err(format!("region file {name} is not in the checkpoint"));
            };
            if node.is_some_and(|node| node != self.node_id) || incarnation != want.incarnation {
                return Err(format!(
                    "region file {name} is not the one the checkpoint recorded"
                ));
            }
            let path = item.path();
            // Never follows a link, never blocks on a FIFO: what is not a
            // regular file is recovery's to set aside.
            let meta = fs::symlink_metadata(&path).map_err(|e| format!("{name}: {e}"))?;
            if !meta.is_file() {
                return Err(format!("{name} is not a regular file"));
            }
            let (file, direct) = self.open_file(&path, false).map_err(|e| e.to_string())?;
            let len = file.metadata().map_err(|e| format!("{name}: {e}"))?.len();
            if len != want.len {
                return Err(format!(
                    "region {id} is {len} bytes, the checkpoint recorded {}",
                    want.len
                ));
            }
            opened.push((id, path, file, direct, len));
        }
        if opened.len() != wanted.len() {
            return Err(format!(
                "{} of the checkpoint's {} regions are in the directory",
                opened.len(),
                wanted.len()
            ));
        }
        let mut regions = self.regions.write().unwrap();
        for (id, path, file, direct, len) in opened {
            report.regions += 1;
            if !direct {
                report.buffered_regions += 1;
            }
            self.used.fetch_add(len, Ordering::AcqRel);
            let bounded = self.bounds_reads_of(&file);
            let region = Region::new(id, file, path, len, direct, &self.engine, bounded);
            regions.insert(id, Arc::new(region));
        }
        drop(regions);
        let next = newest.map_or(0, |n| n.saturating_add(1));
        let next = head.map_or(next, |h| next.max(h.saturating_add(1)));
        self.writer.lock().unwrap().next_region = next;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::recovery::RecoveryChecks;
    use super::super::test_log::{put, TestLog};
    use super::*;

    /// A log of three regions, written and closed; what a checkpoint of
    /// it would record.
    fn closed_log() -> (TestLog, Vec<RecordedRegion>) {
        let log = TestLog::new(64 << 10);
        let (tier, _, _) = log.open(RecoveryChecks::default());
        for i in 0..3u8 {
            log.write(&tier, &[put(&[b'k', i], u64::from(i) + 1, 40 << 10, i)])
                .unwrap();
        }
        let recorded = tier
            .own_regions()
            .into_iter()
            .map(|(id, incarnation, len)| RecordedRegion {
                id,
                incarnation,
                len,
            })
            .collect();
        (log, recorded)
    }

    fn checks(recorded: &[RecordedRegion]) -> RecoveryChecks {
        RecoveryChecks {
            recorded: Some(recorded.into()),
            ..RecoveryChecks::default()
        }
    }

    #[test]
    fn an_exact_match_opens_every_region_without_reading_a_record() {
        let (log, recorded) = closed_log();
        assert_eq!(recorded.len(), 3);
        let (tier, applied, report) = log.open(checks(&recorded));
        assert!(report.from_checkpoint, "{report:?}");
        assert!(applied.is_empty(), "no record is read");
        assert_eq!(report.regions, 3);
        assert_eq!(tier.own_regions().len(), 3);
        // The next region follows the newest.
        assert_eq!(
            tier.next_region_id(),
            recorded.iter().map(|r| r.id).max().unwrap() + 1
        );
    }

    #[test]
    fn any_difference_reads_every_record_instead() {
        let (log, recorded) = closed_log();
        let files = log.region_files();
        let mut cases: Vec<(&str, Vec<RecordedRegion>)> = Vec::new();
        let mut grown = recorded.clone();
        grown[1].len -= 4096;
        cases.push(("a region longer than recorded", grown));
        cases.push(("a region the checkpoint lacks", recorded[1..].to_vec()));
        let mut extra = recorded.clone();
        extra.push(RecordedRegion {
            id: recorded[2].id + 1,
            ..recorded[2]
        });
        cases.push(("a recorded region that is gone", extra));
        let mut other = recorded.clone();
        other[0].incarnation ^= 1;
        cases.push(("another incarnation", other));
        let mut gap = recorded.clone();
        gap.remove(1);
        cases.push(("a gap", gap));
        for (what, recorded) in cases {
            let (_tier, applied, report) = log.open(checks(&recorded));
            assert!(!report.from_checkpoint, "{what}: {report:?}");
            assert_eq!(applied.len(), 3, "{what}: every record is read");
        }
        // A region replaced by something that is not a regular file.
        let (_, path) = &files[0];
        let saved = path.with_extension("saved");
        std::fs::rename(path, &saved).unwrap();
        std::fs::create_dir(path).unwrap();
        let (_tier, applied, report) = log.open(checks(&recorded));
        assert!(!report.from_checkpoint, "{report:?}");
        assert_eq!(applied.len(), 2, "the two regions left are read");
    }

    #[test]
    fn a_head_past_the_newest_recorded_region_reads_every_record() {
        let (log, recorded) = closed_log();
        let newest = log.region_files().pop().unwrap().1;
        // The newest region gone, and the checkpoint without it: the log
        // head still names it, so its removals may be lost.
        std::fs::remove_file(newest).unwrap();
        let (_tier, _applied, report) = log.open(checks(&recorded[..2]));
        assert!(!report.from_checkpoint, "{report:?}");
        assert!(report.regions_behind_gap > 0, "{report:?}");
    }
}
