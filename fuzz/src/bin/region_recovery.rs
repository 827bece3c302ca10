//! Any bytes as a region file, recovered by the disk tier. Properties:
//! - recovery never panics and never fails on bad content (it skips or
//!   quarantines what it cannot read);
//! - every entry it applies carries a digest keyed from its own key;
//! - recovery changes nothing it keeps: opening the directory again
//!   recovers exactly the same entries.

use kvtier::disk::format::{encode_record, RecordEntry, RecordKind, RegionHeader};
use kvtier::disk::DiskTier;
use kvtier::{value_checksum, Config, IoEngineKind, KeySecret, Namespace};
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

fn recover(config: &Config, secret: &Arc<KeySecret>) -> Vec<(u64, u128, u32, u32)> {
    let mut seen = Vec::new();
    let (_tier, _report) = DiskTier::open(config, Arc::clone(secret), |r| {
        assert_eq!(secret.digest_qualified(&r.entry.key), r.entry.digest);
        seen.push((r.entry.seq, r.entry.digest.0, r.loc.region(), r.loc.page()));
    })
    .expect("recovery of damaged content must not fail");
    seen
}

fn main() {
    let dir = std::env::temp_dir().join(format!("kvtier-fuzz-recovery-{}", std::process::id()));
    let secret = Arc::new(KeySecret::from_bytes([7; 32]));
    if let Ok(out) = std::env::var("KVTIER_FUZZ_SEEDS") {
        std::fs::write(format!("{out}/region"), sample_region(&secret)).unwrap();
        return;
    }
    afl::fuzz!(|data: &[u8]| {
        let config = Config::new(&dir)
            .io_engine(IoEngineKind::Psync)
            .io_threads(1)
            .direct_io(false)
            .disk_capacity(64 << 20)
            .region_size(1 << 20);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("regions")).unwrap();
        std::fs::write(dir.join("regions").join("00000000.kvr"), data).unwrap();
        let first = recover(&config, &secret);
        let second = recover(&config, &secret);
        assert_eq!(first, second, "a second recovery saw something else");
    });
}
