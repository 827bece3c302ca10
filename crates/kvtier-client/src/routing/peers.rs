//! Connections to the other members, and what they cost: idle connections
//! kept per member (at most `IDLE_PER_MEMBER`, reused by namespace, see
//! `idle_pool`), every call bounded by the peer timeout, and a member that
//! failed is skipped for a moment so a dead node costs one timeout, not
//! one per request.

use super::idle_pool::{IdlePool, IDLE_PER_MEMBER, MAX_IDLE};
use crate::conn::{ClientOptions, Connection};
use kvtier_wire::cluster::{ClusterView, Member};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a member that failed a call is skipped (its keys read as
/// misses and its puts fail) before the next try.
const SKIP_AFTER_FAILURE: Duration = Duration::from_secs(1);

/// Requests to one member, for the admin endpoint and Prometheus.
#[derive(Debug, Default, Clone)]
pub struct PeerStats {
    pub address: String,
    pub requests: u64,
    pub errors: u64,
    /// Calls not made because the member failed just before.
    pub skipped: u64,
    pub keys: u64,
    pub seconds: f64,
    pub max_seconds: f64,
}

#[derive(Debug)]
pub struct Peers {
    pub view: Arc<ClusterView>,
    token: Option<String>,
    /// CA that signs the members' certificates, for members that speak TLS.
    tls_ca: Option<std::path::PathBuf>,
    timeout: Duration,
    idle: Mutex<IdlePool<Connection>>,
    skip_until: Mutex<HashMap<String, Instant>>,
    stats: Mutex<BTreeMap<String, PeerStats>>,
}

impl Peers {
    /// Peers of `view`'s node, reached with `token` (every member of a
    /// cluster serves the same one) and answering within `timeout`.
    pub fn new(
        view: Arc<ClusterView>,
        token: Option<String>,
        tls_ca: Option<std::path::PathBuf>,
        timeout: Duration,
    ) -> Peers {
        Peers {
            view,
            token,
            tls_ca,
            timeout,
            idle: Mutex::new(IdlePool::new(IDLE_PER_MEMBER, MAX_IDLE)),
            skip_until: Mutex::new(HashMap::new()),
            stats: Mutex::new(BTreeMap::new()),
        }
    }

    /// Runs `call` on a connection to `member` in `namespace`; `None` when
    /// the member cannot be reached, failed, or failed a moment ago.
    pub fn call<T>(
        &self,
        member: &Member,
        namespace: &str,
        keys: usize,
        call: impl FnOnce(&mut Connection) -> kvtier::Result<T>,
    ) -> Option<T> {
        if self
            .skip_until
            .lock()
            .unwrap()
            .get(&member.id)
            .is_some_and(|t| Instant::now() < *t)
        {
            self.note(member, |s| s.skipped += 1);
            return None;
        }
        let pooled = self
            .idle
            .lock()
            .unwrap()
            .take(&pool_key(member), namespace, Instant::now());
        let started = Instant::now();
        let client = match pooled {
            Some(client) => Ok(client),
            None => Connection::connect_with(
                &format!(
                    "{}://{}",
                    if member.tls { "tls" } else { "tcp" },
                    member.address
                ),
                ClientOptions {
                    auth_token: self.token.clone(),
                    namespace: namespace.to_string(),
                    tls_ca: self.tls_ca.clone(),
                    timeout: self.timeout,
                    shm_size: 0,
                    local_only: true,
                    route: false,
                    // The server must prove it is this member: a process
                    // on a dead member's address relaying to a live one
                    // is refused.
                    member: Some(member.id.clone()),
                    // Members are other hosts (TCP).
                    cross_memory: false,
                    map_pool: false,
                },
            ),
        };
        let outcome = client.and_then(|mut client| call(&mut client).map(|v| (v, client)));
        let seconds = started.elapsed().as_secs_f64();
        match outcome {
            Ok((value, client)) => {
                self.idle
                    .lock()
                    .unwrap()
                    .put(&pool_key(member), namespace, client, Instant::now());
                self.note(member, |s| {
                    s.requests += 1;
                    s.keys += keys as u64;
                    s.seconds += seconds;
                    s.max_seconds = s.max_seconds.max(seconds);
                });
                Some(value)
            }
            Err(e) => {
                tracing::warn!(peer = %member.id, address = %member.address, error = %e, "a call to a cluster member failed; its keys count as misses");
                self.skip_until
                    .lock()
                    .unwrap()
                    .insert(member.id.clone(), Instant::now() + SKIP_AFTER_FAILURE);
                self.idle.lock().unwrap().forget(&pool_key(member));
                self.note(member, |s| {
                    s.requests += 1;
                    s.errors += 1;
                    s.seconds += seconds;
                    s.max_seconds = s.max_seconds.max(seconds);
                });
                None
            }
        }
    }

    fn note(&self, member: &Member, update: impl FnOnce(&mut PeerStats)) {
        let mut stats = self.stats.lock().unwrap();
        let entry = stats.entry(member.id.clone()).or_default();
        entry.address.clone_from(&member.address);
        update(entry);
    }

    pub fn stats(&self) -> BTreeMap<String, PeerStats> {
        self.stats.lock().unwrap().clone()
    }

    pub fn json(&self) -> serde_json::Value {
        self.stats()
            .into_iter()
            .map(|(id, s)| {
                let mean = (s.requests > 0).then(|| s.seconds / s.requests as f64);
                (
                    id,
                    serde_json::json!({
                        "address": s.address,
                        "requests": s.requests,
                        "errors": s.errors,
                        "skipped": s.skipped,
                        "keys": s.keys,
                        "mean_seconds": mean,
                        "max_seconds": s.max_seconds,
                    }),
                )
            })
            .collect::<serde_json::Map<_, _>>()
            .into()
    }
}

/// Idle connections are kept per member and address: a connection was
/// proven to be one member (`ClientOptions::member`), and another member
/// may take the address over later.
fn pool_key(member: &Member) -> String {
    format!("{}@{}", member.id, member.address)
}
