//! What a case measures (`Measurement`: latency histogram, spans) and how
//! its batches are cut into rounds and shared among caller threads.

use hdrhistogram::Histogram;
use std::time::Duration;

/// A bench run's result: any failure ends it with a message.
pub type BenchResult<T> = Result<T, Box<dyn std::error::Error>>;

/// Timing of one case: per-call latency and throughput over timed spans.
#[derive(Debug)]
pub struct Measurement {
    pub latency_us: Histogram<u64>,
    pub seconds: f64,
    pub bytes: u64,
    pub calls: u64,
    /// MB/s of each timed span (one per round), for paired comparisons.
    pub span_mb_per_s: Vec<f64>,
}

impl Measurement {
    pub(crate) fn new() -> Self {
        Measurement {
            latency_us: Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid bounds"),
            seconds: 0.0,
            bytes: 0,
            calls: 0,
            span_mb_per_s: Vec::new(),
        }
    }

    pub(crate) fn record_call(&mut self, elapsed: Duration) {
        self.latency_us
            .saturating_record((elapsed.as_micros() as u64).max(1));
        self.calls += 1;
    }

    /// Adds a timed span that moved `bytes`.
    pub(crate) fn add_span(&mut self, elapsed: Duration, bytes: u64) {
        self.seconds += elapsed.as_secs_f64();
        self.bytes += bytes;
        if elapsed > Duration::ZERO {
            self.span_mb_per_s
                .push(bytes as f64 / elapsed.as_secs_f64() / 1e6);
        }
    }

    /// The median over rounds of this side's rate divided by the other's
    /// in the same round, when both ran the same rounds: less swayed than
    /// the ratio of totals by a burst that lands in one round.
    pub fn paired_median_ratio(&self, baseline: &Measurement) -> Option<f64> {
        if self.span_mb_per_s.len() != baseline.span_mb_per_s.len() || self.span_mb_per_s.is_empty()
        {
            return None;
        }
        let mut ratios: Vec<f64> = self
            .span_mb_per_s
            .iter()
            .zip(&baseline.span_mb_per_s)
            .map(|(s, b)| if *b > 0.0 { s / b } else { 0.0 })
            .collect();
        ratios.sort_by(f64::total_cmp);
        let n = ratios.len();
        Some(if n % 2 == 1 {
            ratios[n / 2]
        } else {
            (ratios[n / 2 - 1] + ratios[n / 2]) / 2.0
        })
    }

    pub(crate) fn merge_calls(&mut self, other: &Measurement) {
        self.latency_us.add(&other.latency_us).expect("same bounds");
        self.calls += other.calls;
    }

    pub fn mb_per_s(&self) -> f64 {
        if self.seconds > 0.0 {
            self.bytes as f64 / self.seconds / 1e6
        } else {
            0.0
        }
    }
}

/// Splits `0..batches` into up to `most` rounds.
pub(crate) fn rounds(batches: u64, most: u64) -> Vec<std::ops::Range<u64>> {
    let n = batches.min(most);
    (0..n)
        .map(|r| (batches * r / n)..(batches * (r + 1) / n))
        .collect()
}

/// Runs a round on one caller thread per entry of `states` at once, each
/// over its share of the round's batches with its own state. `call` does
/// one batch and returns the time of its timed part and a tally (bytes
/// verified, say). The calls merge into `m`; the round counts the busiest
/// thread's time for `bytes`. Returns the tallies' sum.
pub(crate) fn on_callers<S: Send>(
    round: std::ops::Range<u64>,
    states: &mut [S],
    m: &mut Measurement,
    bytes: u64,
    call: impl Fn(u64, &mut S) -> Result<(Duration, u64), String> + Sync,
) -> Result<u64, String> {
    let call = &call;
    let parts: Vec<Result<(Measurement, Duration, u64), String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = shares(round, states.len())
            .into_iter()
            .zip(states.iter_mut())
            .map(|(share, state)| {
                scope.spawn(move || {
                    let mut calls = Measurement::new();
                    let (mut busy, mut tally) = (Duration::ZERO, 0u64);
                    for b in share {
                        let (elapsed, t) = call(b, state)?;
                        busy += elapsed;
                        tally += t;
                        calls.record_call(elapsed);
                    }
                    Ok((calls, busy, tally))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("caller thread"))
            .collect()
    });
    let (mut busiest, mut tally) = (Duration::ZERO, 0);
    for part in parts {
        let (calls, busy, t) = part?;
        m.merge_calls(&calls);
        busiest = busiest.max(busy);
        tally += t;
    }
    m.add_span(busiest, bytes);
    Ok(tally)
}

/// Splits a round's batches among `threads`.
pub(crate) fn shares(range: std::ops::Range<u64>, threads: usize) -> Vec<std::ops::Range<u64>> {
    let len = range.end - range.start;
    let threads = threads as u64;
    (0..threads)
        .map(|t| (range.start + len * t / threads)..(range.start + len * (t + 1) / threads))
        .filter(|r| !r.is_empty())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rounds and shares cover every batch once, in order, and are as even
    /// as the counts allow.
    #[test]
    fn rounds_and_shares_cover_every_batch_once() {
        for (batches, most) in [(1, 8), (7, 3), (64, 64), (100, 7), (5, 1)] {
            let r = rounds(batches, most);
            assert_eq!(r.len() as u64, batches.min(most));
            assert_eq!(r.first().unwrap().start, 0);
            assert_eq!(r.last().unwrap().end, batches);
            assert!(r.windows(2).all(|w| w[0].end == w[1].start));
            let sizes: Vec<u64> = r.iter().map(|x| x.end - x.start).collect();
            assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1);
            for threads in [1, 2, 5] {
                for round in &r {
                    let s = shares(round.clone(), threads);
                    let covered: u64 = s.iter().map(|x| x.end - x.start).sum();
                    assert_eq!(covered, round.end - round.start);
                    assert!(s.iter().all(|x| !x.is_empty()));
                }
            }
        }
    }
}
