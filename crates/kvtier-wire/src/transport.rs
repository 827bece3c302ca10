//! One connection's byte stream, TCP or Unix, with the frame reads both
//! sides use. Unix reads collect descriptors passed with SCM_RIGHTS.

use crate::protocol::{Header, ProtocolError, HEADER_LEN};
use crate::shm;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

pub type TlsServerStream = rustls::StreamOwned<rustls::ServerConnection, TcpStream>;
pub type TlsClientStream = rustls::StreamOwned<rustls::ClientConnection, TcpStream>;

#[derive(Debug)]
pub enum Transport {
    Tcp(TcpStream),
    Unix(UnixStream),
    TlsServer(Box<TlsServerStream>),
    TlsClient(Box<TlsClientStream>),
}

/// What a frame read produced.
#[derive(Debug)]
pub enum FrameRead {
    /// The body is the first `header.body_len` bytes of the caller's
    /// buffer.
    Frame { header: Header, fd: Option<OwnedFd> },
    /// The peer closed the connection cleanly between frames.
    Closed,
    /// No byte of a new frame arrived within one read timeout (only with
    /// `FrameLimits::return_when_idle`); call again to keep waiting.
    Idle,
    /// A frame whose body the caller's `grow` refused room for: the body
    /// was read and discarded (the connection is still in step), and the
    /// request is to be answered as refused.
    Refused { header: Header },
    /// The header of a frame the caller asked to read itself
    /// ([`Transport::read_frame_or_stream`]): its body follows on the
    /// connection, to be read through `body`.
    Streamed {
        header: Header,
        fd: Option<OwnedFd>,
        body: BodyStream,
    },
}

/// A frame body still on the connection: how much of it is left, and the
/// frame's deadline and stall limit, which hold while the caller reads it
/// piece by piece ([`Transport::read_body`]).
#[derive(Debug)]
pub struct BodyStream {
    remaining: u64,
    deadline: Option<Instant>,
    stall: Duration,
}

impl BodyStream {
    /// Body bytes not read yet.
    pub fn remaining(&self) -> u64 {
        self.remaining
    }
}

/// How long a frame may take and how large it may be.
#[derive(Debug, Clone, Copy)]
pub struct FrameLimits {
    /// Largest body accepted; a header announcing more is a protocol error.
    pub max_body: u64,
    /// Return `Idle` after a read timeout with no byte of a new frame,
    /// instead of waiting on.
    pub return_when_idle: bool,
    /// Once a frame's first byte arrived, it must be whole within
    /// `frame_time + body_len / min_rate` (a trickle of bytes cannot keep
    /// a frame open forever); `min_rate` 0 sets no such deadline.
    pub frame_time: Duration,
    pub min_rate: u64,
    /// A frame that makes no progress for this long is an error.
    pub stall: Duration,
    /// A deadline no frame may pass, whatever its size (the handshake's).
    pub deadline: Option<Instant>,
}

impl FrameLimits {
    /// A client's reads: no rate floor, only the stall timeout.
    pub fn client(max_body: u64, stall: Duration) -> Self {
        FrameLimits {
            max_body,
            return_when_idle: false,
            frame_time: stall,
            min_rate: 0,
            stall,
            deadline: None,
        }
    }
}

/// First allocation for a body, and the most a body grows by per read
/// beyond doubling: memory follows the bytes that arrived, not the length
/// a header announced.
const BODY_FIRST_CHUNK: usize = 64 << 10;

#[derive(Debug)]
pub enum ReadError {
    Io(io::Error),
    Protocol(ProtocolError),
}

impl From<io::Error> for ReadError {
    fn from(e: io::Error) -> Self {
        ReadError::Io(e)
    }
}

impl Transport {
    pub fn set_timeouts(&self, read: Option<Duration>, write: Option<Duration>) -> io::Result<()> {
        match self {
            Transport::Tcp(s) => {
                s.set_read_timeout(read)?;
                s.set_write_timeout(write)
            }
            Transport::Unix(s) => {
                s.set_read_timeout(read)?;
                s.set_write_timeout(write)
            }
            Transport::TlsServer(s) => {
                s.sock.set_read_timeout(read)?;
                s.sock.set_write_timeout(write)
            }
            Transport::TlsClient(s) => {
                s.sock.set_read_timeout(read)?;
                s.sock.set_write_timeout(write)
            }
        }
    }

    pub fn write_all(&mut self, bytes: &[u8]) -> io::Result<()> {
        match self {
            Transport::Tcp(s) => s.write_all(bytes),
            Transport::Unix(s) => s.write_all(bytes),
            Transport::TlsServer(s) => s.write_all(bytes),
            Transport::TlsClient(s) => s.write_all(bytes),
        }
    }

    /// Writes `parts` in order, as one stream of bytes: with vectored
    /// writes on plain sockets (no copy into one buffer), part by part
    /// through TLS (which copies into records anyway).
    pub fn write_all_parts(&mut self, parts: &[&[u8]]) -> io::Result<()> {
        fn vectored(stream: &mut impl Write, parts: &[&[u8]]) -> io::Result<()> {
            // At most IOV_MAX (1024) slices per call.
            for group in parts.chunks(1024) {
                let mut slices: Vec<io::IoSlice<'_>> =
                    group.iter().map(|p| io::IoSlice::new(p)).collect();
                let mut rest = &mut slices[..];
                while !rest.is_empty() {
                    match stream.write_vectored(rest) {
                        Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                        Ok(n) => io::IoSlice::advance_slices(&mut rest, n),
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(e),
                    }
                }
            }
            Ok(())
        }
        match self {
            Transport::Tcp(s) => vectored(s, parts),
            Transport::Unix(s) => vectored(s, parts),
            tls => parts.iter().try_for_each(|p| tls.write_all(p)),
        }
    }

    pub fn flush(&mut self) -> io::Result<()> {
        match self {
            Transport::Tcp(s) => s.flush(),
            Transport::Unix(s) => s.flush(),
            Transport::TlsServer(s) => s.flush(),
            Transport::TlsClient(s) => s.flush(),
        }
    }

    fn read_some(&mut self, buf: &mut [u8], fds: &mut Option<OwnedFd>) -> io::Result<usize> {
        match self {
            Transport::Tcp(s) => s.read(buf),
            Transport::TlsServer(s) => s.read(buf),
            Transport::TlsClient(s) => s.read(buf),
            Transport::Unix(s) => {
                let (n, fd) = shm::recv_some_with_fd(s, buf)?;
                if fd.is_some() && fds.is_none() {
                    *fds = fd;
                }
                Ok(n)
            }
        }
    }

    /// Reads one frame within `limits`. The body is the first
    /// `header.body_len` bytes of `body`, which grows as bytes arrive (never
    /// past the bytes received, rounded up to a doubling) and is kept by
    /// the caller for the next frame.
    pub fn read_frame(
        &mut self,
        body: &mut Vec<u8>,
        limits: &FrameLimits,
    ) -> Result<FrameRead, ReadError> {
        self.read_frame_or_stream(body, limits, |_| false, |_| true)
    }

    /// [`read_frame`](Self::read_frame), except that a frame whose header
    /// `stream` picks is returned as [`FrameRead::Streamed`] as soon as its
    /// header is in: the caller reads the body itself (a put's values
    /// straight into their destination). Before `body` grows to hold more
    /// bytes, `grow` is asked with the capacity it would have; when it
    /// refuses, the rest of the body is read into a small scratch buffer
    /// and dropped, and the frame comes back as [`FrameRead::Refused`] (a
    /// server's memory budget decides).
    pub fn read_frame_or_stream(
        &mut self,
        body: &mut Vec<u8>,
        limits: &FrameLimits,
        stream: impl FnOnce(&Header) -> bool,
        mut grow: impl FnMut(usize) -> bool,
    ) -> Result<FrameRead, ReadError> {
        let mut header = [0u8; HEADER_LEN];
        let mut fd = None;
        let mut got = 0usize;
        let mut deadline = limits.deadline;
        let mut last_progress = Instant::now();
        while got < HEADER_LEN {
            match self.read_some(&mut header[got..], &mut fd) {
                Ok(0) if got == 0 => return Ok(FrameRead::Closed),
                Ok(0) => return Err(eof("connection closed inside a frame header")),
                Ok(n) => {
                    if got == 0 {
                        let base = Instant::now() + limits.frame_time;
                        deadline = Some(deadline.map_or(base, |d| d.min(base)));
                    }
                    got += n;
                    last_progress = Instant::now();
                }
                Err(e) if is_timeout(&e) => {
                    if got == 0 && limits.return_when_idle {
                        return Ok(FrameRead::Idle);
                    }
                    check_time(
                        got > 0 || !limits.return_when_idle,
                        last_progress,
                        limits.stall,
                        deadline,
                    )?;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(ReadError::Io(e)),
            }
        }
        let header = Header::decode(&header, limits.max_body).map_err(ReadError::Protocol)?;
        let len = header.body_len as usize;
        if limits.min_rate > 0 {
            let allowance = Duration::from_secs_f64(len as f64 / limits.min_rate as f64);
            deadline = deadline.map(|d| d + allowance);
        }
        if stream(&header) {
            return Ok(FrameRead::Streamed {
                header,
                fd,
                body: BodyStream {
                    remaining: len as u64,
                    deadline,
                    stall: limits.stall,
                },
            });
        }
        // `body` keeps its initialised length between frames (no zeroing
        // per frame); it grows only as bytes arrive.
        let mut filled = 0usize;
        let mut scratch: Option<Box<[u8]>> = None;
        while filled < len {
            if scratch.is_none() && body.len() == filled {
                // Grow by what has arrived so far (at least a first chunk),
                // never straight to the announced length.
                let more = filled.max(BODY_FIRST_CHUNK).min(len - filled);
                let want = filled + more;
                if want > body.capacity() && !grow(want) {
                    scratch = Some(vec![0u8; BODY_FIRST_CHUNK].into_boxed_slice());
                } else {
                    if want > body.capacity() {
                        body.reserve_exact(want - body.len());
                    }
                    body.resize(want, 0);
                }
            }
            let target = match &mut scratch {
                Some(scratch) => {
                    let n = scratch.len().min(len - filled);
                    &mut scratch[..n]
                }
                None => {
                    let end = body.len().min(len);
                    &mut body[filled..end]
                }
            };
            match self.read_some(target, &mut fd) {
                Ok(0) => return Err(eof("connection closed inside a frame body")),
                Ok(n) => {
                    filled += n;
                    last_progress = Instant::now();
                }
                Err(e) if is_timeout(&e) => {
                    check_time(true, last_progress, limits.stall, deadline)?;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(ReadError::Io(e)),
            }
            if deadline.is_some_and(|d| Instant::now() > d) && filled < len {
                return Err(too_slow());
            }
        }
        if scratch.is_some() {
            return Ok(FrameRead::Refused { header });
        }
        Ok(FrameRead::Frame { header, fd })
    }
}

impl Transport {
    /// Reads the next `buf.len()` bytes of a streamed frame body, within
    /// the frame's deadline and stall limit. Asking for more than the body
    /// has left is a protocol error (the frame's counts do not fit it).
    pub fn read_body(&mut self, body: &mut BodyStream, buf: &mut [u8]) -> Result<(), ReadError> {
        if buf.len() as u64 > body.remaining {
            return Err(ReadError::Protocol(ProtocolError(
                "the frame's items run past its body".into(),
            )));
        }
        self.fill_within(buf, body.stall, body.deadline)?;
        body.remaining -= buf.len() as u64;
        Ok(())
    }

    /// Reads exactly `buf.len()` bytes of a frame, failing once no byte has
    /// arrived for `stall` (a client reading a reply straight into its
    /// destination buffers).
    pub fn read_exact_within(&mut self, buf: &mut [u8], stall: Duration) -> Result<(), ReadError> {
        self.fill_within(buf, stall, None)
    }

    /// Fills `buf` from the connection, failing once no byte has arrived
    /// for `stall` or past `deadline`.
    fn fill_within(
        &mut self,
        buf: &mut [u8],
        stall: Duration,
        deadline: Option<Instant>,
    ) -> Result<(), ReadError> {
        let mut fd = None;
        let mut filled = 0usize;
        let mut last_progress = Instant::now();
        while filled < buf.len() {
            match self.read_some(&mut buf[filled..], &mut fd) {
                Ok(0) => return Err(eof("connection closed inside a frame")),
                Ok(n) => {
                    filled += n;
                    last_progress = Instant::now();
                }
                Err(e) if is_timeout(&e) => check_time(true, last_progress, stall, deadline)?,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(ReadError::Io(e)),
            }
            if deadline.is_some_and(|d| Instant::now() > d) && filled < buf.len() {
                return Err(too_slow());
            }
        }
        Ok(())
    }
}

fn eof(what: &str) -> ReadError {
    ReadError::Io(io::Error::new(
        io::ErrorKind::UnexpectedEof,
        what.to_string(),
    ))
}

fn too_slow() -> ReadError {
    ReadError::Io(io::Error::new(
        io::ErrorKind::TimedOut,
        "frame arrived too slowly (past its deadline)",
    ))
}

/// After a read timeout inside a frame: an error once the frame stalled or
/// passed its deadline.
fn check_time(
    in_frame: bool,
    last_progress: Instant,
    stall: Duration,
    deadline: Option<Instant>,
) -> Result<(), ReadError> {
    if deadline.is_some_and(|d| Instant::now() > d) {
        return Err(too_slow());
    }
    if in_frame && last_progress.elapsed() > stall {
        return Err(ReadError::Io(io::Error::new(
            io::ErrorKind::TimedOut,
            "frame stalled",
        )));
    }
    Ok(())
}

pub fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}
