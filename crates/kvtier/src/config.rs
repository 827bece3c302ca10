//! Store configuration. Every setter documents its default.

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use crate::units::{GIB, KIB, MAX_VALUE_SIZE_LIMIT, MIB, PAGE_SIZE};

/// Which io engine the disk tier uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoEngineKind {
    /// io_uring: a batch's reads are queued on a ring and submitted at once,
    /// up to `io_depth` in flight; `io_threads` rings serve concurrent
    /// callers. Falls back to `Psync`, with a warning, where the kernel or
    /// sandbox refuses io_uring.
    Uring,
    /// `pread`/`pwritev`; a batch's reads are spread over `io_threads`
    /// threads.
    Psync,
}

impl IoEngineKind {
    pub fn parse(name: &str) -> Result<Self> {
        match name.to_ascii_lowercase().as_str() {
            "uring" | "io_uring" | "io-uring" => Ok(IoEngineKind::Uring),
            "psync" => Ok(IoEngineKind::Psync),
            other => Err(Error::invalid(format!(
                "unknown io engine {other:?}: expected uring or psync"
            ))),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            IoEngineKind::Uring => "uring",
            IoEngineKind::Psync => "psync",
        }
    }
}

/// How the memory pool picks entries to drop when it is full. Only entries
/// already durable on disk (or put as memory-only) are ever dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EvictionPolicy {
    /// The default: LRU or S3-FIFO with a 10%, 25% or 50% probation queue,
    /// whichever wins on the current workload. Miniature simulations of all
    /// four run on a hash-sampled 1/N of the keys (at most 32,768 pages
    /// each), scored on the prefix each `prefix_len` request would have hit,
    /// and the pool follows the best by a margin (docs/design.md,
    /// "Eviction"). Long-gap reuse (multi-turn chat, agent loops) favours
    /// recency; floods of one-time blocks (RAG suffixes) favour a short
    /// probation queue.
    #[default]
    Adaptive,
    /// S3-FIFO: new entries enter a small FIFO (10% of the pool); those hit
    /// while there move to the main FIFO, the rest leave early. Resists scans,
    /// and hits never take a lock.
    S3Fifo,
    /// Least recently used, approximated CLOCK-style: a hit only marks the
    /// entry, and the marked entries at the old end get another round.
    Lru,
}

impl EvictionPolicy {
    /// The name `parse` accepts.
    pub fn name(self) -> &'static str {
        match self {
            EvictionPolicy::Adaptive => "adaptive",
            EvictionPolicy::S3Fifo => "s3fifo",
            EvictionPolicy::Lru => "lru",
        }
    }

    pub fn parse(name: &str) -> Result<Self> {
        match name.to_ascii_lowercase().as_str() {
            "adaptive" => Ok(EvictionPolicy::Adaptive),
            "s3fifo" | "s3-fifo" => Ok(EvictionPolicy::S3Fifo),
            "lru" => Ok(EvictionPolicy::Lru),
            other => Err(Error::invalid(format!(
                "unknown eviction policy {other:?}: expected adaptive, s3fifo or lru"
            ))),
        }
    }
}

/// When the background flusher writes pool entries to disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlushPolicy {
    /// Write as soon as anything is pending; batches form from whatever
    /// accumulates while the previous write runs.
    WriteThrough,
    /// Write only on `flush()`, a durable put, pool pressure or close.
    OnDemand,
}

/// Configuration for [`crate::Store::open`].
#[derive(Debug, Clone)]
pub struct Config {
    pub(crate) data_dir: PathBuf,
    pub(crate) memory_capacity: u64,
    pub(crate) disk_capacity: u64,
    /// `None`: sized from the disk capacity (see `region_size`).
    pub(crate) region_size: Option<u64>,
    pub(crate) max_value_size: u64,
    pub(crate) io_engine: IoEngineKind,
    pub(crate) io_threads: usize,
    pub(crate) io_depth: u32,
    pub(crate) read_piece: u64,
    pub(crate) direct_io: bool,
    pub(crate) io_registration: bool,
    pub(crate) shareable_memory: bool,
    pub(crate) eviction: EvictionPolicy,
    pub(crate) flush: FlushPolicy,
    pub(crate) flush_batch_bytes: u64,
    pub(crate) flush_yield: Duration,
    pub(crate) flush_yield_quiet: Duration,
    pub(crate) put_wait: Duration,
    /// `Duration::ZERO`: no deadline.
    pub(crate) io_deadline: Duration,
    pub(crate) io_deadline_local: bool,
    /// Where block events go (`Config::events`); `None`: none are made.
    pub(crate) events: Option<std::sync::Arc<crate::events::EventSink>>,
    pub(crate) time_policy: bool,
    pub(crate) namespace: String,
    /// A directory on a file system every node mounts (docs/design.md,
    /// "Shared directory"); `None`: the log stays under `data_dir`.
    pub(crate) shared_dir: Option<PathBuf>,
    pub(crate) shared_poll: Duration,
    pub(crate) shared_read_mode: SharedReadMode,
    pub(crate) shared_checkpoint_interval: Duration,
    pub(crate) local_checkpoints: bool,
    pub(crate) shared_index_share: bool,
    /// `shared::collect_dead_writers`: write this (dead) writer's log of the
    /// shared directory instead of the data directory's node's, and
    /// reclaim every region it had at open.
    pub(crate) adopt_writer: Option<String>,
    /// Test seam: wraps the io engine (see `io::faulty`).
    #[cfg(feature = "test-util")]
    pub(crate) engine_wrapper: Option<EngineWrapper>,
    /// Test seam: wraps the bounded reads' engine (see `disk::deadline`).
    #[cfg(feature = "test-util")]
    pub(crate) bounded_engine_wrapper: Option<EngineWrapper>,
    /// Test seam: write a batch's record without first syncing its values
    /// (the protocol before format 2), to prove the tests catch it.
    #[cfg(feature = "test-util")]
    pub(crate) skip_value_sync: bool,
    /// Test seam: seconds added to this node's wall clock readings.
    #[cfg(feature = "test-util")]
    pub(crate) clock_offset_secs: i64,
}

/// `Config::flush_yield`'s default.
pub const DEFAULT_FLUSH_YIELD: Duration = Duration::from_secs(1);
/// `Config::flush_yield_quiet`'s default.
pub const DEFAULT_FLUSH_YIELD_QUIET: Duration = Duration::from_millis(10);

/// `Config::io_deadline`'s default.
pub const DEFAULT_IO_DEADLINE: Duration = Duration::from_secs(5);

/// A function from the io engine the disk tier built to the one it uses.
#[cfg(feature = "test-util")]
pub type WrapEngine = dyn Fn(std::sync::Arc<dyn crate::io::IoEngine>) -> std::sync::Arc<dyn crate::io::IoEngine>
    + Send
    + Sync;

/// Wraps the io engine the disk tier would use (a test seam).
#[cfg(feature = "test-util")]
#[derive(Clone)]
pub struct EngineWrapper(pub std::sync::Arc<WrapEngine>);

#[cfg(feature = "test-util")]
impl std::fmt::Debug for EngineWrapper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EngineWrapper(..)")
    }
}

impl Config {
    /// A configuration with every default, storing its files in `data_dir`
    /// (created if missing).
    pub fn new(data_dir: impl AsRef<Path>) -> Self {
        Config {
            data_dir: data_dir.as_ref().to_path_buf(),
            memory_capacity: GIB,
            disk_capacity: 16 * GIB,
            region_size: None,
            max_value_size: 128 * MIB,
            io_engine: IoEngineKind::Uring,
            io_threads: 4,
            io_depth: 64,
            read_piece: 2 * MIB,
            direct_io: true,
            io_registration: true,
            shareable_memory: false,
            eviction: EvictionPolicy::default(),
            flush: FlushPolicy::WriteThrough,
            flush_batch_bytes: 64 * MIB,
            flush_yield: DEFAULT_FLUSH_YIELD,
            flush_yield_quiet: DEFAULT_FLUSH_YIELD_QUIET,
            put_wait: Duration::from_secs(5),
            io_deadline: DEFAULT_IO_DEADLINE,
            io_deadline_local: false,
            events: None,
            time_policy: false,
            namespace: String::new(),
            shared_dir: None,
            shared_poll: Duration::from_millis(200),
            shared_read_mode: SharedReadMode::Auto,
            shared_checkpoint_interval: Duration::from_secs(60),
            local_checkpoints: true,
            shared_index_share: false,
            adopt_writer: None,
            #[cfg(feature = "test-util")]
            engine_wrapper: None,
            #[cfg(feature = "test-util")]
            bounded_engine_wrapper: None,
            #[cfg(feature = "test-util")]
            skip_value_sync: false,
            #[cfg(feature = "test-util")]
            clock_offset_secs: 0,
        }
    }

    /// Bytes of the memory pool, allocated and pre-faulted at open (rounded
    /// up to 4 KiB). Every put stages its value here. Default: 1 GiB.
    pub fn memory_capacity(mut self, bytes: u64) -> Self {
        self.memory_capacity = bytes;
        self
    }

    /// Most bytes the disk tier's region files may occupy; 0 disables the
    /// disk tier (a memory-only cache). Whole regions are reclaimed,
    /// oldest first, to stay under it. Default: 16 GiB.
    pub fn disk_capacity(mut self, bytes: u64) -> Self {
        self.disk_capacity = bytes;
        self
    }

    /// Size at which a region file is sealed and a new one started; also the
    /// unit of reclaim. A multiple of 4 KiB, at least 64 KiB, at most half
    /// the disk capacity. Default: 256 MiB, or an eighth of the disk
    /// capacity when that is smaller (rounded down to 4 KiB, at least
    /// 64 KiB), so small disk tiers still reclaim in small steps.
    pub fn region_size(mut self, bytes: u64) -> Self {
        self.region_size = Some(bytes);
        self
    }

    /// Largest value accepted (at most 4 GiB - 4 KiB). Default: 128 MiB.
    pub fn max_value_size(mut self, bytes: u64) -> Self {
        self.max_value_size = bytes;
        self
    }

    /// The disk tier's io engine. Default: `IoEngineKind::Uring` (which
    /// falls back to `Psync` where io_uring is refused).
    pub fn io_engine(mut self, engine: IoEngineKind) -> Self {
        self.io_engine = engine;
        self
    }

    /// Callers that can drive disk I/O at once: io_uring rings for the
    /// uring engine, threads a batch of reads is spread over for psync.
    /// Default: 4.
    pub fn io_threads(mut self, threads: usize) -> Self {
        self.io_threads = threads;
        self
    }

    /// Most operations in flight on one io_uring ring (its queue depth).
    /// Default: 64.
    pub fn io_depth(mut self, depth: u32) -> Self {
        self.io_depth = depth;
        self
    }

    /// Size of the pieces a disk read of a value is cut into: each piece
    /// is one read, all of a batch's pieces are queued at once (up to
    /// `io_depth` in flight), and a value's checksum advances as its
    /// pieces complete. A multiple of 4 KiB, 4 KiB to 64 MiB. Default:
    /// 2 MiB: small enough that a value's first pieces are checksummed
    /// while the rest are in flight and that the device gets many requests
    /// at once; large enough to be big transfers (NVMe devices split above
    /// 128 KiB to 2 MiB anyway).
    pub fn read_piece(mut self, bytes: u64) -> Self {
        self.read_piece = bytes;
        self
    }

    /// Open region files with `O_DIRECT`; where the file system refuses it
    /// (tmpfs), buffered I/O is used with a warning. Default: true.
    pub fn direct_io(mut self, enabled: bool) -> Self {
        self.direct_io = enabled;
        self
    }

    /// With the io_uring engine, register the memory pool as fixed buffers
    /// (pinned once, not per write) and region files as registered files.
    /// Either is skipped with a log line where the kernel or the memlock
    /// limit refuses it. Default: true.
    pub fn io_registration(mut self, enabled: bool) -> Self {
        self.io_registration = enabled;
        self
    }

    /// Back the memory pool with a sealed memory file that same-host
    /// readers may map read-only ([`Store::pool_memory_file`](crate::Store::pool_memory_file)):
    /// a server hands it to its same-user, full-scope clients, which then
    /// copy leased values out of it themselves (docs/server.md, "Pool
    /// mapping"). The pool then takes shared memory, which gets transparent
    /// huge pages only where `shmem_enabled` allows. Default: false (a
    /// private anonymous mapping).
    pub fn shareable_memory(mut self, enabled: bool) -> Self {
        self.shareable_memory = enabled;
        self
    }

    /// Count the time spent in the eviction policy (`Stats::policy_ns`), for
    /// benchmarks: two clock reads per policy call. Default: off.
    pub fn time_policy(mut self, on: bool) -> Self {
        self.time_policy = on;
        self
    }

    /// The memory pool's eviction policy. Default: `EvictionPolicy::Adaptive`.
    pub fn eviction(mut self, policy: EvictionPolicy) -> Self {
        self.eviction = policy;
        self
    }

    /// When entries are written to disk. Default: `FlushPolicy::WriteThrough`.
    pub fn flush_policy(mut self, policy: FlushPolicy) -> Self {
        self.flush = policy;
        self
    }

    /// Most value bytes gathered into one disk write (one batch record).
    /// A single larger value is written alone. Default: 64 MiB.
    pub fn flush_batch_bytes(mut self, bytes: u64) -> Self {
        self.flush_batch_bytes = bytes;
        self
    }

    /// The longest write-through writes wait for gets to pause before the
    /// flusher writes them (docs/design.md, "Write-back yields to reads").
    /// While gets keep starting (one within `flush_yield_quiet`), queued
    /// writes are held back, so loads, which an engine waits for, do not
    /// share the memory bus and the disk with background writes; once the
    /// oldest queued write has waited this long, the flusher writes until
    /// its queue is empty, whatever gets do. Writes are not held while the
    /// queued values take a quarter of `memory_capacity` or more (they pin
    /// the pool until written). A `flush`, a durable put, a removal, a put
    /// waiting for pool space and close never wait for gets. Under
    /// `FlushPolicy::OnDemand` there is nothing to hold back.
    /// `Duration::ZERO`: writes never wait. Default: 1 s.
    pub fn flush_yield(mut self, most: Duration) -> Self {
        self.flush_yield = most;
        self
    }

    /// How long no get may have started for gets to count as paused (see
    /// `flush_yield`). Default: 10 ms.
    pub fn flush_yield_quiet(mut self, quiet: Duration) -> Self {
        self.flush_yield_quiet = quiet;
        self
    }

    /// How long a put waits for the flusher to make pool space before it
    /// fails with `NoSpace`. Default: 5 s.
    pub fn put_wait(mut self, wait: Duration) -> Self {
        self.put_wait = wait;
        self
    }

    /// The longest a caller waits on a file system (docs/design.md,
    /// "Deadlines on storage I/O"). A batch of value reads from a file
    /// system that can stall (network and FUSE file systems: the shared
    /// directory, a data directory on one) that has not completed within
    /// it answers a miss for each of its values; its reads go on, into
    /// the store's own buffers, and are dropped when the kernel returns
    /// them. A `flush` (and a put or remove under write-through, which
    /// waits for the disk) answers an I/O error of kind `TimedOut` past
    /// it; the writes stay queued and are made durable when the file
    /// system answers. Memory hits never wait on it. `Duration::ZERO`
    /// turns it off (callers wait for the file system however long it
    /// takes). Default: 5 s.
    pub fn io_deadline(mut self, deadline: Duration) -> Self {
        self.io_deadline = deadline;
        self
    }

    /// Bound reads of files on local disks by `io_deadline` too. Off by
    /// default: reads of a local disk go straight into the caller's memory
    /// (no copy), which a read that outlives its deadline must never do,
    /// so bounded reads go through buffers of the store's own and cost a
    /// copy; a local disk that stops answering is a failed disk, which
    /// the kernel's own timeouts end. Default: false.
    pub fn io_deadline_local(mut self, enabled: bool) -> Self {
        self.io_deadline_local = enabled;
        self
    }

    /// Announce block changes into `sink` (see [`crate::BlockEvent`] for
    /// when each is made). Default: none (no event is built).
    pub fn events(mut self, sink: std::sync::Arc<crate::events::EventSink>) -> Self {
        self.events = Some(sink);
        self
    }

    /// The namespace of the store's own methods (`Store::put`, `get`, ...);
    /// other namespaces are reached with `Store::in_namespace`. At most 128
    /// bytes, no control characters. Default: "" (the empty namespace).
    pub fn namespace(mut self, name: impl Into<String>) -> Self {
        self.namespace = name.into();
        self
    }

    /// Keep the disk tier's region log on a shared file system (JuiceFS,
    /// CephFS, Lustre, NFS, 3FS's FUSE) that every node mounts at `dir`:
    /// this store writes its own log under `dir/nodes/<node id>/` and
    /// indexes, follows and reads every other node's log there, so a block
    /// flushed by one node is a disk hit on every node. `data_dir` stays
    /// local (lock, node id, socket). Every node of one shared directory
    /// must use the same `dir` contents (its `key-secret` keys every
    /// digest). `disk_capacity` is this node's share. Default: none (the
    /// log lives in `data_dir/regions`, read by this store alone).
    pub fn shared_dir(mut self, dir: impl AsRef<Path>) -> Self {
        self.shared_dir = Some(dir.as_ref().to_path_buf());
        self
    }

    /// How often the store looks for new batch records of the other
    /// writers of the shared directory (a listing of their region
    /// directories and a read of their newest files' new pages); a block
    /// another node flushed is indexed here within about this long plus
    /// the file system's own metadata cache time. 10 ms to 60 s.
    /// Default: 200 ms.
    pub fn shared_poll(mut self, every: Duration) -> Self {
        self.shared_poll = every;
        self
    }

    /// How this node reads other writers' region files of the shared
    /// directory: `Auto` by the file system each lives on (buffered, with
    /// sequential readahead, on network and FUSE file systems: JuiceFS,
    /// CephFS, Lustre, NFS, 3FS's FUSE client; O_DIRECT on local disks),
    /// or `Direct` or `Buffered` for every file (docs/design.md, "Read
    /// modes per mount"). Default: Auto.
    pub fn shared_read_mode(mut self, mode: SharedReadMode) -> Self {
        self.shared_read_mode = mode;
        self
    }

    /// With a shared directory: how often this node writes an index
    /// checkpoint of its log (its live entries and removals, so that a node
    /// starting beside a large log reads the checkpoint and only the
    /// records after it; docs/design.md, "Index checkpoints"), when
    /// batches were written since the last one; one more is written at a
    /// clean close. At least 1 s. Default: 60 s.
    pub fn shared_checkpoint_interval(mut self, every: Duration) -> Self {
        self.shared_checkpoint_interval = every;
        self
    }

    /// Without a shared directory: whether a clean close writes an index
    /// checkpoint of the log into the data directory (`checkpoints/`), so
    /// that the next open loads it instead of reading every batch record,
    /// when the region files are still exactly the ones it recorded
    /// (docs/design.md, "Local index checkpoints"). Costs the close a
    /// write of 48 bytes per entry and a sync. Default: on.
    pub fn local_index_checkpoints(mut self, on: bool) -> Self {
        self.local_checkpoints = on;
        self
    }

    /// With a shared directory: index only a share of the other writers'
    /// entries (the bounded mode, for shared directories past what one
    /// node's index holds: docs/design.md, "The bounded index"). Which
    /// share is given later by `Store::set_index_share` (a cluster member
    /// sets it from the member list; a member asks the share's owner for
    /// the rest); until then no other writer's entry is indexed. This
    /// node's own log is always indexed whole. Default: false (every
    /// writer's entries are indexed on every node).
    pub fn shared_index_share(mut self, bounded: bool) -> Self {
        self.shared_index_share = bounded;
        self
    }

    /// Whether the bounded index mode is on (`shared_index_share`).
    pub fn configured_shared_index_share(&self) -> bool {
        self.shared_index_share
    }

    /// The shared directory, if the log lives on one.
    pub fn configured_shared_dir(&self) -> Option<&Path> {
        self.shared_dir.as_deref()
    }

    /// Test seam: the disk tier uses `wrap(engine)` instead of the engine
    /// it built, e.g. a `io::faulty::FaultyEngine` around it. Default:
    /// none.
    #[cfg(feature = "test-util")]
    pub fn wrap_io_engine(mut self, wrap: EngineWrapper) -> Self {
        self.engine_wrapper = Some(wrap);
        self
    }

    /// Test seam: the bounded reads (`io_deadline`) use `wrap(engine)`
    /// instead of the `pread` engine they built. Default: none.
    #[cfg(feature = "test-util")]
    pub fn wrap_bounded_io_engine(mut self, wrap: EngineWrapper) -> Self {
        self.bounded_engine_wrapper = Some(wrap);
        self
    }

    /// Test seam: write each batch's record in the same write as its values
    /// with one sync for both (the protocol before data directory format
    /// 2), so a power loss can leave a valid record over torn values. Only
    /// for proving that the power-loss tests catch it. Default: false.
    #[cfg(feature = "test-util")]
    pub fn unsafe_single_sync_batches(mut self, enabled: bool) -> Self {
        self.skip_value_sync = enabled;
        self
    }

    /// Test seam: this node's wall clock reads `secs` seconds off (a node
    /// whose clock is wrong: a bad NTP answer, a broken RTC). Default: 0.
    #[cfg(feature = "test-util")]
    pub fn unsafe_clock_offset_secs(mut self, secs: i64) -> Self {
        self.clock_offset_secs = secs;
        self
    }

    /// The io engine asked for (the store falls back to psync, with a log
    /// line, where io_uring is unavailable; `Stats::io_engine` says which
    /// runs).
    pub fn requested_io_engine(&self) -> IoEngineKind {
        self.io_engine
    }

    /// `io_depth` as configured (default 64).
    pub fn configured_io_depth(&self) -> u32 {
        self.io_depth
    }

    /// `read_piece` as configured (default 2 MiB).
    pub fn configured_read_piece(&self) -> u64 {
        self.read_piece
    }

    /// `flush_yield` as configured (default 1 s).
    pub fn configured_flush_yield(&self) -> Duration {
        self.flush_yield
    }

    /// `flush_batch_bytes` as configured (default 64 MiB).
    pub fn configured_flush_batch_bytes(&self) -> u64 {
        self.flush_batch_bytes
    }

    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// The region size in effect.
    pub fn effective_region_size(&self) -> u64 {
        self.region_size.unwrap_or_else(|| {
            (self.disk_capacity / 8 / PAGE_SIZE * PAGE_SIZE).clamp(64 * KIB, 256 * MIB)
        })
    }

    pub(crate) fn disk_enabled(&self) -> bool {
        self.disk_capacity > 0
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.memory_capacity < PAGE_SIZE {
            return Err(Error::invalid(format!(
                "memory capacity {} is below the 4096-byte minimum",
                self.memory_capacity
            )));
        }
        if self.max_value_size == 0 || self.max_value_size > MAX_VALUE_SIZE_LIMIT {
            return Err(Error::invalid(format!(
                "max value size {} must be 1 to {MAX_VALUE_SIZE_LIMIT} bytes",
                self.max_value_size
            )));
        }
        if self.io_threads == 0 || self.io_threads > 256 {
            return Err(Error::invalid("io_threads must be 1 to 256"));
        }
        if self.io_depth == 0 || self.io_depth > 4096 {
            return Err(Error::invalid("io_depth must be 1 to 4096"));
        }
        if self.read_piece < PAGE_SIZE
            || self.read_piece > 64 * MIB
            || !self.read_piece.is_multiple_of(PAGE_SIZE)
        {
            return Err(Error::invalid(format!(
                "read_piece {} must be a multiple of 4096 from 4 KiB to 64 MiB",
                self.read_piece
            )));
        }
        if !self.io_deadline.is_zero()
            && (self.io_deadline < Duration::from_millis(10)
                || self.io_deadline > Duration::from_secs(3600))
        {
            return Err(Error::invalid(
                "io_deadline must be 10 ms to 1 hour (or zero: no deadline)",
            ));
        }
        if self.shared_index_share && self.shared_dir.is_none() {
            return Err(Error::invalid(
                "shared_index_share bounds the index of a shared directory's other writers: it \
                 needs shared_dir",
            ));
        }
        if self.shared_dir.is_some() {
            if !self.disk_enabled() {
                return Err(Error::invalid(
                    "a shared directory needs a disk tier (a disk capacity above 0): it holds \
                     this node's log",
                ));
            }
            if self.shared_poll < Duration::from_millis(10)
                || self.shared_poll > Duration::from_secs(60)
            {
                return Err(Error::invalid("shared_poll must be 10 ms to 60 s"));
            }
            if self.shared_checkpoint_interval < Duration::from_secs(1) {
                return Err(Error::invalid(
                    "shared_checkpoint_interval must be at least 1 s",
                ));
            }
        }
        if self.flush_batch_bytes < PAGE_SIZE {
            return Err(Error::invalid("flush_batch_bytes must be at least 4096"));
        }
        if self.disk_enabled() {
            let region_size = self.effective_region_size();
            if region_size < 64 * KIB || !region_size.is_multiple_of(PAGE_SIZE) {
                return Err(Error::invalid(format!(
                    "region size {} must be a multiple of 4096 and at least 64 KiB",
                    region_size
                )));
            }
            if self.disk_capacity < 2 * region_size {
                return Err(Error::invalid(format!(
                    "disk capacity {} must be at least two regions ({} bytes each)",
                    self.disk_capacity, region_size
                )));
            }
        }
        Ok(())
    }
}

/// The read mode of other writers' files (`Config::shared_read_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SharedReadMode {
    /// By the file system each file lives on (`read_mode`). The default.
    #[default]
    Auto,
    Direct,
    Buffered,
}

impl SharedReadMode {
    pub fn parse(text: &str) -> Result<SharedReadMode> {
        match text {
            "auto" => Ok(SharedReadMode::Auto),
            "direct" => Ok(SharedReadMode::Direct),
            "buffered" => Ok(SharedReadMode::Buffered),
            other => Err(Error::invalid(format!(
                "shared read mode {other:?}: expected auto, direct or buffered"
            ))),
        }
    }
}
