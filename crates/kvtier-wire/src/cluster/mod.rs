//! Cluster mode's shared facts: who the members are, and which of them
//! own a key. Membership itself (registration and liveness on etcd) lives
//! in the `kvtier-cluster` crate, which keeps a [`ClusterView`] current;
//! routing a request over the view lives in `kvtier-client`.

mod placement;

pub use placement::{key_hash, owners};

use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

/// One node of a cluster, as registered in etcd.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// Stable across restarts of the same data directory.
    pub id: String,
    /// Where peers and clients reach its data port (`host:port`, TCP).
    pub address: String,
    /// Bytes it holds (memory + disk): its placement weight.
    pub capacity: u64,
    /// Changes at every start and after every lost lease.
    pub incarnation: u64,
    /// Its admin address, if it serves one.
    #[serde(default)]
    pub admin: Option<String>,
    /// Whether its TCP listener speaks TLS (peers then dial `tls://`).
    #[serde(default)]
    pub tls: bool,
}

/// What this node knows of its cluster: itself, the live members (the last
/// list etcd gave; kept while etcd cannot be reached), and how
/// registration has gone.
#[derive(Debug)]
pub struct ClusterView {
    pub name: String,
    replicas: AtomicUsize,
    me: RwLock<Member>,
    members: RwLock<Arc<Vec<Member>>>,
    updated: RwLock<Option<Instant>>,
    /// Whether the last call to etcd succeeded.
    pub etcd_reachable: AtomicBool,
    /// Registrations under a new lease (the first one included), and how
    /// many of them followed a lease that expired.
    pub registrations: AtomicU64,
    pub lease_losses: AtomicU64,
    /// Calls to etcd that failed or timed out.
    pub etcd_errors: AtomicU64,
}

impl ClusterView {
    pub fn new(name: &str, me: Member, replicas: usize) -> Arc<ClusterView> {
        Arc::new(ClusterView {
            name: name.to_string(),
            replicas: AtomicUsize::new(replicas.max(1)),
            me: RwLock::new(me),
            members: RwLock::new(Arc::new(Vec::new())),
            updated: RwLock::new(None),
            etcd_reachable: AtomicBool::new(false),
            registrations: AtomicU64::new(0),
            lease_losses: AtomicU64::new(0),
            etcd_errors: AtomicU64::new(0),
        })
    }

    /// How many members own each key.
    pub fn replicas(&self) -> usize {
        self.replicas.load(Ordering::Relaxed)
    }

    /// A client's copy of a server's view takes the server's setting.
    pub fn set_replicas(&self, replicas: usize) {
        self.replicas.store(replicas.max(1), Ordering::Relaxed);
    }

    pub fn me(&self) -> Member {
        self.me.read().unwrap().clone()
    }

    /// Where this node is reached, once its listener is bound.
    pub fn set_address(&self, address: String, admin: Option<String>, tls: bool) {
        let mut me = self.me.write().unwrap();
        me.address = address;
        me.admin = admin;
        me.tls = tls;
    }

    /// A new incarnation (a fresh start, or after a lost lease).
    pub fn set_incarnation(&self, incarnation: u64) {
        self.me.write().unwrap().incarnation = incarnation;
    }

    /// The live members, sorted by id.
    pub fn members(&self) -> Arc<Vec<Member>> {
        Arc::clone(&self.members.read().unwrap())
    }

    pub fn set_members(&self, mut members: Vec<Member>) {
        members.sort_by(|a, b| a.id.cmp(&b.id));
        members.dedup_by(|a, b| a.id == b.id);
        *self.members.write().unwrap() = Arc::new(members);
        *self.updated.write().unwrap() = Some(Instant::now());
    }

    /// Time since etcd last gave a member list.
    pub fn view_age(&self) -> Option<Duration> {
        self.updated.read().unwrap().map(|t| t.elapsed())
    }

    pub fn json(&self) -> serde_json::Value {
        let me = self.me();
        let members: Vec<serde_json::Value> = self
            .members()
            .iter()
            .map(|m| {
                let mut v = serde_json::to_value(m).expect("a member serializes");
                v["self"] = (m.id == me.id).into();
                v
            })
            .collect();
        serde_json::json!({
            "enabled": true,
            "name": self.name,
            "node_id": me.id,
            "incarnation": me.incarnation,
            "address": me.address,
            "replicas": self.replicas(),
            "members": members,
            "etcd_reachable": self.etcd_reachable.load(Ordering::Relaxed),
            "view_age_seconds": self.view_age().map(|d| d.as_secs_f64()),
            "registrations": self.registrations.load(Ordering::Relaxed),
            "lease_losses": self.lease_losses.load(Ordering::Relaxed),
            "etcd_errors": self.etcd_errors.load(Ordering::Relaxed),
        })
    }
}
