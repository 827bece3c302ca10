//! Same-host shared memory: a memfd the client creates and maps, passed to
//! the server with SCM_RIGHTS over the Unix socket and mapped there too, so
//! batch puts and gets name (offset, length) ranges instead of sending
//! bytes, the way 3FS's USRBIO registers an iov.

use rustix::fs::{FileType, MemfdFlags, SealFlags};
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

/// A shared mapping of a memfd, page-aligned, unmapped on drop.
#[derive(Debug)]
pub struct SharedRegion {
    /// The mapping's first byte, taken once from `mapping`: ranges are cut
    /// through this pointer, so handing one range out never borrows the
    /// whole mapping.
    ptr: *mut u8,
    len: usize,
    /// Owns the mapping; dropped before `fd`.
    _mapping: memmap2::MmapMut,
    /// The memfd, kept on the side that passes it on (the client); the
    /// side that receives one (the server) closes it once mapped: the
    /// mapping keeps the memory, and a registered buffer costs no
    /// descriptor.
    fd: Option<OwnedFd>,
}

// SAFETY: the mapping is plain memory owned by this value; concurrent use
// is coordinated by the protocol (a range is touched by one side at a time).
unsafe impl Send for SharedRegion {}
// SAFETY: as above.
unsafe impl Sync for SharedRegion {}

impl SharedRegion {
    /// Creates a memfd of `len` bytes, seals its size (so the server can
    /// trust it cannot shrink under a copy), and maps it (client side).
    pub fn create(len: usize) -> io::Result<SharedRegion> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "shared buffer of 0 bytes",
            ));
        }
        let fd = rustix::fs::memfd_create(
            c"kvtier-shm",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )?;
        rustix::fs::ftruncate(&fd, len as u64)?;
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
        // Not pre-faulted: a page is allocated where a value first lands in
        // it (on either side). Faulting in all of it at once cost a
        // connect 0.2-2.4 s of CPU for the default 256 MiB, which a
        // short-lived client paid for pages it never used.
        let mut region = Self::map_fd(&fd, len)?;
        region.fd = Some(fd);
        Ok(region)
    }

    /// Maps a descriptor a client sent (server side), after checking that
    /// it is a memfd sealed against shrinking and growing and at least
    /// `len` bytes long: then no later act of the client can make an access
    /// inside the mapping fault (SIGBUS), which would kill the server.
    pub fn map_client_buffer(fd: OwnedFd, len: usize) -> io::Result<SharedRegion> {
        let refuse = |why: String| io::Error::new(io::ErrorKind::InvalidInput, why);
        // Only memfds (and shmem files) answer F_GET_SEALS; anything else
        // fails with EINVAL.
        let seals = rustix::fs::fcntl_get_seals(&fd).map_err(|e| {
            refuse(format!(
                "the descriptor is not a sealable memfd ({e}): create the buffer with \
                 memfd_create(MFD_ALLOW_SEALING) and seal it with F_SEAL_SHRINK | F_SEAL_GROW"
            ))
        })?;
        if !seals.contains(SealFlags::SHRINK | SealFlags::GROW) {
            return Err(refuse(format!(
                "the memfd is not sealed against resizing (seals {:#x}): add \
                 F_SEAL_SHRINK | F_SEAL_GROW before registering it",
                seals.bits()
            )));
        }
        let stat = rustix::fs::fstat(&fd)?;
        if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile {
            return Err(refuse("the descriptor is not a memory file".into()));
        }
        if (stat.st_size as u64) < len as u64 {
            return Err(refuse(format!(
                "shared buffer is {} bytes, not the {len} announced",
                stat.st_size
            )));
        }
        // Not pre-faulted: the server touches pages only where values are
        // copied, and never populates what a client merely announced. The
        // descriptor closes here (dropped with `fd`).
        Self::map_fd(&fd, len)
    }

    /// Maps `len` bytes of `fd`, shared, asking for huge pages (taken where
    /// the system allows them for shared memory: `shmem_enabled` set to
    /// `advise` or `always`; with 4 KiB pages a copy into the buffer runs
    /// about a tenth slower than between huge-paged buffers). No page is
    /// faulted in here.
    fn map_fd(fd: &OwnedFd, len: usize) -> io::Result<SharedRegion> {
        // SAFETY: memmap2 asks that the file not change size under the
        // mapping: both sides' memfds are sealed against shrinking (checked
        // in `map_client_buffer`, set in `create`), so no access inside
        // `len` can fault. Its contents change under us by design (the
        // other side writes its ranges); the protocol orders those writes.
        let mut mapping = unsafe { memmap2::MmapOptions::new().len(len).map_mut(fd)? };
        // Failure only means no huge pages.
        let _ = mapping.advise(memmap2::Advice::HugePage);
        let ptr = mapping.as_mut_ptr();
        Ok(SharedRegion {
            ptr,
            len,
            _mapping: mapping,
            fd: None,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Address of the first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// The memfd, on the side that created the region (`None` on the
    /// side that mapped a received one).
    pub fn fd(&self) -> Option<RawFd> {
        self.fd.as_ref().map(AsRawFd::as_raw_fd)
    }

    /// The `(offset, len)` ranges as foreign segments (see
    /// `kvtier::ForeignSegments`): memory the peer may write at any time,
    /// reached only through raw copies. `None` if a range leaves the
    /// buffer.
    pub fn foreign_segments(&self, ranges: &[(u64, u64)]) -> Option<kvtier::ForeignSegments> {
        let mut segments = Vec::with_capacity(ranges.len());
        for &(offset, len) in ranges {
            let end = offset.checked_add(len)?;
            if end > self.len as u64 {
                return None;
            }
            // SAFETY: inside the mapping (checked above).
            segments.push((unsafe { self.ptr.add(offset as usize) }, len as usize));
        }
        // SAFETY: the ranges lie inside this mapping, which lives as long
        // as `self` (the caller keeps the region for the request). Overlap
        // is the caller's to rule out for destinations.
        Some(unsafe { kvtier::ForeignSegments::new(segments) })
    }

    /// [`foreign_segments`](Self::foreign_segments) of ranges as a frame
    /// holds them, without a copy of them: they are read from `list`'s
    /// bytes, which must outlive the segments (the request's frame does).
    pub fn foreign_segments_in(
        &self,
        list: &crate::protocol::SegmentList<'_>,
    ) -> Option<kvtier::ForeignSegments> {
        // SAFETY: checked inside this mapping, which lives as long as
        // `self` (the caller keeps the region for the request); `list`'s
        // bytes are the request frame's, kept for the request too.
        // Overlap is the caller's to rule out for destinations.
        unsafe { kvtier::ForeignSegments::packed(self.ptr, self.len, list.as_bytes()) }
    }

    /// Mutable bytes of `offset..offset + len`, if in range.
    ///
    /// # Safety
    /// The caller must not hold another reference overlapping this range.
    #[expect(
        clippy::mut_from_ref,
        reason = "shared memory; exclusivity is the caller's contract"
    )]
    pub unsafe fn range_mut(&self, offset: u64, len: u64) -> Option<&mut [u8]> {
        let end = offset.checked_add(len)?;
        if end > self.len as u64 {
            return None;
        }
        // SAFETY: in bounds; exclusivity is the caller's obligation.
        Some(unsafe { std::slice::from_raw_parts_mut(self.ptr.add(offset as usize), len as usize) })
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the whole live mapping, exclusively borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the whole live mapping.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// Sends `bytes` with one file descriptor attached.
pub fn send_with_fd(stream: &UnixStream, bytes: &[u8], fd: RawFd) -> io::Result<()> {
    // SAFETY: the caller passes a descriptor that stays open for this call
    // (its own shared region's).
    let fd = unsafe { BorrowedFd::borrow_raw(fd) };
    let fds = [fd];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(io::Error::other(
            "no room for a descriptor in the control buffer",
        ));
    }
    let sent = loop {
        match rustix::net::sendmsg(
            stream,
            &[IoSlice::new(bytes)],
            &mut control,
            SendFlags::NOSIGNAL,
        ) {
            Err(rustix::io::Errno::INTR) => continue,
            result => break result?,
        }
    };
    // The descriptor went with the first byte; send the rest plainly.
    if sent < bytes.len() {
        use std::io::Write;
        let mut s = stream;
        s.write_all(&bytes[sent..])?;
    }
    Ok(())
}

/// Receives up to `buf.len()` bytes (at least one, or 0 at end of stream),
/// returning a descriptor if one was attached. Extra descriptors are closed.
pub fn recv_some_with_fd(
    stream: &UnixStream,
    buf: &mut [u8],
) -> io::Result<(usize, Option<OwnedFd>)> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let received = rustix::net::recvmsg(
        stream.as_fd(),
        &mut [IoSliceMut::new(buf)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    // Every received descriptor becomes an OwnedFd (the drain hands them
    // out owned), so the extras close as they drop and none leaks.
    let mut first = None;
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = message {
            for fd in fds {
                if first.is_none() {
                    first = Some(fd);
                }
            }
        }
    }
    Ok((received.bytes, first))
}

/// A read-only mapping of a server's memory pool (MapPool, same host),
/// from which a client copies the values it leased.
#[derive(Debug)]
pub struct PoolView {
    /// The mapping's first byte (taken once from `_mapping`).
    ptr: *const u8,
    len: usize,
    _mapping: memmap2::Mmap,
    /// The memory file's device and inode: one mapping serves every
    /// connection to the same pool.
    identity: (u64, u64),
}

// SAFETY: a read-only mapping; its bytes are read through raw pointers
// only, ranges the server leased (unchanged while leased).
unsafe impl Send for PoolView {}
// SAFETY: as above.
unsafe impl Sync for PoolView {}

impl PoolView {
    /// The device and inode of the memory file behind `fd` (so a caller
    /// can reuse a mapping it already has).
    pub fn identity_of(fd: &OwnedFd) -> io::Result<(u64, u64)> {
        let stat = rustix::fs::fstat(fd)?;
        Ok((stat.st_dev, stat.st_ino))
    }

    /// Maps `len` bytes of the pool file a server passed, read-only, once
    /// the file is shown to be a memory file of at least `len` bytes that
    /// cannot shrink (a shrink would make a copy out of the mapping fault).
    pub fn map(fd: &OwnedFd, len: u64) -> io::Result<PoolView> {
        let refuse = |why: String| io::Error::new(io::ErrorKind::InvalidData, why);
        let seals = rustix::fs::fcntl_get_seals(fd)
            .map_err(|e| refuse(format!("the pool descriptor is not a memory file: {e}")))?;
        if !seals.contains(SealFlags::SHRINK) {
            return Err(refuse(
                "the pool's memory file is not sealed against shrinking".into(),
            ));
        }
        let stat = rustix::fs::fstat(fd)?;
        if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile
            || (stat.st_size as u64) < len
        {
            return Err(refuse(format!(
                "the pool's memory file holds {} bytes, not the {len} the server named",
                stat.st_size
            )));
        }
        let len = usize::try_from(len).map_err(|_| refuse(format!("a pool of {len} bytes")))?;
        if len == 0 {
            return Err(refuse("a pool of 0 bytes".into()));
        }
        // SAFETY: the file cannot shrink (sealed, checked above), so no
        // read inside `len` faults; its bytes change only in extents no
        // lease holds, and this view reads leased extents only.
        let mapping = unsafe { memmap2::MmapOptions::new().len(len).map(fd)? };
        Ok(PoolView {
            ptr: mapping.as_ptr(),
            len,
            _mapping: mapping,
            identity: (stat.st_dev, stat.st_ino),
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn identity(&self) -> (u64, u64) {
        self.identity
    }

    /// Maps every page of the view now (MADV_POPULATE_READ, Linux 5.14),
    /// a piece at a time: a copy out of a page this process never touched
    /// takes a page fault per 64 KiB, which cost a fresh pool's first
    /// copies a third of their speed. Run on a thread of its own; on older
    /// kernels the pages fault in as copies touch them.
    pub fn populate(&self) {
        const PIECE: usize = 64 << 20;
        let mut at = 0;
        while at < self.len {
            let n = PIECE.min(self.len - at);
            if self
                ._mapping
                .advise_range(memmap2::Advice::PopulateRead, at, n)
                .is_err()
            {
                return;
            }
            at += n;
        }
    }

    /// Copies the `len` bytes at `offset` into `segments`, in order.
    /// Refuses a range outside the mapping, or longer than the segments.
    pub fn copy_out(
        &self,
        offset: u64,
        len: u64,
        segments: &mut [&mut [u8]],
        streamed: bool,
    ) -> io::Result<()> {
        let refuse = |why: String| io::Error::new(io::ErrorKind::InvalidData, why);
        let end = offset
            .checked_add(len)
            .filter(|&end| end <= self.len as u64)
            .ok_or_else(|| {
                refuse(format!(
                    "a lease of {len} bytes at {offset}, past the pool's {} bytes",
                    self.len
                ))
            })?;
        let room: u64 = segments.iter().map(|s| s.len() as u64).sum();
        if len > room {
            return Err(refuse(format!(
                "a lease of {len} bytes for {room} bytes of buffers"
            )));
        }
        let (mut at, end) = (offset as usize, end as usize);
        for segment in segments {
            if at == end {
                break;
            }
            let n = segment.len().min(end - at);
            // SAFETY: `at..at + n` lies inside the mapping (checked above);
            // `segment` is the caller's own memory, never the mapping
            // (which is read-only: a write into it would have faulted).
            // A leased extent is not written while the lease holds it.
            // `streamed`: non-temporal stores, for a batch too large to
            // stay in the cache for its reader (`kvtier::bulk_copy`).
            unsafe {
                if streamed {
                    kvtier::bulk_copy::copy_raw_for_elsewhere(
                        segment.as_mut_ptr(),
                        self.ptr.add(at),
                        n,
                    )
                } else {
                    std::ptr::copy_nonoverlapping(self.ptr.add(at), segment.as_mut_ptr(), n)
                }
            };
            at += n;
        }
        Ok(())
    }
}
