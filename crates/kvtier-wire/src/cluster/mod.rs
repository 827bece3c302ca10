//! Cluster mode's shared facts: who the members are, and which of them
//! own a key. Membership itself (registration and liveness on etcd) lives
//! in the `kvtier-cluster` crate, which keeps a [`ClusterView`] current;
//! routing a request over the view lives in `kvtier-client`.

mod placement;

pub use placement::{index_share_owner, key_hash, owners};

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

/// A member record as stored in etcd: the member and its signature, a
/// keyed hash (`proof::sign_record`, key from the cluster's token) over
/// the etcd key and the member's JSON as `serde_json` writes a `Member`.
/// A writer to etcd without the token cannot make a record members accept,
/// nor move a genuine one to another member's key.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SignedRecord {
    pub member: Member,
    /// 64 lowercase hex digits.
    pub signature: String,
}

/// The value a member registers under `etcd_key`.
pub fn sign_member(key: &[u8; 32], etcd_key: &str, member: &Member) -> Vec<u8> {
    let canonical = serde_json::to_vec(member).expect("a member serializes");
    let signature = crate::proof::sign_record(key, etcd_key.as_bytes(), &canonical);
    let record = SignedRecord {
        member: member.clone(),
        signature: signature.iter().map(|b| format!("{b:02x}")).collect(),
    };
    serde_json::to_vec(&record).expect("a record serializes")
}

/// The member a record stored under `etcd_key` names, if its signature
/// verifies under `key`; otherwise why not.
pub fn verify_member(key: &[u8; 32], etcd_key: &[u8], value: &[u8]) -> Result<Member, String> {
    let record: SignedRecord =
        serde_json::from_slice(value).map_err(|e| format!("not a signed member record: {e}"))?;
    let signature = decode_hex(&record.signature).ok_or("a signature that is not 64 hex digits")?;
    let canonical = serde_json::to_vec(&record.member).expect("a member serializes");
    if !crate::proof::record_signed(key, etcd_key, &canonical, &signature) {
        return Err("a signature that does not verify under the cluster's token".into());
    }
    Ok(record.member)
}

fn decode_hex(hex: &str) -> Option<Vec<u8>> {
    if hex.len() != 64 || !hex.is_ascii() {
        return None;
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).ok())
        .collect()
}

/// A member's placement weight is at most this many times the median
/// capacity of the list.
pub const MAX_WEIGHT_OVER_MEDIAN: u64 = 4;

/// The member list a node acts on, from records whose signatures verified
/// (a holder of the cluster token may still misbehave): sorted by id; an id
/// claimed by more than one record is refused altogether (an impostor must
/// not replace a member by reusing its id, and which record is genuine
/// cannot be told); a record with this node's id is replaced by this
/// node's own facts (it knows where it is); and every capacity is capped
/// at `MAX_WEIGHT_OVER_MEDIAN` times the median, so one record claiming a
/// huge capacity cannot draw nearly every key to itself.
pub fn accept_members(me: &Member, mut members: Vec<Member>) -> Vec<Member> {
    members.sort_by(|a, b| a.id.cmp(&b.id));
    let mut accepted: Vec<Member> = Vec::with_capacity(members.len());
    let mut i = 0;
    while i < members.len() {
        let mut j = i + 1;
        while j < members.len() && members[j].id == members[i].id {
            j += 1;
        }
        if members[i].id == me.id {
            accepted.push(me.clone());
        } else if j - i == 1 {
            accepted.push(members[i].clone());
        }
        i = j;
    }
    if !accepted.is_empty() {
        let mut capacities: Vec<u64> = accepted.iter().map(|m| m.capacity).collect();
        capacities.sort_unstable();
        let median = capacities[(capacities.len() - 1) / 2].max(1);
        let cap = median.saturating_mul(MAX_WEIGHT_OVER_MEDIAN);
        for member in &mut accepted {
            member.capacity = member.capacity.min(cap);
        }
    }
    accepted
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

    /// Takes a member list (from etcd, or from a server's cluster view)
    /// through `accept_members`.
    pub fn set_members(&self, members: Vec<Member>) {
        let members = accept_members(&self.me(), members);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn member(id: &str, address: &str, capacity: u64) -> Member {
        Member {
            id: id.into(),
            address: address.into(),
            capacity,
            incarnation: 1,
            admin: None,
            tls: false,
        }
    }

    #[test]
    fn only_records_signed_with_the_cluster_token_under_their_key_verify() {
        let key = crate::proof::member_record_key(b"cluster-token-0123456789");
        let m = member("a", "10.0.0.1:7700", 100);
        let value = sign_member(&key, "/kvtier/c/members/a", &m);
        assert_eq!(
            verify_member(&key, b"/kvtier/c/members/a", &value),
            Ok(m.clone())
        );
        // Moved to another key, re-signed with another token, edited, or
        // unsigned as before: refused.
        assert!(verify_member(&key, b"/kvtier/c/members/b", &value).is_err());
        let other = crate::proof::member_record_key(b"other-token-0123456789ab");
        assert!(verify_member(&other, b"/kvtier/c/members/a", &value).is_err());
        let edited = String::from_utf8(value.clone())
            .unwrap()
            .replace("\"capacity\":100", "\"capacity\":100000");
        assert_ne!(edited.as_bytes(), &value[..]);
        assert!(verify_member(&key, b"/kvtier/c/members/a", edited.as_bytes()).is_err());
        let plain = serde_json::to_vec(&m).unwrap();
        assert!(verify_member(&key, b"/kvtier/c/members/a", &plain).is_err());
    }

    #[test]
    fn reused_ids_are_refused_and_this_node_is_itself() {
        let me = member("b", "10.0.0.2:7700", 100);
        let list = vec![
            member("c", "10.0.0.3:7700", 100),
            member("a", "10.0.0.1:7700", 100),
            member("a", "6.6.6.6:7700", 100),
            member("b", "6.6.6.6:7700", 100),
        ];
        let accepted = accept_members(&me, list);
        let ids: Vec<(&str, &str)> = accepted
            .iter()
            .map(|m| (m.id.as_str(), m.address.as_str()))
            .collect();
        assert_eq!(ids, [("b", "10.0.0.2:7700"), ("c", "10.0.0.3:7700")]);
    }

    #[test]
    fn a_huge_capacity_is_capped_relative_to_the_median() {
        let me = member("a", "x:1", 100);
        let list = vec![
            member("a", "x:1", 100),
            member("b", "x:2", 120),
            member("c", "x:3", 80),
            member("evil", "x:4", u64::MAX),
        ];
        let accepted = accept_members(&me, list);
        let evil = accepted.iter().find(|m| m.id == "evil").unwrap();
        // Median of [80, 100, 120, MAX] (the lower middle) is 100.
        assert_eq!(evil.capacity, 400);
        assert_eq!(accepted.iter().find(|m| m.id == "b").unwrap().capacity, 120);
        // With equal capacities nothing changes.
        let even = accept_members(&me, vec![member("a", "x:1", 100), member("b", "x:2", 100)]);
        assert!(even.iter().all(|m| m.capacity == 100));
    }
}
