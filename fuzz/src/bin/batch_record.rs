//! Any bytes as an on-disk region header or batch record. Properties:
//! - decoding never panics;
//! - a region header that decodes encodes back to the same checked bytes;
//! - a record that decodes (checksum, MAC or keyed digests, and all)
//!   encodes back to exactly the bytes it was decoded from (a version-2
//!   record: once its version-3 encoding is rewritten as version 2).

use kvtier::internals::format::{
    decode_record, encode_record, unbind_record, BatchHeader, RegionHeader, RECORD_VERSION,
};
use kvtier::KeySecret;
use kvtier_fuzz::{region_origin, sample_region};
use std::sync::Arc;

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
        // The seed's first record, where the sample region has it.
        let origin = region_origin();
        let Ok(header) = BatchHeader::decode(data, &origin) else {
            return;
        };
        if let Ok(entries) = decode_record(data, &header, &secret, &origin, 4096) {
            let len = header.record_len as usize;
            let mut out = vec![0u8; (len + 16).div_ceil(4096) * 4096];
            let mut written =
                encode_record(&mut out, &origin, 4096, header.batch_len, &entries, &secret);
            if header.version != RECORD_VERSION {
                unbind_record(&mut out);
                written -= 16;
            }
            assert_eq!(written, len);
            assert_eq!(&out[..len], &data[..len], "record does not round-trip");
            for entry in &entries {
                assert_eq!(secret.digest_qualified(&entry.key), entry.digest);
            }
        }
    });
}
