//! The feed's configuration, every field with its default, and its CURVE
//! keys (derived from the server's tokens).

use crate::curve;
use kvtier_governor::{Governor, Principal};
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
    /// Most connections on each socket once logged in (the limits of the
    /// governor's budgets `feed subscribers` and `feed replays`, split
    /// between principals as every budget is), and of connections in their
    /// handshake on both sockets together (`feed handshakes`, of which
    /// unauthenticated peers hold at most their share). Default: 64.
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
    /// dropped; and how long a subscriber sent nothing is idle (closable
    /// for a newcomer). Default: 5 s.
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
    /// The server's governor: every connection's slot is a grant of one of
    /// its budgets, and every refused login spends a turn of its one guess
    /// budget, is answered only after its pause, and is counted with every
    /// other surface's (`auth_failures`).
    pub governor: Arc<Governor>,
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
    /// A feed on `publish` for node `node`, drawing on `governor` (the
    /// server's: `kvtier_server::Server::governor`).
    pub fn new(publish: SocketAddr, node: &str, governor: Arc<Governor>) -> Self {
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
            governor,
        }
    }

    /// Who a peer that logged in with `scope` is to the governor: see
    /// [`Principals`].
    pub(crate) fn principals(&self) -> Principals {
        let scopes: Vec<kvtier_server::Scope> = match (&self.curve, &self.credentials) {
            (Some(keys), _) => keys.admitted().cloned().collect(),
            (None, Some(auth)) => auth
                .derived_from_each_token(b"")
                .into_iter()
                .map(|(_, scope)| scope)
                .collect(),
            (None, None) => Vec::new(),
        };
        Principals {
            tenants: scopes
                .into_iter()
                .filter_map(|scope| match scope {
                    kvtier_server::Scope::Tenant { name, .. } => Some(name),
                    kvtier_server::Scope::Full => None,
                })
                .collect(),
            governed: self.governor.tenants(),
        }
    }
}

/// The governor's principal of a peer once its handshake is done: the
/// server's token `Server`, the `i`-th tenant of the tenants file
/// `Tenant(i)` (the index the server's governor counts it by: `Auth` lists
/// its tokens in the tenants file's order, after the server's own), and
/// every peer of a feed without logins `Server` too (it is shown all that
/// the server's token is, and there is no one else to share with).
#[derive(Debug, Clone)]
pub(crate) struct Principals {
    tenants: Vec<String>,
    /// Tenants the governor splits between (a tenant past them, which a
    /// governor made for other tenants would not know, is charged as an
    /// unauthenticated peer rather than panic).
    governed: usize,
}

impl Principals {
    pub(crate) fn of(&self, scope: &Option<kvtier_server::Scope>) -> Principal {
        match scope {
            None | Some(kvtier_server::Scope::Full) => Principal::Server,
            Some(kvtier_server::Scope::Tenant { name, .. }) => self
                .tenants
                .iter()
                .position(|t| t == name)
                .filter(|&i| i < self.governed)
                .map_or(Principal::Anonymous, Principal::Tenant),
        }
    }
}
