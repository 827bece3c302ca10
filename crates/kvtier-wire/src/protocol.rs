//! The wire protocol: versioned, length-prefixed binary frames with request
//! ids (specified in docs/protocol.md). Every integer is little endian.
//! Decoders never trust a length: each is checked against the bytes left
//! and the negotiated limits before anything is allocated.

use std::fmt;

pub const MAGIC: &[u8; 4] = b"KVTP";
/// Version 2: hello carries a namespace; tokens are required on TCP.
pub const VERSION: u16 = 2;
pub const HEADER_LEN: usize = 24;

/// Longest auth token a hello may carry.
pub const MAX_TOKEN_LEN: usize = 512;

/// `(offset, len)` ranges of a shared buffer that one value is laid
/// across, as the frame holds them: 16 bytes a range (u64 offset, u64
/// length), decoded as they are read. A frame of millions of ranges is
/// therefore served without a decoded copy of them (a server holds a
/// segment frame within 1.5x of its size).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct SegmentList<'a> {
    bytes: &'a [u8],
}

impl<'a> SegmentList<'a> {
    /// The ranges `bytes` holds (`None` unless a multiple of 16 bytes).
    pub fn new(bytes: &'a [u8]) -> Option<Self> {
        bytes
            .len()
            .is_multiple_of(16)
            .then_some(SegmentList { bytes })
    }

    /// `ranges` in the wire's layout, for [`SegmentList::new`].
    pub fn encode(ranges: &[(u64, u64)]) -> Vec<u8> {
        let mut out = Vec::with_capacity(ranges.len() * 16);
        for (offset, len) in ranges {
            out.extend_from_slice(&offset.to_le_bytes());
            out.extend_from_slice(&len.to_le_bytes());
        }
        out
    }

    pub fn len(&self) -> usize {
        self.bytes.len() / 16
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The ranges in wire layout.
    pub fn as_bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// Range `i`.
    pub fn get(&self, i: usize) -> (u64, u64) {
        let at = &self.bytes[i * 16..i * 16 + 16];
        (
            u64::from_le_bytes(at[..8].try_into().expect("8 bytes")),
            u64::from_le_bytes(at[8..].try_into().expect("8 bytes")),
        )
    }

    pub fn iter(&self) -> impl Iterator<Item = (u64, u64)> + 'a {
        let list = *self;
        (0..list.len()).map(move |i| list.get(i))
    }
}

impl std::fmt::Debug for SegmentList<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// A key and its segments, in a segment op.
pub type SegmentItem<'a> = (&'a [u8], SegmentList<'a>);

/// Most segments one value may have in the segment ops: a block's K and V
/// pages across the layers of the deepest models, with room to spare.
pub const MAX_SEGMENTS: u32 = 4096;

/// Default limits, announced by the server at hello.
pub const DEFAULT_MAX_FRAME: u64 = 1 << 30;
pub const DEFAULT_MAX_BATCH: u32 = 4096;

/// Operation codes (the same value in a request and its response).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum Op {
    Hello = 1,
    BatchPut = 2,
    BatchGet = 3,
    BatchExists = 4,
    PrefixLen = 5,
    Remove = 6,
    Flush = 7,
    Stats = 8,
    RegisterBuffer = 9,
    BatchPutShm = 10,
    BatchGetShm = 11,
    BatchPutShmSegments = 12,
    BatchGetShmSegments = 13,
    ClusterView = 14,
    /// Before hello: the client's nonce and token id; the reply is the
    /// server's nonce and its proof of the token (`proof`).
    Challenge = 15,
    /// The namespaces the connection's scope covers, with their census
    /// (blocks, bytes) and manifests: a JSON document.
    Namespaces = 16,
    /// Removes every block of the connection's namespace (durable on
    /// return; in cluster mode on every member): two u64s, the blocks and
    /// bytes removed.
    RetireNamespace = 17,
    /// Stores the connection's namespace's manifest (a JSON object of
    /// readable fields, at most `kvtier::MAX_MANIFEST_LEN` bytes).
    DescribeNamespace = 18,
    /// Same host only: lets the shared-memory ops name ranges of the
    /// client's own address space, which the server reads and writes with
    /// cross-memory attach (`process_vm_readv`/`writev`, one copy). The
    /// body is a probe: an address and the 16 bytes the client holds there,
    /// which the server must read back. The reply is a buffer id, as
    /// RegisterBuffer's.
    RegisterPeerMemory = 19,
    /// Same host, full scope only: the reply carries (SCM_RIGHTS) a
    /// descriptor of the server's memory pool that maps read-only, and
    /// its length (u64). See docs/protocol.md, "Pool mapping".
    MapPool = 20,
    /// Leases the memory copies of values for the client to copy out of
    /// its pool mapping: a BatchGet's body; the reply is a lease id (u64)
    /// and per key `(i32 code, u64 offset, u64 len)`, where NOT_FOUND
    /// means no memory copy (the key is read with a get instead).
    LeaseValues = 21,
    /// Ends a lease (u64 id): its extents may be reused from then on.
    ReleaseLease = 22,
}

impl Op {
    /// Every operation, in code order (codes run from 1 without gaps).
    pub const ALL: [Op; 22] = [
        Op::Hello,
        Op::BatchPut,
        Op::BatchGet,
        Op::BatchExists,
        Op::PrefixLen,
        Op::Remove,
        Op::Flush,
        Op::Stats,
        Op::RegisterBuffer,
        Op::BatchPutShm,
        Op::BatchGetShm,
        Op::BatchPutShmSegments,
        Op::BatchGetShmSegments,
        Op::ClusterView,
        Op::Challenge,
        Op::Namespaces,
        Op::RetireNamespace,
        Op::DescribeNamespace,
        Op::RegisterPeerMemory,
        Op::MapPool,
        Op::LeaseValues,
        Op::ReleaseLease,
    ];

    pub fn from_u16(code: u16) -> Option<Op> {
        Op::ALL.get(usize::from(code).checked_sub(1)?).copied()
    }

    /// The operation's place in `ALL`, for tables indexed by operation.
    pub fn index(self) -> usize {
        self as usize - 1
    }

    /// The name metrics, logs and the admin page use.
    pub fn name(self) -> &'static str {
        match self {
            Op::Hello => "hello",
            Op::BatchPut => "batch_put",
            Op::BatchGet => "batch_get",
            Op::BatchExists => "batch_exists",
            Op::PrefixLen => "prefix_len",
            Op::Remove => "remove",
            Op::Flush => "flush",
            Op::Stats => "stats",
            Op::RegisterBuffer => "register_buffer",
            Op::BatchPutShm => "batch_put_shm",
            Op::BatchGetShm => "batch_get_shm",
            Op::BatchPutShmSegments => "batch_put_shm_segments",
            Op::BatchGetShmSegments => "batch_get_shm_segments",
            Op::ClusterView => "cluster_view",
            Op::Challenge => "challenge",
            Op::Namespaces => "namespaces",
            Op::RetireNamespace => "retire_namespace",
            Op::DescribeNamespace => "describe_namespace",
            Op::RegisterPeerMemory => "register_peer_memory",
            Op::MapPool => "map_pool",
            Op::LeaseValues => "lease_values",
            Op::ReleaseLease => "release_lease",
        }
    }

    /// Whether the operation's replies carry values (the get latency).
    pub fn reads_values(self) -> bool {
        matches!(
            self,
            Op::BatchGet | Op::BatchGetShm | Op::BatchGetShmSegments
        )
    }

    /// Whether the operation's requests carry values (the put latency).
    pub fn writes_values(self) -> bool {
        matches!(
            self,
            Op::BatchPut | Op::BatchPutShm | Op::BatchPutShmSegments
        )
    }
}

/// Per-key and per-frame result codes: 0 is success, negative values are
/// errors (Mooncake's convention, so Python callers can share one table).
pub mod code {
    pub const OK: i32 = 0;
    pub const INVALID_ARGUMENT: i32 = -1;
    pub const BUFFER_TOO_SMALL: i32 = -2;
    pub const NO_SPACE: i32 = -3;
    pub const CLOSED: i32 = -4;
    pub const IO: i32 = -5;
    pub const NOT_FOUND: i32 = -6;
    pub const UNAUTHORIZED: i32 = -7;
    pub const UNSUPPORTED: i32 = -8;
    pub const PROTOCOL: i32 = -9;
    pub const LIMIT: i32 = -10;
    pub const TIMEOUT: i32 = -11;
    pub const CORRUPTION: i32 = -12;
    pub const LOCKED: i32 = -13;

    /// Every code with its constant's name, for bindings that export the
    /// table (the Python package's `kvtier.OK`, ...).
    pub const ALL: [(&str, i32); 14] = [
        ("OK", OK),
        ("INVALID_ARGUMENT", INVALID_ARGUMENT),
        ("BUFFER_TOO_SMALL", BUFFER_TOO_SMALL),
        ("NO_SPACE", NO_SPACE),
        ("CLOSED", CLOSED),
        ("IO", IO),
        ("NOT_FOUND", NOT_FOUND),
        ("UNAUTHORIZED", UNAUTHORIZED),
        ("UNSUPPORTED", UNSUPPORTED),
        ("PROTOCOL", PROTOCOL),
        ("LIMIT", LIMIT),
        ("TIMEOUT", TIMEOUT),
        ("CORRUPTION", CORRUPTION),
        ("LOCKED", LOCKED),
    ];

    pub fn name(code: i32) -> &'static str {
        match code {
            OK => "ok",
            INVALID_ARGUMENT => "invalid argument",
            BUFFER_TOO_SMALL => "buffer too small",
            NO_SPACE => "no space",
            CLOSED => "closed",
            IO => "i/o error",
            NOT_FOUND => "not found",
            UNAUTHORIZED => "unauthorized",
            UNSUPPORTED => "unsupported",
            PROTOCOL => "protocol error",
            LIMIT => "over a limit",
            TIMEOUT => "timed out",
            CORRUPTION => "corruption",
            LOCKED => "locked",
            _ => "unknown error",
        }
    }

    pub fn of(kind: kvtier::ErrorKind) -> i32 {
        use kvtier::ErrorKind as K;
        match kind {
            K::InvalidArgument => INVALID_ARGUMENT,
            K::BufferTooSmall => BUFFER_TOO_SMALL,
            K::NoSpace => NO_SPACE,
            K::Closed => CLOSED,
            K::Io => IO,
            K::Corruption => CORRUPTION,
            K::Locked => LOCKED,
            _ => IO,
        }
    }

    /// The error kind a client reports for a server's code (the inverse
    /// of [`of`] where one exists; codes with no kind of their own map to
    /// the nearest one).
    pub fn kind(code: i32) -> kvtier::ErrorKind {
        use kvtier::ErrorKind as K;
        match code {
            INVALID_ARGUMENT | LIMIT | UNSUPPORTED => K::InvalidArgument,
            BUFFER_TOO_SMALL => K::BufferTooSmall,
            NO_SPACE => K::NoSpace,
            CLOSED => K::Closed,
            CORRUPTION => K::Corruption,
            LOCKED => K::Locked,
            _ => K::Io,
        }
    }
}

/// Fixed frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub op: u16,
    pub request_id: u64,
    pub body_len: u32,
    /// Requests: flags (none defined, must be 0). Responses: a frame-level
    /// code (0, or an error from [`code`] with a message as the body).
    pub status: i32,
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0..4].copy_from_slice(MAGIC);
        out[4..6].copy_from_slice(&VERSION.to_le_bytes());
        out[6..8].copy_from_slice(&self.op.to_le_bytes());
        out[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        out[16..20].copy_from_slice(&self.body_len.to_le_bytes());
        out[20..24].copy_from_slice(&self.status.to_le_bytes());
        out
    }

    pub fn decode(bytes: &[u8; HEADER_LEN], max_frame: u64) -> Result<Header, ProtocolError> {
        if &bytes[0..4] != MAGIC {
            return Err(ProtocolError::new("bad frame magic (not a kvtier peer?)"));
        }
        let version = u16::from_le_bytes([bytes[4], bytes[5]]);
        if version != VERSION {
            return Err(ProtocolError::new(format!(
                "protocol version {version} is not supported (this side speaks {VERSION})"
            )));
        }
        let header = Header {
            op: u16::from_le_bytes([bytes[6], bytes[7]]),
            request_id: u64::from_le_bytes(bytes[8..16].try_into().unwrap()),
            body_len: u32::from_le_bytes(bytes[16..20].try_into().unwrap()),
            status: i32::from_le_bytes(bytes[20..24].try_into().unwrap()),
        };
        if u64::from(header.body_len) > max_frame {
            return Err(ProtocolError::new(format!(
                "frame body of {} bytes exceeds the {max_frame}-byte limit",
                header.body_len
            )));
        }
        Ok(header)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProtocolError(pub String);

impl ProtocolError {
    pub fn new(message: impl Into<String>) -> Self {
        ProtocolError(message.into())
    }
}

impl fmt::Display for ProtocolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ProtocolError {}

/// Appends encoded fields to a body.
#[derive(Debug, Default)]
pub struct Writer {
    pub buf: Vec<u8>,
}

impl Writer {
    pub fn with_capacity(n: usize) -> Self {
        Writer {
            buf: Vec::with_capacity(n),
        }
    }
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn i32(&mut self, v: i32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(v);
        self
    }
    /// A key: u16 length then the bytes.
    pub fn key(&mut self, key: &[u8]) -> &mut Self {
        self.u16(key.len() as u16).bytes(key)
    }
}

/// Reads fields from a body, failing cleanly on truncation.
#[derive(Debug)]
pub struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, at: 0 }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], ProtocolError> {
        if self.buf.len() - self.at < n {
            return Err(ProtocolError::new(format!(
                "frame body truncated: needed {n} more bytes at offset {}, {} left",
                self.at,
                self.buf.len() - self.at
            )));
        }
        let out = &self.buf[self.at..self.at + n];
        self.at += n;
        Ok(out)
    }
    pub fn u8(&mut self) -> Result<u8, ProtocolError> {
        Ok(self.take(1)?[0])
    }
    pub fn u16(&mut self) -> Result<u16, ProtocolError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().unwrap()))
    }
    pub fn u32(&mut self) -> Result<u32, ProtocolError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    pub fn i32(&mut self) -> Result<i32, ProtocolError> {
        Ok(i32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    pub fn u64(&mut self) -> Result<u64, ProtocolError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8], ProtocolError> {
        self.take(n)
    }
    /// A key: u16 length (1..=256) then the bytes.
    pub fn key(&mut self) -> Result<&'a [u8], ProtocolError> {
        let len = self.u16()? as usize;
        rules::key_len(len)?;
        self.take(len)
    }
    /// A batch count, checked against the limit and against the bytes left
    /// (each item takes at least `min_item` bytes).
    pub fn count(&mut self, max_batch: u32, min_item: usize) -> Result<usize, ProtocolError> {
        let n = self.u32()?;
        rules::count(n, max_batch, min_item as u64, self.remaining() as u64)?;
        Ok(n as usize)
    }
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.at
    }
    pub fn finish(&self) -> Result<(), ProtocolError> {
        if self.remaining() != 0 {
            return Err(ProtocolError::new(format!(
                "{} unexpected trailing bytes in the frame body",
                self.remaining()
            )));
        }
        Ok(())
    }
}

/// The body of a successful Hello reply: the server's protocol version and
/// the limits a client splits its batches by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HelloReply {
    pub version: u32,
    /// Largest frame body the server reads.
    pub max_frame: u64,
    /// Most items in one batch.
    pub max_batch: u32,
    pub max_key_len: u32,
    /// Largest value a put can store (`Store::max_put_len`).
    pub max_value: u64,
    /// What this server offers beyond the version (`features::*` bits).
    /// Absent from older servers' replies, read as 0; older clients
    /// ignore it.
    pub features: u32,
}

/// Bits of `HelloReply::features`.
pub mod features {
    /// RegisterPeerMemory is served (the server allows cross-memory
    /// attach, and this connection came over its Unix socket).
    pub const PEER_MEMORY: u32 = 1;
    /// MapPool, LeaseValues and ReleaseLease are served (the server's pool
    /// is shareable, and this connection is a same-user, full-scope one
    /// over its Unix socket).
    pub const POOL_MAP: u32 = 2;
}

/// Bytes of RegisterPeerMemory's probe.
pub const PEER_PROBE_LEN: usize = 16;

/// One key's answer to LeaseValues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Leased {
    /// OK: leased, at `offset` of the pool; BUFFER_TOO_SMALL: `len` is
    /// the value's length; NOT_FOUND: no memory copy (get it instead).
    pub code: i32,
    pub offset: u64,
    pub len: u64,
}

/// LeaseValues' reply: `u64 lease, u32 n, n × (i32 code, u64 offset, u64 len)`.
pub fn encode_lease_reply(lease: u64, items: &[Leased]) -> Vec<u8> {
    let mut w = Writer::default();
    w.u64(lease).u32(items.len() as u32);
    for item in items {
        w.i32(item.code).u64(item.offset).u64(item.len);
    }
    w.buf
}

/// Reads LeaseValues' reply to a request of `n` keys. Lengths and offsets
/// are the server's word: the caller checks them against its mapping.
pub fn decode_lease_reply(body: &[u8], n: usize) -> Result<(u64, Vec<Leased>), ProtocolError> {
    let mut r = Reader::new(body);
    let lease = r.u64()?;
    if r.u32()? as usize != n {
        return Err(ProtocolError::new(
            "a lease reply with another number of keys than asked",
        ));
    }
    let mut items = Vec::with_capacity(n.min(r.remaining() / 20));
    for _ in 0..n {
        items.push(Leased {
            code: r.i32()?,
            offset: r.u64()?,
            len: r.u64()?,
        });
    }
    r.finish()?;
    Ok((lease, items))
}

impl HelloReply {
    pub const LEN: usize = 4 + 8 + 4 + 4 + 8 + 4;

    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(Self::LEN);
        w.u32(self.version)
            .u64(self.max_frame)
            .u32(self.max_batch)
            .u32(self.max_key_len)
            .u64(self.max_value)
            .u32(self.features);
        w.buf
    }

    pub fn decode(body: &[u8]) -> Result<HelloReply, ProtocolError> {
        let mut r = Reader::new(body);
        Ok(HelloReply {
            version: r.u32()?,
            max_frame: r.u64()?,
            max_batch: r.u32()?,
            max_key_len: r.u32()?,
            max_value: r.u64()?,
            features: if r.remaining() >= 4 { r.u32()? } else { 0 },
        })
    }
}

/// The checks every reader of a request applies, written once: the frame
/// decoder ([`decode_request`]) and the server's streamed BatchPut reader,
/// which checks the same frame as its items arrive.
pub mod rules {
    use super::ProtocolError;

    /// The smallest BatchPut item: a 1-byte key with its length, and a
    /// value length.
    pub const MIN_PUT_ITEM: u64 = 11;

    /// A batch of `n` items, each at least `min_item` bytes, with
    /// `remaining` bytes of the frame left.
    pub fn count(
        n: u32,
        max_batch: u32,
        min_item: u64,
        remaining: u64,
    ) -> Result<(), ProtocolError> {
        if n > max_batch {
            return Err(ProtocolError::new(format!(
                "batch of {n} keys exceeds the {max_batch}-key limit"
            )));
        }
        if u64::from(n).saturating_mul(min_item) > remaining {
            return Err(ProtocolError::new(format!(
                "batch of {n} keys does not fit the frame"
            )));
        }
        Ok(())
    }

    pub fn key_len(len: usize) -> Result<(), ProtocolError> {
        if len == 0 || len > kvtier::MAX_KEY_LEN {
            return Err(ProtocolError::new(format!(
                "key of {len} bytes: keys are 1 to {} bytes",
                kvtier::MAX_KEY_LEN
            )));
        }
        Ok(())
    }

    /// A put's value length, with `remaining` bytes of the frame left.
    pub fn value_len(len: u64, remaining: u64) -> Result<(), ProtocolError> {
        if len > remaining {
            return Err(ProtocolError::new(format!(
                "value of {len} bytes does not fit the frame"
            )));
        }
        Ok(())
    }
}

/// Flags in a request header's status field (all other bits must be 0).
pub mod request_flags {
    /// Answer from this server's own store only: never forward to the
    /// cluster members that own a key. Cluster peers set it on what they
    /// forward, so a request crosses at most one hop.
    pub const LOCAL_ONLY: i32 = 1;
}

/// A put's options as the one flags byte of a BatchPut frame, mapped both
/// ways here only.
pub mod put_flags {
    use kvtier::{PutOptions, PutTier};

    pub const SKIP_EXISTING: u8 = 1;
    pub const MEMORY_ONLY: u8 = 2;
    pub const DURABLE: u8 = 4;
    pub fn encode(options: &PutOptions) -> u8 {
        let mut flags = 0;
        if options.skip_existing {
            flags |= SKIP_EXISTING;
        }
        if options.tier == PutTier::MemoryOnly {
            flags |= MEMORY_ONLY;
        }
        if options.durable {
            flags |= DURABLE;
        }
        flags
    }

    /// The options of a frame's flags (bits this version does not know
    /// are ignored, as they always were).
    pub fn decode(flags: u8) -> PutOptions {
        PutOptions {
            skip_existing: flags & SKIP_EXISTING != 0,
            tier: if flags & MEMORY_ONLY != 0 {
                PutTier::MemoryOnly
            } else {
                PutTier::MemoryAndDisk
            },
            durable: flags & DURABLE != 0,
        }
    }
}

/// A decoded request body, borrowing from the frame.
#[derive(Debug, PartialEq, Eq)]
pub enum Request<'a> {
    /// The first half of a challenge-response hello (`proof`): the hello
    /// that follows carries a proof in place of the token.
    Challenge {
        client_nonce: &'a [u8; crate::proof::NONCE_LEN],
        token_id: &'a [u8; crate::proof::TOKEN_ID_LEN],
        /// The cluster member the client meant to reach (its node id), if
        /// it dialled one: the server then proves which member it is.
        member: Option<&'a str>,
    },
    Hello {
        token: &'a [u8],
        /// UTF-8, at most `kvtier::MAX_NAMESPACE_LEN` bytes.
        namespace: &'a str,
    },
    BatchPut {
        flags: u8,
        items: Vec<(&'a [u8], &'a [u8])>,
    },
    BatchGet {
        items: Vec<(&'a [u8], u64)>,
    },
    BatchExists {
        keys: Vec<&'a [u8]>,
    },
    PrefixLen {
        keys: Vec<&'a [u8]>,
    },
    Remove {
        key: &'a [u8],
    },
    Flush,
    Stats,
    /// The members a client may send keys to directly (cluster mode).
    ClusterView,
    Namespaces,
    RetireNamespace,
    /// The manifest's bytes (the whole body).
    DescribeNamespace {
        manifest: &'a [u8],
    },
    RegisterBuffer {
        size: u64,
    },
    /// `probe` is what the client holds at `address` of its own memory.
    RegisterPeerMemory {
        address: u64,
        probe: &'a [u8; PEER_PROBE_LEN],
    },
    MapPool,
    /// Keys with the room the client has for each value.
    LeaseValues {
        items: Vec<(&'a [u8], u64)>,
    },
    ReleaseLease {
        lease: u64,
    },
    BatchPutShm {
        buffer: u32,
        flags: u8,
        items: Vec<(&'a [u8], u64, u64)>,
    },
    BatchGetShm {
        buffer: u32,
        items: Vec<(&'a [u8], u64, u64)>,
    },
    /// Each value is the concatenation of `(offset, len)` segments.
    BatchPutShmSegments {
        buffer: u32,
        flags: u8,
        items: Vec<SegmentItem<'a>>,
    },
    /// Each value is scattered across `(offset, capacity)` segments, in order.
    BatchGetShmSegments {
        buffer: u32,
        items: Vec<SegmentItem<'a>>,
    },
}

impl Request<'_> {
    /// The operation this request is.
    pub fn op(&self) -> Op {
        match self {
            Request::Challenge { .. } => Op::Challenge,
            Request::Hello { .. } => Op::Hello,
            Request::BatchPut { .. } => Op::BatchPut,
            Request::BatchGet { .. } => Op::BatchGet,
            Request::BatchExists { .. } => Op::BatchExists,
            Request::PrefixLen { .. } => Op::PrefixLen,
            Request::Remove { .. } => Op::Remove,
            Request::Flush => Op::Flush,
            Request::Stats => Op::Stats,
            Request::ClusterView => Op::ClusterView,
            Request::Namespaces => Op::Namespaces,
            Request::RetireNamespace => Op::RetireNamespace,
            Request::DescribeNamespace { .. } => Op::DescribeNamespace,
            Request::RegisterBuffer { .. } => Op::RegisterBuffer,
            Request::RegisterPeerMemory { .. } => Op::RegisterPeerMemory,
            Request::MapPool => Op::MapPool,
            Request::LeaseValues { .. } => Op::LeaseValues,
            Request::ReleaseLease { .. } => Op::ReleaseLease,
            Request::BatchPutShm { .. } => Op::BatchPutShm,
            Request::BatchGetShm { .. } => Op::BatchGetShm,
            Request::BatchPutShmSegments { .. } => Op::BatchPutShmSegments,
            Request::BatchGetShmSegments { .. } => Op::BatchGetShmSegments,
        }
    }

    /// The request's body, as `decode_request` reads it. The encoding is
    /// canonical: for every body `decode_request` accepts, encoding the
    /// result gives the same bytes back (the fuzz targets check this).
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        let keys = |w: &mut Writer, keys: &[&[u8]]| {
            w.u32(keys.len() as u32);
            for k in keys {
                w.key(k);
            }
        };
        match self {
            Request::Challenge {
                client_nonce,
                token_id,
                member,
            } => {
                w.bytes(&client_nonce[..]).bytes(&token_id[..]);
                if let Some(member) = member {
                    w.u16(member.len() as u16).bytes(member.as_bytes());
                }
            }
            Request::Hello { token, namespace } => {
                w.u32(token.len() as u32)
                    .bytes(token)
                    .u16(namespace.len() as u16)
                    .bytes(namespace.as_bytes());
            }
            Request::BatchPut { flags, items } => {
                w.u8(*flags).u32(items.len() as u32);
                for (k, v) in items {
                    w.key(k).u64(v.len() as u64).bytes(v);
                }
            }
            Request::BatchGet { items } | Request::LeaseValues { items } => {
                w.u32(items.len() as u32);
                for (k, cap) in items {
                    w.key(k).u64(*cap);
                }
            }
            Request::BatchExists { keys: k } | Request::PrefixLen { keys: k } => keys(&mut w, k),
            Request::Remove { key } => {
                w.key(key);
            }
            Request::Flush
            | Request::Stats
            | Request::ClusterView
            | Request::Namespaces
            | Request::MapPool
            | Request::RetireNamespace => {}
            Request::ReleaseLease { lease } => {
                w.u64(*lease);
            }
            Request::DescribeNamespace { manifest } => {
                w.bytes(manifest);
            }
            Request::RegisterBuffer { size } => {
                w.u64(*size);
            }
            Request::RegisterPeerMemory { address, probe } => {
                w.u64(*address).bytes(&probe[..]);
            }
            Request::BatchPutShm {
                buffer,
                flags,
                items,
            } => {
                w.u32(*buffer).u8(*flags).u32(items.len() as u32);
                for (k, offset, len) in items {
                    w.key(k).u64(*offset).u64(*len);
                }
            }
            Request::BatchGetShm { buffer, items } => {
                w.u32(*buffer).u32(items.len() as u32);
                for (k, offset, len) in items {
                    w.key(k).u64(*offset).u64(*len);
                }
            }
            Request::BatchPutShmSegments {
                buffer,
                flags,
                items,
            } => {
                w.u32(*buffer).u8(*flags);
                write_segment_lists(&mut w, items);
            }
            Request::BatchGetShmSegments { buffer, items } => {
                w.u32(*buffer);
                write_segment_lists(&mut w, items);
            }
        }
        w.buf
    }
}

/// What a batch request and its reply take on the wire, so a client cuts
/// a batch into frames that fit before it writes them: `Request::encode`
/// writes exactly these sizes (`sizes_are_what_encode_writes` checks), and
/// a client that sends values from its own memory (BatchPut, written
/// vectored) counts with the same functions.
pub mod frame_size {
    use super::Op;

    /// Bytes of a request body before its items (the flags, the buffer id
    /// and the item count); 0 for requests without items.
    pub const fn fixed(op: Op) -> u64 {
        match op {
            Op::BatchPut => 1 + 4,
            Op::BatchGet | Op::LeaseValues | Op::BatchExists | Op::PrefixLen => 4,
            Op::BatchPutShm | Op::BatchPutShmSegments => 4 + 1 + 4,
            Op::BatchGetShm | Op::BatchGetShmSegments => 4 + 4,
            Op::Hello
            | Op::Remove
            | Op::Flush
            | Op::Stats
            | Op::RegisterBuffer
            | Op::RegisterPeerMemory
            | Op::MapPool
            | Op::ReleaseLease
            | Op::ClusterView
            | Op::Challenge
            | Op::Namespaces
            | Op::RetireNamespace
            | Op::DescribeNamespace => 0,
        }
    }

    /// A key: its u16 length, then its bytes.
    pub const fn key(key_len: usize) -> u64 {
        2 + key_len as u64
    }

    /// A BatchPut item: the key, the value's u64 length, the value.
    pub const fn put_item(key_len: usize, value_len: u64) -> u64 {
        key(key_len) + 8 + value_len
    }

    /// A BatchGet item: the key and the u64 capacity.
    pub const fn get_item(key_len: usize) -> u64 {
        key(key_len) + 8
    }

    /// A BatchPutShm or BatchGetShm item: the key, u64 offset, u64 length.
    pub const fn range_item(key_len: usize) -> u64 {
        key(key_len) + 16
    }

    /// A segment item: the key, the u32 count, 16 bytes a segment.
    pub const fn segment_item(key_len: usize, segments: usize) -> u64 {
        key(key_len) + 4 + 16 * segments as u64
    }

    /// A LeaseValues reply item: the i32 code, the u64 offset, the u64
    /// length.
    pub const LEASE_REPLY_ITEM: u64 = 4 + 8 + 8;

    /// A BatchGet reply item: the i32 code, the u64 length, the value.
    pub const fn get_reply_item(value_len: u64) -> u64 {
        4 + 8 + value_len
    }
}

/// `u32 n, n × (key, u32 count, count × (u64 offset, u64 len))`.
pub fn write_segment_items<K: AsRef<[u8]>, S: AsRef<[(u64, u64)]>>(
    w: &mut Writer,
    items: &[(K, S)],
) {
    w.u32(items.len() as u32);
    for (k, segments) in items {
        let segments = segments.as_ref();
        w.key(k.as_ref()).u32(segments.len() as u32);
        for (offset, len) in segments {
            w.u64(*offset).u64(*len);
        }
    }
}

/// [`write_segment_items`] of items decoded from a frame.
fn write_segment_lists(w: &mut Writer, items: &[SegmentItem<'_>]) {
    w.u32(items.len() as u32);
    for (k, segments) in items {
        w.key(k)
            .u32(segments.len() as u32)
            .bytes(segments.as_bytes());
    }
}

/// Decodes a request body for `op`.
pub fn decode_request<'a>(
    op: u16,
    body: &'a [u8],
    max_batch: u32,
) -> Result<Request<'a>, ProtocolError> {
    let op =
        Op::from_u16(op).ok_or_else(|| ProtocolError::new(format!("unknown operation {op}")))?;
    let mut r = Reader::new(body);
    let keys = |r: &mut Reader<'a>| -> Result<Vec<&'a [u8]>, ProtocolError> {
        let n = r.count(max_batch, 3)?;
        (0..n).map(|_| r.key()).collect()
    };
    let request = match op {
        Op::Challenge => Request::Challenge {
            client_nonce: r
                .bytes(crate::proof::NONCE_LEN)?
                .try_into()
                .expect("NONCE_LEN bytes"),
            token_id: r
                .bytes(crate::proof::TOKEN_ID_LEN)?
                .try_into()
                .expect("TOKEN_ID_LEN bytes"),
            member: if r.remaining() == 0 {
                None
            } else {
                let len = usize::from(r.u16()?);
                if len == 0 || len > crate::proof::MAX_MEMBER_ID_LEN {
                    return Err(ProtocolError::new(format!(
                        "a challenge's member id of {len} bytes (1 to {})",
                        crate::proof::MAX_MEMBER_ID_LEN
                    )));
                }
                Some(
                    std::str::from_utf8(r.bytes(len)?)
                        .map_err(|_| ProtocolError::new("a challenge's member id is not UTF-8"))?,
                )
            },
        },
        Op::Hello => {
            let len = r.u32()? as usize;
            if len > MAX_TOKEN_LEN {
                return Err(ProtocolError::new(format!(
                    "auth token longer than {MAX_TOKEN_LEN} bytes"
                )));
            }
            let token = r.bytes(len)?;
            let ns_len = usize::from(r.u16()?);
            if ns_len > kvtier::MAX_NAMESPACE_LEN {
                return Err(ProtocolError::new(format!(
                    "namespace longer than {} bytes",
                    kvtier::MAX_NAMESPACE_LEN
                )));
            }
            let namespace = std::str::from_utf8(r.bytes(ns_len)?)
                .map_err(|_| ProtocolError::new("namespace is not UTF-8"))?;
            Request::Hello { token, namespace }
        }
        Op::BatchPut => {
            let flags = r.u8()?;
            let n = r.count(max_batch, rules::MIN_PUT_ITEM as usize)?;
            let mut items = Vec::with_capacity(n);
            for _ in 0..n {
                let key = r.key()?;
                let len = r.u64()?;
                rules::value_len(len, r.remaining() as u64)?;
                items.push((key, r.bytes(len as usize)?));
            }
            Request::BatchPut { flags, items }
        }
        Op::BatchGet | Op::LeaseValues => {
            let n = r.count(max_batch, 11)?;
            let mut items = Vec::with_capacity(n);
            for _ in 0..n {
                let key = r.key()?;
                items.push((key, r.u64()?));
            }
            if op == Op::BatchGet {
                Request::BatchGet { items }
            } else {
                Request::LeaseValues { items }
            }
        }
        Op::BatchExists => Request::BatchExists {
            keys: keys(&mut r)?,
        },
        Op::PrefixLen => Request::PrefixLen {
            keys: keys(&mut r)?,
        },
        Op::Remove => Request::Remove { key: r.key()? },
        Op::Flush => Request::Flush,
        Op::Stats => Request::Stats,
        Op::ClusterView => Request::ClusterView,
        Op::Namespaces => Request::Namespaces,
        Op::RetireNamespace => Request::RetireNamespace,
        Op::DescribeNamespace => {
            let manifest = r.bytes(r.remaining())?;
            kvtier::validate_manifest(manifest).map_err(|e| ProtocolError::new(e.to_string()))?;
            Request::DescribeNamespace { manifest }
        }
        Op::RegisterBuffer => Request::RegisterBuffer { size: r.u64()? },
        Op::MapPool => Request::MapPool,
        Op::ReleaseLease => Request::ReleaseLease { lease: r.u64()? },
        Op::RegisterPeerMemory => Request::RegisterPeerMemory {
            address: r.u64()?,
            probe: r
                .bytes(PEER_PROBE_LEN)?
                .try_into()
                .expect("PEER_PROBE_LEN bytes"),
        },
        Op::BatchPutShm | Op::BatchGetShm => {
            let buffer = r.u32()?;
            let flags = if op == Op::BatchPutShm { r.u8()? } else { 0 };
            let n = r.count(max_batch, 19)?;
            let mut items = Vec::with_capacity(n);
            for _ in 0..n {
                let key = r.key()?;
                items.push((key, r.u64()?, r.u64()?));
            }
            if op == Op::BatchPutShm {
                Request::BatchPutShm {
                    buffer,
                    flags,
                    items,
                }
            } else {
                Request::BatchGetShm { buffer, items }
            }
        }
        Op::BatchPutShmSegments | Op::BatchGetShmSegments => {
            let buffer = r.u32()?;
            let flags = if op == Op::BatchPutShmSegments {
                r.u8()?
            } else {
                0
            };
            // Key (3 bytes at least) and a count: a value may have no
            // segments here and be refused per key by the handler.
            let n = r.count(max_batch, 7)?;
            let mut items = Vec::with_capacity(n);
            for _ in 0..n {
                let key = r.key()?;
                let count = r.u32()?;
                if count > MAX_SEGMENTS || count as usize * 16 > r.remaining() {
                    return Err(ProtocolError::new(format!(
                        "value of {count} segments: at most {MAX_SEGMENTS}, and all in the frame"
                    )));
                }
                let segments = SegmentList::new(r.bytes(count as usize * 16)?)
                    .expect("a multiple of 16 bytes");
                items.push((key, segments));
            }
            if op == Op::BatchPutShmSegments {
                Request::BatchPutShmSegments {
                    buffer,
                    flags,
                    items,
                }
            } else {
                Request::BatchGetShmSegments { buffer, items }
            }
        }
    };
    r.finish()?;
    Ok(request)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_replies_round_trip_and_refuse_other_counts() {
        let items = [
            Leased {
                code: code::OK,
                offset: 4096,
                len: 77,
            },
            Leased {
                code: code::NOT_FOUND,
                offset: 0,
                len: 0,
            },
        ];
        let body = encode_lease_reply(9, &items);
        assert_eq!(decode_lease_reply(&body, 2).unwrap(), (9, items.to_vec()));
        assert!(decode_lease_reply(&body, 3).is_err());
        assert!(decode_lease_reply(&body[..body.len() - 1], 2).is_err());
        let mut longer = body.clone();
        longer.push(0);
        assert!(decode_lease_reply(&longer, 2).is_err());
    }

    #[test]
    fn every_op_code_maps_both_ways_and_names_are_distinct() {
        for (i, op) in Op::ALL.iter().enumerate() {
            assert_eq!(op.index(), i);
            assert_eq!(Op::from_u16(*op as u16), Some(*op));
        }
        assert_eq!(Op::from_u16(0), None);
        assert_eq!(Op::from_u16(Op::ALL.len() as u16 + 1), None);
        let names: std::collections::HashSet<_> = Op::ALL.iter().map(|op| op.name()).collect();
        assert_eq!(names.len(), Op::ALL.len());
    }
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2048))]
        /// Arbitrary bytes never panic the decoders, whatever the op.
        #[test]
        fn garbage_never_panics(op in 0u16..24, body in proptest::collection::vec(any::<u8>(), 0..512), header in proptest::collection::vec(any::<u8>(), 24)) {
            let _ = decode_request(op, &body, 64);
            let mut h = [0u8; HEADER_LEN];
            h.copy_from_slice(&header);
            let _ = Header::decode(&h, 1 << 20);
        }

        /// Whatever decodes, encodes back to the same bytes, for every op
        /// (bodies built from fragments that often decode).
        #[test]
        fn decoded_requests_encode_back_to_their_bytes(
            op in 1u16..23,
            parts in proptest::collection::vec((0u8..4, proptest::collection::vec(any::<u8>(), 0..24)), 0..8),
        ) {
            let mut body = Vec::new();
            for (kind, bytes) in parts {
                match kind {
                    0 => body.extend_from_slice(&(bytes.len() as u16).to_le_bytes()),
                    1 => body.extend_from_slice(&((bytes.len() % 3) as u32).to_le_bytes()),
                    2 => body.extend_from_slice(&(bytes.len() as u64).to_le_bytes()),
                    _ => {}
                }
                body.extend_from_slice(&bytes);
            }
            if let Ok(request) = decode_request(op, &body, 64) {
                prop_assert_eq!(request.op() as u16, op);
                prop_assert_eq!(request.encode(), body);
            }
        }

        /// A batch put round-trips, and any truncation is an error.
        #[test]
        fn batch_put_round_trips(items in proptest::collection::vec((proptest::collection::vec(any::<u8>(), 1..40), proptest::collection::vec(any::<u8>(), 0..100)), 0..10), cut in any::<usize>()) {
            let mut w = Writer::default();
            w.u8(put_flags::DURABLE).u32(items.len() as u32);
            for (k, v) in &items {
                w.key(k).u64(v.len() as u64).bytes(v);
            }
            let decoded = decode_request(Op::BatchPut as u16, &w.buf, 64).unwrap();
            let expected: Vec<(&[u8], &[u8])> = items.iter().map(|(k, v)| (&k[..], &v[..])).collect();
            prop_assert_eq!(decoded, Request::BatchPut { flags: put_flags::DURABLE, items: expected });
            let cut = cut % w.buf.len();
            prop_assert!(decode_request(Op::BatchPut as u16, &w.buf[..cut], 64).is_err());
        }
    }

    proptest! {
        /// Segment requests round-trip; any truncation is an error.
        #[test]
        fn segment_requests_round_trip(
            items in proptest::collection::vec((proptest::collection::vec(any::<u8>(), 1..40), proptest::collection::vec((any::<u64>(), any::<u64>()), 0..6)), 0..6),
            cut in any::<usize>(),
        ) {
            let encoded: Vec<Vec<u8>> = items.iter().map(|(_, s)| SegmentList::encode(s)).collect();
            let items: Vec<SegmentItem<'_>> = items.iter().zip(&encoded).map(|((k, s), e)| {
                let list = SegmentList::new(e).unwrap();
                assert_eq!(list.iter().collect::<Vec<_>>(), *s);
                (&k[..], list)
            }).collect();
            for request in [
                Request::BatchPutShmSegments { buffer: 3, flags: put_flags::MEMORY_ONLY, items: items.clone() },
                Request::BatchGetShmSegments { buffer: 3, items: items.clone() },
            ] {
                let body = request.encode();
                let op = request.op() as u16;
                prop_assert_eq!(decode_request(op, &body, 64).unwrap(), request);
                let cut = cut % body.len();
                prop_assert!(decode_request(op, &body[..cut], 64).is_err());
            }
        }
    }

    proptest! {
        /// The sizes clients cut batches by are the bytes `encode` writes.
        #[test]
        fn sizes_are_what_encode_writes(
            items in proptest::collection::vec((proptest::collection::vec(any::<u8>(), 1..40), proptest::collection::vec(any::<u8>(), 0..100), proptest::collection::vec((any::<u64>(), any::<u64>()), 0..6)), 0..8),
        ) {
            let keys: Vec<&[u8]> = items.iter().map(|(k, _, _)| &k[..]).collect();
            let lists: Vec<Vec<u8>> = items.iter().map(|(_, _, s)| SegmentList::encode(s)).collect();
            let sum = |f: &dyn Fn(usize) -> u64| (0..items.len()).map(f).sum::<u64>();
            let checks: Vec<(Request<'_>, u64)> = vec![
                (
                    Request::BatchPut { flags: 0, items: items.iter().map(|(k, v, _)| (&k[..], &v[..])).collect() },
                    sum(&|i| frame_size::put_item(items[i].0.len(), items[i].1.len() as u64)),
                ),
                (
                    Request::BatchGet { items: keys.iter().map(|k| (*k, 7)).collect() },
                    sum(&|i| frame_size::get_item(items[i].0.len())),
                ),
                (Request::BatchExists { keys: keys.clone() }, sum(&|i| frame_size::key(items[i].0.len()))),
                (Request::PrefixLen { keys: keys.clone() }, sum(&|i| frame_size::key(items[i].0.len()))),
                (
                    Request::BatchPutShm { buffer: 1, flags: 0, items: keys.iter().map(|k| (*k, 1, 2)).collect() },
                    sum(&|i| frame_size::range_item(items[i].0.len())),
                ),
                (
                    Request::BatchGetShm { buffer: 1, items: keys.iter().map(|k| (*k, 1, 2)).collect() },
                    sum(&|i| frame_size::range_item(items[i].0.len())),
                ),
                (
                    Request::BatchPutShmSegments { buffer: 1, flags: 0, items: items.iter().zip(&lists).map(|((k, _, _), s)| (&k[..], SegmentList::new(s).unwrap())).collect() },
                    sum(&|i| frame_size::segment_item(items[i].0.len(), items[i].2.len())),
                ),
                (
                    Request::BatchGetShmSegments { buffer: 1, items: items.iter().zip(&lists).map(|((k, _, _), s)| (&k[..], SegmentList::new(s).unwrap())).collect() },
                    sum(&|i| frame_size::segment_item(items[i].0.len(), items[i].2.len())),
                ),
            ];
            for (request, items_len) in checks {
                let op = request.op();
                prop_assert_eq!(request.encode().len() as u64, frame_size::fixed(op) + items_len, "{:?}", op);
            }
        }
    }

    #[test]
    fn too_many_segments_are_refused() {
        let mut w = Writer::default();
        w.u32(1).u32(1).key(b"k").u32(MAX_SEGMENTS + 1);
        w.bytes(&vec![0; 16 * (MAX_SEGMENTS as usize + 1)]);
        let err = decode_request(Op::BatchGetShmSegments as u16, &w.buf, 64).unwrap_err();
        assert!(err.0.contains("4096"), "{err}");
    }

    #[test]
    fn limits_are_enforced() {
        let mut w = Writer::default();
        w.u32(100_000);
        let err = decode_request(Op::BatchExists as u16, &w.buf, 4096).unwrap_err();
        assert!(err.0.contains("4096-key limit"), "{err}");
        let mut w = Writer::default();
        w.u32(1).u16(300).bytes(&[1; 300]);
        assert!(decode_request(Op::BatchExists as u16, &w.buf, 4096).is_err());
        let header = Header {
            op: 2,
            request_id: 1,
            body_len: 2000,
            status: 0,
        };
        assert!(Header::decode(&header.encode(), 1000).is_err());
        assert!(Header::decode(&header.encode(), 4000).is_ok());
        let mut bad = header.encode();
        bad[0] = b'X';
        assert!(Header::decode(&bad, 4000).is_err());
    }
}
