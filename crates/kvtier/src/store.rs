//! The `Store` facade: the one place that decides tiering.
//!
//! Put: the value is copied once into a pool extent, indexed, and queued
//! for the flusher; the call returns. Get: every key of a batch is looked up
//! first; memory hits are copied out under a lease (an `Arc` on the slot),
//! disk hits are read together as one batch, straight into the caller's
//! buffer when it is aligned, and verified before they count as hits.

use crate::config::{Config, FlushPolicy};
use crate::disk::format::{self, RecordKind};
use crate::disk::io::{is_direct_io_aligned, AlignedBuf, ReadOp};
use crate::disk::{DiskLocation, DiskTier, RecoveryChecks, RecoveryReport, Region};
use crate::error::{Error, ErrorKind, Result};
use crate::flusher::{Flusher, FlusherHandle};
use crate::index::{DiskLoc, Entry, Index};
use crate::key::{validate_key, KeyDigest, KeySecret, Namespace, ValueChecksum};
use crate::lock::DirLock;
use crate::pool::{EvictionQueues, PoolCore, PoolSlot};
use crate::stats::{Counters, Stats};
use crate::streamed_put::StreamedPuts;
use crate::units::{page_round_up, PAGE_SIZE};
use crate::write_log::{QueuedWrite, WriteLog};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Where a put may keep its value.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum PutTier {
    /// The memory pool now and disk in the background (write-through).
    #[default]
    MemoryAndDisk,
    /// The memory pool only: never written to disk, dropped first under
    /// pressure, gone after a restart.
    MemoryOnly,
}

/// Per-call put options. Default: write-through, overwrite, don't wait.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PutOptions {
    /// Leave keys that are already present untouched (and report success).
    pub skip_existing: bool,
    pub tier: PutTier,
    /// Return only once the values are durable on disk.
    pub durable: bool,
}

#[derive(Debug)]
pub(crate) struct Inner {
    config: Config,
    /// The data directory's node id (`node-id`; docs/design.md).
    node_id: String,
    index: Arc<Index>,
    pool: Arc<PoolCore>,
    eviction: Mutex<EvictionQueues>,
    /// The adaptive policy's simulations, fed by reads without the
    /// eviction lock.
    shadow: Option<Arc<crate::pool::Shadow>>,
    disk: Option<Arc<DiskTier>>,
    /// Sequence numbers, the flusher's queue and the durable watermark.
    log: Arc<WriteLog>,
    counters: Arc<Counters>,
    closed: AtomicBool,
    lock: Mutex<Option<DirLock>>,
    recovery: RecoveryReport,
    max_put_len: AtomicU64,
    /// The process that opened the store (see `check_owner`).
    owner_pid: u32,
    /// The data directory's digest key (see `crate::data_dir`).
    secret: Arc<KeySecret>,
}

/// The embedded tiered KV-cache store. `Send + Sync`: share it with an
/// `Arc` and call it from any number of threads.
/// A memory-resident value held for reading (see
/// [`NamespacedStore::batch_memory_leases`]).
#[derive(Debug, Clone)]
pub struct ValueLease(Arc<PoolSlot>);

impl ValueLease {
    pub fn bytes(&self) -> &[u8] {
        self.0.bytes()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

#[derive(Debug)]
pub struct Store {
    inner: Arc<Inner>,
    flusher: Mutex<Option<FlusherHandle>>,
    /// The namespace of the store's own methods (`Config::namespace`).
    default_namespace: Namespace,
}

/// A store seen through one namespace: the same operations as [`Store`],
/// with every key qualified by the namespace. From [`Store::in_namespace`].
#[derive(Debug, Clone, Copy)]
pub struct NamespacedStore<'s> {
    inner: &'s Inner,
    namespace: &'s Namespace,
}

/// A value located by a lookup, pinned if in memory.
enum Found {
    Memory(Arc<PoolSlot>),
    Disk {
        region: Arc<Region>,
        loc: DiskLoc,
        len: usize,
        checksum: u64,
        seq: u64,
    },
    Miss,
}

impl Store {
    /// Opens the store in `config.data_dir`, creating it if needed and
    /// recovering the index from the region log if it exists.
    pub fn open(config: Config) -> Result<Store> {
        config.validate()?;
        std::fs::create_dir_all(&config.data_dir).map_err(|e| {
            Error::io(
                format!("creating data directory {}", config.data_dir.display()),
                e,
            )
        })?;
        let lock = DirLock::acquire(&config.data_dir)?;
        let identity = crate::data_dir::open_or_create(
            &config.data_dir,
            &config.data_dir.join(crate::disk::REGION_DIR),
        )?;
        let secret = Arc::new(identity.secret);
        let node_id = identity.node_id;
        let default_namespace = Namespace::new(Arc::clone(&secret), &config.namespace)?;
        let index = Index::default();
        // Whether the last run closed cleanly: taken (and synced away) now,
        // so that a crash of this run is noticed by the next.
        let clean = crate::data_dir::take_clean_marker(&config.data_dir)?;
        // Keys whose newest value the tail scrub found lost: removed for
        // good once the store runs (their records would index them again).
        let mut lost: Vec<(KeyDigest, Box<[u8]>)> = Vec::new();
        let (disk, recovery) = if config.disk_enabled() {
            let mut tombstones: HashMap<u128, u64> = HashMap::new();
            let checks = RecoveryChecks {
                identity_confirmed: identity.confirmed,
                scrub_tail: !clean,
            };
            let (disk, report) = DiskTier::open(
                &config,
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
                    apply_recovered(&index, &mut tombstones, recovered)
                },
            )?;
            (Some(disk), report)
        } else {
            (None, RecoveryReport::default())
        };
        if !identity.confirmed {
            // The records (if any) verified under the secret: record it.
            crate::data_dir::write_key_check(&config.data_dir, &secret)?;
        }
        if let Some(disk) = &disk {
            // The lock outlives this process for as long as the engine's
            // writes may (io_uring finishes them after a kill).
            disk.engine().hold_until_idle(lock.dir_file());
        }
        let pool = PoolCore::new(config.memory_capacity)?;
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
        let inner = Arc::new(Inner {
            max_put_len: AtomicU64::new(max_put_len(&config, disk.as_ref())),
            config,
            index: Arc::new(index),
            pool,
            shadow: eviction.shadow(),
            eviction: Mutex::new(eviction),
            disk: disk.map(Arc::new),
            log: Arc::new(WriteLog::new(next_seq, write_through)),
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
                )
                .spawn()?,
            ),
            None => None,
        };
        let store = Store {
            inner,
            flusher: Mutex::new(flusher),
            default_namespace,
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

    /// A namespace of this store: keys used through it never meet equal
    /// keys of another namespace (see docs/design.md, "Keys"). Put into the
    /// name whatever makes two blocks' bytes incompatible: model, dtype,
    /// block size, tensor-parallel rank and size, KV layout.
    pub fn namespace(&self, name: &str) -> Result<Namespace> {
        Namespace::new(Arc::clone(&self.inner.secret), name)
    }

    /// This store seen through `namespace`.
    pub fn in_namespace<'s>(&'s self, namespace: &'s Namespace) -> NamespacedStore<'s> {
        NamespacedStore {
            inner: &self.inner,
            namespace,
        }
    }

    /// The namespace the store's own methods use (`Config::namespace`).
    pub fn default_namespace(&self) -> &Namespace {
        &self.default_namespace
    }

    fn default_view(&self) -> NamespacedStore<'_> {
        self.in_namespace(&self.default_namespace)
    }

    /// What recovery found when this store was opened.
    pub fn recovery_report(&self) -> &RecoveryReport {
        &self.inner.recovery
    }

    /// Stores `value` under `key` (write-through).
    pub fn put(&self, key: impl AsRef<[u8]>, value: impl AsRef<[u8]>) -> Result<()> {
        self.default_view().put(key, value)
    }

    pub fn put_with(
        &self,
        key: impl AsRef<[u8]>,
        value: impl AsRef<[u8]>,
        options: &PutOptions,
    ) -> Result<()> {
        self.default_view().put_with(key, value, options)
    }

    /// Stores each value under its key; one result per key.
    pub fn batch_put<K: AsRef<[u8]>, V: AsRef<[u8]>>(
        &self,
        keys: &[K],
        values: &[V],
    ) -> Vec<Result<()>> {
        self.default_view().batch_put(keys, values)
    }

    pub fn batch_put_with<K: AsRef<[u8]>, V: AsRef<[u8]>>(
        &self,
        keys: &[K],
        values: &[V],
        options: &PutOptions,
    ) -> Vec<Result<()>> {
        self.default_view().batch_put_with(keys, values, options)
    }

    /// The value under `key`, or `None`.
    pub fn get(&self, key: impl AsRef<[u8]>) -> Result<Option<Vec<u8>>> {
        self.default_view().get(key)
    }

    /// Length of the value under `key`, without reading it.
    pub fn value_len(&self, key: impl AsRef<[u8]>) -> Result<Option<usize>> {
        self.default_view().value_len(key)
    }

    /// Where the durable copy of `key` lies in the default namespace; see
    /// [`NamespacedStore::disk_location`].
    pub fn disk_location(&self, key: impl AsRef<[u8]>) -> Result<Option<DiskLocation>> {
        self.default_view().disk_location(key)
    }

    /// Reads each key's value into its buffer. Per key: `Ok(Some(n))` with
    /// the bytes written, `Ok(None)` for a miss (the buffer's contents are
    /// then unspecified), or an error such as `BufferTooSmall`.
    pub fn batch_get_into<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        bufs: &mut [&mut [u8]],
    ) -> Vec<Result<Option<usize>>> {
        self.default_view().batch_get_into(keys, bufs)
    }

    /// See [`NamespacedStore::batch_put_segments`].
    pub fn batch_put_segments<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        values: &[&[&[u8]]],
        options: &PutOptions,
    ) -> Vec<Result<()>> {
        self.default_view()
            .batch_put_segments(keys, values, options)
    }

    /// See [`NamespacedStore::batch_get_segments`].
    pub fn batch_get_segments<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        bufs: &mut [&mut [&mut [u8]]],
    ) -> Vec<Result<Option<usize>>> {
        self.default_view().batch_get_segments(keys, bufs)
    }

    pub fn exists(&self, key: impl AsRef<[u8]>) -> bool {
        self.default_view().exists(key)
    }

    /// Whether each key is present (invalid keys are simply absent).
    pub fn batch_exists<K: AsRef<[u8]>>(&self, keys: &[K]) -> Vec<bool> {
        self.default_view().batch_exists(keys)
    }

    /// How many leading keys are present: the cached prefix of a prompt.
    pub fn prefix_len<K: AsRef<[u8]>>(&self, keys: &[K]) -> usize {
        self.default_view().prefix_len(keys)
    }

    /// Leases on the memory copies of `keys`; see
    /// [`NamespacedStore::batch_memory_leases`].
    pub fn batch_memory_leases<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        capacities: &[usize],
    ) -> Vec<Option<Result<ValueLease>>> {
        self.default_view().batch_memory_leases(keys, capacities)
    }

    /// Whether each key has a memory copy now; see
    /// [`NamespacedStore::batch_in_memory`].
    pub fn batch_in_memory<K: AsRef<[u8]>>(&self, keys: &[K]) -> Vec<bool> {
        self.default_view().batch_in_memory(keys)
    }

    /// Removes `key` from every tier; durable on return (a tombstone is
    /// always written, so no older value can come back after a restart).
    /// Returns whether the key was present.
    pub fn remove(&self, key: impl AsRef<[u8]>) -> Result<bool> {
        self.default_view().remove(key)
    }

    /// Returns once everything put so far is durable on disk. Fails if any
    /// write failed since the previous `flush` (those values remain readable
    /// from memory but are not durable).
    pub fn flush(&self) -> Result<()> {
        self.inner.check_open()?;
        self.inner.flush_all()
    }

    /// Flushes, stops the flusher and releases the data directory. Later
    /// calls fail with `Closed`. Dropping the store closes it too.
    pub fn close(&self) -> Result<()> {
        // In a fork() child: touch nothing (the flusher, the lock and the
        // pool belong to the parent).
        self.inner.check_owner()?;
        if self.inner.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        self.inner.log.shut_down();
        let had_flusher = if let Some(handle) = self.flusher.lock().unwrap().take() {
            handle.join();
            true
        } else {
            false
        };
        let result = if had_flusher {
            self.inner.log.close_result()
        } else {
            Ok(())
        };
        self.inner.index.clear();
        let lock = self.inner.lock.lock().unwrap().take();
        if let (Some(disk), Some(lock)) = (&self.inner.disk, &lock) {
            // The flusher is joined: no write of this store is in flight.
            disk.engine().release_hold(lock.dir_file());
        }
        if result.is_ok() {
            // Everything acknowledged is on disk and nothing writes any
            // more: the next open need not scrub the tail. (Written while
            // the directory is still locked.)
            if let Err(e) = crate::data_dir::leave_clean_marker(&self.inner.config.data_dir) {
                tracing::warn!(error = %e, "could not mark the shutdown clean; the next open scrubs the newest region");
            }
        }
        drop(lock);
        result
    }

    pub fn stats(&self) -> Stats {
        self.inner.stats()
    }

    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// The data directory's node id: 32 hex digits, the same for the
    /// directory's whole life (region files and cluster membership carry it).
    pub fn node_id(&self) -> &str {
        &self.inner.node_id
    }

    /// Largest value a put can accept with this configuration: the smallest
    /// of the max value size, the memory pool and (for disk puts) one batch.
    pub fn max_put_len(&self) -> u64 {
        self.inner.max_put_len.load(Ordering::Relaxed)
    }
}

impl NamespacedStore<'_> {
    pub fn namespace(&self) -> &Namespace {
        self.namespace
    }

    /// Stores `value` under `key` (write-through).
    pub fn put(&self, key: impl AsRef<[u8]>, value: impl AsRef<[u8]>) -> Result<()> {
        self.put_with(key, value, &PutOptions::default())
    }

    pub fn put_with(
        &self,
        key: impl AsRef<[u8]>,
        value: impl AsRef<[u8]>,
        options: &PutOptions,
    ) -> Result<()> {
        self.batch_put_with(&[key], &[value], options)
            .pop()
            .expect("one result per key")
    }

    /// Stores each value under its key; one result per key.
    pub fn batch_put<K: AsRef<[u8]>, V: AsRef<[u8]>>(
        &self,
        keys: &[K],
        values: &[V],
    ) -> Vec<Result<()>> {
        self.batch_put_with(keys, values, &PutOptions::default())
    }

    pub fn batch_put_with<K: AsRef<[u8]>, V: AsRef<[u8]>>(
        &self,
        keys: &[K],
        values: &[V],
        options: &PutOptions,
    ) -> Vec<Result<()>> {
        let values: Vec<[&[u8]; 1]> = values.iter().map(|v| [v.as_ref()]).collect();
        let values: Vec<&[&[u8]]> = values.iter().map(|v| &v[..]).collect();
        self.batch_put_segments(keys, &values, options)
    }

    /// A batch of `items` puts whose values (`bytes` in all, about) will
    /// arrive piece by piece, each received straight into its pool extent
    /// (see [`StreamedPuts`]).
    pub fn streamed_puts(
        &self,
        options: &PutOptions,
        items: usize,
        bytes: u64,
    ) -> StreamedPuts<'_> {
        StreamedPuts::new(self.inner, *self, options, items, bytes)
    }

    /// Stores each value given as segments laid end to end (Mooncake's
    /// multi-buffer form: one block's pages scattered across layers become
    /// one value). The segments are copied once, straight into the pool.
    pub fn batch_put_segments<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        values: &[&[&[u8]]],
        options: &PutOptions,
    ) -> Vec<Result<()>> {
        if keys.len() != values.len() {
            return mismatched(keys.len(), "values", values.len());
        }
        if keys.len() > 1 {
            let pages = values
                .iter()
                .map(|v| (segments_len(v) as u64).div_ceil(PAGE_SIZE).max(1))
                .sum();
            self.inner.eviction.lock().unwrap().note_batch(pages);
        }
        let mut results: Vec<Result<()>> = Vec::with_capacity(keys.len());
        let mut seqs = (u64::MAX, 0u64);
        // Last key first: engines put a prompt's blocks in prefix order,
        // and a prefix hit needs every earlier block, so the eviction order
        // should reach a block's descendants before the block itself.
        // Entering the queues deepest-first does that for both policies.
        for (key, value) in keys.iter().zip(values).rev() {
            let result = self
                .inner
                .put_one(self.namespace, key.as_ref(), value, options);
            if let Ok(Some(seq)) = &result {
                seqs = (seqs.0.min(*seq), seqs.1.max(*seq));
            }
            results.push(result.map(|_| ()));
        }
        results.reverse();
        if options.durable && seqs.1 > 0 {
            if let Err(e) = self.inner.wait_durable(seqs.0, seqs.1) {
                for result in results.iter_mut().filter(|r| r.is_ok()) {
                    *result = Err(e.duplicate());
                }
            }
        }
        results
    }

    /// The value under `key`, or `None`.
    pub fn get(&self, key: impl AsRef<[u8]>) -> Result<Option<Vec<u8>>> {
        let key = key.as_ref();
        loop {
            let Some(len) = self.value_len(key)? else {
                // A miss like any other (the hit rate counts it).
                Counters::add(&self.inner.counters.misses, 1);
                return Ok(None);
            };
            let mut value = vec![0u8; len];
            match self
                .inner
                .get_into(self.namespace, &[key], &mut [&mut value[..]])
                .pop()
                .unwrap()
            {
                Ok(Some(n)) => {
                    value.truncate(n);
                    return Ok(Some(value));
                }
                Ok(None) => return Ok(None),
                // Replaced by a longer value between the two lookups.
                Err(e) if e.kind() == ErrorKind::BufferTooSmall => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// Length of the value under `key`, without reading it.
    pub fn value_len(&self, key: impl AsRef<[u8]>) -> Result<Option<usize>> {
        self.inner.check_open()?;
        let key = key.as_ref();
        validate_key(key)?;
        let digest = self.namespace.digest(key);
        Ok(self
            .inner
            .index
            .lock(digest)
            .get(digest)
            .map(|e| e.len() as usize))
    }

    /// Where the durable copy of `key` lies: its region file, byte offset
    /// and length, with the digest and checksum that verify it. `None` for
    /// a missing key or one not yet on disk. For tools and benchmarks that
    /// read the files themselves (`kvtier bench`'s shape-matched reader).
    pub fn disk_location(&self, key: impl AsRef<[u8]>) -> Result<Option<DiskLocation>> {
        self.inner.check_open()?;
        let key = key.as_ref();
        validate_key(key)?;
        let digest = self.namespace.digest(key);
        let (loc, len, checksum) = {
            let shard = self.inner.index.lock(digest);
            match shard
                .get(digest)
                .and_then(|e| Some((e.disk()?, e.len(), e.checksum())))
            {
                Some(found) => found,
                None => return Ok(None),
            }
        };
        let Some(region) = self
            .inner
            .disk
            .as_ref()
            .and_then(|d| d.region(loc.region()))
        else {
            return Ok(None);
        };
        Ok(Some(DiskLocation {
            path: region.path().to_path_buf(),
            offset: u64::from(loc.page()) * PAGE_SIZE,
            len,
            digest,
            checksum,
        }))
    }

    /// Reads each key's value into its buffer. Per key: `Ok(Some(n))` with
    /// the bytes written, `Ok(None)` for a miss (the buffer's contents are
    /// then unspecified), or an error such as `BufferTooSmall`.
    pub fn batch_get_into<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        bufs: &mut [&mut [u8]],
    ) -> Vec<Result<Option<usize>>> {
        self.inner.get_into(self.namespace, keys, bufs)
    }

    /// Reads each key's value across its segments, in order (the inverse
    /// of [`batch_put_segments`](Self::batch_put_segments)). Per key:
    /// `Ok(Some(n))` with the bytes written, `Ok(None)` for a miss, or
    /// `BufferTooSmall` when the segments together hold less than the value.
    pub fn batch_get_segments<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        bufs: &mut [&mut [&mut [u8]]],
    ) -> Vec<Result<Option<usize>>> {
        self.inner.get_into(self.namespace, keys, bufs)
    }

    pub fn exists(&self, key: impl AsRef<[u8]>) -> bool {
        self.batch_exists(&[key])[0]
    }

    /// Whether each key is present (invalid keys are simply absent).
    pub fn batch_exists<K: AsRef<[u8]>>(&self, keys: &[K]) -> Vec<bool> {
        if self.inner.check_open().is_err() {
            return vec![false; keys.len()];
        }
        self.inner.contains_many(self.namespace, keys)
    }

    /// How many leading keys are present: the cached prefix of a prompt.
    pub fn prefix_len<K: AsRef<[u8]>>(&self, keys: &[K]) -> usize {
        if self.inner.check_open().is_err() {
            return 0;
        }
        // An engine's lookup of a prompt: the adaptive policy's sample.
        let inner = self.inner;
        inner
            .contains_many_then(self.namespace, keys, |digests| {
                if let Some(shadow) = &inner.shadow {
                    inner.timed(|| {
                        shadow.on_request(digests.iter().map(|d| d.0));
                    });
                }
            })
            .into_iter()
            .take_while(|&present| present)
            .count()
    }

    /// For each key with a memory copy: a lease on it, or `BufferTooSmall`
    /// if it is longer than the key's capacity (counted as a get of it
    /// would be); `None` for the others, which the caller reads with
    /// `batch_get_into`. The bytes stay valid while the lease lives,
    /// whatever puts or evictions happen meanwhile. For a server sending
    /// values straight from the pool, with no copy into a reply.
    pub fn batch_memory_leases<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        capacities: &[usize],
    ) -> Vec<Option<Result<ValueLease>>> {
        if keys.len() != capacities.len() || self.inner.check_open().is_err() {
            return keys.iter().map(|_| None).collect();
        }
        keys.iter()
            .zip(capacities)
            .map(|(key, &capacity)| {
                let key = key.as_ref();
                validate_key(key).ok()?;
                let digest = self.namespace.digest(key);
                let mut shard = self.inner.index.lock(digest);
                let slot = Arc::clone(shard.get(digest)?.mem()?);
                slot.record_hit();
                shard.mark_accessed(digest);
                drop(shard);
                Some(check_buffer(slot.len(), capacity).map(|()| {
                    Counters::add(&self.inner.counters.memory_hits, 1);
                    ValueLease(slot)
                }))
            })
            .collect()
    }

    /// Whether each key has a memory copy now (a get of it would be served
    /// from the pool, unless it is evicted first). Touches no policy state;
    /// for tools and benchmarks that report memory and disk hits apart.
    pub fn batch_in_memory<K: AsRef<[u8]>>(&self, keys: &[K]) -> Vec<bool> {
        if self.inner.check_open().is_err() {
            return vec![false; keys.len()];
        }
        let digests: Vec<KeyDigest> = keys
            .iter()
            .map(|k| self.namespace.digest(k.as_ref()))
            .collect();
        let mut found = self
            .inner
            .index
            .map_many(&digests, false, |e| e.mem().is_some());
        for (resident, key) in found.iter_mut().zip(keys) {
            *resident &= validate_key(key.as_ref()).is_ok();
        }
        found
    }

    /// Removes `key` from every tier; durable on return (a tombstone is
    /// always written, so no older value can come back after a restart).
    /// Returns whether the key was present.
    pub fn remove(&self, key: impl AsRef<[u8]>) -> Result<bool> {
        self.inner.remove(self.namespace, key.as_ref())
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        if self.inner.check_owner().is_err() {
            // A fork() child dropping the parent's store: running the
            // destructors would join a thread that does not exist here and
            // release state the parent still uses. Leak it; the child's
            // exit reclaims the memory.
            std::mem::forget(Arc::clone(&self.inner));
            if let Some(handle) = self.flusher.get_mut().ok().and_then(Option::take) {
                std::mem::forget(handle);
            }
            return;
        }
        if let Err(e) = self.close() {
            tracing::warn!(error = %e, "closing the store on drop");
        }
    }
}

fn mismatched<T>(n: usize, what: &str, m: usize) -> Vec<Result<T>> {
    (0..n.max(m))
        .map(|_| {
            Err(Error::invalid(format!(
                "batch has {n} keys but {m} {what}: one per key is required"
            )))
        })
        .collect()
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

impl Inner {
    /// Tells the eviction policy a batch of `bytes` is arriving (so it does
    /// not evict the batch's own first values for its last).
    pub(crate) fn note_batch(&self, bytes: u64) {
        self.eviction
            .lock()
            .unwrap()
            .note_batch(bytes.div_ceil(PAGE_SIZE));
    }

    /// Bytes of the memory pool not held by any value.
    pub(crate) fn pool_free_bytes(&self) -> u64 {
        self.pool.free_bytes()
    }

    pub(crate) fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            Err(Error::closed())
        } else {
            self.check_owner()
        }
    }

    /// A `fork()` child inherits the store object but not its flusher
    /// thread, and a registered pool is not even mapped there: every call
    /// in the child is refused with a clear error instead.
    pub(crate) fn check_owner(&self) -> Result<()> {
        let pid = std::process::id();
        if pid == self.owner_pid {
            Ok(())
        } else {
            Err(Error::new(
                crate::ErrorKind::Closed,
                format!(
                    "this store was opened by process {} and process {pid} is a fork() child of it: \
                     a child cannot use the parent's store; open a store or a client in the child",
                    self.owner_pid
                ),
            ))
        }
    }

    /// Presence of each key; invalid keys are absent.
    fn contains_many<K: AsRef<[u8]>>(&self, ns: &Namespace, keys: &[K]) -> Vec<bool> {
        self.contains_many_then(ns, keys, |_| {})
    }

    /// `contains_many`, handing the digests to `seen` first.
    fn contains_many_then<K: AsRef<[u8]>>(
        &self,
        ns: &Namespace,
        keys: &[K],
        seen: impl FnOnce(&[KeyDigest]),
    ) -> Vec<bool> {
        let valid: Vec<bool> = keys
            .iter()
            .map(|k| validate_key(k.as_ref()).is_ok())
            .collect();
        let digests: Vec<KeyDigest> = keys.iter().map(|k| ns.digest(k.as_ref())).collect();
        seen(&digests);
        let mut found = self.index.contains_many(&digests);
        for (present, valid) in found.iter_mut().zip(valid) {
            *present &= valid;
        }
        found
    }

    /// Returns the put's sequence number, or `None` if it was skipped.
    fn put_one(
        &self,
        ns: &Namespace,
        key: &[u8],
        value: &[&[u8]],
        options: &PutOptions,
    ) -> Result<Option<u64>> {
        let Some(mut put) = self.begin_put(ns, key, segments_len(value) as u64, options)? else {
            return Ok(None);
        };
        // The segments' bounds and the chunks' need not line up.
        let mut segments = value.iter().copied();
        let mut current: &[u8] = &[];
        put.fill(|chunk| {
            let mut at = 0;
            while at < chunk.len() {
                while current.is_empty() {
                    current = segments.next().expect("the segments fill the value");
                }
                let n = current.len().min(chunk.len() - at);
                chunk[at..at + n].copy_from_slice(&current[..n]);
                current = &current[n..];
                at += n;
            }
            Ok(())
        })
        .expect("copying from memory cannot fail");
        self.commit_put(ns, key, put).map(Some)
    }

    /// The first half of a put: checks the key and length and takes a pool
    /// extent for the value. `None`: `skip_existing` and the key is there.
    pub(crate) fn begin_put(
        &self,
        ns: &Namespace,
        key: &[u8],
        len: u64,
        options: &PutOptions,
    ) -> Result<Option<ReceivingValue>> {
        self.check_open()?;
        validate_key(key)?;
        if len == 0 {
            return Err(Error::invalid(format!(
                "value is empty: values are 1 to {} bytes",
                self.config.max_value_size
            )));
        }
        if len > self.config.max_value_size {
            return Err(Error::invalid(format!(
                "value is {len} bytes: the max value size is {} bytes",
                self.config.max_value_size
            )));
        }
        let to_disk = options.tier == PutTier::MemoryAndDisk && self.disk.is_some();
        let limit = self.max_put_len.load(Ordering::Relaxed);
        if len > limit {
            return Err(Error::no_space(format!(
                "value is {len} bytes but at most {limit} fit (memory capacity {}, disk capacity {})",
                self.config.memory_capacity, self.config.disk_capacity
            )));
        }
        let digest = ns.digest(key);
        if options.skip_existing && self.index.lock(digest).get(digest).is_some() {
            return Ok(None);
        }
        let slot = self.allocate_slot(len as usize, digest)?;
        Ok(Some(ReceivingValue {
            digest,
            slot,
            checksum: to_disk.then(|| ValueChecksum::new(digest)),
        }))
    }

    /// The second half of a put: the filled value enters the index, the
    /// eviction queues and (write-through) the flusher's queue. Returns its
    /// sequence number.
    pub(crate) fn commit_put(
        &self,
        ns: &Namespace,
        key: &[u8],
        put: ReceivingValue,
    ) -> Result<u64> {
        let ReceivingValue {
            digest,
            mut slot,
            checksum,
        } = put;
        let to_disk = checksum.is_some();
        let checksum = checksum.map_or(0, |c| c.finish());
        // The page padding goes to disk with the value and comes back with
        // direct reads: it must not hold an earlier value's bytes.
        slot.zero_padding();
        let slot = Arc::new(slot);
        if !to_disk {
            slot.set_evictable();
        }
        let value_len = slot.len();
        let mut replaced = None;
        let seq = self.log.append(|seq| {
            replaced = self.index.lock(digest).insert(
                digest,
                Entry::new(seq, 0, Some(Arc::clone(&slot)), None, value_len as u32),
            );
            to_disk.then(|| QueuedWrite::Put {
                digest,
                key: ns.qualify(key),
                seq,
                slot: Arc::clone(&slot),
                checksum,
            })
        })?;
        // Freed outside the queue lock.
        drop(replaced);
        self.timed(|| self.eviction.lock().unwrap().insert(&slot));
        Counters::add(&self.counters.puts, 1);
        if to_disk && self.config.flush == FlushPolicy::WriteThrough {
            self.wake_flusher(false);
        }
        Ok(seq)
    }

    /// An extent for `len` bytes: evicts what may be evicted, then waits
    /// (up to `put_wait`) for the flusher to make more evictable.
    fn allocate_slot(&self, len: usize, digest: KeyDigest) -> Result<PoolSlot> {
        let deadline = Instant::now() + self.config.put_wait;
        loop {
            if let Some(slot) = self.pool.try_allocate(len, digest) {
                return Ok(slot);
            }
            if self.evict_one() {
                continue;
            }
            let now = Instant::now();
            if self.disk.is_none() || now >= deadline {
                return Err(Error::no_space(format!(
                    "memory pool has no room for {len} bytes: {} of {} bytes in use, none of it \
                     evictable{}",
                    self.pool.capacity() - self.pool.free_bytes(),
                    self.pool.capacity(),
                    if self.disk.is_some() {
                        format!(" after waiting {:?} for the flusher", self.config.put_wait)
                    } else {
                        String::new()
                    }
                )));
            }
            self.wake_flusher(true);
            self.log
                .wait_progress((deadline - now).min(Duration::from_millis(10)));
        }
    }

    /// Drops one memory value the policy picks. Returns false when nothing
    /// in the pool may be dropped right now.
    /// Runs `f`, counting its time as the eviction policy's when asked to.
    fn timed<T>(&self, f: impl FnOnce() -> T) -> T {
        if !self.config.time_policy {
            return f();
        }
        let start = Instant::now();
        let result = f();
        Counters::add(&self.counters.policy_ns, start.elapsed().as_nanos() as u64);
        result
    }

    fn evict_one(&self) -> bool {
        let mut queues = self.eviction.lock().unwrap();
        let Some(slot) = self.timed(|| queues.next_victim()) else {
            return false;
        };
        let digest = slot.digest();
        if self.index.lock(digest).drop_mem(digest, &slot) {
            Counters::add(&self.counters.evictions, 1);
        }
        drop(queues);
        drop(slot);
        true
    }

    fn lookup(&self, digest: KeyDigest) -> Found {
        let mut shard = self.index.lock(digest);
        let Some(entry) = shard.get(digest) else {
            return Found::Miss;
        };
        let found = if let Some(slot) = entry.mem() {
            slot.record_hit();
            Found::Memory(Arc::clone(slot))
        } else if let Some(loc) = entry.disk() {
            match self.disk.as_ref().and_then(|d| d.region(loc.region())) {
                Some(region) => Found::Disk {
                    region,
                    loc,
                    len: entry.len() as usize,
                    checksum: entry.checksum(),
                    seq: entry.seq(),
                },
                None => Found::Miss,
            }
        } else {
            Found::Miss
        };
        if !matches!(found, Found::Miss) {
            shard.mark_accessed(digest);
        }
        found
    }

    pub(crate) fn get_into<K: AsRef<[u8]>, D: Destination>(
        &self,
        ns: &Namespace,
        keys: &[K],
        bufs: &mut [D],
    ) -> Vec<Result<Option<usize>>> {
        if keys.len() != bufs.len() {
            return mismatched(keys.len(), "buffers", bufs.len());
        }
        if let Err(e) = self.check_open() {
            return keys.iter().map(|_| Err(e.duplicate())).collect();
        }
        let mut results: Vec<Result<Option<usize>>> = Vec::with_capacity(keys.len());
        let mut disk_reads: Vec<Option<DiskRead>> = Vec::with_capacity(keys.len());
        for (key, buf) in keys.iter().zip(bufs.iter_mut()) {
            let key = key.as_ref();
            let mut disk_read = None;
            let result = validate_key(key).and_then(|()| {
                let digest = ns.digest(key);
                match self.lookup(digest) {
                    Found::Miss => {
                        Counters::add(&self.counters.misses, 1);
                        Ok(None)
                    }
                    Found::Memory(slot) => {
                        check_buffer(slot.len(), buf.capacity())?;
                        buf.fill_from(slot.bytes());
                        Counters::add(&self.counters.memory_hits, 1);
                        Ok(Some(slot.len()))
                    }
                    Found::Disk {
                        region,
                        loc,
                        len,
                        checksum,
                        seq,
                    } => {
                        check_buffer(len, buf.capacity())?;
                        let padded = page_round_up(len as u64) as usize;
                        // Alignment is a fact of the file, not the store.
                        let direct = region.direct_io();
                        // Straight into the caller's buffer when it is one
                        // slice and O_DIRECT allows it; through a bounce
                        // buffer otherwise.
                        let contiguous = buf.contiguous();
                        let fits_direct = contiguous.as_ref().is_some_and(|b| {
                            b.len() >= padded && is_direct_io_aligned(&b[..padded])
                        });
                        let bounce = if contiguous.is_some() && (!direct || fits_direct) {
                            None
                        } else {
                            self.disk.as_ref().map(|d| d.bounce_buffers().take(padded))
                        };
                        disk_read = Some(DiskRead {
                            digest,
                            region,
                            loc,
                            len,
                            read_len: if direct { padded } else { len },
                            checksum,
                            seq,
                            bounce,
                            outcome: Ok(()),
                        });
                        Ok(Some(len))
                    }
                }
            });
            results.push(result);
            disk_reads.push(disk_read);
        }
        if disk_reads.iter().any(Option::is_some) {
            self.read_from_disk(bufs, &mut disk_reads, &mut results);
        }
        results
    }

    /// Submits every disk read of a batch at once, each value cut into
    /// pieces of `Config::read_piece` bytes. A value's checksum is computed piece
    /// by piece as its pieces complete, in order, so verification runs while
    /// later reads are in flight instead of after the last one (reads of a
    /// batch share the device and tend to finish together).
    fn read_from_disk<D: Destination>(
        &self,
        bufs: &mut [D],
        reads: &mut [Option<DiskRead>],
        results: &mut [Result<Option<usize>>],
    ) {
        let disk = self.disk.as_ref().expect("disk reads imply a disk tier");
        let piece_len = self.config.read_piece as usize;
        // Per read of the batch (None where the key needs no disk read).
        let mut checks: Vec<Option<Mutex<PieceCheck>>> = reads.iter().map(|_| None).collect();
        {
            let mut ops: Vec<ReadOp<'_>> = Vec::new();
            // Per op: the read it belongs to and its piece number.
            let mut owners: Vec<(usize, usize)> = Vec::new();
            for (i, (buf, read)) in bufs.iter_mut().zip(reads.iter_mut()).enumerate() {
                let Some(read) = read else { continue };
                let offset = u64::from(read.loc.page()) * PAGE_SIZE;
                let target: &mut [u8] = match &mut read.bounce {
                    Some(bounce) => &mut bounce.as_mut_slice()[..read.read_len],
                    None => match buf.contiguous() {
                        Some(b) => &mut b[..read.read_len],
                        None => unreachable!(
                            "scattered destinations always read through a bounce buffer"
                        ),
                    },
                };
                let mut pieces = Vec::new();
                for (k, piece) in target.chunks_mut(piece_len).enumerate() {
                    pieces.push((piece.as_ptr() as usize, piece.len()));
                    ops.push(ReadOp::new(
                        &read.region.file,
                        offset + (k * piece_len) as u64,
                        piece,
                    ));
                    owners.push((i, k));
                }
                checks[i] = Some(Mutex::new(PieceCheck {
                    checksum: ValueChecksum::new(read.digest),
                    done: vec![false; pieces.len()],
                    pieces,
                    next: 0,
                    remaining: read.len,
                    expected: read.checksum,
                    verified: false,
                }));
            }
            let verify = |op: usize, _bytes: &[u8]| {
                let (i, piece) = owners[op];
                if let Some(check) = &checks[i] {
                    check.lock().unwrap().complete(piece);
                }
            };
            disk.engine().read_batch_then(&mut ops, &verify);
            let outcomes: Vec<_> = ops.into_iter().map(|op| op.result).collect();
            for ((i, _), outcome) in owners.iter().copied().zip(outcomes) {
                if let Some(read) = &mut reads[i] {
                    if read.outcome.is_ok() {
                        read.outcome = outcome;
                    }
                }
            }
        }
        for (i, (buf, read)) in bufs.iter_mut().zip(reads.iter_mut()).enumerate() {
            let Some(read) = read else { continue };
            let verdict = match &read.outcome {
                Ok(())
                    if checks[i]
                        .as_mut()
                        .is_some_and(|c| c.get_mut().unwrap().verified) =>
                {
                    Ok(())
                }
                Ok(()) => Err("checksum or key digest mismatch".to_string()),
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                    Err(format!("value lies past the end of its region file: {e}"))
                }
                Err(e) => {
                    results[i] = Err(Error::io(
                        format!(
                            "reading region {} page {}",
                            read.loc.region(),
                            read.loc.page()
                        ),
                        std::io::Error::new(e.kind(), e.to_string()),
                    ));
                    continue;
                }
            };
            match verdict {
                Ok(()) => {
                    if let Some(bounce) = &read.bounce {
                        buf.fill_from(&bounce.as_slice()[..read.len]);
                    }
                    Counters::add(&self.counters.disk_hits, 1);
                }
                Err(reason) => {
                    tracing::warn!(
                        region = read.loc.region(),
                        page = read.loc.page(),
                        len = read.len,
                        %reason,
                        "disk read failed verification; dropping the entry and reporting a miss"
                    );
                    if read.bounce.is_none() {
                        // What landed there is not this key's value.
                        if let Some(b) = buf.contiguous() {
                            b[..read.read_len].fill(0);
                        }
                    }
                    Counters::add(&self.counters.checksum_failures, 1);
                    Counters::add(&self.counters.misses, 1);
                    self.index
                        .lock(read.digest)
                        .clear_disk(read.digest, read.seq, read.loc);
                    results[i] = Ok(None);
                }
            }
        }
        for read in reads.iter_mut().flatten() {
            if let Some(bounce) = read.bounce.take() {
                disk.bounce_buffers().give_back(bounce);
            }
        }
    }

    fn remove(&self, ns: &Namespace, key: &[u8]) -> Result<bool> {
        self.check_open()?;
        validate_key(key)?;
        let digest = ns.digest(key);
        let mut removed = None;
        let seq = self.log.append(|seq| {
            removed = self.index.lock(digest).remove(digest);
            // Logged even for a key the index does not know: an older
            // durable value may still lie on disk (replaced by a
            // memory-only put that was then evicted) and must not come
            // back after a restart.
            self.disk.is_some().then(|| QueuedWrite::Tombstone {
                digest,
                key: ns.qualify(key),
                seq,
            })
        })?;
        let was_present = removed.is_some();
        drop(removed);
        if was_present {
            Counters::add(&self.counters.removes, 1);
        }
        if self.disk.is_some() {
            self.wait_durable(seq, seq)?;
        }
        Ok(was_present)
    }

    /// Queues a tombstone for a qualified key the index no longer holds
    /// (one the tail scrub found lost); returns its sequence number, for
    /// `wait_durable`.
    fn log_removal(&self, digest: KeyDigest, key: Box<[u8]>) -> Result<u64> {
        self.log
            .append(|seq| Some(QueuedWrite::Tombstone { digest, key, seq }))
    }

    pub(crate) fn wake_flusher(&self, request: bool) {
        self.log.wake(request);
    }

    fn flush_all(&self) -> Result<()> {
        if self.disk.is_none() {
            return Ok(());
        }
        self.log.flush()
    }

    /// Waits until writes `low..=high` are durable; fails if any of them
    /// failed (see `WriteLog::wait_durable`).
    pub(crate) fn wait_durable(&self, low: u64, high: u64) -> Result<()> {
        self.log.wait_durable(low, high)
    }

    fn stats(&self) -> Stats {
        let counts = self.index.counts();
        let c = &self.counters;
        let (policy_bytes, eviction_mode) = {
            let queues = self.eviction.lock().unwrap();
            (queues.heap_bytes(), queues.mode_name())
        };
        Stats {
            entries: counts.entries,
            memory_entries: self.pool.live_entries(),
            memory_bytes: self.pool.live_bytes(),
            memory_capacity: self.pool.capacity(),
            disk_entries: counts.disk_entries,
            disk_value_bytes: counts.disk_bytes,
            disk_used_bytes: self.disk.as_ref().map_or(0, |d| d.used()),
            disk_capacity: self.config.disk_capacity,
            disk_regions: self.disk.as_ref().map_or(0, |d| d.region_count() as u64),
            quarantined_regions: self.recovery.quarantined_regions,
            damaged_regions: self.recovery.damaged_regions,
            damaged_headers: self.recovery.damaged_headers,
            foreign_regions: self.recovery.foreign_regions,
            skipped_region_files: self.recovery.skipped_files,
            buffered_regions: self.recovery.buffered_regions,
            regions_behind_gap: self.recovery.regions_behind_gap,
            scrub_dropped: self.recovery.scrub_dropped,
            memory_hits: Counters::get(&c.memory_hits),
            disk_hits: Counters::get(&c.disk_hits),
            misses: Counters::get(&c.misses),
            evictions: Counters::get(&c.evictions),
            reclaimed_regions: Counters::get(&c.reclaimed_regions),
            reclaimed_entries: Counters::get(&c.reclaimed_entries),
            carried_entries: Counters::get(&c.carried_entries),
            checksum_failures: Counters::get(&c.checksum_failures),
            puts: Counters::get(&c.puts),
            removes: Counters::get(&c.removes),
            flushed_batches: Counters::get(&c.flushed_batches),
            flush_errors: Counters::get(&c.flush_errors),
            retrying_writes: self.log.retrying_writes(),
            index_bytes: counts.table_bytes,
            policy_bytes,
            eviction_mode,
            policy_ns: Counters::get(&c.policy_ns),
            io_engine: self.disk.as_ref().map_or("none", |d| d.engine_name()),
            io_depth: self.config.configured_io_depth(),
            read_piece: self.config.configured_read_piece(),
            direct_io: self.disk.as_ref().is_some_and(|d| d.direct_io()),
            io_fixed_buffers: self
                .disk
                .as_ref()
                .is_some_and(|d| d.engine().uses_fixed_buffers()),
            io_registered_files: self
                .disk
                .as_ref()
                .is_some_and(|d| d.engine().uses_registered_files()),
        }
    }
}

/// Bytes a put copies before adding them to the value's checksum: small
/// enough to still be in the core's cache when hashed.
const COPY_CHUNK: usize = 64 << 10;

/// A value between [`Inner::begin_put`] and [`Inner::commit_put`]: its
/// pool extent, filled a cache-sized chunk at a time.
#[derive(Debug)]
pub struct ReceivingValue {
    digest: KeyDigest,
    slot: PoolSlot,
    /// A write-through value's checksum, taken as each chunk lands, while
    /// the chunk is still in cache.
    checksum: Option<ValueChecksum>,
}

impl ReceivingValue {
    pub fn len(&self) -> usize {
        self.slot.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slot.is_empty()
    }

    /// Fills the value front to back: `read` is given each chunk (at most
    /// 64 KiB) in order and must fill it whole.
    pub fn fill(
        &mut self,
        mut read: impl FnMut(&mut [u8]) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        for chunk in self.slot.bytes_mut().chunks_mut(COPY_CHUNK) {
            read(chunk)?;
            if let Some(checksum) = &mut self.checksum {
                checksum.update(chunk);
            }
        }
        Ok(())
    }
}

/// One value's verification while its pieces complete in any order.
struct PieceCheck {
    checksum: ValueChecksum,
    /// Address and length of each piece's bytes.
    pieces: Vec<(usize, usize)>,
    done: Vec<bool>,
    /// The first piece not yet added to the checksum.
    next: usize,
    /// Value bytes not yet added (padding past the value is not hashed).
    remaining: usize,
    expected: u64,
    /// Set once every piece is in and the checksum matched.
    verified: bool,
}

impl PieceCheck {
    /// Records that `piece` has been read and adds every piece now
    /// contiguous with what was hashed before; once all are in, sets
    /// `verified` if the checksum matches.
    fn complete(&mut self, piece: usize) {
        self.done[piece] = true;
        while self.next < self.pieces.len() && self.done[self.next] {
            let (at, len) = self.pieces[self.next];
            let take = len.min(self.remaining);
            // SAFETY: the piece's read has completed, so the kernel no
            // longer writes it; the buffer outlives the batch read, and
            // nothing else touches it until the read call returns.
            let bytes = unsafe { std::slice::from_raw_parts(at as *const u8, take) };
            self.checksum.update(bytes);
            self.remaining -= take;
            self.next += 1;
        }
        if self.next == self.pieces.len() {
            self.verified = self.checksum.finish() == self.expected;
        }
    }
}

struct DiskRead {
    digest: KeyDigest,
    region: Arc<Region>,
    loc: DiskLoc,
    len: usize,
    read_len: usize,
    checksum: u64,
    seq: u64,
    bounce: Option<AlignedBuf>,
    outcome: std::io::Result<()>,
}

fn segments_len(segments: &[&[u8]]) -> usize {
    segments.iter().map(|s| s.len()).sum()
}

/// Where a get writes one value: a single buffer, or segments filled in
/// order (the multi-buffer form).
pub(crate) trait Destination {
    /// Bytes the destination holds in all.
    fn capacity(&self) -> usize;
    /// The destination as one slice, when it is one (direct reads need it).
    fn contiguous(&mut self) -> Option<&mut [u8]>;
    /// Copies `bytes` (at most `capacity()`) to the front of the destination.
    fn fill_from(&mut self, bytes: &[u8]);
}

impl Destination for &mut [u8] {
    fn capacity(&self) -> usize {
        self.len()
    }
    fn contiguous(&mut self) -> Option<&mut [u8]> {
        Some(&mut self[..])
    }
    fn fill_from(&mut self, bytes: &[u8]) {
        self[..bytes.len()].copy_from_slice(bytes);
    }
}

impl Destination for &mut [&mut [u8]] {
    fn capacity(&self) -> usize {
        self.iter().map(|s| s.len()).sum()
    }
    fn contiguous(&mut self) -> Option<&mut [u8]> {
        match self {
            [only] => Some(&mut only[..]),
            _ => None,
        }
    }
    fn fill_from(&mut self, mut bytes: &[u8]) {
        for segment in self.iter_mut() {
            if bytes.is_empty() {
                break;
            }
            let n = segment.len().min(bytes.len());
            segment[..n].copy_from_slice(&bytes[..n]);
            bytes = &bytes[n..];
        }
    }
}

fn check_buffer(len: usize, buf_len: usize) -> Result<()> {
    if buf_len < len {
        return Err(Error::new(
            ErrorKind::BufferTooSmall,
            format!("value is {len} bytes but the buffer is {buf_len} bytes"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `disk_location` names the bytes a raw reader finds verified at
    /// that place in the file, and nothing before the value is durable.
    #[test]
    fn disk_location_names_the_durable_bytes() {
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(
            Config::new(dir.path())
                .memory_capacity(4 << 20)
                .disk_capacity(32 << 20)
                .region_size(1 << 20),
        )
        .unwrap();
        let value: Vec<u8> = (0..70_000u32).map(|i| (i * 7 % 251) as u8).collect();
        store.put(b"k", &value).unwrap();
        store.flush().unwrap();
        assert_eq!(store.disk_location(b"missing").unwrap(), None);
        assert_eq!(
            store.batch_in_memory(&[&b"k"[..], b"missing"]),
            vec![true, false]
        );
        let at = store
            .disk_location(b"k")
            .unwrap()
            .expect("durable after flush");
        assert_eq!((at.len, at.offset % PAGE_SIZE), (70_000, 0));
        let mut raw = vec![0u8; at.len as usize];
        std::fs::File::open(&at.path)
            .unwrap()
            .read_exact_at(&mut raw, at.offset)
            .unwrap();
        assert_eq!(raw, value);
        assert_eq!(crate::value_checksum(at.digest, &raw), at.checksum);
        let memory_only = PutOptions {
            tier: PutTier::MemoryOnly,
            ..Default::default()
        };
        store.put_with(b"m", b"x", &memory_only).unwrap();
        assert_eq!(store.disk_location(b"m").unwrap(), None);
    }

    /// The checksum is bound to the digest: an index entry that names one
    /// key's bytes for another key (what a digest collision would do with
    /// an unbound checksum) is a miss, counted, and dropped.
    #[test]
    fn bytes_of_one_key_never_verify_as_another() {
        let dir = tempfile::tempdir().unwrap();
        let config = || {
            Config::new(dir.path())
                .memory_capacity(4 << 20)
                .disk_capacity(32 << 20)
                .region_size(1 << 20)
        };
        let store = Store::open(config()).unwrap();
        store.put(b"victim", vec![42u8; 70_000]).unwrap();
        store.flush().unwrap();
        drop(store);
        let store = Store::open(config()).unwrap();
        let ns = store.default_namespace().clone();
        let (victim, forged) = (ns.digest(b"victim"), ns.digest(b"attacker"));
        let entry = {
            let shard = store.inner.index.lock(victim);
            let e = shard.get(victim).unwrap();
            assert!(e.disk().is_some() && e.mem().is_none());
            Entry::new(e.seq(), e.checksum(), None, e.disk(), e.len())
        };
        store.inner.index.lock(forged).insert(forged, entry);
        assert_eq!(store.get(b"attacker").unwrap(), None);
        assert_eq!(store.stats().checksum_failures, 1);
        assert!(!store.exists(b"attacker"), "the forged entry was dropped");
        assert_eq!(store.get(b"victim").unwrap().unwrap(), vec![42u8; 70_000]);
    }
}
