//! Helpers shared by the integration tests.
#![allow(dead_code, reason = "each test binary uses a different subset")]

use kvtier::{Config, IoEngineKind, Store};
use std::cell::Cell;
use std::path::Path;

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
