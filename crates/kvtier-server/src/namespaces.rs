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

/// Namespaces whose last use this server tracks at most for one principal
/// (a client can name any number of namespaces: past this, that
/// principal's new ones are not tracked, and a listing shows the last use
/// of a namespace it has no clock for as "untracked", not as unused). Each
/// principal has its own, so one tenant naming thousands of namespaces
/// leaves the others' tracked.
const MAX_TRACKED: usize = 4096;

/// A census younger than this is answered again instead of reading every
/// record once more: a client listing in a loop (any tenant may) costs the
/// store one scan per interval, not one per request. A retirement makes
/// the next listing run a new one.
pub(crate) const CENSUS_REUSE: std::time::Duration = std::time::Duration::from_secs(5);

/// A census as listings show it: each namespace rendered once, when the
/// census ran (its manifest parsed then, at most `MAX_MANIFEST_LEN` bytes
/// of it), so neither a listing nor `/stats` parses what a client stored.
#[derive(Debug)]
struct Census {
    taken: std::time::Instant,
    taken_unix_s: u64,
    /// Name and rendered entry (without its last use, added when shown).
    entries: Vec<(String, Value)>,
}

/// When this server last served a request in each namespace (since it
/// started), and the last census it ran.
#[derive(Debug, Default)]
pub(crate) struct NamespaceUse {
    last_used: Mutex<HashMap<String, Arc<AtomicU64>>>,
    /// Namespaces tracked per principal (`MAX_TRACKED` each).
    tracked_by: Mutex<HashMap<kvtier_governor::Principal, usize>>,
    /// Namespaces not tracked because `MAX_TRACKED` were.
    untracked: AtomicU64,
    /// The last census (for listings within `CENSUS_REUSE`, and `/stats`).
    last_census: Mutex<Option<Arc<Census>>>,
    /// Held while a census or a retirement runs: each reads every batch
    /// record, so callers (any tenant may ask) take turns instead of
    /// scanning at once.
    census_turn: Mutex<()>,
    /// Censuses run (each a scan of every record), since start.
    censuses: AtomicU64,
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
    /// The clock of `namespace` (made at a connection's hello by
    /// `principal`, within its `MAX_TRACKED`).
    pub(crate) fn clock(&self, namespace: &str, principal: kvtier_governor::Principal) -> UseClock {
        let mut used = self.last_used.lock().unwrap();
        if let Some(at) = used.get(namespace) {
            return UseClock(Some(Arc::clone(at)));
        }
        let mut tracked_by = self.tracked_by.lock().unwrap();
        let tracked = tracked_by.entry(principal).or_insert(0);
        if *tracked >= MAX_TRACKED {
            self.untracked.fetch_add(1, Ordering::Relaxed);
            return UseClock(None);
        }
        *tracked += 1;
        let at = Arc::new(AtomicU64::new(0));
        used.insert(namespace.to_owned(), Arc::clone(&at));
        UseClock(Some(at))
    }

    /// When `namespace` was last served: a number, `null` (not since
    /// start), or "untracked" (no clock for it while some principal's
    /// tracking was full: it may have been served).
    fn last_used(&self, namespace: &str) -> Value {
        let used = self.last_used.lock().unwrap();
        match used.get(namespace) {
            Some(at) => {
                let at = at.load(Ordering::Relaxed);
                if at > 0 {
                    json!(at)
                } else {
                    Value::Null
                }
            }
            None if self.untracked.load(Ordering::Relaxed) > 0 => json!("untracked"),
            None => Value::Null,
        }
    }

    /// The `/stats` section: the last census (when a NAMESPACES request
    /// last ran one) and the namespaces served since this server started.
    /// Never waits for a census that is running, and parses nothing.
    pub(crate) fn stats_json(&self) -> Value {
        let census = self.last_census.lock().unwrap().clone();
        let listed = census.as_ref().map(|census| {
            json!({
                "taken_unix_s": census.taken_unix_s,
                "namespaces": census
                    .entries
                    .iter()
                    .map(|(name, entry)| self.shown(name, entry))
                    .collect::<Vec<_>>(),
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
            "censuses_run": self.censuses.load(Ordering::Relaxed),
        })
    }

    /// One namespace of a listing: its rendered entry with its last use.
    fn shown(&self, name: &str, entry: &Value) -> Value {
        let mut entry = entry.clone();
        entry["last_used_unix_s"] = json!(self.last_used(name));
        entry
    }

    /// The census of `store`: the last one if it is younger than
    /// `CENSUS_REUSE`, else a new one, run in turn with any other census or
    /// retirement.
    fn census(&self, store: &Store) -> kvtier::Result<Arc<Census>> {
        let turn = self.census_turn.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(census) = self.last_census.lock().unwrap().as_ref() {
            if census.taken.elapsed() < CENSUS_REUSE {
                return Ok(Arc::clone(census));
            }
        }
        self.censuses.fetch_add(1, Ordering::Relaxed);
        let found: Vec<NamespaceCensus> = store.namespaces()?;
        let census = Arc::new(Census {
            taken: std::time::Instant::now(),
            taken_unix_s: unix_seconds(),
            entries: found
                .iter()
                .map(|c| (c.name.clone(), kvtier_wire::stats::namespace_json(c, None)))
                .collect(),
        });
        *self.last_census.lock().unwrap() = Some(Arc::clone(&census));
        drop(turn);
        Ok(census)
    }

    /// NAMESPACES: the census of this node's store, the namespaces `scope`
    /// covers only.
    pub(crate) fn list<'b>(&self, store: &Store, scope: &Scope) -> Reply<'b> {
        let census = match self.census(store) {
            Ok(census) => census,
            Err(e) => return Reply::error(code::of(e.kind()), e.to_string()),
        };
        let visible: Vec<Value> = census
            .entries
            .iter()
            .filter(|(name, _)| scope.refuses_namespace(name).is_none())
            .map(|(name, entry)| self.shown(name, entry))
            .collect();
        let body = json!({
            "node": store.node_id(),
            "namespaces": visible,
        });
        Reply::ok(body.to_string().into_bytes())
    }

    /// Drops the last census: the next listing runs a new one (a manifest
    /// was described here, so listings must show it at once).
    pub(crate) fn forget_census(&self) {
        *self.last_census.lock().unwrap() = None;
    }

    /// RETIRE_NAMESPACE: the connection's namespace, through `backend` (the
    /// store, or in cluster mode every member), in turn with every census
    /// and retirement (each scans the whole store); the next listing runs
    /// a new census.
    pub(crate) fn retire<'b>(&self, backend: &dyn KvBackend) -> Reply<'b> {
        let turn = self.census_turn.lock().unwrap_or_else(|e| e.into_inner());
        let retired = backend.retire_namespace();
        *self.last_census.lock().unwrap() = None;
        drop(turn);
        retired_reply(retired)
    }
}

fn retired_reply<'b>(retired: kvtier::Result<kvtier::RetiredNamespace>) -> Reply<'b> {
    match retired {
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
