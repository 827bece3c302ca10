//! Server metrics: lock-free counters on the request path, read at scrape
//! time into the Prometheus exposition (by `prometheus-client`, through a
//! collector over the counters and the store's `Stats`) and the admin JSON.

use kvtier::{StatValue, Stats, Store};
use kvtier_client::routing::Peers;
use kvtier_wire::protocol::Op;
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

/// Operations, as the metrics count them: one row per `Op`, in code
/// order, named by `Op::name`.
pub const OPS: usize = Op::ALL.len();

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
    ops: [OpMetrics; OPS],
    started: StartTime,
    pub connections_open: AtomicU64,
    pub connections_total: AtomicU64,
    pub protocol_errors: AtomicU64,
    /// The governor whose guess budget counts refused logins on every
    /// surface (`auth_failures`); none in tests that make bare metrics.
    governor: Option<Arc<kvtier_governor::Governor>>,
    /// Connections refused at the connection cap.
    pub connections_refused: AtomicU64,
    /// Connections dropped by a deadline: handshake, idle or a slow frame.
    pub connections_timed_out: AtomicU64,
    /// Connections closed in the lobby (before their first byte): the
    /// oldest, for a newcomer, or at the first-byte deadline.
    pub lobby_closed: AtomicU64,
    /// Connections waiting in the lobby now.
    pub lobby_waiting: AtomicU64,
    /// Connections waiting for their hello, unproven, closed to make room
    /// for a newcomer.
    pub pending_closed: AtomicU64,
    /// Requests answered LIMIT because the buffer budget was spent.
    pub requests_refused_for_memory: AtomicU64,
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

/// The sum of the counts of the operations `which` picks.
pub fn sum_ops(counts: &[OpCounts; OPS], which: fn(Op) -> bool) -> OpCounts {
    let mut sum = OpCounts::default();
    for (op, c) in Op::ALL.iter().zip(counts) {
        if which(*op) {
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
    /// Metrics of a server governed by `governor`.
    pub fn governed(governor: &Arc<kvtier_governor::Governor>) -> Metrics {
        Metrics {
            governor: Some(Arc::clone(governor)),
            ..Metrics::default()
        }
    }

    /// Logins refused for a wrong or missing credential, on every surface
    /// that spends from the governor's guess budget.
    pub fn auth_failures(&self) -> u64 {
        self.governor.as_ref().map_or(0, |g| g.guesses().refused())
    }

    /// Counts one request of `op` (a header's code: an unknown one is a
    /// protocol error, counted there, not here).
    pub fn record(&self, op: u16, elapsed: Duration, sample: Sample) {
        let Some(op) = Op::from_u16(op) else {
            return;
        };
        let m = &self.ops[op.index()];
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

    /// Every operation's counters now, in `Op::ALL` order.
    pub fn op_counts(&self) -> [OpCounts; OPS] {
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
        let ops: serde_json::Map<String, serde_json::Value> = Op::ALL
            .iter()
            .map(|op| op.name())
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
                "get": latency(&sum_ops(&counts, Op::reads_values)),
                "put": latency(&sum_ops(&counts, Op::writes_values)),
            },
            "server": {
                "connections": self.connections_open.load(Ordering::Relaxed),
                "connections_total": self.connections_total.load(Ordering::Relaxed),
                "protocol_errors": self.protocol_errors.load(Ordering::Relaxed),
                "auth_failures": self.auth_failures(),
                "connections_refused": self.connections_refused.load(Ordering::Relaxed),
                "connections_timed_out": self.connections_timed_out.load(Ordering::Relaxed),
                "lobby_closed": self.lobby_closed.load(Ordering::Relaxed),
                "lobby_waiting": self.lobby_waiting.load(Ordering::Relaxed),
                "pending_closed": self.pending_closed.load(Ordering::Relaxed),
                "buffers_refused": self.buffers_refused.load(Ordering::Relaxed),
                "requests_refused_for_memory": self.requests_refused_for_memory.load(Ordering::Relaxed),
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

/// One exposition family made of the store's `Stats` fields: a single
/// series (`label` None, one member) or one series per member, labelled.
#[derive(Debug)]
struct StoreFamily {
    name: &'static str,
    help: &'static str,
    /// In bytes (the `_bytes` suffix and unit).
    bytes: bool,
    counter: bool,
    label: Option<&'static str>,
    /// (label value, `Stats` field) per series; the label value is unused
    /// without a label.
    members: &'static [(&'static str, &'static str)],
}

/// Every numeric `Stats` field but those in `STATS_NOT_EXPORTED`, in
/// exactly one family (the test below holds the table to `Stats::fields`,
/// so a new field cannot go unexported).
const STORE_FAMILIES: &[StoreFamily] = &[
    StoreFamily {
        name: "kvtier_entries",
        help: "Keys in the index (any tier).",
        bytes: false,
        counter: false,
        label: None,
        members: &[("", "entries")],
    },
    StoreFamily {
        name: "kvtier_tier_entries",
        help: "Values held, by tier.",
        bytes: false,
        counter: false,
        label: Some("tier"),
        members: &[("memory", "memory_entries"), ("disk", "disk_entries")],
    },
    StoreFamily {
        name: "kvtier_tier_used",
        help: "Bytes used, by tier (disk: region files, dead space included).",
        bytes: true,
        counter: false,
        label: Some("tier"),
        members: &[("memory", "memory_bytes"), ("disk", "disk_used_bytes")],
    },
    StoreFamily {
        name: "kvtier_tier_capacity",
        help: "Capacity, by tier.",
        bytes: true,
        counter: false,
        label: Some("tier"),
        members: &[("memory", "memory_capacity"), ("disk", "disk_capacity")],
    },
    StoreFamily {
        name: "kvtier_disk_value",
        help: "Bytes of values with a durable copy on disk.",
        bytes: true,
        counter: false,
        label: None,
        members: &[("", "disk_value_bytes")],
    },
    StoreFamily {
        name: "kvtier_disk_regions",
        help: "Region files on disk.",
        bytes: false,
        counter: false,
        label: None,
        members: &[("", "disk_regions")],
    },
    StoreFamily {
        name: "kvtier_quarantined_regions",
        help: "Region files moved to quarantine/ at the last open.",
        bytes: false,
        counter: false,
        label: None,
        members: &[("", "quarantined_regions")],
    },
    StoreFamily {
        name: "kvtier_damaged_regions",
        help: "Regions where the last open skipped pages without a valid batch.",
        bytes: false,
        counter: false,
        label: None,
        members: &[("", "damaged_regions")],
    },
    StoreFamily {
        name: "kvtier_recovery_findings",
        help: "What the last open found and did, by kind: damaged_headers (kept), \
               foreign_regions (quarantined), skipped_region_files, buffered_regions \
               (no O_DIRECT), regions_behind_gap (not indexed), scrub_dropped (values), \
               checkpoint_entries_loaded (indexed from a local index checkpoint).",
        bytes: false,
        counter: false,
        label: Some("kind"),
        members: &[
            ("damaged_headers", "damaged_headers"),
            ("foreign_regions", "foreign_regions"),
            ("skipped_region_files", "skipped_region_files"),
            ("buffered_regions", "buffered_regions"),
            ("regions_behind_gap", "regions_behind_gap"),
            ("scrub_dropped", "scrub_dropped"),
            ("checkpoint_entries_loaded", "checkpoint_entries_loaded"),
        ],
    },
    StoreFamily {
        name: "kvtier_hits",
        help: "Get hits, by tier.",
        bytes: false,
        counter: true,
        label: Some("tier"),
        members: &[("memory", "memory_hits"), ("disk", "disk_hits")],
    },
    StoreFamily {
        name: "kvtier_misses",
        help: "Get misses.",
        bytes: false,
        counter: true,
        label: None,
        members: &[("", "misses")],
    },
    StoreFamily {
        name: "kvtier_puts",
        help: "Values stored.",
        bytes: false,
        counter: true,
        label: None,
        members: &[("", "puts")],
    },
    StoreFamily {
        name: "kvtier_removes",
        help: "Keys removed.",
        bytes: false,
        counter: true,
        label: None,
        members: &[("", "removes")],
    },
    StoreFamily {
        name: "kvtier_evictions",
        help: "Values dropped from the memory pool to make room.",
        bytes: false,
        counter: true,
        label: None,
        members: &[("", "evictions")],
    },
    StoreFamily {
        name: "kvtier_reclaimed_regions",
        help: "Disk regions reclaimed.",
        bytes: false,
        counter: true,
        label: None,
        members: &[("", "reclaimed_regions")],
    },
    StoreFamily {
        name: "kvtier_reclaimed_entries",
        help: "Entries dropped by disk reclaim.",
        bytes: false,
        counter: true,
        label: None,
        members: &[("", "reclaimed_entries")],
    },
    StoreFamily {
        name: "kvtier_carried_entries",
        help: "Recently read entries carried forward by disk reclaim.",
        bytes: false,
        counter: true,
        label: None,
        members: &[("", "carried_entries")],
    },
    StoreFamily {
        name: "kvtier_io_deadline_misses",
        help: "Values answered as a miss because their read of a file system that can stall \
               did not complete within the storage deadline (io_deadline).",
        bytes: false,
        counter: true,
        label: None,
        members: &[("", "io_deadline_misses")],
    },
    StoreFamily {
        name: "kvtier_io_deadline_write_errors",
        help: "Flushes and durable writes answered with a TimedOut error past the storage \
               deadline (their writes stay queued).",
        bytes: false,
        counter: true,
        label: None,
        members: &[("", "io_deadline_write_errors")],
    },
    StoreFamily {
        name: "kvtier_io_stalls",
        help: "Times reads of a file system went from all answering to some held past the \
               storage deadline.",
        bytes: false,
        counter: true,
        label: None,
        members: &[("", "io_stalls")],
    },
    StoreFamily {
        name: "kvtier_io_stalled_reads",
        help: "Read batches held by the kernel past their deadline now (answered as misses; \
               nonzero while a file system does not answer).",
        bytes: false,
        counter: false,
        label: None,
        members: &[("", "io_stalled_reads")],
    },
    StoreFamily {
        name: "kvtier_io_stalled_read",
        help: "Bytes of the store's buffers held by reads past their deadline.",
        bytes: true,
        counter: false,
        label: None,
        members: &[("", "io_stalled_read_bytes")],
    },
    StoreFamily {
        name: "kvtier_checksum_failures",
        help: "Disk reads that failed verification (served as misses).",
        bytes: false,
        counter: true,
        label: None,
        members: &[("", "checksum_failures")],
    },
    StoreFamily {
        name: "kvtier_flushed_batches",
        help: "Batches written to disk.",
        bytes: false,
        counter: true,
        label: None,
        members: &[("", "flushed_batches")],
    },
    StoreFamily {
        name: "kvtier_flush_errors",
        help: "Batch write attempts that failed (each is retried).",
        bytes: false,
        counter: true,
        label: None,
        members: &[("", "flush_errors")],
    },
    StoreFamily {
        name: "kvtier_retrying_writes",
        help: "Writes whose last disk attempt failed, waiting to be retried: not durable yet.",
        bytes: false,
        counter: false,
        label: None,
        members: &[("", "retrying_writes")],
    },
    StoreFamily {
        name: "kvtier_index",
        help: "Bytes the index's hash tables occupy.",
        bytes: true,
        counter: false,
        label: None,
        members: &[("", "index_bytes")],
    },
    StoreFamily {
        name: "kvtier_shared_writers",
        help: "Other writers of the shared directory this node follows (0 without one).",
        bytes: false,
        counter: false,
        label: None,
        members: &[("", "shared_writers")],
    },
    StoreFamily {
        name: "kvtier_shared_regions",
        help: "Region files of other writers this node follows.",
        bytes: false,
        counter: false,
        label: None,
        members: &[("", "shared_regions")],
    },
    StoreFamily {
        name: "kvtier_shared_buffered_regions",
        help: "Region files of other writers held open and read through the page cache \
               (buffered: the read mode of network and FUSE file systems); the rest are read \
               O_DIRECT.",
        bytes: false,
        counter: false,
        label: None,
        members: &[("", "shared_buffered_regions")],
    },
    StoreFamily {
        name: "kvtier_shared",
        help: "Bytes of the region files of other writers this node follows.",
        bytes: true,
        counter: false,
        label: None,
        members: &[("", "shared_bytes")],
    },
    StoreFamily {
        name: "kvtier_shared_batches",
        help: "Batches of other writers indexed since open.",
        bytes: false,
        counter: true,
        label: None,
        members: &[("", "shared_batches")],
    },
    StoreFamily {
        name: "kvtier_shared_stuck_regions",
        help: "Other writers' regions whose newest page holds no whole batch record yet \
               (a flush in progress, or a writer that died in one).",
        bytes: false,
        counter: false,
        label: None,
        members: &[("", "shared_stuck_regions")],
    },
    StoreFamily {
        name: "kvtier_shared_clock_ahead_entries",
        help: "Other writers' entries not indexed because their sequence numbers read more \
               than 5 minutes ahead of this node's clock.",
        bytes: false,
        counter: true,
        label: None,
        members: &[("", "shared_clock_ahead_entries")],
    },
    StoreFamily {
        name: "kvtier_shared_regions_over_file_budget",
        help: "Other writers' region files not followed at the last pass because the \
               descriptors kept for them were spent (their blocks are misses).",
        bytes: false,
        counter: false,
        label: None,
        members: &[("", "shared_regions_over_file_budget")],
    },
    StoreFamily {
        name: "kvtier_shared_dirs_without_lock",
        help: "Directories under the shared directory's nodes/ not followed at the last pass \
               because they never held a writer's LOCK.",
        bytes: false,
        counter: false,
        label: None,
        members: &[("", "shared_dirs_without_lock")],
    },
    StoreFamily {
        name: "kvtier_shared_writers_stalled",
        help: "Other writers whose files did not answer within the storage deadline at the \
               last follow pass and still do not (their logs are not followed meanwhile).",
        bytes: false,
        counter: false,
        label: None,
        members: &[("", "shared_writers_stalled")],
    },
    StoreFamily {
        name: "kvtier_shared_regions_behind_gap",
        help: "Other writers' region files not followed because a region between them and \
               their writer's head is missing.",
        bytes: false,
        counter: false,
        label: None,
        members: &[("", "shared_regions_behind_gap")],
    },
    StoreFamily {
        name: "kvtier_shared_tombstones",
        help: "Removes remembered so that an older put of another writer is not indexed.",
        bytes: false,
        counter: false,
        label: None,
        members: &[("", "shared_tombstones")],
    },
    StoreFamily {
        name: "kvtier_shared_checkpoints_loaded",
        help: "Other writers' index checkpoints loaded since open.",
        bytes: false,
        counter: true,
        label: None,
        members: &[("", "shared_checkpoints_loaded")],
    },
    StoreFamily {
        name: "kvtier_shared_checkpoint_entries",
        help: "Index entries taken from other writers' checkpoints since open.",
        bytes: false,
        counter: true,
        label: None,
        members: &[("", "shared_checkpoint_entries")],
    },
    StoreFamily {
        name: "kvtier_shared_polls",
        help: "Passes over the other writers' logs since open.",
        bytes: false,
        counter: true,
        label: None,
        members: &[("", "shared_polls")],
    },
    StoreFamily {
        name: "kvtier_shared_reads",
        help: "Disk hits served from other writers' files.",
        bytes: false,
        counter: true,
        label: None,
        members: &[("", "shared_reads")],
    },
    StoreFamily {
        name: "kvtier_shared_read_failures",
        help: "Reads of other writers' files that failed (reclaimed or replaced under the \
               read); each was a miss.",
        bytes: false,
        counter: true,
        label: None,
        members: &[("", "shared_read_failures")],
    },
    StoreFamily {
        name: "kvtier_shared_outside_share",
        help: "Bounded index mode: other writers' put entries passed over as another \
               member's share of the index.",
        bytes: false,
        counter: true,
        label: None,
        members: &[("", "shared_outside_share")],
    },
    StoreFamily {
        name: "kvtier_shared_share_rereads",
        help: "Bounded index mode: times a new share (the member list changed) made this \
               node read the other writers' records again.",
        bytes: false,
        counter: true,
        label: None,
        members: &[("", "shared_share_rereads")],
    },
    StoreFamily {
        name: "kvtier_eviction_policy",
        help: "Bytes the eviction policy's queues and simulations occupy.",
        bytes: true,
        counter: false,
        label: None,
        members: &[("", "policy_bytes")],
    },
];

/// Numeric `Stats` fields left out of the exposition, and why: settings
/// (visible in `/stats`, fixed for the process's life) and the policy's
/// own cost, which the admin page shows as a share of time.
#[cfg(test)]
const STATS_NOT_EXPORTED: &[&str] = &[
    "policy_ns",
    "io_depth",
    "read_piece",
    "io_deadline_ms",
    // Exported in seconds, as kvtier_shared_follow_age_seconds.
    "shared_follow_age_ms",
];

fn family_unlabelled(
    e: &mut DescriptorEncoder,
    f: &StoreFamily,
    unit: Option<&Unit>,
    kind: MetricType,
    v: u64,
) -> Written {
    match kind {
        MetricType::Counter => counter(e, f.name, f.help, unit, v),
        _ => gauge(e, f.name, f.help, unit, v),
    }
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
            Op::ALL
                .iter()
                .zip(&counts)
                .map(move |(op, c)| (op.name(), f(c)))
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
        for (op, c) in Op::ALL.iter().zip(&counts) {
            let labels = [("op", op.name())];
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
            "kvtier_lobby_closed",
            "Connections closed before their first byte: the oldest of a full lobby, or at the first-byte deadline.",
            None,
            load(&m.lobby_closed),
        )?;
        counter(
            &mut e,
            "kvtier_pending_closed",
            "Connections waiting for their hello, unproven, closed to make room for a newcomer.",
            None,
            load(&m.pending_closed),
        )?;
        counter(
            &mut e,
            "kvtier_requests_refused_for_memory",
            "Requests answered LIMIT because the server's buffer budget was spent.",
            None,
            load(&m.requests_refused_for_memory),
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
            m.auth_failures(),
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
        let fields: std::collections::HashMap<&str, u64> = s
            .fields()
            .into_iter()
            .filter_map(|(name, value)| match value {
                StatValue::Count(n) => Some((name, n)),
                _ => None,
            })
            .collect();
        for f in STORE_FAMILIES {
            let unit = f.bytes.then_some(&bytes);
            let kind = if f.counter { Counter } else { Gauge };
            // A field the table names but `Stats` lost reads as 0 here and
            // fails the table's test.
            let value = |field: &str| fields.get(field).copied().unwrap_or(0);
            match f.label {
                None => family_unlabelled(&mut e, f, unit, kind, value(f.members[0].1))?,
                Some(label) => family(
                    &mut e,
                    (f.name, f.help, unit, kind),
                    label,
                    f.members
                        .iter()
                        .map(|&(member, field)| (member, value(field))),
                )?,
            }
        }
        gauge(
            &mut e,
            "kvtier_shared_follow_age",
            "Seconds since the last pass over the other writers' logs of the shared directory \
             began (this node's staleness about them, before the file system's own caches); \
             0 without one.",
            Some(&seconds),
            fields.get("shared_follow_age_ms").copied().unwrap_or(0) as f64 / 1000.0,
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

    #[test]
    fn every_numeric_stats_field_is_exported_once_or_excluded_by_name() {
        let numeric: Vec<&str> = Stats::default()
            .fields()
            .into_iter()
            .filter(|(_, v)| matches!(v, StatValue::Count(_)))
            .map(|(name, _)| name)
            .collect();
        let mut seen = std::collections::HashMap::new();
        for f in STORE_FAMILIES {
            assert!(f.label.is_some() || f.members.len() == 1, "{}", f.name);
            for (_, field) in f.members {
                assert!(
                    numeric.contains(field),
                    "{} names no Stats field {field}",
                    f.name
                );
                assert!(
                    seen.insert(*field, f.name).is_none(),
                    "{field} exported twice"
                );
            }
        }
        for field in STATS_NOT_EXPORTED {
            assert!(
                numeric.contains(field),
                "excluded {field} is no Stats field"
            );
            assert!(
                !seen.contains_key(field),
                "{field} both exported and excluded"
            );
        }
        for field in &numeric {
            assert!(
                seen.contains_key(field) || STATS_NOT_EXPORTED.contains(field),
                "Stats field {field} is neither exported nor excluded: add it to STORE_FAMILIES"
            );
        }
    }
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
            assert_eq!(inf, OPS, "one +Inf bucket per operation");
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
