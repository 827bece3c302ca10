//! The real `kvtier serve` binary under load, abuse and crashes, driven by
//! the Rust client over TCP and the Unix socket.

use crate::common::{frame, hello_body, options, ServerProcess, TEST_TOKEN};
use kvtier::test_util::Dice;
use kvtier_client::{Client, ClientOptions};
use kvtier_wire::protocol::{Header, Op, Writer};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn value_for(key: &[u8], len: usize) -> Vec<u8> {
    kvtier::pattern::value(key, len)
}

fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn many_clients_mixed_verified_operations() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(dir.path(), &[]);
    let threads: Vec<_> = (0..32)
        .map(|t| {
            let url = if t % 2 == 0 {
                server.tcp_url()
            } else {
                server.unix_url()
            };
            std::thread::spawn(move || {
                let options = ClientOptions {
                    shm_size: 4 << 20,
                    ..options()
                };
                let mut client = Client::connect_with(&url, options).unwrap();
                let keys: Vec<Vec<u8>> = (0..12)
                    .map(|i| format!("client-{t}/block-{i}").into_bytes())
                    .collect();
                let values: Vec<Vec<u8>> = keys
                    .iter()
                    .enumerate()
                    .map(|(i, k)| value_for(k, 4096 * (i + 1) + 17))
                    .collect();
                for result in client.batch_put(&keys, &values).unwrap() {
                    result.unwrap();
                }
                assert_eq!(client.prefix_len(&keys).unwrap(), 12);
                let mut bufs: Vec<Vec<u8>> = values.iter().map(|v| vec![0u8; v.len()]).collect();
                let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
                let got = client.batch_get_into(&keys, &mut slices).unwrap();
                for ((result, buf), value) in got.iter().zip(&bufs).zip(&values) {
                    assert_eq!(result.as_ref().unwrap(), &Some(value.len()));
                    assert_eq!(buf, value);
                }
                if t % 2 == 1 {
                    // Through the registered buffer: put from it, get into it.
                    let shm = client.registered_buffer().unwrap();
                    shm[..values[0].len()].copy_from_slice(&values[0]);
                    let key = format!("client-{t}/shm").into_bytes();
                    let put = client
                        .batch_put_registered(
                            &[&key],
                            &[(0, values[0].len() as u64)],
                            &Default::default(),
                        )
                        .unwrap();
                    put[0].as_ref().unwrap();
                    let got = client
                        .batch_get_registered(
                            &[&key, &keys[3]],
                            &[(1 << 20, 1 << 20), (2 << 20, 1 << 20)],
                        )
                        .unwrap();
                    assert_eq!(got[0].as_ref().unwrap(), &Some(values[0].len()));
                    assert_eq!(got[1].as_ref().unwrap(), &Some(values[3].len()));
                    let shm = client.registered_buffer().unwrap();
                    assert_eq!(&shm[1 << 20..(1 << 20) + values[0].len()], &values[0][..]);
                    assert_eq!(&shm[2 << 20..(2 << 20) + values[3].len()], &values[3][..]);
                }
                assert!(client.remove(&keys[5]).unwrap());
                let exists = client.batch_exists(&keys).unwrap();
                assert_eq!(exists.iter().filter(|&&e| e).count(), 11);
                assert!(!exists[5]);
                assert_eq!(client.prefix_len(&keys).unwrap(), 5);
                let mut small = [0u8; 8];
                let got = client
                    .batch_get_into(
                        &[&keys[0], &keys[5]],
                        &mut [&mut small[..], &mut [0u8; 8][..]],
                    )
                    .unwrap();
                assert_eq!(
                    got[0].as_ref().unwrap_err().kind(),
                    kvtier::ErrorKind::BufferTooSmall
                );
                assert_eq!(got[1].as_ref().unwrap(), &None);
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let mut client = Client::connect_with(&server.tcp_url(), options()).unwrap();
    client.flush().unwrap();
    let stats = client.stats().unwrap();
    assert_eq!(stats["store"]["entries"], 32 * 11 + 16);
    let metrics = server.http("/metrics");
    assert!(
        metrics.contains("kvtier_requests_total{op=\"batch_put\"}"),
        "{metrics}"
    );
    assert!(server.http("/health").ends_with("ok\n"));
    assert!(server.http("/nope").starts_with("HTTP/1.1 404"));
    // The Unix socket is private to the user.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&server.unix)
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
}

#[test]
fn garbage_frames_close_only_their_connection() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(dir.path(), &[]);
    let mut good = Client::connect_with(&server.tcp_url(), options()).unwrap();
    good.batch_put(&[b"keep"], &[value_for(b"keep", 10_000)])
        .unwrap()[0]
        .as_ref()
        .unwrap();

    let mut dice = Dice::new(0x1234_5678_9abc_def0);
    let mut next = || dice.roll();
    let hello = {
        let body = hello_body(TEST_TOKEN, "");
        let mut frame = Header {
            op: Op::Hello as u16,
            request_id: 1,
            body_len: body.len() as u32,
            status: 0,
        }
        .encode()
        .to_vec();
        frame.extend_from_slice(&body);
        frame
    };
    for round in 0..60 {
        let mut stream = TcpStream::connect(&server.tcp).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let payload: Vec<u8> = match round % 6 {
            // Pure noise.
            0 => (0..(next() % 4096)).map(|_| next() as u8).collect(),
            // A valid magic with a random header.
            1 => {
                let mut p = b"KVTP".to_vec();
                p.extend((0..20).map(|_| next() as u8));
                p
            }
            // Hello, then a frame claiming a huge body.
            2 => {
                let mut p = hello.clone();
                p.extend_from_slice(
                    &Header {
                        op: 2,
                        request_id: 2,
                        body_len: u32::MAX,
                        status: 0,
                    }
                    .encode(),
                );
                p
            }
            // Hello, then a batch put whose counts lie.
            3 => {
                let mut p = hello.clone();
                let mut w = Writer::default();
                w.u8(0).u32(3).key(b"x").u64(1 << 40);
                p.extend_from_slice(
                    &Header {
                        op: 2,
                        request_id: 2,
                        body_len: w.buf.len() as u32,
                        status: 0,
                    }
                    .encode(),
                );
                p.extend_from_slice(&w.buf);
                p
            }
            // A request before hello.
            4 => Header {
                op: Op::Flush as u16,
                request_id: 9,
                body_len: 0,
                status: 0,
            }
            .encode()
            .to_vec(),
            // Hello, then a truncated frame and a hang-up.
            _ => {
                let mut p = hello.clone();
                p.extend_from_slice(
                    &Header {
                        op: 4,
                        request_id: 3,
                        body_len: 1000,
                        status: 0,
                    }
                    .encode(),
                );
                p.extend((0..100).map(|_| next() as u8));
                p
            }
        };
        let _ = stream.write_all(&payload);
        let _ = stream.shutdown(std::net::Shutdown::Write);
        // The server answers with an error and closes, or just closes.
        let mut sink = Vec::new();
        let _ = stream.read_to_end(&mut sink);
    }
    // Everyone else is still served and nothing was lost.
    let mut buf = vec![0u8; 10_000];
    let got = good
        .batch_get_into(&[b"keep"], &mut [&mut buf[..]])
        .unwrap();
    assert_eq!(got[0].as_ref().unwrap(), &Some(10_000));
    assert_eq!(buf, value_for(b"keep", 10_000));
    let stats = server.stats();
    assert!(
        stats["server"]["protocol_errors"].as_u64().unwrap() >= 30,
        "{stats}"
    );
    wait_until("garbage connections to close", || {
        server.stats()["server"]["connections"] == 1
    });
}

/// A client process that registers a shared buffer, sends half a batch and
/// waits to be killed; the parent runs it. A no-op unless the environment
/// says otherwise.
#[test]
fn half_batch_client_child() {
    let Ok(url) = std::env::var("KVTIER_HALF_BATCH_URL") else {
        return;
    };
    let mut client = Client::connect_with(
        &url,
        ClientOptions {
            shm_size: 8 << 20,
            ..options()
        },
    )
    .unwrap();
    client
        .batch_put(&[b"from-child"], &[vec![7u8; 1000]])
        .unwrap()[0]
        .as_ref()
        .unwrap();
    let tcp = std::env::var("KVTIER_HALF_BATCH_TCP").unwrap();
    let mut raw = TcpStream::connect(tcp).unwrap();
    let hello = hello_body(TEST_TOKEN, "");
    raw.write_all(
        &Header {
            op: 1,
            request_id: 1,
            body_len: hello.len() as u32,
            status: 0,
        }
        .encode(),
    )
    .unwrap();
    raw.write_all(&hello).unwrap();
    let mut reply = [0u8; 64];
    let _ = raw.read(&mut reply).unwrap();
    // A well-formed put of one 8 MiB value, cut off after 1 MiB of it: the
    // server is receiving it into a pool extent when this process dies.
    let mut w = Writer::default();
    w.u8(0).u32(1).key(b"never-finished").u64(8 << 20);
    raw.write_all(
        &Header {
            op: 2,
            request_id: 2,
            body_len: (w.buf.len() + (8 << 20)) as u32,
            status: 0,
        }
        .encode(),
    )
    .unwrap();
    raw.write_all(&w.buf).unwrap();
    raw.write_all(&vec![1u8; 1 << 20]).unwrap();
    println!("HALF-SENT");
    std::thread::sleep(Duration::from_secs(60));
}

/// The full name of test `name` of this module, as the test binary that
/// holds it lists it (without the crate name).
fn child_test_name(name: &str) -> String {
    let module = module_path!().split_once("::").map_or("", |(_, m)| m);
    if module.is_empty() {
        name.to_string()
    } else {
        format!("{module}::{name}")
    }
}

#[test]
fn a_client_killed_mid_batch_leaks_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(dir.path(), &[]);
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            // The test's name in this binary: its module path below the
            // crate root (`server::half_batch_client_child`).
            &child_test_name("half_batch_client_child"),
            "--nocapture",
            "--test-threads=1",
        ])
        .env("KVTIER_HALF_BATCH_URL", server.unix_url())
        .env("KVTIER_HALF_BATCH_TCP", &server.tcp)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while !line.contains("HALF-SENT") {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "child ended early");
    }
    let stats = server.stats();
    assert_eq!(stats["server"]["connections"], 2, "{stats}");
    assert_eq!(stats["server"]["registered_buffers"], 1, "{stats}");
    child.kill().unwrap();
    child.wait().unwrap();
    wait_until(
        "the dead client's connections and buffer to be released",
        || {
            let s = server.stats();
            s["server"]["connections"] == 0
                && s["server"]["registered_buffers"] == 0
                && s["server"]["registered_bytes"] == 0
        },
    );
    let mut client = Client::connect_with(&server.tcp_url(), options()).unwrap();
    let mut buf = vec![0u8; 1000];
    assert_eq!(
        client
            .batch_get_into(&[b"from-child"], &mut [&mut buf[..]])
            .unwrap()[0]
            .as_ref()
            .unwrap(),
        &Some(1000)
    );
    let stats = client.stats().unwrap();
    assert_eq!(stats["store"]["entries"], 1);
    // The half-received value's extent went back to the pool.
    assert_eq!(stats["store"]["memory_bytes"], 1000, "{stats}");
}

#[test]
fn sigkill_under_load_then_restart_keeps_flushed_entries() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = ServerProcess::start(dir.path(), &[]);
    let flushed: Vec<Vec<u8>> = (0..64)
        .map(|i| format!("flushed-{i}").into_bytes())
        .collect();
    let mut client = Client::connect_with(&server.unix_url(), options()).unwrap();
    let values: Vec<Vec<u8>> = flushed.iter().map(|k| value_for(k, 50_000)).collect();
    for r in client.batch_put(&flushed, &values).unwrap() {
        r.unwrap();
    }
    client.flush().unwrap();
    // Load from other clients while the server dies.
    let url = server.tcp_url();
    let loaders: Vec<_> = (0..4)
        .map(|t| {
            let url = url.clone();
            std::thread::spawn(move || {
                let Ok(mut client) = Client::connect_with(&url, options()) else {
                    return;
                };
                for i in 0..10_000 {
                    let key = format!("load-{t}-{i}").into_bytes();
                    if client
                        .batch_put(&[&key], &[value_for(&key, 30_000)])
                        .is_err()
                    {
                        return;
                    }
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    // Durable puts over TCP (the server reads them value by value into
    // the pool): acknowledged only once on disk, so no flush is needed.
    let durable_keys: Vec<Vec<u8>> = (0..16)
        .map(|i| format!("durable-{i}").into_bytes())
        .collect();
    let durable_values: Vec<Vec<u8>> = durable_keys.iter().map(|k| value_for(k, 70_000)).collect();
    let mut tcp = Client::connect_with(&server.tcp_url(), options()).unwrap();
    let durable = kvtier::PutOptions {
        durable: true,
        ..Default::default()
    };
    for r in tcp
        .batch_put_with(&durable_keys, &durable_values, &durable)
        .unwrap()
    {
        r.unwrap();
    }
    // Killed the moment the durable puts are acknowledged.
    server.signal(libc::SIGKILL);
    server.wait();
    for l in loaders {
        l.join().unwrap();
    }
    let server = ServerProcess::start(dir.path(), &[]);
    // The client from before the crash reconnects by itself (the Unix
    // socket path is the same): at most one call fails, then it works.
    if client.prefix_len(&flushed).is_err() {
        assert_eq!(client.prefix_len(&flushed).unwrap(), 64);
    }
    let mut client = Client::connect_with(&server.tcp_url(), options()).unwrap();
    let mut bufs: Vec<Vec<u8>> = values.iter().map(|v| vec![0u8; v.len()]).collect();
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let got = client.batch_get_into(&flushed, &mut slices).unwrap();
    for (i, result) in got.iter().enumerate() {
        assert_eq!(
            result.as_ref().unwrap(),
            &Some(50_000),
            "flushed key {i} lost"
        );
    }
    assert_eq!(bufs, values);
    let mut bufs: Vec<Vec<u8>> = durable_values.iter().map(|v| vec![0u8; v.len()]).collect();
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let got = client.batch_get_into(&durable_keys, &mut slices).unwrap();
    for (i, result) in got.iter().enumerate() {
        assert_eq!(
            result.as_ref().unwrap(),
            &Some(70_000),
            "durable key {i} lost"
        );
    }
    assert_eq!(bufs, durable_values);
    let stats = client.stats().unwrap();
    assert_eq!(stats["store"]["checksum_failures"], 0);
}

#[test]
fn sigterm_finishes_flushes_and_exits_zero() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = ServerProcess::start(dir.path(), &[]);
    let keys: Vec<Vec<u8>> = (0..20)
        .map(|i| format!("graceful-{i}").into_bytes())
        .collect();
    let values: Vec<Vec<u8>> = keys.iter().map(|k| value_for(k, 70_000)).collect();
    let mut client = Client::connect_with(&server.tcp_url(), options()).unwrap();
    for r in client.batch_put(&keys, &values).unwrap() {
        r.unwrap();
    }
    server.signal(libc::SIGTERM);
    let status = server.wait();
    assert!(status.success(), "{status:?}");
    assert!(
        !Path::new(&server.unix).exists(),
        "the socket file is removed on shutdown"
    );
    let server = ServerProcess::start(dir.path(), &[]);
    let mut client = Client::connect_with(&server.unix_url(), options()).unwrap();
    assert_eq!(client.prefix_len(&keys).unwrap(), 20);
}

#[test]
fn auth_is_required_off_loopback_and_checked_at_hello() {
    let dir = tempfile::tempdir().unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args([
            "serve",
            "--data-dir",
            &dir.path().display().to_string(),
            "--memory",
            "16MiB",
            "--listen",
            "0.0.0.0:0",
            "--admin",
            "off",
        ])
        .env_remove("KVTIER_AUTH_TOKEN")
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("without an auth token"), "{stderr}");

    let short = ServerProcess::try_start(dir.path(), &["--auth-token", "s3cret"]);
    assert!(short.contains("at least 16"), "{short}");

    let server = ServerProcess::start(dir.path(), &["--auth-token", "s3cret-but-long-enough"]);
    let none = ClientOptions {
        auth_token: None,
        ..Default::default()
    };
    let err = Client::connect_with(&server.tcp_url(), none.clone()).unwrap_err();
    assert!(err.to_string().contains("unauthorized"), "{err}");
    let wrong = ClientOptions {
        auth_token: Some("s3cret-but-long-enougH".into()),
        ..Default::default()
    };
    let refused_at = Instant::now();
    assert!(Client::connect_with(&server.tcp_url(), wrong).is_err());
    assert!(
        refused_at.elapsed() >= Duration::from_millis(900),
        "a refused hello is answered only after the failed-auth delay"
    );
    // The server's own user needs no token on the Unix socket.
    let mut local = Client::connect_with(&server.unix_url(), none).unwrap();
    local.flush().unwrap();
    let right = ClientOptions {
        auth_token: Some("s3cret-but-long-enough".into()),
        ..Default::default()
    };
    let mut client = Client::connect_with(&server.tcp_url(), right).unwrap();
    client.flush().unwrap();
    assert!(server.stats()["server"]["auth_failures"].as_u64().unwrap() >= 2);
}

#[test]
fn pipelined_requests_are_answered_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(dir.path(), &[]);
    let mut stream = TcpStream::connect(&server.tcp).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let hello = hello_body(TEST_TOKEN, "");
    let mut put = Writer::default();
    put.u8(0).u32(1).key(b"pipelined").u64(3).bytes(b"abc");
    let mut exists = Writer::default();
    exists.u32(2).key(b"pipelined").key(b"absent");
    // Everything written before any reply is read.
    let mut all = frame(Op::Hello, 1, &hello);
    all.extend(frame(Op::BatchPut, 2, &put.buf));
    all.extend(frame(Op::BatchExists, 3, &exists.buf));
    all.extend(frame(Op::Flush, 4, &[]));
    stream.write_all(&all).unwrap();
    for (id, op) in [
        (1u64, Op::Hello),
        (2, Op::BatchPut),
        (3, Op::BatchExists),
        (4, Op::Flush),
    ] {
        let mut head = [0u8; kvtier_wire::protocol::HEADER_LEN];
        stream.read_exact(&mut head).unwrap();
        let header = Header::decode(&head, 1 << 20).unwrap();
        assert_eq!(
            (header.request_id, header.op, header.status),
            (id, op as u16, 0)
        );
        let mut body = vec![0u8; header.body_len as usize];
        stream.read_exact(&mut body).unwrap();
        if op == Op::BatchExists {
            assert_eq!(body, [2, 0, 0, 0, 1, 0]);
        }
    }
}

#[test]
fn a_live_servers_socket_is_never_taken_over() {
    let dir_a = tempfile::tempdir().unwrap();
    let dir_b = tempfile::tempdir().unwrap();
    let socket = dir_a.path().join("shared.sock").display().to_string();
    let server = ServerProcess::start(&dir_a.path().join("data"), &["--socket", &socket]);
    let output = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args([
            "serve",
            "--data-dir",
            &dir_b.path().display().to_string(),
            "--memory",
            "16MiB",
        ])
        .args([
            "--listen",
            "127.0.0.1:0",
            "--admin",
            "off",
            "--socket",
            &socket,
        ])
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("another server is listening"), "{stderr}");
    // The first server still answers on it.
    let mut client = Client::connect_with(&server.unix_url(), options()).unwrap();
    client.flush().unwrap();
}

/// Multi-buffer puts and gets: one value gathered from (or scattered to)
/// segments, through the registered buffer and over the socket; what one
/// path writes the other reads back byte for byte.
#[test]
fn segment_values_round_trip_through_shared_memory_and_the_socket() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(dir.path(), &[]);
    let shm_options = ClientOptions {
        shm_size: 8 << 20,
        ..options()
    };
    let mut local = Client::connect_with(&server.unix_url(), shm_options).unwrap();
    let mut remote = Client::connect_with(&server.tcp_url(), options()).unwrap();
    // Three values of 5, 1 and 40 segments of uneven sizes.
    let layouts: [&[usize]; 3] = [&[4096, 100, 70_000, 1, 12_345], &[300_000], &[2048; 40]];
    let keys: Vec<Vec<u8>> = (0..3).map(|i| format!("seg-{i}").into_bytes()).collect();
    let values: Vec<Vec<u8>> = keys
        .iter()
        .zip(layouts)
        .map(|(k, l)| value_for(k, l.iter().sum()))
        .collect();
    // Segments placed at scattered offsets of the shared buffer.
    let mut at = 0u64;
    let mut place = |lens: &[usize]| -> Vec<(u64, u64)> {
        lens.iter()
            .map(|&n| {
                at += 4096 + 13;
                let segment = (at, n as u64);
                at += n as u64;
                segment
            })
            .collect()
    };
    let put_segments: Vec<Vec<(u64, u64)>> = layouts.iter().map(|l| place(l)).collect();
    let get_segments: Vec<Vec<(u64, u64)>> = layouts.iter().map(|l| place(l)).collect();
    let shm = local.registered_buffer().unwrap();
    for (value, segments) in values.iter().zip(&put_segments) {
        let mut rest = &value[..];
        for &(offset, len) in segments {
            let (head, tail) = rest.split_at(len as usize);
            shm[offset as usize..(offset + len) as usize].copy_from_slice(head);
            rest = tail;
        }
    }
    for r in local
        .batch_put_registered_segments(&keys, &put_segments, &Default::default())
        .unwrap()
    {
        r.unwrap();
    }
    // Read back over TCP into differently split buffers.
    let mut bufs: Vec<Vec<u8>> = values.iter().map(|v| vec![0u8; v.len()]).collect();
    let mut splits: Vec<Vec<&mut [u8]>> = bufs
        .iter_mut()
        .map(|b| {
            let third = b.len() / 3;
            let (a, rest) = b.split_at_mut(third);
            let (c, d) = rest.split_at_mut(rest.len() / 2);
            vec![a, c, d]
        })
        .collect();
    let mut dests: Vec<&mut [&mut [u8]]> = splits.iter_mut().map(|s| &mut s[..]).collect();
    let got = remote.batch_get_segments(&keys, &mut dests).unwrap();
    for ((r, buf), value) in got.iter().zip(&bufs).zip(&values) {
        assert_eq!(r.as_ref().unwrap(), &Some(value.len()));
        assert_eq!(buf, value);
    }
    // Put over TCP as segments, scatter back through shared memory.
    let other: Vec<Vec<u8>> = keys.iter().map(|k| [&k[..], b"/tcp"].concat()).collect();
    let pieces: Vec<Vec<&[u8]>> = values
        .iter()
        .map(|v| v.chunks(777).collect::<Vec<_>>())
        .collect();
    let refs: Vec<&[&[u8]]> = pieces.iter().map(|p| &p[..]).collect();
    for r in remote
        .batch_put_segments(&other, &refs, &Default::default())
        .unwrap()
    {
        r.unwrap();
    }
    let got = local
        .batch_get_registered_segments(&other, &get_segments)
        .unwrap();
    let shm = local.registered_buffer().unwrap();
    for ((r, value), segments) in got.iter().zip(&values).zip(&get_segments) {
        assert_eq!(r.as_ref().unwrap(), &Some(value.len()));
        let gathered: Vec<u8> = segments
            .iter()
            .flat_map(|&(o, l)| shm[o as usize..(o + l) as usize].to_vec())
            .collect();
        assert_eq!(&gathered, value);
    }
    // Overlapping destinations are refused whole; a segment outside the
    // buffer fails its key alone; too little room is BUFFER_TOO_SMALL.
    let overlap = vec![vec![(0, 100), (50, 100)]];
    assert!(local
        .batch_get_registered_segments(&keys[..1], &overlap)
        .is_err());
    let outside = vec![vec![(0, 10), (u64::MAX - 4, 8)], vec![(0, 300_000)]];
    let got = local
        .batch_put_registered_segments(&keys[..2], &outside, &Default::default())
        .unwrap();
    assert_eq!(
        got[0].as_ref().unwrap_err().kind(),
        kvtier::ErrorKind::InvalidArgument
    );
    got[1].as_ref().unwrap();
    let small = vec![vec![(0, 1000), (2000, 1000)]];
    let got = local
        .batch_get_registered_segments(&keys[2..], &small)
        .unwrap();
    assert_eq!(
        got[0].as_ref().unwrap_err().kind(),
        kvtier::ErrorKind::BufferTooSmall
    );
    let metrics = server.http("/metrics");
    assert!(
        metrics.contains("kvtier_requests_total{op=\"batch_get_shm_segments\"} 3"),
        "{metrics}"
    );
}

/// A server restart under a connected client: the next call of every kind
/// succeeds on its first try (the client reconnects and repeats it once),
/// and the shared buffer handed out before is registered again, so it stays
/// on the shared-memory path.
#[test]
fn a_client_carries_on_across_a_server_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = ServerProcess::start(dir.path(), &[]);
    let options = ClientOptions {
        shm_size: 1 << 20,
        ..options()
    };
    let mut client = Client::connect_with(&server.unix_url(), options).unwrap();
    let before = client.registered_buffer().unwrap().as_ptr();
    let value = value_for(b"restart", 100_000);
    client.registered_buffer().unwrap()[..value.len()].copy_from_slice(&value);
    let put = client
        .batch_put_registered(
            &[b"restart"],
            &[(0, value.len() as u64)],
            &Default::default(),
        )
        .unwrap();
    put[0].as_ref().unwrap();
    client.flush().unwrap();

    // SIGKILL: the flushed value survives; the connection dies.
    drop(server);
    server = ServerProcess::start(dir.path(), &[]);
    assert_eq!(client.prefix_len(&[b"restart"]).unwrap(), 1);
    drop(server);
    server = ServerProcess::start(dir.path(), &[]);
    let got = client
        .batch_get_registered(&[b"restart"], &[(1 << 19, value.len() as u64)])
        .unwrap();
    assert_eq!(got[0].as_ref().unwrap(), &Some(value.len()));
    let shm = client.registered_buffer().unwrap();
    assert_eq!(shm.as_ptr(), before, "the same shared buffer");
    assert_eq!(&shm[1 << 19..(1 << 19) + value.len()], &value[..]);
    let stats = client.stats().unwrap();
    assert_eq!(
        stats["server"]["ops"]["batch_get_shm"]["requests"], 1,
        "{stats}"
    );
    assert_eq!(stats["server"]["registered_buffers"], 1, "{stats}");
    drop(server);
}

/// Batches larger than one frame or than the server's key limit are split
/// by the client: the caller sees one batch with per-key results in order,
/// and a value too large for any frame fails alone over the socket (by
/// cross-memory transfers no frame carries it, and it is stored).
#[test]
fn the_client_splits_batches_the_server_would_refuse() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("limits.toml");
    std::fs::write(&config, "max_frame = \"4MiB\"\nmax_batch = 64\n").unwrap();
    let data = dir.path().join("data");
    let server = ServerProcess::start(&data, &["--config", config.to_str().unwrap()]);
    for (url, cross_memory) in [
        (server.tcp_url(), false),
        (server.unix_url(), false),
        (server.unix_url(), true),
    ] {
        let shm = ClientOptions {
            shm_size: 64 << 20,
            cross_memory,
            ..options()
        };
        let mut client = Client::connect_with(&url, shm).unwrap();
        assert_eq!(client.cross_memory(), cross_memory);
        let tag = format!("{}-{cross_memory}", url.split(':').next().unwrap());
        // Whether the 5 MiB value is stored: only where no frame carries it.
        let large_stored = cross_memory;
        // 200 keys (over the 64-key limit) of 100 KiB (20 MiB: over the
        // 4 MiB frame), one of them 5 MiB (over any frame).
        let keys: Vec<Vec<u8>> = (0..200)
            .map(|i| format!("{tag}-split-{i}").into_bytes())
            .collect();
        let values: Vec<Vec<u8>> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| value_for(k, if i == 150 { 5 << 20 } else { 100 << 10 }))
            .collect();
        let put = client.batch_put(&keys, &values).unwrap();
        for (i, r) in put.iter().enumerate() {
            if i == 150 && !large_stored {
                assert_eq!(
                    r.as_ref().unwrap_err().kind(),
                    kvtier::ErrorKind::InvalidArgument
                );
            } else {
                r.as_ref().unwrap();
            }
        }
        let present = if large_stored { 200 } else { 199 };
        assert_eq!(
            client.prefix_len(&keys).unwrap(),
            if large_stored { 200 } else { 150 }
        );
        let exists = client.batch_exists(&keys).unwrap();
        assert_eq!(exists.iter().filter(|e| **e).count(), present);
        let mut bufs: Vec<Vec<u8>> = values.iter().map(|v| vec![0u8; v.len()]).collect();
        let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        let got = client.batch_get_into(&keys, &mut slices).unwrap();
        for (i, (r, (b, v))) in got.iter().zip(bufs.iter().zip(&values)).enumerate() {
            if i == 150 && !large_stored {
                assert_eq!(r.as_ref().unwrap(), &None);
            } else {
                assert_eq!(r.as_ref().unwrap(), &Some(v.len()));
                assert_eq!(b, v);
            }
        }
        if url.starts_with("unix") {
            // 100 shared-memory ranges: over the key limit, split too.
            let ranges: Vec<(u64, u64)> = (0..100).map(|i| (i * 4096, 4096)).collect();
            let got = client.batch_get_registered(&keys[..100], &ranges).unwrap();
            assert!(got
                .iter()
                .all(|r| matches!(r, Err(e) if e.kind() == kvtier::ErrorKind::BufferTooSmall)));
        }
    }
}

/// A pool serves threads in parallel on up to its limit of connections,
/// every connection reads what another wrote, and a closed pool refuses
/// calls.
#[test]
fn a_client_pool_runs_threads_on_their_own_connections() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(&dir.path().join("data"), &[]);
    for url in [server.tcp_url(), server.unix_url()] {
        let first = Client::connect_with(&url, options()).unwrap();
        let pool = kvtier_client::ClientPool::new(first, 3).unwrap();
        let tag = url.split(':').next().unwrap().to_string();
        let barrier = std::sync::Barrier::new(6);
        std::thread::scope(|scope| {
            for t in 0..6 {
                let (pool, barrier, tag) = (&pool, &barrier, &tag);
                scope.spawn(move || {
                    barrier.wait();
                    for i in 0..40 {
                        let key = format!("{tag}-pool-{t}-{i}").into_bytes();
                        let value = value_for(&key, 300 << 10);
                        let put = pool.with(|c| c.batch_put(&[&key], &[&value])).unwrap();
                        put[0].as_ref().unwrap();
                        // Read back through whichever connection is free.
                        let got = pool.with(|c| c.get(&key)).unwrap();
                        assert_eq!(got.as_deref(), Some(&value[..]));
                    }
                });
            }
        });
        let open = pool.open_connections();
        assert!((2..=3).contains(&open), "{open} connections open");
        // Overlapped calls: two gets in flight from one caller, each on
        // its own connection, with their buffers moved in and back out.
        let pool = std::sync::Arc::new(pool);
        let pending: Vec<_> = (0..2)
            .map(|t| {
                let key = format!("{tag}-pool-{t}-7").into_bytes();
                pool.spawn(move |c| {
                    let mut buf = vec![0u8; 300 << 10];
                    let got = c.batch_get_into(&[&key], &mut [&mut buf[..]])?;
                    Ok((key, buf, got))
                })
            })
            .collect();
        for p in pending {
            let (key, buf, got) = p.wait().unwrap();
            assert_eq!(got[0].as_ref().unwrap(), &Some(300 << 10));
            assert_eq!(buf, value_for(&key, 300 << 10));
        }
        let missing = pool.spawn(|c| c.get(b"never-stored"));
        let deadline = Instant::now() + Duration::from_secs(10);
        while !missing.is_done() {
            assert!(Instant::now() < deadline, "the background get never ended");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(missing.wait().unwrap(), None);
        pool.close();
        let refused = pool.with(|c| c.get(b"anything")).unwrap_err();
        assert_eq!(refused.kind(), kvtier::ErrorKind::Closed);
        assert_eq!(pool.open_connections(), 0);
    }
}

/// The admin endpoint off loopback: data needs the token, the status
/// page's own files do not (they hold none); other methods, unknown paths
/// and connections past the cap get clear answers.
#[test]
fn admin_endpoint_guards_data_off_loopback_and_caps_connections() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("serve.toml");
    std::fs::write(&config, "max_admin_connections = 3\nadmin_timeout = 2.0\n").unwrap();
    let server = ServerProcess::start(
        &dir.path().join("data"),
        &["--admin", "0.0.0.0:0", "--config", config.to_str().unwrap()],
    );
    for path in ["/stats", "/stats/history", "/metrics"] {
        let response = server.http(path);
        assert!(response.starts_with("HTTP/1.1 401"), "{path}: {response}");
    }
    // Liveness reveals nothing: a probe needs no secret.
    assert!(server.http("/health").starts_with("HTTP/1.1 200"));
    let get = |path: &str| {
        server.http_request(&format!(
            "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TEST_TOKEN}\r\n\r\n"
        ))
    };
    let body = |response: &str| response.split("\r\n\r\n").nth(1).unwrap().to_string();
    let stats: serde_json::Value = serde_json::from_str(&body(&get("/stats"))).unwrap();
    assert_eq!(stats["server"]["auth_failures"], 3, "{stats}");
    assert_eq!(stats["cluster"]["enabled"], false);
    assert!(stats["hit_rate"]["overall"].is_null(), "no lookups yet");
    let history: serde_json::Value = serde_json::from_str(&body(&get("/stats/history"))).unwrap();
    assert_eq!(history["interval_seconds"], 2.0);
    assert!(get("/metrics").contains("kvtier_tier_capacity_bytes{tier=\"memory\"} 67108864"));
    // The page needs no token, and runs only its own script.
    let page = server.http("/");
    assert!(page.starts_with("HTTP/1.1 200"), "{page}");
    assert!(page.contains("<title>kvtier status</title>"));
    assert!(page
        .to_ascii_lowercase()
        .contains("content-security-policy: default-src 'self'"));
    assert!(server.http("/status.js").contains("function poll()"));
    let posted = server.http_request(&format!(
        "POST /stats HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TEST_TOKEN}\r\nContent-Length: 0\r\n\r\n"
    ));
    assert!(posted.starts_with("HTTP/1.1 405"), "{posted}");
    assert!(get("/nope").starts_with("HTTP/1.1 404"));
    // Three silent connections fill the cap; the next is told at once.
    let silent: Vec<TcpStream> = (0..3)
        .map(|_| TcpStream::connect(&server.admin).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let busy = server.http("/");
    assert!(busy.starts_with("HTTP/1.1 503"), "{busy}");
    // The silent ones are dropped at the admin timeout; room again.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let response = server.http("/");
        if response.starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(Instant::now() < deadline, "the cap never freed: {response}");
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(silent);
}

#[test]
fn a_routing_client_of_a_lone_server_talks_to_it_alone() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(dir.path(), &[]);
    let routing = ClientOptions {
        route: true,
        ..options()
    };
    let mut client = Client::connect_with(&server.tcp_url(), routing).unwrap();
    assert_eq!(
        client.cluster_view().unwrap(),
        serde_json::json!({"enabled": false})
    );
    let keys: Vec<Vec<u8>> = (0..8).map(|i| format!("lone-{i}").into_bytes()).collect();
    let values: Vec<Vec<u8>> = keys.iter().map(|k| value_for(k, 70_000)).collect();
    for result in client.batch_put(&keys, &values).unwrap() {
        result.unwrap();
    }
    let mut bufs: Vec<Vec<u8>> = values.iter().map(|v| vec![0u8; v.len()]).collect();
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    for result in client.batch_get_into(&keys, &mut slices).unwrap() {
        assert_eq!(result.unwrap(), Some(70_000));
    }
    assert_eq!(bufs, values);
    assert_eq!(client.prefix_len(&keys).unwrap(), 8);
    // A bad key is the caller's error, as without routing.
    assert!(client.batch_exists(&[&b""[..]]).is_err());
}

/// Sends hello then `body` as one BatchPut frame on a fresh connection;
/// returns the reply's status and body (`None`: closed without one).
fn raw_put(
    server: &ServerProcess,
    flags: i32,
    body: &[u8],
    then: Option<&[u8]>,
) -> Option<(i32, Vec<u8>)> {
    let mut stream = TcpStream::connect(&server.tcp).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let read_reply = crate::common::try_read_reply;
    let hello = hello_body(TEST_TOKEN, "");
    let frame = |op: u16, id: u64, body: &[u8], status: i32| {
        let mut f = Header {
            op,
            request_id: id,
            body_len: body.len() as u32,
            status,
        }
        .encode()
        .to_vec();
        f.extend_from_slice(body);
        f
    };
    stream
        .write_all(&frame(Op::Hello as u16, 1, &hello, 0))
        .unwrap();
    read_reply(&mut stream)?;
    stream
        .write_all(&frame(Op::BatchPut as u16, 2, body, flags))
        .ok()?;
    let reply = read_reply(&mut stream);
    if let Some(next) = then {
        // The connection goes on after a frame it accepted.
        stream
            .write_all(&frame(Op::BatchPut as u16, 3, next, 0))
            .unwrap();
        let (status, _) = read_reply(&mut stream).expect("a second reply");
        assert_eq!(status, 0);
    }
    reply
}

/// BatchPut frames are read value by value straight into the pool; one
/// that breaks the rules part-way is refused whole, stores nothing, and
/// leaves every other connection alone. Values the store refuses are
/// answered per key, their bytes skipped, and the connection goes on.
#[test]
fn a_put_frame_read_value_by_value_is_checked_as_a_whole() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(dir.path(), &[]);
    let mut good = Client::connect_with(&server.tcp_url(), options()).unwrap();
    let item = |w: &mut Writer, key: &[u8], len: usize| {
        w.key(key).u64(len as u64).bytes(&value_for(key, len));
    };
    // A complete first value, then a second whose length runs past the body.
    let mut w = Writer::default();
    w.u8(0).u32(2);
    item(&mut w, b"first-of-a-lie", 300_000);
    w.key(b"second").u64(1 << 30).bytes(&[1; 100]);
    // Trailing bytes after the items.
    let mut trailing = Writer::default();
    trailing.u8(0).u32(1);
    item(&mut trailing, b"with-trailer", 70_000);
    trailing.bytes(&[0; 3]);
    // An empty key after a good item.
    let mut empty_key = Writer::default();
    empty_key.u8(0).u32(2);
    item(&mut empty_key, b"before-empty", 5000);
    empty_key.u16(0).u64(1).bytes(&[1]);
    // A well-formed put with a request flag no server knows.
    let mut unknown_flag = Writer::default();
    unknown_flag.u8(0).u32(1);
    item(&mut unknown_flag, b"unknown-flag", 1000);
    for (flags, body) in [
        (0, &w.buf),
        (0, &trailing.buf),
        (0, &empty_key.buf),
        (2, &unknown_flag.buf),
    ] {
        let reply = raw_put(&server, flags, body, None);
        if let Some((status, message)) = &reply {
            assert_eq!(*status, kvtier_wire::protocol::code::PROTOCOL, "{reply:?}");
            assert!(!message.is_empty());
        }
    }
    let absent: Vec<&[u8]> = vec![
        b"first-of-a-lie",
        b"second",
        b"with-trailer",
        b"before-empty",
    ];
    assert_eq!(good.batch_exists(&absent).unwrap(), vec![false; 4]);
    assert!(
        server.stats()["server"]["protocol_errors"]
            .as_u64()
            .unwrap()
            >= 3
    );

    // With skip-existing, a present key's value is skipped (its bytes read
    // and dropped) and an empty value is refused per key; the rest of the
    // frame is stored and the connection carries on.
    good.batch_put(&[b"present"], &[value_for(b"present", 4096)])
        .unwrap()[0]
        .as_ref()
        .unwrap();
    let mut mixed = Writer::default();
    mixed.u8(1).u32(3);
    item(&mut mixed, b"present", 300_000);
    item(&mut mixed, b"zero", 0);
    item(&mut mixed, b"fits", 200_000);
    let mut next = Writer::default();
    next.u8(0).u32(1);
    item(&mut next, b"next-frame", 1000);
    let (status, body) = raw_put(&server, 0, &mixed.buf, Some(&next.buf)).expect("a reply");
    assert_eq!(status, 0);
    let codes: Vec<i32> = body[4..]
        .chunks(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(codes, [0, kvtier_wire::protocol::code::INVALID_ARGUMENT, 0]);
    let mut buf = vec![0u8; 200_000];
    let got = good
        .batch_get_into(&[b"fits"], &mut [&mut buf[..]])
        .unwrap();
    assert_eq!(got[0].as_ref().unwrap(), &Some(200_000));
    assert_eq!(buf, value_for(b"fits", 200_000));
    let mut kept = vec![0u8; 300_000];
    let got = good
        .batch_get_into(&[b"present"], &mut [&mut kept[..]])
        .unwrap();
    assert_eq!(got[0].as_ref().unwrap(), &Some(4096));
    assert_eq!(&kept[..4096], &value_for(b"present", 4096)[..]);
    assert_eq!(
        good.batch_exists(&[&b"zero"[..], b"next-frame"]).unwrap(),
        vec![false, true]
    );
    // The skipped and refused values' bytes were dropped, not kept.
    assert_eq!(good.stats().unwrap()["store"]["entries"], 3);
}

/// `--shared-index` takes `all` or `share`, and `share` (the bounded
/// index, divided by the member list) needs cluster mode: each refusal
/// names what to change.
#[test]
fn the_bounded_shared_index_needs_cluster_mode() {
    let dir = tempfile::tempdir().unwrap();
    let shared = dir.path().join("shared").display().to_string();
    let alone = ServerProcess::try_start(
        &dir.path().join("a"),
        &["--shared-dir", &shared, "--shared-index", "share"],
    );
    assert!(alone.contains("needs --cluster"), "{alone}");
    let unknown = ServerProcess::try_start(
        &dir.path().join("b"),
        &["--shared-dir", &shared, "--shared-index", "some"],
    );
    assert!(unknown.contains("`all` or `share`"), "{unknown}");
}

/// A pool of clients as a `KvBackend` (what the Python binding drives):
/// values and destinations inside the registered region move through
/// shared memory, the others by cross-memory transfers, and a server that is gone is an
/// error for the whole call, never keys reported absent.
#[test]
fn a_client_pool_backend_uses_shared_memory_and_reports_a_lost_server() {
    use kvtier_client::KvBackend;
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(&dir.path().join("data"), &[]);
    let first = Client::connect_with(&server.unix_url(), options()).unwrap();
    let region = first
        .registered_region()
        .expect("a Unix socket registers a region");
    let pool = kvtier_client::ClientPool::new(first, 2).unwrap();
    let backend: &dyn KvBackend = &pool;
    let keys: Vec<Vec<u8>> = (0..4)
        .map(|i| format!("pool-backend-{i}").into_bytes())
        .collect();
    let key_refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
    let values: Vec<Vec<u8>> = keys.iter().map(|k| value_for(k, 100_000)).collect();
    // The first two values from the shared region, the others from the heap.
    // SAFETY: this test is the region's only writer, and no call is in
    // flight while it writes.
    let shared = unsafe { region.range_mut(0, 200_000) }.unwrap();
    shared[..100_000].copy_from_slice(&values[0]);
    shared[100_000..].copy_from_slice(&values[1]);
    let shared: &[u8] = shared;
    let whole: Vec<&[u8]> = vec![&shared[..100_000], &shared[100_000..]];
    for r in backend
        .batch_put_whole(&key_refs[..2], &whole, &Default::default())
        .unwrap()
    {
        r.unwrap();
    }
    let heap: Vec<&[u8]> = values[2..].iter().map(|v| &v[..]).collect();
    for r in backend
        .batch_put_whole(&key_refs[2..], &heap, &Default::default())
        .unwrap()
    {
        r.unwrap();
    }
    let ops = server.stats()["server"]["ops"].clone();
    assert_eq!(ops["batch_put_shm"]["keys"], 2, "{ops}");
    // The heap values: read from this process's memory by the server
    // (cross-memory transfers), not sent in frames.
    assert_eq!(ops["batch_put_shm_segments"]["keys"], 2, "{ops}");
    assert_eq!(ops["batch_put"]["keys"], 0, "{ops}");
    assert_eq!(backend.batch_exists(&key_refs).unwrap(), vec![true; 4]);
    assert_eq!(backend.prefix_len(&key_refs).unwrap(), 4);
    for (key, value) in key_refs.iter().zip(&values) {
        assert_eq!(backend.get(key).unwrap().as_deref(), Some(&value[..]));
    }
    drop(server);
    let err = backend.batch_exists(&key_refs).unwrap_err();
    assert_eq!(err.kind(), kvtier::ErrorKind::Io, "{err}");
    assert!(backend.prefix_len(&key_refs).is_err());
    let mut buf = vec![0u8; 100_000];
    assert!(backend
        .batch_get_whole(&key_refs[..1], &mut [&mut buf[..]])
        .is_err());
}
