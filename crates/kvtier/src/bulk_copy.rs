//! Copies of values into a caller's memory that the caller will not read
//! back soon: a KV block bound for an engine's buffer is next read by a
//! GPU's DMA engine or by the engine on another core, not by this thread.
//!
//! A plain `memcpy` of a large value first reads every destination line
//! into the cache (to own it), then writes it: three memory transfers per
//! line. Non-temporal stores write whole lines to memory without reading
//! them: two. Measured on this project's 2-core VM (32 MiB in 1 MiB
//! values out of a memfd mapping): 6.0 -> 9.4 GB/s on one core, 12-13.6 ->
//! 19 GB/s on two. glibc switches to such stores only for single copies
//! past a large fraction of the last-level cache, which 1 MiB values never
//! reach.
//!
//! Below `STREAM_FROM` bytes, or off x86-64, this is `copy_from_slice`: a
//! small value's lines are cheap to own, and its reader may be close by.
//!
//! Where the destination was written or read just before (an engine's
//! staging buffer reused batch after batch), its lines are already in
//! the cache and a plain copy is the faster one. So callers stream only
//! batches of `STREAM_BATCH_FROM` bytes or more (`worth_streaming`), too
//! large to stay in the copying cores' caches for their reader anyway
//! (as glibc streams only copies past a fraction of the last-level cache).
//! Measured with one 32 MiB batch of 1 MiB values, two threads: +21-27 %
//! into buffers last written by the previous batch's copy, +7-10 % into
//! buffers zeroed just before; an embedded bench of 8 x 1 MiB batches
//! into the same 8 MiB of buffers lost about a fifth with streaming.

/// The smallest copy made with non-temporal stores.
pub const STREAM_FROM: usize = 256 << 10;

/// The smallest batch (bytes copied out at once, all values together)
/// whose values are worth streaming.
pub const STREAM_BATCH_FROM: usize = 16 << 20;

/// Whether a batch copying out `total` bytes should copy with
/// `copy_for_elsewhere` (else a plain copy).
pub fn worth_streaming(total: usize) -> bool {
    total >= STREAM_BATCH_FROM
}

/// Copies `src` into `dst` (equal lengths), with non-temporal stores from
/// `STREAM_FROM` bytes up. The destination's old contents are never read.
///
/// # Panics
/// If the lengths differ, as `copy_from_slice` does.
pub fn copy_for_elsewhere(dst: &mut [u8], src: &[u8]) {
    assert_eq!(
        dst.len(),
        src.len(),
        "copy_for_elsewhere: a {}-byte source into a {}-byte destination",
        src.len(),
        dst.len()
    );
    // SAFETY: two valid slices of equal length; `dst` is the caller's
    // exclusive borrow, so they do not overlap.
    unsafe { copy_raw_for_elsewhere(dst.as_mut_ptr(), src.as_ptr(), dst.len()) }
}

/// `copy_for_elsewhere` between raw pointers: for a source in memory that
/// no reference may be made to (a mapping another process shares, whose
/// range the caller knows nobody writes meanwhile).
///
/// # Safety
/// `dst` valid for writes and `src` for reads of `len` bytes, not
/// overlapping, and nothing in this process writes `src`'s range during
/// the call. Another process writing its own shared memory meanwhile (a
/// client's buffer) only changes which bytes land: like a plain copy,
/// this reads each source byte once and decides nothing by it.
pub unsafe fn copy_raw_for_elsewhere(dst: *mut u8, src: *const u8, len: usize) {
    // Miri cannot run the streaming stores' inline assembly; it checks the
    // callers' pointers through the plain copy, which touches the same
    // bytes.
    if len < STREAM_FROM || cfg!(miri) {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
        return;
    }
    // SAFETY: the caller's contract.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        stream_copy_x86(dst, src, len)
    };
    // SAFETY: the caller's contract.
    #[cfg(not(target_arch = "x86_64"))]
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, len)
    };
}

/// SSE2 (every x86-64 has it): plain copies up to the destination's first
/// 16-byte boundary and after its last, 64 bytes a round in between with
/// `movntdq`, then a store fence so that the bytes are visible to other
/// cores (and to the caller's next plain store ordering) before return.
///
/// # Safety
/// `dst` and `src` valid for `len` bytes each, not overlapping.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_copy_x86(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    let head = dst.align_offset(16).min(len);
    // SAFETY: every access below lies in `0..len` of both ranges (the
    // caller's contract); the streaming stores' addresses are 16-byte
    // aligned (`dst + head` is, and steps are multiples of 16).
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, head);
        let mut at = head;
        while at + 64 <= len {
            let s = src.add(at).cast::<__m128i>();
            let d = dst.add(at).cast::<__m128i>();
            let (a, b, c, e) = (
                _mm_loadu_si128(s),
                _mm_loadu_si128(s.add(1)),
                _mm_loadu_si128(s.add(2)),
                _mm_loadu_si128(s.add(3)),
            );
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
            at += 64;
        }
        _mm_sfence();
        std::ptr::copy_nonoverlapping(src.add(at), dst.add(at), len - at);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Every byte lands where a plain copy puts it, and nothing
        /// around the destination is touched, whatever the alignment of
        /// either side and the length (on both sides of `STREAM_FROM`).
        #[test]
        fn copies_exactly_what_a_plain_copy_does(
            len in prop_oneof![0usize..4096, (STREAM_FROM - 100)..(STREAM_FROM + 5000)],
            src_skew in 0usize..64,
            dst_skew in 0usize..64,
            seed in any::<u64>(),
        ) {
            let src: Vec<u8> = crate::pattern::value(&seed.to_le_bytes(), len + src_skew);
            let mut dst = vec![0xeeu8; len + dst_skew + 64];
            copy_for_elsewhere(&mut dst[dst_skew..dst_skew + len], &src[src_skew..]);
            prop_assert!(dst[..dst_skew].iter().all(|&b| b == 0xee));
            prop_assert_eq!(&dst[dst_skew..dst_skew + len], &src[src_skew..]);
            prop_assert!(dst[dst_skew + len..].iter().all(|&b| b == 0xee));
        }
    }

    #[test]
    #[should_panic(expected = "a 8-byte source into a 9-byte destination")]
    fn unequal_lengths_are_refused() {
        copy_for_elsewhere(&mut [0u8; 9], &[0u8; 8]);
    }
}
