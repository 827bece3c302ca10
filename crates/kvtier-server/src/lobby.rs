//! The lobby: accepted connections whose first message has not arrived
//! whole yet.
//!
//! Such a connection holds a descriptor here and nothing else: no thread,
//! no pending-hello slot. It leaves the lobby when its first message is
//! whole (a frame header and the body it announces, up to the hello
//! frame's limit; over TLS the first TLS record), or when it closes; then
//! it competes for a pending slot as before. It is closed at its deadline,
//! or when a newer connection needs its room: the lobby is bounded, per
//! address and in all, and a full lobby closes its **oldest** waiting
//! connection instead of refusing the new one. So sockets that say
//! nothing, or a byte and then nothing, however many and however fast
//! they are reopened, cannot keep a client that sends its first message
//! at once from reaching its hello: it would have to be the oldest of the
//! lobby's `max_lobby_connections` (or of its address's
//! `max_lobby_per_address`) before that message arrives (docs/server.md,
//! threat model).
//!
//! Same-user Unix peers never wait here (they are trusted by their
//! credentials and have reserved slots).

use kvtier_wire::proof::{NONCE_LEN, TOKEN_ID_LEN};
use kvtier_wire::protocol::{Header, Op, HEADER_LEN};
use kvtier_wire::transport::Transport;
use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::os::fd::{AsFd, BorrowedFd};
use std::time::{Duration, Instant};

/// A connection waiting for its first message.
pub struct Waiting<P> {
    pub transport: Transport,
    pub peer: P,
    pub addr: Option<IpAddr>,
    since: Instant,
    /// Part of its first message arrived: when to look again (such a
    /// socket stays readable, so it is left out of the poll).
    partial: Option<Instant>,
}

/// How often a connection with part of its first message is looked at.
const PARTIAL_RECHECK: Duration = Duration::from_millis(20);

/// The longest first message waited for whole: a hello frame's body limit
/// (a longer announcement is refused by the session at once).
const FIRST_BODY_LIMIT: usize = 4 << 10;

/// What a waiting connection's received bytes say.
enum Arrived {
    /// Its first message is whole: on to its hello.
    Whole,
    /// Part of it: look again later.
    Part,
    /// It closed (or failed): close it here.
    Gone,
}

/// What `Lobby::poll` found.
pub struct Polled<P> {
    /// Connections whose first bytes arrived (or that closed: their thread
    /// sees that at once), oldest first.
    pub ready: Vec<Waiting<P>>,
    /// Connections closed at their deadline (first message not whole).
    pub expired: usize,
}

pub struct Lobby<P> {
    waiting: VecDeque<Waiting<P>>,
    per_address: HashMap<IpAddr, usize>,
    limit: usize,
    per_address_limit: usize,
    deadline: Duration,
}

impl<P> Lobby<P> {
    pub fn new(limit: usize, per_address_limit: usize, deadline: Duration) -> Lobby<P> {
        Lobby {
            waiting: VecDeque::new(),
            per_address: HashMap::new(),
            limit: limit.max(1),
            per_address_limit: per_address_limit.max(1),
            deadline,
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
            partial: None,
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

    /// Takes out the connections whose first message arrived whole (or
    /// that closed) within `wait`, and closes those past their deadline.
    pub fn poll(&mut self, wait: Duration, now: Instant) -> std::io::Result<Polled<P>> {
        let mut polled = Polled {
            ready: Vec::new(),
            expired: 0,
        };
        if self.waiting.is_empty() {
            return Ok(polled);
        }
        // Those with nothing yet are polled; those with part of a message
        // are looked at on their schedule.
        let polled_at: Vec<usize> = (0..self.waiting.len())
            .filter(|&i| self.waiting[i].partial.is_none())
            .collect();
        let mut readable = vec![false; self.waiting.len()];
        if !polled_at.is_empty() {
            let mut fds: Vec<rustix::event::PollFd<'_>> = polled_at
                .iter()
                .map(|&i| {
                    rustix::event::PollFd::from_borrowed_fd(
                        fd_of(&self.waiting[i].transport),
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
            for (fd, &i) in fds.iter().zip(&polled_at) {
                readable[i] = !fd.revents().is_empty();
            }
        } else if !wait.is_zero() {
            std::thread::sleep(wait.min(PARTIAL_RECHECK));
        }
        let now = now.max(Instant::now());
        let mut at = 0;
        for is_readable in readable {
            let w = &self.waiting[at];
            let look = is_readable || w.partial.is_some_and(|next| now >= next);
            let found = if look {
                Some(arrived(&w.transport))
            } else {
                None
            };
            let past_deadline = now.saturating_duration_since(w.since) >= self.deadline;
            match found {
                Some(Arrived::Whole) => polled.ready.extend(self.remove(at)),
                Some(Arrived::Gone) => drop(self.remove(at)),
                _ if past_deadline => {
                    drop(self.remove(at));
                    polled.expired += 1;
                }
                Some(Arrived::Part) => {
                    self.waiting[at].partial = Some(now + PARTIAL_RECHECK);
                    at += 1;
                }
                None => at += 1,
            }
        }
        Ok(polled)
    }
}

/// Whether `transport`'s first message has arrived whole, by the bytes
/// waiting in its socket (looked at, never taken).
fn arrived(transport: &Transport) -> Arrived {
    let fd = fd_of(transport);
    let Ok(available) = rustix::io::ioctl_fionread(fd) else {
        return Arrived::Gone;
    };
    let available = usize::try_from(available).unwrap_or(usize::MAX);
    if available == 0 {
        // Readable with nothing to read: the peer closed, or an error.
        return Arrived::Gone;
    }
    let mut head = [0u8; HEADER_LEN];
    let want = available.min(HEADER_LEN);
    let flags = rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT;
    let seen = match rustix::net::recv(fd, &mut head[..want], flags) {
        Ok((n, _)) => n,
        Err(_) => return Arrived::Gone,
    };
    let needed = match transport {
        // A TLS record: type, version, a 16-bit big-endian length.
        Transport::TlsServer(_) | Transport::TlsClient(_) => {
            if seen < 5 {
                5
            } else {
                5 + usize::from(u16::from_be_bytes([head[3], head[4]]))
            }
        }
        // A frame: the header, then the body it announces (a body past
        // the hello's limit is refused by the session as soon as it reads
        // the header).
        Transport::Tcp(_) | Transport::Unix(_) => {
            if seen < HEADER_LEN {
                HEADER_LEN
            } else {
                let body = u32::from_le_bytes([head[16], head[17], head[18], head[19]]) as usize;
                HEADER_LEN + if body > FIRST_BODY_LIMIT { 0 } else { body }
            }
        }
    };
    if available >= needed {
        Arrived::Whole
    } else {
        Arrived::Part
    }
}

/// The token id a waiting connection's first message names, when that
/// message (whole in the socket, looked at without taking it) is a
/// challenge over plain TCP or Unix (TLS hides it until the handshake).
pub fn challenged_token_id(transport: &Transport) -> Option<[u8; TOKEN_ID_LEN]> {
    if !matches!(transport, Transport::Tcp(_) | Transport::Unix(_)) {
        return None;
    }
    let mut first = [0u8; HEADER_LEN + NONCE_LEN + TOKEN_ID_LEN];
    let flags = rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT;
    let (seen, _) = rustix::net::recv(fd_of(transport), &mut first, flags).ok()?;
    if seen < first.len() {
        return None;
    }
    let header = Header::decode(first[..HEADER_LEN].try_into().ok()?, u64::MAX).ok()?;
    // The body may go on with the member the client meant (u16 length,
    // then the id): the token id is where it always is.
    let body_len = header.body_len as usize;
    let named = NONCE_LEN + TOKEN_ID_LEN;
    if header.op != Op::Challenge as u16
        || !(body_len == named
            || (named + 2 < body_len
                && body_len <= named + 2 + kvtier_wire::proof::MAX_MEMBER_ID_LEN))
    {
        return None;
    }
    first[HEADER_LEN + NONCE_LEN..].try_into().ok()
}

/// The token of a connection whose first message (whole in the socket,
/// looked at without taking it) is a plain hello over TCP or Unix: a client
/// that skips the challenge. Only to charge its wait to the right
/// principal; the hello itself is checked as any other.
pub fn hello_token(transport: &Transport) -> Option<Vec<u8>> {
    if !matches!(transport, Transport::Tcp(_) | Transport::Unix(_)) {
        return None;
    }
    let mut first = vec![0u8; HEADER_LEN + FIRST_BODY_LIMIT];
    let flags = rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT;
    let (seen, _) = rustix::net::recv(fd_of(transport), &mut first, flags).ok()?;
    let header = Header::decode(first.get(..HEADER_LEN)?.try_into().ok()?, u64::MAX).ok()?;
    if header.op != Op::Hello as u16 {
        return None;
    }
    let body = first.get(HEADER_LEN..seen.min(HEADER_LEN + header.body_len as usize))?;
    let len = u32::from_le_bytes(body.get(..4)?.try_into().ok()?) as usize;
    body.get(4..4usize.checked_add(len)?).map(<[u8]>::to_vec)
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
        // Peer 3 sends part of a frame: it stays (looked at again later).
        clients[3].write_all(&[0u8; 10]).unwrap();
        let polled = lobby.poll(Duration::from_millis(200), start).unwrap();
        assert!(polled.ready.is_empty());
        assert_eq!(lobby.len(), 4);
        // The rest of a header announcing an 8-byte body, then the body:
        // whole, it alone leaves.
        let mut header = [0u8; HEADER_LEN - 10];
        header[16 - 10..20 - 10].copy_from_slice(&8u32.to_le_bytes());
        clients[3].write_all(&header).unwrap();
        std::thread::sleep(PARTIAL_RECHECK * 2);
        let polled = lobby.poll(Duration::ZERO, start).unwrap();
        assert!(polled.ready.is_empty(), "the body has not arrived");
        clients[3].write_all(&[7u8; 8]).unwrap();
        // Looked at again until the body shows (a loaded machine may
        // deliver loopback bytes late; a bound only against a hang).
        let mut ready: Vec<u32> = Vec::new();
        for _ in 0..1000 {
            let polled = lobby.poll(PARTIAL_RECHECK, start).unwrap();
            ready.extend(polled.ready.iter().map(|w| w.peer));
            if !ready.is_empty() {
                break;
            }
        }
        assert_eq!(ready, vec![3]);
        assert_eq!(lobby.len(), 3);
        // A peer that closes leaves (closed here, not handed on).
        drop(clients.remove(4));
        let polled = lobby.poll(Duration::from_secs(10), start).unwrap();
        assert!(polled.ready.is_empty() && polled.expired == 0);
        assert_eq!(lobby.len(), 2);
        // Past the deadline the silent ones are closed.
        let later = start + Duration::from_secs(61);
        let polled = lobby.poll(Duration::ZERO, later).unwrap();
        assert!(polled.ready.is_empty());
        assert_eq!(polled.expired, 2);
        assert!(lobby.is_empty());
    }
}
