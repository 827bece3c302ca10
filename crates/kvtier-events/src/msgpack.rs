//! The msgpack vLLM's subscribers decode (`msgspec` with
//! `vllm.distributed.kv_events.KVEventBatch`): a batch is an array
//! `[ts, [event, ...]]` (`array_like`, the absent data-parallel rank
//! omitted), each event a map whose `"type"` names its class (`tag=True`)
//! and which carries every field without a default.

/// One event of a batch, as vLLM names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireEvent {
    BlockStored {
        block_hashes: Vec<Vec<u8>>,
        medium: &'static str,
    },
    BlockRemoved {
        block_hashes: Vec<Vec<u8>>,
        medium: &'static str,
    },
    AllBlocksCleared,
}

/// Encodes a `KVEventBatch` taken at `ts` (seconds since the epoch).
pub fn encode_batch(ts: f64, events: &[WireEvent]) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + events.len() * 96);
    array_len(&mut out, 2);
    out.push(0xcb);
    out.extend_from_slice(&ts.to_bits().to_be_bytes());
    array_len(&mut out, events.len());
    for event in events {
        match event {
            WireEvent::BlockStored {
                block_hashes,
                medium,
            } => {
                map_len(&mut out, 8);
                str_(&mut out, "type");
                str_(&mut out, "BlockStored");
                str_(&mut out, "block_hashes");
                hashes(&mut out, block_hashes);
                // kvtier does not know a block's parent, tokens or size
                // (keys are the engine's opaque hashes): nil, [] and 0.
                str_(&mut out, "parent_block_hash");
                out.push(0xc0);
                str_(&mut out, "token_ids");
                array_len(&mut out, 0);
                str_(&mut out, "block_size");
                out.push(0x00);
                str_(&mut out, "lora_id");
                out.push(0xc0);
                str_(&mut out, "medium");
                str_(&mut out, medium);
                str_(&mut out, "lora_name");
                out.push(0xc0);
            }
            WireEvent::BlockRemoved {
                block_hashes,
                medium,
            } => {
                map_len(&mut out, 3);
                str_(&mut out, "type");
                str_(&mut out, "BlockRemoved");
                str_(&mut out, "block_hashes");
                hashes(&mut out, block_hashes);
                str_(&mut out, "medium");
                str_(&mut out, medium);
            }
            WireEvent::AllBlocksCleared => {
                map_len(&mut out, 1);
                str_(&mut out, "type");
                str_(&mut out, "AllBlocksCleared");
            }
        }
    }
    out
}

fn hashes(out: &mut Vec<u8>, hashes: &[Vec<u8>]) {
    array_len(out, hashes.len());
    for h in hashes {
        bin(out, h);
    }
}

fn array_len(out: &mut Vec<u8>, n: usize) {
    match n {
        0..=15 => out.push(0x90 | n as u8),
        16..=0xffff => {
            out.push(0xdc);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        _ => {
            out.push(0xdd);
            out.extend_from_slice(
                &u32::try_from(n)
                    .expect("fewer than 2^32 items")
                    .to_be_bytes(),
            );
        }
    }
}

fn map_len(out: &mut Vec<u8>, n: usize) {
    assert!(n <= 15, "event maps are small");
    out.push(0x80 | n as u8);
}

fn str_(out: &mut Vec<u8>, s: &str) {
    let n = s.len();
    match n {
        0..=31 => out.push(0xa0 | n as u8),
        32..=0xff => {
            out.push(0xd9);
            out.push(n as u8);
        }
        _ => {
            out.push(0xda);
            out.extend_from_slice(&u16::try_from(n).expect("short strings").to_be_bytes());
        }
    }
    out.extend_from_slice(s.as_bytes());
}

fn bin(out: &mut Vec<u8>, b: &[u8]) {
    let n = b.len();
    match n {
        0..=0xff => {
            out.push(0xc4);
            out.push(n as u8);
        }
        0x100..=0xffff => {
            out.push(0xc5);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        _ => {
            out.push(0xc6);
            out.extend_from_slice(&u32::try_from(n).expect("keys are small").to_be_bytes());
        }
    }
    out.extend_from_slice(b);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_encodes_to_the_expected_bytes() {
        let got = encode_batch(
            1.5,
            &[
                WireEvent::BlockRemoved {
                    block_hashes: vec![b"ab".to_vec()],
                    medium: "CPU",
                },
                WireEvent::AllBlocksCleared,
            ],
        );
        let mut want = vec![0x92, 0xcb];
        want.extend_from_slice(&1.5f64.to_bits().to_be_bytes());
        want.push(0x92);
        want.push(0x83);
        for s in ["type", "BlockRemoved", "block_hashes"] {
            want.push(0xa0 | s.len() as u8);
            want.extend_from_slice(s.as_bytes());
        }
        want.extend_from_slice(&[0x91, 0xc4, 2, b'a', b'b']);
        for s in ["medium", "CPU"] {
            want.push(0xa0 | s.len() as u8);
            want.extend_from_slice(s.as_bytes());
        }
        want.push(0x81);
        for s in ["type", "AllBlocksCleared"] {
            want.push(0xa0 | s.len() as u8);
            want.extend_from_slice(s.as_bytes());
        }
        assert_eq!(got, want);
    }

    #[test]
    fn long_lists_and_keys_use_the_wide_forms() {
        let hashes: Vec<Vec<u8>> = (0..20).map(|_| vec![7u8; 300]).collect();
        let got = encode_batch(
            0.0,
            &[WireEvent::BlockStored {
                block_hashes: hashes,
                medium: "STORAGE",
            }],
        );
        let at = got
            .windows(3)
            .position(|w| w == [0xdc, 0, 20])
            .expect("array16 of 20 hashes");
        assert_eq!(&got[at + 3..at + 6], &[0xc5, 1, 44]);
    }
}
