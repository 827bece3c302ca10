//! Keys: validation and the 128-bit digest the index and the disk format use.

use crate::error::{Error, Result};
use xxhash_rust::xxh3::{xxh3_128, xxh3_64_with_seed};

/// Longest key accepted, in bytes.
pub const MAX_KEY_LEN: usize = 256;

/// The 128-bit digest of a key (xxh3-128). The index is keyed by it and every
/// record on disk carries it, so a read can prove the bytes belong to the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KeyDigest(pub u128);

impl KeyDigest {
    pub fn of(key: &[u8]) -> Self {
        KeyDigest(xxh3_128(key))
    }

    /// Bits used to pick an index shard; independent of the bits the shard's
    /// hash map uses so shards stay evenly loaded.
    pub(crate) fn shard_bits(self) -> u64 {
        (self.0 >> 64) as u64
    }

    pub(crate) fn low(self) -> u64 {
        self.0 as u64
    }
}

/// Checks a key against the documented limits.
pub fn validate_key(key: &[u8]) -> Result<()> {
    if key.is_empty() {
        return Err(Error::invalid("key is empty: keys are 1 to 256 bytes"));
    }
    if key.len() > MAX_KEY_LEN {
        return Err(Error::invalid(format!(
            "key is {} bytes: keys are 1 to {MAX_KEY_LEN} bytes",
            key.len()
        )));
    }
    Ok(())
}

/// The checksum stored for a value: xxh3-64 of the value bytes, seeded with
/// the key digest. Seeding binds the checksum to the key, so bytes written
/// under one key can never verify as another key's value.
pub fn value_checksum(digest: KeyDigest, value: &[u8]) -> u64 {
    xxh3_64_with_seed(value, digest.low() ^ (digest.shard_bits().rotate_left(17)))
}
