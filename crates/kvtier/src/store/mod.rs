//! The `Store` facade: the one place that decides tiering.
//!
//! Put: the value is copied once into a pool extent, indexed, and queued
//! for the flusher; the call returns. Get: every key of a batch is looked up
//! first; memory hits are copied out under a lease (an `Arc` on the slot),
//! hits below memory are read together as one batch by the tier there,
//! through the tier seam (`tier::LowerTier::read_verified`), which
//! verifies them before they count. The store names no concrete tier
//! outside its composition (`open.rs`, with the region log's local
//! checkpoints in `local_checkpoint.rs`).
//!
//! By concern: `open` (opening and recovery), `write` (the put path and
//! removes; `streamed_put` for values arriving piece by piece), `read`
//! (lookups and the get path), `namespaced` (the per-namespace view every
//! call goes through), `options` (per-call put options). This file holds
//! the shared state, the facade and closing.

mod local_checkpoint;
#[cfg(test)]
mod model_tier;
mod namespaced;
mod namespaces;
mod open;
mod options;
mod read;
mod streamed_put;
mod write;

pub use namespaced::NamespacedStore;
pub use namespaces::{NamespaceCensus, RetiredNamespace, MANIFEST_KEY, MAX_MANIFEST_LEN};
pub use options::{PutOptions, PutTier};
pub use streamed_put::StreamedPuts;
pub use write::ReceivingValue;

use crate::config::Config;
use crate::disk::RecoveryReport;
use crate::error::{Error, Result};
use crate::flusher::FlusherHandle;
use crate::index::Index;
use crate::key::{KeySecret, Namespace};
use crate::lock::DirLock;
use crate::pool::{EvictionQueues, PoolCore, PoolSlot};
use crate::stats::{Counters, Stats};
use crate::tier::{DiskLocation, LowerTier};
use crate::units::PAGE_SIZE;
use crate::write_log::WriteLog;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

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
    /// The tier below the memory pool, through the tier seam (the region
    /// log: `store/open.rs` composes it), when there is one.
    lower: Option<Arc<dyn LowerTier>>,
    /// Tests that hold the region log's test gates reach it here.
    #[cfg(test)]
    disk_for_tests: Option<Arc<crate::disk::DiskTier>>,
    /// Whether a flusher writes what is put into that tier (the region
    /// log's does): without one, puts and removes stay in memory.
    writes_below: bool,
    /// Sequence numbers, the flusher's queue and the durable watermark.
    log: Arc<WriteLog>,
    /// With a shared directory: the follower of the other writers' logs,
    /// and this node's writer directory (locked while the store lives).
    follower: Option<Arc<crate::shared::Follower>>,
    /// This log's index checkpoints: in the shared directory for the
    /// other nodes, or in the data directory for this store's next open.
    checkpoints: Option<Arc<crate::checkpoint::CheckpointWriter>>,
    shared: Option<crate::shared::SharedDir>,
    counters: Arc<Counters>,
    closed: AtomicBool,
    lock: Mutex<Option<DirLock>>,
    recovery: RecoveryReport,
    max_put_len: u64,
    /// The process that opened the store (see `check_owner`).
    owner_pid: u32,
    /// The data directory's digest key (see `crate::data_dir`).
    secret: Arc<KeySecret>,
}

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

    /// The value's byte offset in the pool's memory file
    /// ([`Store::pool_memory_file`]).
    pub fn pool_offset(&self) -> u64 {
        self.0.pool_offset()
    }
}

/// The embedded tiered KV-cache store. `Send + Sync`: share it with an
/// `Arc` and call it from any number of threads.
#[derive(Debug)]
pub struct Store {
    inner: Arc<Inner>,
    flusher: Mutex<Option<FlusherHandle>>,
    follow_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// The store's own methods go through the namespace of
    /// `Config::namespace`.
    default_view: NamespacedStore,
}

impl Store {
    /// A namespace of this store: keys used through it never meet equal
    /// keys of another namespace (see docs/design.md, "Keys"). Put into the
    /// name whatever makes two blocks' bytes incompatible: model, dtype,
    /// block size, tensor-parallel rank and size, KV layout.
    pub fn namespace(&self, name: &str) -> Result<Namespace> {
        Namespace::new(Arc::clone(&self.inner.secret), name)
    }

    /// This store seen through `namespace`: a view that shares the store
    /// (an `Arc`), so it may be kept and sent to other threads.
    pub fn in_namespace(&self, namespace: &Namespace) -> NamespacedStore {
        NamespacedStore::new(Arc::clone(&self.inner), namespace.clone())
    }

    /// The namespace the store's own methods use (`Config::namespace`).
    pub fn default_namespace(&self) -> &Namespace {
        self.default_view.namespace()
    }

    /// The store's default namespace as a view: what every call of the
    /// store itself runs on.
    pub fn default_view(&self) -> &NamespacedStore {
        &self.default_view
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

    /// `key`'s hash for the bounded index in the default namespace; see
    /// [`NamespacedStore::share_hash`].
    pub fn share_hash(&self, key: impl AsRef<[u8]>) -> u64 {
        self.default_view().share_hash(key)
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

    /// Every namespace holding a block or a manifest, sorted by name: its
    /// blocks and bytes as the index holds them now (a census that reads
    /// every batch record of the tier's regions beside the index: about
    /// what a reopen reading records costs), and its manifest. See
    /// docs/design.md, "Namespaces: census, manifests, retirement".
    pub fn namespaces(&self) -> Result<Vec<NamespaceCensus>> {
        self.inner.namespace_census()
    }

    /// Retires namespace `name`: see [`NamespacedStore::retire`].
    pub fn retire_namespace(&self, name: &str) -> Result<RetiredNamespace> {
        self.inner.retire_namespace(&self.namespace(name)?)
    }

    /// Returns once everything put so far is durable on disk. Fails if any
    /// write failed since the previous `flush` (those values remain readable
    /// from memory but are not durable).
    pub fn flush(&self) -> Result<()> {
        self.default_view().flush()
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
        if let Some(follower) = &self.inner.follower {
            follower.shut_down();
            if let Some(thread) = self.follow_thread.lock().unwrap().take() {
                let _ = thread.join();
            }
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
        let lock = self.inner.lock.lock().unwrap().take();
        if let (Some(lower), Some(lock)) = (&self.inner.lower, &lock) {
            // The flusher is joined: no write of this store is in flight.
            lower.closing(lock.dir_file());
        }
        if let (Ok(()), Some(checkpoints)) = (&result, &self.inner.checkpoints) {
            // The flusher is joined: the log is still. Other nodes starting
            // later (or, in a local directory, this store's next open) read
            // this instead of every record.
            if let Err(e) = checkpoints.write_now() {
                tracing::warn!(error = %e, "could not write an index checkpoint at close");
            }
        }
        if result.is_ok() {
            // Everything acknowledged is on disk and nothing writes any
            // more: the next open need not scrub the tail. (Written while
            // the directory is still locked.)
            if let Err(e) = crate::data_dir::leave_clean_marker(&self.inner.config.data_dir) {
                tracing::warn!(error = %e, "could not mark the shutdown clean; the next open scrubs the newest region");
            }
            if let Some(shared) = &self.inner.shared {
                if let Err(e) = crate::data_dir::leave_clean_marker(&shared.writer_dir) {
                    tracing::warn!(error = %e, "could not mark the shutdown clean in the shared directory; other nodes will verify this writer's newest region");
                }
            }
        }
        self.inner.index.clear();
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

    /// The other writers of the shared directory as this node follows
    /// them (empty without one).
    pub fn shared_writers(&self) -> Vec<crate::shared::SharedWriter> {
        self.inner
            .follower
            .as_ref()
            .map_or_else(Vec::new, |f| f.writers())
    }

    /// Looks for the other writers' new records now instead of at the next
    /// poll (`Config::shared_poll`); returns once this pass is done. A
    /// no-op without a shared directory.
    pub fn follow_shared_now(&self) {
        if let Some(follower) = &self.inner.follower {
            follower.poll();
        }
    }

    /// Bounded index mode (`Config::shared_index_share`): index from now
    /// on only the other writers' keys whose `NamespacedStore::share_hash`
    /// `share` accepts; the rest is another node's to index and answer.
    /// The next follow pass drops the entries outside the share and reads
    /// every other writer's records again for the keys it adds (call
    /// `follow_shared_now` to wait for it). This node's own log stays
    /// indexed whole. `InvalidArgument` unless the bounded mode is on.
    /// Most other writers' region files this node holds open at once (one
    /// descriptor each): the server sets the room its own caps leave, so
    /// a shared directory full of writers (or of junk writer directories)
    /// cannot take the descriptors its connections need. Regions past it
    /// are not followed (misses, `shared_regions_over_file_budget`) until
    /// there is room; lowered below what is open, the regions past it are
    /// closed. Default: half the open-file limit at open. No effect
    /// without a shared directory.
    pub fn set_shared_file_budget(&self, files: usize) {
        if let Some(lower) = &self.inner.lower {
            lower.set_open_files_budget(files);
        }
        if let Some(follower) = &self.inner.follower {
            follower.close_past_budget();
        }
    }

    pub fn set_index_share(
        &self,
        share: impl Fn(u64) -> bool + Send + Sync + 'static,
    ) -> Result<()> {
        let bounded = self
            .inner
            .follower
            .as_ref()
            .is_some_and(|f| f.set_share(Arc::new(share)));
        if bounded {
            Ok(())
        } else {
            Err(Error::invalid(
                "set_index_share needs a shared directory in the bounded index mode \
                 (Config::shared_index_share)",
            ))
        }
    }

    /// Writes an index checkpoint of this node's log now (with a shared
    /// directory; otherwise `InvalidArgument`), after making everything
    /// put so far durable. Returns the checkpoint's path. Nodes that start
    /// later load it instead of reading every record of this log.
    pub fn write_checkpoint(&self) -> Result<std::path::PathBuf> {
        // A local directory's checkpoint is written at a clean close only:
        // one written earlier stops matching the log at its next write.
        let (Some(checkpoints), Some(_)) = (&self.inner.checkpoints, &self.inner.shared) else {
            return Err(Error::invalid("index checkpoints need a shared directory"));
        };
        self.flush()?;
        // Between batches: the flusher is told to wait for this.
        let _quiet = self.inner.log.hold_flusher();
        checkpoints.write_now()
    }

    /// Largest value a put can accept with this configuration: the smallest
    /// of the max value size, the memory pool and (for disk puts) one batch.
    pub fn max_put_len(&self) -> u64 {
        self.inner.max_put_len
    }

    /// The memory pool's memory file, which a mapping can only read (see
    /// [`Config::shareable_memory`](crate::Config::shareable_memory)), and
    /// its length; `None` unless the store was opened with it. A value
    /// held by a [`ValueLease`] lies at `pool_offset()` in it, unchanged
    /// while the lease lives.
    pub fn pool_memory_file(&self) -> Option<(std::os::fd::BorrowedFd<'_>, u64)> {
        let pool = &self.inner.pool;
        pool.shared_view().map(|fd| (fd, pool.capacity()))
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
            if let Some(thread) = self.follow_thread.get_mut().ok().and_then(Option::take) {
                std::mem::forget(thread);
            }
            return;
        }
        if let Err(e) = self.close() {
            tracing::warn!(error = %e, "closing the store on drop");
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

    /// Runs `f`, counting its time as the eviction policy's when asked to.
    pub(super) fn timed<T>(&self, f: impl FnOnce() -> T) -> T {
        if !self.config.time_policy {
            return f();
        }
        let start = Instant::now();
        let result = f();
        Counters::add(&self.counters.policy_ns, start.elapsed().as_nanos() as u64);
        result
    }

    pub(crate) fn wake_flusher(&self, request: bool) {
        self.log.wake(request);
    }

    pub(super) fn flush_all(&self) -> Result<()> {
        if !self.writes_below {
            return Ok(());
        }
        self.log.flush()
    }

    /// Waits until writes `low..=high` are durable; fails if any of them
    /// failed (see `WriteLog::wait_durable`).
    pub(crate) fn wait_durable(&self, low: u64, high: u64) -> Result<()> {
        self.log.wait_durable(low, high)
    }

    pub(super) fn stats(&self) -> Stats {
        let counts = self.index.counts();
        let c = &self.counters;
        let usage = self.lower.as_ref().map(|l| l.usage()).unwrap_or_default();
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
            disk_used_bytes: usage.used_bytes,
            disk_capacity: self.config.disk_capacity,
            disk_regions: usage.units,
            quarantined_regions: self.recovery.quarantined_regions,
            damaged_regions: self.recovery.damaged_regions,
            damaged_headers: self.recovery.damaged_headers,
            foreign_regions: self.recovery.foreign_regions,
            skipped_region_files: self.recovery.skipped_files,
            buffered_regions: self.recovery.buffered_regions,
            regions_behind_gap: self.recovery.regions_behind_gap,
            scrub_dropped: self.recovery.scrub_dropped,
            checkpoint_entries_loaded: self.recovery.checkpoint_entries,
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
            io_engine: if self.lower.is_some() {
                usage.io_engine
            } else {
                "none"
            },
            io_depth: self.config.configured_io_depth(),
            read_piece: self.config.configured_read_piece(),
            direct_io: usage.direct_io,
            io_fixed_buffers: usage.fixed_buffers,
            io_registered_files: usage.registered_files,
            io_deadline_ms: self.config.io_deadline.as_millis() as u64,
            io_deadline_misses: usage.deadline_misses,
            io_deadline_write_errors: self.log.deadline_errors(),
            io_stalls: usage.stalls,
            io_stalled_reads: usage.stalled_reads,
            io_stalled_read_bytes: usage.stalled_read_bytes,
            shared_dir: self.shared.is_some(),
            shared_writers: self.follow_count(|f| &f.writers),
            shared_regions: self.follow_count(|f| &f.regions),
            shared_buffered_regions: usage.buffered_other_units,
            shared_bytes: self.follow_count(|f| &f.bytes),
            shared_batches: self.follow_count(|f| &f.batches),
            shared_stuck_regions: self.follow_count(|f| &f.stuck_regions),
            shared_clock_ahead_entries: self.follow_count(|f| &f.clock_ahead),
            shared_regions_behind_gap: self.follow_count(|f| &f.regions_behind_gap),
            shared_regions_over_file_budget: self.follow_count(|f| &f.regions_over_budget),
            shared_dirs_without_lock: self.follow_count(|f| &f.writers_without_lock),
            shared_writers_stalled: self.follow_count(|f| &f.writers_stalled),
            shared_tombstones: self.follow_count(|f| &f.tombstones),
            shared_checkpoints_loaded: self.follow_count(|f| &f.checkpoints_loaded),
            shared_checkpoint_entries: self.follow_count(|f| &f.checkpoint_entries),
            shared_polls: self.follow_count(|f| &f.polls),
            shared_follow_age_ms: self.follower.as_ref().map_or(0, |f| {
                let last = f.counters.last_pass_unix_ms.load(Ordering::Relaxed);
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64);
                now.saturating_sub(last)
            }),
            shared_reads: Counters::get(&c.shared_reads),
            shared_read_failures: Counters::get(&c.shared_read_failures),
            shared_index_share: self.config.shared_index_share,
            shared_outside_share: self.follow_count(|f| &f.outside_share),
            shared_share_rereads: self.follow_count(|f| &f.share_rereads),
        }
    }
}

impl Inner {
    fn follow_count(&self, field: impl Fn(&crate::shared::FollowCounters) -> &AtomicU64) -> u64 {
        self.follower
            .as_ref()
            .map_or(0, |f| field(&f.counters).load(Ordering::Relaxed))
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

fn check_buffer(len: usize, buf_len: usize) -> Result<()> {
    if buf_len < len {
        return Err(Error::buffer_too_small(len as u64, buf_len as u64));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::Entry;

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
            Entry::new(e.seq(), e.checksum(), None, e.disk(), e.value_len())
        };
        store.inner.index.lock(forged).insert(forged, entry);
        assert_eq!(store.get(b"attacker").unwrap(), None);
        assert_eq!(store.stats().checksum_failures, 1);
        assert!(!store.exists(b"attacker"), "the forged entry was dropped");
        assert_eq!(store.get(b"victim").unwrap().unwrap(), vec![42u8; 70_000]);
    }
}
