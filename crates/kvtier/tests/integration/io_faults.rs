//! I/O errors from a fault-injecting engine: a failed write is retried and
//! reported to every caller it concerns; a flusher that dies turns waits
//! into errors; nothing the index says is present is missing its bytes.

use crate::common::*;
use kvtier::test_util::{FaultOp, FaultyEngine};
use kvtier::{ErrorKind, PutOptions, Store};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

fn faulty_store(dir: &Path) -> (Store, Arc<FaultyEngine>) {
    open_faulty(small_config(dir))
}

#[test]
fn a_transient_write_error_is_retried_until_durable() {
    for_each_engine(|_| {
        let dir = tempfile::tempdir().unwrap();
        let (store, faulty) = faulty_store(dir.path());
        faulty.fail(FaultOp::Write, 0, 2, libc::EIO);
        store.put(key(1), value_for(&key(1), 1, 50_000)).unwrap();
        // Flushes may report the failure while the retry is pending, but
        // one succeeds once the retry lands.
        let ok = flush_succeeds_within(&store, 200);
        assert!(ok, "the retried write never became durable");
        assert!(store.stats().flush_errors >= 1);
        assert_eq!(store.stats().retrying_writes, 0);
        drop(store);
        let store = open(small_config(dir.path()));
        assert_eq!(
            store.get(key(1)).unwrap().unwrap(),
            value_for(&key(1), 1, 50_000)
        );
    });
}

#[test]
fn a_lasting_write_error_reaches_every_caller_it_concerns() {
    for_each_engine(|_| {
        let dir = tempfile::tempdir().unwrap();
        let (store, faulty) = faulty_store(dir.path());
        store.put(key(0), value_for(&key(0), 0, 30_000)).unwrap();
        store.flush().unwrap();
        faulty.fail(FaultOp::Write, 0, u64::MAX, libc::EIO);
        let store = Arc::new(store);
        store.put(key(1), value_for(&key(1), 1, 30_000)).unwrap();
        // Two callers flush: neither "consumes" the failure for the other.
        let other = {
            let store = Arc::clone(&store);
            std::thread::spawn(move || store.flush())
        };
        let mine = store.flush();
        let theirs = other.join().unwrap();
        assert!(mine.is_err() && theirs.is_err(), "{mine:?} {theirs:?}");
        assert!(store.flush().is_err(), "a failure is not consumed");
        // A durable put fails on its own write, a remove too.
        let durable = PutOptions {
            durable: true,
            ..PutOptions::default()
        };
        assert!(store
            .put_with(key(2), value_for(&key(2), 2, 30_000), &durable)
            .is_err());
        assert!(store.remove(key(0)).is_err());
        assert!(store.stats().retrying_writes >= 1);
        // Gets keep working from memory and disk meanwhile.
        assert_eq!(
            store.get(key(1)).unwrap().unwrap(),
            value_for(&key(1), 1, 30_000)
        );
        // The disk heals: the retries land, and every later flush is Ok.
        faulty.clear_faults();
        let healed = flush_succeeds_within(&store, 300);
        assert!(healed, "the store did not recover when the disk did");
        assert_eq!(store.stats().retrying_writes, 0);
        Arc::into_inner(store).unwrap().close().unwrap();
        let store = open(small_config(dir.path()));
        assert_eq!(
            store.get(key(0)).unwrap(),
            None,
            "the retried remove landed"
        );
        for k in [1u64, 2] {
            assert_eq!(
                store.get(key(k)).unwrap().unwrap(),
                value_for(&key(k), k, 30_000)
            );
        }
    });
}

/// A disk that stays broken: the unwritten values stay pinned, the pool
/// fills, and puts fail with `NoSpace` after their bounded wait instead of
/// silently dropping data; gets keep working; close reports the loss.
#[test]
fn a_broken_disk_fills_the_pool_then_puts_fail_cleanly() {
    for_each_engine(|_| {
        let dir = tempfile::tempdir().unwrap();
        // The first region's header passes; every later write fails.
        let (wrapper, _slot) =
            faulty_wrapper(|faulty| faulty.fail(FaultOp::Write, 1, u64::MAX, libc::EIO));
        let config = small_config(dir.path())
            .put_wait(Duration::from_millis(200))
            .wrap_io_engine(wrapper);
        let store = Store::open(config).unwrap();
        let mut no_space = None;
        for i in 0..200u64 {
            match store.put(key(i), value_for(&key(i), 1, 100_000)) {
                Ok(()) => {}
                Err(e) => {
                    no_space = Some((i, e));
                    break;
                }
            }
        }
        let (at, err) = no_space.expect("puts never ran out of pool space");
        assert_eq!(err.kind(), ErrorKind::NoSpace, "{err}");
        assert!(at >= 30, "the 4 MiB pool holds about 40 such values: {at}");
        for i in 0..at {
            assert_eq!(
                store.get(key(i)).unwrap().unwrap(),
                value_for(&key(i), 1, 100_000),
                "unwritten values stay readable"
            );
        }
        assert!(
            store.close().is_err(),
            "close reports writes it could not make durable"
        );
    });
}

#[test]
fn a_dying_flusher_turns_waits_into_errors() {
    for_each_engine(|_| {
        let dir = tempfile::tempdir().unwrap();
        let (store, faulty) = faulty_store(dir.path());
        faulty.panic_on_next(FaultOp::Write);
        store.put(key(1), value_for(&key(1), 1, 10_000)).unwrap();
        let err = store.flush().unwrap_err();
        assert!(err.to_string().contains("flusher thread died"), "{err}");
        assert!(store.remove(key(1)).is_err());
        let err = store.put(key(2), vec![1u8; 100]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Io);
        assert!(err.to_string().contains("flusher thread died"), "{err}");
        // What is in memory is still served.
        assert_eq!(
            store.get(key(1)).unwrap().unwrap(),
            value_for(&key(1), 1, 10_000)
        );
        assert!(store.close().is_err());
    });
}
