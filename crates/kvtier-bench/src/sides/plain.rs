//! A plain program's reads of the store's values through a mount: one
//! buffered `pread` per value (the kernel's readahead and page cache do
//! the rest), into the caller's memory, nothing verified. The shared
//! cases' baseline: the best a program that knows where each value lies
//! gets from the same file system, cold (its page cache copies dropped
//! first, `drop_cached`) and warm.

use kvtier::DiskLocation;
use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Buffered handles of the files that hold `at`'s values.
#[derive(Debug)]
pub struct PlainReader {
    files: HashMap<PathBuf, File>,
    at: Vec<DiskLocation>,
    batch: usize,
}

impl PlainReader {
    /// Opens every file holding a value of `at` (values `batch` to a
    /// batch, in order).
    pub fn new(at: Vec<DiskLocation>, batch: usize) -> std::io::Result<PlainReader> {
        let mut files = HashMap::new();
        for loc in &at {
            if !files.contains_key(&loc.path) {
                files.insert(loc.path.clone(), File::open(&loc.path)?);
            }
        }
        Ok(PlainReader { files, at, batch })
    }

    fn batch_values(&self, b: u64) -> &[DiskLocation] {
        let start = (b as usize * self.batch).min(self.at.len());
        let end = (start + self.batch).min(self.at.len());
        &self.at[start..end]
    }

    /// Drops the page cache's copies of batch `b`'s values, so the next
    /// read of them asks the file system (`posix_fadvise(DONTNEED)`: no
    /// privilege needed, clean pages only, which these are).
    pub fn drop_cached(&self, b: u64) {
        use std::os::fd::AsRawFd;
        for loc in self.batch_values(b) {
            let file = &self.files[&loc.path];
            // SAFETY: a hint on a descriptor this reader owns.
            unsafe {
                libc::posix_fadvise(
                    file.as_raw_fd(),
                    loc.offset as libc::off_t,
                    loc.len as libc::off_t,
                    libc::POSIX_FADV_DONTNEED,
                );
            }
        }
    }

    /// Reads batch `b`'s values one after another into `host` (a slot of
    /// `slot` bytes each); returns the time and the bytes read.
    pub fn read_batch(
        &self,
        b: u64,
        host: &mut [u8],
        slot: usize,
    ) -> Result<(Duration, u64), String> {
        let started = Instant::now();
        let mut bytes = 0u64;
        for (loc, dest) in self.batch_values(b).iter().zip(host.chunks_mut(slot)) {
            let dest = &mut dest[..loc.len as usize];
            self.files[&loc.path]
                .read_exact_at(dest, loc.offset)
                .map_err(|e| format!("reading {}: {e}", loc.path.display()))?;
            bytes += loc.len as u64;
        }
        Ok((started.elapsed(), bytes))
    }
}
