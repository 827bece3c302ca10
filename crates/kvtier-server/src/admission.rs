//! Where each data-port connection's slot comes from, before and after its
//! hello: two budgets of the governor, split between principals.
//!
//! A peer trusted by its credentials (a Unix peer of the server's user) is
//! admitted at accept as the server's own principal, into the connection
//! budget or, when that is full, the slots reserved for it. Every other
//! connection waits for its hello in the **pending** budget (and, over
//! TCP, within its address's cap), charged to the principal its first
//! message names: the token a challenge names (a tenant's, or the server's
//! own), else unauthenticated peers together. Its hello moves it into the
//! **connection** budget, charged to the principal of the token it proved.
//! So no principal holds more than its share of either: a tenant's idle
//! connections, from however many addresses, leave the other tenants their
//! floors and the server's token its reserve.
//!
//! A full pending budget does not refuse a newcomer while some principal
//! holds waiting connections past its floor: the newcomer closes the
//! oldest waiting connection of its own principal when that principal is
//! at its share, else of the principal furthest past its floor
//! (unauthenticated peers have none, so their connections go first). It
//! takes its grant at once, past the limit until the closed connection's
//! thread lets go: a flood of newcomers cannot take the room it made. A
//! finished hello is never closed for anyone.

use crate::limits::{Budget, Limits, Permit};
use kvtier_governor::{Governor, Grant, Pool, Principal};
use kvtier_wire::transport::Transport;
use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

/// A connection's peer, as far as trust goes.
#[derive(Debug, Clone, Copy)]
pub struct Peer {
    /// Connected over the Unix socket.
    pub unix: bool,
    /// Its kernel credentials (SO_PEERCRED) name the server's user or root.
    pub trusted_by_credentials: bool,
    /// The process that connected (SO_PEERCRED, in this server's pid
    /// namespace; `None` over TCP or where the kernel gives none): the only
    /// process whose memory cross-memory transfers of this connection touch.
    pub pid: Option<i32>,
}

/// The slots of the data ports (see the module).
#[derive(Debug)]
pub struct Admission {
    pending: Arc<Pool>,
    admitted: Arc<Pool>,
    local_reserve: Arc<Budget>,
    per_address: Arc<Mutex<HashMap<IpAddr, usize>>>,
    per_address_limit: usize,
    waiting: Arc<Mutex<Waiting>>,
    principals: Vec<Principal>,
}

/// Connections waiting for their hello, oldest first: how to close each,
/// and whose it is.
#[derive(Debug, Default)]
struct Waiting {
    next: u64,
    entries: BTreeMap<u64, WaitingEntry>,
    /// Connections closed to make room, over the server's life.
    evicted: u64,
}

#[derive(Debug)]
struct WaitingEntry {
    closer: Option<Closer>,
    principal: Principal,
    addr: Option<IpAddr>,
}

impl Waiting {
    /// Closes the oldest waiting connection that `chosen` accepts; `false`
    /// when there is none.
    fn close_oldest(&mut self, chosen: impl Fn(&WaitingEntry) -> bool) -> bool {
        let victim = self
            .entries
            .iter()
            .find(|(_, e)| e.closer.is_some() && chosen(e))
            .map(|(id, _)| *id);
        let Some(victim) = victim else {
            return false;
        };
        let entry = self.entries.remove(&victim).expect("found above");
        if let Some(closer) = &entry.closer {
            closer.shut_down();
        }
        self.evicted += 1;
        true
    }

    fn closable(&self, principal: Principal) -> bool {
        self.entries
            .values()
            .any(|e| e.closer.is_some() && e.principal == principal)
    }
}

/// A second handle on a waiting connection's socket, to shut it down
/// from the accept thread (its own thread then sees the end at once).
#[derive(Debug)]
pub enum Closer {
    Tcp(std::net::TcpStream),
    Unix(std::os::unix::net::UnixStream),
}

impl Closer {
    /// A handle on `transport`'s socket, if it can be duplicated.
    pub fn of(transport: &Transport) -> Option<Closer> {
        match transport {
            Transport::Tcp(s) => s.try_clone().ok().map(Closer::Tcp),
            Transport::TlsServer(tls) => tls.sock.try_clone().ok().map(Closer::Tcp),
            Transport::TlsClient(tls) => tls.sock.try_clone().ok().map(Closer::Tcp),
            Transport::Unix(s) => s.try_clone().ok().map(Closer::Unix),
        }
    }

    fn shut_down(&self) {
        let _ = match self {
            Closer::Tcp(s) => s.shutdown(std::net::Shutdown::Both),
            Closer::Unix(s) => s.shutdown(std::net::Shutdown::Both),
        };
    }
}

/// What a connection holds: a grant of the pending or the connection
/// budget (or a reserved local slot); given back, with its address's
/// count, on drop.
#[derive(Debug)]
pub struct Slot {
    grant: Option<Grant>,
    _reserved: Option<Permit>,
    admitted: bool,
    /// Its entry among the waiting connections, until its hello.
    waiting: Option<(u64, Arc<Mutex<Waiting>>)>,
    _address: Option<AddressCount>,
}

impl Slot {
    /// Whether the server closed this waiting connection to make room for
    /// a newcomer (its waits end at once then).
    pub fn closed_for_newcomer(&self) -> bool {
        self.waiting
            .as_ref()
            .is_some_and(|(id, waiting)| !lock(waiting).entries.contains_key(id))
    }

    /// Whose slot this is.
    #[cfg(test)]
    fn principal(&self) -> Option<Principal> {
        self.grant.as_ref().map(Grant::principal)
    }

    fn leave_waiting(&mut self) {
        if let Some((id, waiting)) = self.waiting.take() {
            lock(&waiting).entries.remove(&id);
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.leave_waiting();
    }
}

#[derive(Debug)]
struct AddressCount {
    addr: IpAddr,
    counts: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

impl Drop for AddressCount {
    fn drop(&mut self) {
        let mut counts = lock(&self.counts);
        if let Some(n) = counts.get_mut(&self.addr) {
            *n -= 1;
            if *n == 0 {
                counts.remove(&self.addr);
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Admission {
    pub fn new(limits: &Limits, governor: &Governor) -> Admission {
        Admission {
            pending: governor.budget("pending hellos", limits.max_pending_connections as u64),
            admitted: governor.budget("connections", limits.max_connections as u64),
            local_reserve: Budget::new(limits.reserved_local_connections as u64),
            per_address: Arc::default(),
            per_address_limit: limits.max_connections_per_address,
            waiting: Arc::default(),
            principals: governor.principals().collect(),
        }
    }

    /// Connections closed so far to make room for newcomers.
    pub fn evicted(&self) -> u64 {
        lock(&self.waiting).evicted
    }

    /// A new connection's slot, or why it is refused (answered with LIMIT).
    /// `closer` lets the server close it later to make room; `principal` is
    /// whom its first message names (see the module).
    pub fn admit_connection(
        &self,
        peer: &Peer,
        addr: Option<IpAddr>,
        closer: Option<Closer>,
        principal: Principal,
    ) -> Result<Slot, String> {
        // The cap per address bounds unauthenticated peers (every local user
        // has 2^24 loopback addresses, so it cannot bound a principal): a
        // token's connections are bounded by its share, from any address.
        let address = match addr {
            Some(addr) if principal == Principal::Anonymous => {
                let mut counts = lock(&self.per_address);
                let n = counts.entry(addr).or_insert(0);
                // At its cap, the address's oldest connection that proved
                // nothing makes room (a token holder shares its address
                // with whoever floods from it); only proven ones refuse.
                if *n >= self.per_address_limit
                    && !lock(&self.waiting).close_oldest(|e| {
                        e.principal == Principal::Anonymous && e.addr == Some(addr)
                    })
                {
                    return Err(format!(
                        "{addr} has {} connections open, the most one address may \
                         (max_connections_per_address); retry later",
                        self.per_address_limit
                    ));
                }
                *n += 1;
                Some(AddressCount {
                    addr,
                    counts: Arc::clone(&self.per_address),
                })
            }
            _ => None,
        };
        if peer.trusted_by_credentials {
            let (grant, reserved) = match self.admitted.try_take(Principal::Server, 1) {
                Some(grant) => (Some(grant), None),
                None => (
                    None,
                    Some(
                        self.local_reserve
                            .try_take(1)
                            .ok_or_else(|| self.full_message(Principal::Server))?,
                    ),
                ),
            };
            return Ok(Slot {
                grant,
                _reserved: reserved,
                admitted: true,
                waiting: None,
                _address: address,
            });
        }
        let mut waiting = lock(&self.waiting);
        let grant = match self.pending.try_take(principal, 1) {
            Some(grant) => grant,
            None => {
                // Full for this principal: close the oldest waiting
                // connection of whoever is furthest past its floor (its own
                // when it is at its share), and take the room at once.
                let mine = self.pending.held_by(principal);
                let victim = if mine >= self.pending.share_of(principal) {
                    Some(principal)
                } else {
                    self.pending.most_over_floor(
                        self.principals
                            .iter()
                            .copied()
                            .filter(|&p| waiting.closable(p)),
                    )
                };
                let closed = victim.is_some_and(|v| waiting.close_oldest(|e| e.principal == v));
                if !closed {
                    return Err(format!(
                        "the server has {} connections waiting for their hello, the most it \
                         allows (max_pending_connections), and none it may close for {principal} \
                         ({mine} of theirs waiting); retry later",
                        self.pending.limit()
                    ));
                }
                Grant::displacing(&self.pending, principal, 1)
            }
        };
        let id = waiting.next;
        waiting.next += 1;
        waiting.entries.insert(
            id,
            WaitingEntry {
                closer,
                principal,
                addr,
            },
        );
        drop(waiting);
        Ok(Slot {
            grant: Some(grant),
            _reserved: None,
            admitted: false,
            waiting: Some((id, Arc::clone(&self.waiting))),
            _address: address,
        })
    }

    /// Moves a connection whose hello proved `principal` into the
    /// connection budget, charged to it.
    pub fn admit_hello(&self, slot: &mut Slot, principal: Principal) -> Result<(), String> {
        if slot.admitted {
            return Ok(());
        }
        slot.grant = Some(
            self.admitted
                .try_take(principal, 1)
                .ok_or_else(|| self.full_message(principal))?,
        );
        slot.admitted = true;
        slot.leave_waiting();
        // Authenticated: out of its address's count (see admit_connection).
        slot._address = None;
        Ok(())
    }

    fn full_message(&self, principal: Principal) -> String {
        format!(
            "the server has {} connections open, the most it allows (max_connections), or \
             {principal} holds its share of them ({} of {}); retry later",
            self.admitted.used(),
            self.admitted.held_by(principal),
            self.admitted.share_of(principal),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_governor::{GuessBudget, Shares};
    use std::time::Duration;
    use Principal::{Anonymous, Server, Tenant};

    fn admission(pending: usize, tenants: usize) -> Admission {
        let limits = Limits {
            max_pending_connections: pending,
            max_connections: 16,
            ..Limits::default()
        };
        let governor = Governor::new(
            tenants,
            Shares::default(),
            GuessBudget::new(10, Duration::ZERO),
        );
        Admission::new(&limits, &governor)
    }

    fn remote() -> Peer {
        Peer {
            unix: false,
            trusted_by_credentials: false,
            pid: None,
        }
    }

    /// A pair of connected sockets: the first's closer, and the second to
    /// see whether it was closed.
    fn closable() -> (Closer, std::os::unix::net::UnixStream) {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        (Closer::Unix(a), b)
    }

    fn was_closed(s: &mut std::os::unix::net::UnixStream) -> bool {
        use std::io::Read;
        s.set_nonblocking(true).unwrap();
        matches!(s.read(&mut [0u8; 1]), Ok(0))
    }

    /// Issue 60, finding 1: a tenant's proven pending connections were
    /// never closed, so other tenants and the server's token were locked
    /// out. Now a tenant holds at most its share; the others get in, and
    /// it is the tenant's waiting connections that make room. (A closed
    /// connection's slot is dropped, as its thread would.)
    #[test]
    fn a_tenant_holding_pending_slots_never_keeps_the_others_out() {
        let admission = admission(16, 2);
        let mut open: Vec<(Slot, std::os::unix::net::UnixStream)> = Vec::new();
        let admit = |who: Principal, open: &mut Vec<(Slot, _)>| {
            let (closer, seen) = closable();
            let slot = admission.admit_connection(&remote(), None, Some(closer), who);
            open.retain_mut(|(_, seen)| !was_closed(seen));
            slot.map(|slot| open.push((slot, seen)))
        };
        for _ in 0..40 {
            let _ = admit(Tenant(0), &mut open);
        }
        let held = admission.pending.held_by(Tenant(0));
        assert!(held <= 8, "tenant 0 holds {held} of 16 pending slots");
        // The other tenant, the server's token and unauthenticated peers
        // all get in, many times over, and the tenant keeps waiting ones.
        for who in [Tenant(1), Server, Anonymous, Tenant(1), Server, Tenant(0)] {
            for _ in 0..10 {
                let admitted = admit(who, &mut open);
                assert!(admitted.is_ok(), "{who} refused: {:?}", admitted.err());
            }
        }
        assert!(admission.evicted() > 0);
        assert!(
            admission.pending.used() <= 16,
            "{}",
            admission.pending.used()
        );
    }

    /// Issue 60, finding 2: idle authenticated connections of one tenant
    /// (from any number of addresses) filled max_connections.
    #[test]
    fn a_tenants_connections_leave_the_others_their_floor_and_the_reserve() {
        let admission = admission(16, 2);
        let mut held: Vec<Slot> = Vec::new();
        for _ in 0..16 {
            let mut slot = admission
                .admit_connection(&remote(), None, None, Anonymous)
                .unwrap();
            if admission.admit_hello(&mut slot, Tenant(0)).is_ok() {
                held.push(slot);
            }
        }
        assert_eq!(held.len(), 8, "tenant 0 past its share of 16");
        for who in [Tenant(1), Tenant(1), Server, Server] {
            let mut slot = admission
                .admit_connection(&remote(), None, None, Anonymous)
                .unwrap();
            admission
                .admit_hello(&mut slot, who)
                .unwrap_or_else(|e| panic!("{who} refused: {e}"));
            held.push(slot);
        }
    }

    /// A newcomer that closed a waiting connection holds its slot at once:
    /// no one who arrives before the closed one's thread lets go takes it.
    #[test]
    fn a_displacing_newcomer_keeps_the_room_it_made() {
        let admission = admission(4, 0);
        let first: Vec<Slot> = (0..3)
            .map(|_| {
                let (closer, _) = closable();
                admission
                    .admit_connection(&remote(), None, Some(closer), Server)
                    .unwrap()
            })
            .collect();
        // One anonymous share (25 % of 4), then the second closes the first.
        let (closer, mut seen) = closable();
        let _one = admission
            .admit_connection(&remote(), None, Some(closer), Anonymous)
            .unwrap();
        let two = admission.admit_connection(&remote(), None, None, Anonymous);
        assert!(two.is_ok() && was_closed(&mut seen));
        assert!(two.unwrap().principal() == Some(Anonymous));
        drop(first);
    }
}
