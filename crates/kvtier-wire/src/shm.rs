//! Same-host shared memory: a memfd the client creates and maps, passed to
//! the server with SCM_RIGHTS over the Unix socket and mapped there too, so
//! batch puts and gets name (offset, length) ranges instead of sending
//! bytes, the way 3FS's USRBIO registers an iov.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

/// A shared mapping of a memfd, page-aligned, unmapped on drop.
#[derive(Debug)]
pub struct SharedRegion {
    ptr: *mut u8,
    len: usize,
    fd: OwnedFd,
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
        let name = c"kvtier-shm";
        // SAFETY: a valid NUL-terminated name; the result is checked.
        let raw = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: ftruncate on our own descriptor.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: fcntl on our own descriptor.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // The client's own buffer is pre-faulted: it is about to be filled.
        Self::map_fd(fd, len, true)
    }

    /// Maps a descriptor a client sent (server side), after checking that
    /// it is a memfd sealed against shrinking and growing and at least
    /// `len` bytes long: then no later act of the client can make an access
    /// inside the mapping fault (SIGBUS), which would kill the server.
    pub fn map_client_buffer(fd: OwnedFd, len: usize) -> io::Result<SharedRegion> {
        let refuse = |why: String| io::Error::new(io::ErrorKind::InvalidInput, why);
        // SAFETY: F_GET_SEALS on a descriptor we own; only memfds (and
        // shmem files) answer it, anything else fails with EINVAL.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 {
            return Err(refuse(format!(
                "the descriptor is not a sealable memfd ({}): create the buffer with \
                 memfd_create(MFD_ALLOW_SEALING) and seal it with F_SEAL_SHRINK | F_SEAL_GROW",
                io::Error::last_os_error()
            )));
        }
        let needed = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
        if seals & needed != needed {
            return Err(refuse(format!(
                "the memfd is not sealed against resizing (seals {seals:#x}): add \
                 F_SEAL_SHRINK | F_SEAL_GROW before registering it"
            )));
        }
        // SAFETY: fstat into a zeroed struct on our own descriptor.
        let mut stat: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut stat) } != 0 {
            return Err(io::Error::last_os_error());
        }
        if stat.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(refuse("the descriptor is not a memory file".into()));
        }
        if (stat.st_size as u64) < len as u64 {
            return Err(refuse(format!(
                "shared buffer is {} bytes, not the {len} announced",
                stat.st_size
            )));
        }
        // Not pre-faulted: the server touches pages only where values are
        // copied, and never populates what a client merely announced.
        Self::map_fd(fd, len, false)
    }

    /// Maps `len` bytes of `fd`, shared, asking for huge pages (taken where
    /// the system allows them for shared memory: `shmem_enabled` set to
    /// `advise` or `always`; with 4 KiB pages a copy into the buffer runs
    /// about a tenth slower than between huge-paged buffers), and with
    /// `populate` faults every page in.
    fn map_fd(fd: OwnedFd, len: usize, populate: bool) -> io::Result<SharedRegion> {
        // SAFETY: a shared mapping of a descriptor we own; checked below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: advice on the mapping just made; failure only means no
        // huge pages.
        unsafe { libc::madvise(ptr, len, libc::MADV_HUGEPAGE) };
        if populate {
            // MADV_POPULATE_WRITE (Linux 5.14) faults the pages in without
            // writing them; older kernels get the pages touched instead.
            const MADV_POPULATE_WRITE: libc::c_int = 23;
            // SAFETY: as above.
            if unsafe { libc::madvise(ptr, len, MADV_POPULATE_WRITE) } != 0 {
                for page in (0..len).step_by(4096) {
                    // SAFETY: inside the fresh mapping, which holds zeros.
                    unsafe { ptr.cast::<u8>().add(page).write_volatile(0) };
                }
            }
        }
        Ok(SharedRegion {
            ptr: ptr.cast(),
            len,
            fd,
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

    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// The bytes of `offset..offset + len`, if in range.
    pub fn range(&self, offset: u64, len: u64) -> Option<&[u8]> {
        let end = offset.checked_add(len)?;
        if end > self.len as u64 {
            return None;
        }
        // SAFETY: in bounds of the live mapping.
        Some(unsafe { std::slice::from_raw_parts(self.ptr.add(offset as usize), len as usize) })
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

impl Drop for SharedRegion {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping of this length.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

/// Sends `bytes` with one file descriptor attached.
pub fn send_with_fd(stream: &UnixStream, bytes: &[u8], fd: RawFd) -> io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut control = vec![0u8; space];
    // SAFETY: a zeroed msghdr filled in below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: the control buffer holds one cmsg of the right size.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), fd);
    }
    let mut sent = 0usize;
    while sent < bytes.len() {
        // SAFETY: msg points at live buffers.
        let n = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        sent += n as usize;
        // The descriptor went with the first byte; send the rest plainly.
        if sent < bytes.len() {
            use std::io::Write;
            let mut s = stream;
            s.write_all(&bytes[sent..])?;
            sent = bytes.len();
        }
    }
    Ok(())
}

/// Receives up to `buf.len()` bytes (at least one, or 0 at end of stream),
/// returning a descriptor if one was attached. Extra descriptors are closed.
pub fn recv_some_with_fd(
    stream: &UnixStream,
    buf: &mut [u8],
) -> io::Result<(usize, Option<OwnedFd>)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE((4 * std::mem::size_of::<RawFd>()) as u32) } as usize;
    let mut control = vec![0u8; space];
    // SAFETY: a zeroed msghdr filled in below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: msg points at live buffers.
    let n = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut received = None;
    // SAFETY: walking the control messages the kernel filled in; every
    // descriptor is taken into an OwnedFd so none leaks.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                let count = ((*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize)
                    / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    let fd = OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i)));
                    if received.is_none() {
                        received = Some(fd);
                    }
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    Ok((n as usize, received))
}
