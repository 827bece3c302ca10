//! Deterministic value bytes derived from a key: what the demo, the bench
//! and the tests write, so every read can be checked byte for byte and a
//! value read under the wrong key (or at the wrong offset) never passes.
//! Never all zeros.

fn seed(key: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &b in key {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    h | 1
}

fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// Fills `out` with the pattern for `key`.
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

/// The pattern for `key`, `len` bytes long.
pub fn value(key: &[u8], len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    fill(key, &mut out);
    out
}

/// Whether `bytes` is exactly the pattern for `key` at that length.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_verify_only_under_their_key() {
        for len in [1usize, 7, 8, 4096, 10_001] {
            let mut v = value(b"a", len);
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
