//! Opening a store: the directory, its identity and lock, recovery of the
//! index from the region log (newest sequence wins per key), the tail
//! scrub's tombstones, and the flusher.

use super::{Inner, NamespacedStore, Store};
use crate::config::{Config, FlushPolicy};
use crate::disk::format::{self, RecordKind};
use crate::disk::{DiskTier, RecoveryChecks, RecoveryReport};
use crate::error::{Error, Result};
use crate::flusher::Flusher;
use crate::index::{Entry, Index};
use crate::key::{KeyDigest, Namespace};
use crate::lock::DirLock;
use crate::pool::{EvictionQueues, PoolCore};
use crate::shared::{CheckpointWriter, Follower, SharedDir};
use crate::units::{page_round_up, PAGE_SIZE};
use crate::write_log::{WriteLog, EARLIEST_PLAUSIBLE_CLOCK_NANOS, LATEST_PLAUSIBLE_CLOCK_NANOS};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};

impl Store {
    /// Opens the store in `config.data_dir`, creating it if needed and
    /// recovering the index from the region log if it exists.
    pub fn open(config: Config) -> Result<Store> {
        config.validate()?;
        // Cached values are private to the store's user, whatever the
        // umask: created 0700, refused if another user owns it or may
        // write it (docs/design.md, "Private at rest").
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
        let default_namespace = Namespace::new(Arc::clone(&secret), &config.namespace)?;
        let index = Arc::new(Index::default());
        let mut own_tombstones: HashMap<u128, u64> = HashMap::new();
        // Whether the last run closed cleanly: taken (and synced away) now,
        // so that a crash of this run is noticed by the next.
        let clean = crate::data_dir::take_clean_marker(&config.data_dir)?;

        // The pool is backed with memory while the disk tier recovers (the
        // two together took the sum of their times; the pre-fault alone
        // was most of a 1M-entry reopen on a virtual machine).
        let (pool, prefaulting) = PoolCore::new_prefaulting(config.memory_capacity)?;

        // Keys whose newest value the tail scrub found lost: removed for
        // good once the store runs (their records would index them again).
        let mut lost: Vec<(KeyDigest, Box<[u8]>)> = Vec::new();
        let (disk, recovery) = if config.disk_enabled() {
            let tombstones = &mut own_tombstones;
            let checks = RecoveryChecks {
                // In a shared directory `key-check` travels with
                // `key-secret` (both copied from another directory confirm
                // each other), so it proves nothing about this node's own
                // log: there a log none of whose intact records verify is
                // refused, never set aside region by region.
                identity_confirmed: identity_confirmed && shared.is_none(),
                scrub_tail: !clean,
            };
            let (disk, report) = DiskTier::open(
                &config,
                &log_dir,
                Arc::clone(&secret),
                &node_id,
                checks,
                |recovered| {
                    if recovered.value_lost {
                        lost.push((
                            recovered.entry.digest,
                            recovered.entry.key.clone().into_boxed_slice(),
                        ));
                    }
                    apply_recovered(&index, tombstones, recovered)
                },
            )?;
            (Some(disk), report)
        } else {
            (None, RecoveryReport::default())
        };
        if let (Some(disk), Some(lock)) = (&disk, shared.as_ref().and_then(|s| s.writer_lock())) {
            disk.set_write_guard(Arc::new(move || lock.check()));
        }
        if !identity_confirmed {
            // The records (if any) verified under the secret: record it.
            crate::data_dir::write_key_check(&config.data_dir, &secret)?;
        }
        if let Some(disk) = &disk {
            // The lock outlives this process for as long as the engine's
            // writes may (io_uring finishes them after a kill).
            disk.engine().hold_until_idle(lock.dir_file());
        }
        if prefaulting.join().is_err() {
            return Err(Error::invalid(
                "the memory pool's pre-fault thread panicked",
            ));
        }
        if let Some(disk) = &disk {
            // The flusher writes straight from the pool: pinned once here,
            // its pages need no pinning per write.
            if disk.engine().register_memory(Arc::clone(&pool) as _) {
                pool.exclude_from_fork();
            }
        }
        let eviction = EvictionQueues::new(config.eviction, pool.capacity_pages());
        let next_seq = recovery.max_seq + 1;
        if let Some(disk) = &disk {
            tracing::info!(
                dir = %config.data_dir.display(),
                regions = recovery.regions,
                batches = recovery.batches,
                records = recovery.records,
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
        }
        if let Some(disk) = &disk {
            if disk.used() > disk.capacity() {
                // Said in one line, never done silently: a capacity smaller
                // than what the directory holds costs its oldest regions.
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
        let write_through = config.flush == FlushPolicy::WriteThrough;
        let disk = disk.map(Arc::new);
        if let Some(shared) = &shared {
            // The data directory's marker in the writer directory too, for
            // the other nodes (a writer whose lock is free and who left no
            // marker stopped uncleanly: followers verify its newest
            // region's values). Taken once the log has opened: an open
            // refused before here changes nothing in the directory.
            crate::data_dir::take_clean_marker(&shared.writer_dir)?;
        }
        let mut log = WriteLog::with_clock(next_seq, write_through, shared.is_some());
        #[cfg(feature = "test-util")]
        log.set_clock_offset(config.clock_offset_secs);
        if disk.as_ref().is_some_and(|d| d.writes_bounded()) {
            log.set_deadline(config.io_deadline);
        }
        if shared.is_some() {
            let now = log.raw_wall_nanos();
            if !(EARLIEST_PLAUSIBLE_CLOCK_NANOS..LATEST_PLAUSIBLE_CLOCK_NANOS).contains(&now) {
                return Err(Error::new(
                    crate::ErrorKind::InvalidArgument,
                    format!(
                        "this host's clock reads {} s since 1970, outside 2020-2250: in a shared \
                         directory sequence numbers follow the clock, and a clock this wrong \
                         would order this node's writes against every other node's wrongly. \
                         Fix the clock (NTP) and start again",
                        now / 1_000_000_000
                    ),
                ));
            }
        }
        let log = Arc::new(log);
        let shared_floor = Arc::new(AtomicU64::new(u64::MAX));
        let follower = match (&shared, &disk) {
            (Some(shared), Some(disk)) => {
                let follower = Arc::new(
                    Follower::new(
                        &shared.root,
                        &node_id,
                        Arc::clone(disk),
                        Arc::clone(&index),
                        Arc::clone(&log),
                        own_tombstones,
                        Arc::clone(&shared_floor),
                    )
                    .bounded(config.shared_index_share),
                );
                // Every other writer's log is indexed before the store
                // answers (their records are the meta persisted with
                // their data).
                let started = std::time::Instant::now();
                follower.poll();
                tracing::info!(
                    shared_dir = %shared.root.display(),
                    writers = follower.writers().len(),
                    entries = index.counts().entries,
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "indexed the other writers of the shared directory"
                );
                Some(follower)
            }
            _ => None,
        };
        let checkpoints = match (&shared, &disk, &follower) {
            (Some(shared), Some(disk), Some(follower)) => Some(Arc::new(CheckpointWriter::new(
                &shared.writer_dir,
                &node_id,
                Arc::clone(&secret),
                Arc::clone(disk),
                Arc::clone(&index),
                Arc::clone(&log),
                Arc::clone(follower),
                config.shared_checkpoint_interval,
            ))),
            _ => None,
        };
        let inner = Arc::new(Inner {
            max_put_len: AtomicU64::new(max_put_len(&config, disk.as_deref())),
            config,
            index,
            pool,
            shadow: eviction.shadow(),
            eviction: Mutex::new(eviction),
            disk,
            log,
            follower,
            checkpoints,
            shared,
            counters: Arc::default(),
            closed: AtomicBool::new(false),
            lock: Mutex::new(Some(lock)),
            recovery,
            owner_pid: std::process::id(),
            secret,
            node_id,
        });
        let flusher = match &inner.disk {
            Some(disk) => Some(
                Flusher::new(
                    Arc::clone(&inner.log),
                    Arc::clone(disk),
                    Arc::clone(&inner.index),
                    Arc::clone(&inner.counters),
                    inner.config.flush_batch_bytes,
                    inner.checkpoints.as_ref().zip(inner.follower.as_ref()).map(
                        |(writer, follower)| {
                            let writer = Arc::clone(writer);
                            let follower = Arc::clone(follower);
                            crate::flusher::SharedHooks {
                                floor: Arc::clone(&shared_floor),
                                note_removal: crate::flusher::NoteRemoval(Box::new(
                                    move |digest, seq| follower.note_removal(digest, seq),
                                )),
                                reclaim_before: inner
                                    .config
                                    .adopt_writer
                                    .as_ref()
                                    .map(|_| disk.next_region_id()),
                                after_batch: Box::new(move || writer.after_batch()),
                            }
                        },
                    ),
                    inner.config.events.clone(),
                )
                .spawn()?,
            ),
            None => None,
        };
        let follow_thread = match &inner.follower {
            Some(follower) => {
                let follower = Arc::clone(follower);
                let every = inner.config.shared_poll;
                Some(
                    std::thread::Builder::new()
                        .name("kvtier-follower".into())
                        .spawn(move || follower.run(every))
                        .map_err(|e| Error::io("starting the shared-directory follower", e))?,
                )
            }
            None => None,
        };
        let store = Store {
            default_view: NamespacedStore::new(Arc::clone(&inner), default_namespace),
            inner,
            flusher: Mutex::new(flusher),
            follow_thread: Mutex::new(follow_thread),
        };
        // A lost value whose key has a newer surviving put keeps that put:
        // only keys recovery left absent get their tombstone.
        lost.retain(|(digest, _)| store.inner.index.lock(*digest).get(*digest).is_none());
        if !lost.is_empty() {
            let mut seqs = Vec::with_capacity(lost.len());
            for (digest, key) in lost {
                seqs.push(store.inner.log_removal(digest, key)?);
            }
            let (low, high) = (seqs[0], seqs[seqs.len() - 1]);
            store.inner.wait_durable(low, high)?;
        }
        Ok(store)
    }
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
