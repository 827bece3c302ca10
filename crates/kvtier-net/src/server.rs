//! The server: a thread per connection over one shared `Store`, TCP and a
//! Unix socket, plus the admin HTTP endpoint. Requests on a connection are
//! answered in order; clients may pipeline.

use crate::metrics::{Metrics, Sample};
use crate::protocol::{self, code, decode_request, put_flags, Header, Op, Request, Writer};
use crate::shm::SharedRegion;
use crate::transport::{FrameRead, ReadError, Transport};
use kvtier::disk::io::AlignedBuf;
use kvtier::{PutOptions, PutTier, Store};
use std::collections::HashMap;
use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How the server listens and what it allows.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// TCP address; a non-loopback address requires `auth_token`.
    pub listen: Option<SocketAddr>,
    /// Unix socket path (created with mode 0600).
    pub socket: Option<PathBuf>,
    /// Admin HTTP address (`/metrics`, `/health`, `/stats`).
    pub admin: Option<SocketAddr>,
    /// Token every client must present at hello, if set.
    pub auth_token: Option<String>,
    /// Largest frame body accepted.
    pub max_frame: u64,
    /// Most keys in one batch.
    pub max_batch: u32,
    /// Most bytes of shared memory one connection may register.
    pub max_registered_bytes: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: Some(SocketAddr::from(([127, 0, 0, 1], 7700))),
            socket: None,
            admin: Some(SocketAddr::from(([127, 0, 0, 1], 7701))),
            auth_token: None,
            max_frame: protocol::DEFAULT_MAX_FRAME,
            max_batch: protocol::DEFAULT_MAX_BATCH,
            max_registered_bytes: 64 << 30,
        }
    }
}

/// A running server; `shutdown` stops it.
#[derive(Debug)]
pub struct Server {
    store: Arc<Store>,
    config: ServerConfig,
    stopping: Arc<AtomicBool>,
    metrics: Arc<Metrics>,
}

struct Shared {
    store: Arc<Store>,
    config: ServerConfig,
    stopping: Arc<AtomicBool>,
    metrics: Arc<Metrics>,
}

/// How often idle reads and accept loops look at the stop flag.
const POLL: Duration = Duration::from_millis(100);
/// A frame that makes no progress for this long is dropped.
const STALL: Duration = Duration::from_secs(60);

impl Server {
    /// Checks the configuration (a non-loopback listener needs a token).
    pub fn new(store: Arc<Store>, config: ServerConfig) -> io::Result<Server> {
        if let Some(addr) = config.listen {
            if !addr.ip().is_loopback() && config.auth_token.as_deref().is_none_or(str::is_empty) {
                return Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    format!(
                        "refusing to listen on non-loopback address {addr} without an auth token: \
                         set --auth-token or KVTIER_AUTH_TOKEN"
                    ),
                ));
            }
        }
        if config.listen.is_none() && config.socket.is_none() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "nothing to listen on: give a TCP address or a socket path",
            ));
        }
        Ok(Server {
            store,
            config,
            stopping: Arc::new(AtomicBool::new(false)),
            metrics: Arc::new(Metrics::default()),
        })
    }

    /// A flag that stops the server when set.
    pub fn stop_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.stopping)
    }

    pub fn metrics(&self) -> Arc<Metrics> {
        Arc::clone(&self.metrics)
    }

    /// Binds every listener, serves until the stop flag is set, then stops
    /// accepting, lets in-flight requests finish and returns.
    pub fn run(&self, ready: impl FnOnce(&BoundAddrs)) -> io::Result<()> {
        let shared = Arc::new(Shared {
            store: Arc::clone(&self.store),
            config: self.config.clone(),
            stopping: Arc::clone(&self.stopping),
            metrics: Arc::clone(&self.metrics),
        });
        let mut bound = BoundAddrs::default();
        let mut threads: Vec<JoinHandle<()>> = Vec::new();
        if let Some(addr) = self.config.listen {
            let listener =
                TcpListener::bind(addr).map_err(|e| annotate(e, format!("binding {addr}")))?;
            listener.set_nonblocking(true)?;
            bound.tcp = Some(listener.local_addr()?);
            threads.push(spawn_accept(
                "kvtier-tcp-accept",
                &shared,
                move || match listener.accept() {
                    Ok((stream, _)) => {
                        stream.set_nodelay(true)?;
                        stream.set_nonblocking(false)?;
                        Ok(Some(Transport::Tcp(stream)))
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
                    Err(e) => Err(e),
                },
            )?);
        }
        if let Some(path) = &self.config.socket {
            if path.exists() {
                // Someone answering there is a live server: never take its
                // socket away. Otherwise the file is left from a crash.
                if std::os::unix::net::UnixStream::connect(path).is_ok() {
                    return Err(io::Error::new(
                        io::ErrorKind::AddrInUse,
                        format!("another server is listening on {}", path.display()),
                    ));
                }
                std::fs::remove_file(path).map_err(|e| {
                    annotate(e, format!("removing stale socket {}", path.display()))
                })?;
            }
            // SAFETY: umask only changes this process's file-creation mask;
            // the old mask is restored right after the bind.
            let old = unsafe { libc::umask(0o177) };
            let listener = UnixListener::bind(path);
            // SAFETY: as above.
            unsafe { libc::umask(old) };
            let listener =
                listener.map_err(|e| annotate(e, format!("binding {}", path.display())))?;
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
            listener.set_nonblocking(true)?;
            bound.socket = Some(path.clone());
            threads.push(spawn_accept(
                "kvtier-unix-accept",
                &shared,
                move || match listener.accept() {
                    Ok((stream, _)) => {
                        stream.set_nonblocking(false)?;
                        Ok(Some(Transport::Unix(stream)))
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
                    Err(e) => Err(e),
                },
            )?);
        }
        if let Some(addr) = self.config.admin {
            let listener = TcpListener::bind(addr)
                .map_err(|e| annotate(e, format!("binding admin {addr}")))?;
            listener.set_nonblocking(true)?;
            bound.admin = Some(listener.local_addr()?);
            let shared = Arc::clone(&shared);
            threads.push(
                std::thread::Builder::new()
                    .name("kvtier-admin".into())
                    .spawn(move || {
                        crate::admin::serve(
                            listener,
                            &shared.store,
                            &shared.metrics,
                            &shared.stopping,
                        );
                    })?,
            );
        }
        ready(&bound);
        for thread in threads {
            let _ = thread.join();
        }
        if let Some(path) = &bound.socket {
            let _ = std::fs::remove_file(path);
        }
        Ok(())
    }
}

/// Where the server actually listens (ports chosen by the OS for port 0).
#[derive(Debug, Default, Clone)]
pub struct BoundAddrs {
    pub tcp: Option<SocketAddr>,
    pub socket: Option<PathBuf>,
    pub admin: Option<SocketAddr>,
}

fn annotate(e: io::Error, context: String) -> io::Error {
    io::Error::new(e.kind(), format!("{context}: {e}"))
}

/// Starts a thread running `accept_loop` with `accept`.
fn spawn_accept(
    name: &str,
    shared: &Arc<Shared>,
    accept: impl FnMut() -> io::Result<Option<Transport>> + Send + 'static,
) -> io::Result<JoinHandle<()>> {
    let shared = Arc::clone(shared);
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || accept_loop(&shared, accept))
}

/// Accepts until stopping; connection threads are joined before returning
/// so in-flight requests finish.
fn accept_loop(shared: &Arc<Shared>, mut accept: impl FnMut() -> io::Result<Option<Transport>>) {
    let mut connections: Vec<JoinHandle<()>> = Vec::new();
    while !shared.stopping.load(Ordering::Acquire) {
        match accept() {
            Ok(Some(transport)) => {
                let shared = Arc::clone(shared);
                shared
                    .metrics
                    .connections_total
                    .fetch_add(1, Ordering::Relaxed);
                match std::thread::Builder::new()
                    .name("kvtier-conn".into())
                    .spawn(move || {
                        shared
                            .metrics
                            .connections_open
                            .fetch_add(1, Ordering::Relaxed);
                        Connection::new(&shared, transport).serve();
                        shared
                            .metrics
                            .connections_open
                            .fetch_sub(1, Ordering::Relaxed);
                    }) {
                    Ok(handle) => connections.push(handle),
                    Err(e) => tracing::error!(error = %e, "could not start a connection thread"),
                }
                connections.retain(|h| !h.is_finished());
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(5).min(POLL)),
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                std::thread::sleep(POLL);
            }
        }
    }
    for handle in connections {
        let _ = handle.join();
    }
}

struct Connection<'a> {
    shared: &'a Shared,
    transport: Transport,
    /// Reused across frames: request bodies and batch-get value slots.
    body: Vec<u8>,
    arena: Option<AlignedBuf>,
    authenticated: bool,
    buffers: HashMap<u32, SharedRegion>,
    next_buffer: u32,
    registered: u64,
}

/// A request's reply: frame status, body, and value bytes sent after it.
struct Reply<'b> {
    status: i32,
    body: Vec<u8>,
    tail: Vec<&'b [u8]>,
    sample: Sample,
    close: bool,
    /// Set when the handler wrote the response itself.
    sent: Option<io::Result<()>>,
}

impl<'b> Reply<'b> {
    fn ok(body: Vec<u8>) -> Self {
        Reply {
            status: code::OK,
            body,
            tail: Vec::new(),
            sample: Sample::default(),
            close: false,
            sent: None,
        }
    }

    fn error(status: i32, message: impl Into<String>) -> Self {
        Reply {
            status,
            body: message.into().into_bytes(),
            tail: Vec::new(),
            sample: Sample {
                error: true,
                ..Sample::default()
            },
            close: false,
            sent: None,
        }
    }
}

fn result_code<T>(result: &kvtier::Result<T>) -> i32 {
    match result {
        Ok(_) => code::OK,
        Err(e) => code::of(e.kind()),
    }
}

impl<'a> Connection<'a> {
    fn new(shared: &'a Shared, transport: Transport) -> Self {
        Connection {
            shared,
            transport,
            body: Vec::new(),
            arena: None,
            authenticated: false,
            buffers: HashMap::new(),
            next_buffer: 1,
            registered: 0,
        }
    }

    fn serve(mut self) {
        if let Err(e) = self.transport.set_timeouts(Some(POLL), Some(STALL)) {
            tracing::warn!(error = %e, "configuring a connection");
            return;
        }
        loop {
            let mut body = std::mem::take(&mut self.body);
            let read = self.transport.read_frame(
                &mut body,
                self.shared.config.max_frame,
                Some(&self.shared.stopping),
                STALL,
            );
            let (header, fd) = match read {
                Ok(FrameRead::Frame { header, fd }) => (header, fd),
                Ok(FrameRead::Closed) | Ok(FrameRead::Stopping) => break,
                Err(ReadError::Io(e)) => {
                    tracing::debug!(error = %e, "connection ended");
                    break;
                }
                Err(ReadError::Protocol(e)) => {
                    self.shared
                        .metrics
                        .protocol_errors
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(error = %e, "closing a connection after a malformed frame");
                    let _ = self.send(0, 0, code::PROTOCOL, e.0.as_bytes(), &[]);
                    break;
                }
            };
            let started = Instant::now();
            let mut reply = self.handle(&header, &body[..header.body_len as usize], fd);
            let sample = reply.sample;
            let close = reply.close;
            let sent = match reply.sent.take() {
                Some(sent) => sent,
                None => self.send(
                    header.op,
                    header.request_id,
                    reply.status,
                    &reply.body,
                    &reply.tail,
                ),
            };
            drop(reply);
            self.body = body;
            self.shared
                .metrics
                .record(header.op, started.elapsed(), sample);
            if sent.is_err() || close {
                break;
            }
        }
        let freed: u64 = self.buffers.values().map(|b| b.len() as u64).sum();
        self.shared
            .metrics
            .registered_buffers
            .fetch_sub(self.buffers.len() as u64, Ordering::Relaxed);
        self.shared
            .metrics
            .registered_bytes
            .fetch_sub(freed, Ordering::Relaxed);
    }

    fn send(
        &mut self,
        op: u16,
        request_id: u64,
        status: i32,
        body: &[u8],
        tail: &[&[u8]],
    ) -> io::Result<()> {
        let tail_len: usize = tail.iter().map(|t| t.len()).sum();
        let header = Header {
            op,
            request_id,
            body_len: (body.len() + tail_len) as u32,
            status,
        };
        let mut head = Vec::with_capacity(protocol::HEADER_LEN + body.len());
        head.extend_from_slice(&header.encode());
        head.extend_from_slice(body);
        self.transport.write_all(&head)?;
        for piece in tail {
            self.transport.write_all(piece)?;
        }
        self.transport.flush()
    }

    fn handle<'b>(
        &mut self,
        header: &Header,
        body: &'b [u8],
        fd: Option<std::os::fd::OwnedFd>,
    ) -> Reply<'b> {
        if header.status != 0 {
            return Reply {
                close: true,
                ..Reply::error(code::PROTOCOL, "request flags must be 0")
            };
        }
        let request = match decode_request(header.op, body, self.shared.config.max_batch) {
            Ok(request) => request,
            Err(e) => {
                self.shared
                    .metrics
                    .protocol_errors
                    .fetch_add(1, Ordering::Relaxed);
                return Reply {
                    close: true,
                    ..Reply::error(code::PROTOCOL, e.0)
                };
            }
        };
        if !self.authenticated && !matches!(request, Request::Hello { .. }) {
            return Reply {
                close: true,
                ..Reply::error(code::UNAUTHORIZED, "say hello first")
            };
        }
        let store = &self.shared.store;
        match request {
            Request::Hello { token } => {
                let expected = self
                    .shared
                    .config
                    .auth_token
                    .as_deref()
                    .unwrap_or("")
                    .as_bytes();
                if !constant_time_eq(token, expected) {
                    self.shared
                        .metrics
                        .auth_failures
                        .fetch_add(1, Ordering::Relaxed);
                    return Reply {
                        close: true,
                        ..Reply::error(code::UNAUTHORIZED, "wrong or missing auth token")
                    };
                }
                self.authenticated = true;
                let mut w = Writer::default();
                w.u32(u32::from(protocol::VERSION))
                    .u64(self.shared.config.max_frame)
                    .u32(self.shared.config.max_batch)
                    .u32(kvtier::MAX_KEY_LEN as u32)
                    .u64(store.max_put_len());
                Reply::ok(w.buf)
            }
            Request::BatchPut { flags, items } => {
                let keys: Vec<&[u8]> = items.iter().map(|i| i.0).collect();
                let values: Vec<&[u8]> = items.iter().map(|i| i.1).collect();
                let results = store.batch_put_with(&keys, &values, &put_options(flags));
                let codes: Vec<i32> = results.iter().map(result_code).collect();
                put_reply(&codes, &values)
            }
            Request::BatchGet { items } => self.batch_get(header.request_id, items),
            Request::BatchExists { keys } => {
                let present = store.batch_exists(&keys);
                let mut w = Writer::with_capacity(4 + present.len());
                w.u32(present.len() as u32);
                for p in present {
                    w.u8(u8::from(p));
                }
                Reply {
                    sample: Sample {
                        keys: keys.len() as u64,
                        ..Sample::default()
                    },
                    ..Reply::ok(w.buf)
                }
            }
            Request::PrefixLen { keys } => {
                let mut w = Writer::default();
                w.u64(store.prefix_len(&keys) as u64);
                Reply {
                    sample: Sample {
                        keys: keys.len() as u64,
                        ..Sample::default()
                    },
                    ..Reply::ok(w.buf)
                }
            }
            Request::Remove { key } => match store.remove(key) {
                Ok(removed) => Reply::ok(vec![u8::from(removed)]),
                Err(e) => Reply::error(code::of(e.kind()), e.to_string()),
            },
            Request::Flush => match store.flush() {
                Ok(()) => Reply::ok(Vec::new()),
                Err(e) => Reply::error(code::of(e.kind()), e.to_string()),
            },
            Request::Stats => {
                let json = self.shared.metrics.json(&store.stats());
                Reply::ok(json.to_string().into_bytes())
            }
            Request::RegisterBuffer { size } => self.register(size, fd),
            Request::BatchPutShm {
                buffer,
                flags,
                items,
            } => {
                let Some(region) = self.buffers.get(&buffer) else {
                    return Reply::error(
                        code::INVALID_ARGUMENT,
                        format!("buffer {buffer} is not registered on this connection"),
                    );
                };
                let mut codes = vec![code::OK; items.len()];
                let mut keys = Vec::with_capacity(items.len());
                let mut values = Vec::with_capacity(items.len());
                let mut slots = Vec::with_capacity(items.len());
                for (i, &(key, offset, len)) in items.iter().enumerate() {
                    match region.range(offset, len) {
                        Some(bytes) => {
                            keys.push(key);
                            values.push(bytes);
                            slots.push(i);
                        }
                        None => codes[i] = code::INVALID_ARGUMENT,
                    }
                }
                let results = store.batch_put_with(&keys, &values, &put_options(flags));
                for (slot, result) in slots.into_iter().zip(&results) {
                    codes[slot] = result_code(result);
                }
                put_reply(&codes, &values)
            }
            Request::BatchGetShm { buffer, items } => self.batch_get_shm(buffer, items),
        }
    }

    fn register<'b>(&mut self, size: u64, fd: Option<std::os::fd::OwnedFd>) -> Reply<'b> {
        if !matches!(self.transport, Transport::Unix(_)) {
            return Reply::error(code::UNSUPPORTED, "shared buffers need the Unix socket");
        }
        let Some(fd) = fd else {
            return Reply::error(
                code::INVALID_ARGUMENT,
                "no file descriptor came with the register request",
            );
        };
        if size == 0
            || self.registered + size > self.shared.config.max_registered_bytes
            || self.buffers.len() >= 64
        {
            return Reply::error(
                code::LIMIT,
                format!(
                    "registering {size} bytes would pass this connection's limit ({} bytes, 64 buffers)",
                    self.shared.config.max_registered_bytes
                ),
            );
        }
        match SharedRegion::map(fd, size as usize) {
            Ok(region) => {
                let id = self.next_buffer;
                self.next_buffer += 1;
                self.buffers.insert(id, region);
                self.registered += size;
                self.shared
                    .metrics
                    .registered_buffers
                    .fetch_add(1, Ordering::Relaxed);
                self.shared
                    .metrics
                    .registered_bytes
                    .fetch_add(size, Ordering::Relaxed);
                let mut w = Writer::default();
                w.u32(id);
                Reply::ok(w.buf)
            }
            Err(e) => Reply::error(
                code::INVALID_ARGUMENT,
                format!("mapping the shared buffer: {e}"),
            ),
        }
    }

    /// Values come back after the per-key table, straight from page-aligned
    /// slots the disk reads land in.
    fn batch_get<'b>(&mut self, request_id: u64, items: Vec<(&[u8], u64)>) -> Reply<'b> {
        let store = &self.shared.store;
        let lens: Vec<usize> = items
            .iter()
            .map(|(key, cap)| {
                store
                    .value_len(key)
                    .ok()
                    .flatten()
                    .map_or(0, |l| l.min(*cap as usize))
            })
            .collect();
        let total: u64 = lens.iter().map(|&l| l as u64).sum();
        if total + 16 * items.len() as u64 > self.shared.config.max_frame {
            return Reply::error(
                code::LIMIT,
                format!("the values ({total} bytes) exceed the frame limit; use smaller batches"),
            );
        }
        let slot_of = |len: usize| len.div_ceil(4096) * 4096;
        let needed = lens
            .iter()
            .map(|&l| slot_of(l.max(1)))
            .sum::<usize>()
            .max(1);
        // The arena only grows, so steady traffic reuses warm pages.
        let mut arena = match self.arena.take() {
            Some(arena) if arena.len() >= needed => arena,
            _ => AlignedBuf::zeroed(needed),
        };
        let results = {
            let mut rest = arena.as_mut_slice();
            let mut slices: Vec<&mut [u8]> = Vec::with_capacity(items.len());
            for &len in &lens {
                let (slot, tail) = rest.split_at_mut(slot_of(len.max(1)));
                slices.push(slot);
                rest = tail;
            }
            let keys: Vec<&[u8]> = items.iter().map(|i| i.0).collect();
            // The caller's capacity bounds what is returned.
            for (slice, (_, cap)) in slices.iter_mut().zip(&items) {
                let limit = (*cap as usize).min(slice.len());
                let full = std::mem::take(slice);
                *slice = &mut full[..limit];
            }
            store.batch_get_into(&keys, &mut slices)
        };
        let mut w = Writer::with_capacity(4 + 12 * items.len());
        w.u32(items.len() as u32);
        let mut ranges = Vec::new();
        let mut offset = 0usize;
        let mut bytes_out = 0u64;
        for (result, &len) in results.iter().zip(&lens) {
            let slot = slot_of(len.max(1));
            match result {
                Ok(Some(n)) => {
                    w.i32(code::OK).u64(*n as u64);
                    ranges.push((offset, *n));
                    bytes_out += *n as u64;
                }
                Ok(None) => {
                    w.i32(code::NOT_FOUND).u64(0);
                }
                Err(e) => {
                    w.i32(code::of(e.kind())).u64(0);
                }
            }
            offset += slot;
        }
        // Sent from here: the values go out of the arena the disk reads
        // landed in, with no copy into a response buffer.
        let tail: Vec<&[u8]> = ranges
            .iter()
            .map(|&(start, n)| &arena.as_slice()[start..start + n])
            .collect();
        let sent = self.send(Op::BatchGet as u16, request_id, code::OK, &w.buf, &tail);
        drop(tail);
        self.arena = Some(arena);
        let error = results.iter().any(|r| r.is_err());
        Reply {
            sample: Sample {
                keys: items.len() as u64,
                bytes_out,
                error,
                ..Sample::default()
            },
            sent: Some(sent),
            ..Reply::ok(Vec::new())
        }
    }

    fn batch_get_shm<'b>(&mut self, buffer: u32, items: Vec<(&[u8], u64, u64)>) -> Reply<'b> {
        let Some(region) = self.buffers.get(&buffer) else {
            return Reply::error(
                code::INVALID_ARGUMENT,
                format!("buffer {buffer} is not registered on this connection"),
            );
        };
        // Ranges must not overlap: each becomes a separate mutable slice.
        let mut order: Vec<usize> = (0..items.len()).collect();
        order.sort_by_key(|&i| items[i].1);
        for pair in order.windows(2) {
            let (a, b) = (&items[pair[0]], &items[pair[1]]);
            if a.1.saturating_add(a.2) > b.1 {
                return Reply::error(code::INVALID_ARGUMENT, "destination ranges overlap");
            }
        }
        let mut codes = vec![code::OK; items.len()];
        let mut lens = vec![0u64; items.len()];
        let mut keys = Vec::with_capacity(items.len());
        let mut slices: Vec<&mut [u8]> = Vec::with_capacity(items.len());
        let mut slots = Vec::with_capacity(items.len());
        for (i, &(key, offset, cap)) in items.iter().enumerate() {
            // SAFETY: ranges were checked disjoint above, and the client
            // does not touch them until this reply arrives.
            match unsafe { region.range_mut(offset, cap) } {
                Some(slice) => {
                    keys.push(key);
                    slices.push(slice);
                    slots.push(i);
                }
                None => codes[i] = code::INVALID_ARGUMENT,
            }
        }
        let results = self.shared.store.batch_get_into(&keys, &mut slices);
        let mut bytes_out = 0;
        for (slot, result) in slots.into_iter().zip(&results) {
            match result {
                Ok(Some(n)) => {
                    lens[slot] = *n as u64;
                    bytes_out += *n as u64;
                }
                Ok(None) => codes[slot] = code::NOT_FOUND,
                Err(e) => codes[slot] = code::of(e.kind()),
            }
        }
        let mut w = Writer::with_capacity(4 + 12 * items.len());
        w.u32(items.len() as u32);
        for (c, l) in codes.iter().zip(&lens) {
            w.i32(*c).u64(*l);
        }
        let error = results.iter().any(|r| r.is_err());
        Reply {
            sample: Sample {
                keys: items.len() as u64,
                bytes_out,
                error,
                ..Sample::default()
            },
            ..Reply::ok(w.buf)
        }
    }
}

/// The reply to a batch put: a code per key.
fn put_reply<'b>(codes: &[i32], values: &[&[u8]]) -> Reply<'b> {
    let mut w = Writer::with_capacity(4 + 4 * codes.len());
    w.u32(codes.len() as u32);
    for &c in codes {
        w.i32(c);
    }
    Reply {
        sample: Sample {
            keys: codes.len() as u64,
            bytes_in: values.iter().map(|v| v.len() as u64).sum(),
            error: codes.iter().any(|&c| c != code::OK),
            ..Sample::default()
        },
        ..Reply::ok(w.buf)
    }
}

fn put_options(flags: u8) -> PutOptions {
    PutOptions {
        skip_existing: flags & put_flags::SKIP_EXISTING != 0,
        tier: if flags & put_flags::MEMORY_ONLY != 0 {
            PutTier::MemoryOnly
        } else {
            PutTier::MemoryAndDisk
        },
        durable: flags & put_flags::DURABLE != 0,
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
