//! A shared-memory client that writes into its own get destination while
//! the server's disk reads land there must not make the server call
//! durable entries damaged (and drop them): a value whose bytes do not
//! verify in client memory is read again into the server's private memory
//! before anything counts as a checksum failure.

use crate::common::{frame, hello_body, memfd, options, read_reply, ServerProcess, TEST_TOKEN};
use kvtier_client::Client;
use kvtier_wire::protocol::{Op, Writer};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

const KEYS: u64 = 24;
const VALUE: usize = 1 << 20;

fn key(i: u64) -> Vec<u8> {
    format!("scribbled/{i}").into_bytes()
}

/// A mapping of our own memfd, written by a scribbler thread through raw
/// pointers (no Rust reference: the server writes it too).
struct Mapping {
    ptr: *mut u8,
    len: usize,
}
// SAFETY: plain shared memory, only ever touched through raw volatile
// writes here.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

#[test]
fn a_client_scribbling_on_its_get_destination_loses_no_durable_entry() {
    let dir = tempfile::tempdir().unwrap();
    {
        let server = ServerProcess::start(dir.path(), &[]);
        let mut client = Client::connect_with(&server.unix_url(), options()).unwrap();
        for i in 0..KEYS {
            let value = kvtier::pattern::value(&key(i), VALUE);
            client.batch_put(&[&key(i)], &[&value]).unwrap()[0]
                .as_ref()
                .unwrap();
        }
        client.flush().unwrap();
    }
    // A restart: the pool is empty, every get reads the disk.
    let server = ServerProcess::start(dir.path(), &[]);
    let len = KEYS as usize * VALUE;
    let fd = memfd(len as i64, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW);
    // SAFETY: a shared mapping of our own memfd, checked below.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    assert_ne!(ptr, libc::MAP_FAILED);
    let mapping = Mapping {
        ptr: ptr.cast(),
        len,
    };
    let mut s = UnixStream::connect(&server.unix).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(&frame(Op::Hello, 1, &hello_body(TEST_TOKEN, "")))
        .unwrap();
    assert_eq!(read_reply(&mut s).0, 0);
    let mut w = Writer::default();
    w.u64(len as u64);
    kvtier_wire::shm::send_with_fd(&s, &frame(Op::RegisterBuffer, 2, &w.buf), fd.as_raw_fd())
        .unwrap();
    assert_eq!(read_reply(&mut s).0, 0, "register");

    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let (mapping, stop) = (&mapping, &stop);
        scope.spawn(move || {
            let mut round = 0u8;
            while !stop.load(Ordering::Relaxed) {
                round = round.wrapping_add(1);
                for offset in (0..mapping.len).step_by(512) {
                    // SAFETY: in bounds of our mapping; raw volatile writes.
                    unsafe { mapping.ptr.add(offset).write_volatile(round) };
                }
            }
        });
        // Every key, read into the buffer the scribbler is writing, a few
        // times over.
        for attempt in 0..4u64 {
            let mut w = Writer::default();
            w.u32(1).u32(KEYS as u32);
            for i in 0..KEYS {
                w.key(&key(i)).u64(i * VALUE as u64).u64(VALUE as u64);
            }
            s.write_all(&frame(Op::BatchGetShm, 10 + attempt, &w.buf))
                .unwrap();
            let (status, _) = read_reply(&mut s);
            assert_eq!(status, 0, "batch get shm");
        }
        stop.store(true, Ordering::Relaxed);
    });
    // Nothing was dropped: a clean reader gets every value, verified.
    let mut clean = Client::connect_with(&server.tcp_url(), options()).unwrap();
    let mut buf = vec![0u8; VALUE];
    for i in 0..KEYS {
        let got = clean
            .batch_get_into(&[&key(i)], &mut [&mut buf[..]])
            .unwrap();
        assert_eq!(
            got[0].as_ref().unwrap(),
            &Some(VALUE),
            "key {i} was dropped after the scribbled reads"
        );
        assert!(kvtier::pattern::verify(&key(i), &buf), "key {i}");
    }
    let stats = server.stats();
    let failures = stats["store"]["checksum_failures"].as_u64().unwrap();
    eprintln!("checksum failures counted: {failures}");
    assert_eq!(failures, 0, "client memory was taken for disk damage");
    // SAFETY: unmapping our own mapping.
    unsafe { libc::munmap(mapping.ptr.cast(), mapping.len) };
}
