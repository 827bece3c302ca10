//! The public API's contract: results per key, limits, errors, tiers.

use crate::common::*;
use kvtier::{block_keys, Config, ErrorKind, PutOptions, PutTier, Store, MAX_KEY_LEN};

#[test]
fn put_get_round_trip_in_memory_and_after_reopen() {
    for_each_engine(|_engine| {
        let dir = tempfile::tempdir().unwrap();
        let store = open(small_config(dir.path()));
        for i in 0..20 {
            store
                .put(key(i), value_for(&key(i), 0, 70_000 + i as usize))
                .unwrap();
        }
        for i in 0..20 {
            assert_eq!(
                store.get(key(i)).unwrap().unwrap(),
                value_for(&key(i), 0, 70_000 + i as usize)
            );
        }
        store.flush().unwrap();
        let stats = store.stats();
        assert_eq!(stats.entries, 20);
        assert_eq!(stats.disk_entries, 20);
        assert_eq!(stats.memory_hits, 20);
        drop(store);

        let store = open(small_config(dir.path()));
        // A clean close: the index comes from its checkpoint.
        assert_eq!(store.stats().checkpoint_entries_loaded, 20);
        for i in 0..20 {
            assert_eq!(
                store.get(key(i)).unwrap().unwrap(),
                value_for(&key(i), 0, 70_000 + i as usize)
            );
        }
        assert_eq!(store.stats().disk_hits, 20);
        assert_eq!(store.get(b"absent").unwrap(), None);
    });
}

#[test]
fn batch_operations_report_per_key() {
    for_each_engine(|_engine| {
        let dir = tempfile::tempdir().unwrap();
        let store = open(small_config(dir.path()));
        let keys: Vec<Vec<u8>> = (0..6).map(key).collect();
        let values: Vec<Vec<u8>> = keys.iter().map(|k| value_for(k, 1, 65536)).collect();
        let results = store.batch_put(&keys[..4], &values[..4]);
        assert!(results.iter().all(Result::is_ok));
        assert_eq!(
            store.batch_exists(&keys),
            vec![true, true, true, true, false, false]
        );
        assert_eq!(store.prefix_len(&keys), 4);
        assert_eq!(store.prefix_len(&[&keys[1], &keys[5], &keys[2]]), 1);

        let mut bufs: Vec<Vec<u8>> =
            vec![vec![0; 65536], vec![0; 100], vec![0; 65536], vec![0; 65536]];
        let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        let got = store.batch_get_into(&[&keys[0], &keys[1], &keys[5], &keys[3]], &mut slices);
        assert_eq!(got[0].as_ref().unwrap(), &Some(65536));
        assert_eq!(
            got[1].as_ref().unwrap_err().kind(),
            ErrorKind::BufferTooSmall
        );
        assert_eq!(got[2].as_ref().unwrap(), &None);
        assert_eq!(got[3].as_ref().unwrap(), &Some(65536));
        assert_eq!(bufs[0], values[0]);
        assert_eq!(bufs[3], values[3]);

        // Mismatched lengths fail every key, clearly.
        let results = store.batch_put(&keys[..2], &values[..1]);
        assert_eq!(results.len(), 2);
        assert!(results
            .iter()
            .all(|r| r.as_ref().unwrap_err().kind() == ErrorKind::InvalidArgument));
    });
}

#[test]
fn skip_existing_keeps_the_first_value() {
    for_each_engine(|_engine| {
        let dir = tempfile::tempdir().unwrap();
        let store = open(small_config(dir.path()));
        store.put(b"k", b"first").unwrap();
        let options = PutOptions {
            skip_existing: true,
            ..Default::default()
        };
        store.put_with(b"k", b"second", &options).unwrap();
        store.put_with(b"other", b"new", &options).unwrap();
        assert_eq!(store.get(b"k").unwrap().unwrap(), b"first");
        assert_eq!(store.get(b"other").unwrap().unwrap(), b"new");
        store.put(b"k", b"third").unwrap();
        assert_eq!(store.get(b"k").unwrap().unwrap(), b"third");
    });
}

#[test]
fn bad_keys_and_values_get_clear_errors() {
    for_each_engine(|_engine| {
        let dir = tempfile::tempdir().unwrap();
        let store = open(small_config(dir.path()).max_value_size(MIB));
        let long_key = vec![b'k'; MAX_KEY_LEN + 1];
        let err = store.put(&long_key, b"v").unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument);
        assert!(err.to_string().contains("257 bytes"), "{err}");
        assert!(store.put(vec![b'k'; MAX_KEY_LEN], b"v").is_ok());
        assert_eq!(
            store.put(b"", b"v").unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        let err = store.put(b"k", b"").unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument);
        assert!(err.to_string().contains("empty"), "{err}");
        let err = store.put(b"k", vec![1u8; MIB as usize + 1]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument);
        assert!(err.to_string().contains("max value size"), "{err}");
        assert!(store.get(&long_key).is_err());
        assert_eq!(
            store.batch_exists(&[&long_key[..], b""]),
            vec![false, false]
        );
        // Nothing else was disturbed.
        assert_eq!(store.stats().entries, 1);
        let mut small = [0u8; 4];
        store.put(b"big", vec![9u8; 5000]).unwrap();
        let got = store.batch_get_into(&[b"big"], &mut [&mut small[..]]);
        let err = got[0].as_ref().unwrap_err();
        assert_eq!(err.kind(), ErrorKind::BufferTooSmall);
        assert!(err.to_string().contains("5000"), "{err}");
    });
}

#[test]
fn a_value_larger_than_the_pool_is_no_space() {
    for_each_engine(|_engine| {
        let dir = tempfile::tempdir().unwrap();
        let store = open(small_config(dir.path()));
        let err = store.put(b"huge", vec![1u8; 5 * MIB as usize]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::NoSpace);
        assert!(err.to_string().contains("at most"), "{err}");
    });
}

#[test]
fn invalid_configuration_is_rejected() {
    for_each_engine(|_engine| {
        let dir = tempfile::tempdir().unwrap();
        let err = Store::open(
            Config::new(dir.path())
                .io_engine(engine())
                .disk_capacity(MIB)
                .region_size(MIB),
        )
        .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument);
        let err = Store::open(small_config(dir.path()).region_size(1000)).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument);
        for piece in [0, 1000, 128 * MIB] {
            let err = Store::open(small_config(dir.path()).read_piece(piece)).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidArgument, "read_piece {piece}");
        }
        // Without an explicit region size, a small disk tier gets small
        // regions instead of an error.
        let config = Config::new(dir.path())
            .io_engine(engine())
            .memory_capacity(MIB)
            .disk_capacity(4 * MIB);
        assert_eq!(config.effective_region_size(), 512 * 1024);
        let store = Store::open(config).unwrap();
        store.put(b"k", b"v").unwrap();
    });
}

#[test]
fn a_locked_directory_cannot_be_opened_twice() {
    for_each_engine(|_engine| {
        let dir = tempfile::tempdir().unwrap();
        let store = open(small_config(dir.path()));
        let err = Store::open(small_config(dir.path())).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Locked);
        assert!(
            err.to_string().contains("in use by another process"),
            "{err}"
        );
        assert!(
            err.to_string().contains(&std::process::id().to_string()),
            "{err}"
        );
        store.close().unwrap();
        // Closing releases the directory even while the handle lives: the
        // reopen waits out what still holds it a moment after the close
        // (the rings' asynchronous release of the directory, or a parallel
        // test's fork() child with a copy of every descriptor).
        let again = Store::open(small_config(dir.path()));
        let again = again.expect("reopen after close");
        assert_eq!(store.put(b"k", b"v").unwrap_err().kind(), ErrorKind::Closed);
        drop(again);
    });
}

#[test]
fn a_closed_store_can_be_reopened_at_once_in_the_same_process() {
    for_each_engine(|_engine| {
        let dir = tempfile::tempdir().unwrap();
        for cycle in 0..30u64 {
            let store = Store::open(small_config(dir.path()))
                .unwrap_or_else(|e| panic!("reopen {cycle}: {e}"));
            for k in 0..4u64 {
                let key = format!("k{cycle}-{k}");
                store
                    .put(key.as_bytes(), value_for(key.as_bytes(), 0, 8192))
                    .unwrap();
            }
            store.flush().unwrap();
            if cycle % 2 == 0 {
                drop(store);
            } else {
                store.close().unwrap();
            }
        }
    });
}

#[test]
fn remove_is_durable_and_reports_presence() {
    for_each_engine(|_engine| {
        let dir = tempfile::tempdir().unwrap();
        let store = open(small_config(dir.path()));
        store.put(b"a", value_for(b"a", 0, 10_000)).unwrap();
        store.put(b"b", value_for(b"b", 0, 10_000)).unwrap();
        store.flush().unwrap();
        assert!(store.remove(b"a").unwrap());
        assert!(!store.remove(b"a").unwrap());
        assert!(!store.exists(b"a"));
        // A memory-only overwrite of a durable key, then removed: the old
        // durable value must not come back either.
        store
            .put_with(
                b"b",
                b"mem",
                &PutOptions {
                    tier: PutTier::MemoryOnly,
                    ..Default::default()
                },
            )
            .unwrap();
        assert!(store.remove(b"b").unwrap());
        drop(store);
        let store = open(small_config(dir.path()));
        assert_eq!(store.get(b"a").unwrap(), None);
        assert_eq!(store.get(b"b").unwrap(), None);
    });
}

#[test]
fn memory_only_store_without_disk_tier() {
    for_each_engine(|_engine| {
        let dir = tempfile::tempdir().unwrap();
        let store = open(
            Config::new(dir.path())
                .io_engine(engine())
                .memory_capacity(MIB)
                .disk_capacity(0),
        );
        for i in 0..64 {
            store.put(key(i), value_for(&key(i), 0, 64 * 1024)).unwrap();
        }
        store.flush().unwrap();
        let stats = store.stats();
        assert!(stats.memory_bytes <= MIB);
        assert!(stats.evictions >= 48, "{stats:?}");
        // Survivors read back correctly; evicted keys are misses.
        let mut hits = 0;
        for i in 0..64 {
            if let Some(v) = store.get(key(i)).unwrap() {
                assert_eq!(v, value_for(&key(i), 0, 64 * 1024));
                hits += 1;
            }
        }
        assert!(hits > 0 && hits <= 16, "{hits}");
    });
}

#[test]
fn durable_put_waits_for_disk() {
    for_each_engine(|_engine| {
        let dir = tempfile::tempdir().unwrap();
        let store = open(small_config(dir.path()).flush_policy(kvtier::FlushPolicy::OnDemand));
        store.put(b"lazy", b"x").unwrap();
        let options = PutOptions {
            durable: true,
            ..Default::default()
        };
        store.put_with(b"now", b"y", &options).unwrap();
        assert!(store.stats().disk_entries >= 1);
        drop(store);
        let store = open(small_config(dir.path()));
        assert_eq!(store.get(b"now").unwrap().unwrap(), b"y");
    });
}

/// Write-back yields to reads (`Config::flush_yield`), but never holds up
/// what waits for the disk. With reads "never" pausing (a quiet interval
/// and a bound of an hour), a write-through put stays queued behind a
/// read, until the queued values pass a quarter of the pool; a flush, a
/// removal, puts that need the pool's space and close each still get
/// their writes made durable at once.
#[test]
fn write_back_yields_to_reads_but_never_holds_up_what_waits_for_the_disk() {
    for_each_engine(|_engine| {
        let dir = tempfile::tempdir().unwrap();
        let hour = std::time::Duration::from_secs(3600);
        let config = || {
            small_config(dir.path())
                .flush_yield(hour)
                .flush_yield_quiet(hour)
        };
        let store = open(config());
        store.put(b"read", b"r").unwrap();
        store.flush().unwrap();
        // A read first, so the flusher finds one recent when the put wakes it.
        assert_eq!(store.get(b"read").unwrap().unwrap(), b"r");
        store.put(b"held", b"x").unwrap();
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert_eq!(
            store.disk_location(b"held").unwrap(),
            None,
            "written while reads had not paused"
        );
        store.flush().unwrap();
        assert!(
            store.disk_location(b"held").unwrap().is_some(),
            "flush wrote it"
        );

        // Removals wait for their tombstone: not held.
        store.put(b"gone", b"y").unwrap();
        assert!(store.remove(b"gone").unwrap());

        // Queued values reaching a quarter of the pool (1 MiB of 4) are
        // written without a request, reads or not.
        assert_eq!(store.get(b"read").unwrap().unwrap(), b"r");
        for i in 100..104 {
            store
                .put(key(i), value_for(&key(i), 0, 256 * 1024))
                .unwrap();
        }
        let waited = std::time::Instant::now();
        while (100..104).any(|i| store.disk_location(key(i)).unwrap().is_none()) {
            assert!(
                waited.elapsed() < std::time::Duration::from_secs(120),
                "1 MiB of a 4 MiB pool held for reads"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }

        // Twice the pool's 4 MiB in write-through puts, a read before each:
        // every put finds room.
        let value = |i: u64| value_for(&key(i), 0, 256 * 1024);
        for i in 0..32 {
            assert_eq!(store.get(b"read").unwrap().unwrap(), b"r");
            store.put(key(i), value(i)).unwrap();
        }
        assert_eq!(store.get(b"read").unwrap().unwrap(), b"r");
        store.put(b"at-close", b"z").unwrap();
        drop(store);

        // Close wrote everything queued.
        let store = open(small_config(dir.path()));
        assert_eq!(store.get(b"held").unwrap().unwrap(), b"x");
        assert_eq!(store.get(b"gone").unwrap(), None);
        assert_eq!(store.get(b"at-close").unwrap().unwrap(), b"z");
        for i in 0..32 {
            assert_eq!(store.get(key(i)).unwrap().unwrap(), value(i), "key {i}");
        }
    });
}

/// Fixed vectors pin the chained-key algorithm: changing it would orphan
/// every deployed cache. They were computed independently of this crate,
/// in Python with the `blake3` package, following the algorithm documented
/// in `kvtier::prefix`.
#[test]
fn block_keys_fixed_vectors() {
    for_each_engine(|_engine| {
        let tokens: Vec<u32> = (0..10).collect();
        let keys = block_keys(&tokens, 4, b"");
        assert_eq!(keys.len(), 2, "the trailing partial block gets no key");
        let hex: Vec<String> = keys.iter().map(|k| k.to_hex()).collect();
        assert_eq!(
            hex,
            [
                "9941b995a131c3d47a9775630915e6f364e7d0fbddeef515ecd83857d9d209bd",
                "fdbea0a8db9851a21daf231d175175eef988ea431b32e41ef86844d7876649b6"
            ]
        );
        let salted = block_keys(&tokens, 4, b"model-a");
        assert_eq!(
            salted[0].to_hex(),
            "f6d35cf1145a944cbda194080ebe901ca12e6f6691aaf7d8ed6329dbcfdc2618"
        );
        assert_eq!(
            salted[1].to_hex(),
            "631f22dad09d98b8c54c293c542c76e22ed06cbef9e5c7ec7e8f86284583c82d"
        );
        // Chaining: block 1's key depends on block 0's tokens.
        let mut other = tokens.clone();
        other[0] = 99;
        let changed = block_keys(&other, 4, b"");
        assert_ne!(changed[1], keys[1]);
        assert_eq!(block_keys(&tokens[4..8], 4, b"").len(), 1);
        assert_ne!(block_keys(&tokens[4..8], 4, b"")[0], keys[1]);
        assert!(block_keys(&tokens[..3], 4, b"").is_empty());
    });
}

#[test]
fn many_threads_share_one_store() {
    for_each_engine(|_engine| {
        let dir = tempfile::tempdir().unwrap();
        let store = std::sync::Arc::new(open(small_config(dir.path())));
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let store = store.clone();
                std::thread::spawn(move || {
                    for i in 0..100 {
                        let k = key(t * 1000 + i);
                        store.put(&k, value_for(&k, t, 20_000)).unwrap();
                        // Another thread never writes this key, and the
                        // disk tier holds all 400 values: every read hits,
                        // exactly.
                        let got = store.get(&k).unwrap();
                        assert_eq!(got, Some(value_for(&k, t, 20_000)), "key {t}/{i}");
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        store.flush().unwrap();
        assert_eq!(store.stats().puts, 400);
        for t in 0..4u64 {
            for i in 0..100 {
                let k = key(t * 1000 + i);
                assert_eq!(store.get(&k).unwrap(), Some(value_for(&k, t, 20_000)));
            }
        }
    });
}

/// The uring engine registers the pool (fixed buffers) and region files
/// where it can, reports so in stats, and moves the same bytes either way,
/// across region turnover (files registered, closed and their slots reused).
#[test]
fn uring_registration_is_reported_and_optional() {
    for registration in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let config = small_config(dir.path())
            .io_engine(kvtier::IoEngineKind::Uring)
            .io_registration(registration);
        let store = open(config.clone());
        let stats = store.stats();
        assert_eq!(stats.io_engine, "uring");
        // SAFETY: libc call without arguments.
        if registration && unsafe { libc::geteuid() } == 0 {
            // Root has no memlock limit: both must have taken effect.
            assert!(stats.io_fixed_buffers && stats.io_registered_files);
        }
        if !registration {
            assert!(!stats.io_fixed_buffers && !stats.io_registered_files);
        }
        // 200 values of 300 KB through 1 MiB regions of a 32 MiB disk: the
        // log turns over several times, so region files come and go.
        for i in 0..200 {
            store.put(key(i), value_for(&key(i), 1, 300_000)).unwrap();
            if i % 10 == 9 {
                store.flush().unwrap();
            }
        }
        store.flush().unwrap();
        assert!(store.stats().reclaimed_regions > 0);
        drop(store);
        let store = open(config);
        let mut found = 0;
        for i in 0..200 {
            if let Some(v) = store.get(key(i)).unwrap() {
                assert!(v == value_for(&key(i), 1, 300_000), "key {i}");
                found += 1;
            }
        }
        assert!(found >= 50, "only {found} values survived");
        assert_eq!(store.stats().checksum_failures, 0);
    }
}

/// A fork() child inherits the store object but not its flusher, its lock
/// or (with io_uring registration) its pool mapping: every call there is a
/// clear `Closed` error, dropping it there leaves the parent's store intact.
#[test]
fn a_forked_child_is_refused_and_leaves_the_parent_working() {
    for_each_engine(|_engine| {
        let dir = tempfile::tempdir().unwrap();
        let store = open(small_config(dir.path()));
        store.put(key(1), value_for(&key(1), 1, 100_000)).unwrap();
        store.flush().unwrap();
        // SAFETY: the child only calls the store (whose refusal allocates
        // an error string; glibc's malloc is fork-safe) and then _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let refused = |r: kvtier::Result<()>| matches!(r, Err(e) if e.kind() == ErrorKind::Closed && e.to_string().contains("fork"));
            let ok = refused(store.get(key(1)).map(drop))
                && refused(store.put(key(2), vec![1u8; 10]))
                && refused(store.close());
            drop(store);
            // SAFETY: ends the child without running the parent's atexit work.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: waits for the child just forked.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(
            libc::WIFEXITED(status),
            "child did not exit normally: {status}"
        );
        assert_eq!(
            libc::WEXITSTATUS(status),
            0,
            "child was not refused cleanly"
        );
        // The parent's store is untouched.
        assert_eq!(
            store.get(key(1)).unwrap().unwrap(),
            value_for(&key(1), 1, 100_000)
        );
        store.put(key(3), value_for(&key(3), 1, 50_000)).unwrap();
        store.flush().unwrap();
        drop(store);
        let store = open(small_config(dir.path()));
        assert!(store.get(key(3)).unwrap().is_some());
    });
}

/// Equal keys in two namespaces are two entries, in memory and after a
/// reopen from disk: neither ever reads, sees or removes the other's value.
#[test]
fn namespaces_never_read_each_others_values() {
    for_each_engine(|_engine| {
        let dir = tempfile::tempdir().unwrap();
        let keys = block_keys(&(0..1024).collect::<Vec<u32>>(), 256, b"");
        for round in 0..2 {
            let store = open(small_config(dir.path()));
            let bf16 = store.namespace("llama3-8b/bf16/tp0of2/page64").unwrap();
            let fp8 = store.namespace("llama3-8b/fp8/tp0of2/page64").unwrap();
            let (a, b) = (store.in_namespace(&bf16), store.in_namespace(&fp8));
            if round == 0 {
                let values: Vec<Vec<u8>> = keys
                    .iter()
                    .map(|k| value_for(k.as_ref(), 1, 50_000))
                    .collect();
                for r in a.batch_put(&keys, &values) {
                    r.unwrap();
                }
                assert_eq!(b.prefix_len(&keys), 0, "fp8 sees bf16's blocks");
                for r in b.batch_put(&keys[..2], &values[2..]) {
                    r.unwrap();
                }
                store.flush().unwrap();
            }
            // After the reopen every read comes from disk.
            assert_eq!(a.prefix_len(&keys), 4);
            assert_eq!(b.prefix_len(&keys), 2);
            assert_eq!(
                store.prefix_len(&keys),
                0,
                "the default namespace is a namespace too"
            );
            for (i, k) in keys.iter().enumerate() {
                assert_eq!(a.get(k).unwrap().unwrap(), value_for(k.as_ref(), 1, 50_000));
                if i < 2 {
                    assert_eq!(
                        b.get(k).unwrap().unwrap(),
                        value_for(keys[i + 2].as_ref(), 1, 50_000)
                    );
                } else {
                    assert_eq!(b.get(k).unwrap(), None);
                }
            }
            if round == 1 {
                assert!(b.remove(keys[0]).unwrap());
                assert!(a.exists(keys[0]), "a removal crossed namespaces");
            }
            assert_eq!(store.stats().checksum_failures, 0);
        }
        assert!(Store::open(small_config(dir.path()).namespace("x".repeat(129))).is_err());
    });
}

/// A directory written by format 1 (region files, no FORMAT file) is
/// refused with a message, and nothing in it is touched.
#[test]
fn a_format_one_directory_is_refused_not_misread() {
    let dir = tempfile::tempdir().unwrap();
    let regions = dir.path().join("regions");
    std::fs::create_dir_all(&regions).unwrap();
    std::fs::write(regions.join("00000000.region"), vec![1u8; 8192]).unwrap();
    let err = Store::open(small_config(dir.path())).unwrap_err();
    assert!(err.to_string().contains("format 1"), "{err}");
    assert_eq!(
        std::fs::read(regions.join("00000000.region")).unwrap(),
        vec![1u8; 8192]
    );
}

/// The bytes between a value's end and its page boundary never hold
/// another value's bytes, even when read straight into the caller's
/// buffer from disk.
#[test]
fn direct_reads_expose_no_stale_padding() {
    for_each_engine(|_engine| {
        let dir = tempfile::tempdir().unwrap();
        let store = open(small_config(dir.path()));
        // Fill the pool with a recognisable pattern, then drop it.
        for i in 0..8 {
            store.put(key(i), vec![0xAB; 256 * 1024]).unwrap();
        }
        store.flush().unwrap();
        for i in 0..8 {
            store.remove(key(i)).unwrap();
        }
        // Short values now reuse those extents.
        for i in 100..108 {
            store.put(key(i), vec![0x11; 5000]).unwrap();
        }
        store.flush().unwrap();
        drop(store);
        let store = open(small_config(dir.path()));
        for i in 100..108 {
            let mut buf = kvtier::AlignedBuf::zeroed(8192);
            buf.as_mut_slice().fill(0xEE);
            let got = store.batch_get_into(&[key(i)], &mut [buf.as_mut_slice()]);
            assert_eq!(got[0].as_ref().unwrap(), &Some(5000));
            let bytes = buf.as_slice();
            assert!(bytes[..5000].iter().all(|&b| b == 0x11));
            assert!(
                bytes[5000..].iter().all(|&b| b == 0 || b == 0xEE),
                "stale bytes past the value's end"
            );
        }
    });
}

/// Splits `len` bytes into segments at `cuts` (positions taken modulo len).
fn split_points(len: usize, cuts: &[usize]) -> Vec<usize> {
    let mut points: Vec<usize> = cuts.iter().map(|c| c % len).filter(|&c| c > 0).collect();
    points.push(0);
    points.push(len);
    points.sort_unstable();
    points.dedup();
    points
}

mod segments {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// A value put as segments reads back whole, as the same or other
        /// segments, from memory and from disk (where scattered reads go
        /// through a bounce buffer); too little room is BufferTooSmall.
        #[test]
        fn any_split_round_trips_from_memory_and_disk(
            lens in proptest::collection::vec(1usize..300_000, 1..4),
            put_cuts in proptest::collection::vec(any::<usize>(), 0..6),
            get_cuts in proptest::collection::vec(any::<usize>(), 0..6),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let keys: Vec<Vec<u8>> = (0..lens.len() as u64).map(key).collect();
            let values: Vec<Vec<u8>> = keys.iter().zip(&lens).map(|(k, &n)| value_for(k, 7, n)).collect();
            let check = |store: &Store| {
                for (value, k) in values.iter().zip(&keys) {
                    let points = split_points(value.len(), &get_cuts);
                    let mut buf = vec![0u8; value.len() + 5];
                    let (front, tail) = buf.split_at_mut(value.len());
                    let mut rest = front;
                    let mut segs: Vec<&mut [u8]> = Vec::new();
                    for w in points.windows(2) {
                        let (a, b) = rest.split_at_mut(w[1] - w[0]);
                        segs.push(a);
                        rest = b;
                    }
                    segs.push(tail);
                    let got = store.batch_get_segments(&[k], &mut [&mut segs[..]]);
                    prop_assert_eq!(got[0].as_ref().unwrap(), &Some(value.len()));
                    prop_assert_eq!(&buf[..value.len()], &value[..]);
                    let mut short = vec![0u8; value.len() - 1];
                    let got = store.batch_get_segments(&[k], &mut [&mut [&mut short[..]][..]]);
                    prop_assert_eq!(got[0].as_ref().unwrap_err().kind(), ErrorKind::BufferTooSmall);
                }
                Ok(())
            };
            {
                let store = open(small_config(dir.path()));
                let segmented: Vec<Vec<&[u8]>> = values.iter().map(|v| {
                    split_points(v.len(), &put_cuts).windows(2).map(|w| &v[w[0]..w[1]]).collect()
                }).collect();
                let refs: Vec<&[&[u8]]> = segmented.iter().map(|s| &s[..]).collect();
                for r in store.batch_put_segments(&keys, &refs, &PutOptions::default()) {
                    r.unwrap();
                }
                for (k, v) in keys.iter().zip(&values) {
                    prop_assert_eq!(&store.get(k).unwrap().unwrap(), v);
                }
                check(&store)?;
                store.flush().unwrap();
            }
            let store = open(small_config(dir.path()));
            check(&store)?;
            prop_assert!(store.stats().disk_hits >= values.len() as u64);
        }
    }

    #[test]
    fn empty_segments_are_an_empty_value() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(small_config(dir.path()));
        let empty: &[&[u8]] = &[&[], &[]];
        let r = store.batch_put_segments(&[b"k"], &[empty], &PutOptions::default());
        assert_eq!(
            r[0].as_ref().unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
    }
}

/// Memory hits of a batch of 16 MiB or more are copied with non-temporal
/// stores (`bulk_copy`), smaller batches plainly: either way every byte
/// arrives, into one slice or segments cut anywhere, and nothing past the
/// value is written. Both kinds are covered (the batch sizes straddle
/// `STREAM_BATCH_FROM`). The values were put memory-only, which streams
/// them into the pool, from slices and from segments.
#[test]
fn memory_gets_of_large_and_small_batches_return_every_byte_and_nothing_more() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(
        Config::new(dir.path())
            .memory_capacity(64 * MIB)
            .disk_capacity(64 * MIB)
            .io_engine(engine()),
    );
    // 1 MiB + 3 bytes each: odd lengths, so copies end mid-line.
    let len = MIB as usize + 3;
    let keys: Vec<Vec<u8>> = (0..20u64).map(key).collect();
    let values: Vec<Vec<u8>> = keys.iter().map(|k| value_for(k, 11, len)).collect();
    let memory_only = PutOptions {
        tier: PutTier::MemoryOnly,
        ..Default::default()
    };
    // Memory-only puts land with non-temporal stores (not hashed): half
    // of them as one slice, half as segments cut at odd places.
    for r in store.batch_put_with(&keys[..10], &values[..10], &memory_only) {
        r.unwrap();
    }
    let cut: Vec<[&[u8]; 3]> = values[10..]
        .iter()
        .map(|v| [&v[..4097], &v[4097..300_001], &v[300_001..]])
        .collect();
    let cut: Vec<&[&[u8]]> = cut.iter().map(|c| &c[..]).collect();
    for r in store.batch_put_segments(&keys[10..], &cut, &memory_only) {
        r.unwrap();
    }
    let mut kinds = Vec::new();
    for batch in [2usize, 20] {
        kinds.push(kvtier::bulk_copy::worth_streaming(batch * len));
        let keys = &keys[..batch];
        // One slice per value, with room to spare that must stay 0xee.
        let mut bufs: Vec<Vec<u8>> = (0..batch).map(|_| vec![0xee; len + 4099]).collect();
        let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        for r in store.batch_get_into(keys, &mut slices) {
            assert_eq!(r.unwrap(), Some(len));
        }
        for (buf, value) in bufs.iter().zip(&values) {
            assert!(
                buf[..len] == value[..],
                "a value of a {batch}-value batch differs"
            );
            assert!(
                buf[len..].iter().all(|&b| b == 0xee),
                "written past a value"
            );
        }
        // Segments cut at odd places (the last one longer than needed).
        let mut backing: Vec<Vec<u8>> = (0..batch).map(|_| vec![0xee; len + 100]).collect();
        let mut segmented: Vec<Vec<&mut [u8]>> = backing
            .iter_mut()
            .map(|b| {
                let (a, rest) = b.split_at_mut(4097);
                let (c, d) = rest.split_at_mut(300_001);
                vec![a, c, d]
            })
            .collect();
        let mut dests: Vec<&mut [&mut [u8]]> = segmented.iter_mut().map(|s| &mut s[..]).collect();
        for r in store.batch_get_segments(keys, &mut dests) {
            assert_eq!(r.unwrap(), Some(len));
        }
        for (b, value) in backing.iter().zip(&values) {
            assert!(
                b[..len] == value[..],
                "a segmented value of a {batch}-value batch differs"
            );
            assert!(
                b[len..].iter().all(|&x| x == 0xee),
                "written past a segmented value"
            );
        }
    }
    assert_eq!(kinds, [false, true], "both copy kinds must be covered");
    assert_eq!(
        store.stats().disk_hits,
        0,
        "the gets were to be served from memory"
    );
}

/// Values read from disk in pieces of any size come back whole and
/// verified, at every length around the piece boundaries.
#[test]
fn disk_reads_in_small_pieces_return_the_same_bytes() {
    for_each_engine(|_engine| {
        let dir = tempfile::tempdir().unwrap();
        let config = || small_config(dir.path()).read_piece(8192);
        let lens = [1usize, 4095, 4096, 8191, 8192, 8193, 70_000, 300_000];
        let value = |len: usize| -> Vec<u8> { (0..len).map(|i| (i * 31 % 251) as u8).collect() };
        {
            let store = open(config());
            for len in lens {
                store.put(format!("piece-{len}"), value(len)).unwrap();
            }
            store.close().unwrap();
        }
        let store = open(config());
        for len in lens {
            assert_eq!(store.get(format!("piece-{len}")).unwrap(), Some(value(len)));
        }
        assert_eq!(store.stats().disk_hits, lens.len() as u64);
    });
}

/// Region files are named `<node id>-<incarnation>-<region>.kvr` (format
/// 3); format 2's names (the region id alone) are still read; another
/// node's files are left alone; two files claiming one region are refused.
#[test]
fn region_files_carry_the_node_id_and_older_names_still_read() {
    let dir = tempfile::tempdir().unwrap();
    let regions = dir.path().join("regions");
    let list = || -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(&regions)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    let node = {
        let store = open(small_config(dir.path()));
        for i in 0..20 {
            store.put(key(i), value_for(&key(i), 0, 70_000)).unwrap();
        }
        store.flush().unwrap();
        let node = store.node_id().to_string();
        store.close().unwrap();
        node
    };
    assert_eq!(node.len(), 32);
    let names = list();
    assert!(!names.is_empty());
    for name in &names {
        let parts: Vec<&str> = name.trim_end_matches(".kvr").split('-').collect();
        assert_eq!(parts.len(), 3, "{name}");
        assert_eq!(parts[0], node, "{name}");
        assert_eq!((parts[1].len(), parts[2].len()), (16, 8), "{name}");
    }
    // What format 2 named it (the region id alone) and wrote in it
    // (records without a MAC).
    let first = &names[0];
    unbind_records(&regions.join(first), &secret_of(dir.path()));
    let old = format!(
        "{}.kvr",
        first.rsplit('-').next().unwrap().trim_end_matches(".kvr")
    );
    std::fs::rename(regions.join(first), regions.join(&old)).unwrap();
    {
        let store = open(small_config(dir.path()));
        assert_eq!(store.node_id(), node, "the node id is the directory's");
        for i in 0..20 {
            assert_eq!(
                store.get(key(i)).unwrap().unwrap(),
                value_for(&key(i), 0, 70_000)
            );
        }
        store.close().unwrap();
    }
    // The same region under another node's name is not read (nor removed).
    let foreign = format!("{}-{:016x}-{}", "f".repeat(32), 7, old);
    std::fs::rename(regions.join(&old), regions.join(&foreign)).unwrap();
    {
        let store = open(small_config(dir.path()));
        assert!(store.stats().entries < 20, "another node's region was read");
        store.close().unwrap();
    }
    assert!(regions.join(&foreign).exists());
    // Two files claiming one region id (a copy): the longer is read, the
    // other set aside in quarantine; the open is not refused.
    std::fs::rename(regions.join(&foreign), regions.join(&old)).unwrap();
    let region = old.trim_end_matches(".kvr");
    let twin = format!("{node}-{:016x}-{region}.kvr", 9);
    std::fs::copy(regions.join(&old), regions.join(&twin)).unwrap();
    let store = Store::open(small_config(dir.path())).unwrap();
    assert_eq!(store.recovery_report().quarantined_regions, 1);
    for i in 0..20 {
        assert_eq!(
            store.get(key(i)).unwrap().unwrap(),
            value_for(&key(i), 0, 70_000)
        );
    }
    assert_eq!(list().len(), names.len(), "one of the twins was set aside");
}

#[test]
fn value_locations_read_beside_an_open_store_agree_with_its_index() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(small_config(dir.path()));
    for i in 0..30 {
        store
            .put(key(i), value_for(&key(i), 0, 70_000 + i as usize))
            .unwrap();
    }
    store.flush().unwrap();
    // A newer put and a removal, in later batches.
    store.put(key(3), value_for(&key(3), 1, 5_000)).unwrap();
    assert!(store.remove(key(5)).unwrap());
    store.flush().unwrap();
    let found = kvtier::internals::value_locations(dir.path()).unwrap();
    assert_eq!(found.len(), 29, "every live key once, the removed one not");
    let namespace = store.default_namespace();
    for i in (0..30).filter(|&i| i != 5) {
        let at = &found[namespace.qualify(&key(i)).as_ref()];
        let indexed = store.disk_location(key(i)).unwrap().unwrap();
        assert_eq!(
            (&at.path, at.offset, at.len, at.digest, at.checksum),
            (
                &indexed.path,
                indexed.offset,
                indexed.len,
                indexed.digest,
                indexed.checksum
            ),
            "key {i}"
        );
    }
    assert_eq!(found[namespace.qualify(&key(3)).as_ref()].len, 5_000);
    assert!(!found.contains_key(namespace.qualify(&key(5)).as_ref()));
}
