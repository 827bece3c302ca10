//! Every limit the server enforces, with its default, and the two
//! server-wide budgets (connections, registered shared memory). A limit is
//! checked in exactly one place; docs/server.md lists them all.

use kvtier_governor::{Grant, Pool, Principal};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The server's limits. `Limits::default()` is what `kvtier serve` uses.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Largest frame body accepted after hello. Default: 1 GiB.
    pub max_frame: u64,
    /// Largest frame body accepted before hello (a hello is a few hundred
    /// bytes): nothing unauthenticated can make the server allocate more.
    /// Default: 4 KiB.
    pub max_hello_frame: u64,
    /// Most keys in one batch. Default: 4096.
    pub max_batch: u32,
    /// Most authenticated client connections (data ports together): a
    /// connection takes its slot at a successful hello; past the cap the
    /// hello is answered with LIMIT and the connection closed. Default:
    /// 1024.
    pub max_connections: usize,
    /// Most connections that have not completed a hello yet (TCP, and Unix
    /// peers of another user), split between principals by the governor:
    /// each waits as the principal its first message names (a challenge's
    /// token, a plain hello's valid token), else as unauthenticated peers,
    /// who together hold at most `anonymous_share_percent` of it (64 of
    /// the default: as many as all waiting connections could before the
    /// split; a TLS client is unauthenticated until its hello is read).
    /// Past a principal's share, its oldest waiting connection makes room.
    /// Default: 256.
    pub max_pending_connections: usize,
    /// Slots beyond `max_connections` that only Unix-socket peers of the
    /// server's own user (trusted by their credentials) may take. Default:
    /// 64.
    pub reserved_local_connections: usize,
    /// Most unauthenticated TCP connections (waiting for their hello as
    /// no token's) from one remote address; a token's connections are
    /// bounded by its share from any address (every local user has 2^24
    /// loopback addresses). Default: 256.
    pub max_connections_per_address: usize,
    /// Most accepted connections that have not sent a byte yet (TCP, and
    /// Unix peers of another user), in the lobby: they hold a descriptor
    /// and nothing else, and a newcomer past the cap closes the oldest
    /// instead of being refused. Default: 1024.
    pub max_lobby_connections: usize,
    /// Most of those from one address (past it, that address's oldest is
    /// closed). Default: 256.
    pub max_lobby_per_address: usize,
    /// Refused hellos answered per second, server-wide (each also waits
    /// `failed_auth_delay`): caps token guessing however many connections
    /// guess in parallel. Default: 10.
    pub max_failed_hellos_per_second: u32,
    /// A connection must complete its hello within this. Default: 5 s.
    pub handshake_timeout: Duration,
    /// A connection with no request for this long is closed (clients
    /// reconnect by themselves). Default: 1 h.
    pub idle_timeout: Duration,
    /// A frame, once its first byte arrived, must be whole within
    /// `frame_timeout + body_len / min_frame_rate`. Defaults: 10 s and
    /// 4 MiB/s (a 1 GiB frame gets 266 s).
    pub frame_timeout: Duration,
    pub min_frame_rate: u64,
    /// A reply that cannot be written for this long closes the connection.
    /// Default: 60 s.
    pub write_timeout: Duration,
    /// Per-connection buffers larger than this are released once the
    /// connection has been idle for a second. Default: 1 MiB.
    pub retained_buffer_bytes: usize,
    /// Shared memory one connection may register, in bytes and buffers.
    /// Defaults: 64 GiB, 64.
    pub max_registered_bytes: u64,
    pub max_registered_buffers: usize,
    /// Shared memory all connections together may register. Default:
    /// 256 GiB.
    pub max_registered_bytes_total: u64,
    /// Shared buffers all connections together may register (each is a
    /// mapping; none holds a descriptor). Default: 4096.
    pub max_registered_buffers_total: usize,
    /// Bytes of streamed put values that may be arriving at once, all
    /// connections together (each holds a pool extent of its announced
    /// length until its bytes are in): the share of the pool unfinished
    /// values may pin. Default (`None`): half the memory tier.
    pub max_receiving_bytes: Option<u64>,
    /// Bytes of heap buffers that clients may cause, all connections
    /// together: request bodies (taken as their bytes arrive) and reply
    /// staging (disk reads, values from other members). A request that
    /// finds the budget spent waits up to `buffer_wait` for room, then is
    /// answered LIMIT (its body read and dropped; the connection stays).
    /// Default (`None`): the memory tier's size, at least `max_frame`.
    pub max_buffer_bytes: Option<u64>,
    /// How long a request waits for room in the buffer budget. Default:
    /// 2 s.
    pub buffer_wait: Duration,
    /// The share of `max_buffer_bytes` and of `max_receiving_bytes` one
    /// tenant's connections may hold together, in percent: a tenant that
    /// holds its share waits (then LIMIT / NO_SPACE) while the others go
    /// on. Clients of the server's own token share the whole. Default: 50.
    pub tenant_share_percent: u8,
    /// The part of `max_buffer_bytes` and of `max_receiving_bytes`, in
    /// percent, that tenants cannot take together: clients of the server's
    /// own token always find it. The rest is the tenants' pool, in which
    /// each tenant may always reach an even split whatever the others hold
    /// (`TenantPool`). Default: 25.
    pub tenant_reserve_percent: u8,
    /// The most of any governed budget that unauthenticated peers together
    /// may hold, in percent (they have no floor: they never take room a
    /// tenant's floor needs). Default: 25.
    pub anonymous_share_percent: u8,
    /// Pause before a refused hello is answered, so a token cannot be
    /// guessed at the speed of the network. Default: 1 s.
    pub failed_auth_delay: Duration,
    /// Most concurrent admin HTTP connections. Default: 256.
    pub max_admin_connections: usize,
    /// An admin request must arrive whole within this, and its answer be
    /// written within it. Default: 5 s.
    pub admin_timeout: Duration,
    /// Cluster mode: a call to another member must connect and answer
    /// within this, or its keys count as misses (and the member is skipped
    /// for a second). Default: 2 s.
    pub peer_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_frame: kvtier_wire::protocol::DEFAULT_MAX_FRAME,
            max_hello_frame: 4 << 10,
            max_batch: kvtier_wire::protocol::DEFAULT_MAX_BATCH,
            max_connections: 1024,
            max_pending_connections: 256,
            reserved_local_connections: 64,
            max_connections_per_address: 256,
            max_lobby_connections: 1024,
            max_lobby_per_address: 256,
            max_failed_hellos_per_second: 10,
            handshake_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(3600),
            frame_timeout: Duration::from_secs(10),
            min_frame_rate: 4 << 20,
            write_timeout: Duration::from_secs(60),
            retained_buffer_bytes: 1 << 20,
            max_registered_bytes: 64 << 30,
            max_registered_buffers: 64,
            max_registered_bytes_total: 256 << 30,
            max_registered_buffers_total: 4096,
            max_receiving_bytes: None,
            max_buffer_bytes: None,
            buffer_wait: Duration::from_secs(2),
            tenant_share_percent: 50,
            tenant_reserve_percent: 25,
            anonymous_share_percent: 25,
            failed_auth_delay: Duration::from_secs(1),
            max_admin_connections: 256,
            admin_timeout: Duration::from_secs(5),
            peer_timeout: Duration::from_secs(2),
        }
    }
}

/// Descriptors kept for the server itself beyond its connections: the
/// listeners, io_uring rings, the data directory and its lock, the next
/// region file, the admin runtime, logging. (Region files are counted
/// apart, from the store's capacity.)
pub const DESCRIPTOR_RESERVE: u64 = 256;

/// Descriptors kept for other writers' region files (a shared directory)
/// before the connection caps are fitted, where the open-file limit leaves
/// an eighth of this at least; they get whatever the caps leave besides.
pub const MIN_OTHER_REGION_FILES: u64 = 64;

/// Buffer bytes each connection holds outside the buffer budget: a small
/// request or reply (a hello, a batch of exists, a get of a few small
/// values) is never refused for memory, whoever holds the budget. The
/// budget bounds the rest; RSS is bounded by the pool, the budget, and
/// this times the connections.
pub const FREE_BUFFER_BYTES: usize = 64 << 10;

/// Connections past `max_admin_connections` still answered (`/health`).
pub const ADMIN_OVERFLOW: u64 = 64;

/// The smallest lobby a server starts with when the lobby must be lowered
/// to fit the open-file limit.
pub const MIN_LOBBY: usize = 64;

/// The fewest waiting connections a server starts with when
/// `max_pending_connections` must be lowered to fit the open-file limit.
pub const MIN_PENDING: usize = 64;

/// The fewest authenticated connections a server starts with when
/// `max_connections` must be lowered to fit the open-file limit.
pub const MIN_CONNECTIONS: usize = 16;

impl Limits {
    /// How the governor splits every budget between principals.
    pub fn shares(&self) -> kvtier_governor::Shares {
        kvtier_governor::Shares {
            reserve_percent: self.tenant_reserve_percent,
            tenant_share_percent: self.tenant_share_percent,
            anonymous_percent: self.anonymous_share_percent,
        }
    }

    /// Descriptors the connection caps together may hold: one socket per
    /// connection of any kind (a registered shared buffer holds none), and
    /// a second handle on each connection waiting for its hello (to close
    /// it for a newcomer).
    pub fn connection_descriptors(&self) -> u64 {
        (self.max_connections
            + self.reserved_local_connections
            + 2 * self.max_pending_connections
            + self.max_lobby_connections
            + self.max_admin_connections) as u64
            + ADMIN_OVERFLOW
    }

    /// Fits the connection caps under `available` descriptors by lowering
    /// `max_connections` (to no fewer than `MIN_CONNECTIONS`); returns what
    /// it changed, to be said, or why the caps cannot fit.
    pub fn fit_descriptors(&mut self, available: u64) -> Result<Option<String>, String> {
        // On a copy: nothing changes when the caps cannot fit.
        let mut fitted = self.clone();
        let said = fitted.fit_into(available)?;
        *self = fitted;
        Ok(said)
    }

    fn fit_into(&mut self, available: u64) -> Result<Option<String>, String> {
        let needed = self.connection_descriptors();
        if needed <= available {
            return Ok(None);
        }
        // The lobby first (its sockets are the cheapest to lose: a full
        // lobby closes its oldest silent one), down to MIN_LOBBY.
        let lobby_was = self.max_lobby_connections;
        let excess = (needed - available) as usize;
        let lobby = lobby_was
            .saturating_sub(excess)
            .max(MIN_LOBBY.min(lobby_was));
        self.max_lobby_connections = lobby;
        self.max_lobby_per_address = self.max_lobby_per_address.min(lobby);
        let lobby_note = (lobby < lobby_was).then(|| {
            format!("max_lobby_connections lowered from {lobby_was} to {lobby} to fit the open-file limit")
        });
        let needed = self.connection_descriptors();
        if needed <= available {
            return Ok(lobby_note);
        }
        // Then the waiting connections (two descriptors each), down to
        // MIN_PENDING: unauthenticated peers keep their share of those.
        let pending_was = self.max_pending_connections;
        let excess = (needed - available).div_ceil(2) as usize;
        let pending = pending_was
            .saturating_sub(excess)
            .max(MIN_PENDING.min(pending_was));
        self.max_pending_connections = pending;
        let pending_note = (pending < pending_was).then(|| {
            format!(
                "max_pending_connections lowered from {pending_was} to {pending} to fit the \
                 open-file limit"
            )
        });
        let lobby_note = match (lobby_note, pending_note) {
            (Some(a), Some(b)) => Some(format!("{a}; {b}")),
            (a, b) => a.or(b),
        };
        let needed = self.connection_descriptors();
        if needed <= available {
            return Ok(lobby_note);
        }
        let others = needed - self.max_connections as u64;
        let room = available.saturating_sub(others);
        if room < MIN_CONNECTIONS as u64 {
            return Err(format!(
                "the open-file limit leaves {available} descriptors for connections, fewer \
                 than the {others} the other caps need plus {MIN_CONNECTIONS}: raise the \
                 limit (ulimit -n, LimitNOFILE=) or lower max_pending_connections, \
                 max_lobby_connections, reserved_local_connections or max_admin_connections"
            ));
        }
        let was = self.max_connections;
        self.max_connections = room as usize;
        let note = format!(
            "max_connections lowered from {was} to {room} to fit the open-file limit \
             ({available} descriptors left for connections); raise the limit to keep {was}"
        );
        Ok(Some(match lobby_note {
            Some(lobby) => format!("{lobby}; {note}"),
            None => note,
        }))
    }
}

/// Raises this process's soft open-file limit to its hard limit and
/// returns the soft limit now in effect.
pub fn raise_open_file_limit() -> u64 {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let limit = getrlimit(Resource::Nofile);
    if limit.current != limit.maximum {
        let raised = rustix::process::Rlimit {
            current: limit.maximum,
            maximum: limit.maximum,
        };
        if let Err(e) = setrlimit(Resource::Nofile, raised) {
            tracing::warn!(error = %e, "could not raise the open-file limit to its hard limit");
        }
    }
    getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX)
}

/// A counted budget shared by every connection: connections open, or bytes
/// of shared memory registered. A permit gives its share back on drop, so
/// no exit path of a connection can leak it.
#[derive(Debug)]
pub struct Budget {
    used: AtomicU64,
    limit: u64,
}

impl Budget {
    pub fn new(limit: u64) -> Arc<Budget> {
        Arc::new(Budget {
            used: AtomicU64::new(0),
            limit,
        })
    }

    /// Takes `amount`, or returns `None` (taking nothing) if that would pass
    /// the limit.
    pub fn try_take(self: &Arc<Self>, amount: u64) -> Option<Permit> {
        self.reserve(amount).then(|| Permit {
            budget: Arc::clone(self),
            amount,
        })
    }

    /// Counts `amount` as used if the limit allows it.
    fn reserve(&self, amount: u64) -> bool {
        let mut used = self.used.load(Ordering::Relaxed);
        loop {
            let Some(next) = used.checked_add(amount).filter(|&n| n <= self.limit) else {
                return false;
            };
            match self
                .used
                .compare_exchange_weak(used, next, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => return true,
                Err(now) => used = now,
            }
        }
    }

    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }
}

/// A share of a [`Budget`], returned on drop.
#[derive(Debug)]
pub struct Permit {
    budget: Arc<Budget>,
    amount: u64,
}

impl Budget {
    /// A share of nothing yet, to grow with [`Permit::grow_to`].
    pub fn empty_permit(self: &Arc<Self>) -> Permit {
        Permit {
            budget: Arc::clone(self),
            amount: 0,
        }
    }
}

impl Permit {
    pub fn amount(&self) -> u64 {
        self.amount
    }

    /// Grows (or shrinks) this share to `to`; `false` (nothing changed)
    /// when growing would pass the budget's limit.
    pub fn try_set(&mut self, to: u64) -> bool {
        if to <= self.amount {
            self.budget
                .used
                .fetch_sub(self.amount - to, Ordering::AcqRel);
            self.amount = to;
            return true;
        }
        if !self.budget.reserve(to - self.amount) {
            return false;
        }
        self.amount = to;
        true
    }

    /// [`try_set`](Self::try_set), waiting up to `wait` for others to give
    /// room back.
    pub fn set_within(&mut self, to: u64, wait: Duration) -> bool {
        retry_within(wait, || self.try_set(to))
    }
}

/// A budget of the governor (heap buffers, receiving values) as one
/// principal draws on it: what it holds counts against its share, the
/// others' floors and the server's reserve (`kvtier_governor::Pool`).
#[derive(Debug, Clone)]
pub struct Budgets {
    pool: Arc<Pool>,
    principal: Principal,
}

/// What a principal holds of its [`Budgets`]; given back on drop.
pub type Held = Grant;

impl Budgets {
    pub fn new(pool: &Arc<Pool>, principal: Principal) -> Budgets {
        Budgets {
            pool: Arc::clone(pool),
            principal,
        }
    }

    /// The most this principal may hold.
    pub fn limit(&self) -> u64 {
        self.pool.share_of(self.principal)
    }

    /// What is in use: server-wide, and by this principal when it is a
    /// tenant.
    pub fn used(&self) -> (u64, Option<u64>) {
        (
            self.pool.used(),
            matches!(self.principal, Principal::Tenant(_))
                .then(|| self.pool.held_by(self.principal)),
        )
    }

    pub fn empty(&self) -> Held {
        self.pool.empty(self.principal)
    }

    /// Takes `amount`, waiting up to `wait` for room.
    pub fn take_within(&self, amount: u64, wait: Duration) -> Option<Held> {
        self.pool.take_within(self.principal, amount, wait)
    }
}

/// Calls `attempt` until it succeeds or `wait` has passed (at least once).
fn retry_within(wait: Duration, mut attempt: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + wait;
    loop {
        if attempt() {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.amount, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_caps_are_fitted_under_the_open_file_limit() {
        let mut limits = Limits::default();
        let needed = limits.connection_descriptors();
        assert_eq!(limits.fit_descriptors(needed), Ok(None));
        // The lobby gives way first...
        let said = limits.fit_descriptors(needed - 500).unwrap().unwrap();
        assert_eq!(
            (limits.max_lobby_connections, limits.max_connections),
            (524, 1024)
        );
        assert!(
            said.contains("max_lobby_connections lowered from 1024 to 524"),
            "{said}"
        );
        assert_eq!(limits.connection_descriptors(), needed - 500);
        // ...down to MIN_LOBBY, then the waiting connections (two
        // descriptors each) down to MIN_PENDING, then the authenticated ones.
        let mut limits = Limits::default();
        let said = limits.fit_descriptors(needed - 1500).unwrap().unwrap();
        assert_eq!(limits.max_lobby_connections, MIN_LOBBY);
        assert_eq!(limits.max_lobby_per_address, MIN_LOBBY);
        assert_eq!(limits.max_pending_connections, MIN_PENDING);
        assert!(
            said.contains("max_pending_connections lowered from 256 to 64"),
            "{said}"
        );
        let freed = (1024 - MIN_LOBBY) + 2 * (256 - MIN_PENDING);
        assert_eq!(limits.max_connections, 1024 - (1500 - freed));
        assert!(said.contains("max_connections lowered from 1024"), "{said}");
        assert_eq!(limits.connection_descriptors(), needed - 1500);
        let mut limits = Limits::default();
        assert!(limits.fit_descriptors(100).is_err());
        assert_eq!(
            (limits.max_connections, limits.max_lobby_connections),
            (1024, 1024),
            "nothing changed on a refusal"
        );
    }

    #[test]
    fn budget_refuses_past_its_limit_and_gets_shares_back() {
        let budget = Budget::new(10);
        let a = budget.try_take(6).unwrap();
        assert!(budget.try_take(5).is_none());
        let b = budget.try_take(4).unwrap();
        assert_eq!(budget.used(), 10);
        drop(a);
        assert_eq!(budget.used(), 4);
        assert!(budget.try_take(u64::MAX).is_none());
        drop(b);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn a_permit_grows_within_the_budget_and_shrinks_back() {
        let budget = Budget::new(10);
        let mut held = budget.empty_permit();
        assert!(held.try_set(7));
        let other = budget.try_take(3).unwrap();
        assert!(!held.try_set(8), "past the limit");
        assert_eq!((held.amount(), budget.used()), (7, 10));
        assert!(!held.set_within(8, Duration::from_millis(20)));
        drop(other);
        assert!(held.set_within(10, Duration::from_millis(20)));
        assert!(held.try_set(2));
        assert_eq!(budget.used(), 2);
        drop(held);
        assert_eq!(budget.used(), 0);
    }
}
