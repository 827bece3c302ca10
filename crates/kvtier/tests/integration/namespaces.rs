//! Namespaces as an operator sees them: the census (blocks and bytes per
//! namespace) against a model through puts, overwrites, removals,
//! retirements and reopens (clean, from the index checkpoint, and as a
//! crash leaves the files); retirement durable and announced; manifests.

use crate::common::{open, small_config, value_for, KIB};
use kvtier::{
    BlockEvent, Config, EventSink, NamespaceCensus, PutOptions, PutTier, Store, MANIFEST_KEY,
    MAX_MANIFEST_LEN,
};
use proptest::prelude::*;
use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::path::Path;

const NAMESPACES: [&str; 3] = ["", "vllm/llama/0/abc", "sglang/qwen/1/def"];

#[derive(Debug, Clone)]
enum Op {
    /// A write-through put of key `key` (0..8) in namespace `ns`.
    Put {
        ns: usize,
        key: u8,
        len: usize,
    },
    /// A memory-only put of key `key` (8..12: never written through, so
    /// no older durable copy can come back under it after a restart).
    PutMemory {
        ns: usize,
        key: u8,
        len: usize,
    },
    Remove {
        ns: usize,
        key: u8,
    },
    Retire {
        ns: usize,
    },
    Describe {
        ns: usize,
    },
    /// Close and open again: cleanly (the index checkpoint is loaded), or
    /// with the clean-shutdown marker taken away (every record read).
    Reopen {
        clean: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let ns = 0..NAMESPACES.len();
    let len = 1usize..24 * 1024;
    prop_oneof![
        6 => (ns.clone(), 0u8..8, len.clone()).prop_map(|(ns, key, len)| Op::Put { ns, key, len }),
        2 => (ns.clone(), 8u8..12, len).prop_map(|(ns, key, len)| Op::PutMemory { ns, key, len }),
        2 => (ns.clone(), 0u8..12).prop_map(|(ns, key)| Op::Remove { ns, key }),
        1 => ns.clone().prop_map(|ns| Op::Retire { ns }),
        1 => ns.prop_map(|ns| Op::Describe { ns }),
        1 => any::<bool>().prop_map(|clean| Op::Reopen { clean }),
    ]
}

/// What the model says a namespace holds: key -> (version, length, memory only).
type Held = BTreeMap<u8, (u64, usize, bool)>;

fn config(dir: &Path) -> Config {
    small_config(dir)
}

fn manifest_of(ns: usize, version: u64) -> Vec<u8> {
    format!("{{\"namespace\":{ns},\"version\":{version}}}").into_bytes()
}

fn census_of(store: &Store) -> BTreeMap<String, NamespaceCensus> {
    store
        .namespaces()
        .unwrap()
        .into_iter()
        .map(|c| (c.name.clone(), c))
        .collect()
}

fn check(store: &Store, held: &[Held], manifests: &[Option<Vec<u8>>]) -> Result<(), TestCaseError> {
    let census = census_of(store);
    for (ns, name) in NAMESPACES.iter().enumerate() {
        let view = store.in_namespace(&store.namespace(name).unwrap());
        for key in 0..12u8 {
            let got = view.get([key]).unwrap();
            let want = held[ns]
                .get(&key)
                .map(|&(version, len, _)| value_for(&[key], version, len));
            prop_assert_eq!(got.is_some(), want.is_some(), "ns {} key {}", name, key);
            prop_assert!(got == want, "ns {} key {}: wrong bytes", name, key);
        }
        let want_blocks = held[ns].len() as u64;
        let want_bytes: u64 = held[ns].values().map(|&(_, len, _)| len as u64).sum();
        let want_memory = held[ns].values().filter(|&&(_, _, mem)| mem).count() as u64;
        match census.get(*name) {
            None => {
                prop_assert_eq!(want_blocks, 0, "ns {:?} missing from the census", name);
                prop_assert!(
                    manifests[ns].is_none(),
                    "ns {:?}: manifest not listed",
                    name
                );
            }
            Some(c) => {
                prop_assert_eq!(
                    (c.blocks, c.bytes, c.memory_only_blocks),
                    (want_blocks, want_bytes, want_memory),
                    "ns {:?}",
                    name
                );
                prop_assert_eq!(&c.manifest, &manifests[ns], "ns {:?}", name);
                prop_assert!(want_blocks > 0 || manifests[ns].is_some());
            }
        }
        prop_assert_eq!(view.manifest().unwrap(), manifests[ns].clone());
    }
    prop_assert!(census
        .keys()
        .all(|name| NAMESPACES.contains(&name.as_str())));
    Ok(())
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(config(dir.path()));
    let mut held: Vec<Held> = vec![Held::new(); NAMESPACES.len()];
    let mut manifests: Vec<Option<Vec<u8>>> = vec![None; NAMESPACES.len()];
    let mut version = 0u64;
    for op in ops {
        version += 1;
        let view = |store: &Store, ns: usize| {
            store.in_namespace(&store.namespace(NAMESPACES[ns]).unwrap())
        };
        match op {
            Op::Put { ns, key, len } => {
                view(&store, ns)
                    .put([key], value_for(&[key], version, len))
                    .unwrap();
                held[ns].insert(key, (version, len, false));
            }
            Op::PutMemory { ns, key, len } => {
                let options = PutOptions {
                    tier: PutTier::MemoryOnly,
                    ..PutOptions::default()
                };
                view(&store, ns)
                    .put_with([key], value_for(&[key], version, len), &options)
                    .unwrap();
                held[ns].insert(key, (version, len, true));
            }
            Op::Remove { ns, key } => {
                let was = view(&store, ns).remove([key]).unwrap();
                prop_assert_eq!(was, held[ns].remove(&key).is_some());
            }
            Op::Retire { ns } => {
                let retired = view(&store, ns).retire().unwrap();
                let blocks = held[ns].len() as u64 + u64::from(manifests[ns].is_some());
                prop_assert_eq!(retired.blocks, blocks, "retired {:?}", NAMESPACES[ns]);
                held[ns].clear();
                manifests[ns] = None;
            }
            Op::Describe { ns } => {
                let manifest = manifest_of(ns, version);
                view(&store, ns).describe(&manifest).unwrap();
                manifests[ns] = Some(manifest);
            }
            Op::Reopen { clean } => {
                store.close().unwrap();
                drop(store);
                if !clean {
                    fs::remove_file(dir.path().join("clean-shutdown")).unwrap();
                }
                store = open(config(dir.path()));
                // Memory-only values do not outlive the process.
                for h in &mut held {
                    h.retain(|_, &mut (_, _, mem)| !mem);
                }
                let durable = held.iter().map(|h| h.len() as u64).sum::<u64>()
                    + manifests.iter().flatten().count() as u64;
                let loaded = store.stats().checkpoint_entries_loaded;
                prop_assert_eq!(loaded, if clean { durable } else { 0 });
            }
        }
        // Memory-only values are evicted only under pressure, which these
        // sizes never reach (12 keys x 3 namespaces x 24 KiB < the pool).
        check(&store, &held, &manifests)?;
    }
    store.close().unwrap();
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn the_census_and_retirement_match_a_model_across_reopens(ops in prop::collection::vec(op(), 1..40)) {
        run(ops)?;
    }
}

#[test]
fn a_retired_namespace_is_announced_and_stays_gone_after_a_crash_and_a_clean_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let (sink, rx) = EventSink::channel(4096);
    let config = |sink: &std::sync::Arc<EventSink>| config(dir.path()).events(sink.clone());
    let store = open(config(&sink));
    let model = store.namespace("model/a").unwrap();
    let other = store.namespace("model/b").unwrap();
    let (a, b) = (store.in_namespace(&model), store.in_namespace(&other));
    let keys: Vec<Vec<u8>> = (0..64u32).map(|i| i.to_le_bytes().to_vec()).collect();
    for k in &keys {
        a.put(k, value_for(k, 1, 8 * KIB as usize)).unwrap();
        b.put(k, value_for(k, 2, 8 * KIB as usize)).unwrap();
    }
    // Overwritten once: the older record of each key names it too.
    for k in &keys[..16] {
        a.put(k, value_for(k, 3, 4 * KIB as usize)).unwrap();
    }
    // The manifest is stored like a value but is no KV block: never
    // announced, and its removal not either.
    a.describe(b"{}").unwrap();
    store.flush().unwrap();
    let announced: HashSet<u128> = rx
        .try_iter()
        .filter_map(|e| match e {
            BlockEvent::Stored {
                digest, qualified, ..
            } if qualified.namespace() == b"model/a" => Some(digest.0),
            _ => None,
        })
        .collect();
    assert_eq!(announced.len(), 64);

    let retired = a.retire().unwrap();
    assert_eq!(
        (retired.blocks, retired.bytes),
        (65, 16 * 4 * KIB + 48 * 8 * KIB + 2)
    );
    assert_eq!(retired.tombstones, 65);
    let removed: HashSet<u128> = rx
        .try_iter()
        .filter_map(|e| match e {
            BlockEvent::Removed { digest, .. } => Some(digest.0),
            _ => None,
        })
        .collect();
    assert_eq!(removed, announced, "one Removed event per retired block");
    assert!(a.batch_exists(&keys).iter().all(|&p| !p));
    assert!(b.batch_exists(&keys).iter().all(|&p| p));
    let census = store.namespaces().unwrap();
    assert_eq!(
        census.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(),
        ["model/b"]
    );
    store.close().unwrap();
    drop(store);

    // As a crash leaves the files: every record read, tombstones included.
    fs::remove_file(dir.path().join("clean-shutdown")).unwrap();
    let store = open(config(&sink));
    assert_eq!(store.stats().checkpoint_entries_loaded, 0);
    let (a, b) = (store.in_namespace(&model), store.in_namespace(&other));
    assert!(
        a.batch_exists(&keys).iter().all(|&p| !p),
        "a retired block came back"
    );
    for k in &keys {
        assert_eq!(
            b.get(k).unwrap().unwrap(),
            value_for(k, 2, 8 * KIB as usize)
        );
    }
    // Retiring it again finds nothing left to remove, and writes no
    // tombstone for keys whose newest record already is one.
    assert_eq!(a.retire().unwrap(), kvtier::RetiredNamespace::default());
    store.close().unwrap();
    drop(store);

    // Clean: from the index checkpoint.
    let store = open(config(&sink));
    assert!(store.stats().checkpoint_entries_loaded > 0);
    let a = store.in_namespace(&model);
    assert!(
        a.batch_exists(&keys).iter().all(|&p| !p),
        "a retired block came back"
    );
    store.close().unwrap();
}

#[test]
fn a_manifest_is_bounded_and_a_store_without_a_disk_retires_its_memory() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(config(dir.path()).disk_capacity(0));
    let ns = store.in_namespace(&store.namespace("m").unwrap());
    for bad in [Vec::new(), vec![b'x'; MAX_MANIFEST_LEN + 1]] {
        let e = ns.describe(&bad).unwrap_err();
        assert_eq!(e.kind(), kvtier::ErrorKind::InvalidArgument, "{e}");
    }
    ns.describe(b"{\"model\":\"m\"}").unwrap();
    for i in 0..10u8 {
        ns.put([i], value_for(&[i], 1, 1000)).unwrap();
    }
    let census = store.namespaces().unwrap();
    assert_eq!(census.len(), 1);
    assert_eq!(
        (
            census[0].blocks,
            census[0].bytes,
            census[0].memory_only_blocks
        ),
        (10, 10_000, 10)
    );
    assert_eq!(
        census[0].manifest.as_deref(),
        Some(&b"{\"model\":\"m\"}"[..])
    );
    // The manifest key is an ordinary key of the namespace to a reader.
    assert!(ns.exists(MANIFEST_KEY));
    let retired = ns.retire().unwrap();
    assert_eq!((retired.blocks, retired.tombstones), (11, 0));
    assert!(store.namespaces().unwrap().is_empty());
    store.close().unwrap();
}

#[test]
fn puts_still_queued_for_the_flusher_are_retired_for_good() {
    let dir = tempfile::tempdir().unwrap();
    // Nothing is written until asked: every put below is still queued when
    // the retirement starts (no census or flush runs before it).
    let config = || config(dir.path()).flush_policy(kvtier::FlushPolicy::OnDemand);
    let store = open(config());
    let ns = store.in_namespace(&store.namespace("queued").unwrap());
    let keys: Vec<[u8; 1]> = (0..8u8).map(|i| [i]).collect();
    for k in &keys {
        ns.put(k, value_for(k, 1, 5000)).unwrap();
    }
    let retired = ns.retire().unwrap();
    assert_eq!((retired.blocks, retired.tombstones), (8, 8));
    store.close().unwrap();
    drop(store);
    // Every record read, as after a crash: the puts' records and the
    // tombstones after them.
    fs::remove_file(dir.path().join("clean-shutdown")).unwrap();
    let store = open(config());
    let ns = store.in_namespace(&store.namespace("queued").unwrap());
    assert!(
        ns.batch_exists(&keys).iter().all(|&p| !p),
        "a retired put came back"
    );
    store.close().unwrap();
}
