//! The data directory's lock: one process opens a directory at a time.

use crate::error::{Error, ErrorKind, Result};
use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::os::unix::io::AsRawFd;
use std::path::Path;

pub const LOCK_FILE: &str = "LOCK";

/// Holds an exclusive `flock` on the data directory itself and on
/// `<data_dir>/LOCK` until dropped. The lock on the directory is the one
/// that counts: deleting `LOCK` (and so letting a second process lock a
/// new file of that name) does not let a second store in. `LOCK` names
/// the holder's pid for the error message. The locks die with the
/// process, so a killed store never leaves a stale lock.
#[derive(Debug)]
pub struct DirLock {
    _dir: File,
    _file: File,
}

impl DirLock {
    pub fn acquire(data_dir: &Path) -> Result<Self> {
        let dir = File::open(data_dir)
            .map_err(|e| Error::io(format!("opening {}", data_dir.display()), e))?;
        lock_exclusive(&dir, data_dir, data_dir)?;
        let path = data_dir.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
        lock_exclusive(&file, &path, data_dir)?;
        let pid = std::process::id().to_string();
        file.set_len(0)
            .and_then(|()| file.seek(SeekFrom::Start(0)).map(|_| ()))
            .and_then(|()| file.write_all(pid.as_bytes()))
            .map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
        Ok(DirLock {
            _dir: dir,
            _file: file,
        })
    }
}

/// Takes `flock(LOCK_EX | LOCK_NB)` on `file` (which is `path`); if another
/// holds it, a `Locked` error naming the holder's pid as `LOCK` says it.
fn lock_exclusive(file: &File, path: &Path, data_dir: &Path) -> Result<()> {
    // SAFETY: flock on a file descriptor we own.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
        return Err(Error::io(format!("locking {}", path.display()), err));
    }
    let lock_file = data_dir.join(LOCK_FILE);
    let holder = std::fs::read_to_string(&lock_file).unwrap_or_default();
    let holder = holder.trim();
    let holder = if holder.is_empty() { "unknown" } else { holder };
    Err(Error::new(
        ErrorKind::Locked,
        format!(
            "data directory {} is in use by another process (pid {holder}, per {})",
            data_dir.display(),
            lock_file.display()
        ),
    ))
}
