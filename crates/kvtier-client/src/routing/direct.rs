//! Client-side routing: a client that learns the member list from the
//! server it connected to (the ClusterView operation) and sends each key
//! straight to its owners, so every key costs one hop. A server that
//! forwards costs a second hop for the keys it does not own (measured in
//! docs/cluster.md).
//!
//! The client is a router like any member: the same placement over the
//! same member list, the same [`Router`] (with no local store), requests
//! marked `LOCAL_ONLY`. A view that is out of date (a member joined or
//! left within the last refresh) costs misses, never another key's bytes:
//! every member answers only from its own verified store.

use super::{Peers, Router};
use kvtier_wire::cluster::{ClusterView, Member};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How often the member list is asked for again. A member that joins is
/// sent its keys at most this long after its registration; one that
/// leaves is skipped by [`Peers`] at its first failed call.
pub const REFRESH_EVERY: Duration = Duration::from_secs(1);

/// How long a member may take to answer one socket operation, bounded
/// by the client's own timeout: a stopped member must cost its keys a
/// miss, not hold the caller for a minute. The servers' `peer_timeout`
/// default.
pub const MEMBER_TIMEOUT: Duration = Duration::from_secs(2);

/// What a routing client knows of the cluster behind its server; shared
/// by the client's siblings (a pool), so they share member connections.
#[derive(Debug)]
pub struct DirectRouting {
    peers: Peers,
    namespace: String,
    /// When the member list was last asked for (`None`: never).
    checked: Mutex<Option<Instant>>,
    /// Until when the client's own server is not asked (it failed to
    /// answer): a server that is down must not cost every refresh a
    /// connect timeout while the members serve on.
    entry_skipped_until: Mutex<Option<Instant>>,
}

/// How long the client's own server is skipped after failing a refresh.
const SKIP_ENTRY_AFTER_FAILURE: Duration = Duration::from_secs(10);

/// The member list a server answers ClusterView with.
#[derive(Debug, PartialEq, Eq)]
pub struct ServerView {
    pub replicas: usize,
    pub members: Vec<Member>,
}

impl ServerView {
    /// Reads a ClusterView answer (docs/protocol.md); `None` when the
    /// server is not in cluster mode.
    pub fn parse(json: &serde_json::Value) -> Result<Option<ServerView>, String> {
        if json.get("enabled") != Some(&serde_json::Value::Bool(true)) {
            return Ok(None);
        }
        let replicas = json
            .get("replicas")
            .and_then(serde_json::Value::as_u64)
            .ok_or("the cluster view has no replicas")?;
        let members: Vec<Member> = serde_json::from_value(
            json.get("members")
                .cloned()
                .ok_or("the cluster view has no members")?,
        )
        .map_err(|e| format!("the cluster view's members: {e}"))?;
        Ok(Some(ServerView {
            replicas: replicas as usize,
            members,
        }))
    }
}

impl DirectRouting {
    /// Routing for a client of `namespace`, reaching members with `token`
    /// (and `tls_ca` for members that speak TLS).
    pub fn new(
        namespace: &str,
        token: Option<String>,
        tls_ca: Option<std::path::PathBuf>,
        timeout: Duration,
    ) -> DirectRouting {
        // The client is no member: an empty id matches none, so no key is
        // ever local to it.
        let me = Member {
            id: String::new(),
            address: String::new(),
            capacity: 0,
            incarnation: 0,
            admin: None,
            tls: false,
        };
        let view = ClusterView::new("", me, 1);
        DirectRouting {
            peers: Peers::new(view, token, tls_ca, timeout.min(MEMBER_TIMEOUT)),
            namespace: namespace.to_string(),
            checked: Mutex::new(None),
            entry_skipped_until: Mutex::new(None),
        }
    }

    /// Whether to ask the client's own server for the member list (it has
    /// not failed to answer within the last few seconds).
    pub fn entry_usable(&self) -> bool {
        self.entry_skipped_until
            .lock()
            .unwrap()
            .is_none_or(|t| Instant::now() >= t)
    }

    /// The client's own server failed to answer a refresh.
    pub fn entry_failed(&self) {
        *self.entry_skipped_until.lock().unwrap() = Some(Instant::now() + SKIP_ENTRY_AFTER_FAILURE);
    }

    /// Whether the member list should be asked for again.
    pub fn due(&self) -> bool {
        self.checked
            .lock()
            .unwrap()
            .is_none_or(|t| t.elapsed() >= REFRESH_EVERY)
    }

    /// Takes a server's answer. `Ok(None)` (not in cluster mode) empties
    /// the view: the client then talks to its server alone.
    pub fn update(&self, view: Option<ServerView>) {
        *self.checked.lock().unwrap() = Some(Instant::now());
        let (replicas, members) = view.map_or((1, Vec::new()), |v| (v.replicas, v.members));
        self.peers.view.set_replicas(replicas);
        self.peers.view.set_members(members);
    }

    /// The last view could not be refreshed: keep it, and ask again at the
    /// next refresh.
    pub fn keep(&self) {
        *self.checked.lock().unwrap() = Some(Instant::now());
    }

    /// Asks the members of the last view, in turn, for the member list
    /// (when the client's own server does not answer).
    pub fn view_from_members(&self) -> Option<ServerView> {
        let members = self.peers.view.members();
        members.iter().find_map(|member| {
            self.peers
                .call(member, &self.namespace, 0, |c| c.cluster_view())
                .and_then(|json| ServerView::parse(&json).ok().flatten())
        })
    }

    /// A router over the current view; `None` while it is empty.
    pub fn router(&self) -> Option<Router<'_>> {
        Router::new(&self.peers, &self.namespace)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_view_parses_and_a_lone_server_has_none() {
        assert_eq!(
            ServerView::parse(&serde_json::json!({"enabled": false})),
            Ok(None)
        );
        let json = serde_json::json!({
            "enabled": true,
            "replicas": 2,
            "members": [{"id": "a", "address": "127.0.0.1:1", "capacity": 5,
                         "incarnation": 7, "admin": null, "tls": false, "self": true}],
        });
        let view = ServerView::parse(&json).unwrap().unwrap();
        assert_eq!(view.replicas, 2);
        assert_eq!(view.members[0].id, "a");
        assert_eq!(view.members[0].incarnation, 7);
        assert!(ServerView::parse(&serde_json::json!({"enabled": true})).is_err());
        let routing = DirectRouting::new("ns", None, None, Duration::from_secs(60));
        assert!(routing.due() && routing.router().is_none());
        routing.update(Some(view));
        assert!(!routing.due());
        assert!(routing.router().is_some());
        routing.update(None);
        assert!(routing.router().is_none());
    }
}
