//! Any bytes as an on-disk region header or batch record. Properties:
//! - decoding never panics;
//! - a region header that decodes encodes back to the same checked bytes;
//! - a record that decodes (checksum, keyed digests and all) encodes back
//!   to exactly the bytes it was decoded from.

use kvtier::disk::format::{
    decode_record, encode_record, BatchHeader, RecordEntry, RecordKind, RegionHeader,
};
use kvtier::{value_checksum, KeySecret, Namespace};
use std::sync::Arc;

/// A region file with a header and two batches, as the store writes it.
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
        encode_record(&mut bytes, 0, batch_len as u64, &entries);
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

fn main() {
    let secret = Arc::new(KeySecret::from_bytes([7; 32]));
    if let Ok(dir) = std::env::var("KVTIER_FUZZ_SEEDS") {
        let region = sample_region(&secret);
        std::fs::write(format!("{dir}/region-header"), &region[..4096]).unwrap();
        std::fs::write(format!("{dir}/record"), &region[4096..4096 * 4]).unwrap();
        return;
    }
    afl::fuzz!(|data: &[u8]| {
        if let Ok(region) = RegionHeader::decode(data) {
            let mut page = vec![0u8; 4096];
            region.encode(&mut page);
            assert_eq!(
                &page[..32],
                &data[..32],
                "region header does not round-trip"
            );
        }
        let Ok(header) = BatchHeader::decode(data, 0) else {
            return;
        };
        if let Ok(entries) = decode_record(data, &header, &secret) {
            let len = header.record_len as usize;
            let mut out = vec![0u8; len.div_ceil(4096) * 4096];
            let written = encode_record(&mut out, 0, header.batch_len, &entries);
            assert_eq!(written, len);
            assert_eq!(&out[..len], &data[..len], "record does not round-trip");
            for entry in &entries {
                assert_eq!(secret.digest_qualified(&entry.key), entry.digest);
            }
        }
    });
}
