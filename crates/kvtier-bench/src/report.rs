//! Result rows: the printed table, the JSON objects and the SVG chart.

use crate::measure::Measurement;
use kvtier::format_size;
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Row {
    pub op: String,
    pub tier: String,
    pub value_size: u64,
    pub batch: usize,
    pub mb_per_s: f64,
    pub baseline_mb_per_s: f64,
    pub ratio: f64,
    /// Median over rounds of the per-round ratio (store and baseline run in
    /// alternating rounds); absent where the rounds do not pair up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ratio_median: Option<f64>,
    pub baseline: String,
    pub batches_per_s: f64,
    pub p50_us: u64,
    pub p90_us: u64,
    pub p99_us: u64,
    pub p999_us: u64,
    pub baseline_p50_us: u64,
    pub bytes: u64,
    pub seconds: f64,
    pub verified_bytes: u64,
    pub io_engine: String,
    /// For index rows: entries in the index and its bytes per entry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index_entries: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index_bytes_per_entry: Option<f64>,
    /// For the index row, medians per batch: hashing the keys (keyed
    /// BLAKE3), the lookups alone, and a reference for those lookups: two
    /// random 64-byte lines per key over memory the size of the index,
    /// read by a plain loop in the same run (the lookups can come in under
    /// it: a prompt's blocks, inserted together, sit close in the arena).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index_hash_p50_us: Option<u64>,
    /// For the open row: seconds to open an empty directory with a 256 MiB
    /// pool (backing the pool with memory), which the reopen itself leaves
    /// out by using a 16 MiB pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_open_seconds: Option<f64>,
    /// For the open row from a checkpoint: seconds the clean close before
    /// it took, the checkpoint's write and sync included.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub close_seconds: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index_lookup_p50_us: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index_random_lines_p50_us: Option<u64>,
    /// For the index row: the default eviction policy's metadata (queues,
    /// ghosts, simulations) for a full pool of `pool_entries` values, from
    /// a real store (see `index::policy_probe`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_entries: Option<u64>,
    /// Disk rows: the device ceiling (the best rate raw transfers reached
    /// on the same files, re-measured beside the store at the sweep's best
    /// shape; never below any side's rate in the case), its shape, and the
    /// store's ratio to it (= `ratio`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ceiling_mb_per_s: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ceiling_shape: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ratio_to_ceiling: Option<f64>,
    /// Local disk rows: the ceiling's best shape re-measured with its
    /// transfers landing in (reads) or coming from (writes) buffers that
    /// cover the batch's bytes, taken in turn, as the store's do (the
    /// ceiling reuses as many buffers as it keeps in flight), and the
    /// store's ratio to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ceiling_in_batch_memory_mb_per_s: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ratio_to_ceiling_in_batch_memory: Option<f64>,
    /// Disk rows: the shape-matched raw stream (the store's own requests)
    /// and the store's ratio to it: its software overhead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape_mb_per_s: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ratio_to_shape: Option<f64>,
    /// Disk get rows with `--pipeline N > 1`: batch calls each caller kept
    /// in flight.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<usize>,
    /// With `--repeat N`: the runs behind this row (its figures are their
    /// medians) and each figure's minimum and maximum over them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runs: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min: Option<serde_json::Map<String, serde_json::Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max: Option<serde_json::Map<String, serde_json::Value>>,
}

impl Row {
    /// A disk row: the store against the device ceiling (`ratio`) and, where
    /// measured, the shape-matched stream and the ceiling's shape in the
    /// batch's memory. The ceiling is the best rate of the case: the
    /// ceiling shape's, or any other side's (the store's included) if it
    /// went faster (the device did it, so it can), which keeps
    /// `ratio_to_ceiling` at most 1 by construction; `ceiling_shape` says
    /// which. Latency of the baseline is the shape-matched stream's
    /// per call (comparable with the store's calls), else the ceiling's.
    #[expect(clippy::too_many_arguments, reason = "one row's worth of facts")]
    pub fn against_device(
        op: &str,
        value_size: u64,
        batch: usize,
        store: &Measurement,
        shape: Option<&Measurement>,
        ceiling: &Measurement,
        in_batch_memory: Option<&Measurement>,
        ceiling_shape: String,
        io_engine: &str,
        verified_bytes: u64,
    ) -> Row {
        let mut row = Row::new(
            op,
            "disk",
            value_size,
            batch,
            store,
            ceiling,
            "device ceiling: raw O_DIRECT io_uring at the best size x depth of a sweep over the same files, re-measured each round; shape-matched: the store's own requests, raw",
            io_engine,
            verified_bytes,
        );
        let mut candidates = vec![
            (ceiling.mb_per_s(), ceiling_shape.clone()),
            (store.mb_per_s(), "the store's own run".to_string()),
        ];
        if let Some(landed) = in_batch_memory {
            candidates.push((
                landed.mb_per_s(),
                format!("{ceiling_shape} in the batch's memory"),
            ));
        }
        if let Some(shape) = shape {
            candidates.push((
                shape.mb_per_s(),
                "the store's request stream, raw".to_string(),
            ));
        }
        let (best, best_shape) = candidates
            .into_iter()
            .max_by(|a, b| a.0.total_cmp(&b.0))
            .expect("candidates");
        let ratio = |base: f64| if base > 0.0 { row.mb_per_s / base } else { 0.0 };
        row.baseline_mb_per_s = best;
        row.ratio = ratio(best);
        row.ceiling_mb_per_s = Some(best);
        row.ceiling_shape = Some(best_shape);
        row.ratio_to_ceiling = Some(ratio(best));
        if let Some(shape) = shape {
            row.shape_mb_per_s = Some(shape.mb_per_s());
            row.ratio_to_shape = Some(ratio(shape.mb_per_s()));
            row.baseline_p50_us = shape.latency_us.value_at_quantile(0.50);
        }
        if let Some(landed) = in_batch_memory {
            row.ceiling_in_batch_memory_mb_per_s = Some(landed.mb_per_s());
            row.ratio_to_ceiling_in_batch_memory = Some(ratio(landed.mb_per_s()));
        }
        row
    }

    /// "; p50 hashing ..." for an index row that carries the split.
    fn split_line(&self) -> String {
        match (
            self.index_hash_p50_us,
            self.index_lookup_p50_us,
            self.index_random_lines_p50_us,
        ) {
            (Some(hash), Some(lookup), Some(lines)) => {
                format!(
                    "; p50 hashing {hash} us, lookups {lookup} us, two random lines per key {lines} us"
                )
            }
            _ => String::new(),
        }
    }

    /// "; policy ..." for an index row that carries the policy probe.
    fn policy_line(&self) -> String {
        let (Some(policy), Some(pool), Some(entries)) =
            (self.policy_bytes, self.pool_entries, self.index_entries)
        else {
            return String::new();
        };
        format!(
            "; policy {:.1} B per pool entry ({pool} entries, {:.2} MiB), +{:.2} B per index entry",
            policy as f64 / pool.max(1) as f64,
            policy as f64 / (1u64 << 20) as f64,
            policy as f64 / entries.max(1) as f64
        )
    }

    #[expect(
        clippy::too_many_arguments,
        reason = "one row's identity plus its two measurements"
    )]
    pub fn new(
        op: &str,
        tier: &str,
        value_size: u64,
        batch: usize,
        store: &Measurement,
        baseline: &Measurement,
        baseline_kind: &str,
        io_engine: &str,
        verified_bytes: u64,
    ) -> Row {
        let mb_per_s = store.mb_per_s();
        let baseline_mb_per_s = baseline.mb_per_s();
        Row {
            op: op.into(),
            tier: tier.into(),
            value_size,
            batch,
            mb_per_s,
            baseline_mb_per_s,
            ratio: if baseline_mb_per_s > 0.0 {
                mb_per_s / baseline_mb_per_s
            } else {
                0.0
            },
            ratio_median: store.paired_median_ratio(baseline),
            baseline: baseline_kind.into(),
            batches_per_s: if store.seconds > 0.0 {
                store.calls as f64 / store.seconds
            } else {
                0.0
            },
            p50_us: store.latency_us.value_at_quantile(0.50),
            p90_us: store.latency_us.value_at_quantile(0.90),
            p99_us: store.latency_us.value_at_quantile(0.99),
            p999_us: store.latency_us.value_at_quantile(0.999),
            baseline_p50_us: baseline.latency_us.value_at_quantile(0.50),
            bytes: store.bytes,
            seconds: store.seconds,
            verified_bytes,
            io_engine: io_engine.into(),
            ..Row::default()
        }
    }

    pub fn header() -> String {
        format!(
            "{:<4} {:<6} {:>9} {:>5} {:>10} {:>10} {:>6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10}",
            "op",
            "tier",
            "value",
            "batch",
            "MB/s",
            "base MB/s",
            "ratio",
            "batch/s",
            "p50 us",
            "p90 us",
            "p99 us",
            "p99.9 us",
            "verified"
        )
    }

    pub fn line(&self) -> String {
        if self.op == "open" {
            let entries = self.index_entries.unwrap_or(0);
            return format!(
                "{:<4} {:<6} reopened {} entries ({} of region files) in {:.3} s ({:.2} M entries/s){}{}",
                self.op,
                self.tier,
                entries,
                format_size(self.bytes),
                self.seconds,
                entries as f64 / self.seconds.max(1e-9) / 1e6,
                self.pool_open_seconds.map_or(String::new(), |s| format!(
                    "; an empty directory with a 256 MiB pool opens in {s:.3} s"
                )),
                self.close_seconds.map_or(String::new(), |s| format!(
                    "; the clean close that wrote the checkpoint took {s:.3} s"
                ))
            );
        }
        let value = if self.value_size > 0 {
            format_size(self.value_size).replace(".00 ", "")
        } else {
            "-".into()
        };
        format!(
            "{:<4} {:<6} {:>9} {:>5} {:>10.0} {:>10.0} {:>6.2} {:>9.1} {:>9} {:>9} {:>9} {:>9} {:>10}{}",
            self.op,
            self.tier,
            value,
            self.batch,
            self.mb_per_s,
            self.baseline_mb_per_s,
            self.ratio,
            self.batches_per_s,
            self.p50_us,
            self.p90_us,
            self.p99_us,
            self.p999_us,
            format_size(self.verified_bytes).replace(".00 ", ""),
            match (self.index_entries, self.index_bytes_per_entry) {
                (Some(n), Some(b)) => format!(
                    "  ({n} entries, {b:.1} B/entry{}{})",
                    self.split_line(),
                    self.policy_line()
                ),
                (Some(n), None) => format!("  ({n} entries)"),
                _ => match (&self.ceiling_shape, self.ratio_to_shape, self.shape_mb_per_s) {
                    (Some(ceiling), Some(to_shape), Some(shape)) => format!(
                        "  (ceiling: {ceiling}; shape-matched {shape:.0} MB/s, ratio {to_shape:.2}{})",
                        match (
                            self.ceiling_in_batch_memory_mb_per_s,
                            self.ratio_to_ceiling_in_batch_memory
                        ) {
                            (Some(rate), Some(r)) =>
                                format!("; in the batch's memory {rate:.0} MB/s, ratio {r:.2}"),
                            _ => String::new(),
                        }
                    ),
                    _ => String::new(),
                },
            }
        )
    }
}

/// Rows of `--repeat` runs merged case by case (op, tier, value size,
/// batch; in the first run's order): every numeric figure becomes the
/// median of the runs (the mean of the middle two for an even count,
/// rounded for integer fields), `min` and `max` hold each figure's extremes,
/// and text fields come from the first run. A case missing from some run
/// is merged over the runs that have it.
pub fn merge_runs(runs: &[Vec<Row>]) -> Vec<Row> {
    use serde_json::{Map, Value};
    let case = |r: &Row| (r.op.clone(), r.tier.clone(), r.value_size, r.batch);
    let mut order = Vec::new();
    for row in runs.iter().flatten() {
        if !order.contains(&case(row)) {
            order.push(case(row));
        }
    }
    order
        .into_iter()
        .map(|key| {
            let group: Vec<Map<String, Value>> = runs
                .iter()
                .flatten()
                .filter(|r| case(r) == key)
                .map(|r| match serde_json::to_value(r).expect("rows serialize") {
                    Value::Object(map) => map,
                    _ => unreachable!("a row is an object"),
                })
                .collect();
            let mut merged = group[0].clone();
            let (mut low, mut high) = (Map::new(), Map::new());
            for (field, first) in &group[0] {
                if !first.is_number() || matches!(field.as_str(), "value_size" | "batch") {
                    continue;
                }
                let mut values: Vec<f64> = group
                    .iter()
                    .filter_map(|m| m.get(field).and_then(Value::as_f64))
                    .collect();
                values.sort_by(f64::total_cmp);
                let n = values.len();
                let median = if n % 2 == 1 {
                    values[n / 2]
                } else {
                    (values[n / 2 - 1] + values[n / 2]) / 2.0
                };
                let number = |x: f64| {
                    if first.is_u64() {
                        Value::from(x.round() as u64)
                    } else {
                        Value::from(x)
                    }
                };
                merged.insert(field.clone(), number(median));
                low.insert(field.clone(), number(values[0]));
                high.insert(field.clone(), number(values[n - 1]));
            }
            let mut row: Row =
                serde_json::from_value(Value::Object(merged)).expect("merged rows deserialize");
            row.runs = Some(group.len());
            row.min = Some(low);
            row.max = Some(high);
            row
        })
        .collect()
}

/// "m (lo-hi)" for a figure of a merged row, or just the figure.
fn spread(r: &Row, field: &str, value: f64, digits: usize) -> String {
    let bound = |m: &Option<serde_json::Map<String, serde_json::Value>>| {
        m.as_ref()
            .and_then(|m| m.get(field))
            .and_then(serde_json::Value::as_f64)
    };
    match (bound(&r.min), bound(&r.max)) {
        (Some(lo), Some(hi)) => format!("{value:.digits$} ({lo:.digits$}-{hi:.digits$})"),
        _ => format!("{value:.digits$}"),
    }
}

/// The rows as a Markdown table (store rows, then index and reopen rows).
pub fn markdown(rows: &[Row]) -> String {
    let mut out = String::from(
        "| op | tier | value | batch | MB/s | baseline MB/s | ratio | ceiling shape | shape-matched MB/s | ratio to shape | ceiling in batch memory MB/s | ratio to it | p50 µs | p99 µs | verified |\n\
         |---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows.iter().filter(|r| r.value_size > 0) {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            r.op,
            r.tier,
            format_size(r.value_size).replace(".00 ", " "),
            match r.pipeline {
                Some(p) => format!("{} ({p} in flight)", r.batch),
                None => r.batch.to_string(),
            },
            spread(r, "mb_per_s", r.mb_per_s, 0),
            spread(r, "baseline_mb_per_s", r.baseline_mb_per_s, 0),
            spread(r, "ratio", r.ratio, 2),
            r.ceiling_shape.as_deref().unwrap_or(&r.baseline),
            r.shape_mb_per_s
                .map_or("-".to_string(), |v| spread(r, "shape_mb_per_s", v, 0)),
            r.ratio_to_shape
                .map_or("-".to_string(), |v| spread(r, "ratio_to_shape", v, 2)),
            r.ceiling_in_batch_memory_mb_per_s
                .map_or("-".to_string(), |v| spread(
                    r,
                    "ceiling_in_batch_memory_mb_per_s",
                    v,
                    0
                )),
            r.ratio_to_ceiling_in_batch_memory
                .map_or("-".to_string(), |v| spread(
                    r,
                    "ratio_to_ceiling_in_batch_memory",
                    v,
                    2
                )),
            r.p50_us,
            r.p99_us,
            format_size(r.verified_bytes).replace(".00 ", " ")
        );
    }
    for r in rows.iter().filter(|r| r.value_size == 0) {
        match r.op.as_str() {
            "exists" => {
                let _ = writeln!(
                    out,
                    "\n`batch_exists` of {} keys on an index of {} entries: p50 {} µs, p90 {} µs, p99 {} µs, p99.9 {} µs; index memory {:.1} bytes per entry{}.",
                    r.batch,
                    r.index_entries.unwrap_or(0),
                    r.p50_us,
                    r.p90_us,
                    r.p99_us,
                    r.p999_us,
                    r.index_bytes_per_entry.unwrap_or(0.0),
                    r.policy_line()
                );
            }
            "open" => {
                let _ = writeln!(
                    out,
                    "\nReopen after a clean close with {} entries ({} of region files), {}: {:.3} s.",
                    r.index_entries.unwrap_or(0),
                    format_size(r.bytes),
                    if r.tier == "checkpoint" {
                        "loading its index checkpoint"
                    } else {
                        "reading every batch record"
                    },
                    r.seconds
                );
            }
            _ => {}
        }
    }
    out
}

/// One panel per (op, tier): MB/s against batch count, a line per value
/// size, the store solid and its baseline dashed.
pub fn svg(rows: &[Row]) -> String {
    let mut panels: Vec<(String, String)> = Vec::new();
    for row in rows.iter().filter(|r| r.value_size > 0) {
        let id = (row.op.clone(), row.tier.clone());
        if !panels.contains(&id) {
            panels.push(id);
        }
    }
    let (pw, ph, margin) = (420.0, 300.0, 80.0);
    let width = (panels.len().max(1) as f64) * (pw + margin) + margin;
    let height = ph + 2.0 * margin + 40.0;
    let colors = [
        "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b",
    ];
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    for (p, (op, tier)) in panels.iter().enumerate() {
        let x0 = margin + p as f64 * (pw + margin);
        let y0 = margin;
        let these: Vec<&Row> = rows
            .iter()
            .filter(|r| &r.op == op && &r.tier == tier && r.value_size > 0)
            .collect();
        let mut batches: Vec<usize> = these.iter().map(|r| r.batch).collect();
        batches.sort_unstable();
        batches.dedup();
        let mut sizes: Vec<u64> = these.iter().map(|r| r.value_size).collect();
        sizes.sort_unstable();
        sizes.dedup();
        let ymax = these
            .iter()
            .map(|r| r.mb_per_s.max(r.baseline_mb_per_s))
            .fold(1.0f64, f64::max)
            * 1.1;
        let x_of = |batch: usize| {
            let i = batches.iter().position(|&b| b == batch).unwrap_or(0) as f64;
            x0 + if batches.len() > 1 {
                i / (batches.len() - 1) as f64 * pw
            } else {
                pw / 2.0
            }
        };
        let y_of = |v: f64| y0 + ph - v / ymax * ph;
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}" font-size="14" font-weight="bold">{op} from/to {tier}</text>"#,
            x0,
            y0 - 20.0
        );
        let _ = writeln!(
            out,
            r##"<rect x="{x0}" y="{y0}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>"##
        );
        for t in 0..=4 {
            let v = ymax * t as f64 / 4.0;
            let y = y_of(v);
            let _ = writeln!(
                out,
                r##"<line x1="{x0}" y1="{y}" x2="{}" y2="{y}" stroke="#eee"/><text x="{}" y="{}" text-anchor="end">{v:.0}</text>"##,
                x0 + pw,
                x0 - 5.0,
                y + 4.0
            );
        }
        for &b in &batches {
            let _ = writeln!(
                out,
                r#"<text x="{}" y="{}" text-anchor="middle">{b}</text>"#,
                x_of(b),
                y0 + ph + 16.0
            );
        }
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}" text-anchor="middle">keys per batch</text>"#,
            x0 + pw / 2.0,
            y0 + ph + 34.0
        );
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}" transform="rotate(-90 {} {})" text-anchor="middle">MB/s</text>"#,
            x0 - 45.0,
            y0 + ph / 2.0,
            x0 - 45.0,
            y0 + ph / 2.0
        );
        for (s, &size) in sizes.iter().enumerate() {
            let color = colors[s % colors.len()];
            let mut series: Vec<&&Row> = these.iter().filter(|r| r.value_size == size).collect();
            series.sort_by_key(|r| r.batch);
            let store: Vec<String> = series
                .iter()
                .map(|r| format!("{:.1},{:.1}", x_of(r.batch), y_of(r.mb_per_s)))
                .collect();
            let base: Vec<String> = series
                .iter()
                .map(|r| format!("{:.1},{:.1}", x_of(r.batch), y_of(r.baseline_mb_per_s)))
                .collect();
            let _ = writeln!(
                out,
                r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"#,
                store.join(" ")
            );
            let _ = writeln!(
                out,
                r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="1.5" stroke-dasharray="6,4"/>"#,
                base.join(" ")
            );
            let ly = y0 + ph + 52.0;
            let lx = x0 + s as f64 * 210.0;
            let _ = writeln!(
                out,
                r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="2"/><text x="{}" y="{}">{} (dashed: {})</text>"#,
                lx + 20.0,
                lx + 24.0,
                ly + 4.0,
                format_size(size).replace(".00 ", ""),
                series
                    .first()
                    .map_or("", |r| if r.tier == "memory" { "memcpy" } else { "raw" })
            );
        }
    }
    out.push_str("</svg>\n");
    out
}
