//! Server metrics, rendered as Prometheus text and JSON.

use kvtier::Stats;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Latency bucket upper bounds in microseconds.
const BUCKETS_US: [u64; 12] = [
    50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 100_000, 1_000_000, 10_000_000,
];

pub const OPS: [&str; 13] = [
    "hello",
    "batch_put",
    "batch_get",
    "batch_exists",
    "prefix_len",
    "remove",
    "flush",
    "stats",
    "register_buffer",
    "batch_put_shm",
    "batch_get_shm",
    "batch_put_shm_segments",
    "batch_get_shm_segments",
];

#[derive(Debug, Default)]
struct OpMetrics {
    requests: AtomicU64,
    errors: AtomicU64,
    keys: AtomicU64,
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
    buckets: [AtomicU64; BUCKETS_US.len() + 1],
    sum_us: AtomicU64,
}

#[derive(Debug, Default)]
pub struct Metrics {
    ops: [OpMetrics; OPS.len()],
    pub connections_open: AtomicU64,
    pub connections_total: AtomicU64,
    pub protocol_errors: AtomicU64,
    pub auth_failures: AtomicU64,
    /// Connections refused at the connection cap.
    pub connections_refused: AtomicU64,
    /// Connections dropped by a deadline: handshake, idle or a slow frame.
    pub connections_timed_out: AtomicU64,
    /// Shared buffers refused (not a sealed memfd, over a cap, ...).
    pub buffers_refused: AtomicU64,
    pub registered_buffers: AtomicU64,
    pub registered_bytes: AtomicU64,
}

/// What one request did, for the metrics.
#[derive(Debug, Default, Clone, Copy)]
pub struct Sample {
    pub keys: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub error: bool,
}

impl Metrics {
    pub fn record(&self, op: u16, elapsed: Duration, sample: Sample) {
        let Some(m) = (op as usize).checked_sub(1).and_then(|i| self.ops.get(i)) else {
            return;
        };
        m.requests.fetch_add(1, Ordering::Relaxed);
        if sample.error {
            m.errors.fetch_add(1, Ordering::Relaxed);
        }
        m.keys.fetch_add(sample.keys, Ordering::Relaxed);
        m.bytes_in.fetch_add(sample.bytes_in, Ordering::Relaxed);
        m.bytes_out.fetch_add(sample.bytes_out, Ordering::Relaxed);
        let us = elapsed.as_micros() as u64;
        let bucket = BUCKETS_US
            .iter()
            .position(|&b| us <= b)
            .unwrap_or(BUCKETS_US.len());
        m.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        m.sum_us.fetch_add(us, Ordering::Relaxed);
    }

    /// Prometheus text exposition format (version 0.0.4).
    pub fn prometheus(&self, stats: &Stats) -> String {
        let mut out = String::new();
        let counter = |out: &mut String, name: &str, help: &str, value: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}"
            );
        };
        let gauge = |out: &mut String, name: &str, help: &str, value: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
            );
        };
        for (name, help, field) in [
            ("kvtier_requests_total", "Requests by operation.", 0),
            (
                "kvtier_request_errors_total",
                "Requests that failed, by operation.",
                1,
            ),
            (
                "kvtier_request_keys_total",
                "Keys named by requests, by operation.",
                2,
            ),
            (
                "kvtier_request_bytes_in_total",
                "Value bytes received, by operation.",
                3,
            ),
            (
                "kvtier_request_bytes_out_total",
                "Value bytes sent, by operation.",
                4,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            for (op, m) in OPS.iter().zip(&self.ops) {
                let value = match field {
                    0 => &m.requests,
                    1 => &m.errors,
                    2 => &m.keys,
                    3 => &m.bytes_in,
                    _ => &m.bytes_out,
                };
                let _ = writeln!(
                    out,
                    "{name}{{op=\"{op}\"}} {}",
                    value.load(Ordering::Relaxed)
                );
            }
        }
        let name = "kvtier_request_duration_seconds";
        let _ = writeln!(
            out,
            "# HELP {name} Request latency, by operation.\n# TYPE {name} histogram"
        );
        for (op, m) in OPS.iter().zip(&self.ops) {
            let mut cumulative = 0;
            for (i, bound) in BUCKETS_US.iter().enumerate() {
                cumulative += m.buckets[i].load(Ordering::Relaxed);
                let _ = writeln!(
                    out,
                    "{name}_bucket{{op=\"{op}\",le=\"{}\"}} {cumulative}",
                    *bound as f64 / 1e6
                );
            }
            cumulative += m.buckets[BUCKETS_US.len()].load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{op=\"{op}\",le=\"+Inf\"}} {cumulative}");
            let _ = writeln!(
                out,
                "{name}_sum{{op=\"{op}\"}} {}",
                m.sum_us.load(Ordering::Relaxed) as f64 / 1e6
            );
            let _ = writeln!(out, "{name}_count{{op=\"{op}\"}} {cumulative}");
        }
        gauge(
            &mut out,
            "kvtier_connections",
            "Open client connections.",
            self.connections_open.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "kvtier_connections_total",
            "Client connections accepted.",
            self.connections_total.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "kvtier_protocol_errors_total",
            "Connections closed for a malformed frame.",
            self.protocol_errors.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "kvtier_auth_failures_total",
            "Hellos refused for a wrong token.",
            self.auth_failures.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "kvtier_connections_refused_total",
            "Connections refused at the connection cap.",
            self.connections_refused.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "kvtier_connections_timed_out_total",
            "Connections dropped by the handshake, idle or frame deadline.",
            self.connections_timed_out.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "kvtier_buffers_refused_total",
            "Shared buffers refused (not a sealed memfd, or over a cap).",
            self.buffers_refused.load(Ordering::Relaxed),
        );
        gauge(
            &mut out,
            "kvtier_registered_buffers",
            "Shared-memory buffers registered by clients.",
            self.registered_buffers.load(Ordering::Relaxed),
        );
        gauge(
            &mut out,
            "kvtier_registered_buffer_bytes",
            "Bytes of registered shared-memory buffers.",
            self.registered_bytes.load(Ordering::Relaxed),
        );
        gauge(
            &mut out,
            "kvtier_entries",
            "Keys in the index.",
            stats.entries,
        );
        let _ = writeln!(
            out,
            "# HELP kvtier_tier_entries Values held, by tier.\n# TYPE kvtier_tier_entries gauge"
        );
        let _ = writeln!(
            out,
            "kvtier_tier_entries{{tier=\"memory\"}} {}\nkvtier_tier_entries{{tier=\"disk\"}} {}",
            stats.memory_entries, stats.disk_entries
        );
        let _ = writeln!(out, "# HELP kvtier_tier_used_bytes Bytes used, by tier.\n# TYPE kvtier_tier_used_bytes gauge");
        let _ = writeln!(out, "kvtier_tier_used_bytes{{tier=\"memory\"}} {}\nkvtier_tier_used_bytes{{tier=\"disk\"}} {}", stats.memory_bytes, stats.disk_used_bytes);
        let _ = writeln!(out, "# HELP kvtier_tier_capacity_bytes Capacity, by tier.\n# TYPE kvtier_tier_capacity_bytes gauge");
        let _ = writeln!(out, "kvtier_tier_capacity_bytes{{tier=\"memory\"}} {}\nkvtier_tier_capacity_bytes{{tier=\"disk\"}} {}", stats.memory_capacity, stats.disk_capacity);
        let _ = writeln!(
            out,
            "# HELP kvtier_hits_total Get hits, by tier.\n# TYPE kvtier_hits_total counter"
        );
        let _ = writeln!(
            out,
            "kvtier_hits_total{{tier=\"memory\"}} {}\nkvtier_hits_total{{tier=\"disk\"}} {}",
            stats.memory_hits, stats.disk_hits
        );
        counter(&mut out, "kvtier_misses_total", "Get misses.", stats.misses);
        counter(
            &mut out,
            "kvtier_evictions_total",
            "Values dropped from the memory pool.",
            stats.evictions,
        );
        counter(
            &mut out,
            "kvtier_reclaimed_regions_total",
            "Disk regions reclaimed.",
            stats.reclaimed_regions,
        );
        counter(
            &mut out,
            "kvtier_reclaimed_entries_total",
            "Entries dropped by disk reclaim.",
            stats.reclaimed_entries,
        );
        counter(
            &mut out,
            "kvtier_checksum_failures_total",
            "Disk reads that failed verification (served as misses).",
            stats.checksum_failures,
        );
        counter(
            &mut out,
            "kvtier_flush_errors_total",
            "Batch writes that failed.",
            stats.flush_errors,
        );
        gauge(
            &mut out,
            "kvtier_retrying_writes",
            "Writes whose last disk attempt failed, waiting to be retried: not durable yet.",
            stats.retrying_writes,
        );
        out
    }

    pub fn json(&self, stats: &Stats) -> serde_json::Value {
        let ops: serde_json::Map<String, serde_json::Value> = OPS
            .iter()
            .zip(&self.ops)
            .map(|(op, m)| {
                (
                    op.to_string(),
                    serde_json::json!({
                        "requests": m.requests.load(Ordering::Relaxed),
                        "errors": m.errors.load(Ordering::Relaxed),
                        "keys": m.keys.load(Ordering::Relaxed),
                        "bytes_in": m.bytes_in.load(Ordering::Relaxed),
                        "bytes_out": m.bytes_out.load(Ordering::Relaxed),
                    }),
                )
            })
            .collect();
        serde_json::json!({
            "store": stats_json(stats),
            "server": {
                "connections": self.connections_open.load(Ordering::Relaxed),
                "connections_total": self.connections_total.load(Ordering::Relaxed),
                "protocol_errors": self.protocol_errors.load(Ordering::Relaxed),
                "auth_failures": self.auth_failures.load(Ordering::Relaxed),
                "connections_refused": self.connections_refused.load(Ordering::Relaxed),
                "connections_timed_out": self.connections_timed_out.load(Ordering::Relaxed),
                "buffers_refused": self.buffers_refused.load(Ordering::Relaxed),
                "registered_buffers": self.registered_buffers.load(Ordering::Relaxed),
                "registered_bytes": self.registered_bytes.load(Ordering::Relaxed),
                "ops": ops,
            }
        })
    }
}

pub fn stats_json(s: &Stats) -> serde_json::Value {
    serde_json::json!({
        "entries": s.entries,
        "memory_entries": s.memory_entries,
        "memory_bytes": s.memory_bytes,
        "memory_capacity": s.memory_capacity,
        "disk_entries": s.disk_entries,
        "disk_value_bytes": s.disk_value_bytes,
        "disk_used_bytes": s.disk_used_bytes,
        "disk_capacity": s.disk_capacity,
        "disk_regions": s.disk_regions,
        "memory_hits": s.memory_hits,
        "disk_hits": s.disk_hits,
        "misses": s.misses,
        "evictions": s.evictions,
        "reclaimed_regions": s.reclaimed_regions,
        "reclaimed_entries": s.reclaimed_entries,
        "carried_entries": s.carried_entries,
        "checksum_failures": s.checksum_failures,
        "puts": s.puts,
        "removes": s.removes,
        "flushed_batches": s.flushed_batches,
        "flush_errors": s.flush_errors,
        "retrying_writes": s.retrying_writes,
        "index_bytes": s.index_bytes,
        "policy_bytes": s.policy_bytes,
        "eviction_mode": s.eviction_mode,
        "io_engine": s.io_engine,
        "direct_io": s.direct_io,
        "io_fixed_buffers": s.io_fixed_buffers,
        "io_registered_files": s.io_registered_files,
    })
}
