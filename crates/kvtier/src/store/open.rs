//! Opening a store: the directory, its identity and lock, recovery of the
//! index from the region log (newest sequence wins per key), the tail
//! scrub's tombstones, the shared directory's follower, and the flusher.
//! `Store::open` composes the steps below in the order their side effects
//! must happen.

use super::{Inner, NamespacedStore, Store};
use crate::checkpoint::{CheckpointWriter, OwnRemovals};
use crate::config::{Config, FlushPolicy};
use crate::data_dir::Identity;
use crate::disk::format::{self, RecordKind};
use crate::disk::{DiskTier, RecoveryChecks, RecoveryReport};
use crate::error::{Error, Result};
use crate::flusher::{Flusher, FlusherHandle};
use crate::index::{Entry, Index};
use crate::key::{KeyDigest, KeySecret, Namespace};
use crate::lock::DirLock;
use crate::pool::{EvictionQueues, PoolCore};
use crate::region_writer::{NoteRemoval, RegionLogWriter, SharedHooks};
use crate::shared::{Follower, SharedDir};
use crate::tier::{LowerTier, TierWriter};
use crate::units::{page_round_up, PAGE_SIZE};
use crate::write_log::{
    ReadsFirst, WriteLog, EARLIEST_PLAUSIBLE_CLOCK_NANOS, LATEST_PLAUSIBLE_CLOCK_NANOS,
};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};

/// A tier plugged in through the seam in place of the region log
/// (`Store::open_with`).
pub(crate) struct PluggedTier {
    /// What the store reads through.
    pub lower: Arc<dyn LowerTier>,
    /// What the flusher writes through; none, and puts stay in memory.
    pub writer: Option<Box<dyn TierWriter>>,
}

impl Store {
    /// Opens the store in `config.data_dir`, creating it if needed and
    /// recovering the index from the region log if it exists.
    pub fn open(config: Config) -> Result<Store> {
        Store::open_with(config, None)
    }

    /// `open`, with `plugged` as the tier below memory instead of the
    /// region log (which must then be off: a disk capacity of 0): how a
    /// tier is plugged in through the seam (`tier::LowerTier` to read,
    /// `tier::TierWriter` for the flusher to write through). A tier
    /// without a writing half gets no flusher: puts stay in memory.
    pub(crate) fn open_with(config: Config, plugged: Option<PluggedTier>) -> Result<Store> {
        config.validate()?;
        check_clock_for_shared(&config)?;
        let (lower, plugged_writer) = match plugged {
            Some(p) => (Some(p.lower), p.writer),
            None => (None, None),
        };
        if lower.is_some() && config.disk_enabled() {
            return Err(Error::invalid(
                "a tier given to open_with replaces the region log: open with a disk capacity of 0",
            ));
        }
        let (lock, identity) = open_data_dir(&config)?;
        let place = LogPlace::settle(&config, identity)?;
        let default_namespace = Namespace::new(Arc::clone(&place.secret), &config.namespace)?;
        let index = Arc::new(Index::default());
        // Whether the last run closed cleanly: taken (and synced away) now,
        // so that a crash of this run is noticed by the next.
        let clean = crate::data_dir::take_clean_marker(&config.data_dir)?;
        // The pool is backed with memory while the disk tier recovers (the
        // two together took the sum of their times; the pre-fault alone
        // was most of a 1M-entry reopen on a virtual machine).
        let (pool, prefaulting) =
            PoolCore::new_prefaulting(config.memory_capacity, config.shareable_memory)?;
        let recovered = recover_disk(&config, &place, &index, clean)?;
        if !place.identity_confirmed {
            // The records (if any) verified under the secret: record it.
            crate::data_dir::write_key_check(&config.data_dir, &place.secret)?;
        }
        if let Some(disk) = &recovered.disk {
            guard_writes(disk, &place, &lock);
        }
        if prefaulting.join().is_err() {
            return Err(Error::invalid(
                "the memory pool's pre-fault thread panicked",
            ));
        }
        if let Some(disk) = &recovered.disk {
            // The flusher writes straight from the pool: pinned once here,
            // its pages need no pinning per write.
            if disk.engine().register_memory(Arc::clone(&pool) as _) {
                pool.exclude_from_fork();
            }
            log_opened(&config, disk, &recovered.report, &index);
        }
        let eviction = EvictionQueues::new(config.eviction, pool.capacity_pages());
        let Recovered {
            disk,
            report: recovery,
            own_tombstones,
            lost,
        } = recovered;
        let disk = disk.map(Arc::new);
        if let Some(shared) = &place.shared {
            // The data directory's marker in the writer directory too, for
            // the other nodes (a writer whose lock is free and who left no
            // marker stopped uncleanly: followers verify its newest
            // region's values). Taken once the log has opened: an open
            // refused before here changes nothing in the directory.
            crate::data_dir::take_clean_marker(&shared.writer_dir)?;
        }
        let log = Arc::new(open_write_log(
            &config,
            recovery.max_seq + 1,
            disk.as_deref(),
            place.shared.is_some(),
        )?);
        let shared_floor = Arc::new(AtomicU64::new(u64::MAX));
        let follower = match (&place.shared, &disk) {
            (Some(shared), Some(disk)) => {
                let follower = Follower::new(
                    &shared.root,
                    &place.node_id,
                    Arc::clone(disk),
                    Arc::clone(&index),
                    Arc::clone(&log),
                    own_tombstones,
                    Arc::clone(&shared_floor),
                )
                .bounded(config.shared_index_share)
                .step_deadline(config.io_deadline);
                Some(first_pass(follower, shared, &index))
            }
            _ => None,
        };
        // The shared directory's (for the other nodes, with the follower's
        // removals), or a local directory's: written at a clean close only
        // (the flusher has no hook without a follower), for the next open.
        let checkpoints = match (&place.shared, &disk, &follower) {
            (Some(shared), Some(disk), Some(follower)) => {
                let follower = Arc::clone(follower);
                let own_removals: OwnRemovals = Arc::new(move || follower.own_tombstones());
                Some((shared.writer_dir.as_path(), disk, Some(own_removals)))
            }
            (None, Some(disk), _) if config.local_checkpoints => {
                Some((config.data_dir.as_path(), disk, None))
            }
            _ => None,
        }
        .map(|(dir, disk, own_removals)| {
            Arc::new(CheckpointWriter::new(
                dir,
                &place.node_id,
                Arc::clone(&place.secret),
                Arc::clone(disk),
                Arc::clone(&index),
                Arc::clone(&log),
                own_removals,
                config.shared_checkpoint_interval,
            ))
        });
        let inner = Arc::new(Inner {
            max_put_len: max_put_len(&config, disk.as_deref()),
            config,
            index,
            pool,
            shadow: eviction.shadow(),
            eviction: Mutex::new(eviction),
            // The region log is the store's tier below memory, through the
            // seam; its own workers (flusher, follower, checkpoints) are
            // built from it here.
            lower: lower.or_else(|| disk.clone().map(|disk| disk as Arc<dyn LowerTier>)),
            #[cfg(test)]
            disk_for_tests: disk.clone(),
            writes_below: disk.is_some() || plugged_writer.is_some(),
            log,
            follower,
            checkpoints,
            shared: place.shared,
            counters: Arc::default(),
            closed: AtomicBool::new(false),
            lock: Mutex::new(Some(lock)),
            recovery,
            owner_pid: std::process::id(),
            secret: place.secret,
            node_id: place.node_id,
        });
        let flusher = spawn_flusher(&inner, disk.as_ref(), plugged_writer, &shared_floor)?;
        let follow_thread = spawn_follow_thread(&inner)?;
        let store = Store {
            default_view: NamespacedStore::new(Arc::clone(&inner), default_namespace),
            inner,
            flusher: Mutex::new(flusher),
            follow_thread: Mutex::new(follow_thread),
        };
        remove_lost_values(&store, lost)?;
        Ok(store)
    }
}

/// Creates (or checks) the data directory, private to the store's user
/// whatever the umask (created 0700, refused if another user owns it or
/// may write it: docs/design.md, "Private at rest"), locks it, and reads
/// or creates its identity.
fn open_data_dir(config: &Config) -> Result<(DirLock, Identity)> {
    crate::private::create_dir(&config.data_dir).map_err(|e| {
        Error::io(
            format!("creating data directory {}", config.data_dir.display()),
            e,
        )
    })?;
    let tightened = crate::private::check_dir(&config.data_dir).map_err(|e| {
        Error::io(
            format!("checking data directory {}", config.data_dir.display()),
            e,
        )
    })?;
    if tightened {
        tracing::warn!(dir = %config.data_dir.display(), "the data directory was readable by other users; made it private (mode 700)");
    }
    let lock = DirLock::acquire(&config.data_dir)?;
    let identity = crate::data_dir::open_or_create(
        &config.data_dir,
        &config.data_dir.join(crate::disk::REGION_DIR),
    )?;
    Ok((lock, identity))
}

/// Where this node's log lives and what keys its digests.
struct LogPlace {
    node_id: String,
    /// The shared directory, when the log is one writer's of it.
    shared: Option<SharedDir>,
    secret: Arc<KeySecret>,
    /// The key-secret matched its check value (or came with a shared
    /// directory).
    identity_confirmed: bool,
    /// The data directory, or this node's writer directory of a shared one.
    log_dir: PathBuf,
}

impl LogPlace {
    fn settle(config: &Config, identity: Identity) -> Result<LogPlace> {
        // Collecting a dead writer's log: write as that writer.
        let node_id = config.adopt_writer.clone().unwrap_or(identity.node_id);
        // With a shared directory, its secret keys every digest (every
        // node must compute the digests other nodes' records hold) and this
        // node's log lives in its writer directory there.
        let (shared, secret, identity_confirmed) = match &config.shared_dir {
            Some(root) => {
                let holder = if config.adopt_writer.is_some() {
                    crate::shared::Holder::Collector
                } else {
                    crate::shared::Holder::Writer
                };
                let (shared, secret) = SharedDir::open_as(root, &node_id, holder)?;
                (Some(shared), Arc::new(secret), true)
            }
            None => (None, Arc::new(identity.secret), identity.confirmed),
        };
        let log_dir = shared
            .as_ref()
            .map_or(config.data_dir.clone(), |s| s.writer_dir.clone());
        Ok(LogPlace {
            node_id,
            shared,
            secret,
            identity_confirmed,
            log_dir,
        })
    }
}

/// What recovering the disk tier gave.
struct Recovered {
    disk: Option<DiskTier>,
    report: RecoveryReport,
    /// This node's own removals (for the follower of a shared directory).
    own_tombstones: HashMap<u128, u64>,
    /// Keys whose newest value the tail scrub found lost: removed for
    /// good once the store runs (their records would index them again).
    lost: Vec<(KeyDigest, Box<[u8]>)>,
}

/// Opens the disk tier (when there is one) and recovers the index from it.
fn recover_disk(
    config: &Config,
    place: &LogPlace,
    index: &Index,
    clean: bool,
) -> Result<Recovered> {
    let mut own_tombstones: HashMap<u128, u64> = HashMap::new();
    let mut lost: Vec<(KeyDigest, Box<[u8]>)> = Vec::new();
    if !config.disk_enabled() {
        return Ok(Recovered {
            disk: None,
            report: RecoveryReport::default(),
            own_tombstones,
            lost,
        });
    }
    // After a clean close, the checkpoint written then (if the log is
    // still exactly as it recorded; the disk tier checks the files).
    let checkpoint = (clean && place.shared.is_none() && config.local_checkpoints)
        .then(|| super::local_checkpoint::load(&config.data_dir, &place.node_id, &place.secret))
        .flatten();
    let checks = RecoveryChecks {
        // In a shared directory `key-check` travels with `key-secret` (both
        // copied from another directory confirm each other), so it proves
        // nothing about this node's own log: there a log none of whose
        // intact records verify is refused, never set aside region by
        // region.
        identity_confirmed: place.identity_confirmed && place.shared.is_none(),
        scrub_tail: !clean,
        recorded: checkpoint
            .as_ref()
            .map(|c| super::local_checkpoint::recorded_regions(c).into()),
    };
    let (disk, report) = DiskTier::open(
        config,
        &place.log_dir,
        Arc::clone(&place.secret),
        &place.node_id,
        checks,
        |recovered| {
            if recovered.value_lost {
                lost.push((
                    recovered.entry.digest,
                    recovered.entry.key.clone().into_boxed_slice(),
                ));
            }
            apply_recovered(index, &mut own_tombstones, recovered)
        },
    )?;
    let mut report = report;
    if let (true, Some(checkpoint)) = (report.from_checkpoint, &checkpoint) {
        report.checkpoint_entries = super::local_checkpoint::index_entries(index, checkpoint);
        report.max_seq = report.max_seq.max(checkpoint.seq);
    }
    Ok(Recovered {
        disk: Some(disk),
        report,
        own_tombstones,
        lost,
    })
}

/// Guards the log's writes with the shared directory's writer lock, and
/// holds the data directory's lock for as long as the engine's writes may
/// outlive this process (io_uring finishes them after a kill).
fn guard_writes(disk: &DiskTier, place: &LogPlace, lock: &DirLock) {
    if let Some(writer_lock) = place.shared.as_ref().and_then(|s| s.writer_lock()) {
        disk.set_write_guard(Arc::new(move || writer_lock.check()));
    }
    disk.engine().hold_until_idle(lock.dir_file());
}

/// Says what recovery found, and warns when the directory holds more than
/// the disk tier's capacity.
fn log_opened(config: &Config, disk: &DiskTier, recovery: &RecoveryReport, index: &Index) {
    tracing::info!(
        dir = %config.data_dir.display(),
        regions = recovery.regions,
        batches = recovery.batches,
        records = recovery.records,
        from_checkpoint = recovery.from_checkpoint,
        entries = index.counts().entries,
        damaged_regions = recovery.damaged_regions,
        skipped_pages = recovery.skipped_pages,
        quarantined_regions = recovery.quarantined_regions,
        damaged_headers = recovery.damaged_headers,
        foreign_regions = recovery.foreign_regions,
        skipped_files = recovery.skipped_files,
        buffered_regions = recovery.buffered_regions,
        regions_behind_gap = recovery.regions_behind_gap,
        scrubbed_entries = recovery.scrubbed_entries,
        scrub_dropped = recovery.scrub_dropped,
        scrub_ms = recovery.scrub_ms,
        io_engine = disk.engine_name(),
        direct_io = disk.direct_io(),
        fixed_buffers = disk.engine().uses_fixed_buffers(),
        registered_files = disk.engine().uses_registered_files(),
        "opened kvtier store"
    );
    if disk.used() > disk.capacity() {
        // Said in one line, never done silently: a capacity smaller than
        // what the directory holds costs its oldest regions.
        tracing::warn!(
            dir = %config.data_dir.display(),
            held_bytes = disk.used(),
            capacity_bytes = disk.capacity(),
            regions = disk.region_count(),
            "the disk tier holds {} bytes but its capacity is {}: the oldest regions \
             (about {} bytes) will be reclaimed as writes arrive; the newest are kept. \
             Open with a larger disk capacity to keep them",
            disk.used(),
            disk.capacity(),
            disk.used() - disk.capacity()
        );
    }
}

/// The write log, numbering from `next_seq`: by the clock in a shared
/// directory (whose clock must be plausible), bounded by the storage
/// deadline where the log's file system can stall.
fn open_write_log(
    config: &Config,
    next_seq: u64,
    disk: Option<&DiskTier>,
    shared: bool,
) -> Result<WriteLog> {
    let write_through = config.flush == FlushPolicy::WriteThrough;
    let mut log = WriteLog::with_clock(next_seq, write_through, shared);
    #[cfg(feature = "test-util")]
    log.set_clock_offset(config.clock_offset_secs);
    if disk.is_some_and(|d| d.writes_bounded()) {
        log.set_deadline(config.io_deadline);
    }
    log.set_reads_first(Some(ReadsFirst {
        quiet: config.flush_yield_quiet,
        most: config.flush_yield,
        // A quarter of the pool: held writes never crowd out new puts.
        most_bytes: config.memory_capacity / 4,
    }));
    Ok(log)
}

/// In a shared directory sequence numbers follow the clock: a clock
/// outside 2020-2250 is refused before anything is created or taken (the
/// data directory, its identity, the writer's directory and lock, a
/// recovery), so a refused start leaves nothing behind that pins the other
/// nodes' reclaim floors (issue 61, finding 1).
fn check_clock_for_shared(config: &Config) -> Result<()> {
    if config.shared_dir.is_none() {
        return Ok(());
    }
    #[cfg(feature = "test-util")]
    let offset = config.clock_offset_secs.saturating_mul(1_000_000_000);
    #[cfg(not(feature = "test-util"))]
    let offset = 0;
    let now = crate::write_log::raw_clock_nanos(offset);
    if (EARLIEST_PLAUSIBLE_CLOCK_NANOS..LATEST_PLAUSIBLE_CLOCK_NANOS).contains(&now) {
        return Ok(());
    }
    Err(Error::new(
        crate::ErrorKind::InvalidArgument,
        format!(
            "this host's clock reads {} s since 1970, outside 2020-2250: in a shared \
             directory sequence numbers follow the clock, and a clock this wrong \
             would order this node's writes against every other node's wrongly. \
             Fix the clock (NTP) and start again (nothing was created or changed)",
            now / 1_000_000_000
        ),
    ))
}

/// The follower after its first pass: every other writer's log is indexed
/// before the store answers (their records are the meta persisted with
/// their data).
fn first_pass(follower: Follower, shared: &SharedDir, index: &Index) -> Arc<Follower> {
    let started = std::time::Instant::now();
    let follower = Arc::new(follower);
    follower.poll();
    tracing::info!(
        shared_dir = %shared.root.display(),
        writers = follower.writers().len(),
        entries = index.counts().entries,
        elapsed_ms = started.elapsed().as_millis() as u64,
        "indexed the other writers of the shared directory"
    );
    follower
}

/// Starts the flusher when there is a tier to write to: the region log
/// (with the shared directory's hooks when the log is one writer's of it),
/// or a plugged tier's writing half.
fn spawn_flusher(
    inner: &Arc<Inner>,
    disk: Option<&Arc<DiskTier>>,
    plugged: Option<Box<dyn TierWriter>>,
    shared_floor: &Arc<AtomicU64>,
) -> Result<Option<FlusherHandle>> {
    let (writer, after_batch): (Box<dyn TierWriter>, _) = match (disk, plugged) {
        (Some(disk), _) => {
            let hooks = inner.checkpoints.as_ref().zip(inner.follower.as_ref()).map(
                |(writer, follower)| {
                    let writer = Arc::clone(writer);
                    let follower = Arc::clone(follower);
                    SharedHooks {
                        floor: Arc::clone(shared_floor),
                        note_removal: NoteRemoval(Box::new(move |digest, seq| {
                            follower.note_removal(digest, seq)
                        })),
                        reclaim_before: inner
                            .config
                            .adopt_writer
                            .as_ref()
                            .map(|_| disk.next_region_id()),
                        after_batch: Box::new(move || writer.after_batch()),
                    }
                },
            );
            let (writer, after_batch) = RegionLogWriter::new(
                Arc::clone(&inner.log),
                Arc::clone(disk),
                Arc::clone(&inner.index),
                Arc::clone(&inner.counters),
                hooks,
                inner.config.events.clone(),
            );
            (Box::new(writer), after_batch)
        }
        (None, Some(plugged)) => (plugged, None),
        (None, None) => return Ok(None),
    };
    let flusher = Flusher::new(
        Arc::clone(&inner.log),
        writer,
        Arc::clone(&inner.index),
        Arc::clone(&inner.counters),
        inner.config.flush_batch_bytes,
        after_batch,
        inner.config.events.clone(),
    );
    Ok(Some(flusher.spawn()?))
}

/// Starts the thread that polls the shared directory's other writers.
fn spawn_follow_thread(inner: &Inner) -> Result<Option<std::thread::JoinHandle<()>>> {
    let Some(follower) = &inner.follower else {
        return Ok(None);
    };
    let follower = Arc::clone(follower);
    let every = inner.config.shared_poll;
    std::thread::Builder::new()
        .name("kvtier-follower".into())
        .spawn(move || follower.run(every))
        .map(Some)
        .map_err(|e| Error::io("starting the shared-directory follower", e))
}

/// Removes for good the keys whose newest value the tail scrub found lost.
/// A lost value whose key has a newer surviving put keeps that put: only
/// keys recovery left absent get their tombstone.
fn remove_lost_values(store: &Store, mut lost: Vec<(KeyDigest, Box<[u8]>)>) -> Result<()> {
    lost.retain(|(digest, _)| store.inner.index.lock(*digest).get(*digest).is_none());
    if lost.is_empty() {
        return Ok(());
    }
    let mut seqs = Vec::with_capacity(lost.len());
    for (digest, key) in lost {
        seqs.push(store.inner.log_removal(digest, key)?);
    }
    let (low, high) = (seqs[0], seqs[seqs.len() - 1]);
    store.inner.wait_durable(low, high)
}

fn max_put_len(config: &Config, disk: Option<&DiskTier>) -> u64 {
    let mut limit = config
        .max_value_size
        .min(config.memory_capacity / PAGE_SIZE * PAGE_SIZE);
    if let Some(disk) = disk {
        // One value alone in a batch: a record page plus the value's pages.
        let record = page_round_up(format::record_len([crate::key::MAX_QUALIFIED_KEY_LEN]) as u64);
        limit = limit.min(disk.max_batch_len() - record);
    }
    limit
}

/// Applies one recovered record entry: per key, the highest sequence
/// number wins, whether put or tombstone, whatever order regions are read.
fn apply_recovered(
    index: &Index,
    tombstones: &mut HashMap<u128, u64>,
    recovered: crate::disk::RecoveredEntry,
) {
    let entry = recovered.entry;
    let digest = entry.digest;
    let mut shard = index.lock(digest);
    let current = shard.get(digest).map(|e| e.seq());
    let newest_removal = tombstones.get(&digest.0).copied();
    if current.is_some_and(|s| s >= entry.seq) || newest_removal.is_some_and(|s| s >= entry.seq) {
        return;
    }
    match entry.kind {
        RecordKind::Tombstone => {
            tombstones.insert(digest.0, entry.seq);
            shard.remove(digest);
        }
        RecordKind::Put => {
            shard.insert(
                digest,
                Entry::new(
                    entry.seq,
                    entry.checksum,
                    None,
                    Some(recovered.loc),
                    entry.value_len,
                ),
            );
        }
    }
}
