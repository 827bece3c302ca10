//! The feed's configuration, every field with its default, and its CURVE
//! keys (derived from the server's tokens).

use crate::curve;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// How events are published; every field has a documented default.
#[derive(Debug, Clone)]
pub struct KvEventsConfig {
    /// The PUB socket's address.
    pub publish: SocketAddr,
    /// The ROUTER socket answering replay requests. Default: none.
    pub replay: Option<SocketAddr>,
    /// The topic prefix; a batch's topic is `<prefix>@<namespace>`.
    /// Default: `kv@<node>` (the node's id or host name).
    pub topic: String,
    /// Most connections on each socket. Default: 64.
    pub max_connections: usize,
    /// Batches queued for one subscriber before it misses some. Default:
    /// 10 000.
    pub subscriber_queue: usize,
    /// Bytes of batches queued for one subscriber (with
    /// `subscriber_queue`, whichever is reached first). Default: 16 MiB.
    pub subscriber_bytes: usize,
    /// Bytes of batches queued for all subscribers together (a batch is
    /// counted once per subscriber queueing it): past it a slow
    /// subscriber misses batches as past its own cap. Default: 64 MiB.
    pub subscribers_bytes_total: usize,
    /// Batches kept for replay. Default: 10 000.
    pub replay_batches: usize,
    /// Bytes of batches kept for replay (with `replay_batches`, whichever
    /// is reached first). Default: 64 MiB.
    pub replay_bytes: usize,
    /// Most events in one batch. Default: 1024.
    pub max_batch_events: usize,
    /// How long events gather before a batch goes out (the publisher
    /// polls the store's channel this often). Default: 50 ms.
    pub batch_interval: Duration,
    /// Blocks whose keys are remembered for their removal. Default: 2^22
    /// (about 100 bytes each); a block announced past it is never
    /// announced removed.
    pub tracked_blocks: usize,
    /// How long a peer may take for the whole ZMTP handshake, a
    /// subscriber may go without any subscription, a frame may take once
    /// begun, and a stalled subscriber's write may block before it is
    /// dropped. Default: 5 s.
    pub peer_timeout: Duration,
    /// Who may subscribe and replay: `None` takes any peer (ZMTP's NULL
    /// mechanism, what routers speak by default); with credentials every
    /// peer must say ZMTP PLAIN with a token of the server as its
    /// password (any user name): the server's own token opens every
    /// namespace, a tenant's its own only (docs/integrations.md, "KV
    /// events"). Default: none.
    pub credentials: Option<Arc<kvtier_server::Auth>>,
    /// ZeroMQ CURVE instead (`kv_events_auth = "curve"`): every peer
    /// speaks CURVE with this server key and a client key derived from a
    /// token of the server, and sees what that token opens; every frame
    /// is encrypted, so the feed may leave the host. Takes precedence
    /// over `credentials`. Default: none.
    pub curve: Option<Arc<CurveKeys>>,
}

impl KvEventsConfig {
    /// Whether peers log in (PLAIN or CURVE), so that each may see less
    /// than everything.
    pub(crate) fn logs_in(&self) -> bool {
        self.credentials.is_some() || self.curve.is_some()
    }
}

/// The feed's CURVE keys: the server's, and each token's client key with
/// what it opens.
pub type CurveKeys = curve::ServerKeys<kvtier_server::Scope>;

impl CurveKeys {
    /// The keys derived from `auth`'s tokens (docs/integrations.md, "KV
    /// events"); none without a server token.
    pub fn from_auth(auth: &kvtier_server::Auth) -> Option<CurveKeys> {
        let server = auth.derived_from_server_token(curve::SERVER_KEY_LABEL)?;
        Some(curve::ServerKeys::new(
            server,
            auth.derived_from_each_token(curve::CLIENT_KEY_LABEL),
        ))
    }
}

impl KvEventsConfig {
    pub fn new(publish: SocketAddr, node: &str) -> Self {
        KvEventsConfig {
            publish,
            replay: None,
            topic: format!("kv@{node}"),
            max_connections: 64,
            subscriber_queue: 10_000,
            subscriber_bytes: 16 << 20,
            subscribers_bytes_total: 64 << 20,
            replay_batches: 10_000,
            replay_bytes: 64 << 20,
            max_batch_events: 1024,
            batch_interval: Duration::from_millis(50),
            tracked_blocks: 1 << 22,
            peer_timeout: Duration::from_secs(5),
            credentials: None,
            curve: None,
        }
    }
}
