//! Bench values: bytes derived from the key (never zeros), so every read
//! can be verified against what was written under that key.

use xorshift::next;

mod xorshift {
    pub fn next(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }
}

fn seed(key: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &b in key {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    h | 1
}

/// Fills `out` with the value for `key`.
pub fn fill(key: &[u8], out: &mut [u8]) {
    let mut state = seed(key);
    let mut chunks = out.chunks_exact_mut(8);
    for chunk in &mut chunks {
        chunk.copy_from_slice(&next(&mut state).to_le_bytes());
    }
    let tail = chunks.into_remainder();
    let last = next(&mut state).to_le_bytes();
    tail.copy_from_slice(&last[..tail.len()]);
}

/// Whether `bytes` is exactly the value for `key`.
pub fn verify(key: &[u8], bytes: &[u8]) -> bool {
    let mut state = seed(key);
    let mut chunks = bytes.chunks_exact(8);
    for chunk in &mut chunks {
        if chunk != next(&mut state).to_le_bytes() {
            return false;
        }
    }
    let tail = chunks.remainder();
    tail == &next(&mut state).to_le_bytes()[..tail.len()]
}

pub fn key(op: &str, value_size: u64, batch: usize, i: u64) -> Vec<u8> {
    format!("bench/{op}/{value_size}/{batch}/{i}").into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_verify_only_under_their_key() {
        for len in [1usize, 7, 8, 4096, 10_001] {
            let mut v = vec![0u8; len];
            fill(b"a", &mut v);
            assert!(verify(b"a", &v));
            assert!(!verify(b"b", &v));
            assert!(v.iter().any(|&b| b != 0));
            if len > 1 {
                v[len / 2] ^= 1;
                assert!(!verify(b"a", &v));
            }
        }
    }
}
