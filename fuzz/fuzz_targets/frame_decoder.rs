//! Any bytes as a frame header plus body: decoding must never panic,
//! allocate without bound, or accept trailing garbage.
#![no_main]

use kvtier_net::protocol::{decode_request, Header, HEADER_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < HEADER_LEN {
        return;
    }
    let header: [u8; HEADER_LEN] = data[..HEADER_LEN].try_into().unwrap();
    if let Ok(header) = Header::decode(&header, 1 << 20) {
        let body = &data[HEADER_LEN..];
        let _ = decode_request(header.op, body, 4096);
    }
});
