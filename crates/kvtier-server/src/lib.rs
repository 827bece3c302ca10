//! The server behind `kvtier serve`: a thread per connection over one
//! shared `Store`, on TCP and a Unix socket, plus the admin HTTP endpoint.
//!
//! - `lib.rs` (here): configuration, listeners, accepting under the
//!   connection cap, shutdown.
//! - `config`: how the server listens and what it allows.
//! - `context`: what every connection of one server shares.
//! - `limits`: every limit and its default; the server-wide budgets.
//! - `trust`: every admission and authorisation decision about a peer.
//! - `session`: one connection: hello, deadlines, shared buffers.
//! - `handlers`: one plain function per operation, (store, request) in,
//!   reply out.
//!
//! Why threads and not an async runtime: see docs/server.md.

mod admin;
mod admission;
mod config;
mod context;
mod handlers;
pub mod limits;
mod lobby;
mod metrics;
mod namespaces;
mod peer_memory;
mod pool_map;
mod routed_put;
mod session;
mod streamed_put;
mod trust;

pub use config::{ServerConfig, StatusSection};
pub use limits::Limits;
pub use trust::{
    check_token, data_dir_token, read_tenants, Auth, Peer, Scope, Tenant, MIN_TOKEN_LEN, TOKEN_FILE,
};

use crate::context::{RateLimitedWarning, Shared, POLL};
use crate::metrics::Metrics;
use kvtier::Store;
use kvtier_wire::protocol::{code, Header};
use kvtier_wire::transport::Transport;
use limits::Budget;
use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A running server; `shutdown` stops it.
#[derive(Debug)]
pub struct Server {
    shared: Arc<Shared>,
}

impl Server {
    /// Checks the configuration: TCP and a non-loopback admin port need a
    /// token of at least `MIN_TOKEN_LEN` bytes.
    pub fn new(store: Arc<Store>, config: ServerConfig) -> io::Result<Server> {
        let auth = Auth::new(config.auth_token.as_deref())?.with_tenants(config.tenants.clone())?;
        if auth.has_tenants() && !auth.has_token() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "tenants need the server's own token too (it opens the admin endpoint, which \
                 shows every tenant)",
            ));
        }
        auth.check_listeners(config.listen, config.tls.is_some(), config.admin)?;
        if config.listen.is_none() && config.socket.is_none() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "nothing to listen on: give a TCP address or a socket path",
            ));
        }
        // One descriptor per connection of any kind, the store's region
        // files and the server's own: the caps must fit the open-file
        // limit, or an idle crowd would starve the flusher of the next
        // region file (puts failing with EMFILE).
        let mut config = config;
        let open_files = limits::raise_open_file_limit();
        let region_files = store
            .stats()
            .disk_capacity
            .div_ceil(store.config().effective_region_size().max(1))
            + 2;
        let available = open_files.saturating_sub(limits::DESCRIPTOR_RESERVE + region_files);
        // Other writers' region files (a shared directory) get at least a
        // small share of their own, the connections the rest.
        let others_floor = if store.config().configured_shared_dir().is_some() {
            (available / 8).min(limits::MIN_OTHER_REGION_FILES)
        } else {
            0
        };
        let available = available - others_floor;
        match config.limits.fit_descriptors(available) {
            Ok(None) => {}
            Ok(Some(said)) => tracing::warn!("{said}"),
            Err(why) => return Err(io::Error::other(why)),
        }
        // What the caps leave is the room for other writers' region files
        // (a shared directory): never taken from connections. (The store's
        // first follow pass, at open, kept within half the limit; what it
        // opened past this room is closed here.)
        let other_files =
            others_floor + available.saturating_sub(config.limits.connection_descriptors());
        store.set_shared_file_budget(usize::try_from(other_files).unwrap_or(usize::MAX));
        let limits = &config.limits;
        let buffer_bytes = limits
            .max_buffer_bytes
            .unwrap_or_else(|| store.stats().memory_capacity.max(limits.max_frame));
        if buffer_bytes < limits.max_frame {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "max_buffer_bytes ({buffer_bytes}) is below max_frame ({}): a frame of the \
                     largest size could never be received; raise it or lower max_frame",
                    limits.max_frame
                ),
            ));
        }
        let governor = kvtier_governor::Governor::new(
            config.tenants.len(),
            limits.shares(),
            kvtier_governor::GuessBudget::new(
                limits.max_failed_hellos_per_second,
                limits.failed_auth_delay,
            ),
        );
        let buffers = governor.budget("buffer bytes", buffer_bytes);
        let receiving = governor.budget(
            "receiving bytes",
            limits
                .max_receiving_bytes
                .unwrap_or_else(|| (store.stats().memory_capacity / 2).max(kvtier::MIB)),
        );
        let peers = config.cluster.as_ref().map(|view| {
            Arc::new(kvtier_client::routing::Peers::new(
                Arc::clone(view),
                config.auth_token.clone(),
                config.peer_tls_ca.clone(),
                limits.peer_timeout,
            ))
        });
        Ok(Server {
            shared: Arc::new(Shared {
                peers,
                admission: admission::Admission::new(limits, &governor),
                metrics: Arc::new(Metrics::governed(&governor)),
                governor,
                registered: Budget::new(limits.max_registered_bytes_total),
                registered_buffers: Budget::new(limits.max_registered_buffers_total as u64),
                receiving,
                leasing: pool_map::leasing_budget(store.stats().memory_capacity),
                buffers,
                store,
                auth,
                config,
                stopping: Arc::new(AtomicBool::new(false)),
                refusal_log: RateLimitedWarning::default(),
                namespace_use: Default::default(),
            }),
        })
    }

    /// A flag that stops the server when set.
    pub fn stop_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.shared.stopping)
    }

    /// The governor every listener of this server draws on (the KV-event
    /// feed's too, where a node runs one).
    pub fn governor(&self) -> Arc<kvtier_governor::Governor> {
        Arc::clone(&self.shared.governor)
    }

    pub fn metrics(&self) -> Arc<Metrics> {
        Arc::clone(&self.shared.metrics)
    }

    /// Binds every listener, serves until the stop flag is set, then stops
    /// accepting, lets in-flight requests finish and returns.
    pub fn run(&self, ready: impl FnOnce(&BoundAddrs)) -> io::Result<()> {
        let shared = &self.shared;
        let config = &shared.config;
        let mut bound = BoundAddrs::default();
        let mut threads: Vec<JoinHandle<()>> = Vec::new();
        if let Some(addr) = config.listen {
            let listener =
                TcpListener::bind(addr).map_err(|e| annotate(e, format!("binding {addr}")))?;
            listener.set_nonblocking(true)?;
            bound.tcp = Some(listener.local_addr()?);
            bound.tls = config.tls.is_some();
            let tls = config.tls.clone();
            threads.push(spawn_accept(
                "kvtier-tcp-accept",
                shared,
                move || match listener.accept() {
                    Ok((stream, _)) => {
                        stream.set_nodelay(true)?;
                        stream.set_nonblocking(false)?;
                        Ok(Some(match &tls {
                            // The handshake runs on the connection's thread,
                            // under the handshake deadline.
                            Some(tls) => Transport::TlsServer(Box::new(rustls::StreamOwned::new(
                                rustls::ServerConnection::new(Arc::clone(tls))
                                    .map_err(io::Error::other)?,
                                stream,
                            ))),
                            None => Transport::Tcp(stream),
                        }))
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
                    Err(e) => Err(e),
                },
            )?);
        }
        if let Some(path) = &config.socket {
            let listener = bind_unix(path)?;
            bound.socket = Some(path.clone());
            threads.push(spawn_accept(
                "kvtier-unix-accept",
                shared,
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
        if let Some(addr) = config.admin {
            let listener = TcpListener::bind(addr)
                .map_err(|e| annotate(e, format!("binding admin {addr}")))?;
            listener.set_nonblocking(true)?;
            bound.admin = Some(listener.local_addr()?);
            let shared = Arc::clone(shared);
            threads.push(
                std::thread::Builder::new()
                    .name("kvtier-admin".into())
                    .spawn(move || crate::admin::serve(listener, &shared))?,
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

/// Binds the Unix socket with mode 0600 from its first instant, never
/// taking the path from a live server.
fn bind_unix(path: &PathBuf) -> io::Result<UnixListener> {
    // Another user who may write the socket's directory could replace the
    // socket with one of their own (and collect the tokens and values of
    // clients that connect to it).
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => std::path::Path::new("."),
    };
    kvtier::private_files::check_socket_dir(dir)
        .map_err(|e| annotate(e, format!("binding {}", path.display())))?;
    if path.exists() {
        // Someone answering there is a live server: never take its socket
        // away. Otherwise the file is left from a crash.
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("another server is listening on {}", path.display()),
            ));
        }
        std::fs::remove_file(path)
            .map_err(|e| annotate(e, format!("removing stale socket {}", path.display())))?;
    }
    // The socket file is born 0600 (the mask is process-wide, so it is
    // restored right after the bind).
    let old = rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o177));
    let listener = UnixListener::bind(path);
    rustix::process::umask(old);
    let listener = listener.map_err(|e| annotate(e, format!("binding {}", path.display())))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// Where the server actually listens (ports chosen by the OS for port 0).
#[derive(Debug, Default, Clone)]
pub struct BoundAddrs {
    pub tcp: Option<SocketAddr>,
    /// Whether the TCP listener speaks TLS.
    pub tls: bool,
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

/// Accepts until stopping, under the connection cap; connection threads
/// are joined before returning so in-flight requests finish. A
/// connection that is not trusted by its credentials waits in the lobby
/// (`lobby`) until its first bytes arrive, holding nothing but its socket.
fn accept_loop(shared: &Arc<Shared>, mut accept: impl FnMut() -> io::Result<Option<Transport>>) {
    let limits = &shared.config.limits;
    let mut lobby: lobby::Lobby<trust::Peer> = lobby::Lobby::new(
        limits.max_lobby_connections,
        limits.max_lobby_per_address,
        limits.handshake_timeout,
    );
    let mut connections: Vec<JoinHandle<()>> = Vec::new();
    while !shared.stopping.load(Ordering::Acquire) {
        let accepted = match accept() {
            Ok(Some(transport)) => {
                let peer = shared.auth.peer(&transport);
                let addr = match &transport {
                    Transport::Tcp(stream) => stream.peer_addr().ok(),
                    Transport::TlsServer(tls) => tls.sock.peer_addr().ok(),
                    Transport::Unix(_) | Transport::TlsClient(_) => None,
                }
                .map(|a| a.ip());
                if peer.trusted_by_credentials {
                    start_connection(shared, transport, peer, addr, &mut connections);
                } else if lobby.enter(transport, peer, addr, Instant::now()).is_some() {
                    // The oldest silent connection made room (closed here).
                    shared.metrics.lobby_closed.fetch_add(1, Ordering::Relaxed);
                }
                true
            }
            Ok(None) => false,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                std::thread::sleep(POLL);
                false
            }
        };
        // Waits for the lobby (up to 5 ms) only when nothing else is due.
        let wait = if accepted {
            Duration::ZERO
        } else {
            Duration::from_millis(5)
        };
        if lobby.is_empty() {
            if !accepted {
                std::thread::sleep(wait);
            }
        } else {
            match lobby.poll(wait, Instant::now()) {
                Ok(polled) => {
                    // Closed at the handshake deadline: a timeout like any.
                    let expired = polled.expired as u64;
                    shared
                        .metrics
                        .lobby_closed
                        .fetch_add(expired, Ordering::Relaxed);
                    shared
                        .metrics
                        .connections_timed_out
                        .fetch_add(expired, Ordering::Relaxed);
                    for w in polled.ready {
                        start_connection(shared, w.transport, w.peer, w.addr, &mut connections);
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "polling the connections that have not spoken yet failed");
                    std::thread::sleep(POLL);
                }
            }
        }
        shared
            .metrics
            .lobby_waiting
            .store(lobby.len() as u64, Ordering::Relaxed);
    }
    for handle in connections {
        let _ = handle.join();
    }
}

/// Gives a connection its slot (pending, or authenticated for a trusted
/// peer) and its thread, or refuses it over a cap.
fn start_connection(
    shared: &Arc<Shared>,
    transport: Transport,
    peer: trust::Peer,
    addr: Option<std::net::IpAddr>,
    connections: &mut Vec<JoinHandle<()>>,
) {
    let closer = (!peer.trusted_by_credentials)
        .then(|| admission::Closer::of(&transport))
        .flatten();
    // A first message that names a token this server holds (a challenge)
    // or presents one (a plain hello) waits as that token's principal,
    // within its share; any other as unauthenticated peers.
    let principal = match lobby::challenged_token_id(&transport) {
        Some(id) => shared.auth.principal_of_token_id(&id),
        None => lobby::hello_token(&transport)
            .and_then(|token| shared.auth.scope_of_token(&token))
            .map_or(kvtier_governor::Principal::Anonymous, |scope| {
                shared.auth.principal_of(&scope)
            }),
    };
    let admitted = shared
        .admission
        .admit_connection(&peer, addr, closer, principal);
    shared
        .metrics
        .pending_closed
        .store(shared.admission.evicted(), Ordering::Relaxed);
    let slot = match admitted {
        Ok(slot) => slot,
        Err(why) => {
            refuse_connection(shared, transport, &why);
            return;
        }
    };
    shared
        .metrics
        .connections_total
        .fetch_add(1, Ordering::Relaxed);
    let worker = Arc::clone(shared);
    match std::thread::Builder::new()
        .name("kvtier-conn".into())
        .spawn(move || serve_connection(&worker, transport, peer, slot))
    {
        Ok(handle) => connections.push(handle),
        Err(e) => tracing::error!(error = %e, "could not start a connection thread"),
    }
    connections.retain(|h| !h.is_finished());
}

fn serve_connection(
    shared: &Shared,
    transport: Transport,
    peer: trust::Peer,
    slot: admission::Slot,
) {
    shared
        .metrics
        .connections_open
        .fetch_add(1, Ordering::Relaxed);
    session::Session::new(shared, transport, peer, slot).serve();
    shared
        .metrics
        .connections_open
        .fetch_sub(1, Ordering::Relaxed);
}

/// Answers a connection over a cap with a LIMIT frame and closes it,
/// spending at most a few milliseconds of the accept thread on it.
fn refuse_connection(shared: &Shared, mut transport: Transport, message: &str) {
    shared
        .metrics
        .connections_refused
        .fetch_add(1, Ordering::Relaxed);
    let header = Header {
        op: 0,
        request_id: 0,
        body_len: message.len() as u32,
        status: code::LIMIT,
    };
    let mut frame = header.encode().to_vec();
    frame.extend_from_slice(message.as_bytes());
    let _ = transport.set_timeouts(
        Some(Duration::from_millis(10)),
        Some(Duration::from_millis(10)),
    );
    let _ = transport.write_all(&frame);
    if let Some(also) = shared.refusal_log.due() {
        tracing::warn!(
            why = message,
            refused_since_last_warning = also,
            "refused a connection over a cap"
        );
    }
}
