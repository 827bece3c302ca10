//! Server metrics: lock-free counters on the request path, read at scrape
//! time into the Prometheus exposition (by `prometheus-client`, through a
//! collector over the counters and the store's `Stats`) and the admin JSON.

use kvtier::{Stats, Store};
use kvtier_client::routing::Peers;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeGaugeValue, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Latency bucket upper bounds in microseconds (the `le` buckets of
/// `kvtier_request_duration_seconds`, and what p50/p99 are read from).
pub const BUCKETS_US: [u64; 16] = [
    50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000,
    1_000_000, 2_500_000, 10_000_000,
];

/// The operations whose requests read values, and those that write them.
pub const GET_OPS: [&str; 3] = ["batch_get", "batch_get_shm", "batch_get_shm_segments"];
pub const PUT_OPS: [&str; 3] = ["batch_put", "batch_put_shm", "batch_put_shm_segments"];

pub const OPS: [&str; 14] = [
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
    "cluster_view",
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
    started: StartTime,
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

/// When the server's metrics began (its start), for uptime and rates.
#[derive(Debug, Clone, Copy)]
struct StartTime(SystemTime);

impl Default for StartTime {
    fn default() -> Self {
        StartTime(SystemTime::now())
    }
}

/// One operation's counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpCounts {
    pub requests: u64,
    pub errors: u64,
    pub keys: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub sum_us: u64,
    /// Requests per latency bucket (not cumulative); the last is past the
    /// highest bound.
    pub buckets: [u64; BUCKETS_US.len() + 1],
}

impl OpCounts {
    pub fn add(&mut self, other: &OpCounts) {
        self.requests += other.requests;
        self.errors += other.errors;
        self.keys += other.keys;
        self.bytes_in += other.bytes_in;
        self.bytes_out += other.bytes_out;
        self.sum_us += other.sum_us;
        for (mine, theirs) in self.buckets.iter_mut().zip(&other.buckets) {
            *mine += theirs;
        }
    }

    /// What happened between `earlier` and `self`.
    pub fn since(&self, earlier: &OpCounts) -> OpCounts {
        let mut delta = OpCounts {
            requests: self.requests.saturating_sub(earlier.requests),
            errors: self.errors.saturating_sub(earlier.errors),
            keys: self.keys.saturating_sub(earlier.keys),
            bytes_in: self.bytes_in.saturating_sub(earlier.bytes_in),
            bytes_out: self.bytes_out.saturating_sub(earlier.bytes_out),
            sum_us: self.sum_us.saturating_sub(earlier.sum_us),
            buckets: [0; BUCKETS_US.len() + 1],
        };
        for (i, slot) in delta.buckets.iter_mut().enumerate() {
            *slot = self.buckets[i].saturating_sub(earlier.buckets[i]);
        }
        delta
    }

    /// The `q` quantile of latency in seconds, interpolated within its
    /// bucket as Prometheus's `histogram_quantile` does (a value past the
    /// highest bound reads as that bound); `None` without requests.
    pub fn quantile_seconds(&self, q: f64) -> Option<f64> {
        let total: u64 = self.buckets.iter().sum();
        if total == 0 {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * total as f64;
        let mut below = 0u64;
        for (i, &count) in self.buckets.iter().enumerate() {
            if count > 0 && (below + count) as f64 >= rank {
                let Some(&upper) = BUCKETS_US.get(i) else {
                    break;
                };
                let lower = if i == 0 { 0 } else { BUCKETS_US[i - 1] };
                let within = ((rank - below as f64) / count as f64).clamp(0.0, 1.0);
                return Some((lower as f64 + (upper - lower) as f64 * within) / 1e6);
            }
            below += count;
        }
        Some(BUCKETS_US[BUCKETS_US.len() - 1] as f64 / 1e6)
    }
}

/// Seconds since the Unix epoch (0 for a clock before it).
pub fn unix_seconds(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The sum of the named operations' counts.
pub fn sum_ops(counts: &[OpCounts; OPS.len()], names: &[&str]) -> OpCounts {
    let mut sum = OpCounts::default();
    for (op, c) in OPS.iter().zip(counts) {
        if names.contains(op) {
            sum.add(c);
        }
    }
    sum
}

/// Hits over lookups (memory, disk, overall); `None` before any lookup.
pub fn hit_rates(memory_hits: u64, disk_hits: u64, misses: u64) -> serde_json::Value {
    let lookups = memory_hits + disk_hits + misses;
    let rate = |hits: u64| (lookups > 0).then(|| hits as f64 / lookups as f64);
    serde_json::json!({
        "lookups": lookups,
        "overall": rate(memory_hits + disk_hits),
        "memory": rate(memory_hits),
        "disk": rate(disk_hits),
    })
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

    /// Every operation's counters now, in `OPS` order.
    pub fn op_counts(&self) -> [OpCounts; OPS.len()] {
        std::array::from_fn(|i| {
            let m = &self.ops[i];
            OpCounts {
                requests: m.requests.load(Ordering::Relaxed),
                errors: m.errors.load(Ordering::Relaxed),
                keys: m.keys.load(Ordering::Relaxed),
                bytes_in: m.bytes_in.load(Ordering::Relaxed),
                bytes_out: m.bytes_out.load(Ordering::Relaxed),
                sum_us: m.sum_us.load(Ordering::Relaxed),
                buckets: std::array::from_fn(|b| m.buckets[b].load(Ordering::Relaxed)),
            }
        })
    }

    /// Seconds since the Unix epoch when the server started.
    pub fn started_unix_seconds(&self) -> f64 {
        unix_seconds(self.started.0)
    }

    pub fn json(&self, stats: &Stats) -> serde_json::Value {
        let counts = self.op_counts();
        let latency = |c: &OpCounts| {
            serde_json::json!({
                "requests": c.requests,
                "p50_seconds": c.quantile_seconds(0.5),
                "p99_seconds": c.quantile_seconds(0.99),
            })
        };
        let ops: serde_json::Map<String, serde_json::Value> = OPS
            .iter()
            .zip(&counts)
            .map(|(op, c)| {
                let mut entry = serde_json::json!({
                    "requests": c.requests,
                    "errors": c.errors,
                    "keys": c.keys,
                    "bytes_in": c.bytes_in,
                    "bytes_out": c.bytes_out,
                });
                entry["p50_seconds"] = c.quantile_seconds(0.5).into();
                entry["p99_seconds"] = c.quantile_seconds(0.99).into();
                (op.to_string(), entry)
            })
            .collect();
        let started = self.started_unix_seconds();
        let now = unix_seconds(SystemTime::now());
        serde_json::json!({
            "version": env!("CARGO_PKG_VERSION"),
            "started_unix_seconds": started,
            "uptime_seconds": (now - started).max(0.0),
            "store": kvtier_wire::stats::stats_json(stats),
            "hit_rate": hit_rates(stats.memory_hits, stats.disk_hits, stats.misses),
            "latency": {
                "get": latency(&sum_ops(&counts, &GET_OPS)),
                "put": latency(&sum_ops(&counts, &PUT_OPS)),
            },
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

/// The Prometheus view of one server: read from the counters and the
/// store's `Stats` at each scrape, so nothing is kept twice.
#[derive(Debug)]
struct ServerCollector {
    metrics: Arc<Metrics>,
    store: Arc<Store>,
    peers: Option<Arc<Peers>>,
}

/// A registry holding one server's metrics.
pub fn registry(metrics: Arc<Metrics>, store: Arc<Store>, peers: Option<Arc<Peers>>) -> Registry {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(ServerCollector {
        metrics,
        store,
        peers,
    }));
    registry
}

/// Content type of the OpenMetrics text exposition.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Renders `registry` as OpenMetrics text (what Prometheus asks for first)
/// or as the Prometheus text format 0.0.4 (what `promtool`, older
/// scrapers and people with curl read); returns the body and its type.
pub fn render(registry: &Registry, openmetrics: bool) -> (String, &'static str) {
    let mut body = String::with_capacity(16 << 10);
    let rendered = if openmetrics {
        prometheus_client::encoding::text::encode(&mut body, registry)
    } else {
        prometheus_client::encoding::prometheus_text::encode(&mut body, registry)
    };
    // Writing into a String cannot fail; a collector error would be ours.
    rendered.expect("metrics render into a String");
    let content_type = if openmetrics {
        OPENMETRICS_CONTENT_TYPE
    } else {
        prometheus_client::encoding::prometheus_text::CONTENT_TYPE
    };
    (body, content_type)
}

type Written = Result<(), std::fmt::Error>;

fn counter(
    e: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    v: u64,
) -> Written {
    ConstCounter::new(v).encode(e.encode_descriptor(name, help, unit, MetricType::Counter)?)
}

fn gauge(
    e: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    v: impl EncodeGaugeValue,
) -> Written {
    ConstGauge::new(v).encode(e.encode_descriptor(name, help, unit, MetricType::Gauge)?)
}

/// One family with one label: a counter or gauge per `(label value, v)`.
fn family<'v, V: Copy>(
    e: &mut DescriptorEncoder,
    (name, help, unit, kind): (&str, &str, Option<&Unit>, MetricType),
    label: &str,
    values: impl IntoIterator<Item = (&'v str, V)>,
) -> Written
where
    ConstCounter<V>: EncodeMetric,
    ConstGauge<V>: EncodeMetric,
{
    let mut metric = e.encode_descriptor(name, help, unit, kind)?;
    for (value_name, v) in values {
        let labels = [(label, value_name)];
        let member = metric.encode_family(&labels)?;
        match kind {
            MetricType::Counter => ConstCounter::new(v).encode(member)?,
            _ => ConstGauge::new(v).encode(member)?,
        }
    }
    Ok(())
}

impl Collector for ServerCollector {
    fn encode(&self, mut e: DescriptorEncoder) -> Written {
        let bytes = Unit::Bytes;
        let seconds = Unit::Seconds;
        let s = self.store.stats();
        let m = &self.metrics;
        let counts = m.op_counts();
        let per_op = |f: fn(&OpCounts) -> u64| {
            OPS.iter()
                .zip(&counts)
                .map(move |(op, c)| (*op, f(c)))
                .collect::<Vec<_>>()
        };
        use MetricType::{Counter, Gauge};
        family(
            &mut e,
            ("kvtier_requests", "Requests, by operation.", None, Counter),
            "op",
            per_op(|c| c.requests),
        )?;
        family(
            &mut e,
            (
                "kvtier_request_errors",
                "Requests that failed, by operation.",
                None,
                Counter,
            ),
            "op",
            per_op(|c| c.errors),
        )?;
        family(
            &mut e,
            (
                "kvtier_request_keys",
                "Keys named by requests, by operation.",
                None,
                Counter,
            ),
            "op",
            per_op(|c| c.keys),
        )?;
        family(
            &mut e,
            (
                "kvtier_request_received",
                "Value bytes received, by operation.",
                Some(&bytes),
                Counter,
            ),
            "op",
            per_op(|c| c.bytes_in),
        )?;
        family(
            &mut e,
            (
                "kvtier_request_sent",
                "Value bytes sent, by operation.",
                Some(&bytes),
                Counter,
            ),
            "op",
            per_op(|c| c.bytes_out),
        )?;
        let mut histogram = e.encode_descriptor(
            "kvtier_request_duration",
            "Request latency from a whole frame read to its answer written, by operation.",
            Some(&seconds),
            MetricType::Histogram,
        )?;
        for (op, c) in OPS.iter().zip(&counts) {
            let labels = [("op", *op)];
            // The +Inf bucket is given: the OpenMetrics encoder adds none
            // by itself, and histogram_quantile() needs it.
            let buckets: Vec<(f64, u64)> = BUCKETS_US
                .iter()
                .map(|&bound| bound as f64 / 1e6)
                .chain([f64::INFINITY])
                .zip(c.buckets)
                .collect();
            histogram
                .encode_family(&labels)?
                .encode_histogram::<prometheus_client::encoding::NoLabelSet>(
                    c.sum_us as f64 / 1e6,
                    c.requests,
                    &buckets,
                    None,
                )?;
        }
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        gauge(
            &mut e,
            "kvtier_connections_open",
            "Client connections open now.",
            None,
            load(&m.connections_open),
        )?;
        counter(
            &mut e,
            "kvtier_connections_accepted",
            "Client connections accepted.",
            None,
            load(&m.connections_total),
        )?;
        counter(
            &mut e,
            "kvtier_connections_refused",
            "Connections refused at the connection cap.",
            None,
            load(&m.connections_refused),
        )?;
        counter(
            &mut e,
            "kvtier_connections_timed_out",
            "Connections dropped by the handshake, idle or frame deadline.",
            None,
            load(&m.connections_timed_out),
        )?;
        counter(
            &mut e,
            "kvtier_protocol_errors",
            "Connections closed for a malformed frame.",
            None,
            load(&m.protocol_errors),
        )?;
        counter(
            &mut e,
            "kvtier_auth_failures",
            "Hellos and admin requests refused for a wrong or missing token.",
            None,
            load(&m.auth_failures),
        )?;
        counter(
            &mut e,
            "kvtier_buffers_refused",
            "Shared buffers refused (not a sealed memfd, or over a cap).",
            None,
            load(&m.buffers_refused),
        )?;
        gauge(
            &mut e,
            "kvtier_registered_buffers",
            "Shared-memory buffers registered by clients.",
            None,
            load(&m.registered_buffers),
        )?;
        gauge(
            &mut e,
            "kvtier_registered_buffer",
            "Bytes of shared-memory buffers registered by clients.",
            Some(&bytes),
            load(&m.registered_bytes),
        )?;
        gauge(
            &mut e,
            "kvtier_entries",
            "Keys in the index (any tier).",
            None,
            s.entries,
        )?;
        family(
            &mut e,
            ("kvtier_tier_entries", "Values held, by tier.", None, Gauge),
            "tier",
            [("memory", s.memory_entries), ("disk", s.disk_entries)],
        )?;
        family(
            &mut e,
            (
                "kvtier_tier_used",
                "Bytes used, by tier (disk: region files, dead space included).",
                Some(&bytes),
                Gauge,
            ),
            "tier",
            [("memory", s.memory_bytes), ("disk", s.disk_used_bytes)],
        )?;
        family(
            &mut e,
            (
                "kvtier_tier_capacity",
                "Capacity, by tier.",
                Some(&bytes),
                Gauge,
            ),
            "tier",
            [("memory", s.memory_capacity), ("disk", s.disk_capacity)],
        )?;
        gauge(
            &mut e,
            "kvtier_disk_value",
            "Bytes of values with a durable copy on disk.",
            Some(&bytes),
            s.disk_value_bytes,
        )?;
        gauge(
            &mut e,
            "kvtier_disk_regions",
            "Region files on disk.",
            None,
            s.disk_regions,
        )?;
        gauge(
            &mut e,
            "kvtier_quarantined_regions",
            "Region files moved to quarantine/ at the last open.",
            None,
            s.quarantined_regions,
        )?;
        gauge(
            &mut e,
            "kvtier_damaged_regions",
            "Regions where the last open skipped pages without a valid batch.",
            None,
            s.damaged_regions,
        )?;
        family(
            &mut e,
            (
                "kvtier_recovery_findings",
                "What the last open found and did, by kind: damaged_headers (kept), \
                 foreign_regions (quarantined), skipped_region_files, buffered_regions \
                 (no O_DIRECT), regions_behind_gap (not indexed), scrub_dropped (values).",
                None,
                Gauge,
            ),
            "kind",
            [
                ("damaged_headers", s.damaged_headers),
                ("foreign_regions", s.foreign_regions),
                ("skipped_region_files", s.skipped_region_files),
                ("buffered_regions", s.buffered_regions),
                ("regions_behind_gap", s.regions_behind_gap),
                ("scrub_dropped", s.scrub_dropped),
            ],
        )?;
        family(
            &mut e,
            ("kvtier_hits", "Get hits, by tier.", None, Counter),
            "tier",
            [("memory", s.memory_hits), ("disk", s.disk_hits)],
        )?;
        counter(&mut e, "kvtier_misses", "Get misses.", None, s.misses)?;
        counter(&mut e, "kvtier_puts", "Values stored.", None, s.puts)?;
        counter(&mut e, "kvtier_removes", "Keys removed.", None, s.removes)?;
        counter(
            &mut e,
            "kvtier_evictions",
            "Values dropped from the memory pool to make room.",
            None,
            s.evictions,
        )?;
        counter(
            &mut e,
            "kvtier_reclaimed_regions",
            "Disk regions reclaimed.",
            None,
            s.reclaimed_regions,
        )?;
        counter(
            &mut e,
            "kvtier_reclaimed_entries",
            "Entries dropped by disk reclaim.",
            None,
            s.reclaimed_entries,
        )?;
        counter(
            &mut e,
            "kvtier_carried_entries",
            "Recently read entries carried forward by disk reclaim.",
            None,
            s.carried_entries,
        )?;
        counter(
            &mut e,
            "kvtier_checksum_failures",
            "Disk reads that failed verification (served as misses).",
            None,
            s.checksum_failures,
        )?;
        counter(
            &mut e,
            "kvtier_flushed_batches",
            "Batches written to disk.",
            None,
            s.flushed_batches,
        )?;
        counter(
            &mut e,
            "kvtier_flush_errors",
            "Batch write attempts that failed (each is retried).",
            None,
            s.flush_errors,
        )?;
        gauge(
            &mut e,
            "kvtier_retrying_writes",
            "Writes whose last disk attempt failed, waiting to be retried: not durable yet.",
            None,
            s.retrying_writes,
        )?;
        gauge(
            &mut e,
            "kvtier_index",
            "Bytes the index's hash tables occupy.",
            Some(&bytes),
            s.index_bytes,
        )?;
        gauge(
            &mut e,
            "kvtier_eviction_policy",
            "Bytes the eviction policy's queues and simulations occupy.",
            Some(&bytes),
            s.policy_bytes,
        )?;
        gauge(
            &mut e,
            "kvtier_start_time",
            "When the server started, in seconds since the Unix epoch.",
            Some(&seconds),
            m.started_unix_seconds(),
        )?;
        if let Some(peers) = &self.peers {
            let view = &peers.view;
            let me = view.me();
            gauge(
                &mut e,
                "kvtier_cluster_members",
                "Live members in this node's view.",
                None,
                view.members().len() as u64,
            )?;
            gauge(
                &mut e,
                "kvtier_cluster_incarnation",
                "This node's incarnation (changes at each start and lost lease).",
                None,
                me.incarnation,
            )?;
            gauge(
                &mut e,
                "kvtier_cluster_etcd_reachable",
                "1 when the last call to etcd succeeded.",
                None,
                u64::from(view.etcd_reachable.load(Ordering::Relaxed)),
            )?;
            counter(
                &mut e,
                "kvtier_cluster_registrations",
                "Registrations under a new lease, the first included.",
                None,
                view.registrations.load(Ordering::Relaxed),
            )?;
            counter(
                &mut e,
                "kvtier_cluster_lease_losses",
                "Leases that expired before renewal (a pause or a partition).",
                None,
                view.lease_losses.load(Ordering::Relaxed),
            )?;
            counter(
                &mut e,
                "kvtier_cluster_etcd_errors",
                "Calls to etcd that failed or timed out.",
                None,
                view.etcd_errors.load(Ordering::Relaxed),
            )?;
            let stats = peers.stats();
            let ids: Vec<&str> = stats.keys().map(String::as_str).collect();
            let per_peer = |f: fn(&kvtier_client::routing::PeerStats) -> u64| {
                ids.iter()
                    .map(|id| (*id, f(&stats[*id])))
                    .collect::<Vec<_>>()
            };
            family(
                &mut e,
                (
                    "kvtier_peer_requests",
                    "Calls to other cluster members, by member id.",
                    None,
                    Counter,
                ),
                "peer",
                per_peer(|p| p.requests),
            )?;
            family(
                &mut e,
                (
                    "kvtier_peer_errors",
                    "Calls to other members that failed or timed out (their keys read as misses).",
                    None,
                    Counter,
                ),
                "peer",
                per_peer(|p| p.errors),
            )?;
            family(
                &mut e,
                (
                    "kvtier_peer_skipped",
                    "Calls not made because the member failed just before.",
                    None,
                    Counter,
                ),
                "peer",
                per_peer(|p| p.skipped),
            )?;
            family(
                &mut e,
                (
                    "kvtier_peer_keys",
                    "Keys sent to other members.",
                    None,
                    Counter,
                ),
                "peer",
                per_peer(|p| p.keys),
            )?;
            let mut seconds_total = e.encode_descriptor(
                "kvtier_peer_request",
                "Seconds spent in calls to other members (rate over kvtier_peer_requests_total: mean latency).",
                Some(&seconds),
                MetricType::Counter,
            )?;
            for id in &ids {
                let labels = [("peer", *id)];
                ConstCounter::new(stats[*id].seconds)
                    .encode(seconds_total.encode_family(&labels)?)?;
            }
        }
        let info = [
            ("version", env!("CARGO_PKG_VERSION")),
            ("io_engine", s.io_engine),
            ("direct_io", if s.direct_io { "true" } else { "false" }),
        ];
        e.encode_descriptor(
            "kvtier_build",
            "The server's version and I/O setup.",
            None,
            MetricType::Info,
        )?
        .encode_info(&info)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier::Config;
    use std::collections::HashSet;

    fn with_latencies(us: &[u64]) -> OpCounts {
        let metrics = Metrics::default();
        for &t in us {
            metrics.record(2, Duration::from_micros(t), Sample::default());
        }
        metrics.op_counts()[1]
    }

    #[test]
    fn quantiles_interpolate_within_buckets_like_prometheus() {
        assert_eq!(with_latencies(&[]).quantile_seconds(0.5), None);
        // 100 requests in (500 us, 1 ms]: the median sits half-way in.
        let c = with_latencies(&[700; 100]);
        assert!((c.quantile_seconds(0.5).unwrap() - 0.00075).abs() < 1e-9);
        assert!((c.quantile_seconds(0.99).unwrap() - 0.000995).abs() < 1e-9);
        // 90 fast, 10 slow: p50 among the fast, p99 among the slow.
        let mut mixed = vec![40; 90];
        mixed.extend([30_000; 10]);
        let c = with_latencies(&mixed);
        assert!(c.quantile_seconds(0.5).unwrap() <= 0.00005);
        let p99 = c.quantile_seconds(0.99).unwrap();
        assert!((0.025..=0.05).contains(&p99), "{p99}");
        // Past the highest bound reads as that bound.
        assert_eq!(
            with_latencies(&[20_000_000]).quantile_seconds(0.5),
            Some(10.0)
        );
        assert_eq!(c.since(&c).requests, 0);
        assert_eq!(c.since(&OpCounts::default()), c);
    }

    #[test]
    fn exposition_follows_the_conventions_in_both_formats() {
        let dir = tempfile::tempdir().unwrap();
        let store =
            Arc::new(Store::open(Config::new(dir.path()).memory_capacity(8 << 20)).unwrap());
        store.put(b"k", vec![7u8; 5000]).unwrap();
        assert!(store.get(b"k").unwrap().is_some());
        assert!(store.get(b"missing").unwrap().is_none());
        let metrics = Arc::new(Metrics::default());
        metrics.record(
            3,
            Duration::from_micros(300),
            Sample {
                keys: 2,
                bytes_out: 5000,
                ..Default::default()
            },
        );
        let registry = registry(Arc::clone(&metrics), store, None);
        let (classic, content_type) = render(&registry, false);
        assert!(content_type.starts_with("text/plain; version=0.0.4"));
        let (open, content_type) = render(&registry, true);
        assert_eq!(content_type, OPENMETRICS_CONTENT_TYPE);
        assert!(open.ends_with("# EOF\n") && !classic.contains("# EOF"));
        for line in [
            "kvtier_requests_total{op=\"batch_get\"} 1",
            "kvtier_request_sent_bytes_total{op=\"batch_get\"} 5000",
            "kvtier_request_duration_seconds_count{op=\"batch_get\"} 1",
            "kvtier_hits_total{tier=\"memory\"} 1",
            "kvtier_misses_total 1",
            "kvtier_tier_capacity_bytes{tier=\"memory\"} 8388608",
            "kvtier_connections_open 0",
        ] {
            assert!(classic.contains(line), "{line} not in\n{classic}");
            assert!(open.contains(line), "{line} not in\n{open}");
        }
        // The two formats order a bucket's labels differently.
        assert!(classic
            .contains("kvtier_request_duration_seconds_bucket{op=\"batch_get\",le=\"0.00025\"} 0"));
        assert!(classic
            .contains("kvtier_request_duration_seconds_bucket{op=\"batch_get\",le=\"0.0005\"} 1"));
        assert!(open
            .contains("kvtier_request_duration_seconds_bucket{le=\"0.0005\",op=\"batch_get\"} 1"));
        for exposition in [&classic, &open] {
            let inf = exposition
                .lines()
                .filter(|l| {
                    l.starts_with("kvtier_request_duration_seconds_bucket")
                        && l.contains("le=\"+Inf\"")
                })
                .count();
            assert_eq!(inf, OPS.len(), "one +Inf bucket per operation");
        }
        // One TYPE per family, every counter ends in _total, every sample
        // belongs to a declared family.
        let mut families = HashSet::new();
        for line in classic.lines().filter(|l| l.starts_with("# TYPE ")) {
            let mut parts = line.split(' ').skip(2);
            let (name, kind) = (parts.next().unwrap(), parts.next().unwrap());
            assert!(families.insert(name.to_string()), "{name} declared twice");
            if kind == "counter" {
                assert!(name.ends_with("_total"), "{name}");
            }
        }
        for line in classic.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap();
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s).filter(|f| families.contains(*f)))
                .unwrap_or(name);
            assert!(families.contains(family), "{name} has no TYPE line");
        }
    }
}
