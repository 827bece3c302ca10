//! Namespaces as the server shows them (docs/protocol.md: NAMESPACES,
//! RETIRE_NAMESPACE, DESCRIBE_NAMESPACE): the store's census filtered by
//! the caller's scope, with each namespace's manifest and when this server
//! last served it; manifests stamped with when they were first and last
//! described; a whole namespace retired.

use crate::handlers::Reply;
use crate::trust::Scope;
use kvtier::{NamespaceCensus, Store, MANIFEST_KEY};
use kvtier_client::KvBackend;
use kvtier_wire::protocol::{code, Writer};
use serde_json::{json, Map, Value};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

/// Namespaces whose last use this server tracks at most (a client can name
/// any number of namespaces: past this, new ones are not tracked and the
/// listing says so).
const MAX_TRACKED: usize = 4096;

/// When this server last served a request in each namespace (since it
/// started), and the last census it ran.
#[derive(Debug, Default)]
pub(crate) struct NamespaceUse {
    last_used: Mutex<HashMap<String, Arc<AtomicU64>>>,
    /// Namespaces not tracked because `MAX_TRACKED` were.
    untracked: AtomicU64,
    /// The last census (for `/stats`): when, and what it found.
    last_census: Mutex<Option<(u64, Vec<NamespaceCensus>)>>,
    /// Held while a census runs: it reads every batch record, so callers
    /// (any tenant may ask) take turns instead of reading them at once.
    census_turn: Mutex<()>,
}

/// The clock a session stamps its namespace's last use with.
#[derive(Debug, Clone, Default)]
pub(crate) struct UseClock(Option<Arc<AtomicU64>>);

impl UseClock {
    /// Notes a request served now (one relaxed store).
    pub(crate) fn touch(&self) {
        if let Some(at) = &self.0 {
            at.store(unix_seconds(), Ordering::Relaxed);
        }
    }
}

impl NamespaceUse {
    /// The clock of `namespace` (made at a connection's hello).
    pub(crate) fn clock(&self, namespace: &str) -> UseClock {
        let mut used = self.last_used.lock().unwrap();
        if let Some(at) = used.get(namespace) {
            return UseClock(Some(Arc::clone(at)));
        }
        if used.len() >= MAX_TRACKED {
            self.untracked.fetch_add(1, Ordering::Relaxed);
            return UseClock(None);
        }
        let at = Arc::new(AtomicU64::new(0));
        used.insert(namespace.to_owned(), Arc::clone(&at));
        UseClock(Some(at))
    }

    fn last_used(&self, namespace: &str) -> Option<u64> {
        let used = self.last_used.lock().unwrap();
        used.get(namespace)
            .map(|at| at.load(Ordering::Relaxed))
            .filter(|&t| t > 0)
    }

    /// The `/stats` section: the last census (when the NAMESPACES request
    /// last ran one) and the namespaces served since this server started.
    pub(crate) fn stats_json(&self) -> Value {
        let census = self.last_census.lock().unwrap();
        let listed = census.as_ref().map(|(at, found)| {
            json!({
                "taken_unix_s": at,
                "namespaces": found.iter().map(|c| self.entry(c)).collect::<Vec<_>>(),
            })
        });
        let used = self.last_used.lock().unwrap();
        let mut served: Vec<(&String, u64)> = used
            .iter()
            .map(|(name, at)| (name, at.load(Ordering::Relaxed)))
            .filter(|&(_, at)| at > 0)
            .collect();
        served.sort();
        json!({
            "last_census": listed,
            "served_since_start": served
                .into_iter()
                .map(|(name, at)| json!({ "name": name, "last_used_unix_s": at }))
                .collect::<Vec<_>>(),
            "untracked": self.untracked.load(Ordering::Relaxed),
        })
    }

    /// One namespace of a listing.
    fn entry(&self, census: &NamespaceCensus) -> Value {
        kvtier_wire::stats::namespace_json(census, self.last_used(&census.name))
    }

    /// NAMESPACES: the census of this node's store, the namespaces `scope`
    /// covers only.
    pub(crate) fn list<'b>(&self, store: &Store, scope: &Scope) -> Reply<'b> {
        let turn = self.census_turn.lock().unwrap_or_else(|e| e.into_inner());
        let found = store.namespaces();
        drop(turn);
        let found = match found {
            Ok(found) => found,
            Err(e) => return Reply::error(code::of(e.kind()), e.to_string()),
        };
        let visible: Vec<NamespaceCensus> = found
            .into_iter()
            .filter(|c| scope.refuses_namespace(&c.name).is_none())
            .collect();
        let body = json!({
            "node": store.node_id(),
            "namespaces": visible.iter().map(|c| self.entry(c)).collect::<Vec<_>>(),
        });
        if scope.sees_the_server() {
            *self.last_census.lock().unwrap() = Some((unix_seconds(), visible));
        }
        Reply::ok(body.to_string().into_bytes())
    }
}

/// RETIRE_NAMESPACE: the connection's namespace, through `backend` (the
/// store, or in cluster mode every member).
pub(crate) fn retire<'b>(backend: &dyn KvBackend) -> Reply<'b> {
    match backend.retire_namespace() {
        Ok(retired) => {
            let mut w = Writer::default();
            w.u64(retired.blocks)
                .u64(retired.bytes)
                .u64(retired.tombstones);
            Reply::ok(w.buf)
        }
        Err(e) => Reply::error(code::of(e.kind()), e.to_string()),
    }
}

/// DESCRIBE_NAMESPACE: a JSON object of readable fields, stored with
/// `first_described_unix_s` (kept from the manifest already stored, if
/// any) and `last_described_unix_s` (now), durable on return.
pub(crate) fn describe<'b>(backend: &dyn KvBackend, manifest: &[u8]) -> Reply<'b> {
    let fields: Map<String, Value> = match serde_json::from_slice(manifest) {
        Ok(Value::Object(fields)) => fields,
        Ok(_) => {
            return Reply::error(
                code::INVALID_ARGUMENT,
                "a namespace manifest is a JSON object",
            )
        }
        Err(e) => {
            return Reply::error(
                code::INVALID_ARGUMENT,
                format!("a namespace manifest is a JSON object: {e}"),
            )
        }
    };
    let now = unix_seconds();
    let first = previous_first_described(backend).unwrap_or(now);
    let mut stamped = fields;
    stamped.insert("first_described_unix_s".into(), json!(first));
    stamped.insert("last_described_unix_s".into(), json!(now));
    let bytes = Value::Object(stamped).to_string().into_bytes();
    // Stored as the backend stores any manifest (the store, or the member
    // that owns the key): its length checked there, durable on return.
    match backend.describe_namespace(&bytes) {
        Ok(()) => Reply::ok(Vec::new()),
        Err(e) => Reply::error(code::of(e.kind()), e.to_string()),
    }
}

/// `first_described_unix_s` of the manifest stored now, if one reads.
fn previous_first_described(backend: &dyn KvBackend) -> Option<u64> {
    let mut buf = vec![0u8; kvtier::MAX_MANIFEST_LEN];
    let mut bufs = [&mut buf[..]];
    let len = match backend.batch_get_whole(&[MANIFEST_KEY], &mut bufs) {
        Ok(mut results) => results.pop()?.ok()??,
        Err(_) => return None,
    };
    let stored: Value = serde_json::from_slice(&buf[..len]).ok()?;
    stored.get("first_described_unix_s")?.as_u64()
}

fn unix_seconds() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
