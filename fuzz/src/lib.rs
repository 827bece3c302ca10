//! What the fuzz targets share: seed inputs built with the store's own
//! encoders.

use kvtier::internals::format::{
    encode_record, RecordEntry, RecordKind, RecordOrigin, RegionHeader,
};
use kvtier::{value_checksum, KeySecret, Namespace};
use std::sync::Arc;

/// The node id the fuzz targets' data directory has.
pub const NODE_ID: &str = "0123456789abcdef0123456789abcdef";

/// What the records of region 0 of that directory, named by its id alone
/// (format 2's name), are bound to; records without a MAC are read there.
pub fn region_origin() -> RecordOrigin {
    RecordOrigin {
        writer: RecordOrigin::node_bytes(NODE_ID).unwrap(),
        incarnation: 0,
        region: 0,
        accept_unbound: true,
    }
}

/// A region file with a header and two batches, as the store writes it
/// (region 0 of `region_origin`).
pub fn sample_region(secret: &Arc<KeySecret>) -> Vec<u8> {
    let ns = Namespace::new(Arc::clone(secret), "fuzz").unwrap();
    let mut file = vec![0u8; 4096];
    RegionHeader {
        region: 0,
        first_seq: 1,
    }
    .encode(&mut file);
    for (batch, keys) in [[&b"k1"[..], b"k2"], [b"k3", b"k1"]].iter().enumerate() {
        let mut entries = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            let value = vec![batch as u8 + 1; 100];
            let digest = ns.digest(key);
            entries.push(RecordEntry {
                kind: if batch == 1 && i == 1 {
                    RecordKind::Tombstone
                } else {
                    RecordKind::Put
                },
                seq: (batch * 2 + i + 1) as u64,
                digest,
                value_offset: 4096 * (1 + i as u64),
                value_len: if batch == 1 && i == 1 { 0 } else { 100 },
                checksum: if batch == 1 && i == 1 {
                    0
                } else {
                    value_checksum(digest, &value)
                },
                key: ns.qualify(key).into_vec(),
            });
        }
        let batch_len = 4096 * 3;
        let mut bytes = vec![0u8; batch_len];
        let at = file.len() as u64;
        encode_record(
            &mut bytes,
            &region_origin(),
            at,
            batch_len as u64,
            &entries,
            secret,
        );
        for (i, e) in entries.iter().enumerate() {
            if e.kind == RecordKind::Put {
                let at = 4096 * (1 + i);
                bytes[at..at + 100].fill(batch as u8 + 1);
            }
        }
        file.extend_from_slice(&bytes);
    }
    file
}
