//! What every connection of one server shares: the store, the
//! configuration, authentication, the budgets every peer draws from, the
//! cluster peers and the metrics. Built by `Server::start`; the sessions
//! and the admin endpoint read it.

use crate::limits::Budget;
use crate::metrics::Metrics;
use crate::{Auth, ServerConfig};
use kvtier::Store;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What every connection of one server shares.
#[derive(Debug)]
pub(crate) struct Shared {
    pub store: Arc<Store>,
    pub config: ServerConfig,
    pub auth: Auth,
    pub stopping: Arc<AtomicBool>,
    pub metrics: Arc<Metrics>,
    /// Connection slots, before and after hello.
    pub admission: crate::admission::Admission,
    /// Every budget a peer draws on, split between principals, and the
    /// guess budget every login spends from.
    pub governor: Arc<kvtier_governor::Governor>,
    /// Bytes of shared memory registered by all connections.
    pub registered: Arc<Budget>,
    /// Shared buffers registered by all connections (each is a mapping).
    pub registered_buffers: Arc<Budget>,
    /// Bytes of streamed put values still arriving (their pool extents):
    /// a budget of the governor, a share per principal.
    pub receiving: Arc<kvtier_governor::Pool>,
    /// Bytes of pool extents leased to clients that map the pool.
    pub leasing: Arc<Budget>,
    /// Heap buffers clients cause: request bodies and reply staging
    /// (`Limits::max_buffer_bytes`): a budget of the governor.
    pub buffers: Arc<kvtier_governor::Pool>,
    /// Connections to the other cluster members, in cluster mode.
    pub peers: Option<Arc<kvtier_client::routing::Peers>>,
    /// Refused connections, warned about at most once a second.
    pub refusal_log: RateLimitedWarning,
    /// When each namespace was last served, and the last census.
    pub namespace_use: crate::namespaces::NamespaceUse,
}

/// How often idle reads and accept loops look at the stop flag and the
/// deadlines.
pub(crate) const POLL: Duration = Duration::from_millis(100);

/// A warning said at most once a second, with how many occurrences it
/// stood for (a lockout attempt refused thousands of connections a
/// second and logged each).
#[derive(Debug, Default)]
pub(crate) struct RateLimitedWarning(std::sync::Mutex<(Option<Instant>, u64)>);

impl RateLimitedWarning {
    /// `Some(occurrences since the last warning)` when a warning is due.
    pub(crate) fn due(&self) -> Option<u64> {
        let mut state = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let (last, count) = &mut *state;
        *count += 1;
        if last.is_some_and(|at| now.duration_since(at) < Duration::from_secs(1)) {
            return None;
        }
        *last = Some(now);
        Some(std::mem::take(count))
    }
}
