//! The disk tier: a log of region files written in whole batches.
//!
//! Each batch is one vectored write: a checksummed batch record (the commit
//! record, naming every value's key, digest, length, checksum and
//! sequence), then the values, each page-aligned so reads can be O_DIRECT
//! straight into the caller's buffer. A write is followed by `fdatasync`
//! before anything in it is reported durable. Recovery reads only the
//! records. See docs/design.md for the bytes and the crash protocol.

mod deadline;
pub mod format;
mod mount;
mod others;
mod parallel_scan;
mod read;

pub(crate) use others::{first_id_past_gaps, read_other_head, scan_new_batches};
pub(crate) use read::{Destination, ReadOutcome, ValueRead};

use crate::config::{Config, IoEngineKind};
use crate::error::{Error, Result};
use crate::index::DiskLoc;
use crate::io::{pread_full, uring, AlignedBuf, BufferPool, IoEngine, PsyncEngine};
use crate::key::{KeySecret, ValueChecksum};
use crate::units::{page_round_up, PAGE_SIZE};
use format::{BatchHeader, RecordEntry, RecordFault, RegionHeader, REGION_HEADER_LEN};
use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::IoSlice;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

pub(crate) const REGION_DIR: &str = "regions";
/// Where recovery moves region files it cannot read (next to `regions/`).
pub(crate) const QUARANTINE_DIR: &str = "quarantine";
/// How often recovery logs its progress.
const RECOVERY_PROGRESS_EVERY: std::time::Duration = std::time::Duration::from_secs(2);
const REGION_SUFFIX: &str = ".kvr";
/// The newest region id the log has created, beside `regions/`: lets
/// recovery notice newest region files that went missing (their
/// tombstones with them). See docs/design.md, "Log head".
pub(crate) const HEAD_FILE: &str = "log-head";
/// The highest region id ever handed out (docs/design.md has the
/// arithmetic: 1 EiB written at the default region size). Reaching it is a
/// clear `NoSpace` error; a region file named above it is set aside rather
/// than allowed to stop every later write.
pub const MAX_REGION_ID: u32 = u32::MAX - 1;

/// Index handles of other writers' regions (a shared directory) start
/// here; this node's own region ids then stay below it.
pub const OTHERS_BASE: u32 = 1 << 31;
/// Recovery reads region files in windows this large once it is
/// resynchronising through damage (a page at a time would crawl).
const SCAN_WINDOW: usize = 8 << 20;
/// Recovery reads at least this much wherever it reads: a batch's first
/// page and the rest of its record (a few hundred entries) in one read
/// instead of two, each a round trip to the device that the scan waits for.
const RECORD_READ: usize = 64 << 10;
/// Piece size of the tail scrub's value reads.
const SCRUB_PIECE: usize = 8 << 20;

/// What recovery may assume, decided by the store from the data
/// directory's files before the disk tier opens.
#[derive(Debug, Clone, Copy, Default)]
pub struct RecoveryChecks {
    /// The key-secret matched its check value: no need to refuse a
    /// directory where no record verifies (older directories have no check
    /// value, and are refused when nothing verifies but something would
    /// under another secret).
    pub identity_confirmed: bool,
    /// The previous run did not close cleanly: verify the values of the
    /// newest region's batches before indexing them.
    pub scrub_tail: bool,
}

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
    len: AtomicU64,
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

    fn new(
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

/// A put that recovery found in a valid batch record.
#[derive(Debug)]
pub struct RecoveredEntry {
    pub entry: RecordEntry,
    pub loc: DiskLoc,
    /// The tail scrub found this put's value lost: handed over as a
    /// tombstone at the put's sequence (so no older value of the key comes
    /// back either), for the store to log as a remove.
    pub value_lost: bool,
}

/// What recovery saw, for logs and tests.
#[derive(Debug, Default, Clone)]
pub struct RecoveryReport {
    pub regions: u64,
    /// Batches whose records verified (and were applied, unless behind a
    /// missing region or dropped by the tail scrub).
    pub batches: u64,
    pub records: u64,
    /// Regions with pages where no valid batch starts (a torn tail after a
    /// failed write, or damage), and how many such pages recovery skipped.
    pub damaged_regions: u64,
    pub skipped_pages: u64,
    /// Region files moved to `quarantine/` because their header could not
    /// be read or verified (kept for inspection, never deleted).
    pub quarantined_regions: u64,
    /// Empty region files removed (created, but their header never
    /// written: they can hold nothing).
    pub empty_regions_removed: u64,
    /// Highest sequence number seen in any header or record.
    pub max_seq: u64,
    /// Regions whose header was damaged but whose batches verified on
    /// their own (kept: the header holds nothing the batches need).
    pub damaged_headers: u64,
    /// Regions whose records were intact but keyed with another secret
    /// (quarantined, never reclaimed as if they were this store's).
    pub foreign_regions: u64,
    /// Files under a region name that recovery could neither use nor
    /// quarantine (left in place, not indexed).
    pub skipped_files: u64,
    /// Regions read without O_DIRECT because their file refused it.
    pub buffered_regions: u64,
    /// Regions older than a missing one (a gap in the region ids, or a
    /// newest region the log head names but the directory lacks), and
    /// their record entries, which were not indexed: the missing region
    /// may have held the tombstones that removed them.
    pub regions_behind_gap: u64,
    pub entries_behind_gap: u64,
    /// The tail scrub after an unclean shutdown: values of the newest
    /// region checked before indexing, those that did not verify, and the
    /// milliseconds it took.
    pub scrubbed_entries: u64,
    pub scrub_dropped: u64,
    pub scrub_ms: u64,
}

/// Where a value's durable copy lies (see [`crate::NamespacedStore::disk_location`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskLocation {
    /// The region file.
    pub path: std::path::PathBuf,
    /// Byte offset of the value in the file (a multiple of 4096).
    pub offset: u64,
    pub len: u32,
    /// The key's digest, which seeds the value checksum.
    pub digest: crate::key::KeyDigest,
    /// `value_checksum(digest, value)`.
    pub checksum: u64,
}

/// A batch ready to write: its record entries (value offsets are filled in
/// by [`DiskTier::write_batch`]) and each put's padded, aligned bytes.
#[derive(Debug, Default)]
pub struct PendingBatch<'a> {
    pub entries: Vec<RecordEntry>,
    pub values: Vec<&'a [u8]>,
}

impl PendingBatch<'_> {
    /// Bytes the batch will take on disk.
    pub fn disk_len(&self) -> u64 {
        let record = format::record_len(self.entries.iter().map(|e| e.key.len())) as u64;
        page_round_up(record) + self.values.iter().map(|v| v.len() as u64).sum::<u64>()
    }
}

#[derive(Debug)]
struct WriterState {
    active: Option<Arc<Region>>,
    next_region: u32,
}

#[derive(Debug)]
pub struct DiskTier {
    dir: PathBuf,
    engine: Arc<dyn IoEngine>,
    direct_io: AtomicBool,
    capacity: u64,
    region_size: u64,
    regions: RwLock<BTreeMap<u32, Arc<Region>>>,
    used: AtomicU64,
    writer: Mutex<WriterState>,
    /// Reads values through `engine`.
    reader: read::ValueReader,
    /// Reads values of files on a file system that can stall, within the
    /// storage deadline (`None`: `Config::io_deadline` is zero).
    bounded: Option<deadline::BoundedReads>,
    /// `Config::io_deadline_local`: bound reads of every file.
    bound_every_file: bool,
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
    /// Most of them held open at once (`set_other_files_budget`): each
    /// holds a descriptor, which would otherwise come out of what the
    /// server keeps for connections.
    other_files_budget: std::sync::atomic::AtomicUsize,
    /// Asked before every batch is written: whether this log is still
    /// this process's to write (a shared directory's writer lock). An
    /// error fails the batch.
    write_guard: WriteGuardSlot,
}

/// See `DiskTier::set_write_guard`.
pub type WriteGuard = Arc<dyn Fn() -> Result<()> + Send + Sync>;

#[derive(Default)]
struct WriteGuardSlot(std::sync::OnceLock<WriteGuard>);

impl std::fmt::Debug for WriteGuardSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.get().is_some() {
            "WriteGuard(set)"
        } else {
            "WriteGuard(none)"
        })
    }
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
            engine,
            #[cfg(feature = "test-util")]
            single_sync: config.skip_value_sync,
            #[cfg(not(feature = "test-util"))]
            single_sync: false,
            direct_io: AtomicBool::new(config.direct_io),
            capacity: config.disk_capacity,
            region_size: config.effective_region_size(),
            regions: RwLock::new(BTreeMap::new()),
            used: AtomicU64::new(0),
            writer: Mutex::new(WriterState {
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
            other_files_budget: std::sync::atomic::AtomicUsize::new(default_other_files_budget()),
            write_guard: WriteGuardSlot::default(),
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
        if id >= OTHERS_BASE && self.max_region_id < OTHERS_BASE {
            return self.others.read().unwrap().get(&id).cloned();
        }
        self.regions.read().unwrap().get(&id).cloned()
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
                let name = r.path.file_name().unwrap_or_default().to_string_lossy();
                let incarnation = parse_region_name(&name).map_or(0, |n| n.incarnation);
                (r.id, incarnation, r.len())
            })
            .collect()
    }

    /// The largest batch (record plus values) that can ever be written:
    /// what is left of the capacity after one region header.
    /// Where an index entry's bytes lie in its region file, for tools that
    /// read the files themselves; `None` once the region is gone.
    pub(crate) fn locate(
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

    pub fn max_batch_len(&self) -> u64 {
        self.capacity - REGION_HEADER_LEN
    }

    /// Whether writing `batch_len` more bytes would pass the capacity; the
    /// flusher reclaims regions until it would not.
    pub fn needs_reclaim(&self, batch_len: u64) -> bool {
        self.used() + batch_len + REGION_HEADER_LEN > self.capacity
    }

    /// Rebuilds what the log holds, newest region first (see docs/design.md,
    /// "Recovery"). Nothing is deleted on recovery's own judgement except
    /// empty files; what it cannot use is quarantined or skipped, and the
    /// entries of regions older than a missing one are not indexed (a
    /// missing region may have held the tombstones that removed them).
    fn recover(
        &self,
        checks: RecoveryChecks,
        apply: &mut impl FnMut(RecoveredEntry),
    ) -> Result<RecoveryReport> {
        let mut report = RecoveryReport::default();
        let mut candidates: BTreeMap<u32, Vec<PathBuf>> = BTreeMap::new();
        let listing = fs::read_dir(&self.dir)
            .map_err(|e| Error::io(format!("listing {}", self.dir.display()), e))?;
        for item in listing {
            let item = item.map_err(|e| Error::io(format!("listing {}", self.dir.display()), e))?;
            let name = item.file_name();
            let name = name.to_string_lossy();
            match parse_region_name(&name) {
                Some(RegionName {
                    node: Some(node), ..
                }) if node != self.node_id => {
                    // Kept, never read: this directory's index must hold
                    // only what it wrote and verified.
                    tracing::warn!(file = %name, "ignoring a region file of another node")
                }
                Some(RegionName { id, .. }) if id > self.max_region_id => {
                    // No writer of this directory gets here (ids are handed
                    // out in order and refused past MAX_REGION_ID): a name
                    // that would stop every later write must not count.
                    self.set_aside(&item.path(), "region id out of range", &mut report);
                }
                Some(RegionName { id, .. }) => {
                    candidates.entry(id).or_default().push(item.path());
                }
                None => {
                    tracing::warn!(file = %name, "ignoring unknown file in the region directory")
                }
            }
        }
        let head = self.read_head();
        // Newest first: a missing region is noticed before any older entry
        // is applied (per key, the highest sequence wins in any order).
        let total = candidates.len();
        let started = std::time::Instant::now();
        let mut reported = started;
        let mut expected = head;
        let mut behind_gap = false;
        let mut newest_seen = false;
        let mut foreign_only: Vec<(u32, PathBuf)> = Vec::new();
        let mut verified_batches = 0u64;
        let mut foreign_batches = 0u64;
        let mut scrub_time = std::time::Duration::ZERO;
        let mut opened = Vec::with_capacity(candidates.len());
        for (id, paths) in candidates.into_iter().rev() {
            if let Some((path, file, direct, file_len)) =
                self.open_candidate(id, paths, &mut report)?
            {
                opened.push(parallel_scan::Candidate {
                    id,
                    path,
                    file,
                    direct,
                    file_len,
                });
            }
        }
        let mut done = 0usize;
        let threads = parallel_scan::scan_threads();
        parallel_scan::scan_in_order(opened, &self.secret, threads, |scanned| {
            let parallel_scan::Scanned {
                candidate:
                    parallel_scan::Candidate {
                        id,
                        path,
                        file,
                        direct,
                        file_len,
                    },
                header,
                scan,
                entries: entries_here,
            } = scanned;
            if reported.elapsed() >= RECOVERY_PROGRESS_EVERY {
                reported = std::time::Instant::now();
                tracing::info!(
                    regions_scanned = done,
                    regions = total,
                    records = report.records,
                    elapsed_s = started.elapsed().as_secs(),
                    "recovering the disk tier: {done} of {total} regions scanned"
                );
            }
            done += 1;
            // A regular file holds this id: the region is not missing, even
            // if nothing in it verifies (its unreadable records are damage
            // like any other). Only ids with no such file are gaps.
            match expected {
                Some(e) if id < e && !behind_gap => {
                    behind_gap = true;
                    tracing::error!(
                        region = id,
                        missing_from = id + 1,
                        missing_to = e,
                        "region files are missing from the middle of the log (deleted, renamed \
                         or unreadable): entries of this region and older ones are not indexed, \
                         since the missing regions may have removed them"
                    );
                }
                _ => {}
            }
            if expected.is_none_or(|e| id <= e) {
                expected = id.checked_sub(1);
            }
            if header.is_err() && file_len == 0 {
                // Created, but its header never written: it holds nothing
                // (headers are synced before any batch).
                drop(file);
                self.unlink(&path)?;
                report.empty_regions_removed += 1;
                return Ok(());
            }
            // A bad header hides nothing: every batch names its region and
            // verifies on its own, so the batches are read either way.
            let scrub = checks.scrub_tail && !newest_seen;
            let mut scrub_buf = None;
            let scan = scan?;
            if scan.verified_batches == 0 && scan.foreign_batches > 0 {
                // Intact records keyed with another secret, and none of
                // ours: decided once every region is scanned.
                foreign_only.push((id, path));
                foreign_batches += scan.foreign_batches;
                return Ok(());
            }
            if let (0, Err(reason)) = (scan.verified_batches, &header) {
                // Never deleted on recovery's own judgement: a read error
                // may be transient, and the bytes may matter to whoever
                // investigates.
                drop(file);
                // Only a member of the log (below its head or a region kept
                // above it) keeps its place; anything above is not one.
                let member = newest_seen || head.is_some_and(|h| id <= h);
                self.set_aside_region(id, &path, reason, member, &mut report);
                return Ok(());
            }
            verified_batches += scan.verified_batches;
            foreign_batches += scan.foreign_batches;
            if let Err(reason) = &header {
                report.damaged_headers += 1;
                tracing::warn!(region = id, path = %path.display(), %reason, batches = scan.verified_batches, "region header damaged; its batches verify on their own and are kept");
            }
            if scan.foreign_batches > 0 {
                tracing::warn!(
                    region = id,
                    batches = scan.foreign_batches,
                    "region holds records keyed with another secret; skipped them"
                );
            }
            report.regions += 1;
            if !direct {
                report.buffered_regions += 1;
            }
            if let Ok(header) = &header {
                report.max_seq = report.max_seq.max(header.first_seq.saturating_sub(1));
            }
            if let Some((offset, reason)) = &scan.first_problem {
                report.damaged_regions += 1;
                report.skipped_pages += scan.skipped_pages;
                tracing::warn!(region = id, offset, file_len, skipped_pages = scan.skipped_pages, %reason, "pages without a valid batch (a torn tail or damage); resynchronised past them");
            }
            for (batch_start, entry) in entries_here {
                report.records += 1;
                report.max_seq = report.max_seq.max(entry.seq);
                if behind_gap {
                    report.entries_behind_gap += 1;
                    continue;
                }
                if scrub && entry.kind == format::RecordKind::Put {
                    // The previous run did not close: a device that
                    // acknowledged a flush it did not do may have kept
                    // this record and lost its values. Read them first.
                    let buf = scrub_buf.get_or_insert_with(|| AlignedBuf::zeroed(SCRUB_PIECE));
                    report.scrubbed_entries += 1;
                    let scrub_started = std::time::Instant::now();
                    let verifies = value_verifies(&file, batch_start, &entry, buf);
                    scrub_time += scrub_started.elapsed();
                    if !verifies {
                        report.scrub_dropped += 1;
                        tracing::warn!(region = id, seq = entry.seq, "the newest region names a value that does not verify (lost by the device after an unclean shutdown); not indexed");
                        let loc = DiskLoc::new(id, 0);
                        let entry = RecordEntry {
                            kind: format::RecordKind::Tombstone,
                            value_offset: 0,
                            value_len: 0,
                            checksum: 0,
                            ..entry
                        };
                        apply(RecoveredEntry {
                            entry,
                            loc,
                            value_lost: true,
                        });
                        continue;
                    }
                }
                let page = (batch_start + entry.value_offset) / PAGE_SIZE;
                let loc = DiskLoc::new(id, page as u32);
                apply(RecoveredEntry {
                    entry,
                    loc,
                    value_lost: false,
                });
            }
            if behind_gap {
                report.regions_behind_gap += 1;
            }
            newest_seen = true;
            self.used.fetch_add(file_len, Ordering::AcqRel);
            let bounded = self.bounds_reads_of(&file);
            let region = Region::new(id, file, path, file_len, direct, &self.engine, bounded);
            self.regions.write().unwrap().insert(id, Arc::new(region));
            Ok(())
        })?;
        if !checks.identity_confirmed && verified_batches == 0 && foreign_batches > 0 {
            // Nothing here verifies under this secret and something would
            // under another: the key-secret file is wrong, not the regions.
            // Refuse before anything is moved (or later reclaimed).
            return Err(Error::new(
                crate::ErrorKind::Corruption,
                format!(
                    "no batch record in {} verifies under this directory's key-secret, and {} \
                     intact ones were keyed with another: the key-secret file is damaged or \
                     belongs to another directory; restore it (nothing was changed)",
                    self.dir.display(),
                    foreign_batches
                ),
            ));
        }
        let newest_kept = self.regions.read().unwrap().keys().next_back().copied();
        for (id, path) in foreign_only {
            let member = head.is_some_and(|h| id <= h) || newest_kept.is_some_and(|k| id < k);
            tracing::error!(region = id, "region records are keyed with another secret");
            self.set_aside_region(
                id,
                &path,
                "records keyed with another secret (not this directory's)",
                member,
                &mut report,
            );
            report.foreign_regions += 1;
        }
        report.batches = verified_batches;
        report.scrub_ms = scrub_time.as_millis() as u64;
        // The next id follows every region file still here (kept, or left
        // in place because it could not be moved) and the log head; ids of
        // files set aside are free again (the new file's name differs by
        // node and incarnation), so they leave no gap.
        let mut next_region = head.map_or(0, |head| head.saturating_add(1));
        for item in fs::read_dir(&self.dir)
            .map_err(|e| Error::io(format!("listing {}", self.dir.display()), e))?
            .flatten()
        {
            if let Some(RegionName { id, node, .. }) =
                parse_region_name(&item.file_name().to_string_lossy())
            {
                if id <= self.max_region_id && node.is_none_or(|node| node == self.node_id) {
                    next_region = next_region.max(id + 1);
                }
            }
        }
        self.writer.lock().unwrap().next_region = next_region;
        Ok(report)
    }

    /// Opens the file that holds region `id` (several names for one id keep
    /// the longest; the others are set aside). Anything that is not a
    /// regular file after following links, or cannot be opened, is set
    /// aside or skipped with a warning instead of refusing the whole open.
    fn open_candidate(
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
        // The longest copy holds every batch a shorter copy of the same
        // log holds; the others are kept for inspection.
        opened.sort_by(|a, b| b.3.cmp(&a.3).then_with(|| a.0.cmp(&b.0)));
        let mut opened = opened.into_iter();
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

    /// Moves what recovery cannot use into quarantine, or leaves it in place
    /// with a warning if even that fails; never refuses the open for it.
    fn set_aside(&self, path: &Path, reason: &str, report: &mut RecoveryReport) {
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
    fn set_aside_region(
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

    /// The id of the newest region the log has created, if the head file
    /// is there and whole (directories written before it have none).
    fn read_head(&self) -> Option<u32> {
        let path = self.head_path();
        let text = match fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot read the log head; missing newest regions will not be noticed");
                return None;
            }
        };
        match parse_head(&text) {
            Some(id) => Some(id),
            None => {
                tracing::warn!(path = %path.display(), "the log head file is damaged; missing newest regions will not be noticed");
                None
            }
        }
    }

    fn head_path(&self) -> PathBuf {
        self.dir.parent().unwrap_or(&self.dir).join(HEAD_FILE)
    }

    /// Records `id` as the newest region created: through a synced
    /// temporary file and a rename, so the file is always whole.
    fn write_head(&self, id: u32) -> std::io::Result<()> {
        let data_dir = self.dir.parent().unwrap_or(&self.dir);
        crate::data_dir::replace_file(data_dir, HEAD_FILE, format_head(id).as_bytes(), 0o600)?;
        sync_dir(data_dir)
    }

    /// Every record entry of a region with its value's location, for the
    /// reclaimer, and whether every page of it was read (if not, entries
    /// the index holds may point into it unseen: the caller sweeps).
    pub fn region_entries(&self, region: &Region) -> Result<(Vec<RecoveredEntry>, bool)> {
        let mut out = Vec::new();
        let mut reader = RegionReader::new(&region.file, region.len());
        let scan = scan_region(
            &mut reader,
            region.id,
            &self.secret,
            |batch_start, entries| {
                for entry in entries {
                    let page = ((batch_start + entry.value_offset) / PAGE_SIZE) as u32;
                    out.push(RecoveredEntry {
                        entry,
                        loc: DiskLoc::new(region.id, page),
                        value_lost: false,
                    });
                }
            },
        )?;
        Ok((out, scan.first_problem.is_none()))
    }

    /// Installs the check asked before every batch (once; later calls are
    /// ignored): with a shared directory, that this node still holds its
    /// writer lock, so a second writer that took the lock file's name never
    /// writes beside this one.
    pub fn set_write_guard(&self, guard: WriteGuard) {
        let _ = self.write_guard.0.set(guard);
    }

    /// Writes one batch and makes it durable. On return, each put entry's
    /// value is at the returned location (in `entries` order, puts only).
    pub fn write_batch(
        &self,
        batch: &mut PendingBatch<'_>,
        first_seq: u64,
    ) -> Result<Vec<DiskLoc>> {
        if let Some(guard) = self.write_guard.0.get() {
            guard()?;
        }
        let record_len = format::record_len(batch.entries.iter().map(|e| e.key.len()));
        let record_pages = page_round_up(record_len as u64);
        let batch_len = batch.disk_len();
        let mut writer = self.writer.lock().unwrap();
        let region = match &writer.active {
            Some(region) if region.is_empty() || region.len() + batch_len <= self.region_size => {
                Arc::clone(region)
            }
            _ => {
                writer.active = None;
                let region = self.create_region(&mut writer, first_seq)?;
                writer.active = Some(Arc::clone(&region));
                region
            }
        };
        let start = region.len();
        // Assign value offsets in order.
        let mut offset = record_pages;
        let mut values = batch.values.iter();
        let mut locs = Vec::with_capacity(batch.values.len());
        for entry in batch.entries.iter_mut() {
            if entry.kind == format::RecordKind::Put {
                let value = values.next().expect("one value per put entry");
                entry.value_offset = offset;
                locs.push(DiskLoc::new(
                    region.id,
                    ((start + offset) / PAGE_SIZE) as u32,
                ));
                offset += value.len() as u64;
            }
        }
        debug_assert_eq!(offset, batch_len);
        let mut record = AlignedBuf::zeroed(record_pages as usize);
        format::encode_record(record.as_mut_slice(), region.id, batch_len, &batch.entries);
        // The crash protocol (docs/design.md, section 4): values first,
        // synced; only then the record that commits them, synced. A record
        // that survives a power loss therefore names values that did too;
        // a batch whose record did not survive was never acknowledged.
        let values: Vec<IoSlice<'_>> = batch.values.iter().map(|v| IoSlice::new(v)).collect();
        let written = if self.single_sync {
            let mut iov = vec![IoSlice::new(record.as_slice())];
            iov.extend(values.iter().copied());
            self.engine
                .write_vectored_at(&region.file, start, &iov)
                .and_then(|()| self.engine.sync_data(&region.file))
        } else {
            let values_written = if values.is_empty() {
                Ok(())
            } else {
                self.engine
                    .write_vectored_at(&region.file, start + record_pages, &values)
                    .and_then(|()| self.engine.sync_data(&region.file))
            };
            values_written
                .and_then(|()| {
                    self.engine.write_vectored_at(
                        &region.file,
                        start,
                        &[IoSlice::new(record.as_slice())],
                    )
                })
                .and_then(|()| self.engine.sync_data(&region.file))
        };
        // Whatever happened, those bytes may be on disk now.
        region.len.store(start + batch_len, Ordering::Release);
        self.used.fetch_add(batch_len, Ordering::AcqRel);
        if let Err(e) = written {
            // Never append after a batch that may be half written: a later
            // scan stops there and would miss everything behind it.
            writer.active = None;
            return Err(Error::io(
                format!(
                    "writing a {batch_len}-byte batch to {}",
                    region.path.display()
                ),
                e,
            ));
        }
        Ok(locs)
    }

    fn create_region(&self, writer: &mut WriterState, first_seq: u64) -> Result<Arc<Region>> {
        let id = writer.next_region;
        if id > self.max_region_id {
            return Err(Error::new(
                crate::ErrorKind::NoSpace,
                format!(
                    "the region log in {} has used every region id (up to {}); \
                     move the directory aside and start empty",
                    self.dir.display(),
                    self.max_region_id
                ),
            ));
        }
        writer.next_region = id + 1;
        let path = self.region_path(id);
        let (file, direct) = self.open_file(&path, true)?;
        let mut page = AlignedBuf::zeroed(REGION_HEADER_LEN as usize);
        RegionHeader {
            region: id,
            first_seq,
        }
        .encode(page.as_mut_slice());
        let bounded = self.bounds_reads_of(&file);
        let region = Arc::new(Region::new(
            id,
            file,
            path.clone(),
            REGION_HEADER_LEN,
            direct,
            &self.engine,
            bounded,
        ));
        self.regions
            .write()
            .unwrap()
            .insert(id, Arc::clone(&region));
        self.used.fetch_add(REGION_HEADER_LEN, Ordering::AcqRel);
        let written = self
            .engine
            .write_vectored_at(&region.file, 0, &[IoSlice::new(page.as_slice())])
            .and_then(|()| self.engine.sync_data(&region.file))
            .and_then(|()| sync_dir(&self.dir))
            .and_then(|()| self.write_head(id));
        if let Err(e) = written {
            // Nothing was committed to it: take it back out, so that a long
            // outage (a retry a second) does not pile up files and
            // descriptors. If the unlink fails too, recovery removes the
            // file (an empty or header-less region holds nothing).
            self.regions.write().unwrap().remove(&id);
            self.used.fetch_sub(REGION_HEADER_LEN, Ordering::AcqRel);
            drop(region);
            if fs::remove_file(&path).is_ok() {
                // Nothing of it is left: the id is free again, so the ids
                // of the log's regions stay contiguous (a gap reads as a
                // missing region at the next recovery).
                writer.next_region = id;
            }
            return Err(Error::io(
                format!("creating region file {}", path.display()),
                e,
            ));
        }
        Ok(region)
    }

    /// The oldest region, for the reclaimer. The active region is sealed
    /// first if it is the only one left.
    pub fn oldest_region(&self) -> Option<Arc<Region>> {
        let oldest = self.regions.read().unwrap().values().next().cloned()?;
        let mut writer = self.writer.lock().unwrap();
        if writer.active.as_ref().is_some_and(|a| a.id == oldest.id) {
            writer.active = None;
        }
        Some(oldest)
    }

    /// Deletes a region file. The directory is synced so that a removed
    /// region (perhaps holding tombstones' older values) cannot come back
    /// after a crash while a newer one stays removed.
    pub fn remove_region(&self, id: u32) -> Result<()> {
        let Some(region) = self.regions.write().unwrap().remove(&id) else {
            return Ok(());
        };
        {
            let mut writer = self.writer.lock().unwrap();
            if writer.active.as_ref().is_some_and(|a| a.id == id) {
                writer.active = None;
            }
        }
        if let Err(e) = self.unlink(&region.path) {
            // Keep it as the oldest region: reclaim retries its removal
            // before any newer region goes. Removing a newer region first
            // could drop a tombstone while the value it removed stays on
            // disk, and bring the value back at the next restart.
            self.regions.write().unwrap().insert(id, region);
            return Err(e);
        }
        self.used.fetch_sub(region.len(), Ordering::AcqRel);
        sync_dir(&self.dir).map_err(|e| Error::io(format!("syncing {}", self.dir.display()), e))
    }

    /// Moves a region file into `<data_dir>/quarantine/`, named by its
    /// region file name and the time, and syncs both directories.
    fn quarantine(&self, path: &Path, reason: &str) -> Result<PathBuf> {
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

    /// Removes a file; one already gone (deleted by hand under a running
    /// store) counts as removed, or reclaim would retry it forever.
    fn unlink(&self, path: &Path) -> Result<()> {
        match fs::remove_file(path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                tracing::warn!(path = %path.display(), "a region file was already gone when reclaimed");
                Ok(())
            }
            Err(e) => Err(Error::io(format!("removing {}", path.display()), e)),
        }
    }

    /// A new region file's path: `<node id>-<incarnation>-<region>.kvr`.
    fn region_path(&self, id: u32) -> PathBuf {
        self.dir.join(format!(
            "{}-{:016x}-{id:08x}{REGION_SUFFIX}",
            self.node_id, self.incarnation
        ))
    }

    /// Opens a region file, with O_DIRECT unless its file system refuses
    /// it; returns whether it did. Only a new file (on the directory's own
    /// file system) turns O_DIRECT off for the files that follow; an
    /// existing file that refuses it is read buffered on its own.
    fn open_file(&self, path: &Path, create: bool) -> Result<(File, bool)> {
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

    pub fn direct_io(&self) -> bool {
        self.direct_io.load(Ordering::Relaxed)
    }
}

/// Where each value stored in the data directory `data_dir` lies, read
/// from its region files' batch records without opening the store (so it
/// may run beside a live store or server, read-only): each qualified key's
/// newest put, unless a newer tombstone removed it. A snapshot for tools
/// that replay the store's disk reads raw (the bench's shape-matched stream
/// through a server); the store's own index stays the authority. Meant for
/// a directory one node writes (sequence numbers order one node's puts).
#[cfg(feature = "internals")]
pub fn value_locations(
    data_dir: &Path,
) -> Result<std::collections::HashMap<Vec<u8>, DiskLocation>> {
    let secret = crate::data_dir::read_secret(data_dir)?;
    let dir = data_dir.join(REGION_DIR);
    let listing =
        fs::read_dir(&dir).map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
    let mut newest: std::collections::HashMap<Vec<u8>, (u64, Option<DiskLocation>)> =
        std::collections::HashMap::new();
    for item in listing {
        let path = item
            .map_err(|e| Error::io(format!("listing {}", dir.display()), e))?
            .path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        let Some(RegionName { id, .. }) = parse_region_name(&name) else {
            continue;
        };
        let file = match File::open(&path) {
            Ok(file) => file,
            // Reclaimed by the live store since the listing.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(Error::io(format!("opening {}", path.display()), e)),
        };
        let file_len = file
            .metadata()
            .map_err(|e| Error::io(format!("reading size of {}", path.display()), e))?
            .len();
        let mut reader = RegionReader::new(&file, file_len);
        let named = file_len >= REGION_HEADER_LEN
            && reader
                .read(0, PAGE_SIZE as usize, false)
                .is_ok_and(|page| RegionHeader::decode(page).is_ok_and(|h| h.region == id));
        if !named {
            continue;
        }
        scan_region(&mut reader, id, &secret, |batch_start, entries| {
            for entry in entries {
                if newest
                    .get(&entry.key)
                    .is_some_and(|(seq, _)| *seq > entry.seq)
                {
                    continue;
                }
                let location = (entry.kind == format::RecordKind::Put).then(|| DiskLocation {
                    path: path.clone(),
                    offset: batch_start + entry.value_offset,
                    len: entry.value_len,
                    digest: entry.digest,
                    checksum: entry.checksum,
                });
                newest.insert(entry.key, (entry.seq, location));
            }
        })?;
    }
    Ok(newest
        .into_iter()
        .filter_map(|(key, (_, location))| Some((key, location?)))
        .collect())
}

/// Reads a region file through one aligned window: pieces the window
/// holds are served from it; a miss reads a new window at the requested
/// offset, the bytes asked for (healthy logs: a record's pages) or, while
/// resynchronising through damage, `SCAN_WINDOW` bytes, so that an
/// unreadable region is crossed in big reads instead of one page each.
struct RegionReader<'f> {
    file: &'f File,
    file_len: u64,
    buf: AlignedBuf,
    /// File offset of `buf[0]` and how many bytes of it are valid.
    start: u64,
    valid: usize,
}

impl<'f> RegionReader<'f> {
    fn new(file: &'f File, file_len: u64) -> Self {
        RegionReader {
            file,
            file_len,
            buf: AlignedBuf::zeroed(PAGE_SIZE as usize),
            start: 0,
            valid: 0,
        }
    }

    /// `len` bytes at page-aligned `offset`, which must lie inside the file.
    fn read(&mut self, offset: u64, len: usize, ahead: bool) -> std::io::Result<&[u8]> {
        let end = offset
            .checked_add(len as u64)
            .filter(|&end| end <= self.file_len)
            .ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("{len} bytes at {offset} lie past the end of the file"),
                )
            })?;
        let held = offset >= self.start && end <= self.start + self.valid as u64;
        if !held {
            // Callers ask for whole pages inside the file; a window reaches
            // further, up to the last whole page.
            let whole_pages_end = self.file_len / PAGE_SIZE * PAGE_SIZE;
            let mut want = page_round_up(len as u64).max(RECORD_READ as u64);
            if ahead {
                want = want.max(SCAN_WINDOW as u64);
            }
            let want = want
                .min(whole_pages_end.saturating_sub(offset))
                .max(len as u64) as usize;
            if self.buf.len() < want {
                self.buf = AlignedBuf::zeroed(want);
            }
            self.valid = 0;
            pread_full(self.file, offset, &mut self.buf.as_mut_slice()[..want])?;
            self.start = offset;
            self.valid = want;
        }
        let from = (offset - self.start) as usize;
        Ok(&self.buf.as_slice()[from..from + len])
    }
}

/// Visits each valid batch of region `id` in order. A page where no valid
/// batch starts (torn, corrupt, unreadable, or past the end of the file)
/// is skipped and the scan resynchronises on the next page that starts a
/// valid batch, so one bad record never hides the good ones (or the
/// tombstones) after it. A record cannot be forged inside a value: every
/// entry's digest is keyed with the directory's secret. Every offset is
/// checked arithmetic and strictly increases, so no content can make the
/// scan loop or wrap.
fn scan_region(
    reader: &mut RegionReader<'_>,
    id: u32,
    secret: &KeySecret,
    mut visit: impl FnMut(u64, Vec<RecordEntry>),
) -> Result<ScanEnd> {
    let file_len = reader.file_len;
    let mut scan = ScanEnd {
        end: REGION_HEADER_LEN,
        skipped_pages: 0,
        verified_batches: 0,
        foreign_batches: 0,
        first_problem: None,
    };
    let mut offset = REGION_HEADER_LEN;
    let mut resyncing = false;
    while offset
        .checked_add(PAGE_SIZE)
        .is_some_and(|end| end <= file_len)
    {
        match read_batch_at(reader, id, secret, offset, resyncing) {
            Ok((batch_len, entries)) => {
                visit(offset, entries);
                scan.verified_batches += 1;
                // read_batch_at checked that the batch lies in the file.
                offset += batch_len;
                scan.end = offset;
                resyncing = false;
            }
            Err((fault, batch_len)) => {
                if fault == RecordFault::ForeignDigests {
                    // Whole, but not ours: step over it as a batch.
                    scan.foreign_batches += 1;
                    offset += batch_len.unwrap_or(PAGE_SIZE);
                    continue;
                }
                if scan.first_problem.is_none() {
                    scan.first_problem = Some((offset, fault.reason()));
                }
                scan.skipped_pages += 1;
                offset += PAGE_SIZE;
                resyncing = true;
            }
        }
    }
    if offset < file_len && scan.first_problem.is_none() {
        scan.first_problem = Some((offset, "partial page at the end of the file".into()));
    }
    Ok(scan)
}

/// Reads and verifies the batch starting at `offset`: its length and
/// record entries. On failure, the batch's length where its header was
/// whole enough to tell it.
fn read_batch_at(
    reader: &mut RegionReader<'_>,
    id: u32,
    secret: &KeySecret,
    offset: u64,
    resyncing: bool,
) -> std::result::Result<(u64, Vec<RecordEntry>), (RecordFault, Option<u64>)> {
    let file_len = reader.file_len;
    let first = reader
        .read(offset, PAGE_SIZE as usize, resyncing)
        .map_err(|e| (format!("read failed: {e}").into(), None))?;
    let header = BatchHeader::decode(first, id).map_err(|e| (e.into(), None))?;
    if offset
        .checked_add(header.batch_len)
        .is_none_or(|end| end > file_len)
    {
        return Err(("batch extends past the end of the file".into(), None));
    }
    let padded = header.padded_record_len() as usize;
    let record = reader
        .read(offset, padded, resyncing)
        .map_err(|e| (format!("read failed: {e}").into(), None))?;
    let entries = format::decode_record(record, &header, secret)
        .map_err(|fault| (fault, Some(header.batch_len)))?;
    Ok((header.batch_len, entries))
}

/// Whether the value a put entry names (in the batch at `batch_start`)
/// reads back and matches its checksum; `buf` is scratch, at least a page.
fn value_verifies(
    file: &File,
    batch_start: u64,
    entry: &RecordEntry,
    buf: &mut AlignedBuf,
) -> bool {
    let Some(mut at) = batch_start.checked_add(entry.value_offset) else {
        return false;
    };
    let mut left = u64::from(entry.value_len);
    let mut checksum = ValueChecksum::new(entry.digest);
    while left > 0 {
        let piece = left.min(buf.len() as u64);
        let padded = page_round_up(piece) as usize;
        if pread_full(file, at, &mut buf.as_mut_slice()[..padded]).is_err() {
            // The last page of a value may end the file (buffered files):
            // fall back to the exact length.
            if pread_full(file, at, &mut buf.as_mut_slice()[..piece as usize]).is_err() {
                return false;
            }
        }
        checksum.update(&buf.as_slice()[..piece as usize]);
        at += piece;
        left -= piece;
    }
    checksum.finish() == entry.checksum
}

#[derive(Debug)]
/// How a region scan went.
struct ScanEnd {
    /// End of the last valid batch.
    end: u64,
    /// Pages where no valid batch started (skipped by resynchronising).
    skipped_pages: u64,
    /// Batches that verified, and batches that were whole but keyed with
    /// another secret (skipped).
    verified_batches: u64,
    foreign_batches: u64,
    /// The first such page and why.
    first_problem: Option<(u64, String)>,
}

/// A region file name, parsed.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct RegionName<'a> {
    pub id: u32,
    /// `None` for format 2's names (the region id alone).
    pub node: Option<&'a str>,
    /// The open that created the file (0 for format 2's names).
    pub incarnation: u64,
}

/// `<node id>-<incarnation>-<region>.kvr` (32, 16 and 8 lower-case hex
/// digits), or format 2's `<region>.kvr`.
pub(crate) fn parse_region_name(name: &str) -> Option<RegionName<'_>> {
    let stem = name.strip_suffix(REGION_SUFFIX)?;
    let hex = |s: &str, len: usize| {
        s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    };
    let parts: Vec<&str> = stem.split('-').collect();
    match parts[..] {
        [region] if hex(region, 8) => Some(RegionName {
            id: u32::from_str_radix(region, 16).ok()?,
            node: None,
            incarnation: 0,
        }),
        [node, incarnation, region] if hex(node, 32) && hex(incarnation, 16) && hex(region, 8) => {
            Some(RegionName {
                id: u32::from_str_radix(region, 16).ok()?,
                node: Some(node),
                incarnation: u64::from_str_radix(incarnation, 16).ok()?,
            })
        }
        _ => None,
    }
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

/// The log head file's text: a line naming the newest region created, and
/// a checksum of that line (docs/design.md, "Log head").
fn format_head(id: u32) -> String {
    let line = format!("kvtier log head {id:08x}");
    format!(
        "{line} {:016x}\n",
        xxhash_rust::xxh3::xxh3_64(line.as_bytes())
    )
}

pub(super) fn parse_head(text: &str) -> Option<u32> {
    let text = text.strip_suffix('\n')?;
    let (line, sum) = text.rsplit_once(' ')?;
    if u64::from_str_radix(sum, 16).ok()? != xxhash_rust::xxh3::xxh3_64(line.as_bytes()) {
        return None;
    }
    let id = line.strip_prefix("kvtier log head ")?;
    (id.len() == 8).then(|| u32::from_str_radix(id, 16).ok())?
}
