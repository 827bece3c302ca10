//! Helpers shared by the integration tests.

use kvtier::internals::format::{BatchHeader, REGION_HEADER_LEN};
use kvtier::test_util::{EngineWrapper, FaultyEngine, IoEngine};
use kvtier::{Config, IoEngineKind, Store};
use std::cell::Cell;
use std::fs::{self, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

pub const KIB: u64 = 1024;
pub const MIB: u64 = 1024 * 1024;

/// Value bytes derived from the key and a version (`kvtier::pattern`),
/// never all zeros, so a read of the wrong key, version or offset is always
/// detected.
pub fn value_for(key: &[u8], version: u64, len: usize) -> Vec<u8> {
    let mut named = key.to_vec();
    named.extend_from_slice(&version.to_le_bytes());
    kvtier::pattern::value(&named, len)
}

/// A small store: 4 MiB pool, 32 MiB disk in 1 MiB regions.
pub fn small_config(dir: &Path) -> Config {
    Config::new(dir)
        .memory_capacity(4 * MIB)
        .disk_capacity(32 * MIB)
        .region_size(MIB)
        .io_engine(engine())
}

/// Opens the store and checks that it runs on what the test asked for:
/// the requested io engine (no silent fallback to psync) and O_DIRECT
/// (no silent fallback to buffered I/O). Either fallback fails the test.
pub fn open(config: Config) -> Store {
    let requested = config.requested_io_engine();
    let store = Store::open(config).expect("open store");
    let stats = store.stats();
    if stats.io_engine != "none" {
        assert_eq!(
            stats.io_engine,
            requested.as_str(),
            "the store fell back from the io engine the test asked for"
        );
        assert!(
            stats.direct_io,
            "O_DIRECT is not in effect: these tests need a file system with direct I/O"
        );
    }
    store
}

pub fn key(i: u64) -> Vec<u8> {
    format!("key-{i}").into_bytes()
}

thread_local! {
    static ENGINE: Cell<IoEngineKind> = const { Cell::new(IoEngineKind::Uring) };
}

/// Runs `body` once per io engine; `engine()` and the config helpers pick
/// up the current one. Every store suite runs on both engines this way.
pub fn for_each_engine(mut body: impl FnMut(IoEngineKind)) {
    for engine in [IoEngineKind::Uring, IoEngineKind::Psync] {
        ENGINE.with(|e| e.set(engine));
        body(engine);
    }
}

/// The io engine of the current `for_each_engine` pass (uring otherwise).
pub fn engine() -> IoEngineKind {
    ENGINE.with(Cell::get)
}

/// Where `faulty_wrapper` leaves the engine it built.
pub type FaultySlot = Arc<Mutex<Option<Arc<FaultyEngine>>>>;

/// A `Config::wrap_io_engine` argument that puts a fault-injecting engine
/// around the disk tier's own (set up by `setup` before the store uses
/// it), and the slot to take that engine from once the store is open.
pub fn faulty_wrapper(
    setup: impl Fn(&FaultyEngine) + Send + Sync + 'static,
) -> (EngineWrapper, FaultySlot) {
    let slot: FaultySlot = Arc::default();
    let wrap_slot = Arc::clone(&slot);
    let wrapper = EngineWrapper(Arc::new(move |inner: Arc<dyn IoEngine>| {
        let faulty = FaultyEngine::new(inner);
        setup(&faulty);
        *wrap_slot.lock().unwrap() = Some(Arc::clone(&faulty));
        faulty as Arc<dyn IoEngine>
    }));
    (wrapper, slot)
}

/// Opens `config` over a fault-injecting engine; returns both.
pub fn open_faulty(config: Config) -> (Store, Arc<FaultyEngine>) {
    let (wrapper, slot) = faulty_wrapper(|_| {});
    let store = Store::open(config.wrap_io_engine(wrapper)).expect("open store");
    let faulty = slot
        .lock()
        .unwrap()
        .take()
        .expect("the disk tier built an engine");
    (store, faulty)
}

/// Flushes until one succeeds, up to `tries` times 10 ms apart: whether the
/// store became durable again (after a fault cleared, space returned, ...).
pub fn flush_succeeds_within(store: &Store, tries: usize) -> bool {
    for _ in 0..tries {
        if store.flush().is_ok() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    false
}

/// The region files of a data directory, sorted by name.
pub fn region_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs::read_dir(dir.join("regions"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    files
}

/// Offsets of every batch record in a region file.
pub fn batch_offsets(path: &Path) -> Vec<u64> {
    let bytes = fs::read(path).unwrap();
    let origin = origin_of(path);
    let mut offsets = Vec::new();
    let mut at = REGION_HEADER_LEN;
    while let Ok(header) = BatchHeader::decode(&bytes[at as usize..], &origin) {
        offsets.push(at);
        at += header.batch_len;
        if at as usize >= bytes.len() {
            break;
        }
    }
    offsets
}

pub fn flip(path: &Path, offset: u64) {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut byte = [0u8];
    file.read_exact_at(&mut byte, offset).unwrap();
    byte[0] ^= 0x5A;
    file.write_all_at(&byte, offset).unwrap();
    file.sync_all().unwrap();
}

/// The region id in a region file's name (`<node>-<incarnation>-<region>.kvr`
/// or format 2's `<region>.kvr`): the last part, in hex.
pub fn region_id(path: &Path) -> u32 {
    let stem = path.file_stem().unwrap().to_str().unwrap();
    u32::from_str_radix(stem.rsplit('-').next().unwrap(), 16).unwrap()
}

/// What the records of the region file at `path` (named with its node id)
/// are bound to; records without a MAC (an earlier build's) are read too,
/// to find them.
pub fn origin_of(path: &Path) -> kvtier::internals::format::RecordOrigin {
    kvtier::internals::record_origin(path, region_id(path), "", true)
}

/// Removes the index checkpoint a clean close left in `dir`, so that the
/// next open reads every batch record: for tests of what recovery does
/// with damaged records (with the checkpoint, an open after a clean close
/// reads no record; local_checkpoint.rs tests that path).
pub fn forget_checkpoint(dir: &Path) {
    let checkpoints = dir.join("checkpoints");
    assert!(checkpoints.is_dir(), "a clean close leaves a checkpoint");
    fs::remove_dir_all(checkpoints).unwrap();
}

/// The value size of the damage suites.
pub const DAMAGE_VALUE: usize = 64 * 1024;

/// Puts keys 0..n (version 7, `DAMAGE_VALUE` bytes; several batches per
/// region), flushes, closes.
pub fn fill(dir: &Path, n: u64) {
    let store = open(small_config(dir));
    for i in 0..n {
        store
            .put(key(i), value_for(&key(i), 7, DAMAGE_VALUE))
            .unwrap();
        if i % 5 == 4 {
            store.flush().unwrap(); // several batches per region
        }
    }
    store.close().unwrap();
}

/// Every key of 0..n is its exact `fill` value or a miss, and `exists`
/// agrees with the read unless the read found damage (no phantoms);
/// returns the hits.
pub fn check_all(store: &Store, n: u64) -> u64 {
    let mut hits = 0;
    for i in 0..n {
        let exists = store.exists(key(i));
        let failures = store.stats().checksum_failures;
        match store.get(key(i)).unwrap() {
            Some(v) => {
                assert_eq!(
                    v,
                    value_for(&key(i), 7, DAMAGE_VALUE),
                    "key {i}: wrong bytes"
                );
                hits += 1;
            }
            None => assert!(
                !exists || store.stats().checksum_failures > failures,
                "key {i}: exists but reads as a miss, and the read found no damage"
            ),
        }
    }
    hits
}

/// The directory's key secret, read from its `key-secret` file.
pub fn secret_of(dir: &Path) -> kvtier::KeySecret {
    let bytes = fs::read(dir.join("key-secret")).unwrap();
    kvtier::KeySecret::from_bytes(bytes.try_into().unwrap())
}

/// Rewrites every verified record of a region file as the version-2
/// record (no MAC binding it) a build of data directory format 3 wrote.
pub fn unbind_records(path: &Path, secret: &kvtier::KeySecret) {
    let records = verified_records(path, secret);
    assert!(!records.is_empty(), "{} has no record", path.display());
    let mut bytes = fs::read(path).unwrap();
    for (at, _) in records {
        kvtier::internals::format::unbind_record(&mut bytes[at as usize..]);
    }
    fs::write(path, bytes).unwrap();
}

/// Every batch record of a region file that verifies under `secret`: the
/// batch's offset and its entries, in file order (resynchronising past
/// pages where no valid batch starts, as recovery does).
pub fn verified_records(
    path: &Path,
    secret: &kvtier::KeySecret,
) -> Vec<(u64, Vec<kvtier::internals::format::RecordEntry>)> {
    let bytes = fs::read(path).unwrap_or_default();
    let origin = origin_of(path);
    let mut found = Vec::new();
    let mut at = REGION_HEADER_LEN as usize;
    while at + 4096 <= bytes.len() {
        let decoded = BatchHeader::decode(&bytes[at..], &origin)
            .ok()
            .and_then(|h| {
                kvtier::internals::format::decode_record(
                    &bytes[at..],
                    &h,
                    secret,
                    &origin,
                    at as u64,
                )
                .ok()
                .map(|entries| (h.batch_len, entries))
            });
        match decoded {
            Some((batch_len, entries)) => {
                found.push((at as u64, entries));
                at += batch_len as usize;
            }
            None => at += 4096,
        }
    }
    found
}
