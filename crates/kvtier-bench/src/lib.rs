//! `kvtier bench`: the store's throughput and latency against what the
//! machine does without it, measured in the same run.
//!
//! For each value size and batch count: put to disk (puts, then `flush`,
//! timed together), get from disk (after a reopen, so the memory pool is
//! empty and every read comes from disk), put to memory (memory-only puts)
//! and get from memory. Each row carries its baseline: raw O_DIRECT
//! io_uring writes or reads of the same sizes at the same depth for disk
//! rows, memcpy for memory rows. Every byte read back is verified.
//!
//! Shared machines drift (other tenants, host caches), so each case runs
//! in rounds that alternate store and baseline, with the side that goes
//! first alternating too: both see the same conditions on average, and
//! their ratio is what the rows report.
//!
//! A crate of its own: the `kvtier` binary runs it as `kvtier bench`; it
//! reaches the core's batching rule, record layout and write chunk through
//! the core's `internals` feature instead of copying them.

mod cases;
mod data;
mod index;
mod remote;
mod report;
mod schedule;
mod sides;
mod trace;
mod workload;

use cases::run_cases;
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};
use kvtier::parse_size;
use kvtier::IoEngineKind;
use report::Row;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Duration;

fn parse_sizes(text: &str) -> Result<Vec<u64>, String> {
    text.split(',').map(parse_size).collect()
}

fn parse_list(text: &str) -> Result<Vec<usize>, String> {
    text.split(',')
        .map(|t| t.trim().parse::<usize>().map_err(|e| format!("{t:?}: {e}")))
        .collect()
}

fn parse_count(text: &str) -> Result<u64, String> {
    let t = text.trim().to_ascii_lowercase();
    let (number, multiplier) = if let Some(n) = t.strip_suffix('m') {
        (n, 1_000_000)
    } else if let Some(n) = t.strip_suffix('k') {
        (n, 1_000)
    } else {
        (t.as_str(), 1)
    };
    number
        .parse::<u64>()
        .map(|n| n * multiplier)
        .map_err(|e| format!("{text:?}: {e}"))
}

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Directory for the store and the baseline's scratch file; created if
    /// missing and removed afterwards if the bench created it.
    #[arg(long, default_value = "./kvtier-bench-data")]
    pub data_dir: PathBuf,
    /// Value sizes, comma separated.
    #[arg(long, default_value = "16MiB,64MiB", value_parser = parse_sizes)]
    pub value_sizes: std::vec::Vec<u64>,
    /// Keys per batch call, comma separated.
    #[arg(long, default_value = "1,4,8,16", value_parser = parse_list)]
    pub batches: std::vec::Vec<usize>,
    /// Operations: put, get.
    #[arg(long, default_value = "put,get", value_delimiter = ',')]
    pub ops: Vec<String>,
    /// Tiers: memory, disk, shared (the seed's workflow: a prefill store
    /// puts into a shared directory, a decode store reads it through
    /// another mount; needs --shared-mounts).
    #[arg(long, default_value = "memory,disk", value_delimiter = ',')]
    pub tiers: Vec<String>,
    /// With --tiers shared: one directory of a shared file system as the
    /// prefill node's mount and as the decode node's mount shows it
    /// (two mounts of one JuiceFS volume, say: `scripts/shared-bench` sets
    /// them up), comma separated.
    #[arg(long, value_delimiter = ',')]
    pub shared_mounts: Vec<PathBuf>,
    /// io engine: uring or psync.
    #[arg(long, default_value = "uring")]
    pub io_engine: String,
    /// With the uring engine: register the memory pool as fixed buffers
    /// and region files as registered files (the store's default), or not.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub io_registration: bool,
    /// Memory pool capacity. Default: 2 GiB; with --trace, a list of
    /// capacities to replay at (default: 3 million tokens' worth of blocks).
    #[arg(long, value_delimiter = ',', value_parser = parse_size)]
    pub memory: Vec<u64>,
    /// Disk tier capacity. Default: 16 GiB; with --trace, a list where 0
    /// means memory-only and `auto` means room for the whole trace
    /// (default: 0,auto).
    #[arg(long, value_delimiter = ',')]
    pub disk: Vec<String>,
    /// Memory eviction policies (lru, s3fifo, adaptive; `default` is the
    /// store's default, adaptive). Default: the store's; with --trace or
    /// --workload, each is replayed (default: lru,s3fifo,default).
    #[arg(long, value_delimiter = ',')]
    pub eviction: Vec<String>,
    /// Run the cases through the client against a running server
    /// (`unix:///path/kvtier.sock` or `tcp://host:port`); the token comes
    /// from KVTIER_AUTH_TOKEN.
    #[arg(long)]
    pub connect: Option<String>,
    /// With --connect: the server's data directory, readable by the bench
    /// (run beside the server): disk gets are then compared with raw reads
    /// of the server's own region files instead of a scratch file's.
    #[arg(long, requires = "connect")]
    pub server_data_dir: Option<PathBuf>,
    /// With --connect to a cluster member: send each key straight to the
    /// members that own it (client-side routing, one hop) instead of
    /// through the connected server.
    #[arg(long, requires = "connect")]
    pub route: bool,
    /// Replay a request trace (JSON lines with `hash_ids`, as Mooncake's
    /// FAST'25 traces) instead of the synthetic cases.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Replay synthesised workloads instead of a trace file, each in turn:
    /// conversation, agent, rag (docs/benchmarks.md describes each). The
    /// --trace options apply.
    #[arg(long, value_delimiter = ',', conflicts_with = "trace")]
    pub workload: Vec<String>,
    /// With --workload: requests per workload.
    #[arg(long, default_value_t = 20_000)]
    pub workload_requests: usize,
    /// With --workload: the generator's seed.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// With --workload: write each generated trace here as Mooncake-format
    /// JSON lines (`PATH` gets the workload's name before its extension)
    /// and replay nothing.
    #[arg(long)]
    pub write_trace: Option<PathBuf>,
    /// With --trace: memory capacities given in tokens (1M, 3M, ...),
    /// each turned into whole blocks of the trace's value size.
    #[arg(long, value_delimiter = ',', value_parser = parse_count)]
    pub memory_tokens: Vec<u64>,
    /// With --trace: KV bytes per token; a block of 512 tokens is a value
    /// of 512 times this.
    #[arg(long, default_value_t = 128)]
    pub bytes_per_token: u64,
    /// With --trace: replay only the first N requests.
    #[arg(long)]
    pub limit: Option<usize>,
    /// With --trace: replay arrival times N times faster (default: as fast
    /// as possible).
    #[arg(long, conflicts_with = "max_rate")]
    pub speed: Option<f64>,
    /// With --trace: ignore arrival times and replay as fast as possible
    /// (the default).
    #[arg(long)]
    pub max_rate: bool,
    /// The store's io_uring queue depth (`Config::io_depth`).
    #[arg(long, default_value_t = 64)]
    pub io_depth: u32,
    /// The store's disk read piece (`Config::read_piece`).
    #[arg(long, default_value = "2MiB", value_parser = parse_size)]
    pub read_piece: u64,
    /// Disk get cases: batch calls each caller keeps in flight (what the
    /// async calls give one caller: the next batch is issued while one is
    /// read). Each call in flight runs on its own worker, and with more than
    /// one the raw shape-matched side keeps as many calls in flight too.
    #[arg(long, default_value_t = 1)]
    pub pipeline: usize,
    /// Run every case this many times, each on fresh files (or, with
    /// --connect, fresh keys), and report each figure's median with its
    /// min and max (synthetic cases; not --trace or --workload).
    #[arg(long, default_value_t = 1)]
    pub repeat: usize,
    /// Bytes each case moves (rounded to whole batches, at least one).
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    pub bytes_per_case: u64,
    /// Caller threads issuing batches concurrently in store cases.
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Also measure batch_exists of 1,024 keys on an index of this many
    /// entries (e.g. 10M); 0 skips it.
    #[arg(long, default_value = "0", value_parser = parse_count)]
    pub index_entries: u64,
    /// Also measure reopening a store holding this many entries (e.g. 1M,
    /// 4 KiB each); 0 skips it.
    #[arg(long, default_value = "0", value_parser = parse_count)]
    pub reopen_entries: u64,
    /// Also measure a node starting beside another writer's log of this
    /// many blocks in a shared directory, by reading its records and by
    /// loading its index checkpoint (e.g. 1M,10M); none by default.
    #[arg(long, value_delimiter = ',', value_parser = parse_count)]
    pub follow_entries: Vec<u64>,
    /// Write the rows as a JSON array to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw throughput against batch count to this SVG file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Write the rows as a Markdown table to this file.
    #[arg(long)]
    pub markdown: Option<PathBuf>,
    /// Run nothing: read rows saved earlier with --json and write the
    /// --markdown and --plot outputs from them.
    #[arg(long)]
    pub from_json: Option<PathBuf>,
}

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
    fn new() -> Self {
        Measurement {
            latency_us: Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid bounds"),
            seconds: 0.0,
            bytes: 0,
            calls: 0,
            span_mb_per_s: Vec::new(),
        }
    }

    fn record_call(&mut self, elapsed: Duration) {
        self.latency_us
            .saturating_record((elapsed.as_micros() as u64).max(1));
        self.calls += 1;
    }

    /// Adds a timed span that moved `bytes`.
    fn add_span(&mut self, elapsed: Duration, bytes: u64) {
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

/// A progress bar per case (indicatif) when stderr is a terminal outside
/// CI; nothing otherwise, so logs and CI output hold only the rows.
struct Progress {
    shown: bool,
    total: usize,
    done: usize,
    bar: ProgressBar,
}

impl Progress {
    fn new(total: usize) -> Progress {
        Progress {
            shown: std::io::stderr().is_terminal() && std::env::var_os("CI").is_none(),
            total,
            done: 0,
            bar: ProgressBar::hidden(),
        }
    }

    fn replace(&mut self, bar: ProgressBar) {
        self.bar.finish_and_clear();
        self.bar = if self.shown {
            bar
        } else {
            ProgressBar::hidden()
        };
    }

    /// A new case of `rounds` rounds begins.
    fn case(&mut self, label: &str, rounds: usize) {
        self.done += 1;
        let style = ProgressStyle::with_template(
            "{prefix} {msg:26} [{bar:30.cyan/blue}] {pos}/{len} rounds {elapsed}",
        )
        .expect("a valid progress template")
        .progress_chars("=> ");
        let bar = ProgressBar::new(rounds as u64)
            .with_style(style)
            .with_prefix(format!("[{}/{}]", self.done, self.total))
            .with_message(label.to_string());
        self.replace(bar);
    }

    /// The case turned out to have `rounds` rounds.
    fn set_rounds(&self, rounds: usize) {
        self.bar.set_length(rounds as u64);
    }

    fn round_done(&self) {
        self.bar.inc(1);
    }

    /// Work between cases (the ceiling sweeps): a spinner.
    fn note(&mut self, label: &str) {
        let bar = ProgressBar::new_spinner()
            .with_prefix(format!("[{}/{}]", self.done, self.total))
            .with_message(label.to_string());
        bar.enable_steady_tick(std::time::Duration::from_millis(120));
        self.replace(bar);
    }

    fn row(&mut self, row: &Row) {
        self.bar.finish_and_clear();
        println!("{}", row.line());
    }

    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// A bench run's result: any failure ends it with a message.
pub type BenchResult<T> = Result<T, Box<dyn std::error::Error>>;

pub fn run(args: &BenchArgs) -> BenchResult<()> {
    if let Some(path) = &args.from_json {
        let rows: Vec<Row> = serde_json::from_str(&std::fs::read_to_string(path)?)?;
        return write_outputs(args, &rows);
    }
    for op in &args.ops {
        if op != "put" && op != "get" {
            return Err(format!("unknown op {op:?}: expected put or get").into());
        }
    }
    for tier in &args.tiers {
        if tier != "memory" && tier != "disk" && tier != "shared" {
            return Err(format!("unknown tier {tier:?}: expected memory, disk or shared").into());
        }
        if tier == "shared" && args.shared_mounts.len() != 2 {
            return Err(
                "--tiers shared needs --shared-mounts B,C (one directory as two mounts show it)"
                    .into(),
            );
        }
    }
    if args.threads == 0 || args.batches.contains(&0) || args.value_sizes.contains(&0) {
        return Err("threads, batch counts and value sizes must be at least 1".into());
    }
    let engine = IoEngineKind::parse(&args.io_engine)?;
    if args.repeat == 0 || args.pipeline == 0 {
        return Err("--repeat and --pipeline must be at least 1".into());
    }
    if args.repeat > 1 && (args.trace.is_some() || !args.workload.is_empty()) {
        return Err(
            "--repeat applies to the synthetic cases (local or --connect), not to --trace or \
             --workload"
                .into(),
        );
    }
    if let Some(path) = &args.trace {
        let requests = trace::load(path, args.limit)?;
        let mut rows = trace::run(args, &path.display().to_string(), &requests, engine)?;
        let name = path.file_stem().map(|s| s.to_string_lossy().into_owned());
        for row in &mut rows {
            row.workload = name.clone().unwrap_or_default();
        }
        return trace::write_outputs(args, &rows);
    }
    if !args.workload.is_empty() {
        let mut rows = Vec::new();
        for name in &args.workload {
            let mut requests = workload::generate(name, args.workload_requests, args.seed)?;
            if let Some(limit) = args.limit {
                requests.truncate(limit);
            }
            if let Some(path) = &args.write_trace {
                let target = trace::named_path(path, name);
                trace::save(&target, &requests)?;
                println!("wrote {} ({} requests)", target.display(), requests.len());
                continue;
            }
            let mut replayed = trace::run(args, name, &requests, engine)?;
            for row in &mut replayed {
                row.workload = name.clone();
            }
            rows.extend(replayed);
        }
        return trace::write_outputs(args, &rows);
    }
    if let Some(url) = &args.connect {
        let created = !args.data_dir.exists();
        let rows = repeated(args.repeat, || remote::run(args, url));
        if created {
            let _ = std::fs::remove_dir_all(&args.data_dir);
        }
        return write_outputs(args, &rows?);
    }
    if args.memory.len() > 1 || args.disk.len() > 1 || args.eviction.len() > 1 {
        return Err("lists of --memory, --disk or --eviction are for --trace replays".into());
    }
    let created = !args.data_dir.exists();
    std::fs::create_dir_all(&args.data_dir)?;
    let result = repeated(args.repeat, || run_cases(args, engine));
    // Clean up whatever happened.
    if created {
        let _ = std::fs::remove_dir_all(&args.data_dir);
    } else {
        let _ = std::fs::remove_dir_all(args.data_dir.join("store"));
        if let Ok(listing) = std::fs::read_dir(&args.data_dir) {
            for item in listing.flatten() {
                if item.file_name().to_string_lossy().ends_with(".scratch") {
                    let _ = std::fs::remove_file(item.path());
                }
            }
        }
    }
    write_outputs(args, &result?)
}

/// Runs the cases `repeat` times (each run on fresh keys and files) and,
/// past one run, gives each case's medians with their min and max.
fn repeated(
    repeat: usize,
    mut run: impl FnMut() -> BenchResult<Vec<Row>>,
) -> BenchResult<Vec<Row>> {
    let mut runs = Vec::new();
    for r in 0..repeat {
        if repeat > 1 {
            println!("== run {} of {repeat}", r + 1);
        }
        runs.push(run()?);
    }
    if repeat == 1 {
        return Ok(runs.pop().unwrap_or_default());
    }
    let merged = report::merge_runs(&runs);
    println!("== medians of {repeat} runs");
    println!("{}", Row::header());
    for row in &merged {
        println!("{}", row.line());
    }
    Ok(merged)
}

fn write_outputs(args: &BenchArgs, rows: &[Row]) -> BenchResult<()> {
    let rows = rows.to_vec();
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)?;
        println!("wrote {}", path.display());
    }
    if let Some(path) = &args.plot {
        std::fs::write(path, report::svg(&rows))?;
        println!("wrote {}", path.display());
    }
    if let Some(path) = &args.markdown {
        std::fs::write(path, report::markdown(&rows))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

fn wants(args: &BenchArgs, op: &str, tier: &str) -> bool {
    args.ops.iter().any(|o| o == op) && args.tiers.iter().any(|t| t == tier)
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
