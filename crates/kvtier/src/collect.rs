//! Collecting the logs of writers that died for good (docs/design.md,
//! "Dead writers"): a dead node's log stays readable by every node; this
//! reclaims it, as its writer would have, under the writer's own lock.
//! The collector opens a store *as that writer* (`Config::adopt_writer`),
//! which recovers its log and follows every other writer like any node,
//! then reclaims every region the log had, oldest first, with the shared
//! reclaim rules (values dropped; removals another log may still need are
//! rewritten). A log left with nothing is removed with its directory.
//!
//! It opens a store, so it sits above `store/` in the crate's layers; the
//! shared directory's mechanisms below the store name no `Store`.

use crate::checkpoint::CHECKPOINT_DIR;
use crate::config::Config;
use crate::error::{ErrorKind, Result};
use crate::shared::{writer_lock_held, SharedDir, WRITER_LOCK_FILE};
use crate::store::Store;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, SystemTime};

/// What `collect_dead_writers` did with one writer directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CollectedWriter {
    pub node: String,
    /// Seconds since its log last changed (its newest file's mtime).
    pub idle_seconds: u64,
    pub outcome: Collection,
}

/// See [`CollectedWriter`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Collection {
    /// Changed more recently than the threshold: left alone.
    Recent,
    /// A process holds its writer lock: alive, left alone.
    Alive,
    /// Its regions were reclaimed: how many, and the bytes its log shrank
    /// by; removals kept
    /// because another writer's log may still hold a put they removed;
    /// whether the writer directory itself went (nothing was left).
    Collected {
        regions: u64,
        bytes: u64,
        kept_removals: u64,
        directory_removed: bool,
    },
    Failed(String),
}

/// Reclaims the log of every writer of `shared_dir` that has not changed
/// for `older_than` and whose writer lock nobody holds. `scratch` holds the
/// collector's throwaway data directories (removed after).
pub fn collect_dead_writers(
    shared_dir: &Path,
    older_than: Duration,
    scratch: &Path,
) -> Result<Vec<CollectedWriter>> {
    collect_dead_writers_where(shared_dir, older_than, scratch, |_| true)
}

/// [`collect_dead_writers`] over the writers `consider` accepts (cluster
/// mode: those that are not live members).
pub fn collect_dead_writers_where(
    shared_dir: &Path,
    older_than: Duration,
    scratch: &Path,
    consider: impl Fn(&str) -> bool,
) -> Result<Vec<CollectedWriter>> {
    let writers = SharedDir::other_writers(shared_dir, "").map_err(|e| {
        crate::Error::io(
            format!("listing the writers of {}", shared_dir.display()),
            e,
        )
    })?;
    let mut out = Vec::new();
    for (node, dir) in writers {
        if !consider(&node) {
            continue;
        }
        let idle = idle_for(&dir);
        let idle_seconds = idle.as_secs();
        let outcome = if idle < older_than {
            Collection::Recent
        } else if writer_lock_held(&dir) {
            Collection::Alive
        } else {
            match collect(shared_dir, &node, &dir, scratch) {
                Ok(done) => done,
                Err(e) if e.kind() == ErrorKind::Locked => Collection::Alive,
                Err(e) => Collection::Failed(e.to_string()),
            }
        };
        out.push(CollectedWriter {
            node,
            idle_seconds,
            outcome,
        });
    }
    Ok(out)
}

fn collect(shared_dir: &Path, node: &str, dir: &Path, scratch: &Path) -> Result<Collection> {
    let (_, bytes_before) = region_files(dir);
    let data_dir = scratch.join(format!("collect-{node}"));
    let _ = fs::remove_dir_all(&data_dir);
    let mut config = Config::new(&data_dir)
        .memory_capacity(16 << 20)
        .disk_capacity(1 << 50)
        .shared_dir(shared_dir)
        // The bounded index with no share: the collector indexes none of
        // the other writers' entries (its reclaim carries no values in a
        // shared directory and keeps only the dead writer's own removals;
        // the floor comes from their records all the same), so it needs
        // the memory of the dead writer's log alone, at any scale.
        .shared_index_share(true);
    config.adopt_writer = Some(node.to_string());
    let store = Store::open(config)?;
    let kept_before = store.stats().carried_entries;
    // Closing joins the flusher, which reclaimed every region first.
    store.close()?;
    let after = store.stats();
    let kept_removals = after.carried_entries - kept_before;
    let regions = after.reclaimed_regions;
    drop(store);
    let _ = fs::remove_dir_all(&data_dir);
    let (regions_after, bytes_after) = region_files(dir);
    let directory_removed = regions_after == 0 && remove_writer_dir(dir);
    Ok(Collection::Collected {
        regions,
        bytes: bytes_before.saturating_sub(bytes_after),
        kept_removals,
        directory_removed,
    })
}

/// Removes an emptied writer directory under its writer lock, the lock
/// file last: a writer that starts meanwhile either takes the lock first
/// (and the directory stays) or waits for it and then finds its lock file
/// unlinked, and makes the directory again (`dir::lock_writer`). Removing
/// the directory after letting go of the lock deleted the log of a writer
/// that had just restarted. Returns whether the directory went.
fn remove_writer_dir(dir: &Path) -> bool {
    let lock_path = dir.join(WRITER_LOCK_FILE);
    let Ok(lock) = fs::File::open(&lock_path) else {
        return false;
    };
    // Released when the file closes at return.
    if crate::lock::flock_exclusive(&lock).is_err() {
        return false; // its writer is back
    }
    let held = lock.metadata().map(|m| (m.dev(), m.ino())).ok();
    let linked = fs::symlink_metadata(&lock_path)
        .map(|m| (m.dev(), m.ino()))
        .ok();
    if held.is_none() || held != linked || region_files(dir).0 > 0 {
        return false;
    }
    let Ok(listing) = fs::read_dir(dir) else {
        return false;
    };
    for item in listing.flatten() {
        let path = item.path();
        if path == lock_path {
            continue;
        }
        let removed = match item.file_type() {
            Ok(t) if t.is_dir() => fs::remove_dir_all(&path),
            _ => fs::remove_file(&path),
        };
        if let Err(e) = removed {
            tracing::warn!(path = %path.display(), error = %e, "removing a collected writer's file; the directory stays");
            return false;
        }
    }
    fs::remove_file(&lock_path).is_ok() && fs::remove_dir(dir).is_ok()
}

/// Region files of a writer directory and their bytes.
fn region_files(dir: &Path) -> (u64, u64) {
    let Ok(listing) = fs::read_dir(dir.join(crate::disk::REGION_DIR)) else {
        return (0, 0);
    };
    listing
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "kvr"))
        .fold((0, 0), |(n, bytes), e| {
            (n + 1, bytes + e.metadata().map_or(0, |m| m.len()))
        })
}

/// How long since anything of the writer's log changed.
fn idle_for(dir: &Path) -> Duration {
    let mut newest = fs::metadata(dir).and_then(|m| m.modified()).ok();
    for sub in [crate::disk::REGION_DIR, CHECKPOINT_DIR] {
        if let Ok(listing) = fs::read_dir(dir.join(sub)) {
            for item in listing.flatten() {
                if let Ok(modified) = item.metadata().and_then(|m| m.modified()) {
                    newest = newest.max(Some(modified));
                }
            }
        }
    }
    if let Ok(modified) = fs::metadata(dir.join(crate::disk::HEAD_FILE)).and_then(|m| m.modified())
    {
        newest = newest.max(Some(modified));
    }
    newest
        .and_then(|t| SystemTime::now().duration_since(t).ok())
        .unwrap_or(Duration::ZERO)
}
