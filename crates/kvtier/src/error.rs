//! One error type for the core crate: a kind to match on, a message that
//! names the limit or the file involved, and the OS error where there is one.

use std::fmt;
use std::io;

/// What went wrong, coarse enough to match on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// A key or value outside the documented limits, mismatched batch
    /// lengths, or an invalid configuration.
    InvalidArgument,
    /// The caller's buffer is smaller than the stored value.
    BufferTooSmall,
    /// Neither the memory pool nor the disk tier can take the value, even
    /// after eviction, reclaim and the configured wait for the flusher.
    NoSpace,
    /// The data directory is locked by another process.
    Locked,
    /// An operation on a store that has been closed.
    Closed,
    /// An I/O error from the file system or device.
    Io,
    /// On-disk data failed validation where it cannot be treated as a miss
    /// (for example a region header during recovery).
    Corruption,
}

impl ErrorKind {
    /// A short stable name, used in logs and by bindings.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidArgument => "invalid argument",
            ErrorKind::BufferTooSmall => "buffer too small",
            ErrorKind::NoSpace => "no space",
            ErrorKind::Locked => "locked",
            ErrorKind::Closed => "closed",
            ErrorKind::Io => "i/o error",
            ErrorKind::Corruption => "corruption",
        }
    }
}

/// The error returned by every fallible kvtier operation.
#[derive(Debug)]
pub struct Error {
    kind: ErrorKind,
    message: String,
    source: Option<io::Error>,
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// An I/O error with context saying what kvtier was doing.
    pub fn io(context: impl Into<String>, source: io::Error) -> Self {
        Error {
            kind: ErrorKind::Io,
            message: context.into(),
            source: Some(source),
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::InvalidArgument, message)
    }

    /// A value of `len` bytes asked for into `room` bytes: the one
    /// wording the store, the server and the client give it.
    pub fn buffer_too_small(len: u64, room: u64) -> Self {
        Error::new(
            ErrorKind::BufferTooSmall,
            format!("value is {len} bytes but the buffer is {room} bytes"),
        )
    }

    pub fn no_space(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::NoSpace, message)
    }

    pub fn closed() -> Self {
        Error::new(ErrorKind::Closed, "the store is closed")
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    /// The underlying OS error, if any.
    pub fn io_error(&self) -> Option<&io::Error> {
        self.source.as_ref()
    }

    /// A copy suitable for handing the same failure to several waiters
    /// (or to every key of a batch that failed as a whole).
    pub fn duplicate(&self) -> Self {
        Error {
            kind: self.kind,
            message: self.message.clone(),
            source: self
                .source
                .as_ref()
                .map(|e| io::Error::new(e.kind(), e.to_string())),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind.as_str(), self.message)?;
        if let Some(source) = &self.source {
            write!(f, ": {source}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_ref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}
