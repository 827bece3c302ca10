//! What a tier is given to write: a batch of record entries (puts and
//! removals, each with its sequence number and qualified key) and each
//! put's value bytes, padded to whole pages. The region log lays them out
//! as a batch record and values (docs/design.md, section 3); another tier
//! keeps them its own way.

use crate::key::KeyDigest;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordKind {
    Put = 1,
    Tombstone = 2,
}

/// One entry of a batch: a put or a removal of a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordEntry {
    pub kind: RecordKind,
    pub seq: u64,
    pub digest: KeyDigest,
    /// Offset of the value from the start of the batch (page multiple).
    pub value_offset: u64,
    pub value_len: u32,
    pub checksum: u64,
    /// The qualified key: namespace length byte, namespace, key.
    pub key: Vec<u8>,
}

/// A batch ready to write: its record entries (value offsets are filled in
/// by the tier that writes it, as its layout puts them) and each put's
/// padded, aligned bytes, in the order of the puts among the entries.
#[derive(Debug, Default)]
pub struct PendingBatch<'a> {
    pub entries: Vec<RecordEntry>,
    pub values: Vec<&'a [u8]>,
}
