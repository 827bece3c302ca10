//! Memory another process may write at any moment (a client's shared
//! buffer): the store copies values out of it and into it only through
//! raw pointers, never forms a Rust reference to it (no `&[u8]` may point
//! at bytes someone else changes meanwhile), and never verifies a value
//! there: a disk read lands in private memory, is verified there, and only
//! then copied out.

use crate::disk::Destination;

/// Byte ranges of foreign memory, laid end to end as one value.
#[derive(Debug, Default)]
pub struct ForeignSegments {
    segments: Vec<(*mut u8, usize)>,
    len: usize,
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
        ForeignSegments { segments, len }
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
    pub fn copy_out(&self, mut at: usize, mut out: &mut [u8]) {
        assert!(at + out.len() <= self.len, "a copy past the segments");
        for &(ptr, len) in &self.segments {
            if out.is_empty() {
                return;
            }
            if at >= len {
                at -= len;
                continue;
            }
            let n = (len - at).min(out.len());
            // SAFETY: `at + n <= len` inside a segment the creator keeps
            // mapped (`new`); `out` is ours and cannot overlap it.
            unsafe { std::ptr::copy_nonoverlapping(ptr.add(at), out.as_mut_ptr(), n) };
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
        for &(ptr, len) in &self.segments {
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
}

impl Source for &[&[u8]] {
    fn len(&self) -> usize {
        self.iter().map(|s| s.len()).sum()
    }

    fn copy_to(&self, mut at: usize, mut chunk: &mut [u8]) {
        for segment in self.iter() {
            if chunk.is_empty() {
                return;
            }
            if at >= segment.len() {
                at -= segment.len();
                continue;
            }
            let n = (segment.len() - at).min(chunk.len());
            chunk[..n].copy_from_slice(&segment[at..at + n]);
            chunk = &mut chunk[n..];
            at = 0;
        }
    }
}

impl Source for &ForeignSegments {
    fn len(&self) -> usize {
        self.len
    }

    fn copy_to(&self, at: usize, chunk: &mut [u8]) {
        self.copy_out(at, chunk);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let parts: &[&[u8]] = &[&bytes[..4], &bytes[4..]];
        let mut chunk = [0u8; 5];
        Source::copy_to(&parts, 2, &mut chunk);
        assert_eq!(chunk, bytes[2..7]);
    }
}
