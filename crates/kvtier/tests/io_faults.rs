//! I/O errors from a fault-injecting engine: a failed write is retried and
//! reported to every caller it concerns; a flusher that dies turns waits
//! into errors; nothing the index says is present is missing its bytes.

mod common;

use common::*;
use kvtier::disk::faulty::{FaultOp, FaultyEngine};
use kvtier::disk::io::IoEngine;
use kvtier::{EngineWrapper, ErrorKind, PutOptions, Store};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

fn open_faulty(dir: &Path) -> (Store, Arc<FaultyEngine>) {
    let slot: Arc<Mutex<Option<Arc<FaultyEngine>>>> = Arc::default();
    let wrap_slot = Arc::clone(&slot);
    let wrapper = EngineWrapper(Arc::new(move |inner: Arc<dyn IoEngine>| {
        let faulty = FaultyEngine::new(inner);
        *wrap_slot.lock().unwrap() = Some(Arc::clone(&faulty));
        faulty as Arc<dyn IoEngine>
    }));
    let store = Store::open(small_config(dir).wrap_io_engine(wrapper)).unwrap();
    let faulty = slot.lock().unwrap().take().unwrap();
    (store, faulty)
}

#[test]
fn a_transient_write_error_is_retried_until_durable() {
    for_each_engine(|_| {
        let dir = tempfile::tempdir().unwrap();
        let (store, faulty) = open_faulty(dir.path());
        faulty.fail(FaultOp::Write, 0, 2, libc::EIO);
        store.put(key(1), value_for(&key(1), 1, 50_000)).unwrap();
        // Flushes may report the failure while the retry is pending, but
        // one succeeds once the retry lands.
        let mut ok = false;
        for _ in 0..200 {
            if store.flush().is_ok() {
                ok = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(ok, "the retried write never became durable");
        assert!(store.stats().flush_errors >= 1);
        assert_eq!(store.stats().failed_writes, 0);
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
        let (store, faulty) = open_faulty(dir.path());
        store.put(key(0), value_for(&key(0), 0, 30_000)).unwrap();
        store.flush().unwrap();
        faulty.fail(FaultOp::Write, 0, u64::MAX, libc::ENOSPC);
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
        // A durable put fails on its own write, a remove too.
        let durable = PutOptions {
            durable: true,
            ..PutOptions::default()
        };
        assert!(store
            .put_with(key(2), value_for(&key(2), 2, 30_000), &durable)
            .is_err());
        assert!(store.remove(key(0)).is_err());
        // Gets keep working from memory and disk meanwhile.
        assert_eq!(
            store.get(key(1)).unwrap().unwrap(),
            value_for(&key(1), 1, 30_000)
        );
        // After every retry the writes count as failed, and stay reported.
        let mut given_up = false;
        for _ in 0..300 {
            if store.stats().failed_writes > 0 {
                given_up = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(given_up, "the flusher never gave up on a dead disk");
        assert!(store.flush().is_err());
        assert!(store.flush().is_err(), "a failure is not consumed");
        faulty.clear_faults();
        // New writes succeed again, yet the lost ones stay reported.
        store
            .put_with(key(3), value_for(&key(3), 3, 30_000), &durable)
            .unwrap();
        assert!(store.flush().is_err());
        assert!(store.close().is_err());
    });
}

#[test]
fn a_dying_flusher_turns_waits_into_errors() {
    for_each_engine(|_| {
        let dir = tempfile::tempdir().unwrap();
        let (store, faulty) = open_faulty(dir.path());
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
