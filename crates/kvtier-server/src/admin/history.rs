//! The last 15 minutes of the server, one point every `INTERVAL`: what the
//! status page draws its charts from, so a page opened late still shows
//! the recent past.

use crate::metrics::{hit_rates, sum_ops, unix_seconds, Metrics, OpCounts, OPS};
use kvtier::Stats;
use kvtier_wire::protocol::Op;
use serde::Serialize;
use std::collections::VecDeque;
use std::time::{Duration, SystemTime};

/// Time between two points.
pub const INTERVAL: Duration = Duration::from_secs(2);
/// Points kept: 15 minutes.
pub const POINTS: usize = 450;

/// What happened during one interval (rates per second, latency
/// quantiles of the requests that finished in it, hits and misses).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Point {
    /// End of the interval, seconds since the Unix epoch.
    pub t: f64,
    pub seconds: f64,
    pub get_requests_per_s: f64,
    pub put_requests_per_s: f64,
    pub get_bytes_per_s: f64,
    pub put_bytes_per_s: f64,
    pub get_p50_seconds: Option<f64>,
    pub get_p99_seconds: Option<f64>,
    pub put_p50_seconds: Option<f64>,
    pub put_p99_seconds: Option<f64>,
    pub memory_hits: u64,
    pub disk_hits: u64,
    pub misses: u64,
    pub errors: u64,
    pub memory_bytes: u64,
    pub disk_used_bytes: u64,
}

#[derive(Debug)]
struct Reading {
    at: SystemTime,
    ops: [OpCounts; OPS],
    memory_hits: u64,
    disk_hits: u64,
    misses: u64,
}

#[derive(Debug, Default)]
pub struct History {
    last: Option<Reading>,
    points: VecDeque<Point>,
}

impl History {
    /// Reads the counters now and appends what changed since the last
    /// reading (the first reading only sets the start).
    pub fn sample(&mut self, metrics: &Metrics, stats: &Stats) {
        let now = Reading {
            at: SystemTime::now(),
            ops: metrics.op_counts(),
            memory_hits: stats.memory_hits,
            disk_hits: stats.disk_hits,
            misses: stats.misses,
        };
        if let Some(last) = self.last.take() {
            let seconds = now
                .at
                .duration_since(last.at)
                .unwrap_or_default()
                .as_secs_f64();
            if seconds > 0.0 {
                self.push(point(&last, &now, seconds, stats));
            }
        }
        self.last = Some(now);
    }

    fn push(&mut self, point: Point) {
        if self.points.len() == POINTS {
            self.points.pop_front();
        }
        self.points.push_back(point);
    }

    /// Hit rates over the points of the last `window`.
    pub fn hit_rates_over(&self, window: Duration) -> serde_json::Value {
        let newest = self.points.back().map_or(0.0, |p| p.t);
        let (mut memory, mut disk, mut misses) = (0, 0, 0);
        for p in self
            .points
            .iter()
            .rev()
            .take_while(|p| newest - p.t < window.as_secs_f64())
        {
            memory += p.memory_hits;
            disk += p.disk_hits;
            misses += p.misses;
        }
        let mut rates = hit_rates(memory, disk, misses);
        rates["window_seconds"] = window.as_secs_f64().into();
        rates
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "interval_seconds": INTERVAL.as_secs_f64(),
            "points": self.points,
        })
    }
}

fn point(last: &Reading, now: &Reading, seconds: f64, stats: &Stats) -> Point {
    let delta: [OpCounts; OPS] = std::array::from_fn(|i| now.ops[i].since(&last.ops[i]));
    let gets = sum_ops(&delta, Op::reads_values);
    let puts = sum_ops(&delta, Op::writes_values);
    Point {
        t: unix_seconds(now.at),
        seconds,
        get_requests_per_s: gets.requests as f64 / seconds,
        put_requests_per_s: puts.requests as f64 / seconds,
        get_bytes_per_s: gets.bytes_out as f64 / seconds,
        put_bytes_per_s: puts.bytes_in as f64 / seconds,
        get_p50_seconds: gets.quantile_seconds(0.5),
        get_p99_seconds: gets.quantile_seconds(0.99),
        put_p50_seconds: puts.quantile_seconds(0.5),
        put_p99_seconds: puts.quantile_seconds(0.99),
        memory_hits: now.memory_hits.saturating_sub(last.memory_hits),
        disk_hits: now.disk_hits.saturating_sub(last.disk_hits),
        misses: now.misses.saturating_sub(last.misses),
        errors: delta.iter().map(|d| d.errors).sum(),
        memory_bytes: stats.memory_bytes,
        disk_used_bytes: stats.disk_used_bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn stats(memory_hits: u64, disk_hits: u64, misses: u64) -> Stats {
        Stats {
            memory_hits,
            disk_hits,
            misses,
            ..Stats::default()
        }
    }

    #[test]
    fn points_hold_what_changed_and_the_window_sums_them() {
        let metrics = Metrics::default();
        let mut history = History::default();
        history.sample(&metrics, &stats(0, 0, 0));
        assert_eq!(history.points.len(), 0, "the first reading is the start");
        let get = Op::BatchGet as u16;
        for _ in 0..4 {
            metrics.record(
                get,
                Duration::from_micros(700),
                crate::metrics::Sample {
                    keys: 2,
                    bytes_out: 1 << 20,
                    ..Default::default()
                },
            );
        }
        std::thread::sleep(Duration::from_millis(5));
        history.sample(&metrics, &stats(3, 1, 4));
        let p = history.points[0].clone();
        assert_eq!((p.memory_hits, p.disk_hits, p.misses), (3, 1, 4));
        assert!((p.get_bytes_per_s * p.seconds - (4 << 20) as f64).abs() < 1.0);
        // All four took 700 us: both quantiles fall in the (500, 1000] bucket.
        let p50 = p.get_p50_seconds.unwrap();
        assert!((0.0005..=0.001).contains(&p50), "{p50}");
        assert_eq!(p.put_p50_seconds, None);
        std::thread::sleep(Duration::from_millis(5));
        history.sample(&metrics, &stats(3, 1, 8));
        let rates = history.hit_rates_over(Duration::from_secs(60));
        assert_eq!(rates["lookups"], 12);
        assert_eq!(rates["overall"].as_f64().unwrap(), 4.0 / 12.0);
        assert_eq!(rates["memory"].as_f64().unwrap(), 3.0 / 12.0);
    }

    #[test]
    fn history_keeps_fifteen_minutes() {
        let metrics = Metrics::default();
        let mut history = History::default();
        for _ in 0..POINTS + 10 {
            history.last = Some(Reading {
                at: SystemTime::now() - Duration::from_secs(2),
                ops: metrics.op_counts(),
                memory_hits: 0,
                disk_hits: 0,
                misses: 0,
            });
            history.sample(&metrics, &stats(0, 0, 0));
        }
        assert_eq!(history.points.len(), POINTS);
        assert_eq!(POINTS as u64 * INTERVAL.as_secs(), 15 * 60);
    }
}
