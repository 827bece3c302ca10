//! Registration, liveness and the member view, on one thread with its own
//! one-thread runtime. Every call to etcd is bounded by a deadline, so a
//! partition or an etcd without quorum costs a retry, never a hang.

use crate::access::EtcdAccess;
use crate::incarnation::new_incarnation;
use etcd_client::{Client, GetOptions, PutOptions, WatchOptions};
use kvtier_wire::cluster::{sign_member, verify_member, ClusterView, Member};
use std::collections::BTreeSet;
use std::sync::Mutex;

/// Keys of unsigned or forged records already warned about.
static FORGED_WARNED: Mutex<BTreeSet<Vec<u8>>> = Mutex::new(BTreeSet::new());
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How a node joins its cluster.
#[derive(Clone)]
pub struct MembershipConfig {
    /// etcd client URLs (`http://127.0.0.1:2379`, ...).
    pub endpoints: Vec<String>,
    /// Signs this node's record and verifies the others'
    /// (`kvtier_wire::proof::member_record_key` of the cluster's token).
    pub record_key: [u8; 32],
    /// TLS and authentication towards etcd.
    pub access: EtcdAccess,
    /// Lease time to live: a node that stops renewing (killed, paused,
    /// partitioned) drops out of every view within this. Default: 5 s.
    pub lease_ttl: Duration,
}

impl std::fmt::Debug for MembershipConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MembershipConfig")
            .field("endpoints", &self.endpoints)
            .field("lease_ttl", &self.lease_ttl)
            .field("access", &self.access)
            .finish()
    }
}

impl MembershipConfig {
    /// Members of one cluster share `token` (the servers' auth token):
    /// it signs and verifies their records.
    pub fn new(endpoints: Vec<String>, token: &[u8]) -> MembershipConfig {
        MembershipConfig {
            endpoints,
            record_key: kvtier_wire::proof::member_record_key(token),
            access: EtcdAccess::default(),
            lease_ttl: Duration::from_secs(5),
        }
    }

    /// Renewals per lease period: a lost renewal or two does not lose it.
    fn keepalive_every(&self) -> Duration {
        self.lease_ttl / 3
    }

    /// Deadline of one call to etcd.
    fn call_timeout(&self) -> Duration {
        (self.lease_ttl / 3).max(Duration::from_millis(500))
    }
}

/// `/kvtier/<cluster>/members/`: where members register.
pub fn member_prefix(cluster: &str) -> String {
    format!("/kvtier/{cluster}/members/")
}

/// The running membership of this node; dropping it (or `leave`) revokes
/// the lease, so the others drop this node at once rather than after the
/// lease runs out.
#[derive(Debug)]
pub struct Membership {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Membership {
    /// Starts registering `view`'s node and keeping the view current.
    /// Returns at once: the first registration happens in the background
    /// (a node whose etcd is down still serves its own keys).
    pub fn start(config: MembershipConfig, view: Arc<ClusterView>) -> std::io::Result<Membership> {
        config
            .access
            .check(&config.endpoints)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        if config.endpoints.is_empty() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "cluster mode needs at least one etcd endpoint",
            ));
        }
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("kvtier-membership".into())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a one-thread runtime starts");
                runtime.block_on(run(config, view, flag));
            })?;
        Ok(Membership {
            stop,
            thread: Some(thread),
        })
    }

    /// Leaves the cluster: revokes the lease (bounded) and stops.
    pub fn leave(mut self) {
        self.stop_and_join();
    }

    fn stop_and_join(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

/// The members registered in `cluster` whose records verify under
/// `record_key`, read once (for `kvtier cluster status` and tests).
pub async fn list_members(
    endpoints: &[String],
    access: &EtcdAccess,
    cluster: &str,
    record_key: &[u8; 32],
    timeout: Duration,
) -> Result<Vec<Member>, String> {
    access.check(endpoints)?;
    let mut client = bounded(
        timeout,
        Client::connect(endpoints, Some(access.options(timeout))),
    )
    .await?;
    read_members(&mut client, cluster, record_key, timeout).await
}

/// Awaits `call` for at most `limit`, turning both a timeout and an etcd
/// error into a message.
async fn bounded<T>(
    limit: Duration,
    call: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, String> {
    match tokio::time::timeout(limit, call).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer from etcd within {limit:?}")),
    }
}

async fn read_members(
    client: &mut Client,
    cluster: &str,
    record_key: &[u8; 32],
    timeout: Duration,
) -> Result<Vec<Member>, String> {
    let response = bounded(
        timeout,
        client.get(
            member_prefix(cluster),
            Some(GetOptions::new().with_prefix()),
        ),
    )
    .await?;
    let mut members = Vec::new();
    let prefix = member_prefix(cluster);
    for kv in response.kvs() {
        match verify_member(record_key, kv.key(), kv.value()) {
            // A member registers under its own id (and signs the key): a
            // record under another key claims an id it was not
            // registered as.
            Ok(member) if kv.key() != format!("{prefix}{}", member.id).as_bytes() => {
                tracing::warn!(
                    key = %String::from_utf8_lossy(kv.key()),
                    id = %member.id,
                    "ignoring a member record stored under another member's key"
                );
            }
            Ok(member) => members.push(member),
            Err(why) => {
                // Every relist would repeat it: warn once per key.
                let mut warned = FORGED_WARNED.lock().unwrap();
                if warned.len() >= 1024 {
                    warned.clear();
                }
                if warned.insert(kv.key().to_vec()) {
                    tracing::warn!(
                        key = %String::from_utf8_lossy(kv.key()),
                        %why,
                        "ignoring a member record that this cluster's token did not sign"
                    );
                }
            }
        }
    }
    Ok(members)
}

/// While etcd stays away, how often the outage is logged as a warning (the
/// retries in between log at debug level).
const OUTAGE_WARNING_EVERY: Duration = Duration::from_secs(30);

async fn run(config: MembershipConfig, view: Arc<ClusterView>, stop: Arc<AtomicBool>) {
    let mut lease: Option<i64> = None;
    let mut backoff = Duration::from_millis(100);
    let mut warned: Option<Instant> = None;
    while !stop.load(Ordering::Acquire) {
        let started = Instant::now();
        match session(&config, &view, &stop, &mut lease).await {
            Ok(()) => return,
            Err(reason) => {
                view.etcd_reachable.store(false, Ordering::Relaxed);
                view.etcd_errors.fetch_add(1, Ordering::Relaxed);
                // A session that ran a while was a working one: the next
                // failure is a new outage, worth a warning at once.
                if started.elapsed() > config.lease_ttl {
                    warned = None;
                    backoff = Duration::from_millis(100);
                }
                if warned.is_none_or(|t| t.elapsed() >= OUTAGE_WARNING_EVERY) {
                    warned = Some(Instant::now());
                    tracing::warn!(%reason, members = view.members().len(), "etcd session ended; serving with the last view and trying again");
                } else {
                    tracing::debug!(%reason, "etcd still unreachable");
                }
                // Short waits, checked against the stop flag.
                let until = Instant::now() + backoff;
                while Instant::now() < until && !stop.load(Ordering::Acquire) {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                backoff = (backoff * 2).min(config.lease_ttl / 2);
            }
        }
    }
}

/// One connection's worth of membership: (re-)register, then renew the
/// lease and follow the member prefix until something fails or we stop.
async fn session(
    config: &MembershipConfig,
    view: &ClusterView,
    stop: &AtomicBool,
    lease: &mut Option<i64>,
) -> Result<(), String> {
    let limit = config.call_timeout();
    let mut client = bounded(
        limit,
        Client::connect(&config.endpoints, Some(config.access.options(limit))),
    )
    .await?;
    // The lease we had may have outlived the outage: then we are still the
    // same incarnation. If it expired, the others dropped us: come back as
    // a new incarnation.
    let alive = match *lease {
        Some(id) => bounded(limit, client.lease_time_to_live(id, None))
            .await
            .map(|r| r.ttl() > 0)?,
        None => false,
    };
    let prefix = member_prefix(&view.name);
    let id = match (*lease, alive) {
        (Some(id), true) => id,
        (previous, _) => {
            if previous.is_some() {
                view.lease_losses.fetch_add(1, Ordering::Relaxed);
                view.set_incarnation(new_incarnation());
            }
            let ttl = config.lease_ttl.as_secs().max(1) as i64;
            let id = bounded(limit, client.lease_grant(ttl, None)).await?.id();
            let me = view.me();
            let key = format!("{prefix}{}", me.id);
            let value = sign_member(&config.record_key, &key, &me);
            bounded(
                limit,
                client.put(key, value, Some(PutOptions::new().with_lease(id))),
            )
            .await?;
            *lease = Some(id);
            view.registrations.fetch_add(1, Ordering::Relaxed);
            tracing::info!(node = %me.id, incarnation = me.incarnation, lease = id, cluster = %view.name, "registered in the cluster");
            id
        }
    };
    view.etcd_reachable.store(true, Ordering::Relaxed);
    view.set_members(read_members(&mut client, &view.name, &config.record_key, limit).await?);
    let (mut keeper, mut renewals) = bounded(limit, client.lease_keep_alive(id)).await?;
    let mut watch = bounded(
        limit,
        client.watch(prefix.clone(), Some(WatchOptions::new().with_prefix())),
    )
    .await?;
    let mut renew = tokio::time::interval(config.keepalive_every());
    let mut relist = tokio::time::interval(Duration::from_secs(5));
    let mut stop_check = tokio::time::interval(Duration::from_millis(100));
    let mut last_renewed = Instant::now();
    loop {
        tokio::select! {
            _ = stop_check.tick() => {
                if stop.load(Ordering::Acquire) {
                    // Leave at once rather than after the lease runs out.
                    let _ = bounded(limit, client.lease_revoke(id)).await;
                    *lease = None;
                    return Ok(());
                }
                if last_renewed.elapsed() > config.lease_ttl {
                    return Err(format!("no lease renewal answered for {:?}", last_renewed.elapsed()));
                }
            }
            _ = renew.tick() => bounded(limit, keeper.keep_alive()).await?,
            answer = renewals.message() => match answer {
                Ok(Some(r)) if r.ttl() > 0 => {
                    last_renewed = Instant::now();
                    view.etcd_reachable.store(true, Ordering::Relaxed);
                }
                Ok(Some(_)) => return Err("our lease expired".into()),
                Ok(None) => return Err("the lease renewal stream ended".into()),
                Err(e) => return Err(e.to_string()),
            },
            event = watch.message() => match event {
                Ok(Some(_)) => view.set_members(read_members(&mut client, &view.name, &config.record_key, limit).await?),
                Ok(None) => return Err("the member watch ended".into()),
                Err(e) => return Err(e.to_string()),
            },
            // A safety net under the watch, and the view's age stays fresh.
            _ = relist.tick() => view.set_members(read_members(&mut client, &view.name, &config.record_key, limit).await?),
        }
    }
}
