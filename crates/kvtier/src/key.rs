//! Keys: validation and the 128-bit digest the index and the disk format use.

use crate::error::{Error, Result};
use xxhash_rust::xxh3::{xxh3_128, xxh3_64_with_seed, Xxh3};

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
    xxh3_64_with_seed(value, checksum_seed(digest))
}

fn checksum_seed(digest: KeyDigest) -> u64 {
    digest.low() ^ (digest.shard_bits().rotate_left(17))
}

/// [`value_checksum`] computed piece by piece, in order, so a value read in
/// pieces can be verified while its later pieces are still in flight.
pub struct ValueChecksum(Box<Xxh3>);

impl ValueChecksum {
    pub fn new(digest: KeyDigest) -> Self {
        ValueChecksum(Box::new(Xxh3::with_seed(checksum_seed(digest))))
    }

    /// Adds the value's next bytes.
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    /// The checksum of every byte added, equal to [`value_checksum`] of
    /// their concatenation.
    pub fn finish(&self) -> u64 {
        self.0.digest()
    }
}

impl std::fmt::Debug for ValueChecksum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ValueChecksum")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Fed in any pieces, the streaming checksum equals the one-shot one
        /// (short values, xxh3's 240-byte and block boundaries included).
        #[test]
        fn streaming_checksum_equals_one_shot(
            value in proptest::collection::vec(any::<u8>(), 1..20_000),
            cuts in proptest::collection::vec(any::<usize>(), 0..8),
            key in proptest::collection::vec(any::<u8>(), 1..64),
        ) {
            let digest = KeyDigest::of(&key);
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % value.len()).collect();
            cuts.sort_unstable();
            let mut streaming = ValueChecksum::new(digest);
            let mut at = 0;
            for cut in cuts.into_iter().chain([value.len()]) {
                streaming.update(&value[at..cut]);
                at = cut;
            }
            prop_assert_eq!(streaming.finish(), value_checksum(digest, &value));
            // And it is bound to the key.
            let other = KeyDigest::of(b"another key");
            prop_assert_ne!(value_checksum(other, &value), value_checksum(digest, &value));
        }
    }
}
