//! The memory cases' baselines: memcpy bandwidth shaped as a get and as a
//! put, measured in the same run.
//! (The disk cases' baselines, raw O_DIRECT io_uring transfers, live in
//! `device`.)

use crate::measure::{on_callers, Measurement};
use kvtier::AlignedBuf;
use std::time::Instant;

/// memcpy of `batch` values of `value_size` bytes per call into distinct
/// (pre-touched) destinations, from sources cycling over a working set as
/// large as the store case's, so neither side runs from cache alone. With
/// `threads` > 1, as many threads copy their shares of a round at once
/// (each with its own destinations), as the store case's callers do, and
/// the round counts the busiest thread's time, as theirs does.
///
/// A batch of 16 MiB or more is copied with non-temporal stores
/// (`kvtier::bulk_copy`, the rule leased copies follow), which beat a plain
/// copy there: the baseline is the faster way the hardware moves such a
/// batch, not the one a plain `memcpy` happens to take.
pub struct Memcpy {
    sources: Vec<Vec<u8>>,
    /// `batch` destinations per thread.
    dests: Vec<Vec<AlignedBuf>>,
    value_size: usize,
    /// Copies with non-temporal stores (`bulk_copy::worth_streaming`).
    streamed: bool,
}

impl Memcpy {
    pub fn new(
        value_size: usize,
        batch: usize,
        working_set_values: usize,
        threads: usize,
    ) -> Memcpy {
        Memcpy {
            sources: (0..working_set_values.max(batch))
                .map(|i| {
                    let mut v = vec![0u8; value_size];
                    crate::data::fill(format!("memcpy/{i}").as_bytes(), &mut v);
                    v
                })
                .collect(),
            dests: (0..threads.max(1))
                .map(|_| {
                    (0..batch)
                        .map(|_| crate::data::touched_buffer(value_size))
                        .collect()
                })
                .collect(),
            value_size,
            streamed: kvtier::bulk_copy::worth_streaming(value_size * batch),
        }
    }

    pub fn run(&mut self, range: std::ops::Range<u64>, m: &mut Measurement) {
        let sources = &self.sources;
        let (value_size, streamed) = (self.value_size, self.streamed);
        let bytes = (range.end - range.start) * (self.dests[0].len() * value_size) as u64;
        // Each call copies the values the store case's call for the same
        // batch number reads.
        let copied = on_callers(range, &mut self.dests, m, bytes, |b, dests| {
            let call = Instant::now();
            let mut next = (b as usize * dests.len()) % sources.len();
            for dst in dests.iter_mut() {
                let dst = &mut dst.as_mut_slice()[..value_size];
                if streamed {
                    kvtier::bulk_copy::copy_for_elsewhere(dst, &sources[next]);
                } else {
                    dst.copy_from_slice(&sources[next]);
                }
                next = (next + 1) % sources.len();
            }
            std::hint::black_box(&mut *dests);
            Ok((call.elapsed(), 0))
        });
        copied.expect("memcpy cannot fail");
    }

    /// The put cases' baseline, shaped as a put: each call first writes
    /// its thread's batch buffers (untimed, as the put case's caller
    /// writes its values just before each put), then copies them into
    /// distinct values of the working set (cold, as a put's fresh pool
    /// extents are), with the better copy for memory nothing reads soon:
    /// non-temporal stores from 256 KiB (`bulk_copy::copy_for_elsewhere`).
    /// Each thread writes its own part of the working set.
    pub fn run_put(&mut self, range: std::ops::Range<u64>, m: &mut Measurement) {
        let value_size = self.value_size;
        let threads = self.dests.len();
        let bytes = (range.end - range.start) * (self.dests[0].len() * value_size) as u64;
        let per_thread = (self.sources.len() / threads).max(1);
        let mut states: Vec<(&mut Vec<AlignedBuf>, &mut [Vec<u8>])> = self
            .dests
            .iter_mut()
            .zip(self.sources.chunks_mut(per_thread))
            .collect();
        let copied = on_callers(range, &mut states, m, bytes, |b, (bufs, set)| {
            for (i, buf) in bufs.iter_mut().enumerate() {
                crate::data::fill(
                    format!("memcpy-put/{b}/{i}").as_bytes(),
                    &mut buf.as_mut_slice()[..value_size],
                );
            }
            let call = Instant::now();
            let mut next = (b as usize * bufs.len()) % set.len();
            for buf in bufs.iter() {
                kvtier::bulk_copy::copy_for_elsewhere(
                    &mut set[next][..value_size],
                    &buf.as_slice()[..value_size],
                );
                next = (next + 1) % set.len();
            }
            std::hint::black_box(&mut **set);
            Ok((call.elapsed(), 0))
        });
        copied.expect("memcpy cannot fail");
    }
}
