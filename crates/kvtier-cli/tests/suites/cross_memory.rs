//! Cross-memory transfers (RegisterPeerMemory): a client on the Unix
//! socket has its own buffers read and written by the server, one copy
//! each way; and what a client that lies about its memory gets (a clear
//! error per key, never another process's memory, nothing stored).

use crate::common::{frame, hello_body, options, read_reply, ServerProcess, TEST_TOKEN};
use kvtier_client::{Client, ClientOptions};
use kvtier_wire::protocol::{code, features, HelloReply, Op, Reader, Request, Writer};
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::time::Duration;

const VALUE: usize = 1 << 20;

fn key(i: u64) -> Vec<u8> {
    format!("cross/{i}").into_bytes()
}

pub(crate) fn ops(server: &ServerProcess, op: &str) -> u64 {
    let mut client = Client::connect_with(&server.tcp_url(), options()).unwrap();
    client.stats().unwrap()["server"]["ops"][op]["requests"]
        .as_u64()
        .unwrap()
}

/// The test clients: the server's pool not mapped, so that gets of values
/// in its memory are cross-memory transfers too (pool_map.rs covers the
/// mapping).
fn unmapped() -> ClientOptions {
    ClientOptions {
        map_pool: false,
        ..options()
    }
}

/// Puts and gets through `client`, every byte checked; a miss and a
/// buffer too small answered as on the socket.
fn round_trip(client: &mut Client, first: u64) {
    let keys: Vec<Vec<u8>> = (first..first + 16).map(key).collect();
    let values: Vec<Vec<u8>> = keys
        .iter()
        .map(|k| kvtier::pattern::value(k, VALUE))
        .collect();
    for stored in client.batch_put(&keys, &values).unwrap() {
        stored.unwrap();
    }
    let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; VALUE + 7]).collect();
    let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let got = client.batch_get_into(&keys, &mut refs).unwrap();
    for ((got, buf), value) in got.into_iter().zip(&bufs).zip(&values) {
        assert_eq!(got.unwrap(), Some(VALUE));
        assert!(buf[..VALUE] == value[..], "a value read back changed");
        assert_eq!(&buf[VALUE..], &[0u8; 7], "bytes past the value written");
    }
    let mut small = [0u8; 100];
    let mut absent = [0u8; 100];
    let got = client
        .batch_get_into(
            &[keys[0].clone(), b"cross/absent".to_vec()],
            &mut [&mut small[..], &mut absent[..]],
        )
        .unwrap();
    let too_small = got[0].as_ref().unwrap_err();
    assert_eq!(
        too_small.kind(),
        kvtier::ErrorKind::BufferTooSmall,
        "{too_small}"
    );
    assert!(
        too_small.to_string().contains(&VALUE.to_string()),
        "{too_small}"
    );
    assert!(matches!(got[1], Ok(None)));
}

#[test]
fn values_cross_once_between_the_pool_and_a_clients_own_buffers() {
    let dir = tempfile::tempdir().unwrap();
    {
        let server = ServerProcess::start(dir.path(), &[]);
        let mut client = Client::connect_with(&server.unix_url(), unmapped()).unwrap();
        assert!(
            client.cross_memory(),
            "the server does not reach this test's memory (same user, no Yama here)"
        );
        round_trip(&mut client, 0);
        client.flush().unwrap();
        // The values travelled by cross-memory ops, not in frames.
        assert!(ops(&server, "batch_put_shm_segments") >= 1);
        assert!(ops(&server, "batch_get_shm_segments") >= 2);
        assert_eq!(ops(&server, "batch_put"), 0);
        assert_eq!(ops(&server, "batch_get"), 0);
        // A client that asks for the socket gets it.
        let mut socket = Client::connect_with(
            &server.unix_url(),
            ClientOptions {
                cross_memory: false,
                ..unmapped()
            },
        )
        .unwrap();
        assert!(!socket.cross_memory());
        round_trip(&mut socket, 100);
        assert!(ops(&server, "batch_put") >= 1);
    }
    // After a restart the pool is empty: values come from the disk tier,
    // staged and then written into the client's buffers.
    let server = ServerProcess::start(dir.path(), &[]);
    let mut client = Client::connect_with(&server.unix_url(), unmapped()).unwrap();
    let keys: Vec<Vec<u8>> = (0..16).map(key).collect();
    let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; VALUE]).collect();
    let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    for (got, (k, buf)) in client
        .batch_get_into(&keys, &mut refs)
        .unwrap()
        .into_iter()
        .zip(keys.iter().zip(&bufs))
    {
        assert_eq!(got.unwrap(), Some(VALUE));
        assert!(buf[..] == kvtier::pattern::value(k, VALUE)[..]);
    }
    // An operator who turns it off gets the socket for every client.
    drop(client);
    drop(server);
    let config = dir.path().join("no-cross-memory.toml");
    std::fs::write(&config, "cross_memory = false\n").unwrap();
    let server = ServerProcess::start(dir.path(), &["--config", config.to_str().unwrap()]);
    let mut client = Client::connect_with(&server.unix_url(), unmapped()).unwrap();
    assert!(!client.cross_memory());
    round_trip(&mut client, 200);
    let (status, _) = register(&mut hello(&server), &probe_of(&[7u8; 16]));
    assert_eq!(status, code::UNSUPPORTED, "registered though turned off");
}

/// A raw Unix connection after its hello, with the hello's reply.
fn hello(server: &ServerProcess) -> UnixStream {
    let mut s = UnixStream::connect(&server.unix).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(&frame(Op::Hello, 1, &hello_body(TEST_TOKEN, "")))
        .unwrap();
    let (status, body) = read_reply(&mut s);
    assert_eq!(status, 0);
    assert!(HelloReply::decode(&body).is_ok());
    s
}

/// A RegisterPeerMemory body claiming that `probe` lies at its address.
fn probe_of(probe: &[u8; 16]) -> Vec<u8> {
    Request::RegisterPeerMemory {
        address: probe.as_ptr() as u64,
        probe,
    }
    .encode()
}

fn register(s: &mut (impl std::io::Read + Write), body: &[u8]) -> (i32, Vec<u8>) {
    s.write_all(&frame(Op::RegisterPeerMemory, 2, body))
        .unwrap();
    read_reply(s)
}

/// A get or put frame of segment items `(key, address, len)` with buffer
/// id `id`.
fn segments(op: Op, id: u32, items: &[(&[u8], u64, u64)]) -> Vec<u8> {
    let mut w = Writer::default();
    w.u32(id);
    if op == Op::BatchPutShmSegments {
        w.u8(0);
    }
    w.u32(items.len() as u32);
    for (k, address, len) in items {
        w.key(k).u32(1).u64(*address).u64(*len);
    }
    w.buf
}

/// The per-key codes of a get or put reply.
fn codes(body: &[u8], get: bool) -> Vec<i32> {
    let mut r = Reader::new(body);
    let n = r.u32().unwrap();
    (0..n)
        .map(|_| {
            let c = r.i32().unwrap();
            if get {
                r.u64().unwrap();
            }
            c
        })
        .collect()
}

#[test]
fn a_client_that_lies_about_its_memory_gets_an_error_per_key_and_stores_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(dir.path(), &[]);
    let mut client = Client::connect_with(&server.unix_url(), unmapped()).unwrap();
    let value = kvtier::pattern::value(b"cross/kept", 4096);
    client.batch_put(&[b"cross/kept"], &[&value]).unwrap()[0]
        .as_ref()
        .unwrap();

    // Over TCP the server names no process: refused.
    let mut tcp = std::net::TcpStream::connect(&server.tcp).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    tcp.write_all(&frame(Op::Hello, 1, &hello_body(TEST_TOKEN, "")))
        .unwrap();
    let (status, body) = read_reply(&mut tcp);
    assert_eq!(status, 0);
    assert_eq!(
        HelloReply::decode(&body).unwrap().features & features::PEER_MEMORY,
        0,
        "offered over TCP"
    );
    assert_eq!(
        register(&mut tcp, &probe_of(&[1u8; 16])).0,
        code::UNSUPPORTED
    );

    let mut s = hello(&server);
    // A probe that is not what lies at its address: refused, and the
    // connection goes on.
    let held = [9u8; 16];
    let lie = Request::RegisterPeerMemory {
        address: held.as_ptr() as u64,
        probe: &[8u8; 16],
    }
    .encode();
    let (status, body) = register(&mut s, &lie);
    assert_eq!(
        status,
        code::UNSUPPORTED,
        "{}",
        String::from_utf8_lossy(&body)
    );
    // An address nothing is mapped at: refused too.
    let unmapped = Request::RegisterPeerMemory {
        address: 16,
        probe: &held,
    }
    .encode();
    assert_eq!(register(&mut s, &unmapped).0, code::UNSUPPORTED);
    let probe: Box<[u8; 16]> = Box::new(
        kvtier_wire::proof::nonce().unwrap()[..16]
            .try_into()
            .unwrap(),
    );
    let (status, body) = register(&mut s, &probe_of(&probe));
    assert_eq!(status, 0);
    let id = Reader::new(&body).u32().unwrap();

    // Gets: one range at an unmapped address, one wrapping past the end of
    // memory, one good. Each answers for itself.
    let mut good = vec![0u8; 4096];
    let items: Vec<(&[u8], u64, u64)> = vec![
        (b"cross/kept", 16, 4096),
        (b"cross/kept", u64::MAX - 8, 4096),
        (b"cross/kept", good.as_mut_ptr() as u64, 4096),
    ];
    s.write_all(&frame(
        Op::BatchGetShmSegments,
        3,
        &segments(Op::BatchGetShmSegments, id, &items),
    ))
    .unwrap();
    let (status, body) = read_reply(&mut s);
    assert_eq!(status, 0);
    assert_eq!(
        codes(&body, true),
        vec![code::INVALID_ARGUMENT, code::INVALID_ARGUMENT, code::OK]
    );
    assert!(good == value, "the good range got the value");
    // A buffer id that is not this connection's: refused.
    s.write_all(&frame(
        Op::BatchGetShmSegments,
        4,
        &segments(Op::BatchGetShmSegments, id + 100, &items[2..]),
    ))
    .unwrap();
    assert_eq!(read_reply(&mut s).0, code::INVALID_ARGUMENT);

    // Puts from memory that is not the client's store nothing.
    let items: Vec<(&[u8], u64, u64)> = vec![
        (b"cross/unmapped", 16, 4096),
        (b"cross/wrapping", u64::MAX - 8, 4096),
        (b"cross/good", value.as_ptr() as u64, 4096),
    ];
    s.write_all(&frame(
        Op::BatchPutShmSegments,
        5,
        &segments(Op::BatchPutShmSegments, id, &items),
    ))
    .unwrap();
    let (status, body) = read_reply(&mut s);
    assert_eq!(status, 0);
    assert_eq!(
        codes(&body, false),
        vec![code::INVALID_ARGUMENT, code::INVALID_ARGUMENT, code::OK]
    );
    assert_eq!(
        client
            .batch_exists(&[&b"cross/unmapped"[..], b"cross/wrapping", b"cross/good"])
            .unwrap(),
        vec![false, false, true]
    );
    let mut back = vec![0u8; 4096];
    assert_eq!(
        client
            .batch_get_into(&[b"cross/good"], &mut [&mut back[..]])
            .unwrap()[0]
            .as_ref()
            .unwrap(),
        &Some(4096)
    );
    assert!(back == value);
    // The server is unharmed.
    assert_eq!(client.stats().unwrap()["server"]["protocol_errors"], 0);
    drop(probe);
}
