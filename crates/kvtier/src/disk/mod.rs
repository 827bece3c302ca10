//! The disk tier: a log of region files written in whole batches.
//!
//! Each batch is one vectored write: a checksummed batch record (the commit
//! record, naming every value's key, digest, length, checksum and
//! sequence), then the values, each page-aligned so reads can be O_DIRECT
//! straight into the caller's buffer. A write is followed by `fdatasync`
//! before anything in it is reported durable. Recovery reads only the
//! records. See docs/design.md for the bytes and the crash protocol.

pub mod faulty;
pub mod format;
pub mod io;
pub mod uring;

use crate::config::{page_round_up, Config, IoEngineKind, PAGE_SIZE};
use crate::error::{Error, Result};
use crate::index::DiskLoc;
use crate::key::KeySecret;
use format::{BatchHeader, RecordEntry, RegionHeader, REGION_HEADER_LEN};
use io::{pread_full, AlignedBuf, BufferPool, IoEngine, PsyncEngine};
use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::IoSlice;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

pub(crate) const REGION_DIR: &str = "regions";
/// Where recovery moves region files it cannot read (next to `regions/`).
pub(crate) const QUARANTINE_DIR: &str = "quarantine";
/// How often recovery logs its progress.
const RECOVERY_PROGRESS_EVERY: std::time::Duration = std::time::Duration::from_secs(2);
const REGION_SUFFIX: &str = ".kvr";

#[derive(Debug)]
pub struct Region {
    pub id: u32,
    pub file: File,
    path: PathBuf,
    /// Bytes of the file in use (header plus every batch written).
    len: AtomicU64,
    /// Told when the file opens and before it closes (registered files).
    engine: Arc<dyn IoEngine>,
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

    fn new(id: u32, file: File, path: PathBuf, len: u64, engine: &Arc<dyn IoEngine>) -> Region {
        engine.register_file(&file);
        Region {
            id,
            file,
            path,
            len: AtomicU64::new(len),
            engine: Arc::clone(engine),
        }
    }

    pub fn len(&self) -> u64 {
        self.len.load(Ordering::Acquire)
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
}

/// What recovery saw, for logs and tests.
#[derive(Debug, Default, Clone)]
pub struct RecoveryReport {
    pub regions: u64,
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
    bounce: BufferPool,
    /// Every record's digests are checked against it.
    secret: Arc<KeySecret>,
    /// Test seam (`Config::unsafe_single_sync_batches`).
    single_sync: bool,
    /// New region files are named `<node_id>-<incarnation>-<region>.kvr`:
    /// a name is never reused, even if a region id is after a reclaim.
    node_id: String,
    incarnation: u64,
}

/// Bytes of bounce buffers kept for reuse between reads.
const BOUNCE_CACHE_BYTES: usize = 256 << 20;

impl DiskTier {
    /// Opens (or creates) the region log under `config.data_dir` and hands
    /// every record entry of every valid batch, in log order, to `apply`.
    pub fn open(
        config: &Config,
        secret: Arc<KeySecret>,
        node_id: &str,
        mut apply: impl FnMut(RecoveredEntry),
    ) -> Result<(DiskTier, RecoveryReport)> {
        let dir = config.data_dir.join(REGION_DIR);
        fs::create_dir_all(&dir)
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
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
        let engine = match &config.engine_wrapper {
            Some(wrap) => (wrap.0)(engine),
            None => engine,
        };
        let tier = DiskTier {
            dir,
            engine,
            single_sync: config.skip_value_sync,
            direct_io: AtomicBool::new(config.direct_io),
            capacity: config.disk_capacity,
            region_size: config.effective_region_size(),
            regions: RwLock::new(BTreeMap::new()),
            used: AtomicU64::new(0),
            writer: Mutex::new(WriterState {
                active: None,
                next_region: 0,
            }),
            bounce: BufferPool::new(BOUNCE_CACHE_BYTES),
            secret,
            node_id: node_id.to_string(),
            // This open's incarnation: nanoseconds since the Unix epoch.
            incarnation: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64),
        };
        let report = tier.recover(&mut apply)?;
        Ok((tier, report))
    }

    pub fn engine_name(&self) -> &'static str {
        self.engine.name()
    }

    pub fn engine(&self) -> &dyn IoEngine {
        &*self.engine
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Buffers for reads whose destination O_DIRECT cannot use as is.
    pub fn bounce_buffers(&self) -> &BufferPool {
        &self.bounce
    }

    /// Bytes of region files on disk.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }

    pub fn region_count(&self) -> usize {
        self.regions.read().unwrap().len()
    }

    pub fn region(&self, id: u32) -> Option<Arc<Region>> {
        self.regions.read().unwrap().get(&id).cloned()
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

    fn recover(&self, apply: &mut impl FnMut(RecoveredEntry)) -> Result<RecoveryReport> {
        let mut report = RecoveryReport::default();
        let mut ids: BTreeMap<u32, PathBuf> = BTreeMap::new();
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
                Some(RegionName { id, .. }) => {
                    if let Some(other) = ids.insert(id, item.path()) {
                        return Err(Error::new(
                            crate::ErrorKind::Corruption,
                            format!(
                                "two region files claim region {id}: {} and {}; move one aside",
                                other.display(),
                                item.path().display()
                            ),
                        ));
                    }
                }
                None => {
                    tracing::warn!(file = %name, "ignoring unknown file in the region directory")
                }
            }
        }
        let mut next_region = 0u32;
        // A large directory takes a while: say how far along it is.
        let total = ids.len();
        let started = std::time::Instant::now();
        let mut reported = started;
        for (done, (id, path)) in ids.into_iter().enumerate() {
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
            next_region = next_region.max(id.saturating_add(1));
            let file = self.open_file(&path, false)?;
            let file_len = file
                .metadata()
                .map_err(|e| Error::io(format!("reading size of {}", path.display()), e))?
                .len();
            let mut page = AlignedBuf::zeroed(PAGE_SIZE as usize);
            let header = if file_len < REGION_HEADER_LEN {
                Err("region file shorter than its header".to_string())
            } else {
                pread_full(&file, 0, page.as_mut_slice())
                    .map_err(|e| e.to_string())
                    .and_then(|()| RegionHeader::decode(page.as_slice()))
                    .and_then(|h| {
                        if h.region == id {
                            Ok(h)
                        } else {
                            Err(format!("header names region {}", h.region))
                        }
                    })
            };
            let header = match header {
                Ok(header) => header,
                Err(_) if file_len == 0 => {
                    // Created, but its header never written: it holds
                    // nothing (headers are synced before any batch).
                    drop(file);
                    self.unlink(&path)?;
                    report.empty_regions_removed += 1;
                    continue;
                }
                Err(reason) => {
                    // Never deleted on recovery's own judgement: a read
                    // error may be transient, and the bytes may matter to
                    // whoever investigates.
                    drop(file);
                    let moved = self.quarantine(&path, &reason)?;
                    tracing::error!(path = %path.display(), quarantined = %moved.display(), %reason, "region header unreadable; moved the file to quarantine");
                    report.quarantined_regions += 1;
                    continue;
                }
            };
            report.regions += 1;
            report.max_seq = report.max_seq.max(header.first_seq.saturating_sub(1));
            let region = Region::new(id, file, path, file_len, &self.engine);
            let scan = scan_region(
                &region.file,
                id,
                file_len,
                &self.secret,
                |batch_start, entries| {
                    report.batches += 1;
                    for entry in entries {
                        report.records += 1;
                        report.max_seq = report.max_seq.max(entry.seq);
                        let page = (batch_start + entry.value_offset) / PAGE_SIZE;
                        let loc = DiskLoc::new(id, page as u32);
                        apply(RecoveredEntry { entry, loc });
                    }
                },
            )?;
            if let Some((offset, reason)) = &scan.first_problem {
                report.damaged_regions += 1;
                report.skipped_pages += scan.skipped_pages;
                tracing::warn!(region = id, offset, file_len, skipped_pages = scan.skipped_pages, %reason, "pages without a valid batch (a torn tail or damage); resynchronised past them");
            }
            self.used.fetch_add(file_len, Ordering::AcqRel);
            self.regions.write().unwrap().insert(id, Arc::new(region));
        }
        self.writer.lock().unwrap().next_region = next_region;
        Ok(report)
    }

    /// Every record entry of a region with its value's location, for the
    /// reclaimer.
    pub fn region_entries(&self, region: &Region) -> Result<Vec<RecoveredEntry>> {
        let mut out = Vec::new();
        scan_region(
            &region.file,
            region.id,
            region.len(),
            &self.secret,
            |batch_start, entries| {
                for entry in entries {
                    let page = ((batch_start + entry.value_offset) / PAGE_SIZE) as u32;
                    out.push(RecoveredEntry {
                        entry,
                        loc: DiskLoc::new(region.id, page),
                    });
                }
            },
        )?;
        Ok(out)
    }

    /// Writes one batch and makes it durable. On return, each put entry's
    /// value is at the returned location (in `entries` order, puts only).
    pub fn write_batch(
        &self,
        batch: &mut PendingBatch<'_>,
        first_seq: u64,
    ) -> Result<Vec<DiskLoc>> {
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
        writer.next_region = id
            .checked_add(1)
            .filter(|&next| next < u32::MAX)
            .ok_or_else(|| Error::new(crate::ErrorKind::Corruption, "region ids exhausted"))?;
        let path = self.region_path(id);
        let file = self.open_file(&path, true)?;
        let mut page = AlignedBuf::zeroed(REGION_HEADER_LEN as usize);
        RegionHeader {
            region: id,
            first_seq,
        }
        .encode(page.as_mut_slice());
        let region = Arc::new(Region::new(
            id,
            file,
            path.clone(),
            REGION_HEADER_LEN,
            &self.engine,
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
            .and_then(|()| sync_dir(&self.dir));
        if let Err(e) = written {
            // Nothing was committed to it: take it back out, so that a long
            // outage (a retry a second) does not pile up files and
            // descriptors. If the unlink fails too, recovery removes the
            // file (an empty or header-less region holds nothing).
            self.regions.write().unwrap().remove(&id);
            self.used.fetch_sub(REGION_HEADER_LEN, Ordering::AcqRel);
            drop(region);
            let _ = fs::remove_file(&path);
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
        fs::create_dir_all(&dir)
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let target = dir.join(format!("{name}.{stamp}"));
        fs::rename(path, &target)
            .map_err(|e| Error::io(format!("quarantining {} ({reason})", path.display()), e))?;
        fs::write(
            dir.join(format!("{name}.{stamp}.why")),
            format!("{reason}\n"),
        )
        .map_err(|e| Error::io(format!("writing to {}", dir.display()), e))?;
        sync_dir(&self.dir)
            .and_then(|()| sync_dir(&dir))
            .map_err(|e| Error::io(format!("syncing {}", dir.display()), e))?;
        Ok(target)
    }

    fn unlink(&self, path: &Path) -> Result<()> {
        fs::remove_file(path).map_err(|e| Error::io(format!("removing {}", path.display()), e))
    }

    /// A new region file's path: `<node id>-<incarnation>-<region>.kvr`.
    fn region_path(&self, id: u32) -> PathBuf {
        self.dir.join(format!(
            "{}-{:016x}-{id:08x}{REGION_SUFFIX}",
            self.node_id, self.incarnation
        ))
    }

    /// Opens a region file, with O_DIRECT unless the file system refuses it.
    fn open_file(&self, path: &Path, create: bool) -> Result<File> {
        let mut options = OpenOptions::new();
        options.read(true).write(true);
        if create {
            options.create_new(true);
        }
        if self.direct_io.load(Ordering::Relaxed) {
            let mut direct = options.clone();
            direct.custom_flags(libc::O_DIRECT);
            match direct.open(path) {
                Ok(file) => return Ok(file),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    tracing::warn!(dir = %self.dir.display(), "the file system refuses O_DIRECT; using buffered I/O");
                    self.direct_io.store(false, Ordering::Relaxed);
                    if create {
                        // The failed attempt may have created the file.
                        let _ = fs::remove_file(path);
                    }
                }
                Err(e) => return Err(Error::io(format!("opening {}", path.display()), e)),
            }
        }
        options
            .open(path)
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
pub fn value_locations(
    data_dir: &Path,
) -> Result<std::collections::HashMap<Vec<u8>, crate::DiskLocation>> {
    let secret = crate::data_dir::read_secret(data_dir)?;
    let dir = data_dir.join(REGION_DIR);
    let listing =
        fs::read_dir(&dir).map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
    let mut newest: std::collections::HashMap<Vec<u8>, (u64, Option<crate::DiskLocation>)> =
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
        let mut page = AlignedBuf::zeroed(PAGE_SIZE as usize);
        let named = file_len >= REGION_HEADER_LEN
            && pread_full(&file, 0, page.as_mut_slice()).is_ok()
            && RegionHeader::decode(page.as_slice()).is_ok_and(|h| h.region == id);
        if !named {
            continue;
        }
        scan_region(&file, id, file_len, &secret, |batch_start, entries| {
            for entry in entries {
                if newest
                    .get(&entry.key)
                    .is_some_and(|(seq, _)| *seq > entry.seq)
                {
                    continue;
                }
                let location =
                    (entry.kind == format::RecordKind::Put).then(|| crate::DiskLocation {
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

/// Visits each valid batch of region `id` (in `file`) in order. A page where no valid
/// batch starts (torn, corrupt, unreadable, or past `file_len`) is
/// skipped and the scan resynchronises on the next page that starts a
/// valid batch, so one bad record never hides the good ones (or the
/// tombstones) after it. A record cannot be forged inside a value:
/// every entry's digest is keyed with the directory's secret.
fn scan_region(
    file: &File,
    id: u32,
    file_len: u64,
    secret: &KeySecret,
    mut visit: impl FnMut(u64, Vec<RecordEntry>),
) -> Result<ScanEnd> {
    let mut scan = ScanEnd {
        end: REGION_HEADER_LEN,
        skipped_pages: 0,
        first_problem: None,
    };
    let mut buf = AlignedBuf::zeroed(PAGE_SIZE as usize);
    let mut offset = REGION_HEADER_LEN;
    while offset + PAGE_SIZE <= file_len {
        match read_batch_at(file, id, file_len, secret, offset, &mut buf) {
            Ok((batch_len, entries)) => {
                visit(offset, entries);
                offset += batch_len;
                scan.end = offset;
            }
            Err(reason) => {
                if scan.first_problem.is_none() {
                    scan.first_problem = Some((offset, reason));
                }
                scan.skipped_pages += 1;
                offset += PAGE_SIZE;
            }
        }
    }
    if offset < file_len && scan.first_problem.is_none() {
        scan.first_problem = Some((offset, "partial page at the end of the file".into()));
    }
    Ok(scan)
}

/// Reads and verifies the batch starting at `offset`: its length and
/// record entries.
fn read_batch_at(
    file: &File,
    id: u32,
    file_len: u64,
    secret: &KeySecret,
    offset: u64,
    buf: &mut AlignedBuf,
) -> std::result::Result<(u64, Vec<RecordEntry>), String> {
    pread_full(file, offset, &mut buf.as_mut_slice()[..PAGE_SIZE as usize])
        .map_err(|e| format!("read failed: {e}"))?;
    let header = BatchHeader::decode(buf.as_slice(), id)?;
    if offset + header.batch_len > file_len {
        return Err("batch extends past the end of the file".into());
    }
    let padded = header.padded_record_len() as usize;
    if padded > buf.len() {
        let mut bigger = AlignedBuf::zeroed(padded);
        bigger.as_mut_slice()[..PAGE_SIZE as usize]
            .copy_from_slice(&buf.as_slice()[..PAGE_SIZE as usize]);
        *buf = bigger;
    }
    if padded > PAGE_SIZE as usize {
        let rest = &mut buf.as_mut_slice()[PAGE_SIZE as usize..padded];
        pread_full(file, offset + PAGE_SIZE, rest).map_err(|e| format!("read failed: {e}"))?;
    }
    let entries = format::decode_record(buf.as_slice(), &header, secret)?;
    Ok((header.batch_len, entries))
}

#[derive(Debug)]
/// How a region scan went.
struct ScanEnd {
    /// End of the last valid batch.
    end: u64,
    /// Pages where no valid batch started (skipped by resynchronising).
    skipped_pages: u64,
    /// The first such page and why.
    first_problem: Option<(u64, String)>,
}

/// A region file name, parsed.
#[derive(Debug, PartialEq, Eq)]
struct RegionName<'a> {
    id: u32,
    /// `None` for format 2's names (the region id alone).
    node: Option<&'a str>,
}

/// `<node id>-<incarnation>-<region>.kvr` (32, 16 and 8 lower-case hex
/// digits), or format 2's `<region>.kvr`.
fn parse_region_name(name: &str) -> Option<RegionName<'_>> {
    let stem = name.strip_suffix(REGION_SUFFIX)?;
    let hex = |s: &str, len: usize| {
        s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    };
    let parts: Vec<&str> = stem.split('-').collect();
    match parts[..] {
        [region] if hex(region, 8) => Some(RegionName {
            id: u32::from_str_radix(region, 16).ok()?,
            node: None,
        }),
        [node, incarnation, region] if hex(node, 32) && hex(incarnation, 16) && hex(region, 8) => {
            Some(RegionName {
                id: u32::from_str_radix(region, 16).ok()?,
                node: Some(node),
            })
        }
        _ => None,
    }
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}
