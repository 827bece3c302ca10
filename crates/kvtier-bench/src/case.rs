//! One case's shape (`Case`): value size, batch count and how many batches
//! it moves; what the cases (`cases`) and the sides they time (`sides`)
//! both read.

use crate::args::BenchArgs;
use crate::data;
use crate::measure::rounds;

/// One case's shape: value size, batch count and how many batches it
/// moves.
pub struct Case<'a> {
    pub args: &'a BenchArgs,
    pub value_size: u64,
    pub batch: usize,
    pub batches: u64,
}

impl Case<'_> {
    /// The keys of batch `b`, wrapping around a working set of `modulo`.
    pub fn keys(&self, tier: &str, b: u64, modulo: u64) -> Vec<Vec<u8>> {
        (0..self.batch as u64)
            .map(|i| {
                data::key(
                    tier,
                    self.value_size,
                    self.batch,
                    (b * self.batch as u64 + i) % modulo,
                )
            })
            .collect()
    }

    /// The bytes the batches of `range` move.
    pub fn bytes(&self, range: &std::ops::Range<u64>) -> u64 {
        (range.end - range.start) * self.batch as u64 * self.value_size
    }

    /// The case's rounds: up to `most`, but at least `--threads` batches
    /// each, so that every caller thread has work in every round (a round
    /// of one batch would leave the other threads idle and measure one).
    pub fn rounds(&self, most: u64) -> Vec<std::ops::Range<u64>> {
        let threads = self.args.threads.max(1) as u64;
        rounds(self.batches, most.min(self.batches / threads).max(1))
    }
}

/// How many batches of `batch` values of `value_size` make `bytes` (at
/// least one).
pub(crate) fn batches_for(bytes: u64, value_size: u64, batch: usize) -> u64 {
    (bytes / (value_size * batch as u64)).max(1)
}
