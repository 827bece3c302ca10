//! The data directory's lock: one process opens a directory at a time.

use crate::error::{Error, ErrorKind, Result};
use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
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
    dir: File,
    _file: File,
    _live: LiveLock,
}

/// The locks this process's stores hold now, by (device, inode) of the
/// locked file or directory. A lock held under this process's own pid
/// that is not in here belongs to a store this process already closed:
/// its io_uring rings drop their reference to the directory
/// asynchronously, a moment after the close, and a child being spawned
/// holds a copy of every descriptor from its fork until its exec closes
/// them (the `flock` lives on that copy meanwhile).
static LIVE: std::sync::Mutex<Vec<(u64, u64)>> = std::sync::Mutex::new(Vec::new());

/// How long an opener waits for a lock whose holder has exited (its
/// io_uring writes may still be landing, see `IoEngine::hold_until_idle`)
/// or was a store this process closed (its rings, or a child between fork
/// and exec, let go of the lock a moment later).
const DEAD_HOLDER_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Marks the lock on a file or directory as held by a live store of this
/// process until dropped (see `LIVE`).
#[derive(Debug)]
pub(crate) struct LiveLock {
    id: (u64, u64),
}

impl LiveLock {
    pub(crate) fn register(id: (u64, u64)) -> Self {
        LIVE.lock().unwrap().push(id);
        LiveLock { id }
    }
}

impl Drop for LiveLock {
    fn drop(&mut self) {
        let mut live = LIVE.lock().unwrap();
        if let Some(i) = live.iter().position(|&id| id == self.id) {
            live.swap_remove(i);
        }
    }
}

/// (device, inode) of an open file or directory.
pub(crate) fn file_id(file: &File) -> std::io::Result<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let meta = file.metadata()?;
    Ok((meta.dev(), meta.ino()))
}

/// Whether process `pid` of this host has let go of the lock `id`: it
/// exited, or it is this process and none of its stores holds the lock
/// now (what still holds it goes away by itself: see `LIVE`).
pub(crate) fn pid_has_let_go(pid: i32, id: (u64, u64)) -> bool {
    if pid <= 0 {
        return false;
    }
    if pid as u32 == std::process::id() {
        return !LIVE.lock().unwrap().contains(&id);
    }
    // Signal 0 only checks that the process exists.
    rustix::process::Pid::from_raw(pid)
        .is_some_and(|pid| rustix::process::test_kill_process(pid) == Err(rustix::io::Errno::SRCH))
}

/// The most of a holder line read back (`LOCK` files are one short line;
/// a damaged or planted one is not read whole).
const MAX_HOLDER_LINE: u64 = 256;

/// The holder line of lock file `path` (empty if unreadable), at most
/// `MAX_HOLDER_LINE` bytes.
pub(crate) fn read_holder(path: &Path) -> String {
    use std::io::Read;
    let mut line = Vec::new();
    let _ = File::open(path).and_then(|f| f.take(MAX_HOLDER_LINE).read_to_end(&mut line));
    String::from_utf8_lossy(&line).into_owned()
}

/// `flock(LOCK_EX | LOCK_NB)` on `file`.
pub(crate) fn flock_exclusive(file: &File) -> std::io::Result<()> {
    rustix::fs::flock(file, rustix::fs::FlockOperation::NonBlockingLockExclusive)
        .map_err(std::io::Error::from)
}

/// Locks `file` (which is `what`) like `flock_exclusive`, trying again
/// every 10 ms, up to `DEAD_HOLDER_WAIT` with one warning, while it is
/// held and `holder_let_go` says the holder has let go (see `LIVE`: what
/// still holds the lock then goes away by itself). Returns the last
/// `flock` error otherwise.
pub(crate) fn flock_waiting_for_let_go(
    file: &File,
    what: &Path,
    holder_let_go: impl Fn() -> bool,
) -> std::io::Result<()> {
    let deadline = std::time::Instant::now() + DEAD_HOLDER_WAIT;
    let mut waited = false;
    loop {
        match flock_exclusive(file) {
            Err(e)
                if e.raw_os_error() == Some(libc::EWOULDBLOCK)
                    && holder_let_go()
                    && std::time::Instant::now() < deadline =>
            {
                if !waited {
                    waited = true;
                    tracing::warn!(path = %what.display(), "the lock's last holder has exited or closed its store, but the lock is still held (its io_uring rings, or a child process between fork and exec); waiting for it");
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            result => return result,
        }
    }
}

impl DirLock {
    pub fn acquire(data_dir: &Path) -> Result<Self> {
        let dir = File::open(data_dir)
            .map_err(|e| Error::io(format!("opening {}", data_dir.display()), e))?;
        let id =
            file_id(&dir).map_err(|e| Error::io(format!("reading {}", data_dir.display()), e))?;
        flock_waiting_for_let_go(&dir, data_dir, || holder_has_let_go(data_dir, id))
            .map_err(|e| refusal(e, data_dir, data_dir))?;
        let path = data_dir.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(crate::private::FILE_MODE)
            .open(&path)
            .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
        // The same wait as for the directory: on a FUSE mount a lock this
        // process let go of is released by the daemon after `close`
        // returns, so a store reopened at once may find it still held.
        flock_waiting_for_let_go(&file, &path, || holder_has_let_go(data_dir, id))
            .map_err(|e| refusal(e, &path, data_dir))?;
        let pid = std::process::id().to_string();
        file.set_len(0)
            .and_then(|()| file.seek(SeekFrom::Start(0)).map(|_| ()))
            .and_then(|()| file.write_all(pid.as_bytes()))
            .map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
        Ok(DirLock {
            dir,
            _file: file,
            _live: LiveLock::register(id),
        })
    }

    /// The locked directory's descriptor (what the io engine holds while
    /// its transfers may run).
    pub fn dir_file(&self) -> &File {
        &self.dir
    }
}

/// Whether the pid `LOCK` names has let go of the directory: a process
/// that exited (it leaves its pid there), or this process when none of its
/// stores holds the directory now.
fn holder_has_let_go(data_dir: &Path, id: (u64, u64)) -> bool {
    read_holder(&data_dir.join(LOCK_FILE))
        .trim()
        .parse::<i32>()
        .is_ok_and(|pid| pid_has_let_go(pid, id))
}

/// The error for a failed `flock` of `path` (in `data_dir`): held by
/// another, a `Locked` error naming the holder's pid as `LOCK` says it.
fn refusal(err: std::io::Error, path: &Path, data_dir: &Path) -> Error {
    if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
        return Error::io(format!("locking {}", path.display()), err);
    }
    let lock_file = data_dir.join(LOCK_FILE);
    let holder = read_holder(&lock_file);
    let holder = holder.trim();
    let holder = if holder.is_empty() { "unknown" } else { holder };
    Error::new(
        ErrorKind::Locked,
        format!(
            "data directory {} is in use by another process (pid {holder}, per {})",
            data_dir.display(),
            lock_file.display()
        ),
    )
}
