//! Every connection's slot, from the server's governor: a grant of the
//! feed's budgets taken before the connection's thread starts and held
//! until it ends, so no connection, however it ends, outlives its slot.
//!
//! - `feed handshakes` (both sockets together): a connection from accept
//!   until its handshake is done. Every such peer has proven nothing, so
//!   they together hold at most the unauthenticated peers' share.
//! - `feed subscribers`, `feed replays`: a connection once its handshake
//!   is done, charged to its login's principal (`config::Principals`): a
//!   tenant holds at most its share and always reaches its floor, the
//!   server's own token finds its reserve.
//!
//! Where a budget has no room for a newcomer, one connection is closed
//! for it when one may be (`Peer::closable`: in its handshake, an idle
//! subscriber, a replay peer between requests; never a replay being
//! answered or a subscriber being sent batches), taken from the principal
//! most over its floor of those whose slot would make room; the newcomer
//! then takes that slot once the closed connection's thread lets go. With
//! none to close the newcomer is closed at once, no thread started.

use crate::config::{KvEventsConfig, Principals};
use crate::shared::{Shared, Stage};
use kvtier_governor::{Grant, Pool, Principal};
use std::collections::BTreeSet;
use std::io;
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How long a newcomer waits for the slot of the connection closed for
/// it: that connection's thread ends as soon as it sees its socket shut
/// down or its flag set (its waits look every 10 ms).
const SLOT_HANDOVER: Duration = Duration::from_secs(2);

/// Which budget a slot is of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Handshake,
    Subscriber,
    Replay,
}

/// The feed's budgets (see the module).
#[derive(Debug)]
pub(crate) struct Budgets {
    handshakes: Arc<Pool>,
    subscribers: Arc<Pool>,
    replays: Option<Arc<Pool>>,
    idle_limit: Duration,
    principals: Principals,
}

impl Budgets {
    pub(crate) fn new(config: &KvEventsConfig) -> Budgets {
        let limit = config.max_connections as u64;
        let governor = &config.governor;
        Budgets {
            handshakes: governor.budget("feed handshakes", limit),
            subscribers: governor.budget("feed subscribers", limit),
            replays: config
                .replay
                .map(|_| governor.budget("feed replays", limit)),
            idle_limit: config.peer_timeout,
            principals: config.principals(),
        }
    }

    pub(crate) fn pool(&self, kind: Kind) -> &Arc<Pool> {
        match kind {
            Kind::Handshake => &self.handshakes,
            Kind::Subscriber => &self.subscribers,
            Kind::Replay => self
                .replays
                .as_ref()
                .expect("replay slots only where the replay socket runs"),
        }
    }

    /// A slot of `kind` for `who`: at once where there is room, else the
    /// slot of a connection closed for it (see the module); `None` when
    /// none may be closed or its slot did not come back in time.
    pub(crate) fn slot(&self, shared: &Shared, kind: Kind, who: Principal) -> Option<Grant> {
        let pool = self.pool(kind);
        if let Some(grant) = pool.try_take(who, 1) {
            return Some(grant);
        }
        if !self.close_one_for(shared, kind, who) {
            return None;
        }
        pool.take_within(who, 1, SLOT_HANDOVER)
    }

    /// Closes one connection holding a slot of `kind` for `who`; `false`
    /// when none may be closed, or none of those whose slot would make
    /// room for `who`.
    fn close_one_for(&self, shared: &Shared, kind: Kind, who: Principal) -> bool {
        let pool = self.pool(kind);
        let mut peers = shared.peers.lock().unwrap();
        let candidate = |peer: &crate::shared::Peer| {
            let of_kind = match kind {
                Kind::Handshake => matches!(peer.stage, Stage::Handshake),
                Kind::Subscriber => !peer.replay && matches!(peer.stage, Stage::Subscribed(_)),
                Kind::Replay => {
                    peer.replay && matches!(peer.stage, Stage::ReplayWaiting | Stage::ReplayServing)
                }
            };
            of_kind && !peer.closed.load(Ordering::Acquire) && peer.closable(self.idle_limit)
        };
        // Whose slot makes room: `who`'s own where it is at its share; the
        // server's only where the whole budget is used (the others' part,
        // which bounds tenants and unauthenticated peers, holds none of
        // the server's); anyone else's otherwise.
        let at_share = pool.held_by(who) >= pool.share_of(who);
        let full = pool.used() >= pool.limit();
        let helps = |p: Principal| {
            if at_share {
                p == who
            } else {
                p != Principal::Server || who == Principal::Server || full
            }
        };
        let principals: BTreeSet<Principal> = peers
            .values()
            .filter(|p| candidate(p))
            .map(|p| p.principal)
            .filter(|&p| helps(p))
            .collect();
        let Some(from) = pool.most_over_floor(principals) else {
            return false;
        };
        // Its oldest closable connection.
        let Some(victim) = peers
            .values_mut()
            .find(|p| p.principal == from && candidate(p))
        else {
            return false;
        };
        victim.closed.store(true, Ordering::Release);
        let _ = victim.closer.shutdown(Shutdown::Both);
        shared.peers_closed.fetch_add(1, Ordering::Relaxed);
        true
    }
}

/// What a connection's thread needs of the publisher: its slot's moves
/// and its stage.
pub(crate) struct PeerThread<'a> {
    pub(crate) shared: &'a Shared,
    pub(crate) config: &'a KvEventsConfig,
    pub(crate) budgets: &'a Budgets,
    pub(crate) id: u64,
    pub(crate) closed: &'a AtomicBool,
}

impl PeerThread<'_> {
    /// Whether it was closed for a newcomer.
    pub(crate) fn closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Its handshake done with `scope`: its slot moves from the handshake
    /// budget to `kind`'s, charged to the login's principal, and it is in
    /// `stage` from now on. An error (the connection ends) when that
    /// principal has no room there and none can be made.
    pub(crate) fn logged_in(
        &self,
        handshake: Grant,
        kind: Kind,
        scope: &Option<kvtier_server::Scope>,
        stage: Stage,
    ) -> io::Result<Grant> {
        let who = self.budgets.principals.of(scope);
        self.set_stage(None, Stage::LoggedIn)?;
        let Some(slot) = self.budgets.slot(self.shared, kind, who) else {
            self.shared.peers_refused.fetch_add(1, Ordering::Relaxed);
            return Err(io::Error::new(
                io::ErrorKind::ResourceBusy,
                format!(
                    "no room for {who} on the feed ({})",
                    self.budgets.pool(kind).name()
                ),
            ));
        };
        drop(handshake);
        self.set_stage(Some(who), stage)?;
        Ok(slot)
    }

    /// Moves it to `stage` (and charges it to `who`); an error when it was
    /// closed for a newcomer meanwhile.
    pub(crate) fn set_stage(&self, who: Option<Principal>, stage: Stage) -> io::Result<()> {
        let mut peers = self.shared.peers.lock().unwrap();
        match peers.get_mut(&self.id) {
            Some(peer) if !peer.closed.load(Ordering::Acquire) => {
                if let Some(who) = who {
                    peer.principal = who;
                }
                peer.stage = stage;
                Ok(())
            }
            _ => Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "closed for a newcomer",
            )),
        }
    }
}
