//! Verified value reads: the disk tier's half of a get.
//!
//! Everything about turning an index entry into checked bytes lives here:
//! the file offset of a page, the choice between reading straight into the
//! caller's memory and through a bounce buffer (a fact of the region file:
//! O_DIRECT or not), cutting a value into pieces submitted together, and
//! the checksum of each value taken piece by piece as its pieces complete,
//! so verification overlaps the reads still in flight. Above this module
//! nothing computes page offsets or touches region files.

use super::{DiskTier, Region};
use crate::disk::DiskLoc;
use crate::error::Error;
use crate::io::{is_direct_io_aligned, AlignedBuf, ReadOp};
use crate::io::{BufferPool, IoEngine};
use crate::key::{KeyDigest, ValueChecksum};
pub(crate) use crate::tier::{Destination, ReadOutcome};
use crate::units::{page_round_up, PAGE_SIZE};
use std::sync::{Arc, Mutex};

/// One value to read: what the index says about it, with its region held
/// open (a reclaim that unlinks the file meanwhile cannot take the bytes).
#[derive(Clone)]
pub(crate) struct ValueRead {
    pub digest: KeyDigest,
    pub region: Arc<Region>,
    pub loc: DiskLoc,
    pub len: usize,
    pub checksum: u64,
}

/// One value's verification while its pieces complete in any order.
struct PieceCheck {
    checksum: ValueChecksum,
    /// Each piece's bytes once its read has completed and it could not be
    /// hashed at once (an earlier piece was still in flight).
    waiting: Vec<Option<Landed>>,
    /// The first piece not yet added to the checksum.
    next: usize,
    pieces: usize,
    /// Value bytes not yet added (padding past the value is not hashed).
    remaining: usize,
    expected: u64,
    /// Set once every piece is in and the checksum matched.
    verified: bool,
}

/// A completed piece's bytes, as the engine handed them to the completion
/// callback. The pointer carries the engine's own provenance for the
/// buffer (never an address taken before the buffer was lent to the
/// engine as `&mut`), and `IoEngine::read_batch_then` promises the bytes
/// stay valid and unwritten until it returns.
struct Landed {
    ptr: *const u8,
    len: usize,
}

// SAFETY: the pointee is plain bytes that no one writes until the batch
// call returns; the pointer is only read under the check's mutex.
unsafe impl Send for Landed {}

impl PieceCheck {
    fn new(digest: KeyDigest, pieces: usize, len: usize, expected: u64) -> Self {
        PieceCheck {
            checksum: ValueChecksum::new(digest),
            waiting: (0..pieces).map(|_| None).collect(),
            next: 0,
            pieces,
            remaining: len,
            expected,
            verified: false,
        }
    }

    fn hash(&mut self, bytes: &[u8]) {
        let take = bytes.len().min(self.remaining);
        self.checksum.update(&bytes[..take]);
        self.remaining -= take;
        self.next += 1;
    }

    /// Records that `piece` has been read as `bytes`, and adds every piece
    /// now contiguous with what was hashed before; once all are in, sets
    /// `verified` if the checksum matches.
    fn complete(&mut self, piece: usize, bytes: &[u8]) {
        if piece != self.next {
            self.waiting[piece] = Some(Landed {
                ptr: bytes.as_ptr(),
                len: bytes.len(),
            });
            return;
        }
        self.hash(bytes);
        while self.next < self.pieces {
            let Some(landed) = self.waiting[self.next].take() else {
                break;
            };
            // SAFETY: see `Landed`: the engine handed these bytes over once
            // their read completed and keeps them valid and unwritten until
            // the batch call (which this callback runs inside) returns.
            let bytes = unsafe { std::slice::from_raw_parts(landed.ptr, landed.len) };
            self.hash(bytes);
        }
        if self.next == self.pieces {
            self.verified = self.checksum.finish() == self.expected;
        }
    }
}

impl DiskTier {
    /// Reads every value of `reads` (None where a key needs no disk read)
    /// into the matching destination, all at once, each value cut into
    /// pieces of `Config::read_piece` bytes, and verifies each against its
    /// checksum and key digest. Straight into the destination when it is one
    /// slice and the region file's O_DIRECT mode allows it; through a bounce
    /// buffer otherwise. Every destination must hold at least its value's
    /// length (the caller checked it to answer BufferTooSmall).
    ///
    /// Values in files whose reads are bounded by the storage deadline
    /// (`Region::bounded`) are read by the bounded reader into the store's
    /// own buffers, started first so they overlap the other reads, and
    /// copied into their destinations only if they completed within the
    /// deadline (`ReadOutcome::TimedOut` otherwise).
    pub(crate) fn read_values<D: Destination>(
        &self,
        reads: &[Option<ValueRead>],
        dests: &mut [D],
    ) -> Vec<Option<ReadOutcome>> {
        let Some(bounded) = &self.bounded else {
            return self.reader.read_checked(reads, dests, true);
        };
        if !reads.iter().flatten().any(|r| r.region.bounded()) {
            return self.reader.read_checked(reads, dests, true);
        }
        let split = |keep: bool| -> Vec<Option<ValueRead>> {
            reads
                .iter()
                .map(|r| r.as_ref().filter(|r| r.region.bounded() == keep).cloned())
                .collect()
        };
        let (far, near) = (split(true), split(false));
        let pending = bounded.start(&far);
        let mut outcomes = if near.iter().any(Option::is_some) {
            self.reader.read_checked(&near, dests, true)
        } else {
            near.iter().map(|_| None).collect()
        };
        for (slot, outcome) in outcomes.iter_mut().zip(pending.finish(&far, dests)) {
            if outcome.is_some() {
                *slot = outcome;
            }
        }
        outcomes
    }
}

/// Reads and verifies values through one io engine: the disk tier's own,
/// or the bounded reader's (`super::deadline`).
#[derive(Debug)]
pub(crate) struct ValueReader {
    pub(super) engine: Arc<dyn IoEngine>,
    /// Bounce buffers, shared by every reader of one disk tier.
    pub(super) bounce: Arc<BufferPool>,
    /// Bytes per piece of a value read (`Config::read_piece`).
    read_piece: usize,
}

impl ValueReader {
    pub(crate) fn new(
        engine: Arc<dyn IoEngine>,
        bounce: Arc<BufferPool>,
        read_piece: usize,
    ) -> Self {
        ValueReader {
            engine,
            bounce,
            read_piece: read_piece.max(1),
        }
    }

    /// `read_verified`; `caller_memory` says whether `dests` may be written
    /// by someone else during the read (then a direct read that does not
    /// verify is read again privately before it counts as damage).
    pub(crate) fn read_checked<D: Destination>(
        &self,
        reads: &[Option<ValueRead>],
        dests: &mut [D],
        caller_memory: bool,
    ) -> Vec<Option<ReadOutcome>> {
        self.read_checked_once(reads, dests, caller_memory, true)
    }

    /// `read_checked`; with `second_look`, a value that fails verification
    /// where the bytes seen may not be the disk's (the caller's memory, or
    /// a buffered file's page cache) is read again into private memory,
    /// once, before it is called damaged.
    fn read_checked_once<D: Destination>(
        &self,
        reads: &[Option<ValueRead>],
        dests: &mut [D],
        caller_memory: bool,
        second_look: bool,
    ) -> Vec<Option<ReadOutcome>> {
        assert_eq!(reads.len(), dests.len(), "one destination per read");
        let piece_len = self.read_piece;
        // Per read: the bytes to read (a page multiple under O_DIRECT) and
        // the bounce buffer, if any.
        let mut plans: Vec<Option<(usize, Option<AlignedBuf>)>> = reads
            .iter()
            .zip(dests.iter_mut())
            .map(|(read, dest)| {
                let read = read.as_ref()?;
                debug_assert!(dest.capacity() >= read.len);
                let padded = page_round_up(read.len as u64) as usize;
                let direct = read.region.direct_io();
                let contiguous = dest.contiguous();
                let fits_direct = contiguous
                    .as_ref()
                    .is_some_and(|b| b.len() >= padded && is_direct_io_aligned(&b[..padded]));
                let bounce = if contiguous.is_some() && (!direct || fits_direct) {
                    None
                } else {
                    Some(self.bounce.take(padded))
                };
                Some((if direct { padded } else { read.len }, bounce))
            })
            .collect();
        let checks: Vec<Option<Mutex<PieceCheck>>>;
        let mut io_results: Vec<std::io::Result<()>> = reads.iter().map(|_| Ok(())).collect();
        {
            let mut ops: Vec<ReadOp<'_>> = Vec::new();
            // Per op: the read it belongs to and its piece number.
            let mut owners: Vec<(usize, usize)> = Vec::new();
            let mut made: Vec<Option<Mutex<PieceCheck>>> = Vec::with_capacity(reads.len());
            for (i, ((read, plan), dest)) in reads
                .iter()
                .zip(plans.iter_mut())
                .zip(dests.iter_mut())
                .enumerate()
            {
                let (Some(read), Some((read_len, bounce))) = (read, plan) else {
                    made.push(None);
                    continue;
                };
                let offset = u64::from(read.loc.page()) * PAGE_SIZE;
                let target: &mut [u8] = match bounce {
                    Some(bounce) => &mut bounce.as_mut_slice()[..*read_len],
                    None => match dest.contiguous() {
                        Some(b) => &mut b[..*read_len],
                        None => unreachable!("scattered destinations read through a bounce buffer"),
                    },
                };
                // A buffered file is read in two requests per value: the
                // page cache's readahead streams each half ahead of its
                // reader, where `read_piece` pieces on several threads at
                // once look random to the file system. Measured on JuiceFS
                // (docs/benchmarks.md, "Shared storage"): one value of 64
                // MiB read cold at 0.35 of a plain read in 2 MiB pieces,
                // 0.79 in two requests (0.70 in one, which also leaves a
                // cached value's copy to one thread: 0.44 warm, against
                // 0.64 in two).
                let piece_len = if read.region.direct_io() {
                    piece_len
                } else {
                    page_round_up(target.len().div_ceil(2) as u64).max(PAGE_SIZE) as usize
                };
                let mut pieces = 0;
                for (k, piece) in target.chunks_mut(piece_len).enumerate() {
                    ops.push(ReadOp::new(
                        &read.region.file,
                        offset + (k * piece_len) as u64,
                        piece,
                    ));
                    owners.push((i, k));
                    pieces += 1;
                }
                made.push(Some(Mutex::new(PieceCheck::new(
                    read.digest,
                    pieces,
                    read.len,
                    read.checksum,
                ))));
            }
            checks = made;
            let verify = |op: usize, bytes: &[u8]| {
                let (i, piece) = owners[op];
                if let Some(check) = &checks[i] {
                    check.lock().unwrap().complete(piece, bytes);
                }
            };
            self.engine.read_batch_then(&mut ops, &verify);
            for ((i, _), op) in owners.iter().copied().zip(ops) {
                if io_results[i].is_ok() {
                    io_results[i] = op.result;
                }
            }
        }
        let mut outcomes = Vec::with_capacity(reads.len());
        for (i, ((read, plan), dest)) in reads
            .iter()
            .zip(plans.iter_mut())
            .zip(dests.iter_mut())
            .enumerate()
        {
            let (Some(read), Some((read_len, bounce))) = (read, plan) else {
                outcomes.push(None);
                continue;
            };
            let verified = checks[i]
                .as_ref()
                .is_some_and(|c| c.lock().unwrap().verified);
            let outcome = match std::mem::replace(&mut io_results[i], Ok(())) {
                Ok(()) if verified => {
                    if let Some(bounce) = bounce {
                        dest.fill_from(&bounce.as_slice()[..read.len]);
                    }
                    ReadOutcome::Verified
                }
                // Read straight into the caller's memory: a caller (a
                // shared-memory client) may have written there while the
                // read landed, so the bytes seen are no verdict on the disk.
                // Decide from a read into private memory before calling the
                // value damaged (which drops it from the index).
                // A buffered file's page cache may hold a copy read before
                // its writer's bytes landed (`mount::drop_cached`): drop
                // it and read the file system's bytes before deciding.
                Ok(()) if second_look && !read.region.direct_io() => {
                    let offset = u64::from(read.loc.page()) * PAGE_SIZE;
                    super::mount::drop_cached(
                        &read.region.file,
                        offset,
                        page_round_up(read.len as u64),
                    );
                    match self.reread_privately(read) {
                        Some(private) => {
                            tracing::debug!(
                                region = read.loc.region(),
                                page = read.loc.page(),
                                "a buffered read did not verify from the page cache but did \
                                 from the file system: a stale cached copy was dropped"
                            );
                            dest.fill_from(&private.as_slice()[..read.len]);
                            self.bounce.give_back(private);
                            ReadOutcome::Verified
                        }
                        None => ReadOutcome::Rejected("checksum or key digest mismatch".into()),
                    }
                }
                Ok(()) if second_look && bounce.is_none() && caller_memory => {
                    match self.reread_privately(read) {
                        Some(private) => {
                            tracing::warn!(
                                region = read.loc.region(),
                                page = read.loc.page(),
                                "a value read into the caller's memory did not verify there but \
                             did in private memory: the caller's buffer changed during the \
                             read"
                            );
                            dest.fill_from(&private.as_slice()[..read.len]);
                            self.bounce.give_back(private);
                            ReadOutcome::Verified
                        }
                        None => ReadOutcome::Rejected("checksum or key digest mismatch".into()),
                    }
                }
                Ok(()) => ReadOutcome::Rejected("checksum or key digest mismatch".into()),
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => ReadOutcome::Rejected(
                    format!("value lies past the end of its region file: {e}"),
                ),
                Err(e) => ReadOutcome::Failed(Error::io(
                    format!(
                        "reading region {} page {}",
                        read.loc.region(),
                        read.loc.page()
                    ),
                    e,
                )),
            };
            if let ReadOutcome::Rejected(reason) = &outcome {
                tracing::warn!(
                    region = read.loc.region(),
                    page = read.loc.page(),
                    len = read.len,
                    %reason,
                    "disk read failed verification"
                );
                if bounce.is_none() {
                    // What landed there is not this key's value.
                    if let Some(b) = dest.contiguous() {
                        b[..*read_len].fill(0);
                    }
                }
            }
            if let Some(bounce) = bounce.take() {
                self.bounce.give_back(bounce);
            }
            outcomes.push(Some(outcome));
        }
        outcomes
    }

    /// Reads `read` again into a private bounce buffer (memory no caller
    /// can write) and returns it if it verifies there.
    fn reread_privately(&self, read: &ValueRead) -> Option<AlignedBuf> {
        let padded = page_round_up(read.len as u64) as usize;
        let mut private = self.bounce.take(padded);
        let outcome = {
            let mut dest: &mut [u8] = &mut private.as_mut_slice()[..padded];
            let reads = [Some(read.clone())];
            // Private memory, read after any stale cached copy was
            // dropped: this verdict is final (no second look).
            self.read_checked_once(&reads, std::slice::from_mut(&mut dest), false, false)
        };
        if matches!(outcome.first(), Some(Some(ReadOutcome::Verified))) {
            Some(private)
        } else {
            self.bounce.give_back(private);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `value` copied into `dest` in pieces of `piece` bytes, each at its
    /// offset, plain or streamed, first to last or last to first.
    fn fill_pieces<D: Destination>(
        dest: &mut D,
        value: &[u8],
        piece: usize,
        streamed: bool,
        backwards: bool,
    ) {
        let mut pieces: Vec<(usize, &[u8])> = value.chunks(piece).enumerate().collect();
        if backwards {
            pieces.reverse();
        }
        for (i, chunk) in pieces {
            if streamed {
                dest.fill_at_streamed(i * piece, chunk);
            } else {
                dest.fill_at(i * piece, chunk);
            }
        }
    }

    /// Pieces copied in at any offset land byte for byte, into one slice
    /// or odd segments, plain or with non-temporal stores (pieces of 256
    /// KiB and up, split across segments anyhow), and nothing else is
    /// written.
    #[test]
    fn pieces_land_at_their_offsets_plain_or_streamed() {
        // Miri copies plainly whatever the size (it checks the pointers
        // only): small pieces keep it quick there.
        let unit = if cfg!(miri) {
            4096
        } else {
            crate::bulk_copy::STREAM_FROM
        };
        let len = 3 * unit + 4321;
        let value: Vec<u8> = (0..len)
            .map(|i| (i % 251) as u8 ^ (i >> 12) as u8)
            .collect();
        let piece = unit + 100;
        for streamed in [false, true] {
            let mut whole = vec![0xeeu8; len + 10];
            {
                let mut one: &mut [u8] = &mut whole[..len];
                fill_pieces(&mut one, &value, piece, streamed, false);
            }
            assert_eq!(&whole[..len], &value[..], "one slice, streamed {streamed}");
            assert!(whole[len..].iter().all(|&x| x == 0xee));
            whole.fill(0xee);
            {
                let (a, rest) = whole.split_at_mut(1000);
                let (b, rest) = rest.split_at_mut(unit + 7);
                let (c, _) = rest.split_at_mut(len - 1000 - unit - 7);
                let mut segments: [&mut [u8]; 3] = [a, b, c];
                // Backwards, so no piece relies on the one before.
                fill_pieces(&mut &mut segments[..], &value, piece, streamed, true);
            }
            assert_eq!(&whole[..len], &value[..], "segments, streamed {streamed}");
            assert!(whole[len..].iter().all(|&x| x == 0xee));
        }
    }

    fn check_of(value: &[u8], piece: usize, digest: KeyDigest) -> PieceCheck {
        let pieces = value.len().div_ceil(piece).max(1);
        PieceCheck::new(
            digest,
            pieces,
            value.len(),
            crate::key::value_checksum(digest, value),
        )
    }

    /// Pieces completing in any order hash to the value's checksum; the
    /// check is pure (no io), so Miri runs it too.
    #[test]
    fn pieces_in_any_order_verify() {
        let digest = KeyDigest(0x0123_4567_89ab_cdef_fedc_ba98_7654_3210);
        let value: Vec<u8> = (0..10_000u32).map(|i| (i * 31 % 251) as u8).collect();
        let piece = 1024;
        let chunks: Vec<&[u8]> = value.chunks(piece).collect();
        for order in [
            (0..chunks.len()).collect::<Vec<_>>(),
            (0..chunks.len()).rev().collect(),
            vec![3, 1, 0, 2, 9, 4, 5, 8, 6, 7],
        ] {
            let mut check = check_of(&value, piece, digest);
            for &k in &order {
                assert!(!check.verified);
                check.complete(k, chunks[k]);
            }
            assert!(check.verified, "order {order:?}");
        }
        let mut flipped = value.clone();
        flipped[5000] ^= 1;
        let mut check = check_of(&value, piece, digest);
        for (k, chunk) in flipped.chunks(piece).enumerate().rev() {
            check.complete(k, chunk);
        }
        assert!(!check.verified);
    }
}
