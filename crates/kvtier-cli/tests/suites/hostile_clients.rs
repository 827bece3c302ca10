//! The real `kvtier serve` binary against clients that flood, trickle,
//! hoard connections, lie about their shared memory or bring no token. In
//! every case the server must stay small and keep serving everyone else.

use crate::common::{hello_body, memfd, options, read_reply, ServerProcess, TEST_TOKEN};
use kvtier_client::{Client, ClientOptions};
use kvtier_wire::protocol::{Header, Op, Writer, HEADER_LEN};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

fn header(op: Op, id: u64, body_len: u32) -> [u8; HEADER_LEN] {
    Header {
        op: op as u16,
        request_id: id,
        body_len,
        status: 0,
    }
    .encode()
}

fn hello(stream: &mut (impl Read + Write)) {
    let body = hello_body(TEST_TOKEN, "");
    stream
        .write_all(&header(Op::Hello, 1, body.len() as u32))
        .unwrap();
    stream.write_all(&body).unwrap();
    assert_eq!(read_reply(stream).0, 0, "hello refused");
}

/// Whether the server closed `stream` within `limit`, while we keep
/// trickling a byte every `every`.
fn closed_while_trickling(stream: &mut TcpStream, every: Duration, limit: Duration) -> bool {
    stream.set_read_timeout(Some(every)).unwrap();
    let started = Instant::now();
    while started.elapsed() < limit {
        if stream.write_all(b"x").is_err() {
            return true;
        }
        let mut byte = [0u8; 256];
        match stream.read(&mut byte) {
            Ok(0) => return true,
            Ok(_) => {} // an error frame, then the close
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => return true,
        }
    }
    false
}

fn verified_round_trip(client: &mut Client, tag: &str) {
    let key = format!("bystander/{tag}").into_bytes();
    let value = kvtier::pattern::value(&key, 200_000);
    for r in client.batch_put(&[&key], &[&value]).unwrap() {
        r.unwrap();
    }
    let mut buf = vec![0u8; value.len()];
    let got = client.batch_get_into(&[&key], &mut [&mut buf[..]]).unwrap();
    assert_eq!(got[0].as_ref().unwrap(), &Some(value.len()));
    assert_eq!(buf, value, "the bystander read wrong bytes");
}

#[test]
fn an_unauthenticated_flood_leaves_memory_flat() {
    let dir = tempfile::tempdir().unwrap();
    // Room for the whole flood to wait for its hello: this test is about
    // memory (admission has its own tests).
    let server = ServerProcess::start(
        dir.path(),
        &[
            "--handshake-timeout",
            "30",
            "--max-pending-connections",
            "400",
            "--max-connections-per-address",
            "400",
        ],
    );
    let pid = server.child.id();
    let mut bystander = Client::connect_with(&server.tcp_url(), options()).unwrap();
    verified_round_trip(&mut bystander, "before");
    let before = rss_bytes(pid);
    let mut held = Vec::new();
    for i in 0..300u32 {
        let mut s = TcpStream::connect(&server.tcp).unwrap();
        // Half announce the largest frame a header can name, half the
        // largest a hello may be; neither sends the body.
        let len = if i % 2 == 0 { u32::MAX } else { 4096 };
        s.write_all(&header(Op::Hello, 1, len)).unwrap();
        s.write_all(b"partial").unwrap();
        held.push(s);
    }
    // Authenticated peers announcing 512 MiB and sending 64 KiB of it.
    for _ in 0..16 {
        let mut s = TcpStream::connect(&server.tcp).unwrap();
        hello(&mut s);
        s.write_all(&header(Op::BatchPut, 2, 512 << 20)).unwrap();
        s.write_all(&vec![0u8; 64 << 10]).unwrap();
        held.push(s);
    }
    std::thread::sleep(Duration::from_millis(500));
    verified_round_trip(&mut bystander, "during");
    let during = rss_bytes(pid);
    eprintln!(
        "server RSS before the flood {} MiB, during {} MiB ({} connections held)",
        before >> 20,
        during >> 20,
        held.len()
    );
    // Without bounds, each of these would have cost the announced length
    // (hundreds of GiB together); threads and 64 KiB first chunks cost a
    // few tens of MiB.
    assert!(
        during < before + (96 << 20),
        "RSS grew from {before} to {during} bytes under an unauthenticated flood"
    );
    let stats = server.stats();
    assert!(
        stats["server"]["protocol_errors"].as_u64().unwrap() >= 150,
        "{stats}"
    );
    drop(held);
}

#[test]
fn the_connection_cap_refuses_the_excess_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(dir.path(), &["--max-connections", "4"]);
    let mut clients: Vec<Client> = (0..4)
        .map(|_| Client::connect_with(&server.unix_url(), options()).unwrap())
        .collect();
    let err = Client::connect_with(&server.tcp_url(), options()).unwrap_err();
    assert!(err.to_string().contains("max_connections"), "{err}");
    clients.pop();
    let mut again = None;
    for _ in 0..100 {
        if let Ok(c) = Client::connect_with(&server.tcp_url(), options()) {
            again = Some(c);
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    verified_round_trip(again.as_mut().expect("a slot came free"), "after-cap");
    assert!(
        server.stats()["server"]["connections_refused"]
            .as_u64()
            .unwrap()
            >= 1
    );
}

#[test]
fn trickling_clients_are_dropped_on_schedule() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("serve.toml");
    std::fs::write(&config, "min_frame_rate = \"64MiB\"\nadmin_timeout = 1.0\n").unwrap();
    let data = dir.path().join("data");
    let server = ServerProcess::start(
        &data,
        &[
            "--handshake-timeout",
            "1",
            "--frame-timeout",
            "1",
            "--config",
            config.to_str().unwrap(),
        ],
    );
    let mut bystander = Client::connect_with(&server.unix_url(), options()).unwrap();
    // Before hello: a byte every 200 ms never completes a hello.
    let mut pre = TcpStream::connect(&server.tcp).unwrap();
    // After hello: a 64 MiB frame sent a byte at a time gets 1 s plus
    // 1 s of rate allowance (64 MiB at 64 MiB/s).
    let mut post = TcpStream::connect(&server.tcp).unwrap();
    hello(&mut post);
    post.write_all(&header(Op::BatchPut, 2, 64 << 20)).unwrap();
    // Admin: 50 clients trickling a request head.
    let mut admins: Vec<TcpStream> = (0..50)
        .map(|_| {
            let mut s = TcpStream::connect(&server.admin).unwrap();
            s.write_all(b"GET /hea").unwrap();
            s
        })
        .collect();
    let health_started = Instant::now();
    let health = server.http("/health");
    let health_took = health_started.elapsed();
    assert!(health.ends_with("ok\n"), "{health}");
    eprintln!("/health answered in {health_took:?} beside 50 trickling admin clients");
    // The bound (#15): slow admin clients may not delay /health by
    // a second. Generous on purpose: on an idle loopback it takes ~1 ms.
    assert!(
        health_took < Duration::from_secs(1),
        "/health took {health_took:?} beside 50 trickling admin clients"
    );
    verified_round_trip(&mut bystander, "trickle");
    let every = Duration::from_millis(200);
    let limit = Duration::from_secs(8);
    assert!(
        closed_while_trickling(&mut pre, every, limit),
        "pre-hello trickler kept"
    );
    assert!(
        closed_while_trickling(&mut post, every, limit),
        "frame trickler kept"
    );
    for admin in admins.iter_mut().take(3) {
        assert!(
            closed_while_trickling(admin, every, limit),
            "admin trickler kept"
        );
    }
    let stats = server.stats();
    let timed_out = stats["server"]["connections_timed_out"].as_u64().unwrap();
    let malformed = stats["server"]["protocol_errors"].as_u64().unwrap();
    // The frame trickler sends payload bytes: only its deadline drops it.
    // The pre-hello one is dropped by its deadline too, unless the machine
    // stalls the server for the ~5 s its trickled bytes take to fill a
    // 24-byte header (CI once did, every test running beside it): then it is
    // dropped as a malformed hello. Dropped either way, and counted.
    assert!(timed_out >= 1 && timed_out + malformed >= 2, "{stats}");
    verified_round_trip(&mut bystander, "after-trickle");
}

/// A raw Unix-socket session for sending descriptors the Rust client never
/// would.
struct RawUnix(UnixStream);

impl RawUnix {
    fn connect(path: &str) -> RawUnix {
        let mut s = UnixStream::connect(path).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        hello(&mut s);
        RawUnix(s)
    }

    fn register(&mut self, size: u64, fd: Option<&OwnedFd>) -> (i32, String) {
        let mut w = Writer::default();
        w.u64(size);
        let mut frame = header(Op::RegisterBuffer, 3, 8).to_vec();
        frame.extend_from_slice(&w.buf);
        match fd {
            Some(fd) => kvtier_wire::shm::send_with_fd(&self.0, &frame, fd.as_raw_fd()).unwrap(),
            None => self.0.write_all(&frame).unwrap(),
        }
        let (status, body) = read_reply(&mut self.0);
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    /// Registers `fd` (sealed, `size` bytes) and returns its buffer id.
    fn register_id(&mut self, size: u64, fd: &OwnedFd) -> u32 {
        let mut w = Writer::default();
        w.u64(size);
        let mut frame = header(Op::RegisterBuffer, 3, 8).to_vec();
        frame.extend_from_slice(&w.buf);
        kvtier_wire::shm::send_with_fd(&self.0, &frame, fd.as_raw_fd()).unwrap();
        let (status, body) = read_reply(&mut self.0);
        assert_eq!(status, 0, "{}", String::from_utf8_lossy(&body));
        u32::from_le_bytes(body[..4].try_into().unwrap())
    }
}

/// Issue 39, finding 7: the largest segment frame the limits allow (4,096
/// keys of 4,096 ranges: 256 MiB of ranges) costs the server at most 1.5x
/// its size, for a get (whose ranges are checked disjoint) and a put alike,
/// where it cost 3.9x (the ranges decoded, copied for the check, and again
/// as pointers). The values make the round trip through the ranges.
#[test]
fn the_largest_segment_frame_costs_the_server_little_more_than_itself() {
    use std::os::unix::fs::FileExt;
    const KEYS: u64 = 4096;
    const RANGES: u64 = kvtier_wire::protocol::MAX_SEGMENTS as u64;
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(dir.path(), &[]);
    let pid = server.child.id();
    let mut raw = RawUnix::connect(&server.unix);
    // One byte a range: range j of key k at j * KEYS + k (every key's
    // ranges spread over the whole buffer, interleaved with the others').
    let buffer_len = KEYS * RANGES;
    let sealed = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
    let memfd = memfd(buffer_len as i64, sealed);
    let buffer = std::fs::File::from(memfd.try_clone().unwrap());
    let pattern: Vec<u8> = (0..buffer_len).map(|i| (i * 7 + (i >> 13)) as u8).collect();
    buffer.write_all_at(&pattern, 0).unwrap();
    let id = raw.register_id(buffer_len, &memfd);
    let frame = |op: Op, request: u64| {
        let mut w = Writer::default();
        w.u32(id);
        if op == Op::BatchPutShmSegments {
            w.u8(0);
        }
        w.u32(KEYS as u32);
        for k in 0..KEYS {
            w.key(format!("segments/{k}").as_bytes()).u32(RANGES as u32);
            for j in 0..RANGES {
                w.u64(j * KEYS + k).u64(1);
            }
        }
        let mut frame = header(op, request, w.buf.len() as u32).to_vec();
        frame.extend_from_slice(&w.buf);
        frame
    };
    let get = frame(Op::BatchGetShmSegments, 10);
    let put = frame(Op::BatchPutShmSegments, 11);
    let frame_len = get.len() as u64;
    assert!(frame_len > 256 << 20, "{frame_len}");
    raw.0
        .set_read_timeout(Some(Duration::from_secs(300)))
        .unwrap();
    let before = peak_rss_bytes(pid);
    // Gets of absent keys (the ranges checked, nothing found), the put,
    // then the gets again into a zeroed buffer.
    raw.0.write_all(&get).unwrap();
    assert_eq!(read_reply(&mut raw.0).0, 0);
    raw.0.write_all(&put).unwrap();
    let (status, body) = read_reply(&mut raw.0);
    assert_eq!(status, 0, "{}", String::from_utf8_lossy(&body));
    buffer
        .write_all_at(&vec![0u8; buffer_len as usize], 0)
        .unwrap();
    raw.0.write_all(&get).unwrap();
    assert_eq!(read_reply(&mut raw.0).0, 0);
    let after = peak_rss_bytes(pid);
    let mut back = vec![0u8; buffer_len as usize];
    buffer.read_exact_at(&mut back, 0).unwrap();
    assert!(
        back == pattern,
        "the values did not make the round trip through the ranges"
    );
    let grown = after.saturating_sub(before);
    eprintln!(
        "a {} MiB segment frame: the server's peak RSS grew {} MiB ({:.2}x the frame)",
        frame_len >> 20,
        grown >> 20,
        grown as f64 / frame_len as f64
    );
    // The frame itself, half of it again, and the values stored (16 MiB)
    // with the index and pool pages they touch.
    assert!(
        grown <= frame_len * 3 / 2 + (64 << 20),
        "a segment frame of {frame_len} bytes grew the server by {grown} bytes"
    );
}

#[test]
fn shared_buffers_must_be_sealed_memfds() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(dir.path(), &[]);
    let mut bystander = Client::connect_with(&server.unix_url(), options()).unwrap();
    let mut raw = RawUnix::connect(&server.unix);
    let sealed = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;

    let file = std::fs::File::create(dir.path().join("plain-file")).unwrap();
    file.set_len(1 << 20).unwrap();
    let (status, message) = raw.register(1 << 20, Some(&OwnedFd::from(file)));
    assert_ne!(status, 0);
    assert!(message.contains("not a sealable memfd"), "{message}");

    let (status, message) = raw.register(1 << 20, Some(&memfd(1 << 20, 0)));
    assert_ne!(status, 0);
    assert!(message.contains("not sealed"), "{message}");

    let (status, message) = raw.register(1 << 20, Some(&memfd(1 << 20, libc::F_SEAL_SHRINK)));
    assert_ne!(status, 0, "a memfd that can still grow: {message}");

    let (status, message) = raw.register(4 << 20, Some(&memfd(1 << 20, sealed)));
    assert_ne!(status, 0);
    assert!(message.contains("not the"), "{message}");

    let (status, _) = raw.register(1 << 20, None);
    assert_ne!(status, 0, "a register with no descriptor");

    // A good one, which the client then tries to shrink and grow (the
    // seals refuse), and closes: the server's mapping stays valid.
    let good = memfd(1 << 20, sealed);
    let (status, message) = raw.register(1 << 20, Some(&good));
    assert_eq!(status, 0, "{message}");
    // SAFETY: ftruncate on our own descriptor; both must fail.
    unsafe {
        assert_ne!(libc::ftruncate(good.as_raw_fd(), 4096), 0);
        assert_ne!(libc::ftruncate(good.as_raw_fd(), 8 << 20), 0);
    }
    drop(good);
    // A get into the closed client's buffer still lands safely.
    let mut w = Writer::default();
    w.u32(1).u32(1).key(b"bystander/shm").u64(0).u64(1 << 20);
    let mut frame = header(Op::BatchGetShm, 4, w.buf.len() as u32).to_vec();
    frame.extend_from_slice(&w.buf);
    raw.0.write_all(&frame).unwrap();
    assert_eq!(read_reply(&mut raw.0).0, 0);
    verified_round_trip(&mut bystander, "shm");
    let stats = server.stats();
    assert!(
        stats["server"]["buffers_refused"].as_u64().unwrap() >= 5,
        "{stats}"
    );
}

#[test]
fn loopback_tcp_without_credentials_is_refused_by_default() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(dir.path(), &["--generated-token"]);
    let token_path = dir.path().join("auth-token");
    let token = std::fs::read_to_string(&token_path)
        .unwrap()
        .trim()
        .to_string();
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&token_path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "the generated token is private");
    let anonymous = ClientOptions {
        auth_token: None,
        ..ClientOptions::default()
    };
    let err = Client::connect_with(&server.tcp_url(), anonymous).unwrap_err();
    assert!(err.to_string().contains("unauthorized"), "{err}");
    let with_token = ClientOptions {
        auth_token: Some(token),
        ..ClientOptions::default()
    };
    let mut client = Client::connect_with(&server.tcp_url(), with_token).unwrap();
    verified_round_trip(&mut client, "token");
}

/// The server's peak resident memory so far (VmHWM).
fn peak_rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

#[test]
fn reply_staging_follows_the_data_not_the_request() {
    let dir = tempfile::tempdir().unwrap();
    let big = kvtier::pattern::value(b"staged/big", 256 << 10);
    {
        let server = ServerProcess::start(dir.path(), &[]);
        let mut client = Client::connect_with(&server.tcp_url(), options()).unwrap();
        client.batch_put(&[b"staged/big"], &[&big]).unwrap()[0]
            .as_ref()
            .unwrap();
        client.flush().unwrap();
    }
    // After a restart the value is on disk only: gets of it are staged.
    let server = ServerProcess::start(dir.path(), &[]);
    let pid = server.child.id();
    let mut bystander = Client::connect_with(&server.tcp_url(), options()).unwrap();
    verified_round_trip(&mut bystander, "before-staging");
    let before = peak_rss_bytes(pid);
    let get_frame = |items: &mut dyn Iterator<Item = (Vec<u8>, u64)>, count: u32| {
        let mut w = Writer::default();
        w.u32(count);
        for (key, capacity) in items {
            w.key(&key).u64(capacity);
        }
        let mut frame = header(Op::BatchGet, 2, w.buf.len() as u32).to_vec();
        frame.extend_from_slice(&w.buf);
        frame
    };
    std::thread::scope(|scope| {
        // 48 connections, each naming 4,096 keys that are not there.
        for c in 0..48 {
            let (server, get_frame) = (&server, &get_frame);
            scope.spawn(move || {
                let mut s = TcpStream::connect(&server.tcp).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
                hello(&mut s);
                let frame = get_frame(
                    &mut (0..4096u32).map(|k| (format!("absent/{c}/{k}").into_bytes(), 1 << 20)),
                    4096,
                );
                s.write_all(&frame).unwrap();
                let (status, _) = read_reply(&mut s);
                assert_eq!(status, 0);
            });
        }
        // 2 connections naming the one disk value 4,000 times each.
        for _ in 0..2 {
            let (server, get_frame, big) = (&server, &get_frame, &big);
            scope.spawn(move || {
                let mut s = TcpStream::connect(&server.tcp).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
                hello(&mut s);
                let frame = get_frame(
                    &mut (0..4000).map(|_| (b"staged/big".to_vec(), big.len() as u64)),
                    4000,
                );
                s.write_all(&frame).unwrap();
                let (status, body) = read_reply(&mut s);
                assert_eq!(status, 0);
                // The table, then the value 4,000 times: check the last.
                assert_eq!(&body[body.len() - big.len()..], &big[..]);
            });
        }
    });
    let after = peak_rss_bytes(pid);
    eprintln!(
        "server peak RSS before {} MiB, after the staging attacks {} MiB",
        before >> 20,
        after >> 20
    );
    verified_round_trip(&mut bystander, "after-staging");
    assert!(
        after < before + (256 << 20),
        "staging grew the server's peak RSS from {before} to {after} bytes"
    );
}

#[test]
fn announced_put_values_pin_at_most_their_share_of_the_pool() {
    let dir = tempfile::tempdir().unwrap();
    // A 64 MiB pool: unfinished values may pin half of it.
    let server = ServerProcess::start(dir.path(), &[]);
    let victim_options = ClientOptions {
        namespace: "victim".into(),
        ..options()
    };
    let mut victim = Client::connect_with(&server.tcp_url(), victim_options).unwrap();
    let keys: Vec<Vec<u8>> = (0..24)
        .map(|i| format!("victim/{i}").into_bytes())
        .collect();
    for key in &keys {
        let value = kvtier::pattern::value(key, 1 << 20);
        victim.batch_put(&[key], &[&value]).unwrap()[0]
            .as_ref()
            .unwrap();
    }
    victim.flush().unwrap();
    // 14 authenticated connections each announce a 4 MiB value and send
    // 787 bytes of it.
    let mut held = Vec::new();
    for c in 0..14 {
        let mut s = TcpStream::connect(&server.tcp).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        hello(&mut s);
        let key = format!("pinning/{c}").into_bytes();
        let mut w = Writer::default();
        w.u8(0).u32(1).key(&key).u64(4 << 20);
        let body_len = w.buf.len() as u32 + (4 << 20);
        s.write_all(&header(Op::BatchPut, 2, body_len)).unwrap();
        s.write_all(&w.buf).unwrap();
        s.write_all(&[7u8; 787]).unwrap();
        held.push(s);
    }
    std::thread::sleep(Duration::from_millis(500));
    let before = server.stats()["store"].clone();
    let mut buf = vec![0u8; 1 << 20];
    for key in &keys {
        let got = victim.batch_get_into(&[key], &mut [&mut buf[..]]).unwrap();
        assert_eq!(got[0].as_ref().unwrap(), &Some(1 << 20));
        assert!(kvtier::pattern::verify(key, &buf));
    }
    let after = server.stats()["store"].clone();
    let memory = after["memory_hits"].as_u64().unwrap() - before["memory_hits"].as_u64().unwrap();
    let disk = after["disk_hits"].as_u64().unwrap() - before["disk_hits"].as_u64().unwrap();
    eprintln!("victim reads while values were pinned: {memory} from memory, {disk} from disk");
    assert_eq!(
        memory, 24,
        "announced values evicted committed ones ({disk} read from disk)"
    );
    // A put while the share is pinned waits a bounded time and is told
    // so (one token's clients are not told apart yet: per-tenant shares
    // are what would keep it flowing), and goes through once the
    // announcers are gone.
    let value = kvtier::pattern::value(b"victim/new", 4 << 20);
    let started = std::time::Instant::now();
    let during = victim.batch_put(&[b"victim/new"], &[&value]).unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    if let Err(e) = &during[0] {
        assert!(e.to_string().contains("no space"), "{e}");
    }
    drop(held);
    std::thread::sleep(Duration::from_millis(300));
    victim.batch_put(&[b"victim/new"], &[&value]).unwrap()[0]
        .as_ref()
        .expect("a put once the announcers are gone");
}

/// Bodies of buffered requests grow out of one server-wide budget as their
/// bytes arrive: connections holding big frames one byte short hold at
/// most the budget together, the rest wait, then are answered LIMIT (the
/// body read and dropped, the connection still usable), and small
/// requests of other clients are served throughout.
#[test]
fn request_bodies_come_out_of_one_buffer_budget() {
    const FRAME: usize = 60 << 20;
    let dir = tempfile::tempdir().unwrap();
    let config = crate::common::small_buffer_config(dir.path());
    let server = ServerProcess::start(
        &dir.path().join("data"),
        &["--config", config.to_str().unwrap()],
    );
    let pid = server.child.id();
    let mut bystander = Client::connect_with(&server.tcp_url(), options()).unwrap();
    verified_round_trip(&mut bystander, "before-bodies");
    let before = rss_bytes(pid);
    // Six connections, each sending a 60 MiB BatchExists body but its last
    // byte (360 MiB announced and sent).
    let mut held: Vec<TcpStream> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..6)
            .map(|_| {
                let server = &server;
                scope.spawn(move || {
                    let mut s = TcpStream::connect(&server.tcp).unwrap();
                    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
                    hello(&mut s);
                    crate::common::send_all_but_last_byte(&mut s, Op::BatchExists, FRAME);
                    s
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // Give the server time to take in what it was sent.
    std::thread::sleep(Duration::from_secs(3));
    let during = rss_bytes(pid);
    eprintln!(
        "server RSS before {} MiB, with 6 x 60 MiB bodies one byte short {} MiB",
        before >> 20,
        during >> 20
    );
    verified_round_trip(&mut bystander, "during-bodies");
    assert!(
        during < before + (128 << 20) + (32 << 20),
        "six unfinished bodies grew the server's RSS from {before} to {during} bytes \
         (the budget is 128 MiB)"
    );
    // Finish the frames: two fit the budget and are answered (a malformed
    // body: PROTOCOL, closed); the others were refused LIMIT and keep
    // their connection.
    let mut limited = 0;
    for s in &mut held {
        s.write_all(&[0]).unwrap();
        let (status, body) = read_reply(s);
        if status == kvtier_wire::protocol::code::LIMIT {
            limited += 1;
            assert!(String::from_utf8_lossy(&body).contains("max_buffer_bytes"));
            // Still in step: a small request is answered.
            s.write_all(&header(Op::Flush, 3, 0)).unwrap();
            assert_eq!(read_reply(s).0, 0);
        }
    }
    assert!(limited >= 3, "only {limited} of 6 bodies were refused");
    let refused = server.stats()["server"]["requests_refused_for_memory"]
        .as_u64()
        .unwrap();
    assert!(refused >= 3, "{refused}");
}
