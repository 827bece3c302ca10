//! Byte-level codecs for region headers and batch records. The layout is
//! specified in docs/design.md; every integer is little endian.

use crate::key::xxh3_64;
use crate::key::{split_qualified, KeyDigest, KeySecret};
pub use crate::tier::{RecordEntry, RecordKind};
use crate::units::{page_round_up, PAGE_SIZE};

/// The region header's version (its layout has not changed since version
/// 2: digests keyed with the directory secret over namespaced keys).
pub const FORMAT_VERSION: u32 = 2;
/// The batch record version this build writes: 3, whose trailer adds a MAC
/// binding the record to its writer, the writer's open, its region and
/// its offset (`RecordOrigin`).
pub const RECORD_VERSION: u32 = 3;
/// Records of version 2 end in a checksum only: they bind nothing, so they
/// are read only where `RecordOrigin::accept_unbound` says so (a private
/// data directory, written by an earlier build).
pub const UNBOUND_RECORD_VERSION: u32 = 2;
pub const REGION_MAGIC: &[u8; 8] = b"KVTREGN1";
pub const BATCH_MAGIC: &[u8; 8] = b"KVTBATCH";

/// Bytes before the first batch of a region file.
pub const REGION_HEADER_LEN: u64 = PAGE_SIZE;
const REGION_HEADER_CHECKED: usize = 24;

pub const BATCH_HEADER_LEN: usize = 32;
pub const ENTRY_FIXED_LEN: usize = 48;
/// Sequence numbers stay below 2^63: the index packs a flag beside them.
pub const MAX_SEQ: u64 = (1 << 63) - 1;
/// A version-2 record's trailer: the xxh3 checksum.
const SUM_LEN: usize = 8;
/// A version-3 record's MAC, after the checksum.
const MAC_LEN: usize = 16;
/// A version-3 record's trailer: checksum, then MAC.
const TRAILER_LEN: usize = SUM_LEN + MAC_LEN;
/// Upper bound on a record, so a corrupt length cannot make recovery
/// allocate without limit.
pub const MAX_RECORD_LEN: u64 = 256 * 1024 * 1024;
/// Upper bound on a batch (record plus values): 64 GiB, far above any
/// region the store writes (regions are at most the disk capacity, and a
/// batch lies inside one region), and low enough that `offset + batch_len`
/// cannot wrap for any offset a file can have.
pub const MAX_BATCH_LEN: u64 = 1 << 36;

/// Why a batch record did not verify. A record whose trailer checks out
/// but whose keys do not hash to their digests under this directory's
/// secret was written under another secret (or the `key-secret` file is
/// wrong): recovery tells the two apart, so that a wrong identity is
/// refused instead of being read as a directory of damaged regions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordFault {
    /// Torn, corrupt, truncated or implausible: damage.
    Damaged(String),
    /// Intact, but keyed with another secret.
    ForeignDigests,
}

impl RecordFault {
    pub fn reason(&self) -> String {
        match self {
            RecordFault::Damaged(reason) => reason.clone(),
            RecordFault::ForeignDigests => {
                "record keys do not match their digests under this directory's key-secret".into()
            }
        }
    }
}

impl From<String> for RecordFault {
    fn from(reason: String) -> Self {
        RecordFault::Damaged(reason)
    }
}

impl From<&str> for RecordFault {
    fn from(reason: &str) -> Self {
        RecordFault::Damaged(reason.to_string())
    }
}

/// Where a batch record lies and who wrote it: what a version-3 record's
/// MAC binds, so that a record copied to another writer's directory, to
/// another region or to another offset (by anyone who can write a shared
/// directory but does not hold its secret) does not verify there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordOrigin {
    /// The writer's node id (its 32 hex digits as 16 bytes).
    pub writer: [u8; 16],
    /// The open of the writer that created the region file (0 for a file
    /// named by its region id alone).
    pub incarnation: u64,
    /// The region id the file's name gives.
    pub region: u32,
    /// Whether version-2 records are read (they bind nothing): only in a
    /// data directory, which no one else writes.
    pub accept_unbound: bool,
}

impl RecordOrigin {
    /// A node id's 32 lower-case hex digits as bytes (`None` if it is not
    /// one).
    pub fn node_bytes(node_id: &str) -> Option<[u8; 16]> {
        if node_id.len() != 32 || !node_id.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        u128::from_str_radix(node_id, 16)
            .ok()
            .map(|n| n.to_be_bytes())
    }

    /// The MAC of a record whose bytes before the trailer are `body`,
    /// written at `batch_offset` of the region.
    fn mac(&self, secret: &KeySecret, batch_offset: u64, body: &[u8]) -> [u8; MAC_LEN] {
        let mut hasher = secret.record_mac();
        hasher.update(&self.writer);
        hasher.update(&self.incarnation.to_le_bytes());
        hasher.update(&batch_offset.to_le_bytes());
        hasher.update(body);
        let mut mac = [0u8; MAC_LEN];
        mac.copy_from_slice(&hasher.finalize().as_bytes()[..MAC_LEN]);
        mac
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionHeader {
    pub region: u32,
    /// The store's next sequence number when the region was created; keeps
    /// sequence numbers increasing across restarts even if every entry has
    /// been reclaimed.
    pub first_seq: u64,
}

impl RegionHeader {
    pub fn encode(&self, page: &mut [u8]) {
        page[..REGION_HEADER_LEN as usize].fill(0);
        page[0..8].copy_from_slice(REGION_MAGIC);
        page[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        page[12..16].copy_from_slice(&self.region.to_le_bytes());
        page[16..24].copy_from_slice(&self.first_seq.to_le_bytes());
        let sum = xxh3_64(&page[..REGION_HEADER_CHECKED]);
        page[24..32].copy_from_slice(&sum.to_le_bytes());
    }

    pub fn decode(page: &[u8]) -> Result<Self, String> {
        if page.len() < 32 {
            return Err("region header is truncated".into());
        }
        if &page[0..8] != REGION_MAGIC {
            return Err("bad region magic".into());
        }
        let sum = u64_at(page, 24);
        if sum != xxh3_64(&page[..REGION_HEADER_CHECKED]) {
            return Err("region header checksum mismatch".into());
        }
        let version = u32_at(page, 8);
        if version != FORMAT_VERSION {
            return Err(format!("unsupported region format version {version}"));
        }
        let first_seq = u64_at(page, 16);
        if first_seq > MAX_SEQ + 1 {
            return Err(format!("region first_seq {first_seq} is out of range"));
        }
        Ok(RegionHeader {
            region: u32_at(page, 12),
            first_seq,
        })
    }
}

/// The fixed part of a batch record, enough to learn its lengths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchHeader {
    /// `RECORD_VERSION`, or `UNBOUND_RECORD_VERSION` where accepted.
    pub version: u32,
    pub region: u32,
    pub entries: u32,
    /// Bytes of the record, trailer included (before page padding).
    pub record_len: u32,
    /// Bytes from the start of this batch to the start of the next.
    pub batch_len: u64,
}

impl BatchHeader {
    pub fn padded_record_len(&self) -> u64 {
        page_round_up(u64::from(self.record_len))
    }

    /// The trailer's length for this record's version.
    fn trailer_len(&self) -> usize {
        if self.version == UNBOUND_RECORD_VERSION {
            SUM_LEN
        } else {
            TRAILER_LEN
        }
    }

    pub fn decode(bytes: &[u8], origin: &RecordOrigin) -> Result<Self, String> {
        let region = origin.region;
        if bytes.len() < BATCH_HEADER_LEN {
            return Err("batch header is truncated".into());
        }
        if &bytes[0..8] != BATCH_MAGIC {
            return Err("bad batch magic".into());
        }
        let version = u32_at(bytes, 8);
        match version {
            RECORD_VERSION => {}
            UNBOUND_RECORD_VERSION if origin.accept_unbound => {}
            UNBOUND_RECORD_VERSION => {
                return Err(
                    "a version-2 batch record (no MAC binding it to its writer) is not read here"
                        .into(),
                )
            }
            _ => return Err(format!("unsupported batch format version {version}")),
        }
        let header = BatchHeader {
            version,
            region: u32_at(bytes, 12),
            entries: u32_at(bytes, 16),
            record_len: u32_at(bytes, 20),
            batch_len: u64_at(bytes, 24),
        };
        if header.region != region {
            return Err(format!(
                "batch names region {} inside region {region}",
                header.region
            ));
        }
        let record_len = u64::from(header.record_len);
        if record_len < (BATCH_HEADER_LEN + header.trailer_len()) as u64
            || record_len > MAX_RECORD_LEN
        {
            return Err(format!("implausible record length {record_len}"));
        }
        if !header.batch_len.is_multiple_of(PAGE_SIZE)
            || header.batch_len < header.padded_record_len()
            || header.batch_len > MAX_BATCH_LEN
        {
            return Err(format!("implausible batch length {}", header.batch_len));
        }
        Ok(header)
    }
}

/// Encoded size of a record (of `RECORD_VERSION`) holding entries with
/// these key lengths.
pub fn record_len(key_lens: impl IntoIterator<Item = usize>) -> usize {
    BATCH_HEADER_LEN
        + key_lens
            .into_iter()
            .map(|k| ENTRY_FIXED_LEN + k)
            .sum::<usize>()
        + TRAILER_LEN
}

/// Writes a record of `RECORD_VERSION` into `out` (at least `record_len`
/// bytes; the page padding after it must already be zero), for the batch
/// at `batch_offset` of the region `origin` names.
pub fn encode_record(
    out: &mut [u8],
    origin: &RecordOrigin,
    batch_offset: u64,
    batch_len: u64,
    entries: &[RecordEntry],
    secret: &KeySecret,
) -> usize {
    let len = record_len(entries.iter().map(|e| e.key.len()));
    out[0..8].copy_from_slice(BATCH_MAGIC);
    out[8..12].copy_from_slice(&RECORD_VERSION.to_le_bytes());
    out[12..16].copy_from_slice(&origin.region.to_le_bytes());
    out[16..20].copy_from_slice(&(entries.len() as u32).to_le_bytes());
    out[20..24].copy_from_slice(&(len as u32).to_le_bytes());
    out[24..32].copy_from_slice(&batch_len.to_le_bytes());
    let mut at = BATCH_HEADER_LEN;
    for entry in entries {
        out[at..at + 8].copy_from_slice(&entry.seq.to_le_bytes());
        out[at + 8..at + 24].copy_from_slice(&entry.digest.0.to_le_bytes());
        out[at + 24..at + 32].copy_from_slice(&entry.value_offset.to_le_bytes());
        out[at + 32..at + 36].copy_from_slice(&entry.value_len.to_le_bytes());
        out[at + 36..at + 44].copy_from_slice(&entry.checksum.to_le_bytes());
        out[at + 44] = entry.kind as u8;
        out[at + 45] = 0;
        out[at + 46..at + 48].copy_from_slice(&(entry.key.len() as u16).to_le_bytes());
        at += ENTRY_FIXED_LEN;
        out[at..at + entry.key.len()].copy_from_slice(&entry.key);
        at += entry.key.len();
    }
    let sum = xxh3_64(&out[..at]);
    let mac = origin.mac(secret, batch_offset, &out[..at]);
    out[at..at + SUM_LEN].copy_from_slice(&sum.to_le_bytes());
    out[at + SUM_LEN..at + TRAILER_LEN].copy_from_slice(&mac);
    at + TRAILER_LEN
}

/// Decodes and verifies a whole record (`bytes` holds at least
/// `header.record_len` bytes) of the batch at `batch_offset` of the region
/// `origin` names. Any inconsistency rejects the whole batch. A record of
/// `RECORD_VERSION` must carry the MAC of its bytes and origin under
/// `secret`; one that does not, but is otherwise whole, is `ForeignDigests`
/// if its keys do not hash to their digests under `secret` either (written
/// under another secret), and damage otherwise (forged, or moved from
/// another writer, region or offset). A version-2 record (where accepted)
/// has no MAC: each entry's qualified key must hash to its digest.
pub fn decode_record(
    bytes: &[u8],
    header: &BatchHeader,
    secret: &KeySecret,
    origin: &RecordOrigin,
    batch_offset: u64,
) -> Result<Vec<RecordEntry>, RecordFault> {
    let len = header.record_len as usize;
    if bytes.len() < len {
        return Err("record is truncated".into());
    }
    let trailer = header.trailer_len();
    let body = &bytes[..len - trailer];
    if u64_at(bytes, len - trailer) != xxh3_64(body) {
        return Err("batch record checksum mismatch".into());
    }
    // Keys are hashed only where the MAC does not already vouch for them:
    // a version-2 record, or a record whose MAC fails (to tell another
    // secret from a forgery or a copy).
    let mac_verified = header.version == RECORD_VERSION
        && origin.mac(secret, batch_offset, body)[..] == bytes[len - MAC_LEN..len];
    let mut entries = Vec::with_capacity((header.entries as usize).min(1 << 16));
    let mut foreign = false;
    let mut at = BATCH_HEADER_LEN;
    for _ in 0..header.entries {
        if body.len().saturating_sub(at) < ENTRY_FIXED_LEN {
            return Err("record entry runs past the record".into());
        }
        let kind = match body[at + 44] {
            1 => RecordKind::Put,
            2 => RecordKind::Tombstone,
            other => return Err(format!("unknown record entry kind {other}").into()),
        };
        let key_len = usize::from(u16::from_le_bytes([body[at + 46], body[at + 47]]));
        let entry = RecordEntry {
            kind,
            seq: u64_at(body, at),
            digest: KeyDigest(u128::from_le_bytes(
                body[at + 8..at + 24].try_into().unwrap(),
            )),
            value_offset: u64_at(body, at + 24),
            value_len: u32_at(body, at + 32),
            checksum: u64_at(body, at + 36),
            key: Vec::new(),
        };
        at += ENTRY_FIXED_LEN;
        if entry.seq > MAX_SEQ {
            return Err(format!("record sequence number {} is out of range", entry.seq).into());
        }
        if body.len().saturating_sub(at) < key_len
            || split_qualified(&body[at..at + key_len]).is_none()
        {
            return Err(format!("bad qualified key of {key_len} bytes in record").into());
        }
        let key = body[at..at + key_len].to_vec();
        at += key_len;
        if !mac_verified && secret.digest_qualified(&key) != entry.digest {
            // Keep checking the rest: only a record that is otherwise
            // whole counts as foreign rather than damaged.
            foreign = true;
        }
        if kind == RecordKind::Put {
            // Checked: a length from disk must not wrap past the batch.
            let end = entry.value_offset.checked_add(u64::from(entry.value_len));
            if entry.value_len == 0
                || !entry.value_offset.is_multiple_of(PAGE_SIZE)
                || entry.value_offset < header.padded_record_len()
                || end.is_none_or(|end| end > header.batch_len)
            {
                return Err("record entry points outside its batch".into());
            }
        }
        entries.push(RecordEntry { key, ..entry });
    }
    if at != body.len() {
        return Err("record has trailing bytes".into());
    }
    if foreign {
        return Err(RecordFault::ForeignDigests);
    }
    if header.version == RECORD_VERSION && !mac_verified {
        return Err(
            "batch record MAC does not verify: written for another writer, region or offset, \
             or forged"
                .into(),
        );
    }
    Ok(entries)
}

/// Rewrites the version-3 record at the start of `bytes` as the version-2
/// record an earlier build wrote for the same batch (no MAC), for tests of
/// reading older directories. The batch's length and values stay.
#[cfg(any(test, feature = "internals"))]
pub fn unbind_record(bytes: &mut [u8]) {
    assert_eq!(u32_at(bytes, 8), RECORD_VERSION, "not a version-3 record");
    let len = u32_at(bytes, 20) as usize - MAC_LEN;
    bytes[8..12].copy_from_slice(&UNBOUND_RECORD_VERSION.to_le_bytes());
    bytes[20..24].copy_from_slice(&(len as u32).to_le_bytes());
    let sum = xxh3_64(&bytes[..len - SUM_LEN]);
    bytes[len - SUM_LEN..len].copy_from_slice(&sum.to_le_bytes());
    bytes[len..len + MAC_LEN].fill(0);
}

pub(crate) fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap())
}

pub(crate) fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn secret() -> KeySecret {
        KeySecret::from_bytes([7; crate::key::KEY_SECRET_LEN])
    }

    fn origin(region: u32) -> RecordOrigin {
        RecordOrigin {
            writer: [0xab; 16],
            incarnation: 0x1874_b0c2_f7d3_a100,
            region,
            accept_unbound: false,
        }
    }

    /// Where the test records lie in their region.
    const AT: u64 = 5 * PAGE_SIZE;

    fn encode(out: &mut [u8], region: u32, batch_len: u64, entries: &[RecordEntry]) -> usize {
        encode_record(out, &origin(region), AT, batch_len, entries, &secret())
    }

    fn decode(
        bytes: &[u8],
        origin: &RecordOrigin,
        secret: &KeySecret,
    ) -> Result<Vec<RecordEntry>, RecordFault> {
        let header = BatchHeader::decode(bytes, origin)?;
        decode_record(bytes, &header, secret, origin, AT)
    }

    fn entry_strategy() -> impl Strategy<Value = RecordEntry> {
        (
            "[a-z0-9/]{0,128}",
            proptest::collection::vec(any::<u8>(), 1..=256),
            0..=MAX_SEQ,
            any::<bool>(),
            1u32..100_000,
            any::<u64>(),
            0u64..16,
        )
            .prop_map(|(namespace, key, seq, tombstone, len, checksum, page)| {
                let ns = crate::key::test_namespace(&namespace);
                let digest = ns.digest(&key);
                let key = ns.qualify(&key).into_vec();
                if tombstone {
                    RecordEntry {
                        kind: RecordKind::Tombstone,
                        seq,
                        digest,
                        value_offset: 0,
                        value_len: 0,
                        checksum: 0,
                        key,
                    }
                } else {
                    RecordEntry {
                        kind: RecordKind::Put,
                        seq,
                        digest,
                        value_offset: (page + 200) * PAGE_SIZE,
                        value_len: len,
                        checksum,
                        key,
                    }
                }
            })
    }

    proptest! {
        // Miri interprets every instruction: a few cases there.
        #![proptest_config(ProptestConfig::with_cases(if cfg!(miri) { 4 } else { 256 }))]
        #[test]
        fn record_round_trips(entries in proptest::collection::vec(entry_strategy(), 0..if cfg!(miri) { 4 } else { 40 })) {
            let batch_len = 300 * PAGE_SIZE;
            let len = record_len(entries.iter().map(|e| e.key.len()));
            let mut buf = vec![0u8; page_round_up(len as u64) as usize];
            prop_assert_eq!(encode(&mut buf, 7, batch_len, &entries), len);
            let header = BatchHeader::decode(&buf, &origin(7)).unwrap();
            prop_assert_eq!(header.batch_len, batch_len);
            prop_assert_eq!(decode(&buf, &origin(7), &secret()).unwrap(), entries.clone());
            // The same bytes anywhere else, or read as version 2, do not
            // verify (and are damage, not another secret's record).
            let moved = [
                RecordOrigin { writer: [0xac; 16], ..origin(7) },
                RecordOrigin { incarnation: 1, ..origin(7) },
            ];
            for other in moved {
                prop_assert!(matches!(decode(&buf, &other, &secret()), Err(RecordFault::Damaged(_))));
            }
            prop_assert!(decode(&buf, &origin(8), &secret()).is_err());
            prop_assert!(matches!(
                decode_record(&buf, &header, &secret(), &origin(7), AT + PAGE_SIZE),
                Err(RecordFault::Damaged(_))
            ));
        }

        /// Any single flipped byte in the record is caught.
        #[test]
        fn flipped_byte_is_rejected(entries in proptest::collection::vec(entry_strategy(), 1..if cfg!(miri) { 3 } else { 8 }), at in any::<usize>(), bit in 0u8..8) {
            let len = record_len(entries.iter().map(|e| e.key.len()));
            let mut buf = vec![0u8; page_round_up(len as u64) as usize];
            encode(&mut buf, 3, 300 * PAGE_SIZE, &entries);
            buf[at % len] ^= 1 << bit;
            let ok = decode(&buf, &origin(3), &secret());
            prop_assert!(ok.is_err());
            // Damage is never mistaken for a record of another secret
            // (which is refused or quarantined instead of skipped).
            prop_assert!(ok != Err(RecordFault::ForeignDigests) || at % len < BATCH_HEADER_LEN);
        }

        /// Decoding arbitrary bytes never panics.
        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..600), valid_prefix in any::<bool>()) {
            let mut bytes = bytes;
            if valid_prefix && bytes.len() >= 32 {
                bytes[0..8].copy_from_slice(BATCH_MAGIC);
                bytes[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
                bytes[12..16].copy_from_slice(&0u32.to_le_bytes());
            }
            let origin = RecordOrigin { accept_unbound: true, ..origin(0) };
            if let Ok(header) = BatchHeader::decode(&bytes, &origin) {
                let _ = decode_record(&bytes, &header, &secret(), &origin, AT);
            }
            let _ = RegionHeader::decode(&bytes);
        }
    }

    /// One put of key "k" at `value_offset`, `value_len` bytes.
    fn put_entry(value_offset: u64, value_len: u32) -> RecordEntry {
        let ns = crate::key::test_namespace("a");
        RecordEntry {
            kind: RecordKind::Put,
            seq: 5,
            digest: ns.digest(b"k"),
            value_offset,
            value_len,
            checksum: 1,
            key: ns.qualify(b"k").into_vec(),
        }
    }

    /// An intact record under another secret is told apart from damage.
    #[test]
    fn a_record_under_another_secret_is_foreign_not_damaged() {
        let entry = put_entry(PAGE_SIZE, 10);
        let mut buf = vec![0u8; PAGE_SIZE as usize];
        encode(&mut buf, 1, 2 * PAGE_SIZE, std::slice::from_ref(&entry));
        assert_eq!(
            decode(&buf, &origin(1), &secret()).unwrap(),
            vec![entry.clone()]
        );
        let other = KeySecret::from_bytes([8; crate::key::KEY_SECRET_LEN]);
        assert_eq!(
            decode(&buf, &origin(1), &other),
            Err(RecordFault::ForeignDigests)
        );
        // The same for a version-2 record (no MAC) where those are read.
        unbind_record(&mut buf);
        let unbound = RecordOrigin {
            accept_unbound: true,
            ..origin(1)
        };
        assert_eq!(decode(&buf, &unbound, &secret()).unwrap(), vec![entry]);
        assert_eq!(
            decode(&buf, &unbound, &other),
            Err(RecordFault::ForeignDigests)
        );
    }

    /// Anyone who can write a region file (a shared directory) but does not
    /// hold the secret can change a value and fix up every checksum that
    /// covers it (the value's seed is its digest, which the record shows):
    /// a version-3 record then fails its MAC; a version-2 record, which
    /// has none, is read only where accepted (a private data directory).
    #[test]
    fn a_forged_record_does_not_verify_and_unbound_ones_are_refused_where_not_accepted() {
        let entry = put_entry(PAGE_SIZE, 10);
        let mut buf = vec![0u8; PAGE_SIZE as usize];
        let len = encode(&mut buf, 1, 2 * PAGE_SIZE, std::slice::from_ref(&entry));
        // The forger's change: another value checksum, and the record's
        // checksum computed again.
        let forged_checksum = crate::key::value_checksum(entry.digest, b"forged bytes");
        buf[BATCH_HEADER_LEN + 36..BATCH_HEADER_LEN + 44]
            .copy_from_slice(&forged_checksum.to_le_bytes());
        let body = len - TRAILER_LEN;
        let sum = xxh3_64(&buf[..body]);
        buf[body..body + SUM_LEN].copy_from_slice(&sum.to_le_bytes());
        let err = decode(&buf, &origin(1), &secret()).unwrap_err();
        assert!(err.reason().contains("MAC"), "{err:?}");

        let mut buf = vec![0u8; PAGE_SIZE as usize];
        encode(&mut buf, 1, 2 * PAGE_SIZE, std::slice::from_ref(&entry));
        unbind_record(&mut buf);
        let err = decode(&buf, &origin(1), &secret()).unwrap_err();
        assert!(err.reason().contains("version-2"), "{err:?}");
    }

    /// Lengths from disk that would wrap are rejected, not wrapped.
    #[test]
    fn wrapping_lengths_are_rejected() {
        let entry = put_entry(u64::MAX - 4095, 8192);
        let mut buf = vec![0u8; PAGE_SIZE as usize];
        encode(&mut buf, 1, 2 * PAGE_SIZE, std::slice::from_ref(&entry));
        assert!(matches!(
            decode(&buf, &origin(1), &secret()),
            Err(RecordFault::Damaged(_))
        ));
        // A batch length near the top of the range is implausible.
        encode(&mut buf, 1, u64::MAX / PAGE_SIZE * PAGE_SIZE, &[]);
        assert!(BatchHeader::decode(&buf, &origin(1)).is_err());
    }

    #[test]
    fn region_header_round_trips_and_detects_damage() {
        let mut page = vec![0u8; REGION_HEADER_LEN as usize];
        let header = RegionHeader {
            region: 42,
            first_seq: 9_000,
        };
        header.encode(&mut page);
        assert_eq!(RegionHeader::decode(&page).unwrap(), header);
        page[13] ^= 1;
        assert!(RegionHeader::decode(&page).is_err());
    }
}
