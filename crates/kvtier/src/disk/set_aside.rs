//! Which file recovery reads for a region id, and what it cannot use: set
//! aside, never deleted on its own judgement, but moved to `quarantine/`
//! beside `regions/` with a note of why (kept for inspection), or left in
//! place with an error when even that fails. A set-aside region that was a member of the log leaves an empty
//! region under its name, so the log's ids stay contiguous.

use super::format::{RegionHeader, REGION_HEADER_LEN};
use super::recovery_report::RecoveryReport;
use super::{sync_dir, DiskTier, QUARANTINE_DIR};
use crate::error::{Error, Result};
use crate::io::AlignedBuf;
use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

impl DiskTier {
    /// Opens the file that holds region `id` (several names for one id keep
    /// the longest; the others are set aside). Anything that is not a
    /// regular file after following links, or cannot be opened, is set
    /// aside or skipped with a warning instead of refusing the whole open.
    pub(super) fn open_candidate(
        &self,
        id: u32,
        paths: Vec<PathBuf>,
        report: &mut RecoveryReport,
    ) -> Result<Option<(PathBuf, File, bool, u64)>> {
        let mut opened: Vec<(PathBuf, File, bool, u64)> = Vec::new();
        for path in paths {
            match fs::metadata(&path) {
                Ok(meta) if meta.is_file() => {}
                Ok(_) => {
                    self.set_aside(&path, "not a regular file", report);
                    continue;
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    // A dangling symlink (or gone since the listing).
                    if fs::symlink_metadata(&path).is_ok() {
                        self.set_aside(&path, "a link to nothing", report);
                    }
                    continue;
                }
                Err(e) => {
                    self.set_aside(&path, &format!("cannot be examined: {e}"), report);
                    continue;
                }
            }
            match self.open_file(&path, false) {
                Ok((file, direct)) => {
                    let len = match file.metadata() {
                        Ok(meta) if meta.is_file() => meta.len(),
                        // Replaced between the check and the open.
                        _ => {
                            self.set_aside(&path, "not a regular file", report);
                            continue;
                        }
                    };
                    opened.push((path, file, direct, len));
                }
                Err(e) => {
                    report.skipped_files += 1;
                    tracing::error!(region = id, path = %path.display(), error = %e, "cannot open a region file; skipped (its entries are not indexed)");
                }
            }
        }
        // A copy under a name its writer did not give it verifies nothing
        // (records are bound to the name's writer and open), so a file
        // whose first record verifies comes first; of those, the longest
        // copy holds every batch a shorter copy of the same log holds. The
        // others are kept for inspection.
        let mut opened: Vec<_> = if opened.len() > 1 {
            opened
                .into_iter()
                .map(|c| (self.first_batch_verifies(&c.0, &c.1, id, c.3), c))
                .collect()
        } else {
            opened.into_iter().map(|c| (true, c)).collect()
        };
        opened.sort_by(|(a_ok, a), (b_ok, b)| {
            b_ok.cmp(a_ok)
                .then_with(|| b.3.cmp(&a.3))
                .then_with(|| a.0.cmp(&b.0))
        });
        let mut opened = opened.into_iter().map(|(_, c)| c);
        let chosen = opened.next();
        for (path, file, _, _) in opened {
            drop(file);
            self.set_aside(
                &path,
                &format!("another file also claims region {id}"),
                report,
            );
        }
        Ok(chosen)
    }

    /// Whether the first batch of region file `path` (region `id`) verifies
    /// where it lies.
    fn first_batch_verifies(&self, path: &Path, file: &File, id: u32, len: u64) -> bool {
        let mut reader = super::scan::RegionReader::new(file, len);
        let mut verified = false;
        super::scan::first_batch(
            &mut reader,
            &self.own_origin(path, id),
            &self.secret,
            REGION_HEADER_LEN,
            |_| verified = true,
        );
        verified
    }

    /// Moves what recovery cannot use into quarantine, or leaves it in place
    /// with a warning if even that fails; never refuses the open for it.
    pub(super) fn set_aside(&self, path: &Path, reason: &str, report: &mut RecoveryReport) {
        match self.quarantine(path, reason) {
            Ok(moved) => {
                report.quarantined_regions += 1;
                tracing::error!(path = %path.display(), quarantined = %moved.display(), %reason, "moved a file recovery cannot use to quarantine");
            }
            Err(e) => {
                report.skipped_files += 1;
                tracing::error!(path = %path.display(), %reason, error = %e, "cannot use this file and cannot quarantine it either; skipped");
            }
        }
    }

    /// Sets aside a regular file that holds region `id` but nothing this
    /// store can read, and leaves an empty region (a fresh header, no
    /// batches) under its name: the log's ids stay contiguous, so the next
    /// recovery does not take the set-aside region for a missing one (and
    /// drop every older entry). The empty region is reclaimed in turn.
    pub(super) fn set_aside_region(
        &self,
        id: u32,
        path: &Path,
        reason: &str,
        member: bool,
        report: &mut RecoveryReport,
    ) {
        let before = report.quarantined_regions;
        self.set_aside(path, reason, report);
        if report.quarantined_regions == before || !member {
            return;
        }
        let mut page = AlignedBuf::zeroed(REGION_HEADER_LEN as usize);
        RegionHeader {
            region: id,
            first_seq: 0,
        }
        .encode(page.as_mut_slice());
        let written = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(crate::private::FILE_MODE)
            .open(path)
            .and_then(|mut file| {
                std::io::Write::write_all(&mut file, page.as_slice())?;
                file.sync_data()
            })
            .and_then(|()| sync_dir(&self.dir));
        if let Err(e) = written {
            tracing::warn!(path = %path.display(), error = %e, "could not leave an empty region in place of a quarantined one; the next open will see a gap in the log and not index older regions");
        }
    }

    /// Moves a region file into `<data_dir>/quarantine/`, named by its
    /// region file name and the time, and syncs both directories.
    pub(super) fn quarantine(&self, path: &Path, reason: &str) -> Result<PathBuf> {
        let dir = self.dir.parent().unwrap_or(&self.dir).join(QUARANTINE_DIR);
        crate::private::create_dir(&dir)
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        // Never over an earlier quarantined file: the first free suffix
        // (the directory is locked, so no one else picks names here).
        let free = |candidate: &Path| fs::symlink_metadata(candidate).is_err();
        let (target, why) = (0u32..)
            .map(|n| {
                let stem = if n == 0 {
                    format!("{name}.{stamp}")
                } else {
                    format!("{name}.{stamp}.{n}")
                };
                (dir.join(&stem), dir.join(format!("{stem}.why")))
            })
            .find(|(target, why)| free(target) && free(why))
            .expect("some suffix is free");
        fs::rename(path, &target)
            .map_err(|e| Error::io(format!("quarantining {} ({reason})", path.display()), e))?;
        fs::write(&why, format!("{reason}\n"))
            .map_err(|e| Error::io(format!("writing to {}", dir.display()), e))?;
        sync_dir(&self.dir)
            .and_then(|()| sync_dir(&dir))
            .map_err(|e| Error::io(format!("syncing {}", dir.display()), e))?;
        Ok(target)
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_log::TestLog;
    use super::super::RecoveryChecks;

    #[test]
    fn quarantine_never_overwrites_an_earlier_file() {
        let log = TestLog::new(1 << 20);
        let (tier, _, _) = log.open(RecoveryChecks::default());
        let path = log.regions_dir().join("00000009.kvr");
        let mut moved = Vec::new();
        for round in 0..3u8 {
            std::fs::write(&path, [round]).unwrap();
            moved.push(tier.quarantine(&path, "a test").unwrap());
        }
        moved.sort();
        moved.dedup();
        assert_eq!(moved.len(), 3);
        for target in &moved {
            let why = target.with_file_name(format!(
                "{}.why",
                target.file_name().unwrap().to_string_lossy()
            ));
            assert_eq!(std::fs::read_to_string(why).unwrap(), "a test\n");
        }
        let mut contents: Vec<u8> = moved.iter().map(|p| std::fs::read(p).unwrap()[0]).collect();
        contents.sort();
        assert_eq!(contents, vec![0, 1, 2]);
    }
}
