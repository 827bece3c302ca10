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

mod args;
mod case;
mod cases;
mod data;
mod index;
mod measure;
mod progress;
mod remote;
mod report;
mod schedule;
mod sides;
mod trace;
mod workload;

pub use args::BenchArgs;
pub use measure::{BenchResult, Measurement};

use cases::run_cases;
use kvtier::IoEngineKind;
use report::Row;

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
