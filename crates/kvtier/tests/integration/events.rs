//! Block events: each is made only once the state it announces holds, and
//! together they describe exactly the blocks the store can serve.

use crate::common::{key, open, small_config, value_for, KIB, MIB};
use kvtier::{BlockEvent, Config, EventSink, FlushPolicy, Medium, Store};
use std::collections::HashMap;
use std::sync::mpsc::Receiver;

fn drain(rx: &Receiver<BlockEvent>) -> Vec<BlockEvent> {
    rx.try_iter().collect()
}

fn stored_keys(events: &[BlockEvent], medium: Medium) -> Vec<Vec<u8>> {
    events
        .iter()
        .filter_map(|e| match e {
            BlockEvent::Stored {
                medium: m,
                qualified,
                ..
            } if *m == medium => Some(qualified.key().to_vec()),
            _ => None,
        })
        .collect()
}

/// Replays events into the set of digests they say the store holds.
fn held(events: &[BlockEvent]) -> HashMap<u128, Vec<u8>> {
    let mut held = HashMap::new();
    for e in events {
        match e {
            BlockEvent::Stored {
                digest, qualified, ..
            } => {
                held.insert(digest.0, qualified.key().to_vec());
            }
            BlockEvent::Removed { digest, .. } => {
                assert!(
                    held.remove(&digest.0).is_some(),
                    "a removal of a block never announced"
                );
            }
        }
    }
    held
}

#[test]
fn a_write_through_put_is_announced_only_once_durable() {
    let dir = tempfile::tempdir().unwrap();
    let (sink, rx) = EventSink::channel(1024);
    let store = open(
        small_config(dir.path())
            .flush_policy(FlushPolicy::OnDemand)
            .events(sink.clone()),
    );
    let keys: Vec<Vec<u8>> = (0..8).map(key).collect();
    let values: Vec<Vec<u8>> = keys.iter().map(|k| value_for(k, 1, 64 * 1024)).collect();
    for r in store.batch_put(&keys, &values) {
        r.unwrap();
    }
    assert!(drain(&rx).is_empty(), "announced before the flush");
    store.flush().unwrap();
    let events = drain(&rx);
    let mut stored = stored_keys(&events, Medium::Storage);
    stored.sort();
    assert_eq!(stored, keys);
    assert!(store.remove(&keys[3]).unwrap());
    let removed = drain(&rx);
    assert_eq!(removed.len(), 1);
    assert!(matches!(
        removed[0],
        BlockEvent::Removed {
            medium: Medium::Storage,
            ..
        }
    ));
    // Removing an absent key announces nothing.
    assert!(!store.remove(&keys[3]).unwrap());
    assert!(drain(&rx).is_empty());
    assert_eq!(sink.dropped(), 0);
}

#[test]
fn memory_only_puts_evictions_and_removes_describe_what_the_store_holds() {
    let dir = tempfile::tempdir().unwrap();
    let (sink, rx) = EventSink::channel(1 << 16);
    let store = Store::open(
        Config::new(dir.path())
            .memory_capacity(2 * MIB)
            .disk_capacity(0)
            .events(sink.clone()),
    )
    .unwrap();
    let mut log = Vec::new();
    // 64 values of 64 KiB through a 2 MiB pool: most are evicted.
    for i in 0..64u64 {
        let k = key(i);
        store.put(&k, value_for(&k, 1, 64 * KIB as usize)).unwrap();
        log.extend(drain(&rx));
        if i % 7 == 0 {
            store.remove(&k).unwrap();
            log.extend(drain(&rx));
        }
    }
    assert!(log.iter().any(|e| matches!(e, BlockEvent::Removed { .. })));
    assert!(log.iter().all(|e| match e {
        BlockEvent::Stored { medium, .. } | BlockEvent::Removed { medium, .. } =>
            *medium == Medium::Memory,
    }));
    let announced = held(&log);
    for i in 0..64u64 {
        let k = key(i);
        let present = store.get(&k).unwrap().is_some();
        assert_eq!(
            present,
            announced.values().any(|a| *a == k),
            "key {i}: events and store disagree"
        );
    }
    assert_eq!(sink.dropped(), 0);
}

#[test]
fn reclaimed_disk_copies_are_announced_removed() {
    let dir = tempfile::tempdir().unwrap();
    let (sink, rx) = EventSink::channel(1 << 16);
    // 32 MiB of disk in 1 MiB regions; 64 MiB written: the oldest regions
    // are reclaimed, and their blocks leave (none was read: no carrying).
    let store = open(small_config(dir.path()).events(sink.clone()));
    for i in 0..256u64 {
        let k = key(i);
        store.put(&k, value_for(&k, 1, 256 * KIB as usize)).unwrap();
    }
    store.flush().unwrap();
    let log = drain(&rx);
    let disk_removals = log
        .iter()
        .filter(|e| {
            matches!(
                e,
                BlockEvent::Removed {
                    medium: Medium::Storage,
                    ..
                }
            )
        })
        .count();
    assert!(
        disk_removals > 0,
        "nothing reclaimed: the test wrote too little"
    );
    let announced = held(&log);
    for i in 0..256u64 {
        let k = key(i);
        let on_disk_or_memory = store.get(&k).unwrap().is_some();
        let said = announced.values().any(|a| *a == k);
        // A block still in memory after its disk copy went is served but
        // no longer announced: the events never claim more than is held.
        if said {
            assert!(on_disk_or_memory, "key {i} announced but not held");
        }
    }
    assert_eq!(sink.dropped(), 0);
}
