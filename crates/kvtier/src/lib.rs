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
//! let keys = kvtier::prefix::block_keys(&[7; 512], 256, b"model-a");
//! store.batch_put(&keys, &[vec![1u8; 65536], vec![2u8; 65536]]);
//! store.flush()?;
//! assert_eq!(store.prefix_len(&keys), 2);
//! let mut a = vec![0u8; 65536];
//! let mut b = vec![0u8; 65536];
//! let got = store.batch_get_into(&keys, &mut [&mut a[..], &mut b[..]]);
//! assert_eq!(got[1].as_ref().unwrap(), &Some(65536));
//! # Ok::<(), kvtier::Error>(())
//! ```

pub mod config;
mod data_dir;
pub mod disk;
mod error;
mod flusher;
pub mod index;
mod key;
mod lock;
pub mod pattern;
pub mod pool;
pub mod prefix;
pub mod size;
mod stats;
mod store;
mod streamed_put;
pub mod units;
mod write_log;

pub use config::{Config, EngineWrapper, EvictionPolicy, FlushPolicy, IoEngineKind};
pub use data_dir::DATA_DIR_FORMAT;
pub use disk::{DiskLocation, RecoveryReport};
pub use error::{Error, ErrorKind, Result};
pub use key::{
    validate_key, validate_namespace, value_checksum, KeyDigest, KeySecret, Namespace,
    ValueChecksum, MAX_KEY_LEN, MAX_NAMESPACE_LEN,
};
pub use prefix::{block_keys, BlockKey};
pub use stats::Stats;
pub use store::{NamespacedStore, PutOptions, PutTier, ReceivingValue, Store, ValueLease};
pub use streamed_put::StreamedPuts;

/// Bytes one index entry occupies, for capacity planning: the hash table
/// slot (digest and entry) plus its control byte, before load-factor slack.
pub const INDEX_SLOT_BYTES: usize = index::SLOT_BYTES;

/// The README's examples, compiled and run as doc tests.
#[doc = include_str!("../../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
