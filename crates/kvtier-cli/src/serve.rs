//! `kvtier serve`: the store as a service for many engine processes.
//!
//! Settings come from flags, then a TOML file (`--config`), then defaults;
//! `kvtier serve --help` and docs/server.md list every key.

use kvtier::parse_size;
use kvtier::{Config, EvictionPolicy, IoEngineKind, Store};
use kvtier_server::{Server, ServerConfig};
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// TOML file with any of: data_dir, listen, socket, admin, memory, disk,
    /// region_size, io_engine, io_depth, read_piece, eviction, flush, shared_dir, shared_poll,
    /// io_deadline, io_deadline_local,
    /// shared_index, kv_events, kv_events_replay, kv_events_topic, kv_events_unauthenticated,
    /// kv_events_auth,
    /// auth_token, and the limits of
    /// docs/server.md (max_frame, max_batch, max_connections, ...).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Data directory. Default: ./kvtier-data.
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// TCP address, or `off`. Default: 127.0.0.1:7700. A non-loopback
    /// address requires an auth token.
    #[arg(long)]
    pub listen: Option<String>,
    /// Unix socket path, or `off`. Default: kvtier.sock in the data
    /// directory (mode 0600).
    #[arg(long)]
    pub socket: Option<String>,
    /// Admin HTTP address (/metrics, /health, /stats), or `off`. Default:
    /// 127.0.0.1:7701.
    #[arg(long)]
    pub admin: Option<String>,
    /// Memory pool capacity. Default: 1 GiB.
    #[arg(long, value_parser = parse_size)]
    pub memory: Option<u64>,
    /// Disk tier capacity (0: memory only). Default: 16 GiB.
    #[arg(long, value_parser = parse_size)]
    pub disk: Option<u64>,
    /// Token clients must present (at least 16 bytes); also read from
    /// KVTIER_AUTH_TOKEN. Default: generated at first start and kept in
    /// <data_dir>/auth-token (mode 0600). TCP always needs it; Unix-socket
    /// clients of the server's own user do not.
    #[arg(long, env = "KVTIER_AUTH_TOKEN", hide_env_values = true)]
    pub auth_token: Option<String>,
    /// PEM certificate chain for TLS on the TCP listener (with
    /// --tls-key). Required for a non-loopback --listen. Default: none.
    #[arg(long)]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert. Default: none.
    #[arg(long)]
    pub tls_key: Option<PathBuf>,
    /// Most authenticated client connections. Default: 1024.
    #[arg(long)]
    pub max_connections: Option<usize>,
    /// Most connections waiting for their hello. Default: 64.
    #[arg(long)]
    pub max_pending_connections: Option<usize>,
    /// TOML file of tokens scoped to namespace prefixes (docs/server.md,
    /// "Tenants"). Default: none.
    #[arg(long)]
    pub tenants: Option<PathBuf>,
    /// Most TCP connections from one address. Default: 256.
    #[arg(long)]
    pub max_connections_per_address: Option<usize>,
    /// Seconds a connection may take to say hello. Default: 5.
    #[arg(long)]
    pub handshake_timeout: Option<f64>,
    /// Seconds a connection may stay idle. Default: 3600.
    #[arg(long)]
    pub idle_timeout: Option<f64>,
    /// Seconds a frame may take once started, before the rate allowance
    /// (see docs/server.md). Default: 10.
    #[arg(long)]
    pub frame_timeout: Option<f64>,
    /// io engine: uring or psync. Default: uring.
    #[arg(long)]
    pub io_engine: Option<String>,
    /// Keep the disk tier's log in this directory of a file system every
    /// node mounts (JuiceFS, CephFS, Lustre, NFS): this node writes under
    /// <dir>/nodes/<node id>/ and reads every other node's blocks there
    /// directly (docs/design.md, "Shared directory"); --disk is this
    /// node's share. Default: none (the log stays in the data directory).
    #[arg(long)]
    pub shared_dir: Option<PathBuf>,
    /// Seconds between looks for other nodes' new blocks in --shared-dir.
    /// Default: 0.2.
    #[arg(long)]
    pub shared_poll: Option<f64>,
    /// Seconds a caller waits at most on a file system that can stall (a
    /// network or FUSE file system: the shared directory): a read past it
    /// is a miss, a flush past it an error (docs/design.md, "Deadlines on
    /// storage I/O"). 0: none. Default: 5.
    #[arg(long)]
    pub io_deadline: Option<f64>,
    /// Which of the other nodes' blocks in --shared-dir this node indexes:
    /// `all`, or `share` (the bounded mode, needs --cluster: a share of
    /// them by the member list, asking the member whose share holds a key
    /// for the rest; for shared directories past what one node's memory
    /// indexes: docs/design.md, "The bounded index"). Default: all.
    #[arg(long)]
    pub shared_index: Option<String>,
    /// Publish block events for cache-aware routers on this ZeroMQ PUB
    /// address (`tcp://HOST:PORT`), in vLLM's KV-event format
    /// (docs/integrations.md, "KV events"). Default: off.
    #[arg(long)]
    pub kv_events: Option<String>,
    /// The ROUTER address answering replay requests for missed event
    /// batches (`tcp://HOST:PORT`). Default: off.
    #[arg(long)]
    pub kv_events_replay: Option<String>,
    /// Topic prefix of the events; a batch's topic is
    /// `<prefix>@<namespace>`. Default: kv@<node id>.
    #[arg(long)]
    pub kv_events_topic: Option<String>,
    /// When write-through values reach the disk: `write-through` (as soon
    /// as possible) or `on-demand` (on flush, a durable put, pool pressure
    /// or close). Default: write-through.
    #[arg(long)]
    pub flush: Option<String>,
    #[command(flatten)]
    pub cluster: crate::cluster::ClusterArgs,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    data_dir: Option<PathBuf>,
    listen: Option<String>,
    socket: Option<String>,
    admin: Option<String>,
    memory: Option<String>,
    disk: Option<String>,
    region_size: Option<String>,
    io_engine: Option<String>,
    io_depth: Option<u32>,
    read_piece: Option<String>,
    eviction: Option<String>,
    shared_dir: Option<PathBuf>,
    shared_poll: Option<f64>,
    io_deadline: Option<f64>,
    io_deadline_local: Option<bool>,
    shared_index: Option<String>,
    kv_events: Option<String>,
    kv_events_replay: Option<String>,
    kv_events_topic: Option<String>,
    kv_events_unauthenticated: Option<bool>,
    kv_events_auth: Option<String>,
    flush: Option<String>,
    auth_token: Option<String>,
    max_frame: Option<String>,
    max_batch: Option<u32>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    max_connections: Option<usize>,
    max_pending_connections: Option<usize>,
    reserved_local_connections: Option<usize>,
    max_connections_per_address: Option<usize>,
    max_lobby_connections: Option<usize>,
    max_lobby_per_address: Option<usize>,
    max_failed_hellos_per_second: Option<u32>,
    admin_allowed_hosts: Option<Vec<String>>,
    tenants_file: Option<PathBuf>,
    handshake_timeout: Option<f64>,
    idle_timeout: Option<f64>,
    frame_timeout: Option<f64>,
    min_frame_rate: Option<String>,
    max_registered: Option<String>,
    max_registered_total: Option<String>,
    max_registered_buffers_total: Option<usize>,
    max_receiving: Option<String>,
    max_buffer_bytes: Option<String>,
    tenant_share_percent: Option<u8>,
    tenant_reserve_percent: Option<u8>,
    max_admin_connections: Option<usize>,
    admin_timeout: Option<f64>,
    peer_timeout: Option<f64>,
}

fn seconds(value: Option<f64>, what: &str) -> Result<Option<std::time::Duration>, String> {
    value
        .map(|s| {
            std::time::Duration::try_from_secs_f64(s)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or_else(|| format!("{what}: {s} is not a positive number of seconds"))
        })
        .transpose()
}

fn address(text: &str, what: &str) -> Result<Option<SocketAddr>, String> {
    if text == "off" {
        return Ok(None);
    }
    text.parse()
        .map(Some)
        .map_err(|e| format!("{what} {text:?}: {e}"))
}

/// Whether the event feed asks its peers for a token (`kv_events_auth`).
fn event_feed_plain(text: Option<&str>) -> Result<bool, String> {
    match text {
        None | Some("none") => Ok(false),
        Some("plain") => Ok(true),
        Some(other) => Err(format!(
            "kv_events_auth must be \"none\" or \"plain\", not {other:?}"
        )),
    }
}

/// The event feed's subscribers read namespaces' block hashes (prompt
/// identities) and names. Without authentication it is served only where
/// every reader is already trusted (loopback, no tenants to keep apart);
/// with `kv_events_auth = "plain"` a subscriber logs in with a token and
/// sees what the token opens, but ZMTP PLAIN sends the token in the clear,
/// so it stays on loopback too (reach it through an SSH tunnel or a VPN).
/// `kv_events_unauthenticated` publishes it anyway, knowingly
/// (docs/server.md, threat model).
fn check_event_feed_exposure(
    publish: SocketAddr,
    replay: Option<SocketAddr>,
    tenants: bool,
    plain: bool,
    unauthenticated: bool,
) -> Result<(), String> {
    if unauthenticated {
        return Ok(());
    }
    for (what, at) in [("kv_events", Some(publish)), ("kv_events_replay", replay)] {
        if let Some(at) = at.filter(|a| !a.ip().is_loopback()) {
            return Err(format!(
                "{what} {at}: the event feed shows namespaces' block hashes, which identify \
                 prompts, and ZeroMQ's PLAIN login would send a token in the clear; bind it to \
                 loopback (reach it through an SSH tunnel or a VPN), or set \
                 kv_events_unauthenticated = true in the config file to publish it off the host \
                 knowingly"
            ));
        }
    }
    if tenants && !plain {
        return Err(
            "without authentication every local subscriber of the event feed would \
                    read every tenant's namespaces and block hashes; set kv_events_auth = \
                    \"plain\" (subscribers log in with a token and see what it opens), leave \
                    kv_events off with --tenants, or set kv_events_unauthenticated = true in the \
                    config file knowingly"
                .into(),
        );
    }
    Ok(())
}

fn zmq_address(text: &str, what: &str) -> Result<SocketAddr, String> {
    let bare = text.strip_prefix("tcp://").unwrap_or(text);
    if bare.contains("://") {
        return Err(format!("{what} {text:?}: only tcp:// endpoints are served"));
    }
    std::net::ToSocketAddrs::to_socket_addrs(bare)
        .map_err(|e| format!("{what} {text:?}: {e}"))?
        .next()
        .ok_or_else(|| format!("{what} {text:?}: resolves to no address"))
}

fn size(text: &Option<String>, what: &str) -> Result<Option<u64>, String> {
    text.as_deref()
        .map(parse_size)
        .transpose()
        .map_err(|e| format!("{what}: {e}"))
}

/// Blocks SIGINT and SIGTERM in every thread and returns a thread that
/// waits for either, so no worker is interrupted mid-request.
fn signal_waiter(stop: Arc<std::sync::atomic::AtomicBool>) -> std::io::Result<()> {
    // SAFETY: building and applying a signal mask for this process's
    // threads; threads spawned later inherit it.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    };
    std::thread::Builder::new()
        .name("kvtier-signals".into())
        .spawn(move || loop {
            let mut signal = 0;
            // SAFETY: waiting on the mask built above.
            if unsafe { libc::sigwait(&set, &mut signal) } == 0 {
                tracing::info!(
                    signal,
                    "stopping: finishing in-flight requests, flushing, closing"
                );
                eprintln!("kvtier: signal {signal} received, shutting down");
                stop.store(true, Ordering::Release);
            }
        })?;
    Ok(())
}

pub fn run(args: &ServeArgs) -> Result<(), Box<dyn std::error::Error>> {
    let file: FileConfig = match &args.config {
        Some(path) => toml::from_str(
            &std::fs::read_to_string(path)
                .map_err(|e| format!("reading {}: {e}", path.display()))?,
        )
        .map_err(|e| format!("{}: {e}", path.display()))?,
        None => FileConfig::default(),
    };
    let data_dir = args
        .data_dir
        .clone()
        .or(file.data_dir)
        .unwrap_or_else(|| "./kvtier-data".into());
    let listen = address(
        args.listen
            .as_deref()
            .or(file.listen.as_deref())
            .unwrap_or("127.0.0.1:7700"),
        "listen address",
    )?;
    let admin = address(
        args.admin
            .as_deref()
            .or(file.admin.as_deref())
            .unwrap_or("127.0.0.1:7701"),
        "admin address",
    )?;
    let socket = match args.socket.as_deref().or(file.socket.as_deref()) {
        Some("off") => None,
        Some(path) => Some(PathBuf::from(path)),
        None => Some(data_dir.join("kvtier.sock")),
    };
    let auth_token = args
        .auth_token
        .clone()
        .or(file.auth_token)
        .filter(|t| !t.is_empty());
    let mut config = Config::new(&data_dir);
    if let Some(memory) = args.memory.or(size(&file.memory, "memory")?) {
        config = config.memory_capacity(memory);
    }
    if let Some(disk) = args.disk.or(size(&file.disk, "disk")?) {
        config = config.disk_capacity(disk);
    }
    if let Some(region) = size(&file.region_size, "region_size")? {
        config = config.region_size(region);
    }
    if let Some(engine) = args.io_engine.as_deref().or(file.io_engine.as_deref()) {
        config = config.io_engine(IoEngineKind::parse(engine)?);
    }
    if let Some(depth) = file.io_depth {
        config = config.io_depth(depth);
    }
    if let Some(piece) = size(&file.read_piece, "read_piece")? {
        config = config.read_piece(piece);
    }
    if let Some(policy) = &file.eviction {
        config = config.eviction(EvictionPolicy::parse(policy)?);
    }
    if let Some(dir) = args.shared_dir.clone().or(file.shared_dir) {
        config = config.shared_dir(dir);
    }
    if let Some(every) = seconds(args.shared_poll.or(file.shared_poll), "shared_poll")? {
        config = config.shared_poll(every);
    }
    match args.io_deadline.or(file.io_deadline) {
        Some(0.0) => config = config.io_deadline(std::time::Duration::ZERO),
        other => {
            if let Some(deadline) = seconds(other, "io_deadline")? {
                config = config.io_deadline(deadline);
            }
        }
    }
    if let Some(local) = file.io_deadline_local {
        config = config.io_deadline_local(local);
    }
    match args
        .shared_index
        .as_deref()
        .or(file.shared_index.as_deref())
    {
        None | Some("all") => {}
        Some("share") => {
            if args.cluster.cluster.is_none() {
                return Err(
                    "--shared-index share divides the index between cluster members: \
                            it needs --cluster"
                        .into(),
                );
            }
            config = config.shared_index_share(true);
        }
        Some(other) => {
            return Err(format!("--shared-index must be `all` or `share`, not {other:?}").into())
        }
    }
    // TCP always needs a token: without one given, the data directory
    // keeps a generated one (0600) for the clients of this host to read.
    let mut token_file = None;
    let auth_token = match auth_token {
        Some(token) => Some(token),
        None if listen.is_some_and(|a| !a.ip().is_loopback()) => {
            return Err(format!(
                "refusing to listen on non-loopback {} without an auth token: set --auth-token \
                 or KVTIER_AUTH_TOKEN to a token of your own (at least 16 bytes) to serve other hosts",
                listen.expect("checked")
            )
            .into());
        }
        None if listen.is_some() => {
            // Private from the start (0700, as the store creates it): a
            // directory made with the umask's 0755 here would be "tightened"
            // with a warning by the store a moment later.
            kvtier::private_files::create_dir(&data_dir)
                .map_err(|e| format!("creating {}: {e}", data_dir.display()))?;
            let (token, path) = kvtier_server::data_dir_token(&data_dir)
                .map_err(|e| format!("the auth token in {}: {e}", data_dir.display()))?;
            token_file = Some(path);
            Some(token)
        }
        None => None,
    };
    let tls = match (
        args.tls_cert.clone().or(file.tls_cert),
        args.tls_key.clone().or(file.tls_key),
    ) {
        (Some(cert), Some(key)) => Some(kvtier_wire::tls::server_config(&cert, &key)?),
        (None, None) => None,
        _ => return Err("TLS needs both --tls-cert and --tls-key".into()),
    };
    let mut server_config = ServerConfig {
        listen,
        socket,
        admin,
        auth_token,
        tls,
        ..ServerConfig::default()
    };
    let limits = &mut server_config.limits;
    if let Some(max_frame) = size(&file.max_frame, "max_frame")? {
        limits.max_frame = max_frame;
    }
    if let Some(max_batch) = file.max_batch {
        limits.max_batch = max_batch;
    }
    if let Some(n) = args.max_connections.or(file.max_connections) {
        limits.max_connections = n;
    }
    if let Some(n) = args
        .max_pending_connections
        .or(file.max_pending_connections)
    {
        limits.max_pending_connections = n;
    }
    if let Some(n) = file.reserved_local_connections {
        limits.reserved_local_connections = n;
    }
    if let Some(n) = file.max_lobby_connections {
        limits.max_lobby_connections = n;
    }
    if let Some(n) = file.max_lobby_per_address {
        limits.max_lobby_per_address = n;
    }
    if let Some(n) = args
        .max_connections_per_address
        .or(file.max_connections_per_address)
    {
        limits.max_connections_per_address = n;
    }
    if let Some(n) = file.max_failed_hellos_per_second {
        limits.max_failed_hellos_per_second = n;
    }
    if let Some(t) = seconds(
        args.handshake_timeout.or(file.handshake_timeout),
        "handshake_timeout",
    )? {
        limits.handshake_timeout = t;
    }
    if let Some(t) = seconds(args.idle_timeout.or(file.idle_timeout), "idle_timeout")? {
        limits.idle_timeout = t;
    }
    if let Some(t) = seconds(args.frame_timeout.or(file.frame_timeout), "frame_timeout")? {
        limits.frame_timeout = t;
    }
    if let Some(rate) = size(&file.min_frame_rate, "min_frame_rate")? {
        limits.min_frame_rate = rate;
    }
    if let Some(bytes) = size(&file.max_registered, "max_registered")? {
        limits.max_registered_bytes = bytes;
    }
    if let Some(bytes) = size(&file.max_buffer_bytes, "max_buffer_bytes")? {
        limits.max_buffer_bytes = Some(bytes);
    }
    if let Some(percent) = file.tenant_share_percent {
        if !(1..=100).contains(&percent) {
            return Err(format!("tenant_share_percent {percent}: give 1 to 100").into());
        }
        limits.tenant_share_percent = percent;
    }
    if let Some(percent) = file.tenant_reserve_percent {
        if percent > 90 {
            return Err(format!(
                "tenant_reserve_percent {percent}: give 0 to 90 (the tenants need some of the budget)"
            )
            .into());
        }
        limits.tenant_reserve_percent = percent;
    }
    if let Some(bytes) = size(&file.max_receiving, "max_receiving")? {
        limits.max_receiving_bytes = Some(bytes);
    }
    if let Some(n) = file.max_registered_buffers_total {
        limits.max_registered_buffers_total = n;
    }
    if let Some(bytes) = size(&file.max_registered_total, "max_registered_total")? {
        limits.max_registered_bytes_total = bytes;
    }
    if let Some(n) = file.max_admin_connections {
        limits.max_admin_connections = n;
    }
    if let Some(t) = seconds(file.admin_timeout, "admin_timeout")? {
        limits.admin_timeout = t;
    }
    if let Some(t) = seconds(file.peer_timeout, "peer_timeout")? {
        limits.peer_timeout = t;
    }

    match args.flush.as_deref().or(file.flush.as_deref()) {
        None | Some("write-through") => {}
        Some("on-demand") => config = config.flush_policy(kvtier::FlushPolicy::OnDemand),
        Some(other) => {
            return Err(format!("flush {other:?}: expected write-through or on-demand").into())
        }
    }
    let events_at = args.kv_events.as_deref().or(file.kv_events.as_deref());
    let events = match events_at {
        Some(at) => {
            let publish = zmq_address(at, "kv_events")?;
            let replay = args
                .kv_events_replay
                .as_deref()
                .or(file.kv_events_replay.as_deref())
                .map(|r| zmq_address(r, "kv_events_replay"))
                .transpose()?;
            let tenants = args.tenants.is_some() || file.tenants_file.is_some();
            let plain = event_feed_plain(file.kv_events_auth.as_deref())?;
            check_event_feed_exposure(
                publish,
                replay,
                tenants,
                plain,
                file.kv_events_unauthenticated.unwrap_or(false),
            )?;
            // 65 536 events of about 100 bytes: 6 MiB, over a second of
            // 64 KiB puts at 3 GB/s for the publisher to fall behind by
            // before events are dropped.
            let (sink, rx) = kvtier::EventSink::channel(1 << 16);
            config = config.events(Arc::clone(&sink));
            Some((publish, replay, plain, sink, rx))
        }
        None if args.kv_events_replay.is_some() || file.kv_events_replay.is_some() => {
            return Err("kv_events_replay needs kv_events".into())
        }
        None if file.kv_events_auth.is_some() => {
            return Err("kv_events_auth needs kv_events".into())
        }
        None => None,
    };

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    signal_waiter(Arc::clone(&stop))?;
    let store = Arc::new(Store::open(config)?);
    if let Some(path) = args.tenants.clone().or(file.tenants_file.clone()) {
        server_config.tenants =
            kvtier_server::read_tenants(&path).map_err(|e| format!("the tenants file: {e}"))?;
    }
    let publisher = match events {
        Some((publish, replay, plain, sink, rx)) => {
            let mut events =
                kvtier_server::kv_events::KvEventsConfig::new(publish, store.node_id());
            events.replay = replay;
            if plain {
                // The same tokens as the data port: the server's opens every
                // namespace, a tenant's its own.
                let auth = kvtier_server::Auth::new(server_config.auth_token.as_deref())
                    .and_then(|a| a.with_tenants(server_config.tenants.clone()))
                    .map_err(|e| format!("kv_events_auth: {e}"))?;
                if !auth.has_token() {
                    return Err("kv_events_auth = \"plain\" logs subscribers in with the \
                                server's token: serve TCP (--listen) or give --auth-token"
                        .into());
                }
                events.credentials = Some(Arc::new(auth));
            }
            if let Some(topic) = args
                .kv_events_topic
                .clone()
                .or(file.kv_events_topic.clone())
            {
                events.topic = topic;
            }
            let publisher = kvtier_server::kv_events::KvEventPublisher::start(events, sink, rx)
                .map_err(|e| format!("kv events on {publish}: {e}"))?;
            Some(Arc::new(publisher))
        }
        None => None,
    };
    server_config.kv_events = publisher.clone();
    let stats = store.stats();
    let mut node = crate::cluster::prepare(
        &args.cluster,
        store.node_id(),
        stats.memory_capacity + stats.disk_capacity,
        server_config.auth_token.as_deref(),
    )?;
    server_config.cluster = node.as_ref().map(|n| Arc::clone(&n.view));
    server_config.peer_tls_ca = args.cluster.peer_ca.clone();
    server_config.admin_allowed_hosts = file.admin_allowed_hosts.clone().unwrap_or_default();
    let adopter = match (&node, store.config().configured_shared_dir()) {
        (Some(node), Some(shared)) => Some(spawn_adopter(
            Arc::clone(&node.view),
            shared.to_path_buf(),
            data_dir.join("adopt-scratch"),
            seconds(Some(args.cluster.adopt_after), "adopt_after")?.unwrap_or_default(),
            Arc::clone(&stop),
        )?),
        _ => None,
    };
    let share_keeper = match &node {
        Some(node) if store.config().configured_shared_index_share() => Some(spawn_share_keeper(
            Arc::clone(&node.view),
            Arc::clone(&store),
            Arc::clone(&stop),
        )?),
        _ => None,
    };
    let server = Server::new(Arc::clone(&store), server_config)?;
    let server_stop = server.stop_flag();
    let stop_seen = Arc::clone(&stop);
    let watcher = std::thread::spawn(move || {
        while !stop_seen.load(Ordering::Acquire) {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        server_stop.store(true, Ordering::Release);
    });
    let mut joined = Ok(());
    server.run(|bound| {
        if let Some(node) = &mut node {
            joined = node.join(&args.cluster, bound.tcp, bound.tls, bound.admin);
            if joined.is_err() {
                stop.store(true, Ordering::Release);
                return;
            }
        }
        let mut parts = Vec::new();
        if let Some(tcp) = bound.tcp {
            let scheme = if bound.tls { "tls" } else { "tcp" };
            parts.push(format!("{scheme}://{tcp}"));
        }
        if let Some(socket) = &bound.socket {
            parts.push(format!("unix://{}", socket.display()));
        }
        if let Some(admin) = bound.admin {
            parts.push(format!("admin http://{admin}"));
        }
        if let Some(path) = &token_file {
            parts.push(format!("TCP token in {}", path.display()));
        }
        if let Some(p) = &publisher {
            parts.push(format!("kv events tcp://{}", p.publish_addr()));
            if let Some(replay) = p.replay_addr() {
                parts.push(format!("replay tcp://{replay}"));
            }
        }
        if let Some(node) = &node {
            let me = node.view.me();
            parts.push(format!(
                "cluster {} as node {} at {}",
                node.view.name, me.id, me.address
            ));
        }
        say(&format!(
            "kvtier serving {} from {}: {}",
            data_dir.display(),
            store.stats().io_engine,
            parts.join(", ")
        ));
        if bound.socket.is_some() {
            note_shared_memory_pages();
        }
    })?;
    let _ = watcher.join();
    if let Some(adopter) = adopter {
        let _ = adopter.join();
    }
    if let Some(keeper) = share_keeper {
        let _ = keeper.join();
    }
    if let Some(node) = node {
        node.leave();
    }
    joined?;
    store.close()?;
    say("kvtier stopped cleanly");
    Ok(())
}

/// A line on standard output, for whoever reads it: a closed pipe (a
/// supervisor gone, `| head -1`) must not turn a clean stop into a panic.
fn say(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}").and_then(|()| out.flush());
}

/// Shared-memory clients' buffers take huge pages only where the system
/// allows them for shared memory; with 4 KiB pages, copies into them run
/// slower (gets 0.87 of a huge-paged copy here, 0.95 with them:
/// docs/server.md). Says so once, at start, after the serving line.
fn note_shared_memory_pages() {
    const SETTING: &str = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";
    if let Ok(text) = std::fs::read_to_string(SETTING) {
        if text.contains("[never]") || text.contains("[deny]") {
            say(&format!(
                "note: shared-memory buffers get 4 KiB pages ({SETTING} is never); \
                 `echo advise > {SETTING}` (as root) gives them huge pages and faster copies"
            ));
        }
    }
}

/// The bounded index mode: gives the store its share of the other
/// writers' keys whenever the member list changes (the keys whose
/// `index_share_owner` is this node, the owner every member's router asks).
/// Never from an empty or stale view, or one without this node: the share
/// held stays (a stale share costs misses, not wrong bytes).
fn spawn_share_keeper(
    view: Arc<kvtier_wire::cluster::ClusterView>,
    store: Arc<kvtier::Store>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("kvtier-share".into())
        .spawn(move || {
            // Members (id, capacity) of the share given last.
            let mut given: Option<Vec<(String, u64)>> = None;
            while !stop.load(Ordering::Acquire) {
                std::thread::sleep(std::time::Duration::from_millis(100));
                let members = view.members();
                let me = view.me().id;
                let fresh = view
                    .view_age()
                    .is_some_and(|age| age < std::time::Duration::from_secs(30));
                if members.is_empty() || !fresh || !members.iter().any(|m| m.id == me) {
                    continue;
                }
                let mut now: Vec<(String, u64)> =
                    members.iter().map(|m| (m.id.clone(), m.capacity)).collect();
                now.sort();
                if given.as_ref() == Some(&now) {
                    continue;
                }
                let share_members = Arc::clone(&members);
                let share_me = me.clone();
                let set = store.set_index_share(move |hash| {
                    kvtier_wire::cluster::index_share_owner(hash, &share_members)
                        .is_some_and(|m| m.id == share_me)
                });
                match set {
                    Ok(()) => {
                        tracing::info!(
                            members = now.len(),
                            "the index share follows the member list"
                        );
                        given = Some(now);
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "cannot set the index share");
                        return;
                    }
                }
            }
        })
}

/// Cluster mode with a shared directory: collects the logs of writers that
/// are no longer members and have been idle for `grace` (docs/design.md,
/// "Dead writers"). Membership (etcd's leases) says who is dead; the
/// writer's lock on the shared file system lets one collector at a time
/// in. Never acts on an empty or stale view.
fn spawn_adopter(
    view: Arc<kvtier_wire::cluster::ClusterView>,
    shared: PathBuf,
    scratch: PathBuf,
    grace: std::time::Duration,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    let every = (grace / 4).clamp(
        std::time::Duration::from_secs(1),
        std::time::Duration::from_secs(30),
    );
    std::thread::Builder::new()
        .name("kvtier-adopter".into())
        .spawn(move || {
            let mut next = std::time::Instant::now() + every;
            while !stop.load(Ordering::Acquire) {
                std::thread::sleep(std::time::Duration::from_millis(50));
                if std::time::Instant::now() < next {
                    continue;
                }
                next = std::time::Instant::now() + every;
                let members = view.members();
                let fresh = view
                    .view_age()
                    .is_some_and(|age| age < std::time::Duration::from_secs(30));
                if members.is_empty() || !fresh {
                    continue;
                }
                let live: std::collections::HashSet<String> =
                    members.iter().map(|m| m.id.clone()).collect();
                if kvtier::private_files::create_dir(&scratch).is_err() {
                    continue;
                }
                match kvtier::collect_dead_writers_where(&shared, grace, &scratch, |node| {
                    !live.contains(node)
                }) {
                    Ok(done) => {
                        for writer in done {
                            match writer.outcome {
                                kvtier::Collection::Collected { regions, bytes, kept_removals, directory_removed } => tracing::warn!(
                                    writer = %writer.node,
                                    regions,
                                    bytes,
                                    kept_removals,
                                    directory_removed,
                                    "collected the log of a writer that left the cluster"
                                ),
                                kvtier::Collection::Failed(why) => tracing::warn!(writer = %writer.node, %why, "could not collect the log of a writer that left the cluster; will retry"),
                                kvtier::Collection::Recent | kvtier::Collection::Alive => {}
                            }
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "looking for dead writers in the shared directory"),
                }
                let _ = std::fs::remove_dir_all(&scratch);
            }
        })
}
