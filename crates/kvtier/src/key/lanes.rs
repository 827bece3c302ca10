//! Keyed digests of many keys at once: BLAKE3's compression run on sixteen
//! keys side by side, one key per lane of a 16 x u32 vector.
//!
//! A qualified key is at most 385 bytes, so its digest is always one BLAKE3
//! chunk: one to seven compressions chained, with no tree above them. The
//! blake3 crate hashes one input at a time, which for a key of one block is
//! one compression (about 60 ns here) with most of the vector unit idle; a
//! 1,024-key `batch_exists` spent half its time there. Sixteen keys per
//! compression fill the vector unit instead. The result is the crate's
//! digest bit for bit (a property test checks it against the crate for
//! every length a qualified key can have), so nothing on disk changes.
//!
//! The compression is written once over a small `Vector` trait and
//! instantiated for AVX-512 (sixteen lanes in one register; 22 µs for
//! 1,024 keys here), AVX2 (two registers of eight; 30 µs) and plain words
//! (one lane at a time, for processors with neither), the first two chosen
//! at run time by what the processor has. The crate one key at a time
//! took 61 µs.

use super::{KeyDigest, KeySecret};

/// Keys hashed side by side.
const LANES: usize = 16;

/// Compressions a qualified key can need: ceil(385 / 64).
const MAX_BLOCKS: usize = 7;

/// Bytes one lane can hold; longer inputs (only invalid keys, which are
/// refused elsewhere but still get a digest) go to the crate one by one.
const MAX_LANE_BYTES: usize = MAX_BLOCKS * 64;

type Lanes = [u32; LANES];

const IV: [u32; 8] = [
    0x6A09_E667,
    0xBB67_AE85,
    0x3C6E_F372,
    0xA54F_F53A,
    0x510E_527F,
    0x9B05_688C,
    0x1F83_D9AB,
    0x5BE0_CD19,
];

// BLAKE3's domain flags.
const CHUNK_START: u32 = 1;
const CHUNK_END: u32 = 2;
const ROOT: u32 = 8;
const KEYED_HASH: u32 = 16;

/// BLAKE3's message permutation, applied between rounds.
const PERMUTATION: [usize; 16] = [2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8];

/// The digests of `prefix` followed by each key, keyed with `secret`: the
/// same as [`super::Namespace::digest`] of each, in order.
pub(super) fn digest_many<K: AsRef<[u8]>>(
    secret: &KeySecret,
    prefix: &[u8],
    keys: &[K],
) -> Vec<KeyDigest> {
    let mut digests = vec![KeyDigest(0); keys.len()];
    let key_words = words_of_secret(secret);
    let mut group = Group::new();
    let mut members = [0usize; LANES];
    let mut filled = 0;
    for (i, key) in keys.iter().enumerate() {
        let key = key.as_ref();
        if prefix.len() + key.len() > MAX_LANE_BYTES {
            digests[i] = one_by_one(secret, prefix, key);
            continue;
        }
        group.load(filled, prefix, key);
        members[filled] = i;
        filled += 1;
        if filled == LANES {
            let out = group.digests(&key_words, filled);
            for (lane, &index) in members.iter().enumerate() {
                digests[index] = out[lane];
            }
            filled = 0;
        }
    }
    if filled > 0 {
        let out = group.digests(&key_words, filled);
        for (lane, &index) in members[..filled].iter().enumerate() {
            digests[index] = out[lane];
        }
    }
    digests
}

fn one_by_one(secret: &KeySecret, prefix: &[u8], key: &[u8]) -> KeyDigest {
    let mut hasher = blake3::Hasher::new_keyed(secret.as_bytes());
    hasher.update(prefix);
    hasher.update(key);
    KeyDigest(u128::from_le_bytes(
        hasher.finalize().as_bytes()[..16]
            .try_into()
            .expect("16 bytes"),
    ))
}

fn words_of_secret(secret: &KeySecret) -> [u32; 8] {
    let mut words = [0u32; 8];
    for (word, bytes) in words.iter_mut().zip(secret.as_bytes().chunks_exact(4)) {
        *word = u32::from_le_bytes(bytes.try_into().expect("4 bytes"));
    }
    words
}

/// Up to sixteen qualified keys, each zero-padded to whole blocks.
struct Group {
    bytes: [[u8; MAX_LANE_BYTES]; LANES],
    lens: [usize; LANES],
}

impl Group {
    fn new() -> Self {
        Group {
            bytes: [[0; MAX_LANE_BYTES]; LANES],
            lens: [0; LANES],
        }
    }

    fn load(&mut self, lane: usize, prefix: &[u8], key: &[u8]) {
        let len = prefix.len() + key.len();
        let row = &mut self.bytes[lane];
        row[..prefix.len()].copy_from_slice(prefix);
        row[prefix.len()..len].copy_from_slice(key);
        // The pad of the last block is zeros (BLAKE3's rule); what an
        // earlier, longer key left there must go.
        row[len..blocks_of(len) * 64].fill(0);
        self.lens[lane] = len;
    }

    /// The digests of lanes `0..filled`; the other lanes hold whatever
    /// earlier keys left and are ignored.
    fn digests(&self, key_words: &[u32; 8], filled: usize) -> [KeyDigest; LANES] {
        let mut blocks = [0usize; LANES];
        for (count, &len) in blocks.iter_mut().zip(&self.lens).take(filled) {
            *count = blocks_of(len);
        }
        let rounds = blocks[..filled].iter().copied().max().unwrap_or(0);
        let mut cv: [Lanes; 8] = std::array::from_fn(|w| [key_words[w]; LANES]);
        // The rows turned into what the compression reads: message word
        // by lane. Read only after every row of the group was written, so
        // the loads never wait on the copies that filled them.
        let mut message = [[0u32; LANES]; 16];
        for block in 0..rounds {
            let mut lens = [0u32; LANES];
            let mut flags = [0u32; LANES];
            for lane in 0..LANES {
                let count = blocks[lane];
                let bytes: &[u8; 64] = self.bytes[lane][block * 64..][..64]
                    .try_into()
                    .expect("64 bytes");
                for (w, word) in message.iter_mut().enumerate() {
                    word[lane] =
                        u32::from_le_bytes(bytes[w * 4..][..4].try_into().expect("4 bytes"));
                }
                let last = block + 1 == count;
                lens[lane] = if last {
                    (self.lens[lane] - block * 64) as u32
                } else {
                    64
                };
                flags[lane] = KEYED_HASH
                    | if block == 0 { CHUNK_START } else { 0 }
                    | if last { CHUNK_END | ROOT } else { 0 };
            }
            let next = compress(&cv, &message, &lens, &flags);
            for (row, next_row) in cv.iter_mut().zip(&next) {
                for lane in 0..LANES {
                    // A lane whose key has no block here keeps its value.
                    if block < blocks[lane] {
                        row[lane] = next_row[lane];
                    }
                }
            }
        }
        std::array::from_fn(|lane| {
            KeyDigest(
                u128::from(cv[0][lane])
                    | u128::from(cv[1][lane]) << 32
                    | u128::from(cv[2][lane]) << 64
                    | u128::from(cv[3][lane]) << 96,
            )
        })
    }
}

/// Blocks of a single-chunk input of `len` bytes (an empty input is one
/// empty block).
fn blocks_of(len: usize) -> usize {
    len.div_ceil(64).max(1)
}

/// Sixteen BLAKE3 compressions (block counter 0: one chunk), returning
/// the new chaining values: in vector registers where the processor has
/// AVX-512 or AVX2, else one lane after another.
fn compress(cv: &[Lanes; 8], message: &[Lanes; 16], lens: &Lanes, flags: &Lanes) -> [Lanes; 8] {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the processor was just found to have AVX-512F, the
            // function's only requirement beyond its arguments.
            return unsafe { x86::compress_avx512(cv, message, lens, flags) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: as above, for AVX2.
            return unsafe { x86::compress_avx2(cv, message, lens, flags) };
        }
    }
    compress_one_lane_at_a_time(cv, message, lens, flags)
}

/// The same compressions on plain integers, lane by lane.
fn compress_one_lane_at_a_time(
    cv: &[Lanes; 8],
    message: &[Lanes; 16],
    lens: &Lanes,
    flags: &Lanes,
) -> [Lanes; 8] {
    let mut out = [[0u32; LANES]; 8];
    for lane in 0..LANES {
        let words = compress_words(
            std::array::from_fn(|w| cv[w][lane]),
            std::array::from_fn(|w| message[w][lane]),
            lens[lane],
            flags[lane],
        );
        for (w, word) in words.into_iter().enumerate() {
            out[w][lane] = word;
        }
    }
    out
}

/// The word operations a compression needs, on one vector of lanes.
///
/// # Safety
/// Every method may use instructions of the vector's extension: call them
/// only where the processor has been found to have it.
trait Vector: Copy {
    unsafe fn splat(word: u32) -> Self;
    unsafe fn add(self, other: Self) -> Self;
    unsafe fn xor(self, other: Self) -> Self;
    unsafe fn rotate_16(self) -> Self;
    unsafe fn rotate_12(self) -> Self;
    unsafe fn rotate_8(self) -> Self;
    unsafe fn rotate_7(self) -> Self;
}

/// Plain words, so the one rule of a compression below serves the
/// one-lane path too.
impl Vector for u32 {
    unsafe fn splat(word: u32) -> Self {
        word
    }
    unsafe fn add(self, other: Self) -> Self {
        self.wrapping_add(other)
    }
    unsafe fn xor(self, other: Self) -> Self {
        self ^ other
    }
    unsafe fn rotate_16(self) -> Self {
        self.rotate_right(16)
    }
    unsafe fn rotate_12(self) -> Self {
        self.rotate_right(12)
    }
    unsafe fn rotate_8(self) -> Self {
        self.rotate_right(8)
    }
    unsafe fn rotate_7(self) -> Self {
        self.rotate_right(7)
    }
}

fn compress_words(cv: [u32; 8], message: [u32; 16], len: u32, flags: u32) -> [u32; 8] {
    // SAFETY: `u32`'s operations need no extension.
    unsafe { compress_vectors(cv, message, len, flags) }
}

/// BLAKE3's compression of one block on every lane of `V`: the seven
/// rounds written out, so every index is a constant and the state stays
/// in registers.
///
/// # Safety
/// As [`Vector`]'s methods.
#[inline(always)]
unsafe fn compress_vectors<V: Vector>(cv: [V; 8], m: [V; 16], len: V, flags: V) -> [V; 8] {
    // SAFETY: `V`'s extension is present (this function's contract).
    unsafe {
        let mut v = [
            cv[0],
            cv[1],
            cv[2],
            cv[3],
            cv[4],
            cv[5],
            cv[6],
            cv[7],
            V::splat(IV[0]),
            V::splat(IV[1]),
            V::splat(IV[2]),
            V::splat(IV[3]),
            V::splat(0),
            V::splat(0),
            len,
            flags,
        ];
        let mut m = m;
        for round in 0..7 {
            g(&mut v, 0, 4, 8, 12, m[0], m[1]);
            g(&mut v, 1, 5, 9, 13, m[2], m[3]);
            g(&mut v, 2, 6, 10, 14, m[4], m[5]);
            g(&mut v, 3, 7, 11, 15, m[6], m[7]);
            g(&mut v, 0, 5, 10, 15, m[8], m[9]);
            g(&mut v, 1, 6, 11, 12, m[10], m[11]);
            g(&mut v, 2, 7, 8, 13, m[12], m[13]);
            g(&mut v, 3, 4, 9, 14, m[14], m[15]);
            if round < 6 {
                m = std::array::from_fn(|i| m[PERMUTATION[i]]);
            }
        }
        std::array::from_fn(|w| v[w].xor(v[w + 8]))
    }
}

/// BLAKE3's quarter round, on every lane.
#[inline(always)]
unsafe fn g<V: Vector>(v: &mut [V; 16], a: usize, b: usize, c: usize, d: usize, x: V, y: V) {
    // SAFETY: `V`'s extension is present (this function's contract).
    unsafe {
        v[a] = v[a].add(v[b]).add(x);
        v[d] = v[d].xor(v[a]).rotate_16();
        v[c] = v[c].add(v[d]);
        v[b] = v[b].xor(v[c]).rotate_12();
        v[a] = v[a].add(v[b]).add(y);
        v[d] = v[d].xor(v[a]).rotate_8();
        v[c] = v[c].add(v[d]);
        v[b] = v[b].xor(v[c]).rotate_7();
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{compress_vectors, Lanes, Vector, LANES};
    use std::arch::x86_64::*;

    impl Vector for __m512i {
        #[inline(always)]
        unsafe fn splat(word: u32) -> Self {
            // SAFETY: the processor has AVX-512F (the trait's contract).
            unsafe { _mm512_set1_epi32(word as i32) }
        }
        #[inline(always)]
        unsafe fn add(self, other: Self) -> Self {
            // SAFETY: the processor has AVX-512F (the trait's contract).
            unsafe { _mm512_add_epi32(self, other) }
        }
        #[inline(always)]
        unsafe fn xor(self, other: Self) -> Self {
            // SAFETY: the processor has AVX-512F (the trait's contract).
            unsafe { _mm512_xor_si512(self, other) }
        }
        #[inline(always)]
        unsafe fn rotate_16(self) -> Self {
            // SAFETY: the processor has AVX-512F (the trait's contract).
            unsafe { _mm512_ror_epi32::<16>(self) }
        }
        #[inline(always)]
        unsafe fn rotate_12(self) -> Self {
            // SAFETY: the processor has AVX-512F (the trait's contract).
            unsafe { _mm512_ror_epi32::<12>(self) }
        }
        #[inline(always)]
        unsafe fn rotate_8(self) -> Self {
            // SAFETY: the processor has AVX-512F (the trait's contract).
            unsafe { _mm512_ror_epi32::<8>(self) }
        }
        #[inline(always)]
        unsafe fn rotate_7(self) -> Self {
            // SAFETY: the processor has AVX-512F (the trait's contract).
            unsafe { _mm512_ror_epi32::<7>(self) }
        }
    }

    impl Vector for __m256i {
        #[inline(always)]
        unsafe fn splat(word: u32) -> Self {
            // SAFETY: the processor has AVX2 (the trait's contract).
            unsafe { _mm256_set1_epi32(word as i32) }
        }
        #[inline(always)]
        unsafe fn add(self, other: Self) -> Self {
            // SAFETY: the processor has AVX2 (the trait's contract).
            unsafe { _mm256_add_epi32(self, other) }
        }
        #[inline(always)]
        unsafe fn xor(self, other: Self) -> Self {
            // SAFETY: the processor has AVX2 (the trait's contract).
            unsafe { _mm256_xor_si256(self, other) }
        }
        #[inline(always)]
        unsafe fn rotate_16(self) -> Self {
            // SAFETY: the processor has AVX2 (the trait's contract).
            unsafe { _mm256_or_si256(_mm256_srli_epi32::<16>(self), _mm256_slli_epi32::<16>(self)) }
        }
        #[inline(always)]
        unsafe fn rotate_12(self) -> Self {
            // SAFETY: the processor has AVX2 (the trait's contract).
            unsafe { _mm256_or_si256(_mm256_srli_epi32::<12>(self), _mm256_slli_epi32::<20>(self)) }
        }
        #[inline(always)]
        unsafe fn rotate_8(self) -> Self {
            // SAFETY: the processor has AVX2 (the trait's contract).
            unsafe { _mm256_or_si256(_mm256_srli_epi32::<8>(self), _mm256_slli_epi32::<24>(self)) }
        }
        #[inline(always)]
        unsafe fn rotate_7(self) -> Self {
            // SAFETY: the processor has AVX2 (the trait's contract).
            unsafe { _mm256_or_si256(_mm256_srli_epi32::<7>(self), _mm256_slli_epi32::<25>(self)) }
        }
    }

    /// # Safety
    /// The processor must have AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn compress_avx512(
        cv: &[Lanes; 8],
        message: &[Lanes; 16],
        lens: &Lanes,
        flags: &Lanes,
    ) -> [Lanes; 8] {
        // SAFETY: AVX-512F is present (this function's contract); each
        // load and store is one whole 16-word row, unaligned.
        unsafe {
            let load = |row: &Lanes| _mm512_loadu_si512(row.as_ptr().cast());
            let out = compress_vectors::<__m512i>(
                std::array::from_fn(|w| load(&cv[w])),
                std::array::from_fn(|w| load(&message[w])),
                load(lens),
                load(flags),
            );
            let mut rows = [[0u32; LANES]; 8];
            for (row, vector) in rows.iter_mut().zip(out) {
                _mm512_storeu_si512(row.as_mut_ptr().cast(), vector);
            }
            rows
        }
    }

    /// Sixteen lanes as two vectors of eight.
    ///
    /// # Safety
    /// The processor must have AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn compress_avx2(
        cv: &[Lanes; 8],
        message: &[Lanes; 16],
        lens: &Lanes,
        flags: &Lanes,
    ) -> [Lanes; 8] {
        let mut rows = [[0u32; LANES]; 8];
        for half in [0, 8] {
            // SAFETY: AVX2 is present (this function's contract); each load
            // and store is eight words from `half` of a 16-word row, one
            // whole unaligned 256-bit access.
            unsafe {
                let load = |row: &Lanes| _mm256_loadu_si256(row[half..].as_ptr().cast());
                let out = compress_vectors::<__m256i>(
                    std::array::from_fn(|w| load(&cv[w])),
                    std::array::from_fn(|w| load(&message[w])),
                    load(lens),
                    load(flags),
                );
                for (row, vector) in rows.iter_mut().zip(out) {
                    _mm256_storeu_si256(row[half..].as_mut_ptr().cast(), vector);
                }
            }
        }
        rows
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn reference(secret: &KeySecret, prefix: &[u8], key: &[u8]) -> KeyDigest {
        one_by_one(secret, prefix, key)
    }

    proptest! {
        /// Every length a lane takes (and past it, where the crate is
        /// used), in batches that mix lengths within one group.
        #[test]
        fn lanes_give_the_crates_digest(
            secret in any::<[u8; 32]>(),
            prefix in proptest::collection::vec(any::<u8>(), 0..130),
            keys in proptest::collection::vec(
                proptest::collection::vec(any::<u8>(), 0..400), 0..40),
        ) {
            let secret = KeySecret::from_bytes(secret);
            let digests = digest_many(&secret, &prefix, &keys);
            prop_assert_eq!(digests.len(), keys.len());
            for (key, digest) in keys.iter().zip(&digests) {
                prop_assert_eq!(*digest, reference(&secret, &prefix, key));
            }
        }
    }

    #[test]
    fn every_length_at_block_edges_matches() {
        let secret = KeySecret::from_bytes([0x5a; 32]);
        let prefix = b"\x05model";
        // Lengths around every block edge a lane meets, all in one batch
        // so short and long keys share groups.
        let keys: Vec<Vec<u8>> = (0..=MAX_LANE_BYTES + 70 - prefix.len())
            .map(|len| (0..len).map(|i| (i * 31 + len) as u8).collect())
            .collect();
        let digests = digest_many(&secret, prefix, &keys);
        for (key, digest) in keys.iter().zip(&digests) {
            assert_eq!(
                *digest,
                reference(&secret, prefix, key),
                "key of {} bytes",
                key.len()
            );
        }
    }

    #[test]
    fn every_vector_extension_matches_one_lane_at_a_time() {
        // Every path this processor can run, whichever the dispatch takes.
        let cv: [Lanes; 8] =
            std::array::from_fn(|w| std::array::from_fn(|l| (w * 97 + l) as u32 ^ 0x9E37_79B9));
        let message: [Lanes; 16] =
            std::array::from_fn(|w| std::array::from_fn(|l| (w * 7919 + l * 13) as u32));
        let lens = std::array::from_fn(|l| 1 + l as u32 * 4);
        let flags = std::array::from_fn(|l| KEYED_HASH | (l as u32 % 4) | ((l as u32 & 4) << 1));
        let plain = compress_one_lane_at_a_time(&cv, &message, &lens, &flags);
        assert_eq!(compress(&cv, &message, &lens, &flags), plain);
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: detected just above.
                let avx2 = unsafe { x86::compress_avx2(&cv, &message, &lens, &flags) };
                assert_eq!(avx2, plain);
            } else {
                eprintln!("no AVX2 on this processor: its lanes were not checked");
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: detected just above.
                let avx512 = unsafe { x86::compress_avx512(&cv, &message, &lens, &flags) };
                assert_eq!(avx512, plain);
            } else {
                eprintln!("no AVX-512 on this processor: its lanes were not checked");
            }
        }
    }
}
