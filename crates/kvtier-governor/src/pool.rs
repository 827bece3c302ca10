//! A budget split between principals: the one rule every scarce thing of
//! the server is shared by (connection and pending slots, buffer bytes,
//! read threads, scans).
//!
//! Of a pool of `limit` units:
//! - the server's own principal may use all of it, and a **reserve**
//!   (`Shares::reserve_percent`) is kept for it alone: tenants and
//!   unauthenticated peers together hold at most `limit - reserve`;
//! - each tenant holds at most its **share** (`Shares::tenant_share_percent`)
//!   and can always reach its **floor** (half of the others' part split
//!   evenly): a tenant grows past its floor only while the room every other
//!   tenant's unused floor needs stays free, so two busy tenants cannot take
//!   what a third, idle one needs for its first request;
//! - unauthenticated peers together are one principal with the smallest
//!   share (`Shares::anonymous_percent`) and no floor: they never take room
//!   a tenant's floor needs.
//!
//! A principal over its share waits (on a condition variable, woken by every
//! give-back) or is refused; nothing here ever takes a grant away. Who is
//! *most over* its floor is reported, for the callers that close a waiting
//! connection to make room (they pick from that principal).

use crate::Principal;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How a pool is split, in percent of its limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shares {
    /// Kept for the server's own principal. Default: 25.
    pub reserve_percent: u8,
    /// The most one tenant may hold. Default: 50.
    pub tenant_share_percent: u8,
    /// The most unauthenticated peers together may hold. Default: 25.
    pub anonymous_percent: u8,
}

impl Default for Shares {
    fn default() -> Self {
        Shares {
            reserve_percent: 25,
            tenant_share_percent: 50,
            anonymous_percent: 25,
        }
    }
}

/// What each principal holds now.
#[derive(Debug, Default)]
struct Held {
    server: u64,
    anonymous: u64,
    tenants: Vec<u64>,
}

impl Held {
    fn of(&self, who: Principal) -> u64 {
        match who {
            Principal::Server => self.server,
            Principal::Anonymous => self.anonymous,
            Principal::Tenant(i) => self.tenants.get(i).copied().unwrap_or(0),
        }
    }

    fn slot(&mut self, who: Principal) -> &mut u64 {
        match who {
            Principal::Server => &mut self.server,
            Principal::Anonymous => &mut self.anonymous,
            Principal::Tenant(i) => &mut self.tenants[i],
        }
    }

    /// What tenants and unauthenticated peers hold together.
    fn others(&self) -> u64 {
        self.tenants
            .iter()
            .fold(self.anonymous, |sum, &t| sum.saturating_add(t))
    }
}

/// One budget, split between principals (see the module).
#[derive(Debug)]
pub struct Pool {
    name: &'static str,
    limit: u64,
    /// What tenants and unauthenticated peers may hold together.
    others_limit: u64,
    share: u64,
    floor: u64,
    anonymous_share: u64,
    held: Mutex<Held>,
    given_back: Condvar,
}

impl Pool {
    /// A pool of `limit` units named `name` (as errors and metrics say it),
    /// split between the server, `tenants` tenants and unauthenticated
    /// peers by `shares`.
    pub fn new(name: &'static str, limit: u64, tenants: usize, shares: Shares) -> Arc<Pool> {
        let percent_of = |p: u8| (u128::from(limit) * u128::from(p.min(100)) / 100) as u64;
        let others_limit = limit - percent_of(shares.reserve_percent);
        let share = percent_of(shares.tenant_share_percent).min(others_limit);
        Arc::new(Pool {
            name,
            limit,
            others_limit,
            share,
            // Half the others' part split evenly is guaranteed; the other
            // half is what busy tenants borrow (floors of the whole part
            // would make every share a fixed split).
            floor: (others_limit / 2 / tenants.max(1) as u64).min(share),
            anonymous_share: percent_of(shares.anonymous_percent).min(others_limit),
            held: Mutex::new(Held {
                tenants: vec![0; tenants],
                ..Held::default()
            }),
            given_back: Condvar::new(),
        })
    }

    pub fn name(&self) -> &'static str {
        self.name
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The most `who` may hold.
    pub fn share_of(&self, who: Principal) -> u64 {
        match who {
            Principal::Server => self.limit,
            Principal::Anonymous => self.anonymous_share,
            Principal::Tenant(_) => self.share,
        }
    }

    /// What `who` can always reach, whatever the others hold (`0` for
    /// unauthenticated peers; the reserve for the server).
    pub fn floor_of(&self, who: Principal) -> u64 {
        match who {
            Principal::Server => self.limit - self.others_limit,
            Principal::Anonymous => 0,
            Principal::Tenant(_) => self.floor,
        }
    }

    /// What all principals hold together.
    pub fn used(&self) -> u64 {
        let held = self.lock();
        held.server.saturating_add(held.others())
    }

    /// What `who` holds.
    pub fn held_by(&self, who: Principal) -> u64 {
        self.lock().of(who)
    }

    /// Of `candidates`, the principal furthest past its floor (ties: the
    /// first); `None` when none holds anything past its floor. Callers
    /// that close a waiting connection to make room take it from this one.
    pub fn most_over_floor(
        &self,
        candidates: impl IntoIterator<Item = Principal>,
    ) -> Option<Principal> {
        let held = self.lock();
        candidates
            .into_iter()
            .filter_map(|who| {
                let over = held.of(who).checked_sub(self.floor_of(who))?;
                (over > 0).then_some((over, who))
            })
            .fold(
                None,
                |best: Option<(u64, Principal)>, (over, who)| match best {
                    Some((b, _)) if b >= over => best,
                    _ => Some((over, who)),
                },
            )
            .map(|(_, who)| who)
    }

    /// Takes `amount` for `who`, or `None` (taking nothing).
    pub fn try_take(self: &Arc<Self>, who: Principal, amount: u64) -> Option<Grant> {
        let mut grant = self.empty(who);
        grant.try_set(amount).then_some(grant)
    }

    /// [`try_take`](Self::try_take), waiting up to `wait` for room.
    pub fn take_within(
        self: &Arc<Self>,
        who: Principal,
        amount: u64,
        wait: Duration,
    ) -> Option<Grant> {
        let mut grant = self.empty(who);
        grant.set_within(amount, wait).then_some(grant)
    }

    /// A grant of nothing yet, to grow with [`Grant::try_set`].
    pub fn empty(self: &Arc<Self>, who: Principal) -> Grant {
        if let Principal::Tenant(i) = who {
            assert!(
                i < self.lock().tenants.len(),
                "tenant #{i} of a pool that has fewer"
            );
        }
        Grant {
            pool: Arc::clone(self),
            who,
            amount: 0,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether `who`'s holding may grow by `more`, given `held`.
    fn allows(&self, held: &Held, who: Principal, more: u64) -> bool {
        let Some(total) = held.server.saturating_add(held.others()).checked_add(more) else {
            return false;
        };
        if total > self.limit {
            return false;
        }
        let mine = held.of(who).saturating_add(more);
        let others_after = held.others().saturating_add(more);
        // Room that tenants other than `except` still need for their floors.
        let unused_floors = |except: Option<usize>| {
            held.tenants
                .iter()
                .enumerate()
                .filter(|(i, _)| Some(*i) != except)
                .fold(0u64, |sum, (_, &h)| {
                    sum.saturating_add(self.floor.saturating_sub(h))
                })
        };
        match who {
            Principal::Server => true,
            Principal::Tenant(i) => {
                mine <= self.share
                    && others_after <= self.others_limit
                    && (mine <= self.floor
                        || others_after.saturating_add(unused_floors(Some(i))) <= self.others_limit)
            }
            Principal::Anonymous => {
                mine <= self.anonymous_share
                    && others_after.saturating_add(unused_floors(None)) <= self.others_limit
            }
        }
    }
}

/// What one principal holds of a [`Pool`]; given back on drop, so no exit
/// path can leak it.
#[derive(Debug)]
pub struct Grant {
    pool: Arc<Pool>,
    who: Principal,
    amount: u64,
}

impl Grant {
    /// A grant of `amount` for `who`, counted at once even past the limit:
    /// for a newcomer that closed a waiting holder of `pool` to make room,
    /// so nobody arriving before that holder lets go takes the room it
    /// made. The caller bounds how many such grants exist (one per holder
    /// closed, and a holder is closed once).
    pub fn displacing(pool: &Arc<Pool>, who: Principal, amount: u64) -> Grant {
        let mut grant = pool.empty(who);
        let mut held = pool.lock();
        let slot = held.slot(who);
        *slot = slot.saturating_add(amount);
        grant.amount = amount;
        grant
    }

    pub fn amount(&self) -> u64 {
        self.amount
    }

    pub fn principal(&self) -> Principal {
        self.who
    }

    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// Grows or shrinks this grant to `to`; `false` (nothing changed) when
    /// growing is not allowed now. Shrinking always is.
    pub fn try_set(&mut self, to: u64) -> bool {
        let pool = Arc::clone(&self.pool);
        let mut held = pool.lock();
        self.set_locked(&mut held, to)
    }

    fn set_locked(&mut self, held: &mut Held, to: u64) -> bool {
        if to <= self.amount {
            let slot = held.slot(self.who);
            *slot = slot.saturating_sub(self.amount - to);
            self.amount = to;
            self.pool.given_back.notify_all();
            return true;
        }
        if !self.pool.allows(held, self.who, to - self.amount) {
            return false;
        }
        *held.slot(self.who) += to - self.amount;
        self.amount = to;
        true
    }

    /// [`try_set`](Self::try_set), waiting up to `wait` for others to give
    /// room back.
    pub fn set_within(&mut self, to: u64, wait: Duration) -> bool {
        let deadline = Instant::now() + wait;
        let pool = Arc::clone(&self.pool);
        let mut held = pool.lock();
        loop {
            if self.set_locked(&mut held, to) {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            held = pool
                .given_back
                .wait_timeout(held, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        if self.amount > 0 {
            let mut held = self.pool.lock();
            let slot = held.slot(self.who);
            *slot = slot.saturating_sub(self.amount);
            self.pool.given_back.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use Principal::{Anonymous, Server, Tenant};

    #[test]
    fn a_tenant_holds_at_most_its_share_and_the_server_finds_its_reserve() {
        let pool = Pool::new("test", 100, 1, Shares::default());
        let mut a = pool.try_take(Tenant(0), 40).unwrap();
        assert!(!a.try_set(60), "past the tenant's share");
        assert_eq!((pool.used(), pool.held_by(Tenant(0))), (40, 40));
        let server = pool.try_take(Server, 60).expect("the server uses the rest");
        assert!(!a.try_set(50), "the pool is full");
        assert_eq!(a.amount(), 40, "a refused grow changes nothing");
        drop(server);
        assert!(a.try_set(50));
        drop(a);
        assert_eq!(pool.used(), 0);
    }

    /// Two busy tenants leave a third its floor, unauthenticated peers take
    /// none of the floors, and the server always finds its reserve.
    #[test]
    fn floors_and_the_reserve_hold_against_busy_principals() {
        let pool = Pool::new("test", 1200, 3, Shares::default());
        // Others' part 900, floor 150, share 600, anonymous 300.
        let a = pool.try_take(Tenant(0), 600).expect("a's share");
        let mut b = pool.try_take(Tenant(1), 150).expect("b's floor");
        assert!(!b.try_set(151), "b took the room c's floor needs");
        assert!(
            pool.try_take(Anonymous, 1).is_none(),
            "unauthenticated peers took c's floor"
        );
        let c = pool.try_take(Tenant(2), 150).expect("c's floor");
        let own = pool.try_take(Server, 300).expect("the reserve");
        assert_eq!(pool.used(), 1200);
        assert_eq!(
            pool.most_over_floor([Tenant(0), Tenant(1), Tenant(2), Anonymous]),
            Some(Tenant(0))
        );
        drop((a, c, own));
        let anonymous = pool.try_take(Anonymous, 300).expect("the anonymous share");
        assert!(!b.try_set(b.amount() + 451), "past the others' part");
        assert_eq!(
            pool.most_over_floor([Tenant(1), Anonymous]),
            Some(Anonymous)
        );
        drop(anonymous);
    }

    #[test]
    fn a_waiting_grant_is_woken_by_a_give_back() {
        let pool = Pool::new("test", 10, 0, Shares::default());
        let held = pool.try_take(Server, 10).unwrap();
        let waiter = {
            let pool = Arc::clone(&pool);
            std::thread::spawn(move || {
                pool.take_within(Server, 4, Duration::from_secs(600))
                    .is_some()
            })
        };
        drop(held);
        // The waiter would wait ten minutes if the give-back did not wake it.
        assert!(waiter.join().unwrap());
        assert!(pool.take_within(Server, 11, Duration::ZERO).is_none());
    }

    #[derive(Debug, Clone)]
    enum Step {
        Take(usize, u64),
        Set(usize, u64),
        Drop(usize),
    }

    fn principal(i: usize) -> Principal {
        match i {
            0 => Server,
            1 => Anonymous,
            t => Tenant(t - 2),
        }
    }

    proptest! {
        /// Whatever happened before: no tenant past its share, unauthenticated
        /// peers past theirs, the pool past its limit; the reserve is free of
        /// others; an idle tenant can take its floor; the pool counts exactly
        /// what the grants hold.
        #[test]
        fn shares_floors_and_the_reserve_hold_under_any_sequence(
            limit in 1u64..2000,
            steps in proptest::collection::vec(
                prop_oneof![
                    (0usize..5, 0u64..800).prop_map(|(w, n)| Step::Take(w, n)),
                    (0usize..5, 0u64..800).prop_map(|(w, n)| Step::Set(w, n)),
                    (0usize..5).prop_map(Step::Drop),
                ],
                1..60,
            ),
        ) {
            let pool = Pool::new("model", limit, 3, Shares::default());
            let mut grants: Vec<Vec<Grant>> = (0..5).map(|_| Vec::new()).collect();
            for step in steps {
                match step {
                    Step::Take(w, n) => {
                        if let Some(g) = pool.try_take(principal(w), n) {
                            grants[w].push(g);
                        }
                    }
                    Step::Set(w, n) => {
                        if let Some(g) = grants[w].last_mut() {
                            g.try_set(n);
                        }
                    }
                    Step::Drop(w) => {
                        grants[w].pop();
                    }
                }
                let mine: Vec<u64> = grants.iter().map(|g| g.iter().map(Grant::amount).sum()).collect();
                for (w, &m) in mine.iter().enumerate() {
                    prop_assert_eq!(pool.held_by(principal(w)), m);
                    prop_assert!(m <= pool.share_of(principal(w)));
                }
                prop_assert!(pool.used() <= limit);
                let others: u64 = mine[1..].iter().sum();
                prop_assert!(others <= limit - pool.floor_of(Server), "the reserve was taken");
                for w in 2..5 {
                    if mine[w] == 0 && pool.floor_of(principal(w)) > 0 && mine[0] == 0 {
                        let floor = pool.try_take(principal(w), pool.floor_of(principal(w)));
                        prop_assert!(floor.is_some(), "idle tenant {} cannot take its floor", w - 2);
                    }
                }
            }
        }
    }
}
