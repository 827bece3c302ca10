//! The io-engine seam: owned aligned buffers, batched reads, vectored
//! writes. The disk tier speaks only this trait, so an io_uring engine can
//! replace `psync` without touching the tier.

#[cfg(any(test, feature = "test-util"))]
pub mod faulty;
pub(crate) mod progress;
pub mod uring;

use crate::units::PAGE_SIZE;
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::fmt;
use std::fs::File;
use std::io::{self, IoSlice};
use std::sync::Arc;

/// A heap buffer aligned to 4 KiB, as O_DIRECT requires.
pub struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
    layout: Layout,
}

// SAFETY: the buffer is uniquely owned heap memory.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access is read-only through `&self`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes rounded up to a page.
    pub fn zeroed(len: usize) -> Self {
        let len = len.div_ceil(PAGE_SIZE as usize).max(1) * PAGE_SIZE as usize;
        let layout = Layout::from_size_align(len, PAGE_SIZE as usize).expect("valid layout");
        // SAFETY: `layout` has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        AlignedBuf { ptr, len, layout }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len` initialised bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout.
        unsafe { dealloc(self.ptr, self.layout) }
    }
}

impl fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .finish()
    }
}

/// Whether a buffer may be handed to an O_DIRECT transfer as it is.
pub fn is_direct_io_aligned(buf: &[u8]) -> bool {
    (buf.as_ptr() as usize).is_multiple_of(PAGE_SIZE as usize)
        && buf.len().is_multiple_of(PAGE_SIZE as usize)
}

/// One read of a batch: fill all of `buf` from `file` at `offset`.
#[derive(Debug)]
pub struct ReadOp<'a> {
    pub file: &'a File,
    pub offset: u64,
    pub buf: &'a mut [u8],
    /// Set by the engine: `Ok` only when every byte of `buf` was read.
    pub result: io::Result<()>,
}

impl<'a> ReadOp<'a> {
    pub fn new(file: &'a File, offset: u64, buf: &'a mut [u8]) -> Self {
        ReadOp {
            file,
            offset,
            buf,
            result: Ok(()),
        }
    }
}

/// How the disk tier moves bytes. Implementations complete every operation
/// in full or report an error: short transfers are retried internally.
pub trait IoEngine: Send + Sync + fmt::Debug {
    fn name(&self) -> &'static str;

    /// Runs every read of the batch and returns when all have completed;
    /// the engine may run them concurrently and in any order. Calls
    /// `on_read(i, bytes)` for each read that completes in full, as soon as
    /// it does (possibly on another thread), so the caller can verify one
    /// value while others are still in flight.
    ///
    /// `bytes` is read `i`'s buffer, handed over with the engine's own
    /// access to it: the engine promises that it stays valid and that
    /// nothing writes it until this call returns, so `on_read` may keep
    /// the pointer and read the bytes again later in the same call (the
    /// disk tier hashes pieces in order that complete out of order).
    fn read_batch_then(&self, reads: &mut [ReadOp<'_>], on_read: &(dyn Fn(usize, &[u8]) + Sync));

    /// Writes `bufs` back to back starting at `offset`.
    fn write_vectored_at(&self, file: &File, offset: u64, bufs: &[IoSlice<'_>]) -> io::Result<()>;

    /// Makes every completed write to `file` durable (`fdatasync`).
    fn sync_data(&self, file: &File) -> io::Result<()>;

    /// Offers memory that many transfers will use (the memory pool) for
    /// pinning once instead of per transfer (io_uring fixed buffers). The
    /// engine keeps `memory` alive for as long as it uses it. Returns
    /// whether transfers within it now use the registration. Default: no.
    fn register_memory(&self, memory: Arc<dyn LongLivedMemory>) -> bool {
        let _ = memory;
        false
    }

    /// Tells the engine that `file` will take many transfers until
    /// `unregister_file` (io_uring registered files). Call
    /// `unregister_file` before closing it. Default: nothing.
    fn register_file(&self, file: &File) {
        let _ = file;
    }

    /// Ends what `register_file` started; the file may be closed after.
    fn unregister_file(&self, file: &File) {
        let _ = file;
    }

    /// Keeps `file` open for as long as transfers this engine started may
    /// still run, until `release_hold`. io_uring finishes a killed
    /// process's writes after the process is gone (the ring is torn down
    /// asynchronously): the store holds its directory lock here, so that a
    /// new opener cannot recover the directory while the last one's writes
    /// still land in it. Returns whether the engine holds it. Default: no
    /// (its transfers end with the threads that run them).
    fn hold_until_idle(&self, file: &File) -> bool {
        let _ = file;
        false
    }

    /// Ends `hold_until_idle` (nothing is in flight any more).
    fn release_hold(&self, file: &File) {
        let _ = file;
    }

    /// Whether `register_memory` took effect.
    fn uses_fixed_buffers(&self) -> bool {
        false
    }

    /// Whether `register_file` takes effect.
    fn uses_registered_files(&self) -> bool {
        false
    }
}

/// Memory that stays mapped at one address for as long as this value
/// lives, so an engine holding it may pin it.
pub trait LongLivedMemory: Send + Sync + fmt::Debug {
    /// Start and length of the memory.
    fn memory_range(&self) -> (*const u8, usize);
}

/// `pread`/`pwritev` engine; a batch of reads is spread over up to
/// `threads` scoped threads.
#[derive(Debug)]
pub struct PsyncEngine {
    threads: usize,
}

impl PsyncEngine {
    pub fn new(threads: usize) -> Self {
        PsyncEngine {
            threads: threads.max(1),
        }
    }
}

/// Makes a directory's entries (a created, renamed or removed file)
/// durable: the one place every file mechanic of the store does it.
pub(crate) fn sync_dir(dir: &std::path::Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

pub(crate) fn pread_full(file: &File, mut offset: u64, mut buf: &mut [u8]) -> io::Result<()> {
    while !buf.is_empty() {
        let n = match std::os::unix::fs::FileExt::read_at(file, buf, offset) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("read past the end of the file at offset {offset}"),
            ));
        }
        offset += n as u64;
        buf = &mut buf[n..];
        // A follow step reading another writer's files is alive.
        progress::note();
    }
    Ok(())
}

impl IoEngine for PsyncEngine {
    fn name(&self) -> &'static str {
        "psync"
    }

    fn read_batch_then(&self, reads: &mut [ReadOp<'_>], on_read: &(dyn Fn(usize, &[u8]) + Sync)) {
        let read_one = |i: usize, op: &mut ReadOp<'_>| {
            op.result = pread_full(op.file, op.offset, op.buf);
            if op.result.is_ok() {
                on_read(i, op.buf);
            }
        };
        let workers = self.threads.min(reads.len());
        if workers <= 1 {
            for (i, op) in reads.iter_mut().enumerate() {
                read_one(i, op);
            }
            return;
        }
        let per_worker = reads.len().div_ceil(workers);
        std::thread::scope(|scope| {
            for (c, chunk) in reads.chunks_mut(per_worker).enumerate() {
                let read_one = &read_one;
                scope.spawn(move || {
                    for (j, op) in chunk.iter_mut().enumerate() {
                        read_one(c * per_worker + j, op);
                    }
                });
            }
        });
    }

    fn write_vectored_at(&self, file: &File, offset: u64, bufs: &[IoSlice<'_>]) -> io::Result<()> {
        let mut offset = offset;
        // Skip-and-trim state for resuming after a short write.
        let mut index = 0;
        let mut skip = 0usize;
        while index < bufs.len() {
            let iov: Vec<IoSlice<'_>> = bufs[index..]
                .iter()
                .take(1024)
                .enumerate()
                .map(|(i, buf)| IoSlice::new(&buf[if i == 0 { skip } else { 0 }..]))
                .collect();
            let n = match rustix::io::pwritev(file, &iov, offset) {
                Ok(n) => n,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            };
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "pwritev wrote nothing",
                ));
            }
            let mut written = n;
            offset += written as u64;
            while written > 0 && index < bufs.len() {
                let left = bufs[index].len() - skip;
                if written >= left {
                    written -= left;
                    index += 1;
                    skip = 0;
                } else {
                    skip += written;
                    written = 0;
                }
            }
        }
        Ok(())
    }

    fn sync_data(&self, file: &File) -> io::Result<()> {
        file.sync_data()
    }
}

/// Reusable aligned buffers for bounce reads, so the read path does not
/// pay for fresh (page-faulting) allocations on every unaligned get.
#[derive(Debug)]
pub struct BufferPool {
    free: std::sync::Mutex<Vec<AlignedBuf>>,
    max_cached_bytes: usize,
}

impl BufferPool {
    pub fn new(max_cached_bytes: usize) -> Self {
        BufferPool {
            free: std::sync::Mutex::new(Vec::new()),
            max_cached_bytes,
        }
    }

    /// A buffer of at least `len` bytes (contents unspecified).
    pub fn take(&self, len: usize) -> AlignedBuf {
        let mut free = self.free.lock().unwrap();
        let best = free
            .iter()
            .enumerate()
            .filter(|(_, b)| b.len() >= len)
            .min_by_key(|(_, b)| b.len())
            .map(|(i, _)| i);
        match best {
            Some(i) => free.swap_remove(i),
            None => {
                drop(free);
                AlignedBuf::zeroed(len)
            }
        }
    }

    pub fn give_back(&self, buf: AlignedBuf) {
        let mut free = self.free.lock().unwrap();
        let cached: usize = free.iter().map(AlignedBuf::len).sum();
        if cached + buf.len() <= self.max_cached_bytes {
            free.push(buf);
        }
    }
}
