//! The shared directory's identity and layout (docs/design.md, "Shared
//! directory"): one format line and one `key-secret` for every node, and
//! a writer directory per node, which only that node writes.
//!
//! Nodes may start at the same moment on an empty directory, from hosts
//! that share nothing but the file system, so every identity file is
//! written to a private temporary name and hard-linked into place: a link
//! either creates the name whole or fails because another node's file is
//! already there, in which case this node reads and uses that one. No
//! node ever replaces an identity file another node may have read.

use crate::data_dir::{self, KEY_CHECK_FILE, KEY_SECRET_FILE};
use crate::error::{Error, ErrorKind, Result};
use crate::key::KeySecret;
use crate::lock::{
    file_id, flock_exclusive, flock_waiting_for_let_go, pid_has_let_go, read_holder, LiveLock,
};
use crate::private::FILE_MODE;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// The format this build writes and reads: 2, whose batch records carry a
/// MAC binding them to their writer. Format 1's records bind nothing, so
/// anyone who could write the directory could change a value and fix up
/// every checksum; a format-1 directory is refused (a cache: start on a
/// new one), never read.
pub const SHARED_DIR_FORMAT: u32 = 2;
const FORMAT_PREFIX: &str = "kvtier shared directory format ";
pub const FORMAT_FILE: &str = "FORMAT";
/// Holds one directory per writer, named by its node id.
pub const NODES_DIR: &str = "nodes";
/// In a writer directory: held with `flock` by the writing process.
pub const WRITER_LOCK_FILE: &str = "LOCK";

/// An opened shared directory: the secret every node keys digests with,
/// and this node's writer directory, locked.
#[derive(Debug)]
pub struct SharedDir {
    pub root: PathBuf,
    /// `root/nodes/<node id>`: this node's log (regions, head, quarantine).
    pub writer_dir: PathBuf,
    /// Held for the store's life: a second process with the same node id
    /// (a copied data directory) must not write this log too.
    _writer_lock: Option<Arc<WriterLock>>,
}

/// The writer directory's `flock`ed lock file, registered as held by a
/// live store of this process (`crate::lock::LiveLock`).
///
/// A `flock` locks an inode, not a name: once `LOCK` is unlinked (an
/// operator clearing a "stale" lock, a collector), a second process would
/// create and lock a new file of that name and write this log too. So the
/// lock is checked before every batch this node writes
/// (`WriterLock::check`): a `LOCK` gone from a directory that is still
/// there is created again and locked (healed); a `LOCK` that is now another
/// file, or a writer directory that vanished, stops this node's writes for
/// good with a clear error.
#[derive(Debug)]
pub struct WriterLock {
    path: PathBuf,
    /// What this holder writes into the file (`holder_line`).
    holder: Holder,
    state: Mutex<LockState>,
}

/// Who takes a writer directory's lock: its own writer, or a collector
/// adopting a dead writer's log (`shared::gc`). The lock file names which
/// (`pid N on HOST`, `collector pid N on HOST`), so that a writer starting
/// while a collector holds its lock waits for the collection to end
/// instead of being refused as if a second writer ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holder {
    Writer,
    Collector,
}

/// How long a starting writer waits for a collector that holds its lock
/// (collecting a log reads its records and deletes its files: seconds,
/// not minutes); past it, the start is refused with a clear error.
const COLLECTOR_WAIT: std::time::Duration = std::time::Duration::from_secs(60);
/// How long a starting writer waits for the holder of its lock to name
/// itself (a lock file with no holder line: a holder between taking the
/// lock and writing its line) before refusing it as a second writer.
const UNNAMED_HOLDER_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

#[derive(Debug)]
struct LockState {
    /// The lock files this node holds, as (device, inode): the one it
    /// opened with, then any it created again after an unlink.
    held: Vec<(File, (u64, u64), LiveLock)>,
    /// Why this node stopped writing (once set, for good).
    lost: Option<String>,
}

impl WriterLock {
    /// Whether this node still holds the writer lock of its log (healing
    /// an unlinked `LOCK`); an error means nothing more may be written.
    pub fn check(&self) -> Result<()> {
        let mut state = self.state.lock().unwrap();
        if let Some(why) = &state.lost {
            return Err(Error::new(ErrorKind::Locked, why.clone()));
        }
        let linked = match fs::symlink_metadata(&self.path) {
            Ok(meta) => Some((meta.dev(), meta.ino())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(Error::io(format!("checking {}", self.path.display()), e)),
        };
        if let Some(id) = linked {
            if state.held.iter().any(|(_, held, _)| *held == id) {
                return Ok(());
            }
            let why = format!(
                "{} is no longer the lock file this node holds (it was deleted and another \
                 process created its own): another store may be writing this node's log. \
                 This node stops writing it; stop the other process (two data directories \
                 with one node id?) and restart this one",
                self.path.display()
            );
            tracing::error!("{why}");
            state.lost = Some(why.clone());
            return Err(Error::new(ErrorKind::Locked, why));
        }
        let dir = self.path.parent().unwrap_or(&self.path);
        if !dir.is_dir() {
            let why = format!(
                "this node's writer directory {} vanished (a collector took it for a dead \
                 writer's, or it was deleted): this node stops writing its log; restart it",
                dir.display()
            );
            tracing::error!("{why}");
            state.lost = Some(why.clone());
            return Err(Error::new(ErrorKind::Locked, why));
        }
        // Unlinked while this node holds it: take the name back before
        // anyone else can.
        let healed = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(FILE_MODE)
            .open(&self.path)
            .and_then(|file| {
                flock_exclusive(&file)?;
                let id = file_id(&file)?;
                let mut writer = &file;
                let _ = writer.write_all(holder_line(self.holder).as_bytes());
                Ok((file, id))
            });
        match healed {
            Ok((file, id)) => {
                tracing::warn!(path = %self.path.display(), "the writer lock file was deleted while this node held it; created and locked it again");
                state.held.push((file, id, LiveLock::register(id)));
                Ok(())
            }
            Err(e) => {
                let why = format!(
                    "{} was deleted while this node held it and could not be taken back \
                     ({e}): another process may be writing this node's log. This node stops \
                     writing it; restart it once the other is gone",
                    self.path.display()
                );
                tracing::error!("{why}");
                state.lost = Some(why.clone());
                Err(Error::new(ErrorKind::Locked, why))
            }
        }
    }
}

/// The line a writer lock's holder writes into it.
fn holder_line(holder: Holder) -> String {
    let pid_on_host = format!("pid {} on {}\n", std::process::id(), host_name());
    match holder {
        Holder::Writer => pid_on_host,
        Holder::Collector => format!("{COLLECTOR_PREFIX}{pid_on_host}"),
    }
}

const COLLECTOR_PREFIX: &str = "collector ";

impl SharedDir {
    /// Opens (creating what is missing) the shared directory `root` for
    /// node `node_id`; returns it with the secret every node keys digests
    /// with.
    #[cfg(test)]
    pub fn open(root: &Path, node_id: &str) -> Result<(SharedDir, KeySecret)> {
        Self::open_as(root, node_id, Holder::Writer)
    }

    /// [`SharedDir::open`] by `holder`: a collector adopting node
    /// `node_id`'s log takes its lock as a collector.
    pub fn open_as(root: &Path, node_id: &str, holder: Holder) -> Result<(SharedDir, KeySecret)> {
        crate::private::create_dir(root)
            .map_err(|e| Error::io(format!("creating shared directory {}", root.display()), e))?;
        let tightened = crate::private::check_dir(root)
            .map_err(|e| Error::io(format!("checking shared directory {}", root.display()), e))?;
        if tightened {
            tracing::warn!(dir = %root.display(), "the shared directory was readable by other users; made it private (mode 700)");
        }
        let secret = settle_identity(root, node_id)?;
        let nodes = root.join(NODES_DIR);
        let writer_dir = nodes.join(node_id);
        let writer_lock = lock_writer(&writer_dir, holder)?.map(Arc::new);
        let shared = SharedDir {
            root: root.to_path_buf(),
            writer_dir,
            _writer_lock: writer_lock,
        };
        Ok((shared, secret))
    }

    /// This node's writer lock, to check before each write (`None` on a
    /// file system without `flock`).
    pub fn writer_lock(&self) -> Option<Arc<WriterLock>> {
        self._writer_lock.clone()
    }

    /// Every writer directory but `own`: (node id, path). Names that are
    /// not node ids are ignored.
    pub fn other_writers(root: &Path, own: &str) -> std::io::Result<Vec<(String, PathBuf)>> {
        let mut out = Vec::new();
        for item in fs::read_dir(root.join(NODES_DIR))? {
            let item = item?;
            let name = item.file_name().to_string_lossy().into_owned();
            if name != own && data_dir::is_node_id(&name) {
                out.push((name, item.path()));
            }
        }
        out.sort();
        Ok(out)
    }
}

/// Reads the shared directory's format and secret, creating them if this
/// node is the first; every node ends up with the one secret that won.
fn settle_identity(root: &Path, node_id: &str) -> Result<KeySecret> {
    let format = format!("{FORMAT_PREFIX}{SHARED_DIR_FORMAT}\n");
    let format_path = root.join(FORMAT_FILE);
    match fs::read_to_string(&format_path) {
        Ok(text) => check_format(root, &text)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            // A directory that holds writers' logs had an identity: minting
            // a fresh one over it would make every node set its whole log
            // aside as keyed with another secret. (Racing first nodes link
            // the secret before anything else, and before any log exists,
            // so a log without a secret is never theirs.)
            if !root.join(KEY_SECRET_FILE).exists() {
                if let Some(region) = some_writer_region(root) {
                    return Err(Error::new(
                        ErrorKind::Corruption,
                        format!(
                            "{} has no {FORMAT_FILE} and no {KEY_SECRET_FILE}, but holds \
                             writers' logs ({}): its identity was deleted. Restore {FORMAT_FILE}, \
                             {KEY_SECRET_FILE} and {KEY_CHECK_FILE} from a backup; a fresh \
                             identity would make every log unreadable (nothing was changed)",
                            root.display(),
                            region.display()
                        ),
                    ));
                }
            }
            // First node (or racing first nodes): the secret first, so a
            // format line always names a directory that has one.
            let fresh = KeySecret::generate()?;
            link_into_place(root, KEY_SECRET_FILE, fresh.as_bytes(), node_id)?;
            let secret = data_dir::read_secret(root)?;
            let check = format!("{}\n", secret.check_value());
            link_into_place(root, KEY_CHECK_FILE, check.as_bytes(), node_id)?;
            link_into_place(root, FORMAT_FILE, format.as_bytes(), node_id)?;
            create_nodes_dir(root)?;
            data_dir::sync_dir(root)?;
            let text = fs::read_to_string(&format_path)
                .map_err(|e| Error::io(format!("reading {}", format_path.display()), e))?;
            check_format(root, &text)?;
        }
        Err(e) => return Err(Error::io(format!("reading {}", format_path.display()), e)),
    }
    let secret = data_dir::read_secret(root)?;
    let check_path = root.join(KEY_CHECK_FILE);
    let check = fs::read_to_string(&check_path)
        .map_err(|e| Error::io(format!("reading {}", check_path.display()), e))?;
    if check.trim() != secret.check_value() {
        return Err(Error::new(
            ErrorKind::Corruption,
            format!(
                "{} does not match {}: the shared key-secret is damaged or was replaced, and \
                 no node's blocks would verify. Restore it (nothing was changed)",
                check_path.display(),
                root.join(KEY_SECRET_FILE).display()
            ),
        ));
    }
    create_nodes_dir(root)?;
    Ok(secret)
}

/// Creates `nodes/` private (0700, whatever the umask), and takes group and
/// other rights away from one an earlier release created with the umask.
fn create_nodes_dir(root: &Path) -> Result<()> {
    let nodes = root.join(NODES_DIR);
    crate::private::create_dir(&nodes)
        .map_err(|e| Error::io(format!("creating {}", nodes.display()), e))?;
    let tightened = crate::private::tighten_dir(&nodes)
        .map_err(|e| Error::io(format!("checking {}", nodes.display()), e))?;
    if tightened {
        tracing::warn!(dir = %nodes.display(), "the shared directory's nodes/ folder was open to other users; made it private (mode 700)");
    }
    Ok(())
}

/// A region file of some writer under `root`'s `nodes/`, if there is one
/// (a directory that held data). Unreadable folders count as holding none.
fn some_writer_region(root: &Path) -> Option<PathBuf> {
    let writers = fs::read_dir(root.join(NODES_DIR)).ok()?;
    for writer in writers.flatten() {
        let Ok(files) = fs::read_dir(writer.path().join(crate::disk::REGION_DIR)) else {
            continue;
        };
        for file in files.flatten() {
            if crate::disk::parse_region_name(&file.file_name().to_string_lossy()).is_some() {
                return Some(file.path());
            }
        }
    }
    None
}

fn check_format(root: &Path, text: &str) -> Result<()> {
    let version = text
        .trim()
        .strip_prefix(FORMAT_PREFIX.trim_end())
        .and_then(|v| v.trim().parse::<u32>().ok());
    match version {
        Some(SHARED_DIR_FORMAT) => Ok(()),
        Some(1) => Err(Error::invalid(format!(
            "{} is a kvtier shared directory of format 1, whose batch records are not bound to \
             their writer (anyone who can write the directory could change a value unseen); this \
             kvtier reads format {SHARED_DIR_FORMAT} only. Its blocks are a cache: stop every \
             node, move the directory aside (or delete it) and start them on an empty one",
            root.display()
        ))),
        Some(other) => Err(Error::invalid(format!(
            "{} is a kvtier shared directory of format {other}; this kvtier reads format \
             {SHARED_DIR_FORMAT} only",
            root.display()
        ))),
        None => Err(Error::new(
            ErrorKind::Corruption,
            format!(
                "{} is not a kvtier shared directory format file (expected \"{FORMAT_PREFIX}N\"); \
                 refusing to guess how to read {}",
                root.join(FORMAT_FILE).display(),
                root.display()
            ),
        )),
    }
}

/// Creates `root/name` holding `bytes` unless it exists: written and
/// synced under a name private to this node, then hard-linked (a link
/// never replaces an existing name, so of racing nodes exactly one wins).
fn link_into_place(root: &Path, name: &str, bytes: &[u8], node_id: &str) -> Result<()> {
    let tmp = root.join(format!(".{name}.{node_id}.tmp"));
    let _ = fs::remove_file(&tmp);
    let written = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(FILE_MODE)
        .open(&tmp)
        .and_then(|mut file| {
            file.write_all(bytes)?;
            file.sync_all()
        });
    if let Err(e) = written {
        let _ = fs::remove_file(&tmp);
        return Err(Error::io(format!("writing {}", tmp.display()), e));
    }
    let linked = fs::hard_link(&tmp, root.join(name));
    let _ = fs::remove_file(&tmp);
    match linked {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(Error::io(
            format!("linking {} into place", root.join(name).display()),
            e,
        )),
    }
}

/// `flock`s the writer directory's lock file. A file system without
/// `flock` (some NFS setups) is run without the lock, with a warning: the
/// node id in `data_dir` is then the only thing that keeps writers apart.
///
/// A lock whose holder (per the file's `pid N on HOST` line) is a process
/// of this host that has let go of it (it exited, or it is a store this
/// process closed: see `crate::lock::LiveLock`) is waited for, up to
/// 30 s (`crate::lock::flock_waiting_for_let_go`): what still holds it
/// then (a child between fork and exec, a closing ring) lets go by
/// itself. A holder on another host is refused at once, unless it is a
/// collector (`Holder::Collector`): a writer waits for it up to
/// `COLLECTOR_WAIT`, then takes the lock (making its directory again if
/// the collector removed it).
///
/// The lock is the file linked as `LOCK` when it is taken: a lock won on a
/// file a collector (or an operator) unlinked meanwhile locks nothing, so
/// the writer directory and `LOCK` are made again and the lock taken again.
fn lock_writer(writer_dir: &Path, holder: Holder) -> Result<Option<WriterLock>> {
    const ATTEMPTS: u32 = 8;
    let path = writer_dir.join(WRITER_LOCK_FILE);
    let started = std::time::Instant::now();
    let mut said_waiting = false;
    let mut attempts = 0;
    while attempts < ATTEMPTS {
        attempts += 1;
        crate::private::create_dir(writer_dir)
            .map_err(|e| Error::io(format!("creating {}", writer_dir.display()), e))?;
        let opened = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(FILE_MODE)
            .open(&path);
        let file = match opened {
            Ok(file) => file,
            // The directory went between its creation and the open.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(Error::io(format!("opening {}", path.display()), e)),
        };
        let id = file_id(&file).map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
        let locked = flock_waiting_for_let_go(&file, &path, || {
            holder_on_this_host_let_go(&read_holder(&path), id)
        });
        if let Err(e) = locked {
            let line = read_holder(&path);
            let collecting = line.starts_with(COLLECTOR_PREFIX);
            // A holder that has the lock but has not written its line yet
            // (or a file system that shows the write late) is waited for
            // briefly: it may be a collector, which is waited for.
            let unnamed = line.trim().is_empty() && started.elapsed() < UNNAMED_HOLDER_WAIT;
            if holder == Holder::Writer
                && e.raw_os_error() == Some(libc::EWOULDBLOCK)
                && (collecting || unnamed)
                && started.elapsed() < COLLECTOR_WAIT
            {
                if !said_waiting {
                    said_waiting = true;
                    tracing::warn!(path = %path.display(), holder = %read_holder(&path).trim(), "a collector is reclaiming this node's earlier log (it took this node for a dead writer); waiting for it to finish");
                }
                attempts -= 1;
                // The file stays open while this waits (a collector that
                // removes the directory meanwhile unlinks it under us).
                std::thread::sleep(std::time::Duration::from_millis(50));
                drop(file);
                continue;
            }
            return match e.raw_os_error() {
                Some(libc::EWOULDBLOCK) if collecting => Err(Error::new(
                    ErrorKind::Locked,
                    format!(
                        "{} is held by a collector ({}) reclaiming this node's earlier log, \
                         still after {} s (it took this node for a dead writer: raise \
                         --adopt-after or `kvtier shared gc --older-than`); start again once \
                         it is done",
                        path.display(),
                        read_holder(&path).trim(),
                        COLLECTOR_WAIT.as_secs()
                    ),
                )),
                Some(libc::EWOULDBLOCK) => Err(Error::new(
                    ErrorKind::Locked,
                    format!(
                        "{} is held by another process ({}): another store writes this node's \
                         log (two data directories with one node-id, copied?), or a collector \
                         is removing it. Give each node its own data directory",
                        path.display(),
                        read_holder(&path).trim()
                    ),
                )),
                Some(libc::ENOSYS | libc::EOPNOTSUPP | libc::ENOLCK) => {
                    tracing::warn!(path = %path.display(), error = %e, "the shared file system does not lock files; running without the writer lock (make sure no two nodes share a node id)");
                    Ok(None)
                }
                _ => Err(Error::io(format!("locking {}", path.display()), e)),
            };
        }
        let still_linked =
            fs::symlink_metadata(&path).is_ok_and(|meta| (meta.dev(), meta.ino()) == id);
        if !still_linked {
            continue;
        }
        // The line is written over the old one, then the file cut to it:
        // never empty in between, so a writer looking at it meanwhile sees
        // the last holder's line or this one's, never none (an empty line
        // once made a writer starting beside a collector refuse to start).
        let line = holder_line(holder);
        let _ = file
            .write_all_at(line.as_bytes(), 0)
            .and_then(|()| file.set_len(line.len() as u64));
        return Ok(Some(WriterLock {
            path,
            holder,
            state: Mutex::new(LockState {
                held: vec![(file, id, LiveLock::register(id))],
                lost: None,
            }),
        }));
    }
    Err(Error::new(
        ErrorKind::Locked,
        format!(
            "{} was unlinked under this node {ATTEMPTS} times while it took the lock (a \
             collector removing the writer directory?); try again",
            path.display()
        ),
    ))
}

/// Whether the holder line `pid N on HOST` names a process of this host
/// that has let go of the lock `id`.
fn holder_on_this_host_let_go(holder: &str, id: (u64, u64)) -> bool {
    let Some((pid, host)) = holder
        .trim()
        .strip_prefix("pid ")
        .and_then(|rest| rest.split_once(" on "))
    else {
        return false;
    };
    host == host_name() && pid.parse::<i32>().is_ok_and(|pid| pid_has_let_go(pid, id))
}

/// This host's name, for the lock holder's line.
fn host_name() -> String {
    let name = rustix::system::uname();
    let name = name.nodename().to_string_lossy();
    if name.is_empty() {
        "an unknown host".to_string()
    } else {
        name.into_owned()
    }
}

/// Whether a process holds the writer's lock now (the file opened as
/// hostile: regular files only, never blocking on a FIFO).
pub(crate) fn writer_lock_held(dir: &Path) -> bool {
    let mut options = fs::OpenOptions::new();
    options.read(true);
    let Ok(file) = crate::private::open_untrusted(&dir.join(WRITER_LOCK_FILE), &options, 0) else {
        return false;
    };
    // Released when the file closes at return.
    crate::lock::flock_exclusive(&file).is_err()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How many descriptors of this process have `path` open.
    fn open_count(path: &Path) -> usize {
        fs::read_dir("/proc/self/fd")
            .unwrap()
            .flatten()
            .filter(|fd| fs::read_link(fd.path()).is_ok_and(|target| target == path))
            .count()
    }

    /// A writer lock whose file is deleted under it takes the name back at
    /// its next check, so a second writer with the same node id is refused;
    /// one whose name another process took first stops for good.
    #[test]
    fn a_deleted_writer_lock_is_healed_or_stops_the_writer() {
        let dir = tempfile::tempdir().unwrap();
        let id = format!("{:032x}", 5);
        let (first, _) = SharedDir::open(dir.path(), &id).unwrap();
        let lock = first.writer_lock().unwrap();
        lock.check().unwrap();
        let path = first.writer_dir.join(WRITER_LOCK_FILE);
        fs::remove_file(&path).unwrap();
        lock.check().expect("healed");
        let e = SharedDir::open(dir.path(), &id).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Locked, "{e}");

        // Deleted, and taken by a second writer before the first checks.
        fs::remove_file(&path).unwrap();
        let (second, _) = SharedDir::open(dir.path(), &id).unwrap();
        let e = lock.check().unwrap_err();
        assert!(e.to_string().contains("no longer the lock file"), "{e}");
        second.writer_lock().unwrap().check().unwrap();
        // Once stopped, stopped: even with the second writer gone.
        drop(second);
        assert!(lock.check().is_err());
    }

    #[test]
    fn a_writer_whose_directory_vanished_stops() {
        let dir = tempfile::tempdir().unwrap();
        let id = format!("{:032x}", 6);
        let (first, _) = SharedDir::open(dir.path(), &id).unwrap();
        fs::remove_dir_all(&first.writer_dir).unwrap();
        let e = first.writer_lock().unwrap().check().unwrap_err();
        assert!(e.to_string().contains("vanished"), "{e}");
        assert!(!first.writer_dir.exists(), "not made again behind its back");
    }

    /// A writer starting while a collector (`Holder::Collector`, a live
    /// process) holds its lock waits for the collection instead of being
    /// refused as a second writer, and once the collector has removed the
    /// directory makes it again and holds the new lock.
    #[test]
    fn a_writer_starting_during_a_collection_waits_for_it() {
        let dir = tempfile::tempdir().unwrap();
        let id = format!("{:032x}", 8);
        drop(SharedDir::open(dir.path(), &id).unwrap());
        let (collector, _) = SharedDir::open_as(dir.path(), &id, Holder::Collector).unwrap();
        let writer_dir = collector.writer_dir.clone();
        let path = writer_dir.join(WRITER_LOCK_FILE);
        assert!(read_holder(&path).starts_with(COLLECTOR_PREFIX));
        let root = dir.path().to_path_buf();
        let starting = {
            let id = id.clone();
            std::thread::spawn(move || SharedDir::open(&root, &id).map(|(s, _)| s))
        };
        // The writer has the collector's lock file open: it waits.
        while open_count(&path) < 2 {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(!starting.is_finished(), "refused instead of waiting");
        // The collection ends: the directory goes, lock file last.
        fs::remove_file(&path).unwrap();
        fs::remove_dir_all(&writer_dir).unwrap();
        drop(collector);
        let writer = starting.join().unwrap().expect("the writer starts");
        let lock = writer.writer_lock().unwrap();
        lock.check().expect("holds the lock file that is linked");
        assert!(read_holder(&path).starts_with("pid "), "a writer's line");
        // A writer holding it is still refused at once.
        let e = SharedDir::open(dir.path(), &id).unwrap_err();
        assert!(e.to_string().contains("held by another process"), "{e}");
    }

    /// A writer starting while its lock is held by a process that has not
    /// written its holder line yet (a collector between `flock` and its
    /// line) waits instead of being refused as a second writer: the CLI
    /// suite's collection race once failed a restart this way ("held by
    /// another process (collector pid N ...)": the line was empty when
    /// read, the collector's when the message was made).
    #[test]
    fn a_writer_waits_for_a_holder_that_has_not_named_itself_yet() {
        let dir = tempfile::tempdir().unwrap();
        let id = format!("{:032x}", 9);
        let (first, _) = SharedDir::open(dir.path(), &id).unwrap();
        let path = first.writer_dir.join(WRITER_LOCK_FILE);
        drop(first);
        let holder = OpenOptions::new().write(true).open(&path).unwrap();
        flock_exclusive(&holder).unwrap();
        holder.set_len(0).unwrap();
        let root = dir.path().to_path_buf();
        let starting = {
            let id = id.clone();
            std::thread::spawn(move || SharedDir::open(&root, &id).map(|(s, _)| s))
        };
        // (A writer that refuses closes the file at once.)
        while open_count(&path) < 2 && !starting.is_finished() {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!starting.is_finished(), "refused instead of waiting");
        // It names itself a collector, then lets go.
        holder
            .write_all_at(holder_line(Holder::Collector).as_bytes(), 0)
            .unwrap();
        drop(holder);
        let writer = starting.join().unwrap().expect("the writer starts");
        writer
            .writer_lock()
            .unwrap()
            .check()
            .expect("holds the lock");
        assert!(read_holder(&path).starts_with("pid "), "a writer's line");
    }

    /// A collector removes a writer directory while holding its lock, the
    /// lock file last; a writer that opened that lock file and waited for
    /// it finds it unlinked once it gets it, and makes its directory and
    /// lock again instead of running on a deleted directory.
    #[test]
    fn a_writer_waiting_on_a_collected_directory_makes_it_again() {
        let dir = tempfile::tempdir().unwrap();
        let id = format!("{:032x}", 7);
        let (first, _) = SharedDir::open(dir.path(), &id).unwrap();
        let writer_dir = first.writer_dir.clone();
        let path = writer_dir.join(WRITER_LOCK_FILE);
        drop(first);
        // The collector's hold; the holder line names a process of this
        // host that let go, so the writer waits for the lock.
        let collector = File::open(&path).unwrap();
        flock_exclusive(&collector).unwrap();
        fs::create_dir_all(writer_dir.join("regions")).unwrap();
        let root = dir.path().to_path_buf();
        let starting = std::thread::spawn(move || SharedDir::open(&root, &id).map(|(s, _)| s));
        while open_count(&path) < 2 {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        // The writer holds the doomed file open: empty the directory, the
        // lock file last, then let go.
        fs::remove_dir_all(writer_dir.join("regions")).unwrap();
        fs::remove_file(&path).unwrap();
        fs::remove_dir(&writer_dir).unwrap();
        drop(collector);
        let started = starting.join().unwrap().expect("the writer starts");
        let lock = started.writer_lock().unwrap();
        lock.check().expect("it holds the linked lock file");
        assert!(writer_dir.is_dir());
    }

    #[test]
    fn nodes_racing_on_an_empty_directory_settle_on_one_secret() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("shared");
        let ids: Vec<String> = (0..8).map(|n| format!("{n:032x}")).collect();
        let secrets: Vec<[u8; 32]> = std::thread::scope(|s| {
            let handles: Vec<_> = ids
                .iter()
                .map(|id| {
                    let root = root.clone();
                    s.spawn(move || *SharedDir::open(&root, id).unwrap().1.as_bytes())
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(secrets.iter().all(|s| s == &secrets[0]));
        let writers = SharedDir::other_writers(&root, &ids[0]).unwrap();
        assert_eq!(writers.len(), 7);
        // Nothing temporary is left behind.
        let names: Vec<String> = fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.ends_with(".tmp")), "{names:?}");
    }

    #[test]
    fn a_second_writer_with_the_same_node_id_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let id = format!("{:032x}", 7);
        let first = SharedDir::open(dir.path(), &id).unwrap();
        let second = SharedDir::open(dir.path(), &id).unwrap_err();
        assert_eq!(second.kind(), ErrorKind::Locked, "{second}");
        drop(first);
        SharedDir::open(dir.path(), &id).unwrap();
    }

    /// A store of this process closed while a copy of its lock's
    /// descriptor lives on (a child spawned by another thread holds one
    /// from fork to exec): reopening waits for the copy to go instead of
    /// refusing the node its own log. CI saw the refusal once.
    #[test]
    fn reopening_waits_for_a_lingering_copy_of_a_closed_stores_lock() {
        let dir = tempfile::tempdir().unwrap();
        let id = format!("{:032x}", 3);
        let first = SharedDir::open(dir.path(), &id).unwrap().0;
        let lock = first._writer_lock.as_ref().unwrap();
        let copy = lock.state.lock().unwrap().held[0].0.try_clone().unwrap();
        drop(first);
        let closer = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(300));
            drop(copy);
        });
        SharedDir::open(dir.path(), &id).expect("the lock is free once the copy closes");
        closer.join().unwrap();
    }

    /// Only a holder of this host is waited for, and only one that has
    /// let go: a process of another host may be alive (nothing here can
    /// tell), and a live store of this process keeps its lock.
    #[test]
    fn only_a_holder_of_this_host_that_let_go_is_waited_for() {
        let dir = tempfile::tempdir().unwrap();
        let id = format!("{:032x}", 4);
        let first = SharedDir::open(dir.path(), &id).unwrap().0;
        let lock = first._writer_lock.as_ref().unwrap();
        let lock_id = lock.state.lock().unwrap().held[0].1;
        let me = std::process::id();
        let here = host_name();
        assert!(!holder_on_this_host_let_go(
            &format!("pid {me} on {here}\n"),
            lock_id
        ));
        drop(first);
        assert!(holder_on_this_host_let_go(
            &format!("pid {me} on {here}\n"),
            lock_id
        ));
        assert!(!holder_on_this_host_let_go(
            &format!("pid {me} on another-host\n"),
            lock_id
        ));
        assert!(!holder_on_this_host_let_go("", lock_id));
        assert!(!holder_on_this_host_let_go(
            &format!("pid x on {here}"),
            lock_id
        ));
    }

    #[test]
    fn a_replaced_secret_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let id = format!("{:032x}", 1);
        drop(SharedDir::open(dir.path(), &id).unwrap());
        let path = dir.path().join(KEY_SECRET_FILE);
        fs::remove_file(&path).unwrap();
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(FILE_MODE)
            .open(&path)
            .unwrap();
        file.write_all(&[9u8; 32]).unwrap();
        let error = SharedDir::open(dir.path(), &id).unwrap_err();
        assert_eq!(error.kind(), ErrorKind::Corruption, "{error}");
    }
}
