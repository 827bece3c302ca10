//! The lobby: accepted connections that have not sent a byte yet.
//!
//! A connection that says nothing holds a descriptor here and nothing
//! else: no thread, no pending-hello slot. It leaves the lobby when its
//! first bytes arrive (then it competes for a pending slot as before), at
//! its first-byte deadline (closed), or when a newer connection needs its
//! room: the lobby is bounded, per address and in all, and a full lobby
//! closes its **oldest** waiting connection instead of refusing the new
//! one. So idle sockets, however many and however fast they are reopened,
//! cannot keep a client that speaks at once from reaching its hello: it
//! would have to be the oldest of the lobby's `max_lobby_connections`
//! (or of its address's `max_lobby_per_address`) before its first bytes
//! arrive (docs/server.md, "Admission").
//!
//! Same-user Unix peers never wait here (they are trusted by their
//! credentials and have reserved slots).

use kvtier_wire::transport::Transport;
use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::os::fd::{AsFd, BorrowedFd};
use std::time::{Duration, Instant};

/// A connection waiting for its first byte.
pub struct Waiting<P> {
    pub transport: Transport,
    pub peer: P,
    pub addr: Option<IpAddr>,
    since: Instant,
}

/// What `Lobby::poll` found.
pub struct Polled<P> {
    /// Connections whose first bytes arrived (or that closed: their thread
    /// sees that at once), oldest first.
    pub ready: Vec<Waiting<P>>,
    /// Connections closed at their first-byte deadline.
    pub expired: usize,
}

pub struct Lobby<P> {
    waiting: VecDeque<Waiting<P>>,
    per_address: HashMap<IpAddr, usize>,
    limit: usize,
    per_address_limit: usize,
    first_byte_timeout: Duration,
}

impl<P> Lobby<P> {
    pub fn new(limit: usize, per_address_limit: usize, first_byte_timeout: Duration) -> Lobby<P> {
        Lobby {
            waiting: VecDeque::new(),
            per_address: HashMap::new(),
            limit: limit.max(1),
            per_address_limit: per_address_limit.max(1),
            first_byte_timeout,
        }
    }

    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// Lets a connection in. Returns the connection it displaced, if any:
    /// the oldest of its address when the address is at its cap, else the
    /// oldest of all when the lobby is full (the caller closes it).
    pub fn enter(
        &mut self,
        transport: Transport,
        peer: P,
        addr: Option<IpAddr>,
        now: Instant,
    ) -> Option<Waiting<P>> {
        let evicted = match addr {
            Some(a) if self.per_address.get(&a).copied().unwrap_or(0) >= self.per_address_limit => {
                let at = self.waiting.iter().position(|w| w.addr == Some(a));
                at.and_then(|at| self.remove(at))
            }
            _ if self.waiting.len() >= self.limit => self.remove(0),
            _ => None,
        };
        if let Some(a) = addr {
            *self.per_address.entry(a).or_insert(0) += 1;
        }
        self.waiting.push_back(Waiting {
            transport,
            peer,
            addr,
            since: now,
        });
        evicted
    }

    fn remove(&mut self, at: usize) -> Option<Waiting<P>> {
        let w = self.waiting.remove(at)?;
        if let Some(a) = w.addr {
            if let Some(n) = self.per_address.get_mut(&a) {
                *n -= 1;
                if *n == 0 {
                    self.per_address.remove(&a);
                }
            }
        }
        Some(w)
    }

    /// Takes out the connections that became readable within `wait` and
    /// closes those past their first-byte deadline.
    pub fn poll(&mut self, wait: Duration, now: Instant) -> std::io::Result<Polled<P>> {
        let mut polled = Polled {
            ready: Vec::new(),
            expired: 0,
        };
        if self.waiting.is_empty() {
            return Ok(polled);
        }
        let readable: Vec<bool> = {
            let mut fds: Vec<rustix::event::PollFd<'_>> = self
                .waiting
                .iter()
                .map(|w| {
                    rustix::event::PollFd::from_borrowed_fd(
                        fd_of(&w.transport),
                        rustix::event::PollFlags::IN,
                    )
                })
                .collect();
            let timeout =
                rustix::event::Timespec::try_from(wait).unwrap_or(rustix::event::Timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                });
            match rustix::event::poll(&mut fds, Some(&timeout)) {
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => return Ok(polled),
                Err(e) => return Err(e.into()),
            }
            fds.iter().map(|fd| !fd.revents().is_empty()).collect()
        };
        let mut at = 0;
        for is_ready in readable {
            let past_deadline =
                now.saturating_duration_since(self.waiting[at].since) >= self.first_byte_timeout;
            if is_ready {
                polled.ready.extend(self.remove(at));
            } else if past_deadline {
                drop(self.remove(at));
                polled.expired += 1;
            } else {
                at += 1;
            }
        }
        Ok(polled)
    }
}

fn fd_of(transport: &Transport) -> BorrowedFd<'_> {
    match transport {
        Transport::Tcp(s) => s.as_fd(),
        Transport::TlsServer(tls) => tls.sock.as_fd(),
        Transport::TlsClient(tls) => tls.sock.as_fd(),
        Transport::Unix(s) => s.as_fd(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::{TcpListener, TcpStream};

    fn pair(listener: &TcpListener) -> (TcpStream, Transport) {
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        (client, Transport::Tcp(server))
    }

    /// The lobby closes its oldest connection (of the address at its cap,
    /// else of all) for a newcomer, lets out exactly the connections that
    /// spoke, and closes the silent ones at their deadline.
    #[test]
    fn the_oldest_silent_connection_makes_room_and_speakers_leave() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let here: IpAddr = "127.0.0.1".parse().unwrap();
        let other: IpAddr = "127.0.0.2".parse().unwrap();
        let start = Instant::now();
        let mut lobby: Lobby<u32> = Lobby::new(4, 2, Duration::from_secs(60));
        let mut clients = Vec::new();
        for n in 0..2 {
            let (client, transport) = pair(&listener);
            clients.push(client);
            assert!(lobby.enter(transport, n, Some(here), start).is_none());
        }
        // The address is at its cap: its oldest (0) goes.
        let (client, transport) = pair(&listener);
        clients.push(client);
        let evicted = lobby.enter(transport, 2, Some(here), start).unwrap();
        assert_eq!(evicted.peer, 0);
        // Another address fills the lobby; then the oldest of all (1) goes.
        for n in 3..5 {
            let (client, transport) = pair(&listener);
            clients.push(client);
            assert!(lobby.enter(transport, n, Some(other), start).is_none());
        }
        assert_eq!(lobby.len(), 4);
        let (client, transport) = pair(&listener);
        clients.push(client);
        let evicted = lobby.enter(transport, 5, None, start).unwrap();
        assert_eq!(evicted.peer, 1);

        // Nobody spoke: nothing is ready, nothing expired.
        let polled = lobby.poll(Duration::ZERO, start).unwrap();
        assert!(polled.ready.is_empty() && polled.expired == 0);
        // Peer 3 speaks (clients[3]): it alone leaves, by readiness.
        clients[3].write_all(b"x").unwrap();
        let polled = lobby.poll(Duration::from_secs(10), start).unwrap();
        assert_eq!(
            polled.ready.iter().map(|w| w.peer).collect::<Vec<_>>(),
            vec![3]
        );
        assert_eq!(lobby.len(), 3);
        // Past the deadline the silent ones are closed.
        let polled = lobby
            .poll(Duration::ZERO, start + Duration::from_secs(61))
            .unwrap();
        assert!(polled.ready.is_empty());
        assert_eq!(polled.expired, 3);
        assert!(lobby.is_empty());
    }
}
