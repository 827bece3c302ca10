//! The disk tier: a log of region files written in whole batches.
//!
//! Each batch is one vectored write: a checksummed batch record (the commit
//! record, naming every value's key, digest, length, checksum and
//! sequence), then the values, each page-aligned so reads can be O_DIRECT
//! straight into the caller's buffer. A write is followed by `fdatasync`
//! before anything in it is reported durable. Recovery reads only the
//! records. See docs/design.md for the bytes and the crash protocol.
//!
//! By concern: `format` (the bytes), `names` (file names and the log
//! head), `region` (an open region file), `scan` (the one reader of batch
//! records, for recovery, the reclaimer and other writers' logs),
//! `recovery` with `set_aside` (quarantine), `write`, `reclaim`, `other_logs` (other writers' files of a shared
//! directory), `read` and `deadline` (value reads, bounded where the
//! file system can stall), `lower_tier` (the store's seam, `tier::LowerTier`,
//! over all of it). A value's address is the tier seam's `Location`, named
//! `DiskLoc` here. This file composes them into [`DiskTier`].

mod deadline;
pub mod format;
#[cfg(feature = "internals")]
mod locations;
mod lower_tier;
mod mount;
mod names;
mod other_logs;
mod parallel_scan;
mod read;
mod reclaim;
mod recorded;
mod records;
mod recovery;
mod recovery_report;
mod region;
mod scan;
mod set_aside;
#[cfg(test)]
mod test_log;
mod write;

pub use crate::config::SharedReadMode;
pub use crate::tier::DiskLocation;
pub use crate::tier::Location as DiskLoc;
#[cfg(feature = "internals")]
pub use locations::value_locations;
#[cfg(feature = "internals")]
pub use names::record_origin;
pub(crate) use names::{parse_region_name, HEAD_FILE};
pub(crate) use other_logs::read_other_head;
pub(crate) use other_logs::{RegionListing, RegionRead, NO_HANDLE};
pub(crate) use read::{ReadOutcome, ValueRead};
pub use recorded::RecordedRegion;
pub use recovery::{RecoveredEntry, RecoveryChecks};
pub use recovery_report::RecoveryReport;
pub use region::Region;
pub(crate) use scan::value_loc;

use crate::config::{Config, IoEngineKind};
use crate::error::{Error, Result};
use crate::io::{sync_dir, uring, BufferPool, IoEngine, PsyncEngine};
use crate::key::KeySecret;
use crate::units::PAGE_SIZE;
use format::REGION_HEADER_LEN;
use std::collections::BTreeMap;
use std::fs::{self, File};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

pub(crate) const REGION_DIR: &str = "regions";
/// Where recovery moves region files it cannot read (next to `regions/`).
pub(crate) const QUARANTINE_DIR: &str = "quarantine";
/// The highest region id ever handed out (docs/design.md has the
/// arithmetic: 1 EiB written at the default region size). Reaching it is a
/// clear `NoSpace` error; a region file named above it is set aside rather
/// than allowed to stop every later write.
pub const MAX_REGION_ID: u32 = u32::MAX - 1;

/// Index handles of other writers' regions (a shared directory) start
/// here; this node's own region ids then stay below it.
pub const OTHERS_BASE: u32 = 1 << 31;

#[derive(Debug)]
pub struct DiskTier {
    dir: PathBuf,
    engine: Arc<dyn IoEngine>,
    direct_io: AtomicBool,
    /// `Config::shared_read_mode`: how other writers' files are read.
    shared_read_mode: SharedReadMode,
    capacity: u64,
    region_size: u64,
    regions: RwLock<BTreeMap<u32, Arc<Region>>>,
    used: AtomicU64,
    writer: Mutex<write::WriterState>,
    /// Reads values through `engine`.
    reader: read::ValueReader,
    /// Reads values of files on a file system that can stall, within the
    /// storage deadline (`None`: `Config::io_deadline` is zero).
    bounded: Option<deadline::BoundedReads>,
    /// `Config::io_deadline_local`: bound reads of every file.
    bound_every_file: bool,
    /// `Config::io_deadline`: how long a record scan (`records.rs`) may
    /// go without handing anything over (zero: no bound).
    io_deadline: std::time::Duration,
    /// Record scans given up on past the deadline whose thread still
    /// waits for the file system (at most one: see `records.rs`).
    scans_held: Arc<AtomicU64>,
    /// Test seam: record scans wait while this is set.
    #[cfg(test)]
    pub(crate) scan_gate: Arc<(Mutex<bool>, std::sync::Condvar)>,
    /// Every record's digests are checked against it.
    secret: Arc<KeySecret>,
    /// Test seam (`Config::unsafe_single_sync_batches`).
    single_sync: bool,
    /// New region files are named `<node_id>-<incarnation>-<region>.kvr`:
    /// a name is never reused, even if a region id is after a reclaim.
    node_id: String,
    incarnation: u64,
    /// The highest region id this log may use: `MAX_REGION_ID`, or below
    /// `OTHERS_BASE` when the log is one writer's of a shared directory.
    max_region_id: u32,
    /// Other writers' regions (a shared directory), by index handle.
    others: RwLock<std::collections::HashMap<u32, Arc<Region>>>,
    /// Their handles and cursors, by writer and region id.
    other_logs: Mutex<other_logs::OtherLogs>,
    /// Most of them held open at once (`set_other_files_budget`): each
    /// holds a descriptor, which would otherwise come out of what the
    /// server keeps for connections.
    other_files_budget: std::sync::atomic::AtomicUsize,
    /// Asked before every batch is written: whether this log is still
    /// this process's to write (a shared directory's writer lock). An
    /// error fails the batch.
    write_guard: write::WriteGuardSlot,
}

/// Other writers' region files held open by default: half the open-file
/// limit at open (the server sets the exact room it leaves once its own
/// caps are fitted).
fn default_other_files_budget() -> usize {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(1 << 20);
    usize::try_from(limit / 2).unwrap_or(usize::MAX)
}

/// Bytes of bounce buffers kept for reuse between reads.
const BOUNCE_CACHE_BYTES: usize = 256 << 20;

impl DiskTier {
    /// Opens (or creates) the region log under `log_dir` (the data
    /// directory, or this node's writer directory of a shared directory)
    /// and hands every record entry of every valid batch, in log order, to
    /// `apply`.
    pub fn open(
        config: &Config,
        log_dir: &Path,
        secret: Arc<KeySecret>,
        node_id: &str,
        checks: RecoveryChecks,
        mut apply: impl FnMut(RecoveredEntry),
    ) -> Result<(DiskTier, RecoveryReport)> {
        let dir = log_dir.join(REGION_DIR);
        crate::private::create_dir(&dir)
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
        // Cached values are private to the store's user (also for a
        // regions/ made by an older kvtier).
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o700))
            .map_err(|e| Error::io(format!("restricting {}", dir.display()), e))?;
        let engine: Arc<dyn IoEngine> = match config.io_engine {
            IoEngineKind::Psync => Arc::new(PsyncEngine::new(config.io_threads)),
            IoEngineKind::Uring => {
                match uring::UringEngine::new(
                    config.io_depth,
                    config.io_threads,
                    config.io_registration,
                ) {
                    Ok(engine) => Arc::new(engine),
                    Err(e) => {
                        tracing::warn!(error = %e, "io_uring is unavailable here; falling back to the psync io engine");
                        Arc::new(PsyncEngine::new(config.io_threads))
                    }
                }
            }
        };
        #[cfg(feature = "test-util")]
        let engine = match &config.engine_wrapper {
            Some(wrap) => (wrap.0)(engine),
            None => engine,
        };
        let bounce = Arc::new(BufferPool::new(BOUNCE_CACHE_BYTES));
        let read_piece = usize::try_from(config.read_piece).unwrap_or(usize::MAX);
        // Bounded reads never share the rings: a read stuck in the kernel
        // holds its ring, and every read sent to it, until it returns.
        #[allow(unused_mut)]
        let mut bounded_engine: Arc<dyn IoEngine> = Arc::new(PsyncEngine::new(config.io_threads));
        #[cfg(feature = "test-util")]
        if let Some(wrap) = &config.bounded_engine_wrapper {
            bounded_engine = (wrap.0)(bounded_engine);
        }
        let bounded = (!config.io_deadline.is_zero()).then(|| {
            deadline::BoundedReads::new(
                read::ValueReader::new(bounded_engine, Arc::clone(&bounce), read_piece),
                config.io_deadline,
            )
        });
        let tier = DiskTier {
            dir,
            reader: read::ValueReader::new(Arc::clone(&engine), bounce, read_piece),
            bounded,
            bound_every_file: config.io_deadline_local,
            io_deadline: config.io_deadline,
            scans_held: Arc::default(),
            #[cfg(test)]
            scan_gate: Arc::default(),
            engine,
            #[cfg(feature = "test-util")]
            single_sync: config.skip_value_sync,
            #[cfg(not(feature = "test-util"))]
            single_sync: false,
            direct_io: AtomicBool::new(config.direct_io),
            shared_read_mode: config.shared_read_mode,
            capacity: config.disk_capacity,
            region_size: config.effective_region_size(),
            regions: RwLock::new(BTreeMap::new()),
            used: AtomicU64::new(0),
            writer: Mutex::new(write::WriterState {
                active: None,
                next_region: 0,
            }),
            secret,
            node_id: node_id.to_string(),
            // This open's incarnation: nanoseconds since the Unix epoch.
            incarnation: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64),
            max_region_id: if config.shared_dir.is_some() {
                OTHERS_BASE - 1
            } else {
                MAX_REGION_ID
            },
            others: RwLock::new(std::collections::HashMap::new()),
            other_logs: Mutex::default(),
            other_files_budget: std::sync::atomic::AtomicUsize::new(default_other_files_budget()),
            write_guard: write::WriteGuardSlot::default(),
        };
        let report = tier.recover(checks, &mut apply)?;
        Ok((tier, report))
    }

    pub fn engine_name(&self) -> &'static str {
        self.engine.name()
    }

    /// Whether reads of `file` are bounded by the storage deadline: when
    /// there is one, for a file system that can stall (or every file with
    /// `Config::io_deadline_local`).
    fn bounds_reads_of(&self, file: &File) -> bool {
        self.bounded.is_some() && (self.bound_every_file || mount::may_stall(file))
    }

    /// Whether waits for this log's writes are bounded by the storage
    /// deadline: when there is one, for a log on a file system that can
    /// stall (or any, with `Config::io_deadline_local`). A local disk's
    /// slow sync under load is not a stall: flushes there wait it out.
    pub(crate) fn writes_bounded(&self) -> bool {
        self.bounded.is_some() && (self.bound_every_file || mount::may_stall_at(&self.dir))
    }

    /// Bounded reads past the storage deadline since open, stalls seen,
    /// and the batches (and their buffer bytes) the kernel still holds.
    pub(crate) fn deadline_counts(&self) -> (u64, u64, u64, u64) {
        match &self.bounded {
            None => (0, 0, 0, 0),
            Some(b) => {
                let (batches, bytes) = b.stuck();
                (
                    b.counters.deadline_misses.load(Ordering::Relaxed),
                    b.counters.stalls.load(Ordering::Relaxed),
                    batches,
                    bytes,
                )
            }
        }
    }

    pub fn engine(&self) -> &dyn IoEngine {
        &*self.engine
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes of region files on disk.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }

    pub fn region_count(&self) -> usize {
        self.regions.read().unwrap().len()
    }

    /// The region an index entry names: this log's, or another writer's
    /// (handles from `OTHERS_BASE` up).
    pub fn region(&self, id: u32) -> Option<Arc<Region>> {
        if self.is_other_handle(id) {
            return self.others.read().unwrap().get(&id).cloned();
        }
        self.regions.read().unwrap().get(&id).cloned()
    }

    /// Whether `loc` names another writer's region of a shared directory
    /// (a handle, not one of this log's ids).
    pub(crate) fn is_other_writers(&self, loc: DiskLoc) -> bool {
        self.is_other_handle(loc.region())
    }

    /// Whether region id `id` is a handle of another writer's region (only
    /// a log of a shared directory has them).
    fn is_other_handle(&self, id: u32) -> bool {
        id >= OTHERS_BASE && self.max_region_id < OTHERS_BASE
    }

    /// The id the next new region will get.
    pub(crate) fn next_region_id(&self) -> u32 {
        self.writer.lock().unwrap().next_region
    }

    /// This open's incarnation (in the names of the files it creates).
    pub(crate) fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// This log's regions: id, the incarnation in the file's name and the
    /// bytes written (for index checkpoints; called on the flusher's
    /// thread, so no batch is being appended).
    pub(crate) fn own_regions(&self) -> Vec<(u32, u64, u64)> {
        self.regions
            .read()
            .unwrap()
            .values()
            .map(|r| {
                let name = r.path().file_name().unwrap_or_default().to_string_lossy();
                let incarnation = parse_region_name(&name).map_or(0, |n| n.incarnation);
                (r.id, incarnation, r.len())
            })
            .collect()
    }

    /// Where an index entry's bytes lie in its region file, for tools that
    /// read the files themselves; `None` once the region is gone.
    pub(crate) fn file_location_of(
        &self,
        loc: DiskLoc,
        len: u32,
        digest: crate::key::KeyDigest,
        checksum: u64,
    ) -> Option<DiskLocation> {
        let region = self.region(loc.region())?;
        Some(DiskLocation {
            path: region.path().to_path_buf(),
            offset: u64::from(loc.page()) * PAGE_SIZE,
            len,
            digest,
            checksum,
        })
    }

    /// The largest batch (record plus values) that can ever be written:
    /// what is left of the capacity after one region header.
    pub fn max_batch_len(&self) -> u64 {
        self.capacity - REGION_HEADER_LEN
    }

    /// Whether writing `batch_len` more bytes would pass the capacity; the
    /// flusher reclaims regions until it would not.
    pub fn needs_reclaim(&self, batch_len: u64) -> bool {
        self.used() + batch_len + REGION_HEADER_LEN > self.capacity
    }

    pub fn direct_io(&self) -> bool {
        self.direct_io.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::test_log::{put, TestLog};
    use super::*;

    #[test]
    fn capacity_arithmetic_leaves_room_for_a_region_header() {
        let log = TestLog::new(64 << 10);
        let (tier, _, _) = log.open(RecoveryChecks::default());
        assert_eq!(tier.capacity(), 1 << 30);
        assert_eq!(tier.max_batch_len(), (1 << 30) - REGION_HEADER_LEN);
        assert!(!tier.needs_reclaim(tier.max_batch_len()));
        assert!(tier.needs_reclaim(tier.max_batch_len() + 1));
        log.write(&tier, &[put(b"a", 1, 100, 1)]).unwrap();
        assert_eq!(tier.used(), 3 * PAGE_SIZE);
        assert!(tier.needs_reclaim(tier.max_batch_len() - 2 * PAGE_SIZE));
    }

    #[test]
    fn own_regions_and_locations_name_this_logs_files() {
        let log = TestLog::new(64 << 10);
        let (tier, _, _) = log.open(RecoveryChecks::default());
        let a = log.write(&tier, &[put(b"a", 1, 40 << 10, 1)]).unwrap()[0];
        log.write(&tier, &[put(b"b", 2, 40 << 10, 2)]).unwrap();
        let regions = tier.own_regions();
        assert_eq!(regions.len(), 2);
        assert!(regions.iter().all(|&(_, incarnation, len)| {
            incarnation == tier.incarnation() && len == REGION_HEADER_LEN + PAGE_SIZE + (40 << 10)
        }));
        let digest = log.secret.digest_qualified(&test_log::qualified(b"a"));
        let at = tier.file_location_of(a, 40 << 10, digest, 9).unwrap();
        assert_eq!(at.path, log.region_files()[0].1);
        assert_eq!(at.offset, 2 * PAGE_SIZE);
        // Another writer's handle is not one of this log's regions.
        assert!(tier.region(OTHERS_BASE).is_none());
        assert!(tier
            .file_location_of(DiskLoc::new(5, 0), 1, digest, 9)
            .is_none());
    }

    #[test]
    fn a_new_regions_directory_is_private() {
        let log = TestLog::new(64 << 10);
        let _ = log.open(RecoveryChecks::default());
        let mode = fs::metadata(log.regions_dir())
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700);
    }
}
