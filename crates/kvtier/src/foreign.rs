//! Memory another process may write at any moment (a client's shared
//! buffer): the store copies values out of it and into it only through
//! raw pointers, never forms a Rust reference to it (no `&[u8]` may point
//! at bytes someone else changes meanwhile), and never verifies a value
//! there: a disk read lands in private memory, is verified there, and only
//! then copied out.

use crate::tier::Destination;

/// Byte ranges of foreign memory, laid end to end as one value.
#[derive(Debug, Default)]
pub struct ForeignSegments {
    ranges: Ranges,
    len: usize,
}

/// Where the ranges are kept.
#[derive(Debug)]
enum Ranges {
    /// `(pointer, len)` each.
    Pointers(Vec<(*mut u8, usize)>),
    /// Ranges of one mapping at `base`, as little-endian `(u64 offset, u64
    /// len)` pairs kept elsewhere (a request frame): `count` of them at
    /// `pairs`. No copy of millions of ranges for one request.
    Packed {
        base: *mut u8,
        pairs: *const u8,
        count: usize,
    },
}

impl Default for Ranges {
    fn default() -> Self {
        Ranges::Pointers(Vec::new())
    }
}

impl Ranges {
    /// `(pointer, len)` of each range, in order.
    fn each(&self) -> impl Iterator<Item = (*mut u8, usize)> + '_ {
        let (pointers, packed) = match self {
            Ranges::Pointers(v) => (&v[..], None),
            Ranges::Packed { base, pairs, count } => (&[][..], Some((*base, *pairs, *count))),
        };
        let packed = packed.into_iter().flat_map(|(base, pairs, count)| {
            (0..count).map(move |i| {
                // SAFETY: `packed` checked that `count` pairs lie at
                // `pairs` (kept alive by its caller) and that each range
                // lies inside the mapping at `base`.
                let (offset, len) = unsafe { read_pair(pairs, i) };
                // SAFETY: `offset + len` lies inside the mapping (checked
                // by `packed`).
                (unsafe { base.add(offset as usize) }, len as usize)
            })
        });
        pointers.iter().copied().chain(packed)
    }
}

/// Pair `i` of little-endian `(u64, u64)` pairs at `pairs`.
///
/// # Safety
/// `pairs` must point at least `16 * (i + 1)` readable bytes.
unsafe fn read_pair(pairs: *const u8, i: usize) -> (u64, u64) {
    let mut bytes = [0u8; 16];
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(pairs.add(i * 16), bytes.as_mut_ptr(), 16) };
    (
        u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")),
        u64::from_le_bytes(bytes[8..].try_into().expect("8 bytes")),
    )
}

// SAFETY: the pointers name memory mapped for the whole request by
// whoever made the segments (see `new`); nothing here is tied to a thread.
unsafe impl Send for ForeignSegments {}
// SAFETY: shared use only copies through raw pointers, as exclusive use
// does (the memory may change under either anyway).
unsafe impl Sync for ForeignSegments {}

impl ForeignSegments {
    /// # Safety
    /// Every `(pointer, len)` must stay mapped, readable and writable for
    /// as long as the value lives, and no two may overlap. Their contents
    /// may change at any time: that is what this type is for.
    pub unsafe fn new(segments: Vec<(*mut u8, usize)>) -> ForeignSegments {
        let len = segments.iter().map(|s| s.1).sum();
        ForeignSegments {
            ranges: Ranges::Pointers(segments),
            len,
        }
    }

    /// The ranges of the mapping of `mapped` bytes at `base` that `pairs`
    /// names as little-endian `(u64 offset, u64 len)` pairs (16 bytes
    /// each), without copying them; `None` if `pairs` is not whole pairs,
    /// a range does not lie inside the mapping, or the total length does
    /// not fit.
    ///
    /// # Safety
    /// The mapping must stay mapped, readable and writable, and the bytes
    /// of `pairs` must stay as they are, for as long as the value lives;
    /// no two ranges may overlap. The mapping's contents may change at any
    /// time.
    pub unsafe fn packed(base: *mut u8, mapped: usize, pairs: &[u8]) -> Option<ForeignSegments> {
        if !pairs.len().is_multiple_of(16) {
            return None;
        }
        let count = pairs.len() / 16;
        let mut len = 0usize;
        for i in 0..count {
            // SAFETY: `pairs` holds `count` whole pairs.
            let (offset, range) = unsafe { read_pair(pairs.as_ptr(), i) };
            let end = offset.checked_add(range)?;
            if end > mapped as u64 {
                return None;
            }
            len = len.checked_add(range as usize)?;
        }
        Some(ForeignSegments {
            ranges: Ranges::Packed {
                base,
                pairs: pairs.as_ptr(),
                count,
            },
            len,
        })
    }

    /// Bytes in all the segments.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies the bytes at `at..at + out.len()` into `out` (private
    /// memory), through raw pointers.
    pub fn copy_out(&self, at: usize, out: &mut [u8]) {
        self.copy_out_with(at, out, false);
    }

    /// `copy_out`, with non-temporal stores for pieces from
    /// `bulk_copy::STREAM_FROM` bytes when `elsewhere` (`out` is memory
    /// nothing reads soon: a value's fresh pool extent).
    fn copy_out_with(&self, mut at: usize, mut out: &mut [u8], elsewhere: bool) {
        assert!(at + out.len() <= self.len, "a copy past the segments");
        for (ptr, len) in self.ranges.each() {
            if out.is_empty() {
                return;
            }
            if at >= len {
                at -= len;
                continue;
            }
            let n = (len - at).min(out.len());
            // SAFETY: `at + n <= len` inside a segment the creator keeps
            // mapped (`new`); `out` is ours and cannot overlap it. A
            // client writing its segment meanwhile changes which bytes
            // are copied, never where (either copy: the put's bytes are
            // then the client's own mixture, checksummed as copied).
            unsafe {
                if elsewhere {
                    crate::bulk_copy::copy_raw_for_elsewhere(out.as_mut_ptr(), ptr.add(at), n);
                } else {
                    std::ptr::copy_nonoverlapping(ptr.add(at), out.as_mut_ptr(), n);
                }
            }
            out = &mut out[n..];
            at = 0;
        }
    }

    /// Copies `bytes` to the front of the segments, through raw pointers.
    pub fn copy_in(&self, bytes: &[u8]) {
        self.copy_in_at(0, bytes);
    }

    /// Copies `bytes` to the segments from byte `at` on.
    pub fn copy_in_at(&self, mut at: usize, mut bytes: &[u8]) {
        assert!(
            at.checked_add(bytes.len())
                .is_some_and(|end| end <= self.len),
            "a copy past the segments"
        );
        for (ptr, len) in self.ranges.each() {
            if bytes.is_empty() {
                return;
            }
            if at >= len {
                at -= len;
                continue;
            }
            let n = (len - at).min(bytes.len());
            // SAFETY: as in `copy_out`; `at + n` is within this segment.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr.add(at), n) };
            at = 0;
            bytes = &bytes[n..];
        }
    }
}

impl Destination for ForeignSegments {
    fn capacity(&self) -> usize {
        self.len
    }

    /// Never one slice: disk reads land in a private buffer and are copied
    /// out from there (a value that fails verification is zeroed after).
    fn contiguous(&mut self) -> Option<&mut [u8]> {
        None
    }

    fn fill_at(&mut self, at: usize, bytes: &[u8]) {
        self.copy_in_at(at, bytes);
    }
}

/// Where a put's bytes come from.
pub(crate) trait Source {
    fn len(&self) -> usize;
    /// Copies the bytes at `at..at + chunk.len()` into `chunk`.
    fn copy_to(&self, at: usize, chunk: &mut [u8]);
    /// `copy_to` into memory nothing reads soon (a value's fresh pool
    /// extent): large pieces with non-temporal stores where the source
    /// allows (`bulk_copy::copy_for_elsewhere`).
    fn copy_to_elsewhere(&self, at: usize, chunk: &mut [u8]) {
        self.copy_to(at, chunk);
    }
}

impl Source for &[&[u8]] {
    fn len(&self) -> usize {
        self.iter().map(|s| s.len()).sum()
    }

    fn copy_to(&self, at: usize, chunk: &mut [u8]) {
        copy_segments(self, at, chunk, <[u8]>::copy_from_slice);
    }

    fn copy_to_elsewhere(&self, at: usize, chunk: &mut [u8]) {
        copy_segments(self, at, chunk, crate::bulk_copy::copy_for_elsewhere);
    }
}

/// Copies the bytes of `segments` at `at..at + chunk.len()` into `chunk`
/// with `copy` (a destination piece and an equally long source piece).
fn copy_segments(
    segments: &[&[u8]],
    mut at: usize,
    mut chunk: &mut [u8],
    copy: fn(&mut [u8], &[u8]),
) {
    for segment in segments {
        if chunk.is_empty() {
            return;
        }
        if at >= segment.len() {
            at -= segment.len();
            continue;
        }
        let n = (segment.len() - at).min(chunk.len());
        copy(&mut chunk[..n], &segment[at..at + n]);
        chunk = &mut chunk[n..];
        at = 0;
    }
}

impl Source for &ForeignSegments {
    fn len(&self) -> usize {
        self.len
    }

    fn copy_to(&self, at: usize, chunk: &mut [u8]) {
        self.copy_out(at, chunk);
    }

    fn copy_to_elsewhere(&self, at: usize, chunk: &mut [u8]) {
        self.copy_out_with(at, chunk, true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A put's copy out of a client's segments into a fresh extent, with
    /// non-temporal stores for its large pieces: every byte where a plain
    /// copy puts it, from any offset, and nothing past the chunk.
    #[test]
    fn a_copy_for_elsewhere_out_of_segments_is_a_plain_copy() {
        let len = 3 * crate::bulk_copy::STREAM_FROM + 12_345;
        let mut backing = crate::pattern::value(b"segments", len);
        let want = backing.clone();
        let (a, rest) = backing.split_at_mut(4097);
        let (b, c) = rest.split_at_mut(crate::bulk_copy::STREAM_FROM + 7);
        // SAFETY: `backing` outlives `foreign` and the pieces are disjoint.
        let foreign = unsafe {
            ForeignSegments::new(vec![
                (a.as_mut_ptr(), a.len()),
                (b.as_mut_ptr(), b.len()),
                (c.as_mut_ptr(), c.len()),
            ])
        };
        for (at, n) in [
            (0, len),
            (3, len - 3),
            (4096, 2 * crate::bulk_copy::STREAM_FROM + 1),
        ] {
            let mut out = vec![0xeeu8; n + 64];
            (&foreign).copy_to_elsewhere(at, &mut out[..n]);
            assert!(out[..n] == want[at..at + n], "bytes from {at} differ");
            assert!(
                out[n..].iter().all(|&x| x == 0xee),
                "written past the chunk"
            );
        }
    }

    #[test]
    fn copies_cross_segment_bounds_both_ways() {
        let mut a = vec![0u8; 5];
        let mut b = vec![0u8; 7];
        // SAFETY: both vectors outlive `foreign` (dropped before they are
        // read) and do not overlap.
        let foreign =
            unsafe { ForeignSegments::new(vec![(a.as_mut_ptr(), 5), (b.as_mut_ptr(), 7)]) };
        let bytes: Vec<u8> = (1..=12).collect();
        foreign.copy_in(&bytes);
        let mut out = vec![0u8; 6];
        foreign.copy_out(3, &mut out);
        assert_eq!(out, bytes[3..9]);
        drop(foreign);
        assert_eq!((&a[..], &b[..]), (&bytes[..5], &bytes[5..]));
        // The same through packed ranges of one mapping: 3 bytes at 10,
        // 2 at 0, 4 at 20.
        let mut mapping = vec![0u8; 32];
        let pairs: Vec<u8> = [(10u64, 3u64), (0, 2), (20, 4)]
            .iter()
            .flat_map(|(o, l)| o.to_le_bytes().into_iter().chain(l.to_le_bytes()))
            .collect();
        // SAFETY: `mapping` and `pairs` outlive `packed`; the ranges are
        // disjoint.
        let packed = unsafe { ForeignSegments::packed(mapping.as_mut_ptr(), 32, &pairs) }.unwrap();
        assert_eq!(packed.len(), 9);
        packed.copy_in(&bytes[..9]);
        let mut out = vec![0u8; 5];
        packed.copy_out(2, &mut out);
        assert_eq!(out, bytes[2..7]);
        drop(packed);
        assert_eq!(&mapping[10..13], &bytes[..3]);
        assert_eq!(&mapping[0..2], &bytes[3..5]);
        assert_eq!(&mapping[20..24], &bytes[5..9]);
        // Ranges outside the mapping, wrapping, or not whole pairs: none.
        for bad in [
            [(30u64, 3u64)].to_vec(),
            [(u64::MAX, 2)].to_vec(),
            [(0, u64::MAX)].to_vec(),
        ] {
            let pairs: Vec<u8> = bad
                .iter()
                .flat_map(|(o, l)| o.to_le_bytes().into_iter().chain(l.to_le_bytes()))
                .collect();
            // SAFETY: as above (nothing is made).
            assert!(unsafe { ForeignSegments::packed(mapping.as_mut_ptr(), 32, &pairs) }.is_none());
        }
        let torn = &pairs[..15];
        // SAFETY: as above (nothing is made).
        let none = unsafe { ForeignSegments::packed(mapping.as_mut_ptr(), 32, torn) };
        assert!(none.is_none());
        let parts: &[&[u8]] = &[&bytes[..4], &bytes[4..]];
        let mut chunk = [0u8; 5];
        Source::copy_to(&parts, 2, &mut chunk);
        assert_eq!(chunk, bytes[2..7]);
    }
}
