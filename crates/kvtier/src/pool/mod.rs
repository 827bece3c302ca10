//! The memory tier: one pre-allocated, pre-faulted, page-aligned region cut
//! into extents, one extent per value.
//!
//! A [`PoolSlot`] owns an extent; the extent returns to the allocator when
//! the last `Arc<PoolSlot>` drops. The index, the flusher's queue and every
//! in-flight reader each hold an `Arc`, so a reader's bytes can never be
//! freed under it: that clone is the read lease, and it always ends when
//! the read does.

mod allocator;
mod eviction;
mod shadow;

pub use allocator::ExtentAllocator;
pub use eviction::EvictionQueues;
pub use shadow::Shadow;

use crate::error::{Error, Result};
use crate::key::KeyDigest;
use crate::units::PAGE_SIZE;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

/// The mapped region and its allocator, shared by every slot.
#[derive(Debug)]
pub struct PoolCore {
    /// The mapping's first byte, taken once from `mapping`: every slot's
    /// bytes are reached through this pointer, never through `mapping`'s
    /// slices, so no `&mut [u8]` over the whole pool is ever formed while
    /// extents are in use.
    base: *mut u8,
    len: usize,
    /// Owns the mapping (unmapped on drop, after every slot: each holds an
    /// `Arc` to this core).
    mapping: memmap2::MmapMut,
    /// The memory file behind the mapping, for a pool that same-host
    /// clients may map read-only (`Config::shareable_memory`); `None` for
    /// the default anonymous mapping.
    file: Option<std::os::fd::OwnedFd>,
    allocator: Mutex<ExtentAllocator>,
    live_entries: AtomicU64,
    live_bytes: AtomicU64,
}

// SAFETY: `base` points to a private mapping owned by this struct for its
// whole life; disjoint extents are handed out under the allocator mutex, and
// each extent is only written by its unique `PoolSlot` owner before the slot
// is shared.
unsafe impl Send for PoolCore {}
// SAFETY: as above; shared access only reads bytes of published slots.
unsafe impl Sync for PoolCore {}

impl PoolCore {
    /// Maps `capacity` bytes (rounded up to a page), pre-faulted so the data
    /// path takes no page faults.
    #[cfg(test)]
    pub fn new(capacity: u64) -> Result<Arc<Self>> {
        let pool = Self::new_unpopulated(capacity, false)?;
        pool.prefault();
        Ok(pool)
    }

    /// [`new`](Self::new), with the pre-fault run on a thread of its own:
    /// backing a large pool with memory costs a second per few GiB (more on
    /// a virtual machine whose host hands out fresh pages), which a store's
    /// open overlaps with its recovery. Join the handle before the pool is
    /// used or registered with an I/O engine (pinning would fault the pages
    /// in itself, one by one).
    pub fn new_prefaulting(
        capacity: u64,
        shareable: bool,
    ) -> Result<(Arc<Self>, std::thread::JoinHandle<()>)> {
        let pool = Self::new_unpopulated(capacity, shareable)?;
        let populating = Arc::clone(&pool);
        let handle = std::thread::Builder::new()
            .name("kvtier-prefault".into())
            .spawn(move || populating.prefault())
            .map_err(|e| Error::io("starting the pool's pre-fault thread", e))?;
        Ok((pool, handle))
    }

    /// The mapping, anonymous or (`shareable`) of a memory file others may
    /// map read-only ([`shared_view`](Self::shared_view)); not pre-faulted.
    fn new_unpopulated(capacity: u64, shareable: bool) -> Result<Arc<Self>> {
        let len = capacity.div_ceil(PAGE_SIZE) * PAGE_SIZE;
        let len_usize = usize::try_from(len)
            .map_err(|_| Error::invalid(format!("memory capacity {capacity} is too large")))?;
        let (mut mapping, file) = if shareable {
            let (mapping, file) = Self::shareable_mapping(len)?;
            (mapping, Some(file))
        } else {
            let mapping = memmap2::MmapMut::map_anon(len_usize)
                .map_err(|e| Error::io(format!("mapping a memory pool of {len} bytes"), e))?;
            (mapping, None)
        };
        let base = mapping.as_mut_ptr();
        Ok(Arc::new(PoolCore {
            base,
            len: len_usize,
            mapping,
            file,
            allocator: Mutex::new(ExtentAllocator::new(len / PAGE_SIZE)),
            live_entries: AtomicU64::new(0),
            live_bytes: AtomicU64::new(0),
        }))
    }

    /// A writable mapping of a new memory file of `len` bytes (a page
    /// multiple that fits a `usize`), and the file.
    ///
    /// The file is sealed once this process holds its only writable
    /// mapping: `F_SEAL_FUTURE_WRITE` refuses every later writable shared
    /// mapping, `write()` and hole punching, whoever holds a descriptor;
    /// `F_SEAL_SHRINK | F_SEAL_GROW` keep its size (a shrink would make
    /// this process's own accesses fault). So a client given the
    /// descriptor can read the pool and change nothing in it. The price:
    /// shared memory gets no transparent huge pages unless the system's
    /// `shmem_enabled` allows them (a copy out of 4 KiB pages measured as
    /// fast as out of huge pages here; see docs/server.md).
    fn shareable_mapping(len: u64) -> Result<(memmap2::MmapMut, std::os::fd::OwnedFd)> {
        use rustix::fs::{MemfdFlags, SealFlags};
        let file = rustix::fs::memfd_create(
            c"kvtier-pool",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )
        .map_err(|e| Error::io("creating the memory pool's memory file", e.into()))?;
        rustix::fs::ftruncate(&file, len).map_err(|e| {
            Error::io(
                format!("sizing the memory pool's file to {len} bytes"),
                e.into(),
            )
        })?;
        // SAFETY: the file is sealed against resizing right below, before
        // any slot exists; nothing but this mapping writes it.
        let mapping = unsafe { memmap2::MmapOptions::new().len(len as usize).map_mut(&file) }
            .map_err(|e| Error::io(format!("mapping a memory pool of {len} bytes"), e))?;
        rustix::fs::fcntl_add_seals(
            &file,
            SealFlags::FUTURE_WRITE | SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL,
        )
        .map_err(|e| {
            Error::io(
                "sealing the memory pool's file (Linux 5.1 or later)",
                e.into(),
            )
        })?;
        Ok((mapping, file))
    }

    /// The pool's memory file, sealed so that whoever maps it can only read
    /// it (see [`shareable_mapping`](Self::shareable_mapping)); `None` for a pool
    /// that is not shareable.
    pub fn shared_view(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        self.file.as_ref().map(|f| f.as_fd())
    }

    /// Leaves the pool out of child processes. Pinned pages (io_uring fixed
    /// buffers) would otherwise be copied whole into every `fork()` child,
    /// as the kernel must for pages that may be under DMA: a multi-GiB copy
    /// per fork. A child has no use for the pool: the store's threads do not
    /// survive a fork.
    pub fn exclude_from_fork(&self) {
        if let Err(error) = self.mapping.advise(memmap2::Advice::DontFork) {
            tracing::warn!(%error, "madvise(MADV_DONTFORK) on the memory pool failed");
        }
    }

    pub fn capacity(&self) -> u64 {
        self.len as u64
    }

    pub fn capacity_pages(&self) -> u64 {
        self.len as u64 / PAGE_SIZE
    }

    pub fn live_entries(&self) -> u64 {
        self.live_entries.load(Ordering::Relaxed)
    }

    pub fn live_bytes(&self) -> u64 {
        self.live_bytes.load(Ordering::Relaxed)
    }

    pub fn free_bytes(&self) -> u64 {
        self.allocator.lock().unwrap().free_pages() * PAGE_SIZE
    }

    /// Takes an extent for a value of `len` bytes of the namespace whose
    /// qualified-key prefix is `namespace`, or `None` if no free run is long
    /// enough right now.
    pub fn try_allocate(
        self: &Arc<Self>,
        len: usize,
        digest: KeyDigest,
        namespace: Arc<[u8]>,
    ) -> Option<PoolSlot> {
        let pages = (len as u64).div_ceil(PAGE_SIZE).max(1);
        // The counters change under the allocator's lock, as in `drop`: a
        // slot is counted only while it owns its pages, so `live_bytes`
        // never reads above the capacity (a slot freed on the flusher's
        // thread and its pages taken here before it was uncounted did).
        let page = {
            let mut allocator = self.allocator.lock().unwrap();
            let page = allocator.allocate(pages)?;
            self.live_entries.fetch_add(1, Ordering::Relaxed);
            self.live_bytes.fetch_add(len as u64, Ordering::Relaxed);
            page
        };
        Some(PoolSlot {
            core: Arc::clone(self),
            page,
            pages,
            len,
            digest,
            namespace,
            hits: AtomicU8::new(0),
            evictable: AtomicBool::new(false),
        })
    }
}

impl PoolCore {
    /// Backs the whole pool with memory now, in huge pages where the kernel
    /// has them, so the data path takes no page faults and fewer TLB misses.
    /// Run before any slot is handed out (`new`, or the thread of
    /// `new_prefaulting`, joined before use).
    fn prefault(&self) {
        // Miri runs the pool's pure tests and has no madvise; a fresh
        // anonymous mapping reads as zeros either way.
        if cfg!(miri) {
            return;
        }
        // Failure only means no huge pages.
        let _ = self.mapping.advise(memmap2::Advice::HugePage);
        // MADV_POPULATE_WRITE (Linux 5.14): faults pages in as a write
        // would, never changing what a page holds.
        if self.mapping.advise(memmap2::Advice::PopulateWrite).is_ok() {
            return;
        }
        // Older kernels: touch one byte per page.
        for offset in (0..self.len).step_by(PAGE_SIZE as usize) {
            // SAFETY: in bounds of the mapping; no slot exists yet, so
            // nothing else reads or writes these bytes.
            unsafe { std::ptr::write_volatile(self.base.add(offset), 0) };
        }
    }
}

impl crate::io::LongLivedMemory for PoolCore {
    fn memory_range(&self) -> (*const u8, usize) {
        (self.base.cast_const(), self.len)
    }
}

/// One value's extent in the pool.
#[derive(Debug)]
pub struct PoolSlot {
    core: Arc<PoolCore>,
    page: u64,
    pages: u64,
    len: usize,
    digest: KeyDigest,
    /// The namespace's length byte and name (shared with its handle): the
    /// only record of a memory-only value's namespace, which no batch
    /// record names (the namespace census and retirement read it).
    namespace: Arc<[u8]>,
    /// Hits since the eviction policy last looked (capped at 3).
    hits: AtomicU8,
    /// Set once the value is durable on disk, or from the start for
    /// memory-only entries: only such slots may be evicted.
    evictable: AtomicBool,
}

impl PoolSlot {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn digest(&self) -> KeyDigest {
        self.digest
    }

    /// The value's namespace as a qualified-key prefix (length byte, name).
    pub fn namespace_prefix(&self) -> &[u8] {
        &self.namespace
    }

    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// The value bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the extent lies inside the mapping, belongs to this slot
        // alone, and is only written through `bytes_mut`, which needs
        // exclusive access before the slot is shared.
        unsafe { std::slice::from_raw_parts(self.ptr(), self.len) }
    }

    /// The whole extent, value plus padding to the page boundary: what the
    /// flusher hands to an O_DIRECT write.
    pub fn padded_bytes(&self) -> &[u8] {
        // SAFETY: as in `bytes`; the extent is `pages` pages long.
        unsafe { std::slice::from_raw_parts(self.ptr(), (self.pages * PAGE_SIZE) as usize) }
    }

    /// Mutable access while the slot is still uniquely owned.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: `&mut self` proves no other reference to this extent.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(), self.len) }
    }

    /// Zeroes the bytes between the value's end and the extent's end,
    /// while the slot is still uniquely owned.
    pub fn zero_padding(&mut self) {
        let padded = (self.pages * PAGE_SIZE) as usize;
        // SAFETY: `&mut self` proves no other reference to this extent,
        // which is `pages` pages long.
        let extent = unsafe { std::slice::from_raw_parts_mut(self.ptr(), padded) };
        extent[self.len..].fill(0);
    }

    /// Where the value starts in the pool (its byte offset in the pool's
    /// memory file, for a shareable pool).
    pub fn pool_offset(&self) -> u64 {
        self.page * PAGE_SIZE
    }

    fn ptr(&self) -> *mut u8 {
        debug_assert!(((self.page + self.pages) * PAGE_SIZE) as usize <= self.core.len);
        // SAFETY: in bounds of the mapping, as asserted.
        unsafe { self.core.base.add((self.page * PAGE_SIZE) as usize) }
    }

    pub fn record_hit(&self) {
        let hits = self.hits.load(Ordering::Relaxed);
        if hits < 3 {
            self.hits.store(hits + 1, Ordering::Relaxed);
        }
    }

    pub fn set_evictable(&self) {
        self.evictable.store(true, Ordering::Release);
    }

    pub fn is_evictable(&self) -> bool {
        self.evictable.load(Ordering::Acquire)
    }

    fn hits(&self) -> u8 {
        self.hits.load(Ordering::Relaxed)
    }

    fn set_hits(&self, hits: u8) {
        self.hits.store(hits, Ordering::Relaxed);
    }
}

impl Drop for PoolSlot {
    fn drop(&mut self) {
        // Uncounted before the pages are free (see `try_allocate`).
        let mut allocator = self.core.allocator.lock().unwrap();
        self.core.live_entries.fetch_sub(1, Ordering::Relaxed);
        self.core
            .live_bytes
            .fetch_sub(self.len as u64, Ordering::Relaxed);
        allocator.free(self.page, self.pages);
    }
}

#[cfg(test)]
mod fork_tests {
    use super::*;

    #[test]
    fn an_excluded_pool_is_marked_do_not_copy() {
        let pool = PoolCore::new(8 << 20).unwrap();
        pool.exclude_from_fork();
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let start = format!("{:x}-", pool.base as usize);
        let flags = smaps
            .split_once(&start)
            .and_then(|(_, rest)| rest.lines().find(|l| l.starts_with("VmFlags:")))
            .expect("the pool's mapping and its flags");
        // "dc": do not copy this area on fork.
        assert!(flags.split_whitespace().any(|f| f == "dc"), "{flags}");
    }
}

#[cfg(test)]
mod accounting_tests {
    use super::*;

    /// Slots freed on one thread while another takes their pages: the live
    /// counters never read above the capacity. (They did when a slot was
    /// uncounted only after its pages were free: CI caught it in the model
    /// test, whose flusher drops slots while the caller puts.)
    #[test]
    fn live_bytes_never_read_above_the_capacity() {
        let pool = PoolCore::new(16 * PAGE_SIZE).unwrap();
        let done = Arc::new(AtomicBool::new(false));
        let churn = |pool: Arc<PoolCore>, done: Arc<AtomicBool>| {
            std::thread::spawn(move || {
                // Half the pool each: three workers keep it full.
                let len = (PAGE_SIZE as usize) * 8;
                for round in 0..50_000u32 {
                    let slot =
                        pool.try_allocate(len, KeyDigest(u128::from(round)), Arc::from(&[0u8][..]));
                    drop(slot);
                }
                done.store(true, Ordering::Release);
            })
        };
        let workers = [
            churn(Arc::clone(&pool), Arc::new(AtomicBool::new(false))),
            churn(Arc::clone(&pool), Arc::new(AtomicBool::new(false))),
            churn(Arc::clone(&pool), Arc::clone(&done)),
        ];
        let mut reads = 0u64;
        while !done.load(Ordering::Acquire) {
            let live = pool.live_bytes();
            assert!(
                live <= pool.capacity(),
                "{live} bytes live in {}",
                pool.capacity()
            );
            reads += 1;
        }
        for worker in workers {
            worker.join().unwrap();
        }
        assert!(reads > 0);
        assert_eq!(pool.live_bytes(), 0);
        assert_eq!(pool.live_entries(), 0);
    }
}
