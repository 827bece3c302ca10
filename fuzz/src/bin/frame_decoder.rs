//! Any bytes as a frame: header, then body. Properties:
//! - decoding never panics or allocates past the frame (AFL catches both);
//! - a header that decodes encodes back to the same 24 bytes;
//! - a body that decodes as a request encodes back to the same bytes (the
//!   encoding is canonical: no trailing bytes, no alternative forms).

use kvtier_wire::protocol::{decode_request, Header, Request, SegmentList, HEADER_LEN};

/// Valid frames to start from (written when KVTIER_FUZZ_SEEDS names a
/// directory).
fn write_seeds(dir: &str) {
    let ranges = [
        SegmentList::encode(&[(0, 4096), (65536, 4096)]),
        SegmentList::encode(&[(8192, 100)]),
        SegmentList::encode(&[(0, 4096), (4096, 4096), (1 << 20, 7)]),
    ];
    let list = |i: usize| SegmentList::new(&ranges[i]).expect("whole ranges");
    let requests = [
        Request::Challenge {
            client_nonce: &[3; 32],
            token_id: &[4; 16],
            member: None,
        },
        Request::Challenge {
            client_nonce: &[3; 32],
            token_id: &[4; 16],
            member: Some("0123456789abcdef0123456789abcdef"),
        },
        Request::Hello {
            token: b"a-token-of-sixteen-bytes",
            namespace: "llama3-8b/bf16/tp0of2",
        },
        Request::BatchPut {
            flags: 4,
            items: vec![(b"block-1", b"value one"), (b"block-2", b"value two")],
        },
        Request::BatchGetShm {
            buffer: 1,
            items: vec![(b"block-1", 0, 4096), (b"block-2", 4096, 4096)],
        },
        Request::BatchPutShmSegments {
            buffer: 1,
            flags: 1,
            items: vec![(b"block-1", list(0)), (b"block-2", list(1))],
        },
        Request::BatchGetShmSegments {
            buffer: 2,
            items: vec![(b"block-3", list(2))],
        },
        Request::PrefixLen {
            keys: vec![b"a", b"bb", b"ccc"],
        },
    ];
    for (i, request) in requests.iter().enumerate() {
        let body = request.encode();
        let mut frame = Header {
            op: request.op() as u16,
            request_id: i as u64,
            body_len: body.len() as u32,
            status: 0,
        }
        .encode()
        .to_vec();
        frame.extend_from_slice(&body);
        std::fs::write(format!("{dir}/seed-{i}"), frame).unwrap();
    }
}

fn main() {
    if let Ok(dir) = std::env::var("KVTIER_FUZZ_SEEDS") {
        return write_seeds(&dir);
    }
    afl::fuzz!(|data: &[u8]| {
        if data.len() < HEADER_LEN {
            return;
        }
        let raw: [u8; HEADER_LEN] = data[..HEADER_LEN].try_into().unwrap();
        let Ok(header) = Header::decode(&raw, 1 << 20) else {
            return;
        };
        assert_eq!(header.encode(), raw, "header does not round-trip");
        let body = &data[HEADER_LEN..];
        if let Ok(request) = decode_request(header.op, body, 4096) {
            assert_eq!(request.op() as u16, header.op);
            assert_eq!(request.encode(), body, "request does not round-trip");
        }
    });
}
