//! `kvtier serve`: the store as a service for many engine processes.
//!
//! A front end over `kvtier_node::Node`: the flags given are laid over the
//! TOML file (`--config`) as a table of the same keys, then the node's
//! defaults apply; `kvtier serve --help` and docs/server.md list every key.
//! What stays here is the process's: signals and the lines on stdout.

use kvtier::parse_size;
use kvtier_node::{Node, NodeConfig, Stopper};
use serde::Serialize;
use std::path::PathBuf;

#[derive(Debug, clap::Args, Serialize)]
pub struct ServeArgs {
    /// TOML file with any of: data_dir, listen, socket, admin, memory, disk,
    /// region_size, io_engine, io_depth, read_piece, eviction, flush, flush_yield, shared_dir,
    /// shared_read,
    /// shared_poll,
    /// io_deadline, io_deadline_local,
    /// shared_index, kv_events, kv_events_replay, kv_events_topic, kv_events_unauthenticated,
    /// kv_events_auth, auth_token, tenants_file, cross_memory, map_pool, the cluster's keys (cluster, etcd, etcd_ca,
    /// replicas, lease_ttl, advertise, peer_ca, adopt_after, ...) and the limits of
    /// docs/server.md (max_frame, max_batch, max_connections, ...). A flag given wins over
    /// the file.
    #[arg(long)]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Data directory. Default: ./kvtier-data.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data_dir: Option<PathBuf>,
    /// TCP address, or `off`. Default: 127.0.0.1:7700. A non-loopback
    /// address requires an auth token.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<String>,
    /// Unix socket path, or `off`. Default: kvtier.sock in the data
    /// directory (mode 0600).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub socket: Option<String>,
    /// Admin HTTP address (/metrics, /health, /stats), or `off`. Default:
    /// 127.0.0.1:7701.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub admin: Option<String>,
    /// Memory pool capacity. Default: 1 GiB.
    #[arg(long, value_parser = parse_size)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory: Option<u64>,
    /// Disk tier capacity (0: memory only). Default: 16 GiB.
    #[arg(long, value_parser = parse_size)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk: Option<u64>,
    /// Token clients must present (at least 16 bytes); also read from
    /// KVTIER_AUTH_TOKEN. Default: generated at first start and kept in
    /// <data_dir>/auth-token (mode 0600). TCP always needs it; Unix-socket
    /// clients of the server's own user do not.
    #[arg(long, env = "KVTIER_AUTH_TOKEN", hide_env_values = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub auth_token: Option<String>,
    /// PEM certificate chain for TLS on the TCP listener (with
    /// --tls-key). Required for a non-loopback --listen. Default: none.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert. Default: none.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_key: Option<PathBuf>,
    /// Most authenticated client connections. Default: 1024.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<usize>,
    /// Most connections waiting for their hello. Default: 64.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_pending_connections: Option<usize>,
    /// TOML file of tokens scoped to namespace prefixes (docs/server.md,
    /// "Tenants"). Default: none.
    #[arg(long)]
    #[serde(rename = "tenants_file", skip_serializing_if = "Option::is_none")]
    pub tenants: Option<PathBuf>,
    /// Most TCP connections from one address. Default: 256.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_connections_per_address: Option<usize>,
    /// Seconds a connection may take to say hello. Default: 5.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub handshake_timeout: Option<f64>,
    /// Seconds a connection may stay idle. Default: 3600.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idle_timeout: Option<f64>,
    /// Seconds a frame may take once started, before the rate allowance
    /// (see docs/server.md). Default: 10.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub frame_timeout: Option<f64>,
    /// io engine: uring or psync. Default: uring.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub io_engine: Option<String>,
    /// Keep the disk tier's log in this directory of a file system every
    /// node mounts (JuiceFS, CephFS, Lustre, NFS): this node writes under
    /// <dir>/nodes/<node id>/ and reads every other node's blocks there
    /// directly (docs/design.md, "Shared directory"); --disk is this
    /// node's share. Default: none (the log stays in the data directory).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shared_dir: Option<PathBuf>,
    /// How other nodes' files in --shared-dir are read: `auto` (by file
    /// system: through the page cache on network and FUSE file systems,
    /// O_DIRECT on local disks), `direct` or `buffered` (docs/design.md,
    /// "Read modes per mount"). Default: auto.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shared_read: Option<String>,
    /// Seconds between looks for other nodes' new blocks in --shared-dir.
    /// Default: 0.2.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shared_poll: Option<f64>,
    /// Seconds a caller waits at most on a file system that can stall (a
    /// network or FUSE file system: the shared directory): a read past it
    /// is a miss, a flush past it an error (docs/design.md, "Deadlines on
    /// storage I/O"). 0: none. Default: 5.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub io_deadline: Option<f64>,
    /// Which of the other nodes' blocks in --shared-dir this node indexes:
    /// `all`, or `share` (the bounded mode, needs --cluster: a share of
    /// them by the member list, asking the member whose share holds a key
    /// for the rest; for shared directories past what one node's memory
    /// indexes: docs/design.md, "The bounded index"). Default: all.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shared_index: Option<String>,
    /// Publish block events for cache-aware routers on this ZeroMQ PUB
    /// address (`tcp://HOST:PORT`), in vLLM's KV-event format
    /// (docs/integrations.md, "KV events"). Default: off.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<String>,
    /// The ROUTER address answering replay requests for missed event
    /// batches (`tcp://HOST:PORT`). Default: off.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_events_replay: Option<String>,
    /// Topic prefix of the events; a batch's topic is
    /// `<prefix>@<namespace>`. Default: kv@<node id>.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_events_topic: Option<String>,
    /// When write-through values reach the disk: `write-through` (as soon
    /// as possible) or `on-demand` (on flush, a durable put, pool pressure
    /// or close). Default: write-through.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub flush: Option<String>,
    /// Seconds write-through writes wait at most for gets to pause (none
    /// started for 10 ms) before they are written, while their values take
    /// under a quarter of --memory, so loads do not share the memory bus
    /// and the disk with background writes; a flush, a durable put, pool
    /// pressure and stopping never wait (docs/design.md, "Write-back
    /// yields to reads"). 0: never wait. Default: 1.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub flush_yield: Option<f64>,
    #[command(flatten)]
    #[serde(flatten)]
    pub cluster: crate::cluster::ClusterArgs,
}

/// Blocks SIGINT and SIGTERM in this thread and every thread spawned
/// after it, so no worker is interrupted mid-request; `wait_for_signals`
/// then takes them on a thread of its own.
fn block_signals() -> libc::sigset_t {
    // SAFETY: building and applying a signal mask for this process's
    // threads; threads spawned later inherit it.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

/// A thread that stops the node at SIGINT or SIGTERM (signals that came
/// while the node started are pending and taken at once).
fn wait_for_signals(set: libc::sigset_t, stop: Stopper) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("kvtier-signals".into())
        .spawn(move || loop {
            let mut signal = 0;
            // SAFETY: waiting on the mask built by `block_signals`.
            if unsafe { libc::sigwait(&set, &mut signal) } == 0 {
                tracing::info!(
                    signal,
                    "stopping: finishing in-flight requests, flushing, closing"
                );
                eprintln!("kvtier: signal {signal} received, shutting down");
                stop.stop();
            }
        })?;
    Ok(())
}

pub fn run(args: &ServeArgs) -> Result<(), Box<dyn std::error::Error>> {
    let file = match &args.config {
        Some(path) => NodeConfig::from_file(path)?,
        None => NodeConfig::default(),
    };
    let config = file.layered(args)?;
    let signals = block_signals();
    let node = Node::start(config)?;
    say(&node.serving_line());
    if node.bound().socket.is_some() {
        note_shared_memory_pages();
    }
    wait_for_signals(signals, node.stopper())?;
    node.wait()?;
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
