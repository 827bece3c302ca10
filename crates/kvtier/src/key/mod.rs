//! Keys: validation, namespaces, and the 128-bit digest the index and the
//! disk format use.
//!
//! A key's digest is BLAKE3 keyed with the data directory's secret over the
//! key's namespace and the key itself (the *qualified key*, below). Keyed,
//! because a client that chooses keys must not be able to craft two keys
//! with one digest (an unkeyed 128-bit hash invites exactly that, and a
//! digest collision would serve one key's bytes as another's); namespaced,
//! because two models, dtypes or tensor-parallel layouts that happen to
//! produce the same block key must never read each other's bytes.

mod lanes;

use crate::error::{Error, Result};
use std::hash::Hasher as _;
use std::sync::Arc;
use twox_hash::XxHash3_64;

/// Longest key accepted, in bytes.
pub const MAX_KEY_LEN: usize = 256;

/// Longest namespace name accepted, in bytes.
pub const MAX_NAMESPACE_LEN: usize = 128;

/// Longest qualified key (namespace length byte, namespace, key): what a
/// batch record stores per entry.
pub const MAX_QUALIFIED_KEY_LEN: usize = 1 + MAX_NAMESPACE_LEN + MAX_KEY_LEN;

/// Bytes of the data directory's key secret.
pub const KEY_SECRET_LEN: usize = 32;

/// The 128-bit digest of a qualified key. The index is keyed by it and every
/// record on disk carries it, so a read can prove the bytes belong to the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KeyDigest(pub u128);

impl KeyDigest {
    /// Bits used to pick an index shard; independent of the bits the shard's
    /// hash map uses so shards stay evenly loaded.
    pub(crate) fn shard_bits(self) -> u64 {
        (self.0 >> 64) as u64
    }

    pub(crate) fn low(self) -> u64 {
        self.0 as u64
    }

    /// The key's hash for dividing a shared directory's index between
    /// nodes (`Store::set_index_share`): the same on every node of one
    /// shared directory (they share the key secret), unknown to anyone
    /// without it.
    pub fn share_hash(self) -> u64 {
        (self.0 >> 64) as u64 ^ self.0 as u64
    }
}

/// The secret every digest of one data directory is keyed with. Generated
/// from the kernel's random source when the directory is created and kept
/// there (`key-secret`, mode 0600); see docs/design.md.
#[derive(Clone)]
pub struct KeySecret {
    bytes: [u8; KEY_SECRET_LEN],
    /// The key of batch records' MACs (`record_mac`), derived from the
    /// secret in BLAKE3's key-derivation mode: domain-separated by
    /// construction from the digests, which a client can make the store
    /// compute over bytes of its choosing.
    record_key: [u8; 32],
}

/// The context of the record key's derivation (BLAKE3 `derive_key`).
const RECORD_KEY_CONTEXT: &str = "kvtier 2026-12-04 batch record MAC key";

impl KeySecret {
    pub fn from_bytes(bytes: [u8; KEY_SECRET_LEN]) -> Self {
        KeySecret {
            bytes,
            record_key: blake3::derive_key(RECORD_KEY_CONTEXT, &bytes),
        }
    }

    /// A fresh secret from the kernel's random source (`getrandom(2)`,
    /// through the maintained `getrandom` crate).
    pub fn generate() -> Result<Self> {
        let mut bytes = [0u8; KEY_SECRET_LEN];
        getrandom::fill(&mut bytes).map_err(|e| {
            let cause = e.raw_os_error().map_or_else(
                || std::io::Error::other(e.to_string()),
                std::io::Error::from_raw_os_error,
            );
            Error::io("reading the kernel's random source", cause)
        })?;
        Ok(KeySecret::from_bytes(bytes))
    }

    pub fn as_bytes(&self) -> &[u8; KEY_SECRET_LEN] {
        &self.bytes
    }

    /// A keyed hasher for one batch record's MAC (docs/design.md, section
    /// 3.3): only a holder of the directory's secret can make a record that
    /// verifies.
    pub(crate) fn record_mac(&self) -> blake3::Hasher {
        blake3::Hasher::new_keyed(&self.record_key)
    }

    /// A value that names this secret without revealing it (`key-check`
    /// in the data directory): 16 bytes of a BLAKE3 hash keyed with the
    /// secret over a fixed label, as 32 lower-case hex digits.
    pub fn check_value(&self) -> String {
        let hash = blake3::keyed_hash(&self.bytes, b"kvtier key-secret check value v1");
        hash.as_bytes()[..16]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// The digest of a qualified key (as a batch record stores it).
    pub fn digest_qualified(&self, qualified: &[u8]) -> KeyDigest {
        let hash = blake3::keyed_hash(&self.bytes, qualified);
        KeyDigest(u128::from_le_bytes(
            hash.as_bytes()[..16].try_into().expect("16 bytes"),
        ))
    }
}

impl std::fmt::Debug for KeySecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeySecret(..)")
    }
}

/// A namespace of one store: every key used through it is qualified by its
/// name, so equal keys in two namespaces are unrelated entries. Cheap to
/// clone. Build one with [`crate::Store::namespace`].
#[derive(Clone)]
pub struct Namespace {
    secret: Arc<KeySecret>,
    /// The namespace's length byte and name: the qualified key's prefix.
    /// Shared, so that block events name the namespace without a copy.
    prefix: Arc<[u8]>,
}

impl Namespace {
    /// A namespace named `name` (at most 128 bytes of UTF-8; "" is the
    /// default namespace).
    pub fn new(secret: Arc<KeySecret>, name: &str) -> Result<Self> {
        validate_namespace(name)?;
        let mut prefix = Vec::with_capacity(1 + name.len());
        prefix.push(name.len() as u8);
        prefix.extend_from_slice(name.as_bytes());
        Ok(Namespace {
            secret,
            prefix: prefix.into(),
        })
    }

    pub fn name(&self) -> &str {
        std::str::from_utf8(&self.prefix[1..]).expect("validated UTF-8")
    }

    /// The digest of `key` in this namespace.
    pub fn digest(&self, key: &[u8]) -> KeyDigest {
        let mut hasher = blake3::Hasher::new_keyed(self.secret.as_bytes());
        hasher.update(&self.prefix);
        hasher.update(key);
        KeyDigest(u128::from_le_bytes(
            hasher.finalize().as_bytes()[..16]
                .try_into()
                .expect("16 bytes"),
        ))
    }

    /// The digests of many keys in this namespace, in order: the same as
    /// [`Namespace::digest`] of each, sixteen keys at a time (see
    /// `lanes`), for batch calls.
    pub fn digest_many<K: AsRef<[u8]>>(&self, keys: &[K]) -> Vec<KeyDigest> {
        lanes::digest_many(&self.secret, &self.prefix, keys)
    }

    /// The namespace's length byte and name (a qualified key's start),
    /// shared.
    pub(crate) fn prefix_shared(&self) -> Arc<[u8]> {
        Arc::clone(&self.prefix)
    }

    /// The qualified key a batch record stores: the namespace's length byte
    /// and name, then the key.
    pub fn qualify(&self, key: &[u8]) -> Box<[u8]> {
        let mut qualified = Vec::with_capacity(self.prefix.len() + key.len());
        qualified.extend_from_slice(&self.prefix);
        qualified.extend_from_slice(key);
        qualified.into()
    }
}

impl std::fmt::Debug for Namespace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Namespace").field(&self.name()).finish()
    }
}

/// Splits a qualified key into its namespace and key, checking the limits.
pub fn split_qualified(qualified: &[u8]) -> Option<(&[u8], &[u8])> {
    let (&ns_len, rest) = qualified.split_first()?;
    let ns_len = usize::from(ns_len);
    if ns_len > MAX_NAMESPACE_LEN || rest.len() <= ns_len || rest.len() - ns_len > MAX_KEY_LEN {
        return None;
    }
    Some(rest.split_at(ns_len))
}

/// The key a namespace's manifest is stored under, in the namespace
/// itself (`store::namespaces`): so it is kept, shared, routed and retired
/// as the namespace's blocks are. Engines' keys are block hashes or prefix
/// keys of a fixed form, which never equal it. Not a KV block: no block
/// event announces it.
pub const MANIFEST_KEY: &[u8] = b"\xffkvtier-namespace-manifest";

/// The largest manifest a namespace may have, in bytes.
pub const MAX_MANIFEST_LEN: usize = 16 << 10;

/// Checks a namespace manifest's length (1 to `MAX_MANIFEST_LEN` bytes)
/// before it is stored or sent.
pub fn validate_manifest(manifest: &[u8]) -> Result<()> {
    if manifest.is_empty() || manifest.len() > MAX_MANIFEST_LEN {
        return Err(Error::invalid(format!(
            "a namespace manifest is 1 to {MAX_MANIFEST_LEN} bytes, not {}",
            manifest.len()
        )));
    }
    Ok(())
}

/// Checks a namespace name against the documented limits.
pub fn validate_namespace(name: &str) -> Result<()> {
    if name.len() > MAX_NAMESPACE_LEN {
        return Err(Error::invalid(format!(
            "namespace is {} bytes: namespaces are at most {MAX_NAMESPACE_LEN} bytes",
            name.len()
        )));
    }
    if name.chars().any(char::is_control) {
        return Err(Error::invalid(
            "namespace contains a control character: use printable text such as \
             \"llama3-8b/bf16/tp0of2/page64\"",
        ));
    }
    Ok(())
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
/// under one key can never verify as another key's value; the digest itself
/// is keyed with the directory's secret, so no client can choose two keys
/// whose seeds agree.
pub fn value_checksum(digest: KeyDigest, value: &[u8]) -> u64 {
    XxHash3_64::oneshot_with_seed(checksum_seed(digest), value)
}

/// xxh3-64 of `bytes`: the checksum of every record, region header and
/// file kvtier writes. The formats fix the algorithm (XXH3_64bits, seed 0);
/// this implementation picks its AVX2 kernel at run time, where a build
/// for baseline x86-64 would hash with SSE2 only.
pub(crate) fn xxh3_64(bytes: &[u8]) -> u64 {
    XxHash3_64::oneshot(bytes)
}

fn checksum_seed(digest: KeyDigest) -> u64 {
    digest.low() ^ (digest.shard_bits().rotate_left(17))
}

/// [`value_checksum`] computed piece by piece, in order, so a value read in
/// pieces can be verified while its later pieces are still in flight.
pub struct ValueChecksum(Box<XxHash3_64>);

impl ValueChecksum {
    pub fn new(digest: KeyDigest) -> Self {
        ValueChecksum(Box::new(XxHash3_64::with_seed(checksum_seed(digest))))
    }

    /// Adds the value's next bytes.
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.write(bytes);
    }

    /// The checksum of every byte added, equal to [`value_checksum`] of
    /// their concatenation.
    pub fn finish(&self) -> u64 {
        self.0.finish()
    }
}

impl std::fmt::Debug for ValueChecksum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ValueChecksum")
    }
}

/// The digest is already uniformly random; its low 64 bits are the hash.
#[derive(Debug, Default)]
pub struct DigestHasher(u64);

impl std::hash::Hasher for DigestHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, value: u64) {
        self.0 = value;
    }

    fn write_u128(&mut self, value: u128) {
        self.0 = value as u64;
    }
}

#[cfg(test)]
pub(crate) fn test_namespace(name: &str) -> Namespace {
    Namespace::new(Arc::new(KeySecret::from_bytes([7; KEY_SECRET_LEN])), name).unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A value of many blocks, fed in the store's 64 KiB chunks, hashes as
    /// the reference does (the long-input kernel, AVX2 where the CPU has it).
    #[test]
    fn a_large_value_checksums_as_the_reference_does() {
        let value: Vec<u8> = (0..(4usize << 20) + 13)
            .map(|i| (i * 31 + i / 4099) as u8)
            .collect();
        let digest = test_namespace("").digest(b"a large value");
        let mut streaming = ValueChecksum::new(digest);
        for chunk in value.chunks(64 << 10) {
            streaming.update(chunk);
        }
        // The reference's published answer for no input (XXH3_64bits("")).
        assert_eq!(xxh3_64(b""), 0x2D06_8005_38D3_94C2);
        let reference = xxhash_rust::xxh3::xxh3_64_with_seed(&value, checksum_seed(digest));
        assert_eq!(value_checksum(digest, &value), reference);
        assert_eq!(streaming.finish(), reference);
    }

    proptest! {
        /// Fed in any pieces, the streaming checksum equals the one-shot one
        /// (short values, xxh3's 240-byte and block boundaries included).
        #[test]
        fn streaming_checksum_equals_one_shot(
            value in proptest::collection::vec(any::<u8>(), 1..20_000),
            cuts in proptest::collection::vec(any::<usize>(), 0..8),
            key in proptest::collection::vec(any::<u8>(), 1..64),
        ) {
            let digest = test_namespace("").digest(&key);
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
            let other = test_namespace("").digest(b"another key");
            prop_assert_ne!(value_checksum(other, &value), value_checksum(digest, &value));
        }

        /// The run-time dispatched xxh3 gives the reference implementation's
        /// hashes, one-shot and streamed, seeded or not: every checksum
        /// already on disk still verifies (the formats fix the algorithm).
        #[test]
        fn xxh3_equals_the_reference(
            value in proptest::collection::vec(any::<u8>(), 0..70_000),
            cuts in proptest::collection::vec(any::<usize>(), 0..8),
            seed in any::<u64>(),
        ) {
            use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};
            prop_assert_eq!(super::xxh3_64(&value), xxh3_64(&value));
            prop_assert_eq!(XxHash3_64::oneshot_with_seed(seed, &value), xxh3_64_with_seed(&value, seed));
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (value.len() + 1)).collect();
            cuts.sort_unstable();
            let mut streaming = XxHash3_64::with_seed(seed);
            let mut at = 0;
            for cut in cuts.into_iter().chain([value.len()]) {
                streaming.write(&value[at..cut]);
                at = cut;
            }
            prop_assert_eq!(streaming.finish(), xxh3_64_with_seed(&value, seed));
        }

        /// The digest of a key through its namespace equals the digest of
        /// the qualified key a record stores, and splitting the qualified
        /// key gives the namespace and key back.
        #[test]
        fn qualified_keys_round_trip(
            name in "[a-z0-9/._-]{0,128}",
            key in proptest::collection::vec(any::<u8>(), 1..=MAX_KEY_LEN),
        ) {
            let ns = test_namespace(&name);
            let qualified = ns.qualify(&key);
            prop_assert!(qualified.len() <= MAX_QUALIFIED_KEY_LEN);
            prop_assert_eq!(ns.digest(&key), KeySecret::from_bytes([7; KEY_SECRET_LEN]).digest_qualified(&qualified));
            let (n, k) = split_qualified(&qualified).unwrap();
            prop_assert_eq!(n, name.as_bytes());
            prop_assert_eq!(k, &key[..]);
        }
    }

    /// The namespace is part of the digest, with no ambiguity between where
    /// the name ends and the key begins.
    #[test]
    fn namespaces_and_secrets_separate_digests() {
        let a = test_namespace("model-a");
        let b = test_namespace("model-b");
        assert_ne!(a.digest(b"block"), b.digest(b"block"));
        // "ab" + "c" and "a" + "bc" qualify differently.
        assert_ne!(
            test_namespace("ab").digest(b"c"),
            test_namespace("a").digest(b"bc")
        );
        let other_secret = Namespace::new(
            Arc::new(KeySecret::from_bytes([8; KEY_SECRET_LEN])),
            "model-a",
        )
        .unwrap();
        assert_ne!(a.digest(b"block"), other_secret.digest(b"block"));
        assert!(
            Namespace::new(Arc::new(KeySecret::generate().unwrap()), &"x".repeat(129)).is_err()
        );
        assert!(validate_namespace("tab\there").is_err());
    }
}
