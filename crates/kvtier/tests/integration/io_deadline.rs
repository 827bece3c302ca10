//! The storage deadline (`Config::io_deadline`): a file system that stops
//! answering (held here by a fault-injecting engine's gate, as a stopped
//! FUSE daemon holds reads) costs a caller at most the deadline, answered
//! as misses for reads and as a `TimedOut` error for flushes; a read that
//! outlives its deadline never lands in the caller's memory, and nothing
//! is lost when the file system answers again. The same against a real
//! JuiceFS daemon stopped with SIGSTOP: `kvtier-cli`'s shared_storage
//! tests.
//!
//! No assertion here is about time: "the caller got its answer while the
//! read was still held" is shown by the gate's count, not by a clock.

use crate::common::*;
use kvtier::test_util::FaultyEngine;
use kvtier::{Config, ErrorKind, PutOptions, Store};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

const LEN: usize = 100_000;
const SENTINEL: u8 = 0xa5;

/// A small store whose reads and writes are all bounded by a short
/// deadline (local files are bounded only when asked).
fn bounded_config(dir: &Path) -> Config {
    small_config(dir)
        .io_deadline(Duration::from_millis(200))
        .io_deadline_local(true)
}

/// Opens `config` with a fault-injecting engine under its bounded reads.
fn open_with_bounded_faults(config: Config) -> (Store, Arc<FaultyEngine>) {
    let (wrapper, slot) = faulty_wrapper(|_| {});
    let store = open(config.wrap_bounded_io_engine(wrapper));
    let faulty = slot.lock().unwrap().take().expect("a bounded engine");
    (store, faulty)
}

/// Waits (bounded only against a hang) until `done` holds.
fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{what}: not within 60 s"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn reads_of_a_stalled_file_system_answer_misses_and_never_land_late() {
    let dir = tempfile::tempdir().unwrap();
    let keys: Vec<Vec<u8>> = (0..8).map(key).collect();
    {
        let store = open(bounded_config(dir.path()));
        for (i, k) in keys.iter().enumerate() {
            store.put(k, value_for(k, i as u64, LEN)).unwrap();
        }
        store.close().unwrap();
    }
    // Reopened: the pool is empty, every hit is a disk read.
    let (store, faulty) = open_with_bounded_faults(bounded_config(dir.path()));
    assert_eq!(
        store.get(&keys[0]).unwrap().as_deref(),
        Some(&value_for(&keys[0], 0, LEN)[..])
    );

    faulty.stall(true, false);
    let mut bufs: Vec<Vec<u8>> = (0..4).map(|_| vec![SENTINEL; LEN]).collect();
    let got = {
        let mut dests: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        store.batch_get_into(&keys[..4], &mut dests)
    };
    for r in &got {
        assert!(
            matches!(r, Ok(None)),
            "a read past its deadline is a miss: {r:?}"
        );
    }
    let stats = store.stats();
    assert_eq!(stats.io_deadline_misses, 4, "{stats:?}");
    assert_eq!(stats.io_stalls, 1);
    assert_eq!(stats.io_stalled_reads, 1);
    assert!(stats.io_stalled_read_bytes >= 4 * LEN as u64);
    // The caller was answered while its read is still held (the gate holds
    // it until `resume`; `io_stalled_reads` above counts it as not back).
    eventually("the read reached the gate", || faulty.held().0 == 1);
    // Memory hits never wait on the file system.
    store.put(key(100), value_for(&key(100), 9, LEN)).unwrap();
    assert_eq!(
        store.get(key(100)).unwrap().as_deref(),
        Some(&value_for(&key(100), 9, LEN)[..])
    );
    // A second read while the first is held: its own deadline, its own miss.
    assert_eq!(store.get(&keys[5]).unwrap(), None);
    eventually("both reads are held", || faulty.held().0 == 2);
    assert_eq!(store.stats().io_stalled_reads, 2);

    faulty.resume();
    eventually("the held reads came back", || {
        store.stats().io_stalled_reads == 0
    });
    // The late reads landed in the store's own buffers, never the caller's.
    for buf in &bufs {
        assert!(
            buf.iter().all(|&b| b == SENTINEL),
            "a late read wrote the caller's buffer"
        );
    }
    // Nothing was taken for damage: every value reads again.
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(
            store.get(k).unwrap().as_deref(),
            Some(&value_for(k, i as u64, LEN)[..]),
            "{k:?}"
        );
    }
    let stats = store.stats();
    assert_eq!(stats.checksum_failures, 0);
    assert_eq!(stats.io_stalled_read_bytes, 0);
    assert_eq!(stats.io_deadline_misses, 5);
}

#[test]
fn without_a_deadline_local_reads_are_not_bounded() {
    // The default bounds only file systems that can stall: a local disk's
    // reads go straight into the caller's memory, through the main engine.
    let dir = tempfile::tempdir().unwrap();
    {
        let store = open(small_config(dir.path()));
        store.put(key(1), value_for(&key(1), 1, LEN)).unwrap();
        store.close().unwrap();
    }
    let (store, faulty) = open_with_bounded_faults(small_config(dir.path()));
    faulty.stall(true, true);
    assert_eq!(
        store.get(key(1)).unwrap().as_deref(),
        Some(&value_for(&key(1), 1, LEN)[..])
    );
    assert_eq!(faulty.held(), (0, 0));
    assert_eq!(store.stats().io_deadline_ms, 5000);
}

#[test]
fn a_flush_of_a_stalled_log_times_out_and_its_writes_land_when_it_answers() {
    let dir = tempfile::tempdir().unwrap();
    let (store, faulty) = open_faulty(bounded_config(dir.path()));
    store.put(key(1), value_for(&key(1), 1, LEN)).unwrap();
    store.flush().unwrap();

    faulty.stall(false, true);
    store.put(key(2), value_for(&key(2), 2, LEN)).unwrap();
    let err = store.flush().expect_err("a flush past the deadline fails");
    assert_eq!(err.kind(), ErrorKind::Io, "{err}");
    assert!(err.to_string().contains("storage deadline"), "{err}");
    let durable = PutOptions {
        durable: true,
        ..PutOptions::default()
    };
    let err = store
        .put_with(key(3), value_for(&key(3), 3, LEN), &durable)
        .expect_err("a durable put past the deadline fails");
    assert!(err.to_string().contains("storage deadline"), "{err}");
    eventually("the flusher is held at the gate", || faulty.held().0 >= 1);
    assert_eq!(store.stats().io_deadline_write_errors, 2);
    // Readable from memory meanwhile.
    for k in [1u64, 2, 3] {
        assert_eq!(
            store.get(key(k)).unwrap().as_deref(),
            Some(&value_for(&key(k), k, LEN)[..])
        );
    }

    faulty.resume();
    store.flush().unwrap();
    store.close().unwrap();
    let store = open(small_config(dir.path()));
    for k in [1u64, 2, 3] {
        assert_eq!(
            store.get(key(k)).unwrap().as_deref(),
            Some(&value_for(&key(k), k, LEN)[..]),
            "the writes queued during the stall are durable"
        );
    }
}

#[test]
fn a_deadline_outside_its_range_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for bad in [Duration::from_millis(5), Duration::from_secs(7200)] {
        let err = Store::open(small_config(dir.path()).io_deadline(bad)).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument);
        assert!(err.to_string().contains("io_deadline"), "{err}");
    }
    // Zero turns it off.
    let store = open(small_config(dir.path()).io_deadline(Duration::ZERO));
    assert_eq!(store.stats().io_deadline_ms, 0);
}
