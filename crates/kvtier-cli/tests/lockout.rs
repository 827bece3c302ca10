//! Lockout attempts against the real `kvtier serve` binary: idle sockets
//! that never say hello, and idle admin connections, must not keep trusted
//! clients or a liveness probe out. Loopback only; every loop is bounded.

mod common;

use common::{options, ServerProcess};
use kvtier_client::{Client, ClientOptions};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Lets this test process hold more sockets than the usual soft limit.
fn raise_open_files() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: get/setrlimit on this process with a valid struct.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit);
        limit.rlim_cur = limit.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
    }
}

fn round_trip(client: &mut Client, tag: &str) {
    let key = format!("trusted/{tag}").into_bytes();
    let value = kvtier::internals::pattern::value(&key, 100_000);
    client.batch_put(&[&key], &[&value]).unwrap()[0]
        .as_ref()
        .unwrap();
    let mut buf = vec![0u8; value.len()];
    let got = client.batch_get_into(&[&key], &mut [&mut buf[..]]).unwrap();
    assert_eq!(got[0].as_ref().unwrap(), &Some(value.len()));
    assert_eq!(buf, value);
}

#[test]
fn idle_unauthenticated_sockets_do_not_lock_out_trusted_clients() {
    raise_open_files();
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(dir.path(), &[]);
    // 1,100 TCP connections that never say hello: more than the server's
    // whole connection cap.
    let flood = Instant::now();
    let mut idle = Vec::new();
    for _ in 0..1100 {
        match TcpStream::connect(&server.tcp) {
            Ok(s) => idle.push(s),
            Err(e) => panic!("connect: {e}"),
        }
    }
    eprintln!("connected 1,100 idle sockets in {:?}", flood.elapsed());
    std::thread::sleep(Duration::from_millis(300));
    // 48 trusted Unix-socket clients (the server's own user), each to be
    // served within 2 s.
    let mut served = 0;
    let mut clients = Vec::new();
    for i in 0..48 {
        let started = Instant::now();
        // A small shared buffer each (the default is 256 MiB, prefaulted).
        let small = ClientOptions {
            shm_size: 4 << 20,
            ..options()
        };
        let result = Client::connect_with(&server.unix_url(), small).map(|mut c| {
            round_trip(&mut c, &i.to_string());
            c
        });
        match result {
            Ok(c) if started.elapsed() < Duration::from_secs(2) => {
                served += 1;
                clients.push(c);
            }
            Ok(_) => eprintln!("client {i} served after {:?}", started.elapsed()),
            Err(e) => eprintln!("client {i} refused: {e}"),
        }
    }
    let stats = server.stats();
    eprintln!(
        "trusted clients served within 2 s: {served} of 48; connections refused {}",
        stats["server"]["connections_refused"]
    );
    assert_eq!(
        served, 48,
        "idle unauthenticated sockets locked trusted clients out"
    );
    assert!(
        stats["server"]["lobby_closed"].as_u64().unwrap() > 0,
        "the flood was not capped at all"
    );
    drop(idle);
}

/// Issue 39, finding 2: idle sockets from the clients' own address,
/// reopened as fast as the server closes them, used to hold every slot
/// for connections waiting for their hello (a TCP client with the token
/// got in 0 of 46 times). They wait in the lobby now, holding nothing but
/// their socket, and the oldest makes room for a newcomer: every TCP
/// client is served.
#[test]
fn reopened_idle_sockets_from_the_clients_address_never_lock_a_tcp_client_out() {
    raise_open_files();
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(dir.path(), &[]);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // 300 silent sockets (more than one address may keep in the lobby),
    // each reopened as soon as the server closes it.
    let (holding, held) = std::sync::mpsc::channel();
    let attacker = {
        let (stop, addr) = (std::sync::Arc::clone(&stop), server.tcp.clone());
        std::thread::spawn(move || {
            let mut sockets: Vec<TcpStream> = (0..300)
                .filter_map(|_| TcpStream::connect(&addr).ok())
                .collect();
            for s in &sockets {
                s.set_nonblocking(true).unwrap();
            }
            holding.send(sockets.len()).unwrap();
            let mut reopened = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for s in sockets.iter_mut() {
                    let mut byte = [0u8; 1];
                    let closed = match s.read(&mut byte) {
                        Ok(_) => true,
                        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
                    };
                    if closed {
                        if let Ok(fresh) = TcpStream::connect(&addr) {
                            fresh.set_nonblocking(true).unwrap();
                            *s = fresh;
                            reopened += 1;
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            reopened
        })
    };
    let opened = held.recv().unwrap();
    // Until the server has taken them all in (a full accept queue makes
    // the last connects wait for the kernel's retry).
    let started = Instant::now();
    while server.stats()["server"]["lobby_waiting"].as_u64().unwrap() < 256 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the attack never reached the server"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let (mut served, mut slowest) = (0, Duration::ZERO);
    for i in 0..46 {
        let started = Instant::now();
        let small = ClientOptions {
            shm_size: 0,
            ..options()
        };
        match Client::connect_with(&server.tcp_url(), small) {
            Ok(mut c) => {
                round_trip(&mut c, &format!("tcp-{i}"));
                served += 1;
                slowest = slowest.max(started.elapsed());
            }
            Err(e) => eprintln!("TCP client {i} refused: {e}"),
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let reopened = attacker.join().unwrap();
    let stats = server.stats();
    eprintln!(
        "TCP clients served: {served} of 46 (slowest {slowest:?}); attacker sockets {opened}, reopened {reopened}; \
         lobby closed {}, connections refused {}",
        stats["server"]["lobby_closed"], stats["server"]["connections_refused"]
    );
    assert_eq!(served, 46, "reopened idle sockets locked a TCP client out");
    assert!(
        stats["server"]["lobby_closed"].as_u64().unwrap() > 0,
        "the attack never filled the lobby: the test would prove nothing"
    );
}

#[test]
fn idle_admin_sockets_do_not_fail_health_probes() {
    raise_open_files();
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(dir.path(), &[]);
    // More idle admin connections than the admin cap (256), none sending
    // a request.
    let mut idle = Vec::new();
    for _ in 0..300 {
        idle.push(TcpStream::connect(&server.admin).unwrap());
    }
    std::thread::sleep(Duration::from_millis(300));
    let mut healthy = 0;
    for _ in 0..60 {
        let started = Instant::now();
        let answer = (|| -> std::io::Result<String> {
            let mut s = TcpStream::connect(&server.admin)?;
            s.set_read_timeout(Some(Duration::from_secs(2)))?;
            s.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")?;
            let mut text = String::new();
            s.read_to_string(&mut text)?;
            Ok(text)
        })();
        match answer {
            Ok(text)
                if text.starts_with("HTTP/1.1 200")
                    && started.elapsed() < Duration::from_secs(2) =>
            {
                healthy += 1
            }
            Ok(text) => eprintln!("probe: {:?}", text.lines().next()),
            Err(e) => eprintln!("probe failed: {e}"),
        }
    }
    eprintln!("health probes answered 200 within 2 s: {healthy} of 60");
    assert_eq!(healthy, 60, "idle admin sockets made /health fail");
    drop(idle);
}

#[test]
fn the_admin_port_answers_only_loopback_host_names() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(dir.path(), &[]);
    let ask = |host: &str| {
        server.http_request(&format!(
            "GET /stats HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
        ))
    };
    for host in ["127.0.0.1", "localhost", "[::1]:9", "localhost:7701"] {
        let port_host = host.to_string();
        assert!(ask(&port_host).starts_with("HTTP/1.1 200"), "{host}");
    }
    // A page of another origin that resolves its name to 127.0.0.1 (DNS
    // rebinding) sends its own name.
    let answer = ask("attacker.example:7701");
    assert!(answer.starts_with("HTTP/1.1 421"), "{answer}");
}

#[test]
fn token_guesses_are_capped_server_wide_however_many_connections_guess() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(dir.path(), &[]);
    let stop = Instant::now() + Duration::from_secs(3);
    let refused = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|scope| {
        for guesser in 0..40 {
            let (server, refused) = (&server, &refused);
            scope.spawn(move || {
                while Instant::now() < stop {
                    let Ok(mut s) = TcpStream::connect(&server.tcp) else {
                        continue;
                    };
                    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
                    let body = common::hello_body(&format!("guess-{guesser}-0123456789abcdef"), "");
                    let frame = common::frame(kvtier_wire::protocol::Op::Hello, 1, &body);
                    if s.write_all(&frame).is_err() {
                        continue;
                    }
                    let mut head = [0u8; kvtier_wire::protocol::HEADER_LEN];
                    if s.read_exact(&mut head).is_ok() && Instant::now() < stop {
                        let status = i32::from_le_bytes(head[20..24].try_into().unwrap());
                        if status == kvtier_wire::protocol::code::UNAUTHORIZED {
                            refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                }
            });
        }
    });
    let guesses = refused.into_inner();
    eprintln!("wrong tokens answered in 3 s by 40 parallel guessers: {guesses}");
    // 10 a second (the default), plus a second's burst.
    assert!(guesses <= 45, "{guesses} guesses answered in 3 s");
    assert!(guesses > 0, "no guess was answered at all");
    // The right token still gets in.
    let mut client = Client::connect_with(&server.tcp_url(), options()).unwrap();
    round_trip(&mut client, "after-guessing");
}
