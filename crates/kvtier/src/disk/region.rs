//! One region file of the log, open: its descriptor (registered with the
//! I/O engine while open), whether it is read O_DIRECT, the bytes written,
//! and whether its reads are bounded by the storage deadline.

use super::format::REGION_HEADER_LEN;
use super::DiskTier;
use crate::error::{Error, Result};
use crate::io::IoEngine;
use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

#[derive(Debug)]
pub struct Region {
    pub id: u32,
    pub file: File,
    path: PathBuf,
    /// Whether this file was opened with O_DIRECT: decided per file, since
    /// one file (moved to another file system and linked back, say) may
    /// refuse it while the others keep it.
    direct: bool,
    /// Bytes of the file in use (header plus every batch written).
    pub(super) len: AtomicU64,
    /// Told when the file opens and before it closes (registered files).
    engine: Arc<dyn IoEngine>,
    /// Whether reads of this file are bounded by the storage deadline
    /// (`deadline`): decided per file from its file system.
    bounded: bool,
}

impl Drop for Region {
    fn drop(&mut self) {
        self.engine.unregister_file(&self.file);
    }
}

impl Region {
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub(super) fn new(
        id: u32,
        file: File,
        path: PathBuf,
        len: u64,
        direct: bool,
        engine: &Arc<dyn IoEngine>,
        bounded: bool,
    ) -> Region {
        engine.register_file(&file);
        Region {
            id,
            file,
            path,
            direct,
            len: AtomicU64::new(len),
            engine: Arc::clone(engine),
            bounded,
        }
    }

    /// Whether reads of this file are bounded by the storage deadline.
    pub fn bounded(&self) -> bool {
        self.bounded
    }

    pub fn len(&self) -> u64 {
        self.len.load(Ordering::Acquire)
    }

    /// Whether reads of this file must be O_DIRECT-aligned.
    pub fn direct_io(&self) -> bool {
        self.direct
    }

    pub fn is_empty(&self) -> bool {
        self.len() <= REGION_HEADER_LEN
    }
}

impl DiskTier {
    /// Opens a region file, with O_DIRECT unless its file system refuses
    /// it; returns whether it did. Only a new file (on the directory's own
    /// file system) turns O_DIRECT off for the files that follow; an
    /// existing file that refuses it is read buffered on its own.
    pub(super) fn open_file(&self, path: &Path, create: bool) -> Result<(File, bool)> {
        let mut options = OpenOptions::new();
        options.read(true).write(true);
        if create {
            options.create_new(true).mode(crate::private::FILE_MODE);
        }
        if self.direct_io.load(Ordering::Relaxed) {
            let mut direct = options.clone();
            direct.custom_flags(libc::O_DIRECT);
            match direct.open(path) {
                Ok(file) => return Ok((file, true)),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    if create {
                        tracing::warn!(dir = %self.dir.display(), "the file system refuses O_DIRECT; using buffered I/O");
                        self.direct_io.store(false, Ordering::Relaxed);
                        // The failed attempt may have created the file.
                        let _ = fs::remove_file(path);
                    } else {
                        tracing::warn!(path = %path.display(), "this region file refuses O_DIRECT; reading it buffered");
                    }
                }
                Err(e) => return Err(Error::io(format!("opening {}", path.display()), e)),
            }
        }
        options
            .open(path)
            .map(|file| (file, false))
            .map_err(|e| Error::io(format!("opening {}", path.display()), e))
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_log::{put, TestLog};
    use super::super::RecoveryChecks;

    #[test]
    fn a_region_counts_what_is_written_to_it() {
        let log = TestLog::new(1 << 20);
        let (tier, _, _) = log.open(RecoveryChecks::default());
        log.write(&tier, &[put(b"a", 1, 100, 1)]).unwrap();
        let region = tier.region(0).unwrap();
        assert!(!region.is_empty());
        assert_eq!(region.len(), 3 * 4096, "header, record, value");
        assert_eq!(
            region.len(),
            std::fs::metadata(region.path()).unwrap().len()
        );
        assert!(
            !region.bounded(),
            "no storage deadline on a local disk by default"
        );
    }

    #[test]
    fn opening_a_missing_region_names_the_file() {
        let log = TestLog::new(1 << 20);
        let (tier, _, _) = log.open(RecoveryChecks::default());
        let missing = log.regions_dir().join("00000003.kvr");
        let err = tier.open_file(&missing, false).unwrap_err();
        assert!(err.to_string().contains("00000003.kvr"), "{err}");
        // A new file is created private, and never over an existing one.
        let (_, _) = tier.open_file(&missing, true).unwrap();
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&missing).unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "{mode:o}");
        assert!(tier.open_file(&missing, true).is_err());
    }
}
