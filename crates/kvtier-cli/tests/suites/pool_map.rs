//! Pool mapping (MapPool, LeaseValues, ReleaseLease): a full-scope client
//! of the server's user maps the pool read-only and copies leased values
//! out itself; what it cannot do with the mapping (write, shrink or punch
//! the pool, read an extent after it was reused, lease past its budgets);
//! and who is not offered it (TCP, tenants, `map_pool = false`).

use crate::common::{as_tenant, frame, hello_body, options, read_reply, ServerProcess, TEST_TOKEN};
use crate::cross_memory::ops;
use kvtier::{PutOptions, PutTier};
use kvtier_client::{Client, ClientOptions};
use kvtier_wire::protocol::{
    code, decode_lease_reply, features, HelloReply, Leased, Op, Reader, Request, HEADER_LEN,
};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

fn key(i: u64) -> Vec<u8> {
    format!("mapped/{i}").into_bytes()
}

/// A raw Unix connection after a hello with `token` in `namespace`, and
/// the features the hello reply offered.
fn said_hello(server: &ServerProcess, token: &str, namespace: &str) -> (UnixStream, u32) {
    let mut s = UnixStream::connect(&server.unix).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(&frame(Op::Hello, 1, &hello_body(token, namespace)))
        .unwrap();
    let (status, body) = read_reply(&mut s);
    assert_eq!(
        status,
        0,
        "hello refused: {}",
        String::from_utf8_lossy(&body)
    );
    (s, HelloReply::decode(&body).unwrap().features)
}

fn call(s: &mut UnixStream, op: Op, body: &[u8]) -> (i32, Vec<u8>) {
    s.write_all(&frame(op, 7, body)).unwrap();
    read_reply(s)
}

/// MapPool on `s`: the status, the pool's length and the descriptor that
/// came with the reply.
fn map_pool(s: &mut UnixStream) -> (i32, u64, Option<OwnedFd>) {
    s.write_all(&frame(Op::MapPool, 3, &[])).unwrap();
    let mut head = [0u8; HEADER_LEN];
    let mut got = 0;
    let mut passed = None;
    while got < HEADER_LEN {
        let (n, fd) = kvtier_wire::shm::recv_some_with_fd(s, &mut head[got..]).unwrap();
        assert!(n > 0, "the server closed the connection");
        passed = passed.or(fd);
        got += n;
    }
    let len = u32::from_le_bytes(head[16..20].try_into().unwrap()) as usize;
    let status = i32::from_le_bytes(head[20..24].try_into().unwrap());
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).unwrap();
    let pool_len = if status == code::OK {
        Reader::new(&body).u64().unwrap()
    } else {
        0
    };
    (status, pool_len, passed)
}

/// LeaseValues of `keys`, each with `room` bytes: the status, and the
/// lease and its table when it was granted.
fn lease(s: &mut UnixStream, keys: &[Vec<u8>], room: u64) -> (i32, Option<(u64, Vec<Leased>)>) {
    let items = keys.iter().map(|k| (&k[..], room)).collect();
    let (status, body) = call(s, Op::LeaseValues, &Request::LeaseValues { items }.encode());
    let granted = (status == code::OK).then(|| decode_lease_reply(&body, keys.len()).unwrap());
    (status, granted)
}

fn release(s: &mut UnixStream, lease: u64) {
    let (status, _) = call(
        s,
        Op::ReleaseLease,
        &Request::ReleaseLease { lease }.encode(),
    );
    assert_eq!(status, code::OK);
}

/// The pool file mapped read-only.
struct Mapped {
    ptr: *const u8,
    len: usize,
}

impl Mapped {
    fn new(fd: &OwnedFd, len: u64) -> Mapped {
        let len = len as usize;
        // SAFETY: a fresh read-only shared mapping of the file, unmapped on drop.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
        Mapped {
            ptr: ptr as *const u8,
            len,
        }
    }

    fn at(&self, offset: u64, len: u64) -> Vec<u8> {
        assert!(offset + len <= self.len as u64);
        // SAFETY: inside the mapping (asserted).
        unsafe { std::slice::from_raw_parts(self.ptr.add(offset as usize), len as usize).to_vec() }
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

#[test]
fn full_scope_clients_copy_values_out_of_a_pool_they_can_only_read() {
    const VALUE: usize = 1 << 20;
    let dir = tempfile::tempdir().unwrap();
    let keys: Vec<Vec<u8>> = (0..16).map(key).collect();
    let values: Vec<Vec<u8>> = keys
        .iter()
        .map(|k| kvtier::pattern::value(k, VALUE))
        .collect();
    {
        let server = ServerProcess::start(dir.path(), &[]);
        let mut client = Client::connect_with(&server.unix_url(), options()).unwrap();
        assert!(
            client.maps_pool(),
            "a full-scope client of the server's user did not map the pool"
        );
        for stored in client.batch_put(&keys, &values).unwrap() {
            stored.unwrap();
        }
        let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; VALUE + 7]).collect();
        let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        for ((got, buf), value) in client
            .batch_get_into(&keys, &mut refs)
            .unwrap()
            .into_iter()
            .zip(&bufs)
            .zip(&values)
        {
            assert_eq!(got.unwrap(), Some(VALUE));
            assert!(
                buf[..VALUE] == value[..],
                "a value copied out of the pool changed"
            );
            assert_eq!(&buf[VALUE..], &[0u8; 7], "bytes past the value written");
        }
        // Every value came out of the mapping: leased and released, never
        // sent or written by the server.
        assert!(ops(&server, "lease_values") >= 1);
        assert!(ops(&server, "release_lease") >= 1);
        assert_eq!(ops(&server, "batch_get_shm_segments"), 0);
        assert_eq!(ops(&server, "batch_get"), 0);
        // A buffer too small and a miss are answered by a get, as without
        // the mapping.
        let mut small = [0u8; 100];
        let mut absent = [0u8; 100];
        let got = client
            .batch_get_into(
                &[keys[0].clone(), b"mapped/absent".to_vec()],
                &mut [&mut small[..], &mut absent[..]],
            )
            .unwrap();
        let too_small = got[0].as_ref().unwrap_err();
        assert_eq!(too_small.kind(), kvtier::ErrorKind::BufferTooSmall);
        assert!(
            too_small.to_string().contains(&VALUE.to_string()),
            "{too_small}"
        );
        assert!(matches!(got[1], Ok(None)));
        client.flush().unwrap();

        // The descriptor the server passes maps read-only and nothing else.
        let (mut s, offered) = said_hello(&server, TEST_TOKEN, "");
        assert_ne!(offered & features::POOL_MAP, 0);
        let (status, pool_len, fd) = map_pool(&mut s);
        assert_eq!(status, code::OK);
        let fd = fd.expect("MapPool's reply carried no descriptor");
        assert!(pool_len >= 64 << 20);
        // SAFETY: attempts on our own copy of the descriptor, each refused.
        unsafe {
            let writable = libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            );
            assert_eq!(writable, libc::MAP_FAILED, "the pool mapped writable");
            assert_eq!(libc::write(fd.as_raw_fd(), b"x".as_ptr().cast(), 1), -1);
            assert_eq!(libc::ftruncate(fd.as_raw_fd(), 4096), -1, "the pool shrank");
            assert_eq!(
                libc::fallocate(
                    fd.as_raw_fd(),
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    0,
                    pool_len as i64
                ),
                -1,
                "a hole was punched in the pool"
            );
        }
        let mapped = Mapped::new(&fd, pool_len);
        let (status, granted) = lease(&mut s, &keys[..2], VALUE as u64);
        assert_eq!(status, code::OK);
        let (id, table) = granted.unwrap();
        for (item, value) in table.iter().zip(&values) {
            assert_eq!((item.code, item.len), (code::OK, VALUE as u64));
            assert!(mapped.at(item.offset, item.len) == *value);
        }
        release(&mut s, id);
        // Ending a lease that is not held is no error.
        release(&mut s, id);
        release(&mut s, u64::MAX);
        // Nothing was written through any of it.
        let mut buf = vec![0u8; VALUE];
        let got = client
            .batch_get_into(&keys[..1], &mut [&mut buf[..]])
            .unwrap();
        assert_eq!(got[0].as_ref().unwrap(), &Some(VALUE));
        assert!(buf == values[0]);

        // A client that asks for no mapping gets values the other ways.
        let unmapped = Client::connect_with(
            &server.unix_url(),
            ClientOptions {
                map_pool: false,
                ..options()
            },
        )
        .unwrap();
        assert!(!unmapped.maps_pool());
    }
    // After a restart the pool is empty: nothing is leased, and the values
    // come from the disk tier by the other paths.
    let server = ServerProcess::start(dir.path(), &[]);
    let mut client = Client::connect_with(&server.unix_url(), options()).unwrap();
    assert!(client.maps_pool());
    let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; VALUE]).collect();
    let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    for ((got, buf), value) in client
        .batch_get_into(&keys, &mut refs)
        .unwrap()
        .into_iter()
        .zip(&bufs)
        .zip(&values)
    {
        assert_eq!(got.unwrap(), Some(VALUE));
        assert!(buf == value);
    }
    assert!(ops(&server, "batch_get_shm_segments") >= 1);
}

#[test]
fn a_leased_extent_is_never_reused_and_leases_stay_within_their_budgets() {
    const VALUE: usize = 512 << 10;
    let dir = tempfile::tempdir().unwrap();
    // 8 MiB of pool: 16 values, and a leasing budget of a quarter, 2 MiB.
    let server = ServerProcess::start(dir.path(), &["--memory", "8MiB"]);
    let mut client = Client::connect_with(&server.unix_url(), options()).unwrap();
    let memory_only = PutOptions {
        tier: PutTier::MemoryOnly,
        ..PutOptions::default()
    };
    let put = |client: &mut Client, keys: &[Vec<u8>]| {
        let values: Vec<Vec<u8>> = keys
            .iter()
            .map(|k| kvtier::pattern::value(k, VALUE))
            .collect();
        for stored in client.batch_put_with(keys, &values, &memory_only).unwrap() {
            stored.unwrap();
        }
    };
    let leased_key = key(0);
    put(&mut client, std::slice::from_ref(&leased_key));
    let (mut s, _) = said_hello(&server, TEST_TOKEN, "");
    let (_, pool_len, fd) = map_pool(&mut s);
    let mapped = Mapped::new(&fd.unwrap(), pool_len);
    let (_, granted) = lease(&mut s, std::slice::from_ref(&leased_key), VALUE as u64);
    let (id, table) = granted.unwrap();
    assert_eq!(table[0].code, code::OK);
    let (offset, len) = (table[0].offset, table[0].len);
    let expected = kvtier::pattern::value(&leased_key, VALUE);
    // Removed, and the pool churned four times over: the leased extent
    // keeps its bytes.
    assert!(client.remove(&leased_key).unwrap());
    for round in 0..4u64 {
        let keys: Vec<Vec<u8>> = (0..16).map(|i| key(1000 + round * 16 + i)).collect();
        put(&mut client, &keys);
    }
    assert!(
        mapped.at(offset, len) == expected,
        "a leased extent was reused while its lease was held"
    );
    // Once released, the next churn takes it (the check above can fail).
    release(&mut s, id);
    for round in 4..8u64 {
        let keys: Vec<Vec<u8>> = (0..16).map(|i| key(1000 + round * 16 + i)).collect();
        put(&mut client, &keys);
    }
    assert!(
        mapped.at(offset, len) != expected,
        "the released extent was never reused: the churn cannot show a lease holding one"
    );

    // The leasing budget: 2 MiB of leased values at once, all connections.
    let resident: Vec<Vec<u8>> = (0..16).map(|i| key(1000 + 7 * 16 + i)).collect();
    let (status, _) = lease(&mut s, &resident[..5], VALUE as u64);
    assert_eq!(status, code::LIMIT, "2.5 MiB leased past a 2 MiB budget");
    let (status, granted) = lease(&mut s, &resident[..4], VALUE as u64);
    assert_eq!(status, code::OK);
    assert!(granted.unwrap().1.iter().all(|l| l.code == code::OK));
    let (mut other, _) = said_hello(&server, TEST_TOKEN, "");
    let (status, _) = lease(&mut other, &resident[4..5], VALUE as u64);
    assert_eq!(
        status,
        code::LIMIT,
        "another connection leased past the budget"
    );
    // A client that goes away gives its leases back.
    drop(s);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, granted) = lease(&mut other, &resident[4..5], VALUE as u64);
        if status == code::OK {
            release(&mut other, granted.unwrap().0);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the leases of a closed connection were never given back"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // At most 64 leases a connection; ending one makes room.
    let small = key(5000);
    client.batch_put(&[&small], &[b"small value"]).unwrap()[0]
        .as_ref()
        .unwrap();
    let mut ids = Vec::new();
    for _ in 0..64 {
        let (status, granted) = lease(&mut other, std::slice::from_ref(&small), 64);
        assert_eq!(status, code::OK);
        ids.push(granted.unwrap().0);
    }
    let (status, _) = lease(&mut other, std::slice::from_ref(&small), 64);
    assert_eq!(status, code::LIMIT, "a 65th lease was granted");
    release(&mut other, ids[0]);
    assert_eq!(
        lease(&mut other, std::slice::from_ref(&small), 64).0,
        code::OK
    );
}

#[test]
fn the_pool_is_offered_only_to_full_scope_clients_of_the_servers_user() {
    const TENANT: &str = "tenant-token-0123456789abcdef";
    let dir = tempfile::tempdir().unwrap();
    let tenants = dir.path().join("tenants.toml");
    std::fs::write(
        &tenants,
        format!("[[tenant]]\nname = \"a\"\ntoken = \"{TENANT}\"\nnamespaces = [\"a/\"]\n"),
    )
    .unwrap();
    std::fs::set_permissions(&tenants, std::fs::Permissions::from_mode(0o600)).unwrap();
    let data = dir.path().join("data");
    let server = ServerProcess::start(&data, &["--tenants", tenants.to_str().unwrap()]);
    let mut full = Client::connect_with(&server.unix_url(), options()).unwrap();
    assert!(full.maps_pool());
    full.batch_put(&[b"k"], &[b"full scope's value"]).unwrap()[0]
        .as_ref()
        .unwrap();
    // A tenant, even over the Unix socket as the server's user: its reads
    // are held to its namespaces, and the pool holds every namespace.
    let tenant = Client::connect_with(
        &server.unix_url(),
        ClientOptions {
            shm_size: 1 << 20,
            ..as_tenant(TENANT, "a/llama")
        },
    )
    .unwrap();
    assert!(!tenant.maps_pool(), "a tenant mapped the whole pool");
    let (mut s, offered) = said_hello(&server, TENANT, "a/llama");
    assert_eq!(offered & features::POOL_MAP, 0);
    let (status, _, fd) = map_pool(&mut s);
    assert_eq!((status, fd.is_some()), (code::UNSUPPORTED, false));
    let (status, _) = lease(&mut s, &[b"k".to_vec()], 64);
    assert_eq!(status, code::UNSUPPORTED, "a tenant leased a value");
    // TCP: not offered, and refused if asked.
    let mut tcp = std::net::TcpStream::connect(&server.tcp).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    tcp.write_all(&frame(Op::Hello, 1, &hello_body(TEST_TOKEN, "")))
        .unwrap();
    let (status, body) = read_reply(&mut tcp);
    assert_eq!(status, 0);
    assert_eq!(
        HelloReply::decode(&body).unwrap().features & features::POOL_MAP,
        0
    );
    tcp.write_all(&frame(Op::MapPool, 2, &[])).unwrap();
    assert_eq!(read_reply(&mut tcp).0, code::UNSUPPORTED);
    tcp.write_all(&frame(
        Op::LeaseValues,
        3,
        &Request::LeaseValues {
            items: vec![(b"k", 64)],
        }
        .encode(),
    ))
    .unwrap();
    assert_eq!(read_reply(&mut tcp).0, code::UNSUPPORTED);
    drop(full);
    drop(server);
    // An operator who turns it off: no client maps the pool.
    let config = dir.path().join("no-map.toml");
    std::fs::write(&config, "map_pool = false\n").unwrap();
    let server = ServerProcess::start(
        &data,
        &[
            "--tenants",
            tenants.to_str().unwrap(),
            "--config",
            config.to_str().unwrap(),
        ],
    );
    let client = Client::connect_with(&server.unix_url(), options()).unwrap();
    assert!(!client.maps_pool());
    let (mut s, offered) = said_hello(&server, TEST_TOKEN, "");
    assert_eq!(offered & features::POOL_MAP, 0);
    assert_eq!(map_pool(&mut s).0, code::UNSUPPORTED);
}
