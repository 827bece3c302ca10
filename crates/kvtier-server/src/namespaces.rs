//! Namespaces as the server shows them (docs/protocol.md: NAMESPACES,
//! RETIRE_NAMESPACE, DESCRIBE_NAMESPACE): the store's census filtered by
//! the caller's scope, with each namespace's manifest and when this server
//! last served it; manifests stamped with when they were first and last
//! described; a whole namespace retired.

use crate::handlers::Reply;
use crate::trust::Scope;
use kvtier::{NamespaceCensus, Store, MANIFEST_KEY};
use kvtier_client::KvBackend;
use kvtier_governor::Principal;
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
    /// Each principal's own turn, taken before `census_turn`: one
    /// principal's censuses and retirements queue behind each other, so
    /// at the shared turn each principal has at most one waiting, and a
    /// tenant scanning in a loop delays another principal by one scan.
    principal_turns: Mutex<HashMap<Principal, Arc<Mutex<()>>>>,
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
    /// Without `named`, only counts: no namespace name.
    pub(crate) fn stats_json(&self, named: bool) -> Value {
        if !named {
            let census = self.last_census.lock().unwrap().clone();
            let served = self
                .last_used
                .lock()
                .unwrap()
                .values()
                .filter(|at| at.load(Ordering::Relaxed) > 0)
                .count();
            return json!({
                "names": "hidden: send Authorization: Bearer <the server's token> to see them",
                "last_census": census.map(|c| json!({
                    "taken_unix_s": c.taken_unix_s,
                    "namespaces": c.entries.len(),
                })),
                "served_since_start": served,
                "untracked": self.untracked.load(Ordering::Relaxed),
                "censuses_run": self.censuses.load(Ordering::Relaxed),
            });
        }
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

    /// Runs `scan` in `principal`'s turn, then the shared one.
    fn in_turn<T>(&self, principal: Principal, scan: impl FnOnce() -> T) -> T {
        let own = Arc::clone(
            self.principal_turns
                .lock()
                .unwrap()
                .entry(principal)
                .or_default(),
        );
        let _own = own.lock().unwrap_or_else(|e| e.into_inner());
        let _shared = self.census_turn.lock().unwrap_or_else(|e| e.into_inner());
        scan()
    }

    /// The census of `store`: the last one if it is younger than
    /// `CENSUS_REUSE`, else a new one, run in turn (`in_turn`) with any
    /// other census or retirement.
    fn census(&self, store: &Store, principal: Principal) -> kvtier::Result<Arc<Census>> {
        self.in_turn(principal, || self.census_now(store))
    }

    fn census_now(&self, store: &Store) -> kvtier::Result<Arc<Census>> {
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
        Ok(census)
    }

    /// Changes the last census's entry of `name` in place (`None`: it is
    /// gone), so what this server itself did shows in the next listing
    /// without a new census.
    fn amend_census(&self, name: &str, entry: Option<Value>) {
        let mut last = self.last_census.lock().unwrap();
        let Some(census) = last.as_ref() else {
            return;
        };
        let mut entries: Vec<(String, Value)> = census
            .entries
            .iter()
            .filter(|(n, _)| n != name)
            .cloned()
            .collect();
        if let Some(entry) = entry {
            entries.push((name.to_owned(), entry));
            entries.sort_by(|a, b| a.0.cmp(&b.0));
        }
        *last = Some(Arc::new(Census {
            taken: census.taken,
            taken_unix_s: census.taken_unix_s,
            entries,
        }));
    }

    /// NAMESPACES: the census of this node's store, the namespaces `scope`
    /// covers only.
    pub(crate) fn list<'b>(&self, store: &Store, scope: &Scope, principal: Principal) -> Reply<'b> {
        let census = match self.census(store, principal) {
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

    /// DESCRIBE_NAMESPACE for the connection's namespace `name`: stored,
    /// and shown in the last census at once (see `describe`).
    pub(crate) fn describe<'b>(
        &self,
        backend: &dyn KvBackend,
        name: &str,
        manifest: &[u8],
    ) -> Reply<'b> {
        match describe(backend, manifest) {
            Ok(stamped) => {
                let last = self.last_census.lock().unwrap().clone();
                let mut entry = last
                    .and_then(|c| c.entries.iter().find(|(n, _)| n == name).map(|e| e.1.clone()))
                    .unwrap_or_else(|| {
                        json!({ "name": name, "blocks": 0, "bytes": 0, "memory_only_blocks": 0 })
                    });
                entry["manifest"] = stamped;
                self.amend_census(name, Some(entry));
                Reply::ok(Vec::new())
            }
            Err(reply) => reply,
        }
    }

    /// RETIRE_NAMESPACE: the connection's namespace `name`, through
    /// `backend` (the store, or in cluster mode every member), in turn
    /// (`in_turn`) with every census and retirement (each scans the whole
    /// store); gone from the last census at once.
    pub(crate) fn retire<'b>(
        &self,
        backend: &dyn KvBackend,
        name: &str,
        principal: Principal,
    ) -> Reply<'b> {
        let retired = self.in_turn(principal, || backend.retire_namespace());
        if retired.is_ok() {
            self.amend_census(name, None);
        }
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
/// What is stored is returned, as listings show it.
fn describe<'b>(backend: &dyn KvBackend, manifest: &[u8]) -> Result<Value, Reply<'b>> {
    let fields: Map<String, Value> = match serde_json::from_slice(manifest) {
        Ok(Value::Object(fields)) => fields,
        Ok(_) => {
            return Err(Reply::error(
                code::INVALID_ARGUMENT,
                "a namespace manifest is a JSON object",
            ))
        }
        Err(e) => {
            return Err(Reply::error(
                code::INVALID_ARGUMENT,
                format!("a namespace manifest is a JSON object: {e}"),
            ))
        }
    };
    let now = unix_seconds();
    let first = previous_first_described(backend).unwrap_or(now);
    let mut stamped = fields;
    stamped.insert("first_described_unix_s".into(), json!(first));
    stamped.insert("last_described_unix_s".into(), json!(now));
    let stamped = Value::Object(stamped);
    let bytes = stamped.to_string().into_bytes();
    // Stored as the backend stores any manifest (the store, or the member
    // that owns the key): its length checked there, durable on return.
    match backend.describe_namespace(&bytes) {
        Ok(()) => Ok(stamped),
        Err(e) => Err(Reply::error(code::of(e.kind()), e.to_string())),
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
