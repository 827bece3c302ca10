//! Any bytes as an on-disk batch record: decoding must never panic.
#![no_main]

use kvtier::disk::format::{decode_record, BatchHeader, RegionHeader};
use kvtier::KeySecret;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = RegionHeader::decode(data);
    if let Ok(header) = BatchHeader::decode(data, 0) {
        let _ = decode_record(data, &header, &KeySecret::from_bytes([7; 32]));
    }
});
