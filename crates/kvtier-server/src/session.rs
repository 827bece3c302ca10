//! One client connection: the hello (authentication and namespace), the
//! deadlines that bound how long a peer may hold the connection, the
//! shared buffers it registered, and dispatch to the handlers.

use crate::context::{Shared, POLL};
use crate::handlers::{self, Reply};
use crate::limits::Permit;
use crate::metrics::Metrics;
use crate::{routed_put, streamed_put};
use kvtier::AlignedBuf;
use kvtier::{Namespace, NamespacedStore};
use kvtier_client::routing::Router;
use kvtier_client::KvBackend;
use kvtier_governor::Principal;
use kvtier_wire::protocol::{
    self, code, decode_request, request_flags, Header, HelloReply, Op, Request, Writer,
};
use kvtier_wire::shm::SharedRegion;
use kvtier_wire::transport::{FrameLimits, FrameRead, ReadError, Transport};
use std::collections::HashMap;
use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Idle time after which a connection's large buffers are released: long
/// enough that a client verifying one batch before sending the next keeps
/// its warm pages.
const RELEASE_AFTER_IDLE: Duration = Duration::from_secs(1);

pub(crate) struct Session<'a> {
    transport: Transport,
    state: State<'a>,
}

/// Everything of a session but its socket, so a reply can borrow from it
/// while the socket sends.
struct State<'a> {
    shared: &'a Shared,
    /// Set by a successful hello: until then the peer is unauthenticated.
    namespace: Option<Namespace>,
    /// Request bodies; grows with bytes received, released when idle.
    body: Vec<u8>,
    /// Batch-get value slots (TCP: disk reads and values other cluster
    /// members answered); released when idle.
    arena: Option<AlignedBuf>,
    /// Pool leases of the reply being sent (memory hits go out from the
    /// pool itself).
    leases: Vec<Option<kvtier::ValueLease>>,
    buffers: HashMap<u32, RegisteredBuffer>,
    /// The client's own memory, once registered (RegisterPeerMemory),
    /// under a buffer id of its own.
    peer_memory: Option<(u32, crate::peer_memory::PeerMemory)>,
    /// Pool extents this connection's client holds by lease (it maps the
    /// pool: MapPool), ended by ReleaseLease or with the connection.
    client_leases: crate::pool_map::ClientLeases,
    next_buffer: u32,
    registered_bytes: u64,
    /// The peer, as `trust` sees it before the hello.
    peer: crate::trust::Peer,
    /// The connection's slot: pending until the hello succeeds.
    slot: crate::admission::Slot,
    /// What the hello opened (before it: nothing is served anyway).
    scope: crate::trust::Scope,
    /// When the hello must be done by.
    hello_deadline: Instant,
    /// Stamps the namespace's last use (set at hello).
    use_clock: crate::namespaces::UseClock,
    /// The buffer and receiving budgets this connection's principal draws
    /// from (a tenant's shares after its hello).
    heap: crate::limits::Budgets,
    receiving: crate::limits::Budgets,
    /// What `body_held` and the arena hold of `heap`.
    held: crate::limits::Held,
    /// Bytes of body buffer counted in `held`.
    body_held: usize,
    /// The challenge answered on this connection, if the client asked
    /// for one: its hello then carries a proof, never the token.
    challenge: Option<crate::trust::Issued>,
}

/// A client's shared buffer, with its share of the server-wide budget.
struct RegisteredBuffer {
    region: SharedRegion,
    _budget: Permit,
    /// Its place among the server's registered buffers.
    _slot: Permit,
    metrics: Arc<Metrics>,
}

impl Drop for RegisteredBuffer {
    fn drop(&mut self) {
        self.metrics
            .registered_buffers
            .fetch_sub(1, Ordering::Relaxed);
        self.metrics
            .registered_bytes
            .fetch_sub(self.region.len() as u64, Ordering::Relaxed);
    }
}

enum End {
    Closed,
    TimedOut(&'static str),
}

impl<'a> Session<'a> {
    pub fn new(
        shared: &'a Shared,
        transport: Transport,
        peer: crate::trust::Peer,
        slot: crate::admission::Slot,
    ) -> Self {
        let hello_deadline = Instant::now() + shared.config.limits.handshake_timeout;
        Session {
            transport,
            state: State {
                shared,
                namespace: None,
                body: Vec::new(),
                arena: None,
                leases: Vec::new(),
                buffers: HashMap::new(),
                peer_memory: None,
                client_leases: Default::default(),
                next_buffer: 1,
                registered_bytes: 0,
                peer,
                slot,
                scope: crate::trust::Scope::Full,
                hello_deadline,
                use_clock: crate::namespaces::UseClock::default(),
                challenge: None,
                // Before its hello a connection draws as an unauthenticated
                // peer (a hello's body is within its free bytes).
                heap: crate::limits::Budgets::new(&shared.buffers, Principal::Anonymous),
                receiving: crate::limits::Budgets::new(&shared.receiving, Principal::Anonymous),
                held: shared.buffers.empty(Principal::Anonymous),
                body_held: 0,
            },
        }
    }

    pub fn serve(mut self) {
        let limits = &self.state.shared.config.limits;
        if let Err(e) = self
            .transport
            .set_timeouts(Some(POLL), Some(limits.write_timeout))
        {
            tracing::warn!(error = %e, "configuring a connection");
            return;
        }
        match self.serve_frames() {
            End::Closed => {}
            End::TimedOut(why) => {
                self.state
                    .shared
                    .metrics
                    .connections_timed_out
                    .fetch_add(1, Ordering::Relaxed);
                tracing::debug!(why, "dropped a connection at a deadline");
            }
        }
    }

    fn serve_frames(&mut self) -> End {
        let shared = self.state.shared;
        let limits = &shared.config.limits;
        // One deadline for the hello, set when the session began: the
        // frame reads and the token check both keep to it.
        let handshake_deadline = self.state.hello_deadline;
        let mut idle_since = Instant::now();
        loop {
            let authenticated = self.state.namespace.is_some();
            let frame_limits = FrameLimits {
                max_body: if authenticated {
                    limits.max_frame
                } else {
                    limits.max_hello_frame
                },
                return_when_idle: true,
                frame_time: limits.frame_timeout,
                min_rate: limits.min_frame_rate,
                stall: limits.frame_timeout,
                deadline: (!authenticated).then_some(handshake_deadline),
            };
            let mut body = std::mem::take(&mut self.state.body);
            // A put this node runs on its own store alone (no cluster, or a
            // LOCAL_ONLY request) is read value by value straight into the
            // pool; in cluster mode one is read in groups that go to their
            // owners as they fill (`routed_put`). Frames with unknown flags
            // take the plain path, which refuses them.
            // The body grows out of the server's buffer budget, as its
            // bytes arrive (never on a length the peer announced).
            let arena_len = self.state.arena.as_ref().map_or(0, |a| a.len());
            let (held, body_held) = (&mut self.state.held, &mut self.state.body_held);
            let read = self.transport.read_frame_or_stream(
                &mut body,
                &frame_limits,
                |h| {
                    authenticated
                        && h.op == Op::BatchPut as u16
                        && h.status & !request_flags::LOCAL_ONLY == 0
                },
                |want| {
                    let fits = held.set_within(charged(want + arena_len), limits.buffer_wait);
                    if fits {
                        *body_held = want;
                    }
                    fits
                },
            );
            let (header, fd) = match read {
                Ok(FrameRead::Frame { header, fd }) => (header, fd),
                Ok(FrameRead::Streamed {
                    header,
                    body: stream,
                    ..
                }) => {
                    let started = Instant::now();
                    let namespace = self.state.namespace.clone().expect("authenticated");
                    let store = &shared.store.in_namespace(&namespace);
                    let local_only = header.status & request_flags::LOCAL_ONLY != 0;
                    let router = routes_writes(shared, &namespace, store, local_only);
                    let reply = match &router {
                        Some(router) => {
                            let arena_len = self.state.arena.as_ref().map_or(0, |a| a.len());
                            let (held, body_held) =
                                (&mut self.state.held, &mut self.state.body_held);
                            let mut room = |want: usize| {
                                let fits =
                                    held.set_within(charged(want + arena_len), limits.buffer_wait);
                                if fits {
                                    *body_held = want;
                                } else {
                                    shared
                                        .metrics
                                        .requests_refused_for_memory
                                        .fetch_add(1, Ordering::Relaxed);
                                }
                                fits
                            };
                            routed_put::batch_put_routed(
                                router,
                                &mut self.transport,
                                stream,
                                limits.max_batch,
                                &mut body,
                                &mut room,
                            )
                        }
                        None => streamed_put::batch_put_streamed(
                            store,
                            &mut self.transport,
                            stream,
                            limits.max_batch,
                            &mut body,
                            &self.state.receiving,
                        ),
                    };
                    self.state.body = body;
                    let reply = match reply {
                        Ok(reply) => reply,
                        Err(e) => return self.read_failed(e),
                    };
                    if !answer(
                        &mut self.transport,
                        &shared.metrics,
                        &header,
                        reply,
                        started,
                    ) {
                        return End::Closed;
                    }
                    idle_since = Instant::now();
                    continue;
                }
                Ok(FrameRead::Refused { header }) => {
                    self.state.body = body;
                    shared
                        .metrics
                        .requests_refused_for_memory
                        .fetch_add(1, Ordering::Relaxed);
                    let reply = Reply::error(code::LIMIT, buffers_spent(&self.state.heap));
                    if !answer(
                        &mut self.transport,
                        &shared.metrics,
                        &header,
                        reply,
                        Instant::now(),
                    ) {
                        return End::Closed;
                    }
                    idle_since = Instant::now();
                    continue;
                }
                Ok(FrameRead::Closed) => return End::Closed,
                Ok(FrameRead::Idle) => {
                    self.state.body = body;
                    if shared.stopping.load(Ordering::Acquire) {
                        return End::Closed;
                    }
                    if idle_since.elapsed() >= RELEASE_AFTER_IDLE {
                        self.state.release_idle_buffers();
                    }
                    if !authenticated && Instant::now() > handshake_deadline {
                        return End::TimedOut("no hello within the handshake timeout");
                    }
                    if idle_since.elapsed() > limits.idle_timeout {
                        return End::TimedOut("idle past the idle timeout");
                    }
                    continue;
                }
                Err(e) => return self.read_failed(e),
            };
            let started = Instant::now();
            let reply = self
                .state
                .handle(&header, &body[..header.body_len as usize], fd);
            let go_on = answer(
                &mut self.transport,
                &shared.metrics,
                &header,
                reply,
                started,
            );
            // Sent: the pool extents may go as soon as nothing else holds them.
            self.state.leases.clear();
            self.state.body = body;
            if !go_on {
                return End::Closed;
            }
            idle_since = Instant::now();
        }
    }
}

impl Session<'_> {
    /// How a connection ends after a frame could not be read: a deadline,
    /// the peer gone, or a malformed frame (answered, then closed).
    fn read_failed(&mut self, e: ReadError) -> End {
        match e {
            ReadError::Io(e) if e.kind() == io::ErrorKind::TimedOut => {
                End::TimedOut("a frame passed its deadline")
            }
            ReadError::Io(e) => {
                tracing::debug!(error = %e, "connection ended");
                End::Closed
            }
            ReadError::Protocol(e) => {
                self.state
                    .shared
                    .metrics
                    .protocol_errors
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, "closing a connection after a malformed frame");
                let _ = send(
                    &mut self.transport,
                    0,
                    0,
                    code::PROTOCOL,
                    e.0.as_bytes(),
                    &[],
                    None,
                );
                End::Closed
            }
        }
    }
}

impl State<'_> {
    /// Buffers that grew for a large request go back once the connection
    /// is idle; steady traffic keeps its warm pages.
    fn release_idle_buffers(&mut self) {
        let keep = self.shared.config.limits.retained_buffer_bytes;
        if self.body.capacity() > keep {
            self.body = Vec::new();
        }
        if self.arena.as_ref().is_some_and(|a| a.len() > keep) {
            self.arena = None;
        }
        self.body_held = self.body.capacity();
        let arena_len = self.arena.as_ref().map_or(0, |a| a.len());
        // Shrinking always succeeds.
        self.held.try_set(charged(self.body_held + arena_len));
    }

    fn handle<'b>(&'b mut self, header: &Header, body: &[u8], fd: Option<OwnedFd>) -> Reply<'b> {
        let shared = self.shared;
        if header.status & !request_flags::LOCAL_ONLY != 0 {
            return Reply::error(code::PROTOCOL, "unknown request flags").closing();
        }
        let local_only = header.status & request_flags::LOCAL_ONLY != 0;
        let request = match decode_request(header.op, body, shared.config.limits.max_batch) {
            Ok(request) => request,
            Err(e) => {
                shared
                    .metrics
                    .protocol_errors
                    .fetch_add(1, Ordering::Relaxed);
                return Reply::error(code::PROTOCOL, e.0).closing();
            }
        };
        let namespace = match (&self.namespace, request) {
            (
                None,
                Request::Challenge {
                    client_nonce,
                    token_id,
                    member,
                },
            ) => {
                if self.challenge.is_some() {
                    return Reply::error(code::PROTOCOL, "one challenge per connection").closing();
                }
                let slot = &self.slot;
                return match shared.auth.challenge(
                    client_nonce,
                    token_id,
                    member,
                    shared.store.node_id(),
                    shared.governor.guesses(),
                    self.hello_deadline,
                    &|| slot.closed_for_newcomer(),
                ) {
                    Ok((issued, reply)) => {
                        self.challenge = Some(issued);
                        Reply::ok(reply)
                    }
                    Err(why) => {
                        shared.governor.guesses().count_refusal();
                        Reply::error(code::UNAUTHORIZED, why).closing()
                    }
                };
            }
            (None, Request::Hello { token, namespace }) => return self.hello(token, namespace),
            (None, _) => {
                return Reply::error(code::UNAUTHORIZED, "say hello first").closing();
            }
            (Some(_), Request::Hello { .. } | Request::Challenge { .. }) => {
                return Reply::error(code::PROTOCOL, "hello was already said on this connection")
                    .closing();
            }
            (Some(namespace), request) => (namespace.clone(), request),
        };
        let (namespace, request) = namespace;
        self.use_clock.touch();
        let store = &shared.store.in_namespace(&namespace);
        // Cluster mode: one dispatch below serves both: the backend is the
        // store or the router over it (`router_for`).
        let router = router_for(shared, &namespace, store, local_only);
        let backend: &dyn KvBackend = match &router {
            Some(router) if crosses_members(router, &request) => router,
            _ => store,
        };
        match request {
            Request::Hello { .. } | Request::Challenge { .. } => unreachable!("handled above"),
            Request::BatchPut { flags, items } => handlers::batch_put(backend, flags, &items),
            Request::BatchGet { items } => {
                // Reply staging comes out of the buffer budget too.
                let (held, body_held, heap) = (&mut self.held, self.body_held, &self.heap);
                let wait = shared.config.limits.buffer_wait;
                let mut room = |arena_len: usize| {
                    let fits = held.set_within(charged(body_held + arena_len), wait);
                    if !fits {
                        shared
                            .metrics
                            .requests_refused_for_memory
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    fits
                };
                handlers::batch_get(
                    backend,
                    &items,
                    &mut self.arena,
                    &mut self.leases,
                    shared.config.limits.max_frame,
                    shared.store.max_put_len(),
                    &mut room,
                    &|| buffers_spent(heap),
                )
            }
            Request::BatchExists { keys } => handlers::batch_exists(backend, &keys),
            Request::PrefixLen { keys } => handlers::prefix_len(backend, &keys),
            Request::Remove { key } => handlers::remove(backend, key),
            Request::Flush => handlers::flush(backend),
            Request::Stats | Request::ClusterView if !self.scope.sees_the_server() => Reply::error(
                code::UNAUTHORIZED,
                "a tenant's token does not open the server's statistics or cluster view",
            ),
            Request::Stats => {
                let json = shared.metrics.json(&shared.store.stats());
                Reply::ok(json.to_string().into_bytes())
            }
            // The caller's own namespaces (a tenant's within its prefixes).
            Request::Namespaces => {
                let principal = shared.auth.principal_of(&self.scope);
                shared
                    .namespace_use
                    .list(&shared.store, &self.scope, principal)
            }
            Request::RetireNamespace => {
                let principal = shared.auth.principal_of(&self.scope);
                shared
                    .namespace_use
                    .retire(backend, namespace.name(), principal)
            }
            Request::DescribeNamespace { manifest } => {
                shared
                    .namespace_use
                    .describe(backend, namespace.name(), manifest)
            }
            Request::ClusterView => {
                let json = match &shared.peers {
                    Some(peers) => peers.view.json(),
                    None => serde_json::json!({ "enabled": false }),
                };
                Reply::ok(json.to_string().into_bytes())
            }
            Request::RegisterBuffer { size } => self.register(size, fd),
            Request::RegisterPeerMemory { address, probe } => {
                self.register_peer_memory(address, probe)
            }
            Request::MapPool | Request::LeaseValues { .. } | Request::ReleaseLease { .. }
                if !self.offers_pool_map() =>
            {
                Reply::error(
                    code::UNSUPPORTED,
                    "pool mapping needs the Unix socket, a client of the server's own user \
                     without a tenant's scope, a server outside cluster mode, and map_pool on",
                )
            }
            Request::MapPool => crate::pool_map::map_reply(&shared.store),
            Request::LeaseValues { items } => {
                self.client_leases.lease(store, &items, &shared.leasing)
            }
            Request::ReleaseLease { lease } => self.client_leases.release(lease),
            Request::BatchPutShm { .. }
            | Request::BatchGetShm { .. }
            | Request::BatchPutShmSegments { .. }
            | Request::BatchGetShmSegments { .. } => {
                // Private copies (for backends other than the store) come
                // out of the buffer budget, for the request's duration.
                let (heap, wait) = (&self.heap, shared.config.limits.buffer_wait);
                let mut bounce: Option<crate::limits::Held> = None;
                let mut grant = |bytes: usize| {
                    bounce = heap.take_within(bytes as u64, wait);
                    if bounce.is_none() {
                        shared
                            .metrics
                            .requests_refused_for_memory
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    bounce.is_some()
                };
                let spent = || buffers_spent(heap);
                let largest = shared.store.max_put_len();
                let region = |buffer: u32| self.buffers.get(&buffer).map(|b| &b.region);
                // Ranges of the client's own memory (cross-memory attach)
                // when the request names its id.
                let named = match &request {
                    Request::BatchPutShm { buffer, .. }
                    | Request::BatchGetShm { buffer, .. }
                    | Request::BatchPutShmSegments { buffer, .. }
                    | Request::BatchGetShmSegments { buffer, .. } => *buffer,
                    _ => unreachable!("matched above"),
                };
                let own = self.peer_memory.as_ref().filter(|(id, _)| *id == named);
                if let Some((_, peer)) = own {
                    let receiving = &self.receiving;
                    return match request {
                        Request::BatchPutShm { flags, items, .. } => crate::peer_memory::batch_put(
                            backend,
                            peer,
                            flags,
                            &one_segment(&items),
                            receiving,
                            &mut grant,
                            &spent,
                        ),
                        Request::BatchPutShmSegments { flags, items, .. } => {
                            crate::peer_memory::batch_put(
                                backend, peer, flags, &items, receiving, &mut grant, &spent,
                            )
                        }
                        Request::BatchGetShm { items, .. } => crate::peer_memory::batch_get(
                            backend,
                            peer,
                            &one_segment(&items),
                            largest,
                            &mut grant,
                            &spent,
                        ),
                        Request::BatchGetShmSegments { items, .. } => {
                            crate::peer_memory::batch_get(
                                backend, peer, &items, largest, &mut grant, &spent,
                            )
                        }
                        _ => unreachable!("matched above"),
                    };
                }
                match request {
                    Request::BatchPutShm {
                        buffer,
                        flags,
                        items,
                    } => match region(buffer) {
                        Some(r) => handlers::batch_put_shm(
                            backend,
                            r,
                            flags,
                            &one_segment(&items),
                            &mut grant,
                            &spent,
                        ),
                        None => unknown_buffer(buffer),
                    },
                    Request::BatchGetShm { buffer, items } => match region(buffer) {
                        Some(r) => handlers::batch_get_shm(
                            backend,
                            r,
                            &one_segment(&items),
                            largest,
                            &mut grant,
                            &spent,
                        ),
                        None => unknown_buffer(buffer),
                    },
                    Request::BatchPutShmSegments {
                        buffer,
                        flags,
                        items,
                    } => match region(buffer) {
                        Some(r) => {
                            handlers::batch_put_shm(backend, r, flags, &items, &mut grant, &spent)
                        }
                        None => unknown_buffer(buffer),
                    },
                    Request::BatchGetShmSegments { buffer, items } => match region(buffer) {
                        Some(r) => {
                            handlers::batch_get_shm(backend, r, &items, largest, &mut grant, &spent)
                        }
                        None => unknown_buffer(buffer),
                    },
                    _ => unreachable!("matched above"),
                }
            }
        }
    }

    /// Authenticates the peer (see `trust`) and fixes the connection's
    /// namespace.
    fn hello<'b>(&mut self, token: &[u8], namespace: &str) -> Reply<'b> {
        let shared = self.shared;
        // After a challenge the token field carries the client's proof.
        let credential = match &self.challenge {
            Some(issued) => crate::trust::Credential::Proof {
                issued,
                proof: token,
                namespace,
            },
            None => crate::trust::Credential::Token(token),
        };
        let slot = &self.slot;
        let scope = match shared.auth.admit_hello(
            &self.peer,
            &credential,
            shared.governor.guesses(),
            self.hello_deadline,
            &|| slot.closed_for_newcomer(),
        ) {
            Ok(scope) => scope,
            Err(why) => {
                shared.governor.guesses().count_refusal();
                return Reply::error(code::UNAUTHORIZED, why).closing();
            }
        };
        if let Some(why) = scope.refuses_namespace(namespace) {
            shared.governor.guesses().count_refusal();
            return Reply::error(code::UNAUTHORIZED, why).closing();
        }
        let principal = shared.auth.principal_of(&scope);
        // From here on this connection draws on its principal's shares
        // (what it held before hello is within the free bytes).
        self.heap = crate::limits::Budgets::new(&shared.buffers, principal);
        self.receiving = crate::limits::Budgets::new(&shared.receiving, principal);
        let mut held = self.heap.empty();
        held.try_set(self.held.amount());
        self.held = held;
        self.scope = scope;
        if let Err(why) = shared.admission.admit_hello(&mut self.slot, principal) {
            shared
                .metrics
                .connections_refused
                .fetch_add(1, Ordering::Relaxed);
            return Reply::error(code::LIMIT, why).closing();
        }
        let namespace = match shared.store.namespace(namespace) {
            Ok(namespace) => namespace,
            Err(e) => return Reply::error(code::INVALID_ARGUMENT, e.to_string()).closing(),
        };
        self.use_clock = shared.namespace_use.clock(namespace.name(), principal);
        self.namespace = Some(namespace);
        let limits = &shared.config.limits;
        Reply::ok(
            HelloReply {
                version: u32::from(protocol::VERSION),
                max_frame: limits.max_frame,
                max_batch: limits.max_batch,
                max_key_len: kvtier::MAX_KEY_LEN as u32,
                max_value: shared.store.max_put_len(),
                features: if self.offers_peer_memory() {
                    protocol::features::PEER_MEMORY
                } else {
                    0
                } | if self.offers_pool_map() {
                    protocol::features::POOL_MAP
                } else {
                    0
                },
            }
            .encode(),
        )
    }

    /// Whether MapPool, LeaseValues and ReleaseLease are served on this
    /// connection (see `pool_map`): same user (or root) over the Unix
    /// socket, full scope, no cluster (keys may live on other members), a
    /// shareable pool, and the operator's `map_pool`.
    fn offers_pool_map(&self) -> bool {
        self.shared.config.map_pool
            && self.peer.unix
            && self.peer.trusted_by_credentials
            && matches!(self.scope, crate::trust::Scope::Full)
            && self.shared.peers.is_none()
            && self.shared.store.pool_memory_file().is_some()
    }

    /// Whether RegisterPeerMemory is served on this connection.
    fn offers_peer_memory(&self) -> bool {
        self.shared.config.cross_memory && self.peer.unix && self.peer.pid.is_some()
    }

    /// Lets this connection's shared-memory ops name ranges of the client
    /// process's own memory (see `peer_memory`), once a probe read back
    /// what the client holds where it says. Once per connection: a second
    /// registration answers the same id.
    fn register_peer_memory<'b>(
        &mut self,
        address: u64,
        probe: &[u8; protocol::PEER_PROBE_LEN],
    ) -> Reply<'b> {
        let refuse = |status: i32, message: String| {
            self.shared
                .metrics
                .buffers_refused
                .fetch_add(1, Ordering::Relaxed);
            Reply::error(status, message)
        };
        let pid = match self.peer.pid {
            Some(pid) if self.offers_peer_memory() => pid,
            _ => {
                return refuse(
                    code::UNSUPPORTED,
                    "cross-memory transfers need the Unix socket, a client process this server                      can name, and cross_memory on"
                        .into(),
                )
            }
        };
        if let Some((id, _)) = &self.peer_memory {
            let mut w = Writer::default();
            w.u32(*id);
            return Reply::ok(w.buf);
        }
        match crate::peer_memory::PeerMemory::attach(pid, address, probe) {
            Ok(peer) => {
                let id = self.next_buffer;
                self.next_buffer += 1;
                self.peer_memory = Some((id, peer));
                let mut w = Writer::default();
                w.u32(id);
                Reply::ok(w.buf)
            }
            Err(why) => refuse(code::UNSUPPORTED, why),
        }
    }

    fn register<'b>(&mut self, size: u64, fd: Option<OwnedFd>) -> Reply<'b> {
        let shared = self.shared;
        let limits = &shared.config.limits;
        let refuse = |status: i32, message: String| {
            shared
                .metrics
                .buffers_refused
                .fetch_add(1, Ordering::Relaxed);
            Reply::error(status, message)
        };
        if !self.peer.unix {
            return refuse(
                code::UNSUPPORTED,
                "shared buffers need the Unix socket".into(),
            );
        }
        let Some(fd) = fd else {
            return refuse(
                code::INVALID_ARGUMENT,
                "no file descriptor came with the register request".into(),
            );
        };
        if size == 0 || usize::try_from(size).is_err() {
            return refuse(
                code::INVALID_ARGUMENT,
                format!("cannot register {size} bytes"),
            );
        }
        if self.buffers.len() >= limits.max_registered_buffers
            || self.registered_bytes.saturating_add(size) > limits.max_registered_bytes
        {
            return refuse(
                code::LIMIT,
                format!(
                    "registering {size} bytes would pass this connection's limit ({} bytes, {} \
                     buffers; {} bytes in {} buffers registered)",
                    limits.max_registered_bytes,
                    limits.max_registered_buffers,
                    self.registered_bytes,
                    self.buffers.len()
                ),
            );
        }
        let Some(budget) = shared.registered.try_take(size) else {
            return refuse(
                code::LIMIT,
                format!(
                    "registering {size} bytes would pass the server's limit on shared memory \
                     ({} of {} bytes registered by all clients)",
                    shared.registered.used(),
                    shared.registered.limit()
                ),
            );
        };
        let Some(buffer_slot) = shared.registered_buffers.try_take(1) else {
            return refuse(
                code::LIMIT,
                format!(
                    "the server holds {} shared buffers, the most all clients together may \
                     register (max_registered_buffers_total)",
                    shared.registered_buffers.limit()
                ),
            );
        };
        let region = match SharedRegion::map_client_buffer(fd, size as usize) {
            Ok(region) => region,
            Err(e) => {
                return refuse(
                    code::INVALID_ARGUMENT,
                    format!("refusing the shared buffer: {e}"),
                )
            }
        };
        let id = self.next_buffer;
        self.next_buffer += 1;
        shared
            .metrics
            .registered_buffers
            .fetch_add(1, Ordering::Relaxed);
        shared
            .metrics
            .registered_bytes
            .fetch_add(size, Ordering::Relaxed);
        self.buffers.insert(
            id,
            RegisteredBuffer {
                region,
                _budget: budget,
                _slot: buffer_slot,
                metrics: Arc::clone(&shared.metrics),
            },
        );
        self.registered_bytes += size;
        let mut w = Writer::default();
        w.u32(id);
        Reply::ok(w.buf)
    }
}

/// The router a request in `namespace` goes through, if any: in cluster
/// mode, keys other members own go to them (one hop at most: what peers
/// forward carries LOCAL_ONLY). With a shared directory every node's
/// index covers every node's flushed blocks and reads them from the file
/// system, and a put belongs in the node that computed it
/// (docs/cluster.md, "Shared storage"): nothing is forwarded. In its
/// bounded index mode a node indexes a share of the other writers' keys,
/// and a read it misses asks the member whose share holds the key.
fn router_for<'a>(
    shared: &'a Shared,
    namespace: &'a Namespace,
    store: &'a NamespacedStore,
    local_only: bool,
) -> Option<Router<'a>> {
    let config = shared.store.config();
    let shares_storage = config.configured_shared_dir().is_some();
    let by_share = shares_storage && config.configured_shared_index_share();
    match (&shared.peers, local_only || (shares_storage && !by_share)) {
        (Some(peers), false) => Router::new(peers, namespace.name()).map(|r| {
            let r = r.with_local(store);
            if by_share {
                r.by_index_share()
            } else {
                r
            }
        }),
        _ => None,
    }
}

/// The router a put in `namespace` goes through: `router_for`'s, unless
/// writes stay on this node (the bounded index mode keeps them where
/// they were computed).
fn routes_writes<'a>(
    shared: &'a Shared,
    namespace: &'a Namespace,
    store: &'a NamespacedStore,
    local_only: bool,
) -> Option<Router<'a>> {
    router_for(shared, namespace, store, local_only).filter(|r| !r.reads_by_index_share())
}

/// Whether `request` is a data request with a key some other member owns.
fn crosses_members(router: &Router<'_>, request: &Request<'_>) -> bool {
    let read = matches!(
        request,
        Request::BatchGet { .. }
            | Request::BatchExists { .. }
            | Request::PrefixLen { .. }
            | Request::BatchGetShm { .. }
            | Request::BatchGetShmSegments { .. }
    );
    if router.reads_by_index_share() && !read {
        // Writes stay on the node that computed them.
        return false;
    }
    let keys: Vec<&[u8]> = match request {
        Request::BatchPut { items, .. } => items.iter().map(|i| i.0).collect(),
        Request::BatchGet { items } => items.iter().map(|i| i.0).collect(),
        Request::BatchExists { keys } | Request::PrefixLen { keys } => keys.clone(),
        Request::Remove { key } => vec![*key],
        // What other members acknowledged must reach their disks too.
        Request::Flush => return true,
        // Every member holds some of the namespace's blocks.
        Request::RetireNamespace => return true,
        Request::DescribeNamespace { .. } => vec![kvtier::MANIFEST_KEY],
        Request::BatchPutShm { items, .. } | Request::BatchGetShm { items, .. } => {
            items.iter().map(|i| i.0).collect()
        }
        Request::BatchPutShmSegments { items, .. } | Request::BatchGetShmSegments { items, .. } => {
            items.iter().map(|i| i.0).collect()
        }
        _ => return false,
    };
    !router.all_local(&keys)
}

/// Records `reply` to `header`'s request and sends it; whether the
/// connection goes on (sent, and the reply does not close it). The record
/// comes first so that a client which has its reply also finds the request
/// counted in `/metrics` (recording after the send raced the client's next
/// scrape); the duration therefore ends where the reply starts to go out.
fn answer(
    transport: &mut Transport,
    metrics: &Metrics,
    header: &Header,
    reply: Reply<'_>,
    started: Instant,
) -> bool {
    metrics.record(header.op, started.elapsed(), reply.sample);
    let sent = send(
        transport,
        header.op,
        header.request_id,
        reply.status,
        &reply.body,
        &reply.tail,
        reply.pass,
    );
    sent.is_ok() && !reply.close
}

/// What a connection holding `bytes` of buffers takes from the budget.
fn charged(bytes: usize) -> u64 {
    bytes.saturating_sub(crate::limits::FREE_BUFFER_BYTES) as u64
}

/// Why a request found no room in the buffer budget.
fn buffers_spent(buffers: &crate::limits::Budgets) -> String {
    let (used, share) = buffers.used();
    format!(
        "the server's buffers for requests and replies are spent ({used} bytes in use{}; \
         max_buffer_bytes, or a tenant's share of it: {}); retry",
        share.map_or(String::new(), |s| format!(", {s} by this tenant")),
        buffers.limit()
    )
}

fn unknown_buffer<'b>(buffer: u32) -> Reply<'b> {
    Reply::error(
        code::INVALID_ARGUMENT,
        format!("buffer {buffer} is not registered on this connection"),
    )
}

/// Writes one response frame: header, body, then the value bytes; `pass`,
/// a descriptor, goes along with the frame's first bytes (Unix sockets; a
/// reply that has one is only built for those).
fn send(
    transport: &mut Transport,
    op: u16,
    request_id: u64,
    status: i32,
    body: &[u8],
    tail: &[&[u8]],
    pass: Option<OwnedFd>,
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
    match (transport as &mut Transport, &pass) {
        (Transport::Unix(stream), Some(fd)) => {
            use std::os::fd::AsRawFd;
            kvtier_wire::shm::send_with_fd(stream, &head, fd.as_raw_fd())?;
        }
        (transport, _) => transport.write_all(&head)?,
    }
    // The receiver holds its own copy of the descriptor now.
    drop(pass);
    for piece in tail {
        transport.write_all(piece)?;
    }
    transport.flush()
}

/// A key with its one `(offset, len)` range, held inline.
type OneSegment<'a> = (&'a [u8], [(u64, u64); 1]);

/// The single-range shared-memory ops in the segment ops' form.
fn one_segment<'a>(items: &[(&'a [u8], u64, u64)]) -> Vec<OneSegment<'a>> {
    items
        .iter()
        .map(|&(key, offset, len)| (key, [(offset, len)]))
        .collect()
}
