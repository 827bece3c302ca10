//! A model tier for the store's tests: values in a map, with faults on
//! demand. It keeps the seam's contract (`tier::LowerTier` to read,
//! `tier::TierWriter` for the flusher to write) and nothing of the region
//! log's, and plugs in through `Store::open_with` without a change to the
//! store's read or write paths. The store's read policy (what a hit, a
//! rejected value, a failed read, a stalled one and a vanished unit mean
//! for the caller, the index and the counters) and its put, flush, evict
//! and get semantics are shown to hold for any tier that keeps the
//! contract, checked step by step against a model.

use super::open::PluggedTier;
use super::Store;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::index::Entry;
use crate::key::{value_checksum, KeyDigest};
use crate::stats::Counters;
use crate::tier::{
    Destination, DiskLocation, Location, LowerTier, PendingBatch, ReadOutcome, RecordEntry,
    RecordKind, TierRead, TierUsage, TierWriter,
};
use proptest::prelude::*;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Units from here up hold another writer's values (`is_others`).
const OTHERS_FROM: u32 = 1 << 20;
/// The first unit the model's writer fills (seeded values use units below).
const WRITTEN_FROM: u32 = 1000;

/// What a read of one location does instead of answering from the map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    Fail,
    TimeOut,
}

#[derive(Debug)]
struct Stored {
    digest: KeyDigest,
    seq: u64,
    key: Vec<u8>,
    bytes: Vec<u8>,
}

#[derive(Debug, Default)]
struct ModelState {
    /// unit -> page -> value.
    units: HashMap<u32, HashMap<u32, Stored>>,
    faults: HashMap<(u32, u32), Fault>,
    /// Removals written, (digest, seq, key).
    removals: Vec<(KeyDigest, u64, Vec<u8>)>,
    /// Batches the writer took.
    batches: u32,
}

#[derive(Debug, Default)]
struct ModelTier {
    state: Mutex<ModelState>,
}

impl ModelTier {
    fn put(&self, loc: Location, digest: KeyDigest, seq: u64, key: &[u8], bytes: &[u8]) {
        let mut state = self.state.lock().unwrap();
        state.faults.remove(&(loc.region(), loc.page()));
        state.units.entry(loc.region()).or_default().insert(
            loc.page(),
            Stored {
                digest,
                seq,
                key: key.to_vec(),
                bytes: bytes.to_vec(),
            },
        );
    }

    /// Changes a byte of the value at `loc` (damage the tier cannot see);
    /// damaged again, it stays damaged.
    fn corrupt(&self, loc: Location) {
        let mut state = self.state.lock().unwrap();
        if let Some(stored) = state
            .units
            .get_mut(&loc.region())
            .and_then(|unit| unit.get_mut(&loc.page()))
        {
            stored.bytes[0] = stored.bytes[0].wrapping_add(1);
        }
    }

    fn fault(&self, loc: Location, fault: Option<Fault>) {
        let mut state = self.state.lock().unwrap();
        match fault {
            Some(f) => state.faults.insert((loc.region(), loc.page()), f),
            None => state.faults.remove(&(loc.region(), loc.page())),
        };
    }

    /// The unit `loc` lies in is gone (reclaimed, or its writer's file
    /// dropped).
    fn drop_unit(&self, loc: Location) {
        self.state.lock().unwrap().units.remove(&loc.region());
    }
}

impl LowerTier for ModelTier {
    fn locate(
        &self,
        digest: KeyDigest,
        loc: Location,
        len: usize,
        checksum: u64,
    ) -> Option<TierRead> {
        let state = self.state.lock().unwrap();
        state.units.get(&loc.region())?;
        Some(TierRead {
            digest,
            loc,
            len,
            checksum,
            held: Arc::new(loc.region()),
        })
    }

    fn read_verified(
        &self,
        reads: &[Option<TierRead>],
        dests: &mut [&mut dyn Destination],
    ) -> Vec<Option<ReadOutcome>> {
        let state = self.state.lock().unwrap();
        reads
            .iter()
            .zip(dests.iter_mut())
            .map(|(read, dest)| {
                let read = read.as_ref()?;
                let at = (read.loc.region(), read.loc.page());
                Some(match state.faults.get(&at) {
                    Some(Fault::Fail) => ReadOutcome::Failed(Error::io(
                        "a model read",
                        std::io::Error::from(std::io::ErrorKind::Other),
                    )),
                    Some(Fault::TimeOut) => ReadOutcome::TimedOut,
                    None => match state.units.get(&at.0).and_then(|u| u.get(&at.1)) {
                        // Verified before it counts, and nothing of a value
                        // that does not verify reaches the destination.
                        Some(stored)
                            if stored.bytes.len() == read.len
                                && value_checksum(read.digest, &stored.bytes) == read.checksum =>
                        {
                            assert!(dest.capacity() >= read.len, "the store checks capacity");
                            dest.fill_from(&stored.bytes);
                            ReadOutcome::Verified
                        }
                        Some(_) => ReadOutcome::Rejected("checksum mismatch".into()),
                        None => ReadOutcome::Rejected("no value at the location".into()),
                    },
                })
            })
            .collect()
    }

    fn is_others(&self, loc: Location) -> bool {
        loc.region() >= OTHERS_FROM
    }

    fn visit_records(
        self: Arc<Self>,
        visit: &mut dyn FnMut(Option<Location>, RecordEntry),
    ) -> Result<()> {
        let state = self.state.lock().unwrap();
        for (&unit, values) in &state.units {
            for (&page, stored) in values {
                visit(
                    Some(Location::new(unit, page)),
                    RecordEntry {
                        kind: RecordKind::Put,
                        seq: stored.seq,
                        digest: stored.digest,
                        value_offset: 0,
                        value_len: stored.bytes.len() as u32,
                        checksum: value_checksum(stored.digest, &stored.bytes),
                        key: stored.key.clone(),
                    },
                );
            }
        }
        for (digest, seq, key) in &state.removals {
            visit(
                None,
                RecordEntry {
                    kind: RecordKind::Tombstone,
                    seq: *seq,
                    digest: *digest,
                    value_offset: 0,
                    value_len: 0,
                    checksum: 0,
                    key: key.clone(),
                },
            );
        }
        Ok(())
    }

    fn file_location(&self, _: Location, _: u32, _: KeyDigest, _: u64) -> Option<DiskLocation> {
        None
    }

    fn usage(&self) -> TierUsage {
        let state = self.state.lock().unwrap();
        TierUsage {
            used_bytes: state
                .units
                .values()
                .flat_map(|u| u.values())
                .map(|s| s.bytes.len() as u64)
                .sum(),
            units: state.units.len() as u64,
            io_engine: "model",
            ..TierUsage::default()
        }
    }

    fn set_open_files_budget(&self, _: usize) {}

    fn closing(&self, _: &std::fs::File) {}
}

/// The model tier's writing half: each batch a unit of its own, each
/// value a page of it (the values' own bytes, not the padding).
#[derive(Debug)]
struct ModelWriter(Arc<ModelTier>);

impl TierWriter for ModelWriter {
    fn max_batch_len(&self) -> u64 {
        64 << 20
    }

    fn prepare(&self) {}

    fn make_room(&self, _: &PendingBatch<'_>) {}

    fn write_batch(&self, batch: &mut PendingBatch<'_>, _first_seq: u64) -> Result<Vec<Location>> {
        let mut state = self.0.state.lock().unwrap();
        let unit = WRITTEN_FROM + state.batches;
        assert!(unit < OTHERS_FROM, "the model's units run out");
        state.batches += 1;
        let mut values = batch.values.iter();
        let mut locs = Vec::new();
        let mut written = HashMap::new();
        for entry in &batch.entries {
            match entry.kind {
                RecordKind::Put => {
                    let padded = values.next().expect("a value per put");
                    let page = locs.len() as u32;
                    written.insert(
                        page,
                        Stored {
                            digest: entry.digest,
                            seq: entry.seq,
                            key: entry.key.clone(),
                            bytes: padded[..entry.value_len as usize].to_vec(),
                        },
                    );
                    locs.push(Location::new(unit, page));
                }
                RecordKind::Tombstone => {
                    state
                        .removals
                        .push((entry.digest, entry.seq, entry.key.clone()));
                }
            }
        }
        state.units.insert(unit, written);
        Ok(locs)
    }

    fn on_full(&self) {}
}

/// A store whose tier below memory is a model tier.
fn open_on_model() -> (tempfile::TempDir, Store, Arc<ModelTier>) {
    let dir = tempfile::tempdir().unwrap();
    let model = Arc::new(ModelTier::default());
    let store = Store::open_with(
        Config::new(dir.path())
            .memory_capacity(4 << 20)
            .disk_capacity(0),
        Some(PluggedTier {
            lower: Arc::clone(&model) as Arc<dyn LowerTier>,
            writer: None,
        }),
    )
    .unwrap();
    (dir, store, model)
}

/// A store whose only tier below memory is a model tier, written by the
/// store's own flusher through the seam, with a pool of `memory` bytes.
fn open_on_written_model(memory: u64) -> (tempfile::TempDir, Store, Arc<ModelTier>) {
    let dir = tempfile::tempdir().unwrap();
    let model = Arc::new(ModelTier::default());
    let store = Store::open_with(
        Config::new(dir.path())
            .memory_capacity(memory)
            .disk_capacity(0),
        Some(PluggedTier {
            lower: Arc::clone(&model) as Arc<dyn LowerTier>,
            writer: Some(Box::new(ModelWriter(Arc::clone(&model)))),
        }),
    )
    .unwrap();
    (dir, store, model)
}

/// Key `k`'s value: distinct per key and per version.
fn value_of(k: usize, version: u64) -> Vec<u8> {
    (0..4096 + k * 100)
        .map(|i| (i as u64 ^ (k as u64 * 31) ^ (version * 7)) as u8)
        .collect()
}

/// Where key `k` lives in the model: own units below `OTHERS_FROM`, other
/// writers' above.
fn loc_of(k: usize, others: bool) -> Location {
    let unit = if others {
        OTHERS_FROM + k as u32
    } else {
        k as u32
    };
    Location::new(unit, 3)
}

/// Puts key `k` into the model tier and indexes it there, as a flusher or
/// a follower would.
fn seed(store: &Store, model: &ModelTier, k: usize, version: u64, others: bool) {
    let key = format!("key-{k}").into_bytes();
    let ns = store.default_view().namespace();
    let digest = ns.digest(&key);
    let bytes = value_of(k, version);
    let loc = loc_of(k, others);
    model.put(loc, digest, version, &ns.qualify(&key), &bytes);
    let entry = Entry::new(
        version,
        value_checksum(digest, &bytes),
        None,
        Some(loc),
        bytes.len() as u32,
    );
    store.inner.index.lock(digest).insert(digest, entry);
}

fn counter(store: &Store, pick: impl Fn(&Counters) -> &std::sync::atomic::AtomicU64) -> u64 {
    Counters::get(pick(&store.inner.counters))
}

#[test]
fn a_tier_plugged_in_through_the_seam_serves_verified_reads() {
    let (_dir, store, model) = open_on_model();
    for k in 0..4 {
        seed(&store, &model, k, 1, k % 2 == 1);
    }
    // One batch, as engines read: every hit below memory goes to the tier
    // in one call.
    let keys: Vec<Vec<u8>> = (0..4).map(|k| format!("key-{k}").into_bytes()).collect();
    let mut bufs: Vec<Vec<u8>> = (0..4).map(|_| vec![0u8; 8192]).collect();
    let mut dests: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let got = store.batch_get_into(&keys, &mut dests);
    for (k, got) in got.into_iter().enumerate() {
        let len = got.unwrap().expect("a hit");
        assert_eq!(&bufs[k][..len], &value_of(k, 1)[..], "key {k}");
    }
    assert_eq!(counter(&store, |c| &c.disk_hits), 4);
    assert_eq!(counter(&store, |c| &c.shared_reads), 2);
    let stats = store.stats();
    assert_eq!(stats.io_engine, "model");
    // Puts stay in memory (the model tier has no flusher) and never wait.
    store.put(b"fresh", b"bytes").unwrap();
    store.flush().unwrap();
    assert_eq!(store.get(b"fresh").unwrap().as_deref(), Some(&b"bytes"[..]));
    // The census sees what the tier recorded.
    let census = store.namespaces().unwrap();
    assert_eq!(census.iter().map(|c| c.blocks).sum::<u64>(), 5);
}

#[test]
fn open_with_refuses_a_tier_beside_the_region_log() {
    let dir = tempfile::tempdir().unwrap();
    let e = Store::open_with(
        Config::new(dir.path())
            .memory_capacity(4 << 20)
            .disk_capacity(64 << 20),
        Some(PluggedTier {
            lower: Arc::new(ModelTier::default()) as Arc<dyn LowerTier>,
            writer: None,
        }),
    )
    .unwrap_err();
    assert!(e.to_string().contains("disk capacity of 0"), "{e}");
}

/// What the model tier does to one key's value.
#[derive(Debug, Clone, Copy)]
enum Step {
    Get(usize),
    /// Indexed afresh (a new version), in an own or another writer's unit.
    Seed(usize, bool),
    Corrupt(usize),
    Fault(usize, Option<Fault>),
    DropUnit(usize),
    Remove(usize),
}

fn step() -> impl Strategy<Value = Step> {
    let k = 0..6usize;
    prop_oneof![
        4 => k.clone().prop_map(Step::Get),
        2 => (k.clone(), any::<bool>()).prop_map(|(k, o)| Step::Seed(k, o)),
        1 => k.clone().prop_map(Step::Corrupt),
        1 => (k.clone(), prop_oneof![Just(None), Just(Some(Fault::Fail)), Just(Some(Fault::TimeOut))])
            .prop_map(|(k, f)| Step::Fault(k, f)),
        1 => k.clone().prop_map(Step::DropUnit),
        1 => k.prop_map(Step::Remove),
    ]
}

/// The expected state of one key.
#[derive(Debug, Clone, Copy, Default)]
struct Expected {
    /// Indexed, with this version.
    version: Option<u64>,
    others: bool,
    corrupt: bool,
    fault: Option<Fault>,
    gone: bool,
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// The store's read policy over any tier that keeps the contract:
    /// a verified read is a hit with the value's bytes; a value that does
    /// not verify is a miss, counted, and its index entry dropped; a read
    /// past the deadline is a miss and the entry stays; a failed read of
    /// another writer's value is a miss, of this node's an error, and the
    /// entry stays; a unit gone is a miss. Nothing but the value put is
    /// ever served.
    #[test]
    fn the_store_read_policy_holds_for_a_model_tier(steps in prop::collection::vec(step(), 1..60)) {
        let (_dir, store, model) = open_on_model();
        let mut expected = [Expected::default(); 6];
        let mut next_version = 1u64;
        let mut rejected = 0u64;
        for step in steps {
            match step {
                Step::Seed(k, others) => {
                    seed(&store, &model, k, next_version, others);
                    expected[k] = Expected { version: Some(next_version), others, ..Expected::default() };
                    next_version += 1;
                }
                Step::Corrupt(k) => {
                    model.corrupt(loc_of(k, expected[k].others));
                    if expected[k].version.is_some() && !expected[k].gone {
                        expected[k].corrupt = true;
                    }
                }
                Step::Fault(k, fault) => {
                    model.fault(loc_of(k, expected[k].others), fault);
                    expected[k].fault = fault;
                }
                Step::DropUnit(k) => {
                    model.drop_unit(loc_of(k, expected[k].others));
                    expected[k].gone = true;
                }
                Step::Remove(k) => {
                    store.remove(format!("key-{k}")).unwrap();
                    expected[k].version = None;
                }
                Step::Get(k) => {
                    let key = format!("key-{k}");
                    let got = store.get(&key);
                    let e = expected[k];
                    match (e.version, e.gone, e.fault, e.corrupt) {
                        (None, ..) => prop_assert_eq!(got.unwrap(), None),
                        (Some(_), true, ..) => {
                            prop_assert_eq!(got.unwrap(), None);
                            prop_assert!(store.exists(&key), "a vanished unit leaves the entry");
                        }
                        (Some(_), false, Some(Fault::TimeOut), _) => {
                            prop_assert_eq!(got.unwrap(), None);
                            prop_assert!(store.exists(&key), "a stalled read leaves the entry");
                        }
                        (Some(_), false, Some(Fault::Fail), _) => {
                            if e.others {
                                prop_assert_eq!(got.unwrap(), None);
                            } else {
                                prop_assert!(got.is_err(), "a failed read of this node's value is an error");
                            }
                            prop_assert!(store.exists(&key));
                        }
                        (Some(_), false, None, true) => {
                            prop_assert_eq!(got.unwrap(), None);
                            rejected += 1;
                            prop_assert!(!store.exists(&key), "a value that does not verify loses its entry");
                            expected[k].version = None;
                        }
                        (Some(v), false, None, false) => {
                            let got = got.unwrap();
                            prop_assert_eq!(got.as_deref(), Some(&value_of(k, v)[..]));
                        }
                    }
                }
            }
        }
        prop_assert_eq!(counter(&store, |c| &c.checksum_failures), rejected);
    }
}

#[test]
fn the_flusher_writes_through_the_seam_and_evicted_values_come_back_from_the_tier() {
    // 64 values of 4-10 KiB through a 128 KiB pool: most are evicted once
    // written, and read back from the model tier.
    let (_dir, store, model) = open_on_written_model(128 << 10);
    for k in 0..64 {
        store.put(format!("w-{k}"), value_of(k, 9)).unwrap();
    }
    store.flush().unwrap();
    for k in 0..64 {
        let got = store.get(format!("w-{k}")).unwrap();
        assert_eq!(got.as_deref(), Some(&value_of(k, 9)[..]), "key {k}");
    }
    assert!(model.state.lock().unwrap().batches > 0);
    assert!(
        counter(&store, |c| &c.evictions) > 0,
        "the pool was too small to keep them"
    );
    assert!(
        counter(&store, |c| &c.disk_hits) > 0,
        "evicted values came from the tier"
    );
    // A removal is written through the seam too, and the census sees both.
    assert!(store.remove("w-0").unwrap());
    assert_eq!(store.get("w-0").unwrap(), None);
    assert!(!model.state.lock().unwrap().removals.is_empty());
    let census = store.namespaces().unwrap();
    assert_eq!(census.iter().map(|c| c.blocks).sum::<u64>(), 63);
}

/// One step of the write model.
#[derive(Debug, Clone, Copy)]
enum WriteStep {
    Put(usize, u64),
    Get(usize),
    Remove(usize),
    Flush,
}

fn write_step() -> impl Strategy<Value = WriteStep> {
    let k = 0..12usize;
    prop_oneof![
        4 => (k.clone(), 1..1000u64).prop_map(|(k, v)| WriteStep::Put(k, v)),
        4 => k.clone().prop_map(WriteStep::Get),
        1 => k.prop_map(WriteStep::Remove),
        1 => Just(WriteStep::Flush),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// With a model tier as the only tier below memory, written by the
    /// store's flusher and read through the seam: every get answers the
    /// last value put (or none after a remove), whether the pool still
    /// holds it or it was evicted and comes back from the tier.
    #[test]
    fn puts_and_gets_hold_over_a_written_model_tier(steps in prop::collection::vec(write_step(), 1..120)) {
        // 12 keys of 4-6 KiB (8 KiB in the pool) through 64 KiB: values
        // are evicted once written and read back from the tier.
        let (_dir, store, _model) = open_on_written_model(64 << 10);
        let mut expected: HashMap<usize, u64> = HashMap::new();
        for step in steps {
            match step {
                WriteStep::Put(k, v) => {
                    store.put(format!("p-{k}"), value_of(k, v)).unwrap();
                    expected.insert(k, v);
                }
                WriteStep::Remove(k) => {
                    let was = store.remove(format!("p-{k}")).unwrap();
                    prop_assert_eq!(was, expected.remove(&k).is_some());
                }
                WriteStep::Flush => store.flush().unwrap(),
                WriteStep::Get(k) => {
                    let got = store.get(format!("p-{k}")).unwrap();
                    let want = expected.get(&k).map(|&v| value_of(k, v));
                    prop_assert_eq!(got, want, "key {}", k);
                }
            }
        }
        store.flush().unwrap();
        for k in 0..12 {
            let got = store.get(format!("p-{k}")).unwrap();
            let want = expected.get(&k).map(|&v| value_of(k, v));
            prop_assert_eq!(got, want, "key {} at the end", k);
        }
    }
}
