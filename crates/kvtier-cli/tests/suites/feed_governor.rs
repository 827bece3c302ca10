//! The KV-event feed draws on the server's governor (issue 60), against the
//! real `kvtier serve --kv-events ... --kv-events-replay ...`: refused logins
//! spend the server's one guess budget, every connection holds a slot of a
//! governed budget from before its thread starts, idle subscribers make
//! room for routers and a principal over its floor gives way, a replay in
//! progress is never closed for a newcomer, and a handshake has one
//! deadline. Each test prints what it measured (`--nocapture`); run with
//! `KVTIER_TEST_SERVER_BIN` naming an older build to see it fail there.

use crate::common::{as_tenant, options, ServerProcess, TEST_TOKEN};
use kvtier_client::Client;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const TOKEN_A: &str = "tenant-a-token-0123456789abcdef";
const TOKEN_B: &str = "tenant-b-token-0123456789abcdef";

/// A server with the feed on both sockets.
struct Feed {
    server: ServerProcess,
    publish: SocketAddr,
    replay: SocketAddr,
}

/// Two ports free now (bound together, so distinct).
fn free_ports() -> (u16, u16) {
    let a = TcpListener::bind("127.0.0.1:0").unwrap();
    let b = TcpListener::bind("127.0.0.1:0").unwrap();
    (
        a.local_addr().unwrap().port(),
        b.local_addr().unwrap().port(),
    )
}

/// Starts a server with the feed; `auth`: `kv_events_auth` ("plain",
/// "curve") or none; with tenants a and b (`tenant-a/`, `tenant-b/`).
fn start_feed(dir: &Path, auth: Option<&str>, tenants: bool) -> Feed {
    let (publish, replay) = free_ports();
    let mut args = vec![
        "--kv-events".to_string(),
        format!("tcp://127.0.0.1:{publish}"),
        "--kv-events-replay".into(),
        format!("tcp://127.0.0.1:{replay}"),
    ];
    if let Some(auth) = auth {
        let config = dir.join("feed.toml");
        std::fs::write(&config, format!("kv_events_auth = \"{auth}\"\n")).unwrap();
        args.extend(["--config".into(), config.display().to_string()]);
    }
    if tenants {
        let file = dir.join("tenants.toml");
        std::fs::write(
            &file,
            format!(
                "[[tenant]]\nname = \"a\"\ntoken = \"{TOKEN_A}\"\nnamespaces = [\"tenant-a/\"]\n\n\
                 [[tenant]]\nname = \"b\"\ntoken = \"{TOKEN_B}\"\nnamespaces = [\"tenant-b/\"]\n"
            ),
        )
        .unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        args.extend(["--tenants".into(), file.display().to_string()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let server = ServerProcess::start(&dir.join("data"), &args);
    Feed {
        server,
        publish: format!("127.0.0.1:{publish}").parse().unwrap(),
        replay: format!("127.0.0.1:{replay}").parse().unwrap(),
    }
}

impl Feed {
    /// `/stats`, with the server's token (needed beside tenants).
    fn stats(&self) -> serde_json::Value {
        let response = self.server.http_request(&format!(
            "GET /stats HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TEST_TOKEN}\r\n\r\n"
        ));
        serde_json::from_str(response.split("\r\n\r\n").nth(1).unwrap()).unwrap()
    }

    fn curve_key(&self) -> String {
        self.stats()["kv_events"]["curve_server_key"]
            .as_str()
            .unwrap()
            .to_string()
    }

    /// The server process's threads and open descriptors.
    fn threads_and_fds(&self) -> (usize, usize) {
        let pid = self.server.child.id();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let threads = status
            .lines()
            .find_map(|l| l.strip_prefix("Threads:"))
            .map_or(0, |n| n.trim().parse().unwrap_or(0));
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count());
        (threads, fds)
    }
}

// ZMTP 3 as a peer speaks it, just enough for these tests.

fn greeting(mechanism: &[u8]) -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[12..12 + mechanism.len()].copy_from_slice(mechanism);
    g
}

fn put_frame(out: &mut Vec<u8>, body: &[u8], more: bool, command: bool) {
    let flags = u8::from(more) | if command { 4 } else { 0 };
    if body.len() > 255 {
        out.push(flags | 2);
        out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    } else {
        out.push(flags);
        out.push(body.len() as u8);
    }
    out.extend_from_slice(body);
}

/// One frame: (more, command, body).
fn read_frame(s: &mut impl Read) -> io::Result<(bool, bool, Vec<u8>)> {
    let mut flags = [0u8; 1];
    s.read_exact(&mut flags)?;
    let len = if flags[0] & 2 != 0 {
        let mut n = [0u8; 8];
        s.read_exact(&mut n)?;
        u64::from_be_bytes(n) as usize
    } else {
        let mut n = [0u8; 1];
        s.read_exact(&mut n)?;
        usize::from(n[0])
    };
    if len > 64 << 20 {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "a huge frame"));
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body)?;
    Ok((flags[0] & 1 != 0, flags[0] & 4 != 0, body))
}

fn socket_type_property(kind: &str) -> Vec<u8> {
    let mut p = vec![11];
    p.extend_from_slice(b"Socket-Type");
    p.extend_from_slice(&(kind.len() as u32).to_be_bytes());
    p.extend_from_slice(kind.as_bytes());
    p
}

fn refused(why: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::PermissionDenied, why.into())
}

/// A NULL peer of `kind` (SUB, DEALER) with its handshake done.
fn null_peer(addr: SocketAddr, kind: &str) -> io::Result<TcpStream> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    s.write_all(&greeting(b"NULL"))?;
    let mut theirs = [0u8; 64];
    s.read_exact(&mut theirs)?;
    let mut ready = b"\x05READY".to_vec();
    ready.extend_from_slice(&socket_type_property(kind));
    let mut out = Vec::new();
    put_frame(&mut out, &ready, false, true);
    s.write_all(&out)?;
    match read_frame(&mut s)? {
        (_, true, body) if body.starts_with(b"\x05READY") => Ok(s),
        other => Err(refused(format!("no READY: {other:?}"))),
    }
}

/// The PLAIN greeting and HELLO with `password`, as one write.
fn plain_hello(password: &str) -> Vec<u8> {
    let mut out = greeting(b"PLAIN").to_vec();
    let mut hello = b"\x05HELLO\x06router".to_vec();
    hello.push(password.len() as u8);
    hello.extend_from_slice(password.as_bytes());
    put_frame(&mut out, &hello, false, true);
    out
}

/// A PLAIN peer of `kind` logged in with `password`; `PermissionDenied`
/// when answered ERROR.
fn plain_peer(addr: SocketAddr, password: &str, kind: &str) -> io::Result<TcpStream> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    s.write_all(&plain_hello(password))?;
    let mut theirs = [0u8; 64];
    s.read_exact(&mut theirs)?;
    match read_frame(&mut s)? {
        (_, true, body) if body == b"\x07WELCOME" => {}
        other => return Err(refused(format!("no WELCOME: {other:?}"))),
    }
    let mut initiate = b"\x08INITIATE".to_vec();
    initiate.extend_from_slice(&socket_type_property(kind));
    let mut out = Vec::new();
    put_frame(&mut out, &initiate, false, true);
    s.write_all(&out)?;
    match read_frame(&mut s)? {
        (_, true, body) if body.starts_with(b"\x05READY") => Ok(s),
        other => Err(refused(format!("no READY: {other:?}"))),
    }
}

fn subscribe(s: &mut TcpStream, prefix: &[u8]) -> io::Result<()> {
    let mut body = vec![1];
    body.extend_from_slice(prefix);
    let mut out = Vec::new();
    put_frame(&mut out, &body, false, false);
    s.write_all(&out)
}

/// The topic of the next batch `s` receives within `limit`.
fn next_topic(s: &mut TcpStream, limit: Duration) -> io::Result<Vec<u8>> {
    s.set_read_timeout(Some(limit))?;
    loop {
        let (more, command, body) = read_frame(s)?;
        if !command && more {
            return Ok(body);
        }
    }
}

/// Puts keys into `namespace` as `token` until dropped, so the feed has
/// batches to send.
struct Writer(Arc<AtomicBool>, Option<std::thread::JoinHandle<()>>);

impl Writer {
    fn start(server: &ServerProcess, token: &str, namespace: &str) -> Writer {
        let stop = Arc::new(AtomicBool::new(false));
        let url = server.tcp_url();
        let options = if token == TEST_TOKEN {
            kvtier_client::ClientOptions {
                namespace: namespace.into(),
                ..options()
            }
        } else {
            as_tenant(token, namespace)
        };
        let done = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let mut client = Client::connect_with(&url, options).unwrap();
            let mut i = 0u64;
            while !done.load(Ordering::Acquire) {
                let key = format!("block-{i}");
                let _ = client.batch_put(&[key.as_bytes()], &[b"value"]);
                i += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        Writer(stop, Some(thread))
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
        let _ = self.1.take().map(std::thread::JoinHandle::join);
    }
}

/// Issue 60, findings 1 and 2: wrong feed passwords were answered in
/// 4-52 ms, 250-320 guesses a second outside the data port's guess budget
/// and not counted in `auth_failures`; the threads of the refused
/// connections (and descriptors) piled up past the feed's 64-connection
/// cap. Now every refused login (PLAIN and CURVE) spends a turn of the
/// server's one guess budget (10 a second, one second's burst), is
/// answered after the refusal pause (1 s) and counted; every connection
/// holds a slot of the governor's `feed handshakes` budget from before its
/// thread starts, so threads and descriptors stay within the budget.
fn guessers(feed: &Feed, curve_key: Option<&str>, count: usize, seconds: u64) -> GuessRun {
    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicU64::new(0));
    let fastest = Arc::new(Mutex::new(Duration::MAX));
    let mut threads = Vec::new();
    for n in 0..count {
        let addr = if n % 3 == 2 {
            feed.replay
        } else {
            feed.publish
        };
        let (stop, answered, fastest) = (
            Arc::clone(&stop),
            Arc::clone(&answered),
            Arc::clone(&fastest),
        );
        let key = curve_key.map(str::to_string);
        threads.push(std::thread::spawn(move || {
            let mut i = 0u64;
            while !stop.load(Ordering::Acquire) {
                i += 1;
                let guess = format!("wrong-token-{n}-{i}-0123456789");
                let sent = Instant::now();
                let refused_in = match &key {
                    Some(key) => {
                        match kvtier_events::curve::client::Subscriber::connect(
                            addr,
                            guess.as_bytes(),
                            key,
                        ) {
                            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
                                Some(sent.elapsed())
                            }
                            _ => None,
                        }
                    }
                    None => plain_guess(addr, &guess, &stop).then(|| sent.elapsed()),
                };
                if let Some(took) = refused_in {
                    answered.fetch_add(1, Ordering::Relaxed);
                    let mut f = fastest.lock().unwrap();
                    *f = (*f).min(took);
                }
            }
        }));
    }
    let started = Instant::now();
    let before = feed.threads_and_fds();
    let mut most = before;
    while started.elapsed() < Duration::from_secs(seconds) {
        let now = feed.threads_and_fds();
        most = (most.0.max(now.0), most.1.max(now.1));
        std::thread::sleep(Duration::from_millis(50));
    }
    let elapsed = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Release);
    for t in threads {
        let _ = t.join();
    }
    let answered = answered.load(Ordering::Relaxed);
    let fastest = *fastest.lock().unwrap();
    GuessRun {
        answered,
        per_second: answered as f64 / elapsed,
        fastest,
        most,
    }
}

#[derive(Debug)]
struct GuessRun {
    /// Refusals answered (ERROR received).
    answered: u64,
    per_second: f64,
    /// The soonest a refusal was answered.
    fastest: Duration,
    /// The most threads and descriptors the server held meanwhile.
    most: (usize, usize),
}

/// One wrong PLAIN login: `true` when answered ERROR. Gives up (closing)
/// after 10 s or when told to stop.
fn plain_guess(addr: SocketAddr, password: &str, stop: &AtomicBool) -> bool {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return false;
    };
    if s.write_all(&plain_hello(password)).is_err() {
        return false;
    }
    let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut buf = [0u8; 512];
    while Instant::now() < deadline && !stop.load(Ordering::Acquire) {
        match s.read(&mut buf) {
            Ok(0) => return false,
            Ok(n) => {
                got.extend_from_slice(&buf[..n]);
                if got.windows(6).any(|w| w == b"\x05ERROR") {
                    return true;
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return false,
        }
    }
    false
}

#[test]
fn refused_feed_logins_spend_the_servers_guess_budget_and_are_counted() {
    let mut wrong = Vec::new();
    for auth in ["plain", "curve"] {
        let dir = tempfile::tempdir().unwrap();
        let feed = start_feed(dir.path(), Some(auth), false);
        let key = (auth == "curve").then(|| feed.curve_key());
        let failures_before = feed.stats()["server"]["auth_failures"].as_u64().unwrap();
        let run = guessers(&feed, key.as_deref(), 12, 6);
        let failures = feed.stats()["server"]["auth_failures"].as_u64().unwrap() - failures_before;
        eprintln!(
            "{auth}: {} refusals answered, {:.1}/s, the soonest after {:?}; auth_failures +{failures}",
            run.answered, run.per_second, run.fastest
        );
        if run.answered == 0 {
            wrong.push(format!("{auth}: no refusal was answered at all"));
        }
        // 10 turns a second and one second's burst: about 11 a second over
        // 6 s. Only a broken budget answers more (it used to be 250-320).
        if run.per_second > 20.0 {
            wrong.push(format!(
                "{auth}: {:.1} guesses a second answered",
                run.per_second
            ));
        }
        // The refusal pause: a refusal can only be answered later, never
        // sooner.
        if run.fastest < Duration::from_millis(900) {
            wrong.push(format!(
                "{auth}: a refusal answered after {:?}",
                run.fastest
            ));
        }
        if failures < run.answered {
            wrong.push(format!(
                "{auth}: {} refusals answered, {failures} counted in auth_failures",
                run.answered
            ));
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}

#[test]
fn feed_connections_hold_governed_slots_so_threads_and_descriptors_stay_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let feed = start_feed(dir.path(), Some("plain"), false);
    std::thread::sleep(Duration::from_millis(500));
    let idle = feed.threads_and_fds();
    let run = guessers(&feed, None, 48, 6);
    eprintln!(
        "threads {} at rest, at most {} under 48 guessers; descriptors {} at rest, at most {}",
        idle.0, run.most.0, idle.1, run.most.1
    );
    // `feed handshakes` (64) holds at most 16 unauthenticated peers on both
    // sockets together, a thread and a descriptor (and its second handle)
    // each; the rest is slack for the server's own comings and goings. It
    // used to reach 315-902 threads.
    assert!(
        run.most.0 <= idle.0 + 40,
        "threads: {} at rest, {} under attack",
        idle.0,
        run.most.0
    );
    assert!(
        run.most.1 <= idle.1 + 120,
        "descriptors: {} at rest, {} under attack",
        idle.1,
        run.most.1
    );
}

/// Issue 60, finding 3: 64 subscribers holding a subscription that never
/// matches were never idle, and the operator's and other tenants' routers
/// got in 0 of 3: a local user without a token on the default (NULL) feed,
/// and a tenant under PLAIN and CURVE. Now a subscriber sent nothing for
/// the idle limit (5 s) may be closed for a newcomer, a tenant holds at
/// most its share of `feed subscribers`, and the principal most over its
/// floor gives way.
#[test]
fn subscribers_that_receive_nothing_make_room_for_routers() {
    let mut kept_out = Vec::new();
    for auth in [None, Some("plain"), Some("curve")] {
        let dir = tempfile::tempdir().unwrap();
        let tenants = auth.is_some();
        let feed = start_feed(dir.path(), auth, tenants);
        let key = (auth == Some("curve")).then(|| feed.curve_key());
        // The attacker: 64 subscribers (tenant a's where there are logins),
        // each subscribed to a topic nothing is published under.
        let mut held = Vec::new();
        for _ in 0..64 {
            let subscriber: Option<Box<dyn std::any::Any>> = match (auth, &key) {
                (None, _) => null_peer(feed.publish, "SUB")
                    .and_then(|mut s| subscribe(&mut s, b"nothing-matches").map(|()| s))
                    .ok()
                    .map(|s| Box::new(s) as Box<dyn std::any::Any>),
                (Some(_), Some(key)) => kvtier_events::curve::client::Subscriber::connect(
                    feed.publish,
                    TOKEN_A.as_bytes(),
                    key,
                )
                .and_then(|mut s| s.subscribe(b"nothing-matches").map(|()| s))
                .ok()
                .map(|s| Box::new(s) as Box<dyn std::any::Any>),
                (Some(_), None) => plain_peer(feed.publish, TOKEN_A, "SUB")
                    .and_then(|mut s| subscribe(&mut s, b"nothing-matches").map(|()| s))
                    .ok()
                    .map(|s| Box::new(s) as Box<dyn std::any::Any>),
            };
            held.extend(subscriber);
        }
        let attackers = held.len();
        // Batches flow (none for the attacker) past the idle limit.
        let _server_writes = Writer::start(&feed.server, TEST_TOKEN, "shared/llama");
        let _b_writes = tenants.then(|| Writer::start(&feed.server, TOKEN_B, "tenant-b/llama"));
        std::thread::sleep(Duration::from_secs(7));
        // The routers: the operator's (the server's token, or none on the
        // NULL feed), tenant b's, and the operator's again.
        let routers: Vec<&str> = if tenants {
            vec![TEST_TOKEN, TOKEN_B, TEST_TOKEN]
        } else {
            vec![""; 3]
        };
        let mut admitted = 0;
        let mut kept = Vec::new();
        for token in routers {
            let got = match (auth, &key) {
                (None, _) => null_peer(feed.publish, "SUB").and_then(|mut s| {
                    subscribe(&mut s, b"")?;
                    next_topic(&mut s, Duration::from_secs(30))?;
                    kept.push(Box::new(s) as Box<dyn std::any::Any>);
                    Ok(())
                }),
                (Some(_), Some(key)) => kvtier_events::curve::client::Subscriber::connect(
                    feed.publish,
                    token.as_bytes(),
                    key,
                )
                .and_then(|mut s| {
                    s.subscribe(b"")?;
                    s.next_message(1 << 20, Duration::from_secs(30))?;
                    kept.push(Box::new(s) as Box<dyn std::any::Any>);
                    Ok(())
                }),
                (Some(_), None) => plain_peer(feed.publish, token, "SUB").and_then(|mut s| {
                    subscribe(&mut s, b"")?;
                    next_topic(&mut s, Duration::from_secs(30))?;
                    kept.push(Box::new(s) as Box<dyn std::any::Any>);
                    Ok(())
                }),
            };
            match got {
                Ok(()) => admitted += 1,
                Err(e) => eprintln!("{auth:?}: a router was kept out: {e}"),
            }
        }
        eprintln!(
            "{}: {attackers} of 64 idle subscribers admitted; routers admitted: {admitted} of 3",
            auth.unwrap_or("none")
        );
        if admitted != 3 {
            kept_out.push(format!("{auth:?}: routers admitted: {admitted} of 3"));
        }
        drop(held);
    }
    assert!(kept_out.is_empty(), "{kept_out:#?}");
}

/// Issue 60, finding 4: bare connections to the replay port ended every
/// replay in progress (0 of 6, 0 of 27, 2 of 19 finished): any replay
/// peer was closed for a newcomer at the limit. Now a replay being
/// answered is never closed for a newcomer (only connections in their
/// handshake, or between requests, are), and replay peers hold slots of
/// `feed replays`, apart from the handshakes bare connections hold.
#[test]
fn bare_connections_never_end_a_replay_in_progress() {
    let dir = tempfile::tempdir().unwrap();
    let feed = start_feed(dir.path(), None, false);
    // Megabytes of kept batches: 60 000 keys of 250 bytes (more than the
    // kernel's socket buffers hold, so a replay takes seconds to read).
    let mut client = Client::connect_with(
        &feed.server.tcp_url(),
        kvtier_client::ClientOptions {
            namespace: "replayed".into(),
            ..options()
        },
    )
    .unwrap();
    for round in 0..60u32 {
        let keys: Vec<Vec<u8>> = (0..1000u32)
            .map(|i| {
                let mut k = format!("{round:04}-{i:06}-").into_bytes();
                k.resize(250, b'k');
                k
            })
            .collect();
        let values = vec![b"v"; keys.len()];
        client.batch_put(&keys, &values).unwrap();
    }
    // The batches are published within a second or so.
    std::thread::sleep(Duration::from_secs(2));
    let stop = Arc::new(AtomicBool::new(false));
    // The attacker: 64 bare connections, then a new one every 10 ms
    // (keeping its last 100 open).
    let attacker = {
        let (stop, addr) = (Arc::clone(&stop), feed.replay);
        std::thread::spawn(move || {
            let mut open = std::collections::VecDeque::new();
            for _ in 0..64 {
                open.extend(TcpStream::connect(addr).ok());
            }
            while !stop.load(Ordering::Acquire) {
                open.extend(TcpStream::connect(addr).ok());
                while open.len() > 100 {
                    open.pop_front();
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    // Six replays from the start, each read at about 2 MB/s.
    let replays: Vec<_> = (0..6)
        .map(|_| {
            let addr = feed.replay;
            std::thread::spawn(move || -> Result<usize, String> {
                let mut s = null_peer(addr, "DEALER").map_err(|e| format!("handshake: {e}"))?;
                let mut request = Vec::new();
                put_frame(&mut request, b"", true, false);
                put_frame(&mut request, &0u64.to_be_bytes(), false, false);
                s.write_all(&request).map_err(|e| e.to_string())?;
                s.set_read_timeout(Some(Duration::from_secs(60)))
                    .map_err(|e| e.to_string())?;
                let mut reader = Paced(&mut s, Instant::now(), 0);
                let mut batches = 0;
                loop {
                    let mut frames = Vec::new();
                    loop {
                        let (more, command, body) =
                            read_frame(&mut reader).map_err(|e| format!("after {batches}: {e}"))?;
                        if command {
                            continue;
                        }
                        frames.push(body);
                        if !more {
                            break;
                        }
                    }
                    if frames.len() == 4 && frames[2] == [0xff; 8] {
                        return Ok(batches);
                    }
                    batches += 1;
                }
            })
        })
        .collect();
    let results: Vec<Result<usize, String>> =
        replays.into_iter().map(|r| r.join().unwrap()).collect();
    stop.store(true, Ordering::Release);
    attacker.join().unwrap();
    let finished = results.iter().filter(|r| r.is_ok()).count();
    eprintln!("replays finished: {finished} of 6 ({results:?})");
    assert!(
        results.iter().all(|r| matches!(r, Ok(n) if *n > 10)),
        "replays beside bare connections: {results:?}"
    );
}

/// Reads at most about 2 MB a second.
struct Paced<'a>(&'a mut TcpStream, Instant, usize);

impl Read for Paced<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let allowed = (self.1.elapsed().as_secs_f64() * 2e6) as usize;
        if self.2 >= allowed {
            std::thread::sleep(Duration::from_millis(5));
        }
        let most = buf.len().min(16 << 10);
        let n = self.0.read(&mut buf[..most])?;
        self.2 += n;
        Ok(n)
    }
}

/// Issue 60, finding 5: a peer trickling its greeting a byte every 2 s
/// was reported still connected after 19 s (documented: 5 s for the whole
/// handshake). One deadline bounds the whole handshake, greeting and
/// commands, on both sockets and under every mechanism.
#[test]
fn a_trickled_handshake_ends_at_the_one_deadline() {
    for auth in [None, Some("plain"), Some("curve")] {
        let dir = tempfile::tempdir().unwrap();
        let feed = start_feed(dir.path(), auth, false);
        let mechanism: &[u8] = match auth {
            None => b"NULL",
            Some("plain") => b"PLAIN",
            _ => b"CURVE",
        };
        let tricklers: Vec<_> = [feed.publish, feed.replay]
            .into_iter()
            .map(|addr| {
                let mut bytes = greeting(mechanism).to_vec();
                if auth == Some("plain") {
                    bytes = plain_hello(TEST_TOKEN);
                }
                std::thread::spawn(move || -> Option<Duration> {
                    let mut s = TcpStream::connect(addr).unwrap();
                    s.set_read_timeout(Some(Duration::from_millis(100)))
                        .unwrap();
                    let started = Instant::now();
                    let mut buf = [0u8; 256];
                    for (i, byte) in bytes.iter().cycle().enumerate() {
                        if s.write_all(&[*byte]).is_err() {
                            return Some(started.elapsed());
                        }
                        // A byte every second, reading meanwhile.
                        while started.elapsed() < Duration::from_secs(i as u64 + 1) {
                            match s.read(&mut buf) {
                                Ok(0) => return Some(started.elapsed()),
                                Ok(_) => {}
                                Err(e)
                                    if matches!(
                                        e.kind(),
                                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                                    ) => {}
                                Err(_) => return Some(started.elapsed()),
                            }
                        }
                        if started.elapsed() > Duration::from_secs(20) {
                            return None;
                        }
                    }
                    None
                })
            })
            .collect();
        for (socket, t) in ["publish", "replay"].into_iter().zip(tricklers) {
            let closed = t.join().unwrap();
            eprintln!("{auth:?} {socket}: a trickler closed after {closed:?}");
            assert!(
                closed.is_some_and(|c| c < Duration::from_secs(12)),
                "{auth:?} {socket}: a trickling peer still connected after 20 s"
            );
        }
    }
}
