//! A whole node from one configuration: `Node::start` composes the store,
//! the KV-event feed, the server, cluster membership, the index-share
//! keeper and the dead-writer adopter, in the order each needs the one
//! before; `Node::wait` takes them down in reverse.

use crate::feed_config::{FeedLogin, FeedPlan};
use crate::membership::ClusterMember;
use crate::{adopter, feed_config, membership, share_keeper, NodeConfig};
use kvtier::Store;
use kvtier_events::{CurveKeys, KvEventPublisher, KvEventsConfig};
use kvtier_server::{BoundAddrs, Server, StatusSection};
use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;

/// Why a node did not start or did not stop cleanly, in words for the
/// operator.
#[derive(Debug)]
pub struct NodeError(String);

impl std::fmt::Display for NodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NodeError {}

impl From<String> for NodeError {
    fn from(why: String) -> NodeError {
        NodeError(why)
    }
}

impl From<&str> for NodeError {
    fn from(why: &str) -> NodeError {
        NodeError(why.into())
    }
}

impl From<io::Error> for NodeError {
    fn from(e: io::Error) -> NodeError {
        NodeError(e.to_string())
    }
}

impl From<kvtier::Error> for NodeError {
    fn from(e: kvtier::Error) -> NodeError {
        NodeError(e.to_string())
    }
}

/// Stops a running node from anywhere (a signal handler's thread, a test).
#[derive(Debug, Clone)]
pub struct Stopper(Arc<AtomicBool>);

impl Stopper {
    /// Asks the node to stop: the server finishes in-flight requests, and
    /// `Node::wait` returns once everything is down and the store closed.
    pub fn stop(&self) {
        self.0.store(true, Ordering::Release);
    }
}

/// A running node.
#[derive(Debug)]
pub struct Node {
    store: Arc<Store>,
    data_dir: PathBuf,
    bound: BoundAddrs,
    /// The server's stop flag; the node's workers watch it too.
    stop: Arc<AtomicBool>,
    server: Option<JoinHandle<io::Result<()>>>,
    token_file: Option<PathBuf>,
    publisher: Option<Arc<KvEventPublisher>>,
    member: Option<ClusterMember>,
    workers: Vec<JoinHandle<()>>,
}

/// The feed's state on the admin endpoint's `/stats` (`"kv_events"`):
/// set once the feed runs.
#[derive(Debug)]
struct FeedStatus(std::sync::OnceLock<Arc<KvEventPublisher>>);

impl StatusSection for FeedStatus {
    fn name(&self) -> &str {
        "kv_events"
    }

    fn json(&self) -> serde_json::Value {
        match self.0.get() {
            Some(events) => {
                let mut j = serde_json::to_value(events.stats()).unwrap_or_default();
                j["enabled"] = true.into();
                j
            }
            None => serde_json::json!({ "enabled": false }),
        }
    }
}

impl Node {
    /// Opens the store and starts everything `config` asks for; returns
    /// once the listeners are bound and, in cluster mode, this node is
    /// registered. Threads started here inherit the caller's signal mask
    /// (the CLI blocks SIGINT and SIGTERM first, so no worker is
    /// interrupted mid-request).
    pub fn start(config: NodeConfig) -> Result<Node, NodeError> {
        let data_dir = config.data_dir();
        let mut store_config = config.store_config()?;
        let mut server_config = config.server_config()?;
        // TCP always needs a token: without one given, the data directory
        // keeps a generated one (0600) for the clients of this host to read.
        let mut token_file = None;
        if server_config.auth_token.is_none() {
            match server_config.listen {
                Some(listen) if !listen.ip().is_loopback() => {
                    return Err(format!(
                        "refusing to listen on non-loopback {listen} without an auth token: set \
                         --auth-token or KVTIER_AUTH_TOKEN to a token of your own (at least 16 \
                         bytes) to serve other hosts"
                    )
                    .into());
                }
                Some(_) => {
                    // Private from the start (0700, as the store creates
                    // it): a directory made with the umask's 0755 here
                    // would be "tightened" with a warning by the store a
                    // moment later.
                    kvtier::private_files::create_dir(&data_dir)
                        .map_err(|e| format!("creating {}: {e}", data_dir.display()))?;
                    let (token, path) = kvtier_server::data_dir_token(&data_dir)
                        .map_err(|e| format!("the auth token in {}: {e}", data_dir.display()))?;
                    token_file = Some(path);
                    server_config.auth_token = Some(token);
                }
                None => {}
            }
        }
        let feed = feed_config::plan(&config)?;
        let feed_channel = match &feed {
            Some(_) => {
                // 65 536 events of about 100 bytes: 6 MiB, over a second of
                // 64 KiB puts at 3 GB/s for the publisher to fall behind by
                // before events are dropped.
                let (sink, rx) = kvtier::EventSink::channel(1 << 16);
                store_config = store_config.events(Arc::clone(&sink));
                Some((sink, rx))
            }
            None => None,
        };

        let store = Arc::new(Store::open(store_config)?);
        if let Some(path) = &config.tenants_file {
            server_config.tenants =
                kvtier_server::read_tenants(path).map_err(|e| format!("the tenants file: {e}"))?;
        }
        // The feed starts once the server exists (it draws on the server's
        // governor); its status section is the server's from the start.
        let feed_status = Arc::new(FeedStatus(std::sync::OnceLock::new()));
        server_config
            .status_sections
            .push(Arc::clone(&feed_status) as Arc<dyn StatusSection>);
        let feed_tokens = (
            server_config.auth_token.clone(),
            server_config.tenants.clone(),
        );
        let stats = store.stats();
        let mut member = membership::prepare(
            &config,
            store.node_id(),
            stats.memory_capacity + stats.disk_capacity,
            server_config.auth_token.as_deref(),
        )?;
        server_config.cluster = member.as_ref().map(|m| Arc::clone(&m.view));

        let server = Server::new(Arc::clone(&store), server_config)?;
        let publisher = match (feed, feed_channel) {
            (Some(feed), Some((sink, rx))) => {
                let publisher = start_feed(
                    feed,
                    sink,
                    rx,
                    store.node_id(),
                    feed_tokens,
                    server.governor(),
                )?;
                let _ = feed_status.0.set(Arc::clone(&publisher));
                Some(publisher)
            }
            _ => None,
        };
        let stop = server.stop_flag();
        let mut workers = Vec::new();
        if let (Some(member), Some(shared)) = (&member, store.config().configured_shared_dir()) {
            workers.push(adopter::spawn(
                Arc::clone(&member.view),
                shared.to_path_buf(),
                data_dir.join("adopt-scratch"),
                config.adopt_after()?,
                Arc::clone(&stop),
            )?);
        }
        if let Some(member) = &member {
            if store.config().configured_shared_index_share() {
                workers.push(share_keeper::spawn(
                    Arc::clone(&member.view),
                    Arc::clone(&store),
                    Arc::clone(&stop),
                )?);
            }
        }
        let (bound_tx, bound_rx) = mpsc::channel();
        let server = std::thread::Builder::new()
            .name("kvtier-server".into())
            .spawn(move || {
                server.run(|bound| {
                    let _ = bound_tx.send(bound.clone());
                })
            })?;
        let mut node = Node {
            store,
            data_dir,
            bound: BoundAddrs::default(),
            stop,
            server: Some(server),
            token_file,
            publisher,
            member: None,
            workers,
        };
        match bound_rx.recv() {
            Ok(bound) => node.bound = bound,
            // The server ended before binding: its error says why.
            Err(_) => {
                return Err(node.wait().err().unwrap_or_else(|| {
                    NodeError("the server stopped before it was listening".into())
                }))
            }
        }
        if let Some(member) = &mut member {
            let joined = member.join(node.bound.tcp, node.bound.tls, node.bound.admin);
            if let Err(why) = joined {
                let _ = node.stop_and_wait();
                return Err(why.into());
            }
        }
        node.member = member;
        Ok(node)
    }

    /// What the listeners bound (port 0 resolved).
    pub fn bound(&self) -> &BoundAddrs {
        &self.bound
    }

    /// The node's store.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// The file holding the generated TCP token, when the node made one.
    pub fn token_file(&self) -> Option<&std::path::Path> {
        self.token_file.as_deref()
    }

    /// The KV-event feed's addresses (publish, replay), when it runs.
    pub fn kv_events(&self) -> Option<(std::net::SocketAddr, Option<std::net::SocketAddr>)> {
        self.publisher
            .as_ref()
            .map(|p| (p.publish_addr(), p.replay_addr()))
    }

    /// One line saying what is served where: `kvtier serving <dir> from
    /// <engine>: <endpoints>`.
    pub fn serving_line(&self) -> String {
        let bound = &self.bound;
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
        if let Some(path) = &self.token_file {
            parts.push(format!("TCP token in {}", path.display()));
        }
        if let Some((publish, replay)) = self.kv_events() {
            parts.push(format!("kv events tcp://{publish}"));
            if let Some(key) = self.publisher.as_ref().and_then(|p| p.curve_server_key()) {
                // Z85 may hold any of `,()`: the key is the next 40
                // characters, whatever they are.
                parts.push(format!("CURVE server key {key}"));
            }
            if let Some(replay) = replay {
                parts.push(format!("replay tcp://{replay}"));
            }
        }
        if let Some(member) = &self.member {
            let me = member.view.me();
            parts.push(format!(
                "cluster {} as node {} at {}",
                member.view.name, me.id, me.address
            ));
        }
        format!(
            "kvtier serving {} from {}: {}",
            self.data_dir.display(),
            self.store.stats().io_engine,
            parts.join(", ")
        )
    }

    /// A handle that stops this node.
    pub fn stopper(&self) -> Stopper {
        Stopper(Arc::clone(&self.stop))
    }

    /// Stops the node and waits for it (`stopper().stop()`, then `wait`).
    pub fn stop_and_wait(self) -> Result<(), NodeError> {
        self.stopper().stop();
        self.wait()
    }

    /// Waits until the node is stopped (by a `Stopper`, or by the server
    /// ending on its own), then leaves the cluster, stops the workers and
    /// the feed, and closes the store. The server's error, if it ended
    /// with one, comes first.
    pub fn wait(mut self) -> Result<(), NodeError> {
        let served = match self.server.take().map(JoinHandle::join) {
            Some(Ok(result)) => result.map_err(NodeError::from),
            Some(Err(_)) => Err("the server's thread panicked".into()),
            None => Ok(()),
        };
        self.stop.store(true, Ordering::Release);
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
        if let Some(member) = self.member.take() {
            member.leave();
        }
        drop(self.publisher.take());
        served?;
        self.store.close()?;
        Ok(())
    }
}

fn start_feed(
    feed: FeedPlan,
    sink: Arc<kvtier::EventSink>,
    rx: std::sync::mpsc::Receiver<kvtier::BlockEvent>,
    node_id: &str,
    (auth_token, tenants): (Option<String>, Vec<kvtier_server::Tenant>),
    governor: Arc<kvtier_events::Governor>,
) -> Result<Arc<KvEventPublisher>, NodeError> {
    // Its connections' slots and its logins' guesses are the server's.
    let mut events = KvEventsConfig::new(feed.publish, node_id, governor);
    events.replay = feed.replay;
    if feed.login != FeedLogin::None {
        // The same tokens as the data port: the server's opens every
        // namespace, a tenant's its own.
        let auth = kvtier_server::Auth::new(auth_token.as_deref())
            .and_then(|a| a.with_tenants(tenants))
            .map_err(|e| format!("kv_events_auth: {e}"))?;
        if !auth.has_token() {
            return Err(
                "kv_events_auth = \"plain\" or \"curve\" logs subscribers in with \
                        keys from the server's token: serve TCP (--listen) or give --auth-token"
                    .into(),
            );
        }
        if feed.login == FeedLogin::Curve {
            events.curve = Some(Arc::new(
                CurveKeys::from_auth(&auth).expect("the server has a token"),
            ));
        } else {
            events.credentials = Some(Arc::new(auth));
        }
    }
    if let Some(topic) = feed.topic {
        events.topic = topic;
    }
    let publisher = KvEventPublisher::start(events, sink, rx)
        .map_err(|e| format!("kv events on {}: {e}", feed.publish))?;
    Ok(Arc::new(publisher))
}
