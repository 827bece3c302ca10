//! One connection's byte stream, TCP or Unix, with the frame reads both
//! sides use. Unix reads collect descriptors passed with SCM_RIGHTS.

use crate::protocol::{Header, ProtocolError, HEADER_LEN};
use crate::shm;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

#[derive(Debug)]
pub enum Transport {
    Tcp(TcpStream),
    Unix(UnixStream),
}

/// What a frame read produced.
#[derive(Debug)]
pub enum FrameRead {
    /// The body is the first `header.body_len` bytes of the caller's
    /// buffer.
    Frame { header: Header, fd: Option<OwnedFd> },
    /// The peer closed the connection cleanly between frames.
    Closed,
    /// Shutdown was requested while the connection was idle.
    Stopping,
}

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
        }
    }

    pub fn write_all(&mut self, bytes: &[u8]) -> io::Result<()> {
        match self {
            Transport::Tcp(s) => s.write_all(bytes),
            Transport::Unix(s) => s.write_all(bytes),
        }
    }

    pub fn flush(&mut self) -> io::Result<()> {
        match self {
            Transport::Tcp(s) => s.flush(),
            Transport::Unix(s) => s.flush(),
        }
    }

    fn read_some(&mut self, buf: &mut [u8], fds: &mut Option<OwnedFd>) -> io::Result<usize> {
        match self {
            Transport::Tcp(s) => s.read(buf),
            Transport::Unix(s) => {
                let (n, fd) = shm::recv_some_with_fd(s, buf)?;
                if fd.is_some() && fds.is_none() {
                    *fds = fd;
                }
                Ok(n)
            }
        }
    }

    /// Reads one frame. With `idle_stop`, returns `Stopping` if the flag is
    /// set while no byte of a new frame has arrived (reads must have a
    /// timeout for this to be noticed). A frame that stalls midway for
    /// longer than `stall` is an error.
    ///
    /// The body lands in `body`, which only ever grows, so a connection
    /// reuses one allocation (no page faults per frame).
    pub fn read_frame(
        &mut self,
        body: &mut Vec<u8>,
        max_frame: u64,
        idle_stop: Option<&AtomicBool>,
        stall: Duration,
    ) -> Result<FrameRead, ReadError> {
        let mut header = [0u8; HEADER_LEN];
        let mut fd = None;
        if !self.fill(&mut header, &mut fd, idle_stop, stall)? {
            return Ok(if idle_stop.is_some_and(|f| f.load(Ordering::Acquire)) {
                FrameRead::Stopping
            } else {
                FrameRead::Closed
            });
        }
        let header = Header::decode(&header, max_frame).map_err(ReadError::Protocol)?;
        let len = header.body_len as usize;
        if body.len() < len {
            body.resize(len, 0);
        }
        if !self.fill(&mut body[..len], &mut fd, None, stall)? && len > 0 {
            return Err(ReadError::Io(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "connection closed inside a frame body",
            )));
        }
        Ok(FrameRead::Frame { header, fd })
    }
}

impl Transport {
    /// Fills `buf`. Returns false if the stream ended (or, with
    /// `idle_stop`, the flag was set) before its first byte; a stall of
    /// more than `stall` after the first byte, or an end inside it, is an
    /// error.
    fn fill(
        &mut self,
        buf: &mut [u8],
        fd: &mut Option<OwnedFd>,
        idle_stop: Option<&AtomicBool>,
        stall: Duration,
    ) -> Result<bool, ReadError> {
        let mut got = 0usize;
        let mut last_progress = Instant::now();
        while got < buf.len() {
            match self.read_some(&mut buf[got..], fd) {
                Ok(0) if got == 0 => return Ok(false),
                Ok(0) => {
                    return Err(ReadError::Io(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "connection closed inside a frame",
                    )))
                }
                Ok(n) => {
                    got += n;
                    last_progress = Instant::now();
                }
                Err(e) if is_timeout(&e) => {
                    if got == 0 && idle_stop.is_some() {
                        if idle_stop.is_some_and(|f| f.load(Ordering::Acquire)) {
                            return Ok(false);
                        }
                        continue;
                    }
                    if last_progress.elapsed() > stall {
                        return Err(ReadError::Io(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "frame stalled",
                        )));
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(ReadError::Io(e)),
            }
        }
        Ok(true)
    }
}

pub fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}
