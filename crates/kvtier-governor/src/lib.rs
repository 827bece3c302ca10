//! kvtier's governor: every scarce thing a peer can hold or cause, as a
//! budget split between principals.
//!
//! A listener or an expensive operation does not keep a cap of its own: it
//! asks the one [`Governor`] of its server for a [`Grant`] of a named
//! [`Pool`] (connection slots, pending hellos, buffer bytes, bounded-read
//! threads, store scans, feed subscribers, replays) in the name of a
//! [`Principal`] (the server's own token, a tenant, or unauthenticated
//! peers together), and every login spends from its one [`GuessBudget`].
//! So a new surface gets the same rules as the old ones by construction:
//! a share per principal, a reserve for the server's own token, a floor
//! each tenant always reaches, the smallest share for those who proved
//! nothing, and grants that go back on drop. docs/server.md ("The
//! governor") lists the budgets, their defaults and who draws on them.

mod guesses;
mod pool;
mod principal;

pub use guesses::GuessBudget;
pub use pool::{Grant, Pool, Shares};
pub use principal::Principal;

use std::sync::{Arc, Mutex};

/// The budgets of one server, and its guess budget.
#[derive(Debug)]
pub struct Governor {
    tenants: usize,
    shares: Shares,
    pools: Mutex<Vec<Arc<Pool>>>,
    guesses: GuessBudget,
}

impl Governor {
    /// A governor for a server with `tenants` tenants, splitting every
    /// budget by `shares`, and `guesses` for every login.
    pub fn new(tenants: usize, shares: Shares, guesses: GuessBudget) -> Arc<Governor> {
        Arc::new(Governor {
            tenants,
            shares,
            pools: Mutex::new(Vec::new()),
            guesses,
        })
    }

    /// A new budget of `limit` units, split as every other; listed by
    /// [`budgets`](Self::budgets) (the metrics and the status page show
    /// each).
    pub fn budget(&self, name: &'static str, limit: u64) -> Arc<Pool> {
        let pool = Pool::new(name, limit, self.tenants, self.shares);
        self.pools
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Arc::clone(&pool));
        pool
    }

    /// Every budget made so far, in the order made.
    pub fn budgets(&self) -> Vec<Arc<Pool>> {
        self.pools.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The one guess budget every login spends from.
    pub fn guesses(&self) -> &GuessBudget {
        &self.guesses
    }

    pub fn tenants(&self) -> usize {
        self.tenants
    }

    pub fn shares(&self) -> Shares {
        self.shares
    }

    /// Every principal of this server, the server's own first.
    pub fn principals(&self) -> impl Iterator<Item = Principal> {
        [Principal::Server, Principal::Anonymous]
            .into_iter()
            .chain((0..self.tenants).map(Principal::Tenant))
    }
}
