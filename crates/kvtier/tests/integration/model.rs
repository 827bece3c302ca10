//! Property test: random put / get / remove / flush / reopen sequences
//! against a model map. After every reopen: nothing acknowledged is lost,
//! nothing removed reappears, nothing wrong is returned.

use crate::common::*;
use kvtier::{Config, EvictionPolicy, IoEngineKind, PutOptions, PutTier, Store};
use proptest::prelude::*;
use std::collections::HashMap;
use std::path::Path;

#[derive(Debug, Clone)]
enum Op {
    Put {
        key: u8,
        len: usize,
        memory_only: bool,
    },
    BatchPut {
        first: u8,
        count: u8,
        len: usize,
    },
    Get {
        key: u8,
    },
    /// An engine's lookup of a run of keys (feeds the adaptive policy).
    PrefixLen {
        first: u8,
        count: u8,
    },
    Remove {
        key: u8,
    },
    Flush,
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    let len = prop_oneof![1usize..5000, 60_000usize..140_000];
    prop_oneof![
        6 => (0u8..24, len.clone(), prop::bool::weighted(0.15))
            .prop_map(|(key, len, memory_only)| Op::Put { key, len, memory_only }),
        2 => (0u8..24, 1u8..6, len).prop_map(|(first, count, len)| Op::BatchPut { first, count, len }),
        5 => (0u8..24).prop_map(|key| Op::Get { key }),
        2 => (0u8..24, 1u8..8).prop_map(|(first, count)| Op::PrefixLen { first, count }),
        2 => (0u8..24).prop_map(|key| Op::Remove { key }),
        1 => Just(Op::Flush),
        1 => Just(Op::Reopen),
    ]
}

/// What the model knows about a key.
#[derive(Debug, Clone, Default)]
struct Expected {
    /// The newest value, if any, and whether it was memory-only.
    latest: Option<(Vec<u8>, bool)>,
    /// The newest value written through to disk since the last remove.
    durable: Option<Vec<u8>>,
}

fn config(dir: &Path, policy: EvictionPolicy, engine: IoEngineKind) -> Config {
    // A small pool forces eviction; the disk is large enough that no
    // region is ever reclaimed, so every acknowledged write must survive.
    Config::new(dir)
        .memory_capacity(512 * KIB)
        .disk_capacity(256 * MIB)
        .region_size(MIB)
        .eviction(policy)
        .io_engine(engine)
}

fn check_key(
    store: &Store,
    k: &[u8],
    expected: &Expected,
    after_reopen: bool,
) -> Result<(), TestCaseError> {
    let got = store.get(k).unwrap();
    match (&expected.latest, after_reopen) {
        (Some((value, false)), _) => {
            prop_assert_eq!(got.as_ref(), Some(value), "write-through value")
        }
        (Some((value, true)), false) => {
            // Memory-only: present, or evicted (a miss).
            prop_assert!(
                got.is_none() || got.as_ref() == Some(value),
                "memory-only value wrong"
            );
        }
        (Some((_, true)), true) => {
            // After a restart only the last durable value may come back.
            prop_assert!(
                got.is_none() || got == expected.durable,
                "stale or wrong after reopen"
            );
        }
        (None, _) => prop_assert_eq!(got, None, "removed or never written key returned a value"),
    }
    Ok(())
}

fn run(ops: Vec<Op>, policy: EvictionPolicy, engine: IoEngineKind) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::open(config(dir.path(), policy, engine)).unwrap();
    let mut model: HashMap<Vec<u8>, Expected> = HashMap::new();
    let mut version = 0u64;
    for op in ops {
        version += 1;
        match op {
            Op::Put {
                key: k,
                len,
                memory_only,
            } => {
                let k = key(u64::from(k));
                let value = value_for(&k, version, len);
                let tier = if memory_only {
                    PutTier::MemoryOnly
                } else {
                    PutTier::MemoryAndDisk
                };
                store
                    .put_with(
                        &k,
                        &value,
                        &PutOptions {
                            tier,
                            ..Default::default()
                        },
                    )
                    .unwrap();
                let expected = model.entry(k).or_default();
                if !memory_only {
                    expected.durable = Some(value.clone());
                }
                expected.latest = Some((value, memory_only));
            }
            Op::BatchPut { first, count, len } => {
                let keys: Vec<Vec<u8>> = (first..first.saturating_add(count))
                    .map(|k| key(u64::from(k % 24)))
                    .collect();
                let values: Vec<Vec<u8>> =
                    keys.iter().map(|k| value_for(k, version, len)).collect();
                for result in store.batch_put(&keys, &values) {
                    result.unwrap();
                }
                for (k, v) in keys.into_iter().zip(values) {
                    let expected = model.entry(k).or_default();
                    expected.durable = Some(v.clone());
                    expected.latest = Some((v, false));
                }
            }
            Op::Get { key: k } => {
                let k = key(u64::from(k));
                let expected = model.get(&k).cloned().unwrap_or_default();
                check_key(&store, &k, &expected, false)?;
            }
            Op::PrefixLen { first, count } => {
                let keys: Vec<Vec<u8>> = (first..first.saturating_add(count))
                    .map(|k| key(u64::from(k % 24)))
                    .collect();
                let n = store.prefix_len(&keys);
                prop_assert!(n <= keys.len());
                for k in &keys[..n] {
                    // Counted keys exist, and never one the model removed.
                    let latest = model.get(k).and_then(|e| e.latest.as_ref());
                    prop_assert!(latest.is_some(), "prefix_len counted a removed key");
                }
                if n < keys.len() {
                    prop_assert!(
                        !store.exists(&keys[n]),
                        "prefix_len stopped at a present key"
                    );
                }
            }
            Op::Remove { key: k } => {
                let k = key(u64::from(k));
                let was_present = store.exists(&k);
                prop_assert_eq!(store.remove(&k).unwrap(), was_present);
                model.insert(k, Expected::default());
            }
            Op::Flush => store.flush().unwrap(),
            Op::Reopen => {
                drop(store);
                store = Store::open(config(dir.path(), policy, engine)).unwrap();
                // A clean close: the open loaded its index checkpoint, so
                // the checks below hold it to the model.
                let stats = store.stats();
                prop_assert_eq!(stats.checkpoint_entries_loaded, stats.entries);
                for (k, expected) in model.iter_mut() {
                    check_key(&store, k, expected, true)?;
                    // What came back is what the model holds from now on.
                    match store.get(k).unwrap() {
                        Some(v) => expected.latest = Some((v, false)),
                        None => *expected = Expected::default(),
                    }
                }
                prop_assert_eq!(store.stats().checksum_failures, 0);
            }
        }
        let stats = store.stats();
        prop_assert!(stats.memory_bytes <= stats.memory_capacity);
        prop_assert!(stats.disk_used_bytes <= stats.disk_capacity);
    }
    for (k, expected) in &model {
        check_key(&store, k, expected, false)?;
    }
    prop_assert_eq!(store.stats().reclaimed_regions, 0);
    Ok(())
}

fn cases() -> u32 {
    std::env::var("KVTIER_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn store_matches_model_s3fifo(ops in prop::collection::vec(op(), 1..80), uring in any::<bool>()) {
        run(ops, EvictionPolicy::S3Fifo, if uring { IoEngineKind::Uring } else { IoEngineKind::Psync })?;
    }

    #[test]
    fn store_matches_model_adaptive(ops in prop::collection::vec(op(), 1..80), uring in any::<bool>()) {
        run(ops, EvictionPolicy::Adaptive, if uring { IoEngineKind::Uring } else { IoEngineKind::Psync })?;
    }

    #[test]
    fn store_matches_model_lru(ops in prop::collection::vec(op(), 1..80), uring in any::<bool>()) {
        run(ops, EvictionPolicy::Lru, if uring { IoEngineKind::Uring } else { IoEngineKind::Psync })?;
    }
}
