//! One connection to one kvtier server: the store's batch operations over
//! `tcp://host:port`, `tls://host:port` or `unix:///path` (which adds a
//! registered shared-memory buffer, so values move through shared memory
//! instead of the socket). It knows no routing: `Client` puts cluster
//! routing above it, and the router's peers hold connections.

use kvtier::{Error, ErrorKind, PutOptions, Result};
use kvtier_wire::proof;
use kvtier_wire::protocol::{
    self, code, frame_size, put_flags, Header, HelloReply, Op, Reader, Request, Writer,
};
use kvtier_wire::shm::{self, SharedRegion};
use kvtier_wire::transport::{FrameLimits, FrameRead, ReadError, Transport};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

/// A batch call moving at least this many bytes in all is cut into parts
/// that move at once, each on a connection of its own (and so on a server
/// thread of its own): one connection copies on one core, on both sides.
pub const PARALLEL_FROM: u64 = 8 << 20;

/// What a backend knows of a value's length before reading it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KnownLen {
    /// The value is this long (its index entry says so).
    Len(usize),
    /// No such key (here, now).
    Absent,
    /// Not known without reading it (another member may hold it).
    Unknown,
}

/// Connection options. Defaults: the token from `KVTIER_AUTH_TOKEN` (TCP
/// needs one; a Unix-socket client running as the server's user does
/// not), the empty namespace, 60 s timeout, 256 MiB shared buffer on Unix
/// sockets.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    pub auth_token: Option<String>,
    /// Every key of this client lives in this namespace (see
    /// `kvtier::Store::namespace`): e.g. "llama3-8b/bf16/tp0of2/page64".
    pub namespace: String,
    /// PEM file of the CA that signs the server's certificate, for
    /// `tls://` URLs. Default: `KVTIER_TLS_CA`.
    pub tls_ca: Option<std::path::PathBuf>,
    pub timeout: Duration,
    /// Bytes of shared memory to register on a Unix socket (0: none).
    pub shm_size: usize,
    /// Ask the server to answer from its own store only, never forwarding
    /// to the cluster members that own a key: what cluster peers send
    /// each other (see docs/protocol.md, request flags). Default: false.
    pub local_only: bool,
    /// In cluster mode, send each key straight to the members that own it
    /// (one hop) instead of through the server this client connected to
    /// (two hops for the keys it does not own). The client then learns the
    /// member list from its server (every second) and keeps a connection
    /// to each member. Applies to the socket forms of the batch calls;
    /// the shared-memory forms always go through the local server, which
    /// reads remote values straight into the shared buffer. Default: false.
    pub route: bool,
    /// The cluster member this client means to reach (its node id, from
    /// its signed member record): the challenge names it and the server
    /// must prove it is that member, so a process on a dead member's
    /// address that relays the challenge to a live member is refused
    /// (docs/protocol.md, "Hello"). Needs a token. Default: none.
    pub member: Option<String>,
    /// On a Unix socket, let the server read and write this process's own
    /// memory where the values of the socket forms of the batch calls lie
    /// (cross-memory attach: one copy, between the server's pool and the
    /// caller's buffer, instead of two through the socket), when the
    /// server offers it and the kernel lets it reach this process. Falls
    /// back to the socket otherwise. Default: true.
    pub cross_memory: bool,
    /// On a Unix socket, map the server's memory pool read-only where the
    /// server offers it (a client of its own user, without a tenant's
    /// scope) and copy values held in its memory out of the mapping here,
    /// leased for the copy: one `memcpy` per value, on this thread, the
    /// fastest way a value reaches a caller's buffer (docs/protocol.md,
    /// "Pool mapping"). Values not in the server's memory come as
    /// `cross_memory` or the socket bring them. Default: true.
    pub map_pool: bool,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            auth_token: std::env::var("KVTIER_AUTH_TOKEN")
                .ok()
                .filter(|t| !t.is_empty()),
            namespace: String::new(),
            tls_ca: std::env::var_os("KVTIER_TLS_CA")
                .filter(|p| !p.is_empty())
                .map(Into::into),
            timeout: Duration::from_secs(60),
            shm_size: 256 << 20,
            local_only: false,
            route: false,
            member: None,
            cross_memory: true,
            map_pool: true,
        }
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Tcp(addr) => write!(f, "tcp://{addr}"),
            Endpoint::Tls { addr, .. } => write!(f, "tls://{addr}"),
            Endpoint::Unix(path) => write!(f, "unix://{}", path.display()),
        }
    }
}

#[derive(Debug, Clone)]
enum Endpoint {
    Tcp(String),
    Tls {
        addr: String,
        server_name: rustls_pki_types::ServerName<'static>,
        config: Arc<rustls::ClientConfig>,
    },
    Unix(std::path::PathBuf),
}

/// Connects to the first address `addr` resolves to that answers within
/// `timeout` (a host that is down must not hold a caller for the system's
/// minutes-long connect timeout).
fn connect_within(addr: &str, timeout: Duration) -> std::io::Result<TcpStream> {
    use std::net::ToSocketAddrs;
    let mut last = None;
    for candidate in addr.to_socket_addrs()? {
        match TcpStream::connect_timeout(&candidate, timeout) {
            Ok(stream) => return Ok(stream),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "the address resolves to nothing",
        )
    }))
}

/// A connection to a kvtier server. Not shared between threads: open one
/// per thread. A broken connection is re-established on the next call.
#[derive(Debug)]
pub struct Connection {
    endpoint: Endpoint,
    options: ClientOptions,
    transport: Option<Transport>,
    next_id: u64,
    max_frame: u64,
    max_batch: u32,
    max_value: u64,
    /// The shared buffer, created once and registered again on every
    /// reconnect, so views of it handed out stay on the zero-copy path
    /// across a server restart.
    shm_region: Option<Arc<SharedRegion>>,
    /// Its id on the current connection.
    shm_id: Option<u32>,
    /// The id the server gave this process's own memory (cross-memory
    /// transfers) on the current connection, if it reaches it.
    own_id: Option<u32>,
    /// The server's pool, mapped read-only (MapPool), on the current
    /// connection, if the server offers it.
    pool: Option<Arc<kvtier_wire::shm::PoolView>>,
    /// A descriptor that came with the last reply.
    passed: Option<std::os::fd::OwnedFd>,
    /// ReleaseLease requests sent whose replies are still to be read
    /// (before the next request's: see `release_lease`).
    owed_replies: u32,
    /// Connections made so far: leases and pool offsets belong to one.
    connections: u64,
    /// Reused request and response buffers (they only grow).
    request: Vec<u8>,
    response: Vec<u8>,
}

pub(crate) fn protocol_error(message: impl Into<String>) -> Error {
    Error::new(ErrorKind::Io, message)
}

fn code_error(c: i32, message: &str) -> Error {
    let kind = code::kind(c);
    let detail = if message.is_empty() {
        String::new()
    } else {
        format!(": {message}")
    };
    Error::new(
        kind,
        format!("server answered {} ({c}){detail}", code::name(c)),
    )
}

/// Why one exchange with the server failed, which decides what becomes
/// of the connection.
#[derive(Debug)]
enum CallError {
    /// Sending or receiving failed: the connection is dropped (a call on
    /// one that had been idle is retried once on a new one).
    Transport(Error),
    /// The reply breaks the protocol (wrong id, a table that does not fit
    /// the request): the connection is dropped as for `Transport`.
    Protocol(Error),
    /// The server answered with an error code: the connection is fine.
    Server(Error),
    /// Refused here, before anything was sent.
    Request(Error),
}

impl CallError {
    fn drops_connection(&self) -> bool {
        matches!(self, CallError::Transport(_) | CallError::Protocol(_))
    }
}

impl From<CallError> for Error {
    fn from(e: CallError) -> Error {
        match e {
            CallError::Transport(e)
            | CallError::Protocol(e)
            | CallError::Server(e)
            | CallError::Request(e) => e,
        }
    }
}

fn read_error(e: ReadError) -> CallError {
    match e {
        ReadError::Io(e) => CallError::Transport(Error::io("transport: reading a response", e)),
        ReadError::Protocol(e) => CallError::Protocol(protocol_error(format!("transport: {e}"))),
    }
}

impl Connection {
    /// Connects to `tcp://host:port` or `unix:///path/to.sock`.
    pub fn connect(url: &str) -> Result<Connection> {
        Connection::connect_with(url, ClientOptions::default())
    }

    pub fn connect_with(url: &str, options: ClientOptions) -> Result<Connection> {
        let endpoint = if let Some(addr) = url.strip_prefix("tcp://") {
            Endpoint::Tcp(addr.to_string())
        } else if let Some(addr) = url.strip_prefix("tls://") {
            let Some(ca) = &options.tls_ca else {
                return Err(Error::invalid(format!(
                    "{url} needs the CA certificate that signed the server's: set tls_ca or \
                     KVTIER_TLS_CA to its PEM file"
                )));
            };
            let config = kvtier_wire::tls::client_config(ca)
                .map_err(|e| Error::invalid(format!("TLS for {url}: {e}")))?;
            let host = addr
                .rsplit_once(':')
                .map_or(addr, |(host, _)| host)
                .trim_start_matches('[')
                .trim_end_matches(']');
            let server_name = rustls_pki_types::ServerName::try_from(host.to_string())
                .map_err(|e| Error::invalid(format!("TLS server name {host:?}: {e}")))?;
            Endpoint::Tls {
                addr: addr.to_string(),
                server_name,
                config,
            }
        } else if let Some(path) = url.strip_prefix("unix://") {
            Endpoint::Unix(path.into())
        } else {
            return Err(Error::invalid(format!(
                "unsupported URL {url:?}: use tcp://host:port, tls://host:port or unix:///path"
            )));
        };
        let mut client = Connection {
            endpoint,
            options,
            transport: None,
            next_id: 1,
            max_frame: protocol::DEFAULT_MAX_FRAME,
            max_batch: protocol::DEFAULT_MAX_BATCH,
            max_value: 0,
            shm_region: None,
            shm_id: None,
            own_id: None,
            pool: None,
            passed: None,
            owed_replies: 0,
            connections: 0,
            request: Vec::new(),
            response: Vec::new(),
        };
        client.reconnect()?;
        Ok(client)
    }

    /// A second connection to the same server with the same options,
    /// registering the same shared buffer (so views of it work on either).
    pub fn sibling(&self) -> Result<Connection> {
        let mut client = self.sibling_template();
        client.reconnect()?;
        Ok(client)
    }

    /// This client's settings and shared buffer, without a connection (a
    /// call on it connects first).
    pub(crate) fn sibling_template(&self) -> Connection {
        Connection {
            endpoint: self.endpoint.clone(),
            options: self.options.clone(),
            transport: None,
            next_id: 1,
            max_frame: self.max_frame,
            max_batch: self.max_batch,
            max_value: self.max_value,
            shm_region: self.shm_region.clone(),
            shm_id: None,
            own_id: None,
            pool: None,
            passed: None,
            owed_replies: 0,
            connections: 0,
            request: Vec::new(),
            response: Vec::new(),
        }
    }

    fn reconnect(&mut self) -> Result<()> {
        self.transport = None;
        self.shm_id = None;
        self.own_id = None;
        self.pool = None;
        self.owed_replies = 0;
        self.connections += 1;
        let transport = match &self.endpoint {
            Endpoint::Tcp(addr) => {
                let stream = connect_within(addr, self.options.timeout)
                    .map_err(|e| Error::io(format!("connecting to tcp://{addr}"), e))?;
                stream
                    .set_nodelay(true)
                    .map_err(|e| Error::io("configuring the socket", e))?;
                Transport::Tcp(stream)
            }
            Endpoint::Tls {
                addr,
                server_name,
                config,
            } => {
                let stream = connect_within(addr, self.options.timeout)
                    .map_err(|e| Error::io(format!("connecting to tls://{addr}"), e))?;
                stream
                    .set_nodelay(true)
                    .map_err(|e| Error::io("configuring the socket", e))?;
                let connection =
                    rustls::ClientConnection::new(Arc::clone(config), server_name.clone())
                        .map_err(|e| Error::invalid(format!("TLS for tls://{addr}: {e}")))?;
                Transport::TlsClient(Box::new(rustls::StreamOwned::new(connection, stream)))
            }
            Endpoint::Unix(path) => {
                Transport::Unix(UnixStream::connect(path).map_err(|e| {
                    Error::io(format!("connecting to unix://{}", path.display()), e)
                })?)
            }
        };
        transport
            .set_timeouts(Some(self.options.timeout), Some(self.options.timeout))
            .map_err(|e| Error::io("configuring the socket", e))?;
        self.transport = Some(transport);
        let namespace = self.options.namespace.clone();
        kvtier::validate_namespace(&namespace)?;
        // The token never crosses the wire: the server proves it holds the
        // token first (a forged member or a squatter on a dead member's
        // port cannot), then the hello carries this side's proof.
        let credential = match self.options.auth_token.clone() {
            Some(token) if !token.is_empty() => self.prove_token(token.as_bytes(), &namespace)?,
            _ => Vec::new(),
        };
        let hello = Request::Hello {
            token: &credential,
            namespace: &namespace,
        };
        let len = self.call(Op::Hello, &hello.encode(), None)?;
        let hello = HelloReply::decode(&self.response[..len]).map_err(|e| protocol_error(e.0))?;
        let (max_frame, max_batch, max_value) = (hello.max_frame, hello.max_batch, hello.max_value);
        self.max_frame = max_frame;
        self.max_batch = max_batch;
        self.max_value = max_value;
        if matches!(self.endpoint, Endpoint::Unix(_)) && self.options.shm_size > 0 {
            let region = match &self.shm_region {
                Some(region) => Arc::clone(region),
                None => Arc::new(
                    SharedRegion::create(self.options.shm_size)
                        .map_err(|e| Error::io("creating the shared buffer", e))?,
                ),
            };
            self.shm_region = Some(Arc::clone(&region));
            let register = Request::RegisterBuffer {
                size: region.len() as u64,
            };
            let len = self.call(Op::RegisterBuffer, &register.encode(), region.fd())?;
            let body = &self.response[..len];
            let id = Reader::new(body).u32().map_err(|e| protocol_error(e.0))?;
            self.shm_id = Some(id);
        }
        if self.options.cross_memory
            && matches!(self.endpoint, Endpoint::Unix(_))
            && hello.features & protocol::features::PEER_MEMORY != 0
        {
            self.own_id = self.register_own_memory()?;
        }
        if self.options.map_pool
            && matches!(self.endpoint, Endpoint::Unix(_))
            && hello.features & protocol::features::POOL_MAP != 0
        {
            self.pool = self.map_server_pool()?;
        }
        Ok(())
    }

    /// Maps the server's pool read-only (MapPool). `None` where the server
    /// refuses it or its descriptor does not map as a pool should: values
    /// then come by the other paths.
    fn map_server_pool(&mut self) -> Result<Option<Arc<kvtier_wire::shm::PoolView>>> {
        self.passed = None;
        match self.exchange(Op::MapPool, &[], None) {
            Ok(len) => {
                let pool_len = Reader::new(&self.response[..len])
                    .u64()
                    .map_err(|e| protocol_error(e.0))?;
                let Some(fd) = self.passed.take() else {
                    return Err(protocol_error(
                        "transport: the server's MapPool reply carried no descriptor",
                    ));
                };
                match crate::pool_views::view_of(fd, pool_len) {
                    Ok(view) => Ok(Some(view)),
                    Err(e) => {
                        tracing::warn!(error = %e, "the server's pool does not map here; values come by the socket or cross-memory transfers");
                        Ok(None)
                    }
                }
            }
            Err(CallError::Server(e)) => {
                tracing::debug!(error = %e, "the server does not let this client map its pool");
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Whether values in the server's memory are copied out of a mapping of
    /// its pool by this client (see `ClientOptions::map_pool`).
    pub fn maps_pool(&self) -> bool {
        self.pool.is_some()
    }

    /// Asks the server to reach this process's memory directly: it must
    /// read back a random probe at the probe's address. `None` where it
    /// cannot (the kernel does not let it, the server is set not to): the
    /// socket carries the values then.
    fn register_own_memory(&mut self) -> Result<Option<u32>> {
        let nonce = proof::nonce().map_err(|e| Error::io("drawing a probe", e))?;
        let probe: [u8; protocol::PEER_PROBE_LEN] = nonce[..protocol::PEER_PROBE_LEN]
            .try_into()
            .expect("a nonce is longer than a probe");
        let request = Request::RegisterPeerMemory {
            address: probe.as_ptr() as u64,
            probe: &probe,
        };
        match self.exchange(Op::RegisterPeerMemory, &[&request.encode()], None) {
            Ok(len) => {
                let id = Reader::new(&self.response[..len])
                    .u32()
                    .map_err(|e| protocol_error(e.0))?;
                Ok(Some(id))
            }
            Err(CallError::Server(e)) => {
                tracing::debug!(error = %e, "the server does not reach this process's memory; values travel over the socket");
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Whether the server reads and writes this process's memory for the
    /// socket forms of the batch calls (see `ClientOptions::cross_memory`).
    pub fn cross_memory(&self) -> bool {
        self.own_id.is_some()
    }

    /// The challenge half of the hello: checks the server's proof of the
    /// token and returns this side's proof for the hello.
    fn prove_token(&mut self, token: &[u8], namespace: &str) -> Result<Vec<u8>> {
        let key = proof::TokenKey::new(token);
        let client_nonce = proof::nonce().map_err(|e| Error::io("drawing a nonce", e))?;
        let member = self.options.member.clone();
        if let Some(member) = &member {
            if member.is_empty() || member.len() > proof::MAX_MEMBER_ID_LEN {
                return Err(Error::invalid(format!(
                    "a member id of {} bytes (1 to {})",
                    member.len(),
                    proof::MAX_MEMBER_ID_LEN
                )));
            }
        }
        let token_id = key.id();
        let challenge = Request::Challenge {
            client_nonce: &client_nonce,
            token_id: &token_id,
            member: member.as_deref(),
        };
        let len = self.call(Op::Challenge, &challenge.encode(), None)?;
        let body = &self.response[..len];
        let fixed = proof::NONCE_LEN + proof::PROOF_LEN;
        let stated = match &member {
            None if body.len() == fixed => None,
            Some(_) if body.len() > fixed + 2 => {
                let mut r = Reader::new(&body[fixed..]);
                let id_len = usize::from(r.u16().map_err(|e| protocol_error(e.0))?);
                let id = r.bytes(id_len).map_err(|e| protocol_error(e.0))?;
                r.finish().map_err(|e| protocol_error(e.0))?;
                Some(String::from_utf8_lossy(id).into_owned())
            }
            _ => {
                return Err(protocol_error(format!(
                    "a challenge answer of {} bytes{}",
                    body.len(),
                    if member.is_some() {
                        " without the member id it was asked for"
                    } else {
                        ""
                    }
                )))
            }
        };
        let server_nonce: [u8; proof::NONCE_LEN] = body[..proof::NONCE_LEN]
            .try_into()
            .expect("NONCE_LEN bytes");
        let expected = match &stated {
            None => key.server_proof(&client_nonce, &server_nonce),
            Some(id) => key.server_proof_as(&client_nonce, &server_nonce, id),
        };
        if !proof::proofs_equal(&body[proof::NONCE_LEN..fixed], &expected) {
            return Err(Error::new(
                code::kind(code::UNAUTHORIZED),
                format!(
                    "{} did not prove it holds the auth token (not a server of this \
                     deployment, or one with another token); the hello was not sent",
                    self.endpoint
                ),
            ));
        }
        match (&member, &stated) {
            (Some(meant), Some(id)) if meant != id => Err(Error::new(
                code::kind(code::UNAUTHORIZED),
                format!(
                    "{} answered as cluster member {id:?}, not {meant:?}, the member this \
                     client dialled (a process relaying another member, or a stale member \
                     record); the hello was not sent",
                    self.endpoint
                ),
            )),
            (Some(meant), _) => Ok(key
                .client_proof_for(&client_nonce, &server_nonce, namespace, meant)
                .to_vec()),
            (None, _) => Ok(key
                .client_proof(&client_nonce, &server_nonce, namespace)
                .to_vec()),
        }
    }

    /// Sends one request and returns the response body's length; the body
    /// is `self.response[..len]`.
    fn call(&mut self, op: Op, body: &[u8], fd: Option<i32>) -> Result<usize> {
        self.call_parts(op, &[body], fd)
    }

    /// [`call`](Self::call) with the body given as parts laid end to end
    /// (sent with vectored writes: values go from the caller's memory to
    /// the socket with no copy into a request buffer).
    fn call_parts(&mut self, op: Op, body: &[&[u8]], fd: Option<i32>) -> Result<usize> {
        let fresh = self.transport.is_none();
        if fresh {
            self.reconnect()?;
        }
        // Which of the connection's buffers a shared-memory request names.
        let own = self.own_id.is_some_and(|id| {
            body.first()
                .is_some_and(|b| b.starts_with(&id.to_le_bytes()))
        });
        let result = self.exchange(op, body, fd);
        match &result {
            Err(e) if e.drops_connection() => {
                self.transport = None;
                self.shm_id = None;
                self.own_id = None;
                // A connection that had been idle may have died with its
                // server (a restart): reconnect and send once more. Every
                // operation is safe to repeat (a put stores the same bytes
                // again); a challenge, hello or buffer registration is part
                // of reconnecting itself (retrying one would reconnect
                // within the reconnect, without end). Shared-memory requests start with the
                // buffer's id, which the new connection assigns afresh.
                if fresh
                    || matches!(
                        op,
                        Op::Challenge | Op::Hello | Op::RegisterBuffer | Op::RegisterPeerMemory
                    )
                {
                    return result.map_err(Error::from);
                }
                self.reconnect()?;
                let shm_op = matches!(
                    op,
                    Op::BatchPutShm
                        | Op::BatchGetShm
                        | Op::BatchPutShmSegments
                        | Op::BatchGetShmSegments
                );
                let retried = if shm_op {
                    let mut again = body.concat();
                    again[..4].copy_from_slice(&self.buffer_id(own)?.to_le_bytes());
                    self.exchange(op, &[&again], fd)
                } else {
                    self.exchange(op, body, fd)
                };
                if retried.as_ref().is_err_and(CallError::drops_connection) {
                    self.transport = None;
                    self.shm_id = None;
                    self.own_id = None;
                }
                retried.map_err(Error::from)
            }
            _ => result.map_err(Error::from),
        }
    }

    fn exchange(
        &mut self,
        op: Op,
        body: &[&[u8]],
        fd: Option<i32>,
    ) -> std::result::Result<usize, CallError> {
        let body_len: usize = body.iter().map(|p| p.len()).sum();
        if body_len as u64 > self.max_frame {
            return Err(CallError::Request(Error::invalid(format!(
                "request of {body_len} bytes exceeds the server's {}-byte frame limit; split the batch",
                self.max_frame
            ))));
        }
        let id = self.send_request(op, body, fd)?;
        let transport = self.transport.as_mut().expect("connected");
        let read = transport.read_frame(
            &mut self.response,
            &FrameLimits::client(self.max_frame + 64, self.options.timeout),
        );
        match read {
            Ok(FrameRead::Frame { header, fd }) => {
                self.passed = fd;
                let len = header.body_len as usize;
                if header.status != code::OK {
                    return Err(CallError::Server(code_error(
                        header.status,
                        &String::from_utf8_lossy(&self.response[..len]),
                    )));
                }
                if header.request_id != id || header.op != op as u16 {
                    return Err(CallError::Protocol(protocol_error(
                        "transport: response does not match the request",
                    )));
                }
                Ok(len)
            }
            Ok(_) => Err(CallError::Transport(protocol_error(
                "transport: the server closed the connection",
            ))),
            Err(e) => Err(read_error(e)),
        }
    }

    /// Sends one request frame; returns its id.
    fn send_request(
        &mut self,
        op: Op,
        body: &[&[u8]],
        fd: Option<i32>,
    ) -> std::result::Result<u64, CallError> {
        self.read_owed_replies()?;
        let id = self.next_id;
        self.next_id += 1;
        let header = Header {
            op: op as u16,
            request_id: id,
            body_len: body.iter().map(|p| p.len()).sum::<usize>() as u32,
            status: if self.options.local_only {
                protocol::request_flags::LOCAL_ONLY
            } else {
                0
            },
        };
        let transport = self.transport.as_mut().expect("connected");
        let sent = match (transport as &mut Transport, fd) {
            (Transport::Unix(stream), Some(fd)) => {
                let mut frame = header.encode().to_vec();
                for part in body {
                    frame.extend_from_slice(part);
                }
                shm::send_with_fd(stream, &frame, fd)
            }
            (transport, _) => {
                let head = header.encode();
                let mut parts = Vec::with_capacity(1 + body.len());
                parts.push(&head[..]);
                parts.extend_from_slice(body);
                transport.write_all_parts(&parts)
            }
        };
        sent.map_err(|e| CallError::Transport(Error::io("transport: sending a request", e)))?;
        Ok(id)
    }

    /// A BatchGet exchange whose values are read from the socket straight
    /// into `bufs` (no copy through the response buffer): the header and
    /// the per-key table first, then each value into its segments. A reply
    /// that does not fit the request drops the connection.
    /// Sends one BatchGet frame and reads its answer: per key the code and
    /// length of the reply's table (OK values read into their buffers).
    fn exchange_get(
        &mut self,
        body: &[u8],
        bufs: &mut [&mut [&mut [u8]]],
    ) -> std::result::Result<Vec<(i32, u64)>, CallError> {
        if body.len() as u64 > self.max_frame {
            return Err(CallError::Request(Error::invalid(format!(
                "request of {} bytes exceeds the server's {}-byte frame limit; split the batch",
                body.len(),
                self.max_frame
            ))));
        }
        let id = self.send_request(Op::BatchGet, &[body], None)?;
        let stall = self.options.timeout;
        let max_body = self.max_frame + 64;
        let transport = self.transport.as_mut().expect("connected");
        let read =
            |t: &mut Transport, buf: &mut [u8]| t.read_exact_within(buf, stall).map_err(read_error);
        let mut head = [0u8; protocol::HEADER_LEN];
        read(transport, &mut head)?;
        let header = Header::decode(&head, max_body)
            .map_err(|e| CallError::Protocol(protocol_error(format!("transport: {e}"))))?;
        let len = header.body_len as usize;
        if header.status != code::OK {
            self.response.resize(len.max(self.response.len()), 0);
            read(transport, &mut self.response[..len])?;
            return Err(CallError::Server(code_error(
                header.status,
                &String::from_utf8_lossy(&self.response[..len]),
            )));
        }
        if header.request_id != id || header.op != Op::BatchGet as u16 {
            return Err(CallError::Protocol(protocol_error(
                "transport: response does not match the request",
            )));
        }
        let table_len = 4 + 12 * bufs.len();
        if len < table_len {
            return Err(CallError::Protocol(protocol_error(
                "transport: response too short for its table",
            )));
        }
        self.response.resize(table_len.max(self.response.len()), 0);
        read(transport, &mut self.response[..table_len])?;
        let mut r = Reader::new(&self.response[..table_len]);
        let parsed =
            (|| -> std::result::Result<(usize, Vec<(i32, u64)>), protocol::ProtocolError> {
                let n = r.u32()? as usize;
                let table = (0..bufs.len())
                    .map(|_| Ok((r.i32()?, r.u64()?)))
                    .collect::<std::result::Result<Vec<_>, protocol::ProtocolError>>()?;
                Ok((n, table))
            })();
        let (n, table) = parsed
            .map_err(|e| CallError::Protocol(protocol_error(format!("transport: {}", e.0))))?;
        let values: u64 = table
            .iter()
            .filter(|(c, _)| *c == code::OK)
            .map(|(_, l)| *l)
            .sum();
        let fits = table.iter().zip(bufs.iter()).all(|((c, l), b)| {
            *c != code::OK || *l <= b.iter().map(|s| s.len() as u64).sum::<u64>()
        });
        if n != bufs.len() || table_len as u64 + values != len as u64 || !fits {
            return Err(CallError::Protocol(protocol_error(
                "transport: response does not fit the request",
            )));
        }
        for ((c, value_len), buf) in table.iter().zip(bufs.iter_mut()) {
            if *c == code::OK {
                let mut left = *value_len as usize;
                for segment in buf.iter_mut() {
                    let take = segment.len().min(left);
                    read(transport, &mut segment[..take])?;
                    left -= take;
                }
            }
        }
        Ok(table)
    }

    /// One item per key.
    pub(crate) fn check_batch_pairs(keys: usize, items: usize, what: &str) -> Result<()> {
        if keys != items {
            return Err(Error::invalid(format!(
                "batch has {keys} keys but {items} {what}"
            )));
        }
        Ok(())
    }

    /// Splits a batch into runs the server takes in one frame each: at most
    /// `max_batch` items, and `fixed` plus the items' `sizes` within
    /// `max_frame`. An item too large for a frame alone gets a run of its
    /// own (and fails on its own). Callers see one batch: results come back
    /// per key, in order.
    fn runs(&self, sizes: impl Iterator<Item = u64>, fixed: u64) -> Vec<std::ops::Range<usize>> {
        let mut runs = Vec::new();
        let (mut start, mut bytes, mut end) = (0usize, fixed, 0usize);
        for (i, size) in sizes.enumerate() {
            let full = i - start >= self.max_batch as usize
                || (i > start && bytes.saturating_add(size) > self.max_frame);
            if full {
                runs.push(start..i);
                start = i;
                bytes = fixed;
            }
            bytes = bytes.saturating_add(size);
            end = i + 1;
        }
        if end > start {
            runs.push(start..end);
        }
        runs
    }

    /// Whether a run of one item is too large for any frame.
    fn oversized(&self, size: u64, fixed: u64) -> bool {
        size.saturating_add(fixed) > self.max_frame
    }

    /// Sends a batch as `runs` of it, one `frame` call each, and joins the
    /// per-key results in order.
    fn in_runs<T>(
        &mut self,
        sizes: impl Iterator<Item = u64>,
        fixed: u64,
        mut frame: impl FnMut(&mut Self, std::ops::Range<usize>) -> Result<Vec<T>>,
    ) -> Result<Vec<T>> {
        let mut out = Vec::new();
        for run in self.runs(sizes, fixed) {
            out.extend(frame(self, run)?);
        }
        Ok(out)
    }

    /// The server's ClusterView answer: its member list in cluster mode,
    /// `{"enabled": false}` otherwise (docs/protocol.md).
    pub fn cluster_view(&mut self) -> Result<serde_json::Value> {
        let len = self.call(Op::ClusterView, &[], None)?;
        serde_json::from_slice(&self.response[..len])
            .map_err(|e| protocol_error(format!("the cluster view is not JSON: {e}")))
    }

    /// Largest value the server accepts.
    pub fn max_value(&self) -> u64 {
        self.max_value
    }

    pub fn batch_put<K: AsRef<[u8]>, V: AsRef<[u8]>>(
        &mut self,
        keys: &[K],
        values: &[V],
    ) -> Result<Vec<Result<()>>> {
        self.batch_put_with(keys, values, &PutOptions::default())
    }

    /// Puts each value (sent inline in the frame). Per-key results.
    pub fn batch_put_with<K: AsRef<[u8]>, V: AsRef<[u8]>>(
        &mut self,
        keys: &[K],
        values: &[V],
        options: &PutOptions,
    ) -> Result<Vec<Result<()>>> {
        let values: Vec<[&[u8]; 1]> = values.iter().map(|v| [v.as_ref()]).collect();
        let values: Vec<&[&[u8]]> = values.iter().map(|v| &v[..]).collect();
        self.batch_put_segments(keys, &values, options)
    }

    /// Puts each value given as segments laid end to end (gathered into
    /// the frame as it is built). Per-key results.
    pub fn batch_put_segments<K: AsRef<[u8]>>(
        &mut self,
        keys: &[K],
        values: &[&[&[u8]]],
        options: &PutOptions,
    ) -> Result<Vec<Result<()>>> {
        Self::check_batch_pairs(keys.len(), values.len(), "values")?;
        if self.own_id.is_some() {
            // The server reads the values where they lie, while this call
            // (which borrows them) waits for its reply.
            let segments: Vec<Vec<(u64, u64)>> = values
                .iter()
                .map(|v| {
                    v.iter()
                        .map(|s| (s.as_ptr() as u64, s.len() as u64))
                        .collect()
                })
                .collect();
            let fixed = frame_size::fixed(Op::BatchPutShmSegments);
            return self.in_runs(segment_sizes(keys, &segments), fixed, |c, run| {
                c.put_segments_frame(true, &keys[run.clone()], &segments[run], options)
            });
        }
        let sizes: Vec<u64> = keys
            .iter()
            .zip(values)
            .map(|(k, v)| {
                frame_size::put_item(k.as_ref().len(), v.iter().map(|s| s.len() as u64).sum())
            })
            .collect();
        let fixed = frame_size::fixed(Op::BatchPut);
        self.in_runs(sizes.iter().copied(), fixed, |c, run| {
            if run.len() == 1 && c.oversized(sizes[run.start], fixed) {
                let value_len: u64 = values[run.start].iter().map(|s| s.len() as u64).sum();
                return Ok(vec![Err(Error::invalid(format!(
                    "value of {value_len} bytes does not fit the server's {}-byte frame",
                    c.max_frame
                )))]);
            }
            c.put_frame(&keys[run.clone()], &values[run], options)
        })
    }

    /// One BatchPut frame.
    fn put_frame<K: AsRef<[u8]>>(
        &mut self,
        keys: &[K],
        values: &[&[&[u8]]],
        options: &PutOptions,
    ) -> Result<Vec<Result<()>>> {
        // The keys and lengths go in the reused request buffer; the values
        // are sent from the caller's memory (vectored writes, no copy).
        let mut w = Writer {
            buf: std::mem::take(&mut self.request),
        };
        w.buf.clear();
        w.u8(put_flags::encode(options)).u32(keys.len() as u32);
        let mut ends = Vec::with_capacity(keys.len());
        for (k, v) in keys.iter().zip(values) {
            if let Err(e) = check_key(k.as_ref()) {
                self.request = w.buf;
                return Err(e);
            }
            w.key(k.as_ref())
                .u64(v.iter().map(|s| s.len() as u64).sum());
            ends.push(w.buf.len());
        }
        let mut parts: Vec<&[u8]> = Vec::with_capacity(2 * keys.len() + 1);
        let mut start = 0;
        for (end, value) in ends.into_iter().zip(values) {
            parts.push(&w.buf[start..end]);
            parts.extend(value.iter().filter(|s| !s.is_empty()));
            start = end;
        }
        let sent = self.call_parts(Op::BatchPut, &parts, None);
        drop(parts);
        self.request = w.buf;
        let len = sent?;
        let body = &self.response[..len];
        put_results(body, keys.len())
    }

    /// The value under `key`, or `None`: one round trip, sized by the reply.
    pub fn get(&mut self, key: impl AsRef<[u8]>) -> Result<Option<Vec<u8>>> {
        let get = Request::BatchGet {
            items: vec![(check_key(key.as_ref())?, self.max_value)],
        };
        let len = self.call(Op::BatchGet, &get.encode(), None)?;
        let mut r = Reader::new(&self.response[..len]);
        let parse =
            |r: &mut Reader<'_>| -> std::result::Result<(u32, i32, u64), protocol::ProtocolError> {
                Ok((r.u32()?, r.i32()?, r.u64()?))
            };
        let (n, c, value_len) = parse(&mut r).map_err(|e| protocol_error(e.0))?;
        if n != 1 {
            return Err(protocol_error("response has the wrong number of results"));
        }
        match c {
            code::OK => Ok(Some(
                r.bytes(value_len as usize)
                    .map_err(|e| protocol_error(e.0))?
                    .to_vec(),
            )),
            code::NOT_FOUND => Ok(None),
            c => Err(code_error(c, "")),
        }
    }

    /// Gets each value into its buffer: `Some(n)` bytes, `None` for a miss.
    pub fn batch_get_into<K: AsRef<[u8]>>(
        &mut self,
        keys: &[K],
        bufs: &mut [&mut [u8]],
    ) -> Result<Vec<Result<Option<usize>>>> {
        let mut one: Vec<[&mut [u8]; 1]> = bufs.iter_mut().map(|b| [&mut b[..]]).collect();
        let mut segments: Vec<&mut [&mut [u8]]> = one.iter_mut().map(|b| &mut b[..]).collect();
        self.batch_get_segments(keys, &mut segments)
    }

    /// Gets each value scattered across its segments, in order.
    pub fn batch_get_segments<K: AsRef<[u8]>>(
        &mut self,
        keys: &[K],
        bufs: &mut [&mut [&mut [u8]]],
    ) -> Result<Vec<Result<Option<usize>>>> {
        Self::check_batch_pairs(keys.len(), bufs.len(), "buffers")?;
        let results = self.get_leased(keys, bufs, 1)?;
        answer_rest(results, keys, bufs, |keys, bufs| {
            self.get_segments_unleased(keys, bufs)
        })
    }

    /// Copies the values the server holds in memory out of its mapped
    /// pool (see `ClientOptions::map_pool`): all keys leased first, in as
    /// few requests as frames allow, then copied, on up to `copiers`
    /// threads once the batch is `PARALLEL_FROM` bytes or more, then
    /// released. Leasing first keeps the server out of the copy: a lease
    /// asked for while this host's cores copy waits for the server's
    /// thread to be scheduled (measured: 1.6 ms of a 2.7 ms batch).
    /// `Some` per key copied; `None` for keys to get otherwise (no memory
    /// copy, a buffer too small, a refused lease, no mapping, no room).
    pub fn get_leased<K: AsRef<[u8]>>(
        &mut self,
        keys: &[K],
        bufs: &mut [&mut [&mut [u8]]],
        copiers: usize,
    ) -> Result<Vec<Option<Result<Option<usize>>>>> {
        Self::check_batch_pairs(keys.len(), bufs.len(), "buffers")?;
        let mut results: Vec<Option<Result<Option<usize>>>> = keys.iter().map(|_| None).collect();
        if self.pool.is_none() || !bufs.iter().any(|b| b.iter().any(|s| !s.is_empty())) {
            return Ok(results);
        }
        let sizes = keys
            .iter()
            .map(|k| frame_size::get_item(k.as_ref().len()).max(frame_size::LEASE_REPLY_ITEM));
        let mut leases = Vec::new();
        let mut copies: Vec<LeasedCopy> = Vec::new();
        let mut connection = self.connections;
        for run in self.runs(sizes, frame_size::fixed(Op::LeaseValues) + 8) {
            let leased = match self.lease_run(&keys[run.clone()], &bufs[run.clone()]) {
                Ok(leased) => leased,
                Err(e) => {
                    // Leases of earlier frames end now (a dropped
                    // connection ends them anyway).
                    for lease in leases {
                        self.release_lease(lease);
                    }
                    return Err(e);
                }
            };
            if self.connections != connection {
                if !leases.is_empty() {
                    // The connection was made again for this frame (its
                    // first died): the earlier frames' leases ended with
                    // it, and their offsets may name reused extents, or
                    // another server's pool. Nothing is copied; every key
                    // is got the other ways (this frame's lease, on the
                    // new connection, ends now).
                    if let Some((lease, _)) = leased {
                        self.release_lease(lease);
                    }
                    return Ok(results);
                }
                connection = self.connections;
            }
            let Some((lease, leased)) = leased else {
                continue;
            };
            if !leased.is_empty() {
                leases.push(lease);
            }
            copies.extend(
                leased
                    .into_iter()
                    .map(|(i, offset, len)| (run.start + i, offset, len)),
            );
        }
        let copied = match &self.pool {
            Some(pool) => copy_leased(pool, &copies, bufs, copiers),
            None => Err(std::io::Error::other(
                "values leased on a connection without the pool mapped",
            )),
        };
        for lease in leases {
            self.release_lease(lease);
        }
        copied.map_err(|e| {
            self.transport = None;
            protocol_error(format!("transport: {e}"))
        })?;
        for &(i, _, len) in &copies {
            results[i] = Some(Ok(Some(len as usize)));
        }
        Ok(results)
    }

    /// Leases one frame's keys: the lease and the keys leased, as (index
    /// in the run, offset, length). `None` when the lease was refused as a
    /// whole (LIMIT past the leasing budget, or a server reconnected into
    /// that does not lease): the usual gets answer then.
    fn lease_run<K: AsRef<[u8]>>(
        &mut self,
        keys: &[K],
        bufs: &[&mut [&mut [u8]]],
    ) -> Result<Option<(u64, Vec<LeasedCopy>)>> {
        let items = keys
            .iter()
            .zip(bufs.iter())
            .map(|(k, b)| {
                Ok((
                    check_key(k.as_ref())?,
                    b.iter().map(|s| s.len() as u64).sum(),
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let body = Request::LeaseValues { items }.encode();
        let len = match self.call(Op::LeaseValues, &body, None) {
            Ok(len) => len,
            Err(e) if self.transport.is_some() => {
                tracing::debug!(error = %e, "values not leased; getting them");
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        let (lease, table) = protocol::decode_lease_reply(&self.response[..len], keys.len())
            .map_err(|e| protocol_error(format!("transport: {e}")))?;
        Ok(Some((
            lease,
            table
                .iter()
                .enumerate()
                .filter(|(_, item)| item.code == code::OK)
                .map(|(i, item)| (i, item.offset, item.len))
                .collect(),
        )))
    }

    /// Ends lease `lease` without waiting for the server's answer: the
    /// request goes now (the server ends the lease as soon as it reads
    /// it), and its reply, which can only be OK, is read before the next
    /// request's. A round trip saved per leased batch, which on a busy
    /// host waits for the server's thread to be scheduled. A connection
    /// that fails here is dropped, which ends its leases too.
    fn release_lease(&mut self, lease: u64) {
        if self.transport.is_none() {
            return;
        }
        let body = Request::ReleaseLease { lease }.encode();
        match self.send_request(Op::ReleaseLease, &[&body], None) {
            Ok(_) => self.owed_replies += 1,
            Err(_) => self.transport = None,
        }
    }

    /// Reads the replies `release_lease` left on the connection.
    fn read_owed_replies(&mut self) -> std::result::Result<(), CallError> {
        while self.owed_replies > 0 {
            let transport = self.transport.as_mut().expect("connected");
            let read = transport.read_frame(
                &mut self.response,
                &FrameLimits::client(self.max_frame + 64, self.options.timeout),
            );
            match read {
                Ok(FrameRead::Frame { header, .. })
                    if header.op == Op::ReleaseLease as u16 && header.status == code::OK =>
                {
                    self.owed_replies -= 1;
                }
                Ok(_) => {
                    return Err(CallError::Protocol(protocol_error(
                        "transport: a lease's release was not answered OK",
                    )))
                }
                Err(e) => return Err(read_error(e)),
            }
        }
        Ok(())
    }

    /// Gets each value with the batch get ops: from this process's memory
    /// by cross-memory transfer where the server reaches it, else over the
    /// socket (never leased: for keys `get_leased` left).
    pub fn get_segments_unleased<K: AsRef<[u8]>>(
        &mut self,
        keys: &[K],
        bufs: &mut [&mut [&mut [u8]]],
    ) -> Result<Vec<Result<Option<usize>>>> {
        if self.own_id.is_some() && bufs.iter().any(|b| b.iter().any(|s| !s.is_empty())) {
            // The server writes the values where they go, while this call
            // (which borrows the buffers mutably) waits for its reply.
            let segments: Vec<Vec<(u64, u64)>> = bufs
                .iter_mut()
                .map(|b| {
                    b.iter_mut()
                        .map(|s| (s.as_mut_ptr() as u64, s.len() as u64))
                        .collect()
                })
                .collect();
            let fixed = frame_size::fixed(Op::BatchGetShmSegments);
            return self.in_runs(segment_sizes(keys, &segments), fixed, |c, run| {
                c.get_segments_frame(true, &keys[run.clone()], &segments[run])
            });
        }
        // Each reply carries up to its buffers' capacity in values.
        let sizes: Vec<u64> = bufs
            .iter()
            .zip(keys)
            .map(|(b, k)| {
                let capacity: u64 = b.iter().map(|s| s.len() as u64).sum();
                frame_size::get_reply_item(capacity).max(frame_size::get_item(k.as_ref().len()))
            })
            .collect();
        let fixed = frame_size::fixed(Op::BatchGet);
        let table = self.in_runs(sizes.into_iter(), fixed, |c, run| {
            c.get_frame(&keys[run.clone()], &mut bufs[run])
        })?;
        Ok(table
            .into_iter()
            .zip(bufs.iter())
            .map(|((c, value_len), buf)| match c {
                code::OK => Ok(Some(value_len as usize)),
                code::NOT_FOUND => Ok(None),
                code::BUFFER_TOO_SMALL if value_len > 0 => Err(Error::buffer_too_small(
                    value_len,
                    buf.iter().map(|s| s.len() as u64).sum(),
                )),
                c => Err(code_error(c, "")),
            })
            .collect())
    }

    /// What each key's value takes, learned without moving any value: a
    /// get with no room, which a server answers per key NOT_FOUND (absent)
    /// or BUFFER_TOO_SMALL with the value's length. A server that does not
    /// say the length (before this was in the protocol) leaves the key
    /// `Unknown`; so does any other answer.
    pub fn batch_value_lens<K: AsRef<[u8]>>(&mut self, keys: &[K]) -> Result<Vec<KnownLen>> {
        let mut none: Vec<[&mut [u8]; 0]> = keys.iter().map(|_| []).collect();
        let mut bufs: Vec<&mut [&mut [u8]]> = none.iter_mut().map(|b| &mut b[..]).collect();
        let sizes = keys
            .iter()
            .map(|k| frame_size::get_reply_item(0).max(frame_size::get_item(k.as_ref().len())));
        let table = self.in_runs(sizes, frame_size::fixed(Op::BatchGet), |c, run| {
            c.get_frame(&keys[run.clone()], &mut bufs[run])
        })?;
        Ok(table
            .into_iter()
            .map(|(c, value_len)| match c {
                code::NOT_FOUND => KnownLen::Absent,
                code::OK => KnownLen::Len(value_len as usize),
                code::BUFFER_TOO_SMALL if value_len > 0 => KnownLen::Len(value_len as usize),
                _ => KnownLen::Unknown,
            })
            .collect())
    }

    /// One BatchGet frame; a transport failure on a connection that was
    /// idle is retried once on a new one, as `call` does.
    fn get_frame<K: AsRef<[u8]>>(
        &mut self,
        keys: &[K],
        bufs: &mut [&mut [&mut [u8]]],
    ) -> Result<Vec<(i32, u64)>> {
        let items = keys
            .iter()
            .zip(bufs.iter())
            .map(|(k, b)| {
                Ok((
                    check_key(k.as_ref())?,
                    b.iter().map(|s| s.len() as u64).sum(),
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let body = Request::BatchGet { items }.encode();
        let fresh = self.transport.is_none();
        if fresh {
            self.reconnect()?;
        }
        let result = self.exchange_get(&body, bufs);
        match &result {
            Err(e) if e.drops_connection() => {
                self.transport = None;
                self.shm_id = None;
                self.own_id = None;
                if fresh {
                    return result.map_err(Error::from);
                }
                self.reconnect()?;
                let retried = self.exchange_get(&body, bufs);
                if retried.as_ref().is_err_and(CallError::drops_connection) {
                    self.transport = None;
                    self.shm_id = None;
                    self.own_id = None;
                }
                retried.map_err(Error::from)
            }
            _ => result.map_err(Error::from),
        }
    }

    /// The registered shared buffer (Unix sockets only): place values here
    /// and use the `_registered` calls to move them without socket copies.
    pub fn registered_buffer(&mut self) -> Option<&mut [u8]> {
        let region = self.shm_region.as_ref()?;
        // SAFETY: the whole region, borrowed mutably through `&mut self`;
        // other handles from `registered_region` share the memory by
        // design (it is shared with the server too), as documented there.
        unsafe { region.range_mut(0, region.len() as u64) }
    }

    /// The registered shared region itself, for callers that hand out views
    /// of it (the Python binding's `alloc_buffer`). Writes through such views
    /// race with this client's calls unless the caller orders them.
    pub fn registered_region(&self) -> Option<Arc<SharedRegion>> {
        self.shm_region.clone()
    }

    /// Puts values already in the registered buffer, given as
    /// `(offset, len)` ranges.
    pub fn batch_put_registered<K: AsRef<[u8]>>(
        &mut self,
        keys: &[K],
        ranges: &[(u64, u64)],
        options: &PutOptions,
    ) -> Result<Vec<Result<()>>> {
        Self::check_batch_pairs(keys.len(), ranges.len(), "ranges")?;
        self.in_runs(
            range_sizes(keys),
            frame_size::fixed(Op::BatchPutShm),
            |c, run| c.put_registered_frame(&keys[run.clone()], &ranges[run], options),
        )
    }

    fn put_registered_frame<K: AsRef<[u8]>>(
        &mut self,
        keys: &[K],
        ranges: &[(u64, u64)],
        options: &PutOptions,
    ) -> Result<Vec<Result<()>>> {
        let id = self.shm_id()?;
        let put = Request::BatchPutShm {
            buffer: id,
            flags: put_flags::encode(options),
            items: range_items(keys, ranges)?,
        };
        let len = self.call(Op::BatchPutShm, &put.encode(), None)?;
        let body = &self.response[..len];
        put_results(body, keys.len())
    }

    /// Puts values gathered by the server from `(offset, len)` segments of
    /// the registered buffer (Mooncake's multi-buffer put, no client copy).
    pub fn batch_put_registered_segments<K: AsRef<[u8]>>(
        &mut self,
        keys: &[K],
        segments: &[Vec<(u64, u64)>],
        options: &PutOptions,
    ) -> Result<Vec<Result<()>>> {
        Self::check_batch_pairs(keys.len(), segments.len(), "segment lists")?;
        let fixed = frame_size::fixed(Op::BatchPutShmSegments);
        self.in_runs(segment_sizes(keys, segments), fixed, |c, run| {
            c.put_segments_frame(false, &keys[run.clone()], &segments[run], options)
        })
    }

    /// A BatchPutShmSegments frame: ranges of the registered buffer, or
    /// (`own`) addresses of this process's memory.
    fn put_segments_frame<K: AsRef<[u8]>>(
        &mut self,
        own: bool,
        keys: &[K],
        segments: &[Vec<(u64, u64)>],
        options: &PutOptions,
    ) -> Result<Vec<Result<()>>> {
        let id = self.buffer_id(own)?;
        let mut w = Writer::default();
        w.u32(id).u8(put_flags::encode(options));
        protocol::write_segment_items(&mut w, &segment_items(keys, segments)?);
        let len = self.call(Op::BatchPutShmSegments, &w.buf, None)?;
        let body = &self.response[..len];
        put_results(body, keys.len())
    }

    /// Gets values into the registered buffer at `(offset, capacity)`
    /// ranges; the server copies from its pool (or reads the disk) straight
    /// into them.
    pub fn batch_get_registered<K: AsRef<[u8]>>(
        &mut self,
        keys: &[K],
        ranges: &[(u64, u64)],
    ) -> Result<Vec<Result<Option<usize>>>> {
        Self::check_batch_pairs(keys.len(), ranges.len(), "ranges")?;
        self.in_runs(
            range_sizes(keys),
            frame_size::fixed(Op::BatchGetShm),
            |c, run| c.get_registered_frame(&keys[run.clone()], &ranges[run]),
        )
    }

    fn get_registered_frame<K: AsRef<[u8]>>(
        &mut self,
        keys: &[K],
        ranges: &[(u64, u64)],
    ) -> Result<Vec<Result<Option<usize>>>> {
        let id = self.shm_id()?;
        let get = Request::BatchGetShm {
            buffer: id,
            items: range_items(keys, ranges)?,
        };
        let len = self.call(Op::BatchGetShm, &get.encode(), None)?;
        get_shm_results(&self.response[..len], ranges.iter().map(|r| r.1))
    }

    /// Gets values scattered by the server across `(offset, capacity)`
    /// segments of the registered buffer, in order.
    pub fn batch_get_registered_segments<K: AsRef<[u8]>>(
        &mut self,
        keys: &[K],
        segments: &[Vec<(u64, u64)>],
    ) -> Result<Vec<Result<Option<usize>>>> {
        Self::check_batch_pairs(keys.len(), segments.len(), "segment lists")?;
        let fixed = frame_size::fixed(Op::BatchGetShmSegments);
        self.in_runs(segment_sizes(keys, segments), fixed, |c, run| {
            c.get_segments_frame(false, &keys[run.clone()], &segments[run])
        })
    }

    /// A BatchGetShmSegments frame: ranges of the registered buffer, or
    /// (`own`) addresses of this process's memory.
    fn get_segments_frame<K: AsRef<[u8]>>(
        &mut self,
        own: bool,
        keys: &[K],
        segments: &[Vec<(u64, u64)>],
    ) -> Result<Vec<Result<Option<usize>>>> {
        let id = self.buffer_id(own)?;
        let mut w = Writer::default();
        w.u32(id);
        protocol::write_segment_items(&mut w, &segment_items(keys, segments)?);
        let len = self.call(Op::BatchGetShmSegments, &w.buf, None)?;
        let capacities = segments.iter().map(|s| s.iter().map(|r| r.1).sum());
        get_shm_results(&self.response[..len], capacities)
    }

    /// The registered buffer's id, or (`own`) that of this process's memory.
    fn buffer_id(&mut self, own: bool) -> Result<u32> {
        if !own {
            return self.shm_id();
        }
        if self.transport.is_none() {
            self.reconnect()?;
        }
        self.own_id.ok_or_else(|| {
            Error::invalid(
                "the server no longer reaches this process's memory after reconnecting; call again",
            )
        })
    }

    fn shm_id(&mut self) -> Result<u32> {
        if self.transport.is_none() {
            self.reconnect()?;
        }
        self.shm_id.ok_or_else(|| {
            Error::invalid("no registered buffer: connect over unix:// with shm_size > 0")
        })
    }

    pub fn batch_exists<K: AsRef<[u8]>>(&mut self, keys: &[K]) -> Result<Vec<bool>> {
        let sizes = keys.iter().map(|k| frame_size::key(k.as_ref().len()));
        let fixed = frame_size::fixed(Op::BatchExists);
        self.in_runs(sizes, fixed, |c, run| c.exists_frame(&keys[run]))
    }

    fn exists_frame<K: AsRef<[u8]>>(&mut self, keys: &[K]) -> Result<Vec<bool>> {
        let len = self.call(
            Op::BatchExists,
            &Request::BatchExists {
                keys: checked_keys(keys)?,
            }
            .encode(),
            None,
        )?;
        let body = &self.response[..len];
        let mut r = Reader::new(body);
        let n = r.u32().map_err(|e| protocol_error(e.0))? as usize;
        if n != keys.len() {
            return Err(protocol_error("response has the wrong number of results"));
        }
        (0..n)
            .map(|_| r.u8().map(|b| b == 1).map_err(|e| protocol_error(e.0)))
            .collect()
    }

    /// How many leading keys are present (over several frames when the
    /// batch needs them: the count stops at the first run not wholly
    /// present).
    pub fn prefix_len<K: AsRef<[u8]>>(&mut self, keys: &[K]) -> Result<usize> {
        let sizes = keys.iter().map(|k| 2 + k.as_ref().len() as u64);
        let mut total = 0;
        for run in self.runs(sizes, 4) {
            let len = run.len();
            let hit = self.prefix_frame(&keys[run])?;
            total += hit;
            if hit < len {
                break;
            }
        }
        Ok(total)
    }

    fn prefix_frame<K: AsRef<[u8]>>(&mut self, keys: &[K]) -> Result<usize> {
        let len = self.call(
            Op::PrefixLen,
            &Request::PrefixLen {
                keys: checked_keys(keys)?,
            }
            .encode(),
            None,
        )?;
        let body = &self.response[..len];
        Reader::new(body)
            .u64()
            .map(|n| n as usize)
            .map_err(|e| protocol_error(e.0))
    }

    pub fn remove(&mut self, key: impl AsRef<[u8]>) -> Result<bool> {
        let remove = Request::Remove {
            key: check_key(key.as_ref())?,
        };
        let len = self.call(Op::Remove, &remove.encode(), None)?;
        let body = &self.response[..len];
        Ok(body.first() == Some(&1))
    }

    pub fn flush(&mut self) -> Result<()> {
        self.call(Op::Flush, &[], None).map(|_| ())
    }

    /// The server's `/stats` document.
    pub fn stats(&mut self) -> Result<serde_json::Value> {
        let len = self.call(Op::Stats, &[], None)?;
        let body = &self.response[..len];
        serde_json::from_slice(body).map_err(|e| protocol_error(format!("stats are not JSON: {e}")))
    }

    /// The namespaces this connection's credential covers, as the server
    /// counts them now: a JSON document (`docs/protocol.md`, NAMESPACES).
    pub fn namespaces(&mut self) -> Result<serde_json::Value> {
        let len = self.call(Op::Namespaces, &[], None)?;
        let body = &self.response[..len];
        serde_json::from_slice(body)
            .map_err(|e| protocol_error(format!("the namespace list is not JSON: {e}")))
    }

    /// Removes every block of this connection's namespace (durable on
    /// return; on every member in cluster mode).
    pub fn retire_namespace(&mut self) -> Result<kvtier::RetiredNamespace> {
        let len = self.call(Op::RetireNamespace, &[], None)?;
        let mut r = Reader::new(&self.response[..len]);
        let mut read = || r.u64().map_err(|e| protocol_error(e.0));
        Ok(kvtier::RetiredNamespace {
            blocks: read()?,
            bytes: read()?,
            tombstones: read()?,
        })
    }

    /// Stores this connection's namespace's manifest: a JSON object of
    /// readable fields (what the namespace's digest stands for).
    pub fn describe_namespace(&mut self, manifest: &[u8]) -> Result<()> {
        kvtier::validate_manifest(manifest)?;
        let request = Request::DescribeNamespace { manifest };
        self.call(Op::DescribeNamespace, &request.encode(), None)
            .map(|_| ())
    }
}

/// The keys as slices, each checked as a frame would check it: a bad key
/// fails the call here, not as a member's failure.
pub(crate) fn checked_keys<K: AsRef<[u8]>>(keys: &[K]) -> Result<Vec<&[u8]>> {
    keys.iter().map(|k| check_key(k.as_ref())).collect()
}

pub(crate) fn check_key(key: &[u8]) -> Result<&[u8]> {
    kvtier::validate_key(key)?;
    Ok(key)
}

/// Checked keys paired with their `(offset, len)` ranges, for the
/// registered-buffer ops.
fn range_items<'k, K: AsRef<[u8]>>(
    keys: &'k [K],
    ranges: &[(u64, u64)],
) -> Result<Vec<(&'k [u8], u64, u64)>> {
    keys.iter()
        .zip(ranges)
        .map(|(k, &(offset, len))| Ok((check_key(k.as_ref())?, offset, len)))
        .collect()
}

/// Per-key put results from a reply of codes.
fn put_results(body: &[u8], expected: usize) -> Result<Vec<Result<()>>> {
    Ok(codes(body, expected)?
        .into_iter()
        .map(|c| {
            if c == code::OK {
                Ok(())
            } else {
                Err(code_error(c, ""))
            }
        })
        .collect())
}

fn codes(body: &[u8], expected: usize) -> Result<Vec<i32>> {
    let mut r = Reader::new(body);
    let n = r.u32().map_err(|e| protocol_error(e.0))? as usize;
    if n != expected {
        return Err(protocol_error("response has the wrong number of results"));
    }
    (0..n)
        .map(|_| r.i32().map_err(|e| protocol_error(e.0)))
        .collect()
}

/// Request bytes per key of a single-range shared-memory op.
fn range_sizes<K: AsRef<[u8]>>(keys: &[K]) -> impl Iterator<Item = u64> + '_ {
    keys.iter()
        .map(|k| frame_size::range_item(k.as_ref().len()))
}

/// Request bytes per key of a segment op.
fn segment_sizes<'a, K: AsRef<[u8]>>(
    keys: &'a [K],
    segments: &'a [Vec<(u64, u64)>],
) -> impl Iterator<Item = u64> + 'a {
    keys.iter()
        .zip(segments)
        .map(|(k, s)| frame_size::segment_item(k.as_ref().len(), s.len()))
}

/// A checked key and its segments, for the segment ops.
type CheckedSegments<'k> = (&'k [u8], &'k [(u64, u64)]);

/// Checked keys paired with their segments, for the segment ops.
fn segment_items<'k, K: AsRef<[u8]>>(
    keys: &'k [K],
    segments: &'k [Vec<(u64, u64)>],
) -> Result<Vec<CheckedSegments<'k>>> {
    keys.iter()
        .zip(segments)
        .map(|(k, s)| {
            if s.len() > protocol::MAX_SEGMENTS as usize {
                return Err(Error::invalid(format!(
                    "value of {} segments: at most {} are allowed",
                    s.len(),
                    protocol::MAX_SEGMENTS
                )));
            }
            Ok((check_key(k.as_ref())?, &s[..]))
        })
        .collect()
}

/// The per-key table of a shared-memory get: `u32 n, n × (i32, u64 len)`,
/// one per key of `capacities` (each key's room).
fn get_shm_results(
    body: &[u8],
    capacities: impl ExactSizeIterator<Item = u64>,
) -> Result<Vec<Result<Option<usize>>>> {
    let mut r = Reader::new(body);
    let n = r.u32().map_err(|e| protocol_error(e.0))? as usize;
    if n != capacities.len() {
        return Err(protocol_error("response has the wrong number of results"));
    }
    capacities
        .map(|capacity| {
            let c = r.i32().map_err(|e| protocol_error(e.0))?;
            let len = r.u64().map_err(|e| protocol_error(e.0))?;
            Ok(match c {
                code::OK => Ok(Some(len as usize)),
                code::NOT_FOUND => Ok(None),
                code::BUFFER_TOO_SMALL if len > 0 => Err(Error::buffer_too_small(len, capacity)),
                c => Err(code_error(c, "")),
            })
        })
        .collect()
}

/// Every key's answer: `results`, with the keys it leaves `None` answered
/// by `get` (called once, with those keys and their buffers, if any).
pub(crate) fn answer_rest<K: AsRef<[u8]>>(
    mut results: Vec<Option<Result<Option<usize>>>>,
    keys: &[K],
    bufs: &mut [&mut [&mut [u8]]],
    get: impl FnOnce(&[&[u8]], &mut [&mut [&mut [u8]]]) -> Result<Vec<Result<Option<usize>>>>,
) -> Result<Vec<Result<Option<usize>>>> {
    let rest: Vec<usize> = (0..keys.len()).filter(|&i| results[i].is_none()).collect();
    if !rest.is_empty() {
        let rest_keys: Vec<&[u8]> = rest.iter().map(|&i| keys[i].as_ref()).collect();
        let mut rest_bufs: Vec<&mut [&mut [u8]]> = bufs
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| results[*i].is_none())
            .map(|(_, b)| &mut **b)
            .collect();
        for (&i, result) in rest.iter().zip(get(&rest_keys, &mut rest_bufs)?) {
            results[i] = Some(result);
        }
    }
    results
        .into_iter()
        .map(|r| r.ok_or_else(|| protocol_error("a key left unanswered")))
        .collect()
}

/// A leased value to copy: its key's index, its offset in the pool, its
/// length.
type LeasedCopy = (usize, u64, u64);

/// Copies leased values (`(index, offset, len)`, each index once) out of
/// `pool` into their buffers, on up to `copiers` threads when they add up
/// to `PARALLEL_FROM` bytes or more. The threads take values one at a
/// time from a shared counter, so one that the scheduler holds back (a
/// core busy with the server, or with the caller's other threads) leaves
/// its share to the others instead of finishing last.
fn copy_leased(
    pool: &kvtier_wire::shm::PoolView,
    copies: &[LeasedCopy],
    bufs: &mut [&mut [&mut [u8]]],
    copiers: usize,
) -> std::io::Result<()> {
    if copies.iter().any(|c| c.0 >= bufs.len()) {
        return Err(std::io::Error::other("a leased value without a buffer"));
    }
    let mut seen = vec![false; bufs.len()];
    if !copies
        .iter()
        .all(|c| !std::mem::replace(&mut seen[c.0], true))
    {
        return Err(std::io::Error::other("a buffer leased twice"));
    }
    let total: u64 = copies.iter().map(|c| c.2).sum();
    let threads = if total >= PARALLEL_FROM {
        copiers.min(copies.len()).max(1)
    } else {
        1
    };
    let streamed = kvtier::bulk_copy::worth_streaming(usize::try_from(total).unwrap_or(usize::MAX));
    if threads == 1 {
        return copies
            .iter()
            .try_for_each(|&(i, offset, len)| pool.copy_out(offset, len, bufs[i], streamed));
    }
    /// The buffers, shared by the copying threads.
    struct Shared<'a, 'b>(*mut &'a mut [&'b mut [u8]]);
    // SAFETY: each buffer is reached by the one thread that took its
    // copy from the counter (indices are distinct, checked above).
    unsafe impl Sync for Shared<'_, '_> {}
    let shared = Shared(bufs.as_mut_ptr());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let work = || -> std::io::Result<()> {
        let shared = &shared;
        loop {
            let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let Some(&(i, offset, len)) = copies.get(n) else {
                return Ok(());
            };
            // SAFETY: `i` is in bounds (checked above) and taken by this
            // thread alone; `bufs` outlives every run (`run_scoped`).
            let buf = unsafe { &mut **shared.0.add(i) };
            pool.copy_out(offset, len, buf, streamed)?;
        }
    };
    // Kept threads help: creating one and joining its exit cost 60-100 µs
    // of a 1.6 ms batch of 32 MiB.
    crate::kept_threads::run_scoped(threads - 1, &work)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A pool file of `len` bytes whose byte i is `i * 7 + i / 4096`, sealed
    /// as a server's is, and its view.
    fn pool_view(len: usize) -> kvtier_wire::shm::PoolView {
        let region = SharedRegion::create(len).unwrap();
        let mut file = std::fs::File::from(
            region
                .fd()
                .map(|fd| {
                    // SAFETY: a duplicate of the region's own descriptor.
                    unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) }
                        .try_clone_to_owned()
                        .unwrap()
                })
                .unwrap(),
        );
        let bytes: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
        file.write_all(&bytes).unwrap();
        let fd = std::os::fd::OwnedFd::from(file);
        kvtier_wire::shm::PoolView::map(&fd, len as u64).unwrap()
    }

    #[test]
    fn leased_copies_land_in_their_buffers_whatever_the_threads() {
        const VALUE: usize = 1 << 20;
        let pool = pool_view(24 * VALUE);
        let expected = |offset: u64, len: usize| -> Vec<u8> {
            (offset as usize..offset as usize + len)
                .map(|i| (i * 7 + i / 4096) as u8)
                .collect()
        };
        // Batches of 20 keys, some not leased (gaps), some past the
        // parallel threshold, some whole (past the streaming threshold:
        // non-temporal stores), copied on 1 to 4 threads; values split
        // across two segments each.
        const KEYS: usize = 20;
        let mut streamed_batches = 0;
        for (seed, copiers) in (0..40u64).zip([1, 2, 3, 4].into_iter().cycle()) {
            let leased: Vec<bool> = (0..KEYS)
                .map(|i| seed % 5 == 0 || (seed >> (i % 6)) & 1 == 0 || i == 5)
                .collect();
            let copies: Vec<LeasedCopy> = (0..KEYS)
                .filter(|&i| leased[i])
                .map(|i| {
                    (
                        i,
                        ((i * 2 + seed as usize) % 22 * VALUE) as u64,
                        VALUE as u64 - i as u64,
                    )
                })
                .collect();
            let mut storage: Vec<Vec<u8>> =
                (0..2 * KEYS).map(|_| vec![0u8; VALUE / 2 + 1]).collect();
            let mut halves: Vec<[&mut [u8]; 2]> = Vec::new();
            let mut it = storage.iter_mut();
            while let (Some(a), Some(b)) = (it.next(), it.next()) {
                halves.push([&mut a[..], &mut b[..]]);
            }
            let mut bufs: Vec<&mut [&mut [u8]]> = halves.iter_mut().map(|h| &mut h[..]).collect();
            let total: u64 = copies.iter().map(|c| c.2).sum();
            streamed_batches += usize::from(kvtier::bulk_copy::worth_streaming(total as usize));
            copy_leased(&pool, &copies, &mut bufs, copiers).unwrap();
            drop(bufs);
            drop(halves);
            for (i, pair) in storage.chunks(2).enumerate() {
                let joined: Vec<u8> = pair.concat();
                match copies.iter().find(|c| c.0 == i) {
                    Some(&(_, offset, len)) => {
                        let len = len as usize;
                        assert!(
                            joined[..len] == expected(offset, len),
                            "key {i}, {copiers} threads"
                        );
                        assert!(joined[len..].iter().all(|&b| b == 0), "bytes past key {i}");
                    }
                    None => assert!(
                        joined.iter().all(|&b| b == 0),
                        "key {i} not leased was written"
                    ),
                }
            }
        }
        assert!(
            (1..40).contains(&streamed_batches),
            "{streamed_batches} of 40 batches streamed: both kinds must be covered"
        );
        // A lease past the pool or longer than its buffers is refused.
        let mut small = [0u8; 10];
        let mut one: [&mut [u8]; 1] = [&mut small[..]];
        let mut bufs: Vec<&mut [&mut [u8]]> = vec![&mut one[..]];
        assert!(copy_leased(&pool, &[(0, 0, 11)], &mut bufs, 1).is_err());
        assert!(copy_leased(&pool, &[(0, (24 * VALUE) as u64 - 5, 10)], &mut bufs, 1).is_err());
        assert!(copy_leased(&pool, &[(0, u64::MAX - 2, 10)], &mut bufs, 1).is_err());
    }
}
