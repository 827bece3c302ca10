//! The KV-event feed's side of the soak (issue 39): with the server's feed
//! asking for logins (`kv_events_auth = "plain"`, or `"curve"` where the
//! soak is given the server's CURVE key), attackers that connect without
//! one, with a wrong password (under CURVE: a key derived from a wrong
//! token), or to the replay socket without one must never receive a batch
//! (a *breach*), while one subscriber logged in with the token keeps
//! receiving batches all along. ZMTP is spoken byte by byte here
//! (greeting, HELLO, INITIATE, SUBSCRIBE), as a hostile peer would, not
//! through a ZeroMQ library that would refuse to misbehave; CURVE through
//! kvtier-events' client (`curve::client`).

use kvtier_events::curve::client::Subscriber;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Feed attack classes, in the order each attacker runs them.
pub const CLASSES: [&str; 3] = [
    "feed_subscriber_without_login",
    "feed_wrong_password_or_key",
    "feed_replay_without_login",
];

fn greeting(mechanism: &[u8]) -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[12..12 + mechanism.len()].copy_from_slice(mechanism);
    g
}

fn command(name: &[u8], data: &[u8]) -> Vec<u8> {
    let mut body = vec![name.len() as u8];
    body.extend_from_slice(name);
    body.extend_from_slice(data);
    let mut out = vec![0x04, body.len() as u8];
    out.extend_from_slice(&body);
    out
}

fn socket_type(kind: &str) -> Vec<u8> {
    let mut p = vec![11];
    p.extend_from_slice(b"Socket-Type");
    p.extend_from_slice(&(kind.len() as u32).to_be_bytes());
    p.extend_from_slice(kind.as_bytes());
    p
}

/// One frame: (is a command, body), or `None` when the peer closed, went
/// silent for the socket's timeout, or sent more than 1 MiB.
fn read_frame(s: &mut TcpStream) -> Option<(bool, Vec<u8>)> {
    let mut flags = [0u8; 1];
    s.read_exact(&mut flags).ok()?;
    let len = if flags[0] & 0x02 != 0 {
        let mut l = [0u8; 8];
        s.read_exact(&mut l).ok()?;
        u64::from_be_bytes(l)
    } else {
        let mut l = [0u8; 1];
        s.read_exact(&mut l).ok()?;
        u64::from(l[0])
    };
    if len > 1 << 20 {
        return None;
    }
    let mut body = vec![0u8; len as usize];
    s.read_exact(&mut body).ok()?;
    Some((flags[0] & 0x04 != 0, body))
}

fn connect(addr: &str) -> Option<TcpStream> {
    let s = TcpStream::connect(addr.trim_start_matches("tcp://")).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    s.set_write_timeout(Some(Duration::from_secs(2))).ok()?;
    Some(s)
}

/// A PLAIN login as `kind` with `password`: whether the feed welcomed it
/// (and the socket, ready for messages).
fn plain_login(addr: &str, password: &[u8], kind: &str) -> Option<TcpStream> {
    let mut s = connect(addr)?;
    s.write_all(&greeting(b"PLAIN")).ok()?;
    let mut theirs = [0u8; 64];
    s.read_exact(&mut theirs).ok()?;
    let mut hello = vec![7];
    hello.extend_from_slice(b"soaker!");
    hello.push(password.len() as u8);
    hello.extend_from_slice(password);
    s.write_all(&command(b"HELLO", &hello)).ok()?;
    let (is_command, body) = read_frame(&mut s)?;
    if !(is_command && body.starts_with(b"\x07WELCOME")) {
        return None;
    }
    s.write_all(&command(b"INITIATE", &socket_type(kind)))
        .ok()?;
    let (is_command, body) = read_frame(&mut s)?;
    (is_command && body.starts_with(b"\x05READY")).then_some(s)
}

/// Whether any message (not a command) arrives on `s` within `within`.
fn receives_a_message(s: &mut TcpStream, within: Duration) -> bool {
    let until = Instant::now() + within;
    while Instant::now() < until {
        match read_frame(s) {
            Some((false, _)) => return true,
            Some((true, _)) => {}
            None => return false,
        }
    }
    false
}

/// The feed's login: PLAIN with the token, or CURVE with the key the
/// token derives, for the server whose key this is (Z85).
#[derive(Debug, Clone)]
pub enum Login {
    Plain,
    Curve { server_key: String },
}

impl Login {
    /// From `KVTIER_SOAK_FEED_CURVE_KEY`: CURVE when it is set.
    pub fn from_env() -> Self {
        match std::env::var("KVTIER_SOAK_FEED_CURVE_KEY") {
            Ok(server_key) if !server_key.is_empty() => Login::Curve { server_key },
            _ => Login::Plain,
        }
    }
}

/// A CURVE subscriber with the key `token` derives; `None` when refused.
fn curve_login(addr: &str, token: &[u8], server_key: &str) -> Option<Subscriber> {
    let addr = addr.trim_start_matches("tcp://").parse().ok()?;
    let mut s = Subscriber::connect(addr, token, server_key).ok()?;
    s.subscribe(b"").ok()?;
    Some(s)
}

/// One round of feed attack `class`; whether it was let through.
pub fn attack(
    class: usize,
    id: usize,
    round: usize,
    feed: &str,
    replay: &str,
    login: &Login,
) -> bool {
    match class {
        0 => {
            // NULL greeting, READY as a SUB, subscribe to everything.
            let Some(mut s) = connect(feed) else {
                return false;
            };
            let _ = s.write_all(&greeting(b"NULL"));
            let _ = s.write_all(&command(b"READY", &socket_type("SUB")));
            let _ = s.write_all(&[0x00, 0x01, 0x01]);
            receives_a_message(&mut s, Duration::from_secs(1))
        }
        1 => {
            let guess = format!("feed-guess-{id}-{round}-0123456789");
            if let Login::Curve { server_key } = login {
                // Refused at INITIATE; were it let in, any batch is a breach.
                return curve_login(feed, guess.as_bytes(), server_key).is_some_and(|mut s| {
                    let _ = s.next_message(1 << 20, Duration::from_millis(200));
                    true
                });
            }
            match plain_login(feed, guess.as_bytes(), "SUB") {
                Some(mut s) => {
                    let _ = s.write_all(&[0x00, 0x01, 0x01]);
                    let _ = receives_a_message(&mut s, Duration::from_millis(200));
                    true
                }
                None => false,
            }
        }
        _ => {
            // A DEALER without a login asking for every kept batch.
            let Some(mut s) = connect(replay) else {
                return false;
            };
            let _ = s.write_all(&greeting(b"NULL"));
            let _ = s.write_all(&command(b"READY", &socket_type("DEALER")));
            let _ = s.write_all(&[0x01, 0x00, 0x00, 0x08, 0, 0, 0, 0, 0, 0, 0, 0]);
            receives_a_message(&mut s, Duration::from_secs(1))
        }
    }
}

/// A router's subscriber logged in with the server's token, counting the
/// batches it receives until `stop` (reconnecting if the feed drops it).
pub fn logged_in_subscriber(
    feed: &str,
    token: &str,
    login: &Login,
    stop: &AtomicBool,
    batches: &AtomicU64,
) {
    if let Login::Curve { server_key } = login {
        while !stop.load(Ordering::Relaxed) {
            let Some(mut s) = curve_login(feed, token.as_bytes(), server_key) else {
                std::thread::sleep(Duration::from_millis(200));
                continue;
            };
            while !stop.load(Ordering::Relaxed) {
                match s.next_message(1 << 20, Duration::from_secs(2)) {
                    // The first frame of each three-frame batch.
                    Ok(body) if body.starts_with(b"kv@") => {
                        batches.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(_) => {}
                    Err(_) => break,
                }
            }
        }
        return;
    }
    while !stop.load(Ordering::Relaxed) {
        let Some(mut s) = plain_login(feed, token.as_bytes(), "SUB") else {
            std::thread::sleep(Duration::from_millis(200));
            continue;
        };
        let _ = s.write_all(&[0x00, 0x01, 0x01]);
        while !stop.load(Ordering::Relaxed) {
            match read_frame(&mut s) {
                // The first frame of each three-frame batch.
                Some((false, body)) if body.starts_with(b"kv@") => {
                    batches.fetch_add(1, Ordering::Relaxed);
                }
                Some(_) => {}
                None => break,
            }
        }
    }
}
