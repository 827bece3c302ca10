//! The attacks `soak` interleaves with its legitimate clients (issue 24's
//! classes, each bounded and on loopback): every attacker thread cycles
//! through them, and each round's outcome is checked where the server must
//! refuse (a guessed token admitted, an unauthenticated request answered,
//! a malformed frame answered OK) as a *breach*.

use kvtier_wire::proof;
use kvtier_wire::protocol::{code, Header, Op, Writer, HEADER_LEN};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The attack classes, in the order each attacker runs them.
pub const CLASSES: [&str; 9] = [
    "idle_unauthenticated_sockets",
    "token_guesses",
    "challenge_guesses",
    "bodies_one_byte_short",
    "gets_of_absent_keys",
    "announced_put_values",
    "malformed_frames",
    "cross_memory_lies",
    "pool_map_hoarding",
];

#[derive(Default)]
pub struct AttackCounts {
    pub rounds: [AtomicU64; CLASSES.len()],
    pub feed_rounds: [AtomicU64; crate::feed::CLASSES.len()],
    pub shared_rounds: [AtomicU64; crate::shared_dir::CLASSES.len()],
    pub cluster_rounds: [AtomicU64; crate::cluster_peers::CLASSES.len()],
    /// Attacks whose connection could not be made at all (each such round
    /// attacked nothing; a run where they dominate proves nothing).
    pub unconnected: AtomicU64,
    pub breaches: AtomicU64,
}

pub(crate) fn frame(op: Op, id: u64, body: &[u8]) -> Vec<u8> {
    let mut f = Header {
        op: op as u16,
        request_id: id,
        body_len: body.len() as u32,
        status: 0,
    }
    .encode()
    .to_vec();
    f.extend_from_slice(body);
    f
}

/// The status of the next reply (its body skipped), or `None` if the
/// connection ended first.
pub(crate) fn reply_status(s: &mut TcpStream) -> Option<i32> {
    let mut head = [0u8; HEADER_LEN];
    s.read_exact(&mut head).ok()?;
    let len = u32::from_le_bytes(head[16..20].try_into().unwrap()) as u64;
    std::io::copy(&mut (&mut *s).take(len), &mut std::io::sink()).ok()?;
    Some(i32::from_le_bytes(head[20..24].try_into().unwrap()))
}

pub(crate) fn hello_body(token: &[u8]) -> Vec<u8> {
    let mut w = Writer::default();
    w.u32(token.len() as u32).bytes(token).u16(0);
    w.buf
}

pub(crate) fn connect(tcp: &str) -> Option<TcpStream> {
    let s = TcpStream::connect(tcp).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(20))).ok()?;
    s.set_write_timeout(Some(Duration::from_secs(20))).ok()?;
    Some(s)
}

/// A connection that said hello with the real token (an authenticated
/// attacker: a token holder is a principal too).
fn authenticated(tcp: &str, token: &str) -> Option<TcpStream> {
    let mut s = connect(tcp)?;
    s.write_all(&frame(Op::Hello, 1, &hello_body(token.as_bytes())))
        .ok()?;
    (reply_status(&mut s)? == code::OK).then_some(s)
}

pub fn sleep_unless(stop: &AtomicBool, d: Duration) {
    let until = Instant::now() + d;
    while Instant::now() < until && !stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The KV-event feed's endpoints, when the soak's server publishes one.
pub struct Feed {
    pub publish: String,
    pub replay: String,
    pub login: crate::feed::Login,
}

/// What else the soak's server has that attackers go at, besides its
/// sockets.
#[derive(Clone, Copy, Default)]
pub struct Surfaces<'a> {
    /// Its KV-event feed.
    pub feed: Option<&'a Feed>,
    /// Its shared directory.
    pub shared: Option<&'a std::path::Path>,
    /// The cluster it is a member of.
    pub cluster: Option<&'a crate::cluster_peers::Cluster>,
}

/// `tcp_url` is the server's `tcp://HOST:PORT`.
pub fn attacker_loop(
    id: usize,
    unix_url: &str,
    tcp_url: &str,
    token: &str,
    surfaces: Surfaces<'_>,
    stop: &AtomicBool,
    counts: &AttackCounts,
) {
    let Surfaces {
        feed,
        shared,
        cluster,
    } = surfaces;
    // The raw sockets below dial HOST:PORT. (They were given the URL,
    // which no socket address parses: every connect failed and these
    // classes attacked nothing until this was found.)
    let tcp = tcp_url.strip_prefix("tcp://").unwrap_or(tcp_url);
    let mut round = id;
    let feed_classes = if feed.is_some() {
        crate::feed::CLASSES.len()
    } else {
        0
    };
    let shared_classes = if shared.is_some() {
        crate::shared_dir::CLASSES.len()
    } else {
        0
    };
    let cluster_classes = if cluster.is_some() {
        crate::cluster_peers::CLASSES.len()
    } else {
        0
    };
    let classes = CLASSES.len() + feed_classes + shared_classes + cluster_classes;
    while !stop.load(Ordering::Relaxed) {
        let class = round % classes;
        round += 1;
        if class >= CLASSES.len() {
            let which = class - CLASSES.len();
            let (name, rounds, breach) = if which >= feed_classes + shared_classes {
                let which = which - feed_classes - shared_classes;
                let cluster = cluster.expect("cluster classes only in a cluster");
                (
                    crate::cluster_peers::CLASSES[which],
                    &counts.cluster_rounds[which],
                    crate::cluster_peers::attack(which, id, round, cluster, tcp, token, stop),
                )
            } else if which >= feed_classes {
                let which = which - feed_classes;
                let shared = shared.expect("shared-directory classes only with one");
                (
                    crate::shared_dir::CLASSES[which],
                    &counts.shared_rounds[which],
                    crate::shared_dir::attack(which, id, round, shared, tcp_url, token, stop),
                )
            } else {
                let feed = feed.expect("feed classes only with a feed");
                (
                    crate::feed::CLASSES[which],
                    &counts.feed_rounds[which],
                    crate::feed::attack(which, id, round, &feed.publish, &feed.replay, &feed.login),
                )
            };
            rounds.fetch_add(1, Ordering::Relaxed);
            if breach {
                counts.breaches.fetch_add(1, Ordering::Relaxed);
                eprintln!("attacker {id}: {name} was let through");
            }
            continue;
        }
        if TcpStream::connect(tcp).is_err() {
            counts.unconnected.fetch_add(1, Ordering::Relaxed);
        }
        let breach = match class {
            0 => {
                // Idle sockets that never say hello, held 2 s.
                let idle: Vec<TcpStream> = (0..16).filter_map(|_| connect(tcp)).collect();
                sleep_unless(stop, Duration::from_secs(2));
                drop(idle);
                false
            }
            1 => {
                // Wrong tokens: must be refused (after the delay).
                let guess = format!("guess-{id}-{round}-0123456789abcdef");
                connect(tcp).is_some_and(|mut s| {
                    s.write_all(&frame(Op::Hello, 1, &hello_body(guess.as_bytes())))
                        .is_ok()
                        && reply_status(&mut s) == Some(code::OK)
                })
            }
            2 => {
                // A challenge naming a token the server does not hold.
                let key =
                    proof::TokenKey::new(format!("guess-{id}-{round}-abcdef0123456789").as_bytes());
                let mut body = [3u8; proof::NONCE_LEN].to_vec();
                body.extend_from_slice(&key.id());
                connect(tcp).is_some_and(|mut s| {
                    s.write_all(&frame(Op::Challenge, 1, &body)).is_ok()
                        && reply_status(&mut s) == Some(code::OK)
                })
            }
            3 => {
                // A 16 MiB body sent but its last byte, held, then dropped.
                if let Some(mut s) = authenticated(tcp, token) {
                    let len = 16usize << 20;
                    let _ = s.write_all(
                        &Header {
                            op: Op::BatchExists as u16,
                            request_id: 2,
                            body_len: len as u32,
                            status: 0,
                        }
                        .encode(),
                    );
                    let chunk = vec![0u8; 1 << 20];
                    let mut sent = 0;
                    while sent < len - 1 {
                        let n = chunk.len().min(len - 1 - sent);
                        if s.write_all(&chunk[..n]).is_err() {
                            break;
                        }
                        sent += n;
                    }
                    sleep_unless(stop, Duration::from_secs(2));
                }
                false
            }
            4 => {
                // 4,096 absent keys with 1 MiB capacities each.
                if let Some(mut s) = authenticated(tcp, token) {
                    let mut w = Writer::default();
                    w.u32(4096);
                    for k in 0..4096u32 {
                        w.key(format!("absent/{id}/{k}").as_bytes()).u64(1 << 20);
                    }
                    let _ = s.write_all(&frame(Op::BatchGet, 2, &w.buf));
                    let _ = reply_status(&mut s);
                }
                false
            }
            5 => {
                // A streamed put announcing a 4 MiB value, sending 1 KiB.
                if let Some(mut s) = authenticated(tcp, token) {
                    let mut w = Writer::default();
                    w.u8(0).u32(1).key(b"announced").u64(4 << 20);
                    let mut f = Header {
                        op: Op::BatchPut as u16,
                        request_id: 2,
                        body_len: (w.buf.len() + (4 << 20)) as u32,
                        status: 0,
                    }
                    .encode()
                    .to_vec();
                    f.extend_from_slice(&w.buf);
                    f.extend_from_slice(&[0u8; 1024]);
                    let _ = s.write_all(&f);
                    sleep_unless(stop, Duration::from_secs(2));
                }
                false
            }
            7 => cross_memory_lies(unix_url, token, id, round),
            8 => pool_map_hoarding(unix_url, token, id, round, stop),
            _ => {
                // Garbage where a header should be, unauthenticated and
                // after hello: never answered OK.
                let garbage = [0x5au8; 64];
                let before = connect(tcp).is_some_and(|mut s| {
                    s.write_all(&garbage).is_ok() && reply_status(&mut s) == Some(code::OK)
                });
                let after = authenticated(tcp, token).is_some_and(|mut s| {
                    s.write_all(&garbage).is_ok() && reply_status(&mut s) == Some(code::OK)
                });
                before || after
            }
        };
        counts.rounds[class].fetch_add(1, Ordering::Relaxed);
        if breach {
            counts.breaches.fetch_add(1, Ordering::Relaxed);
            eprintln!("attacker {id}: {} was let through", CLASSES[class]);
        }
    }
}

/// A Unix-socket client that registers its own memory (RegisterPeerMemory)
/// with a lying probe (must be refused), then honestly, and then names
/// memory that is not its own: unmapped addresses and ranges wrapping past
/// the end of memory, for gets and puts. A breach: a lie accepted, a bad
/// range answered OK, or a put from one stored.
fn cross_memory_lies(unix_url: &str, token: &str, id: usize, round: usize) -> bool {
    use kvtier_wire::protocol::{Reader, Request};
    use std::os::unix::net::UnixStream;
    let Some(path) = unix_url.strip_prefix("unix://") else {
        return false;
    };
    let Ok(mut s) = UnixStream::connect(path) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
    let exchange = |s: &mut UnixStream, op: Op, body: &[u8]| -> Option<(i32, Vec<u8>)> {
        s.write_all(&frame(op, 1, body)).ok()?;
        let mut head = [0u8; HEADER_LEN];
        s.read_exact(&mut head).ok()?;
        let header = Header::decode(&head, 64 << 20).ok()?;
        let mut body = vec![0u8; header.body_len as usize];
        s.read_exact(&mut body).ok()?;
        Some((header.status, body))
    };
    if exchange(&mut s, Op::Hello, &hello_body(token.as_bytes())).map(|r| r.0) != Some(code::OK) {
        return false;
    }
    let held = [0x42u8; 16];
    let lie = Request::RegisterPeerMemory {
        address: held.as_ptr() as u64,
        probe: &[0x24u8; 16],
    };
    if exchange(&mut s, Op::RegisterPeerMemory, &lie.encode()).map(|r| r.0) == Some(code::OK) {
        return true;
    }
    let probe: [u8; 16] = std::array::from_fn(|i| (i + id + round) as u8);
    let honest = Request::RegisterPeerMemory {
        address: probe.as_ptr() as u64,
        probe: &probe,
    };
    let Some((code::OK, body)) = exchange(&mut s, Op::RegisterPeerMemory, &honest.encode()) else {
        // The server does not reach this process (a kernel that forbids
        // it): nothing to attack, said so.
        eprintln!("attacker {id}: cross_memory_lies: the server does not reach this process; this round attacked nothing");
        return false;
    };
    let Ok(buffer) = Reader::new(&body).u32() else {
        return true;
    };
    let key = format!("cross-lie/{id}/{round}");
    let bad = [(16u64, 1u64 << 20), (u64::MAX - 8, 4096)];
    let codes = |body: &[u8], get: bool| -> Vec<i32> {
        let mut r = Reader::new(body);
        let n = r.u32().unwrap_or(0);
        (0..n)
            .filter_map(|_| {
                let c = r.i32().ok()?;
                if get {
                    r.u64().ok()?;
                }
                Some(c)
            })
            .collect()
    };
    let mut breach = false;
    for (get, op) in [
        (false, Op::BatchPutShmSegments),
        (true, Op::BatchGetShmSegments),
    ] {
        let mut w = Writer::default();
        w.u32(buffer);
        if !get {
            w.u8(0);
        }
        w.u32(bad.len() as u32);
        for (address, len) in bad {
            w.key(key.as_bytes()).u32(1).u64(address).u64(len);
        }
        if let Some((code::OK, body)) = exchange(&mut s, op, &w.buf) {
            breach |= codes(&body, get).contains(&code::OK);
        }
    }
    // Nothing was stored under the key from memory that was not there.
    let mut w = Writer::default();
    w.u32(1).key(key.as_bytes());
    if let Some((code::OK, body)) = exchange(&mut s, Op::BatchExists, &w.buf) {
        let mut r = Reader::new(&body);
        breach |= r.u32().ok() == Some(1) && r.u8().ok() == Some(1);
    }
    breach
}

/// A Unix-socket client that maps the server's pool (MapPool) and tries to
/// write it through the descriptor (a writable mapping, `write`, a
/// truncation, a punched hole), then leases one value 64 times without
/// releasing and asks for a 65th, and holds what it leased for 2 s while
/// the legitimate clients go on. A breach: any write way accepted, or a
/// lease past the connection's 64.
fn pool_map_hoarding(
    unix_url: &str,
    token: &str,
    id: usize,
    round: usize,
    stop: &AtomicBool,
) -> bool {
    use kvtier_wire::protocol::{features, HelloReply, Reader, Request};
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;
    let Some(path) = unix_url.strip_prefix("unix://") else {
        return false;
    };
    let Ok(mut s) = UnixStream::connect(path) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
    // Reads one reply, with the descriptor that came with it.
    let read = |s: &mut UnixStream| -> Option<(i32, Vec<u8>, Option<std::os::fd::OwnedFd>)> {
        let mut head = [0u8; HEADER_LEN];
        let mut got = 0;
        let mut passed = None;
        while got < HEADER_LEN {
            let (n, fd) = kvtier_wire::shm::recv_some_with_fd(s, &mut head[got..]).ok()?;
            if n == 0 {
                return None;
            }
            passed = passed.or(fd);
            got += n;
        }
        let header = Header::decode(&head, 64 << 20).ok()?;
        let mut body = vec![0u8; header.body_len as usize];
        s.read_exact(&mut body).ok()?;
        Some((header.status, body, passed))
    };
    let exchange = |s: &mut UnixStream, op: Op, body: &[u8]| {
        s.write_all(&frame(op, 1, body)).ok()?;
        read(s)
    };
    let Some((code::OK, hello, _)) = exchange(&mut s, Op::Hello, &hello_body(token.as_bytes()))
    else {
        return false;
    };
    if HelloReply::decode(&hello).map_or(0, |h| h.features) & features::POOL_MAP == 0 {
        eprintln!("attacker {id}: pool_map_hoarding: the server does not offer its pool; this round attacked nothing");
        return false;
    }
    // A refused MapPool (no descriptor to spare, say) gives the attacker
    // nothing: not a breach, and this round attacked nothing.
    let Some((code::OK, body, Some(fd))) = exchange(&mut s, Op::MapPool, &[]) else {
        eprintln!(
            "attacker {id}: pool_map_hoarding: MapPool was refused; this round attacked nothing"
        );
        return false;
    };
    let pool_len = Reader::new(&body).u64().unwrap_or(0) as usize;
    // SAFETY: attempts on this process's own copy of the descriptor; a
    // mapping that succeeds is unmapped at once.
    let written = unsafe {
        let raw = fd.as_raw_fd();
        let writable = libc::mmap(
            std::ptr::null_mut(),
            pool_len.min(1 << 20),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            raw,
            0,
        );
        let mapped = writable != libc::MAP_FAILED;
        if mapped {
            libc::munmap(writable, pool_len.min(1 << 20));
        }
        mapped
            || libc::write(raw, b"x".as_ptr().cast(), 1) >= 0
            || libc::ftruncate(raw, 4096) == 0
            || libc::fallocate(
                raw,
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                0,
                4096,
            ) == 0
    };
    if written {
        return true;
    }
    // A value of this attacker's own, leased 64 times and held.
    let key = format!("pool-hoard/{id}/{round}");
    let mut w = Writer::default();
    w.u8(0).u32(1).key(key.as_bytes()).u64(1 << 20);
    w.buf.extend_from_slice(&vec![0x5a; 1 << 20]);
    if exchange(&mut s, Op::BatchPut, &w.buf).map(|r| r.0) != Some(code::OK) {
        return false;
    }
    let lease = Request::LeaseValues {
        items: vec![(key.as_bytes(), 1 << 20)],
    }
    .encode();
    // Whether a reply leased the value. A lease whose key had no memory
    // copy (evicted meanwhile) is answered OK with nothing held, and the
    // server counts only leases that hold something: such a round proves
    // nothing about the cap.
    let leased = |reply: &[u8]| {
        kvtier_wire::protocol::decode_lease_reply(reply, 1)
            .is_ok_and(|(_, items)| items[0].code == code::OK)
    };
    for _ in 0..64 {
        match exchange(&mut s, Op::LeaseValues, &lease) {
            Some((code::OK, reply, _)) if leased(&reply) => {}
            Some((code::OK, _, _)) => {
                eprintln!("attacker {id}: pool_map_hoarding: the value left memory before 64 leases held it; this round attacked nothing");
                return false;
            }
            // The leasing budget, held by the others: nothing more here.
            _ => return false,
        }
    }
    if let Some((code::OK, reply, _)) = exchange(&mut s, Op::LeaseValues, &lease) {
        if leased(&reply) {
            return true;
        }
    }
    let release = Request::ReleaseLease { lease: u64::MAX }.encode();
    let released = exchange(&mut s, Op::ReleaseLease, &release).map(|r| r.0);
    sleep_unless(stop, Duration::from_secs(2));
    released != Some(code::OK)
}
