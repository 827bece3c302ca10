//! The data directory's lock file: one process opens a directory at a time.

use crate::error::{Error, ErrorKind, Result};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
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
        // SAFETY: flock on a file descriptor we own.
        let rc = unsafe { libc::flock(dir.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
                let holder = std::fs::read_to_string(data_dir.join(LOCK_FILE)).unwrap_or_default();
                let holder = holder.trim();
                let holder = if holder.is_empty() { "unknown" } else { holder };
                return Err(Error::new(
                    ErrorKind::Locked,
                    format!(
                        "data directory {} is in use by another process (pid {holder}, per {})",
                        data_dir.display(),
                        data_dir.join(LOCK_FILE).display()
                    ),
                ));
            }
            return Err(Error::io(format!("locking {}", data_dir.display()), err));
        }
        let path = data_dir.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
        // SAFETY: flock on a file descriptor we own.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = holder.trim();
                let holder = if holder.is_empty() { "unknown" } else { holder };
                return Err(Error::new(
                    ErrorKind::Locked,
                    format!(
                        "data directory {} is in use by another process (pid {holder}, per {})",
                        data_dir.display(),
                        path.display()
                    ),
                ));
            }
            return Err(Error::io(format!("locking {}", path.display()), err));
        }
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
