//! kvtier: a tiered KV-cache store for LLM inference.
//!
//! Values (KV-cache blocks, typically 64 KiB to 64 MiB) live in a
//! pre-allocated memory pool and, written through in the background, in a
//! log of region files on disk. A restart rebuilds the index from the
//! log's checksummed batch records; every disk read is verified against a
//! checksum bound to the key, so a read returns the right bytes or a miss.
//!
//! ```
//! use kvtier::{Config, Store};
//! # let dir = tempfile::tempdir().unwrap();
//! let store = Store::open(
//!     Config::new(dir.path()).memory_capacity(8 << 20).disk_capacity(64 << 20).region_size(8 << 20),
//! )?;
//! let keys = kvtier::block_keys(&[7; 512], 256, b"model-a");
//! store.batch_put(&keys, &[vec![1u8; 65536], vec![2u8; 65536]]);
//! store.flush()?;
//! assert_eq!(store.prefix_len(&keys), 2);
//! let mut a = vec![0u8; 65536];
//! let mut b = vec![0u8; 65536];
//! let got = store.batch_get_into(&keys, &mut [&mut a[..], &mut b[..]]);
//! assert_eq!(got[1].as_ref().unwrap(), &Some(65536));
//! # Ok::<(), kvtier::Error>(())
//! ```

// Every module is private: the crate's surface is the `pub use` list
// below, so dead-code lints see every item. `internals` (fuzzing, the
// bench) and `test_util` (fault injection) are features.
pub mod bulk_copy;
mod checkpoint;
mod collect;
mod config;
mod data_dir;
mod disk;
mod error;
mod events;
mod fail;
mod flusher;
mod foreign;
mod index;
mod io;
mod key;
mod lock;
/// Deterministic value bytes derived from a key: what the demo, the bench
/// and the tests write and check byte for byte.
pub mod pattern;
mod pool;
mod prefix;
mod private;
mod region_writer;
mod shared;
mod size;
mod stats;
mod store;
mod tier;
mod units;
mod write_log;

pub use config::SharedReadMode;
pub use config::{Config, EvictionPolicy, FlushPolicy, IoEngineKind};
pub use data_dir::DATA_DIR_FORMAT;
pub use disk::{DiskLocation, RecoveryReport};
pub use error::{Error, ErrorKind, Result};
pub use events::{BlockEvent, EventSink, Medium, QualifiedKey};
pub use foreign::ForeignSegments;
pub use io::AlignedBuf;
pub use key::{
    split_qualified, validate_key, validate_manifest, validate_namespace, value_checksum,
    KeyDigest, KeySecret, Namespace, ValueChecksum, MAX_KEY_LEN, MAX_NAMESPACE_LEN,
};
pub use prefix::{block_keys, BlockKey};
pub use size::{format_size, parse_size};

/// Private at rest: how the store creates and checks its directory and
/// secrets, for the server's own files (auth token, socket) to follow.
pub mod private_files {
    pub use crate::private::{
        check_dir, check_socket_dir, create_dir, open_secret, DIR_MODE, FILE_MODE,
    };
}
pub use collect::{collect_dead_writers, collect_dead_writers_where, CollectedWriter, Collection};
pub use shared::SharedWriter;
pub use stats::{StatValue, Stats};
pub use store::{
    NamespaceCensus, NamespacedStore, PutOptions, PutTier, ReceivingValue, RetiredNamespace, Store,
    StreamedPuts, ValueLease, MANIFEST_KEY, MAX_MANIFEST_LEN,
};
pub use units::{GIB, KIB, MIB, PAGE_SIZE};

/// Bytes one index entry occupies, for capacity planning: the digest and
/// the entry in its shard's arena plus its table slot, before load-factor
/// slack (at most 62 bytes per entry with it at scale; docs/design.md,
/// section 5).
pub const INDEX_SLOT_BYTES: usize = index::SLOT_BYTES;

/// The core's internals for the fuzz targets and the bench (feature
/// `internals`): the record codec, the disk tier opened on its own, the
/// index, the flusher's batching rule, the io-engine seam and its write
/// chunk. Not a stable API.
#[cfg(feature = "internals")]
pub mod internals {
    pub use crate::disk::format;
    pub use crate::disk::DiskLoc;
    pub use crate::disk::{
        record_origin, value_locations, DiskTier, RecoveredEntry, RecoveryChecks,
    };
    pub use crate::flusher::{BatchBudget, MAX_BATCH_ENTRIES};
    pub use crate::index::{prefetch, Entry, Index};
    pub use crate::io::uring::WRITE_CHUNK;
    pub use crate::io::{is_direct_io_aligned, IoEngine, ReadOp};
}

/// Test seams (feature `test-util`): the fault-injecting io engine, with
/// its power-loss model, and the `Config` setters that install it
/// (`Config::wrap_io_engine`, `Config::unsafe_single_sync_batches`).
/// Absent from builds without the feature.
#[cfg(feature = "test-util")]
pub mod test_util {
    pub use crate::config::{EngineWrapper, WrapEngine};
    pub use crate::io::faulty::{Dice, FaultOp, FaultyEngine};
    pub use crate::io::IoEngine;
}

/// Fail points (feature `failpoints`, src/fail.rs): arm a named point of
/// the store's logic to abort or panic the process there.
#[cfg(feature = "failpoints")]
pub mod fail_points {
    pub use crate::fail::{arm, hits, POINTS};
}

/// The README's examples, compiled and run as doc tests.
#[doc = include_str!("../../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
