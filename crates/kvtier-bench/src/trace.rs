//! `kvtier bench --trace`: replay a request trace (Mooncake's FAST'25
//! format: one JSON object per line with `timestamp` in ms, `input_length`,
//! `output_length` and `hash_ids`, one id per 512-token block) against the
//! store, the way an engine with a prefix cache would serve it.
//!
//! Per request: the block ids become chained keys (a key names the whole
//! prefix up to its block); `prefix_len` finds the cached prefix; those
//! blocks are loaded with `batch_get_into` and verified; the rest are
//! "prefilled" and stored with `batch_put`. Hit rates count whole blocks.
//!
//! A replay runs on the bench's round scheduler: the requests are cut into
//! rounds, and with a disk tier each round also runs the device ceiling at
//! the replay's own disk transfer size and depth over the store's region
//! files, in rotating order with the replay. A replay is one ordered
//! sequence, so the ceiling's share of a round is what the replay's disk
//! loads read in its latest round, at the shape of its disk loads so far.

use super::schedule::{self, Round};
use super::sides::device::{CeilingReader, FileSet, Shape};
use crate::args::BenchArgs;
use crate::data;
use crate::measure::{BenchResult, Measurement};
use hdrhistogram::Histogram;
use kvtier::{format_size, parse_size};
use kvtier::{Config, EvictionPolicy, IoEngineKind, Store};
use serde::{Deserialize, Serialize};
use std::cell::Cell;
use std::collections::HashSet;
use std::fmt::Write as _;
use std::io::BufRead;
use std::path::Path;
use std::time::{Duration, Instant};

/// Tokens per block in Mooncake's traces.
pub const BLOCK_TOKENS: u64 = 512;

/// Rounds a replay is cut into (by request count; fewer for a shorter
/// trace): often enough that a drift in the device's speed reaches the
/// replay and its ceiling alike.
const TRACE_ROUNDS: u64 = 32;

/// The fields a replay uses (`input_length` and `output_length` are
/// implied by the blocks for hit rates counted in whole blocks).
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct Request {
    /// Arrival, in ms from the trace's start.
    pub timestamp: u64,
    /// One id per 512-token block of the prompt.
    pub hash_ids: Vec<u64>,
}

/// One replay: a memory capacity, a disk capacity and a policy.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TraceRow {
    /// The trace file or the synthesised workload replayed.
    #[serde(default)]
    pub workload: String,
    pub memory: u64,
    pub memory_tokens: u64,
    pub disk: u64,
    pub eviction: String,
    pub requests: u64,
    pub blocks: u64,
    pub token_hit_rate: f64,
    pub max_token_hit_rate: f64,
    pub fraction_of_max: f64,
    pub memory_hits: u64,
    pub disk_hits: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Bytes read per second of time spent loading hit blocks.
    pub mb_per_s: f64,
    /// The same for the memory hits alone (loaded in their own call)...
    #[serde(default)]
    pub memory_load_mb_per_s: f64,
    /// ...and for the disk hits alone.
    #[serde(default)]
    pub disk_load_mb_per_s: f64,
    /// The device ceiling at the replay's own disk transfer size and depth
    /// (raw O_DIRECT io_uring reads of the store's region files in pieces
    /// of the value size, or the store's read piece if smaller, with as
    /// many in flight as the disk loads so far read per call, at most the
    /// store's io_depth), measured round by round beside a replay with
    /// disk hits (0 otherwise).
    pub baseline_mb_per_s: f64,
    /// `disk_load_mb_per_s / baseline_mb_per_s`.
    pub ratio: f64,
    /// Per-request load latency (prefix_len plus batch_get_into).
    pub p50_us: u64,
    pub p99_us: u64,
    pub verified_bytes: u64,
    pub value_size: u64,
    pub seconds: f64,
    pub io_engine: String,
    /// The policy's time per block of the replay (lookups, inserts,
    /// victims, simulations), in ns.
    #[serde(default)]
    pub policy_ns_per_block: f64,
    /// Index and policy memory per entry at the end of the replay.
    #[serde(default)]
    pub index_bytes_per_entry: f64,
    #[serde(default)]
    pub policy_bytes_per_entry: f64,
    /// What the eviction did at the end (the adaptive policy's pick).
    #[serde(default)]
    pub eviction_mode: String,
}

/// `path` with `name` before its extension: `traces.jsonl` -> `traces-agent.jsonl`.
pub fn named_path(path: &Path, name: &str) -> std::path::PathBuf {
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let file = match path.extension() {
        Some(ext) => format!("{stem}-{name}.{}", ext.to_string_lossy()),
        None => format!("{stem}-{name}"),
    };
    path.with_file_name(file)
}

/// Writes requests as Mooncake-format JSON lines (`input_length` counts
/// the blocks' tokens; `output_length` is not modelled and written as 0).
pub fn save(path: &Path, requests: &[Request]) -> BenchResult<()> {
    use std::io::Write as _;
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    for r in requests {
        let line = serde_json::json!({
            "timestamp": r.timestamp,
            "input_length": r.hash_ids.len() as u64 * BLOCK_TOKENS,
            "output_length": 0,
            "hash_ids": r.hash_ids,
        });
        writeln!(out, "{line}")?;
    }
    out.flush()?;
    Ok(())
}

pub fn load(path: &Path, limit: Option<usize>) -> BenchResult<Vec<Request>> {
    let file =
        std::fs::File::open(path).map_err(|e| format!("opening trace {}: {e}", path.display()))?;
    let mut requests = Vec::new();
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        if limit.is_some_and(|l| requests.len() >= l) {
            break;
        }
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let request: Request = serde_json::from_str(&line)
            .map_err(|e| format!("{}:{}: {e}", path.display(), n + 1))?;
        requests.push(request);
    }
    if requests.is_empty() {
        return Err(format!("trace {} has no requests", path.display()).into());
    }
    Ok(requests)
}

/// Chained keys: key i = the first 16 bytes of BLAKE3(key i-1 || block id
/// i), so equal keys mean equal prefixes, as the engines' chained block
/// hashes do.
fn chain(ids: &[u64]) -> Vec<[u8; 16]> {
    let mut previous = [0u8; 16];
    ids.iter()
        .map(|id| {
            let mut input = [0u8; 24];
            input[..16].copy_from_slice(&previous);
            input[16..].copy_from_slice(&id.to_le_bytes());
            previous = blake3::hash(&input).as_bytes()[..16].try_into().unwrap();
            previous
        })
        .collect()
}

/// Block hit rate with an infinite cache: the most any policy can reach.
fn max_hit_rate(requests: &[Request]) -> (f64, u64) {
    let mut seen: HashSet<[u8; 16]> = HashSet::new();
    let (mut hits, mut blocks) = (0u64, 0u64);
    for request in requests {
        let keys = chain(&request.hash_ids);
        hits += keys.iter().take_while(|k| seen.contains(*k)).count() as u64;
        blocks += keys.len() as u64;
        seen.extend(keys);
    }
    (hits as f64 / blocks.max(1) as f64, seen.len() as u64)
}

pub fn run(
    args: &BenchArgs,
    source: &str,
    requests: &[Request],
    engine: IoEngineKind,
) -> BenchResult<Vec<TraceRow>> {
    let value_size = args.bytes_per_token * BLOCK_TOKENS;
    if value_size == 0 {
        return Err("--bytes-per-token must be at least 1".into());
    }
    let padded = value_size.div_ceil(4096) * 4096;
    let (max_rate, distinct) = max_hit_rate(requests);
    let mut memories: Vec<u64> = args.memory.clone();
    memories.extend(
        args.memory_tokens
            .iter()
            .map(|&t| t / BLOCK_TOKENS * padded),
    );
    if memories.is_empty() {
        memories.push(3_000_000 / BLOCK_TOKENS * padded);
    }
    // Room for every distinct block, its record entry and region slack.
    let region = 64u64 << 20;
    let whole_trace = (distinct * (padded + 128) + 4 * region).max(2 * region);
    let disks: Vec<u64> = if args.disk.is_empty() {
        vec![0, whole_trace]
    } else {
        args.disk
            .iter()
            .map(|d| {
                if d == "auto" {
                    Ok(whole_trace)
                } else {
                    parse_size(d)
                }
            })
            .collect::<Result<_, _>>()?
    };
    let policies: Vec<EvictionPolicy> = if args.eviction.is_empty() {
        vec![
            EvictionPolicy::Lru,
            EvictionPolicy::S3Fifo,
            EvictionPolicy::default(),
        ]
    } else {
        args.eviction
            .iter()
            .map(|p| match p.as_str() {
                // Whatever the store does when not told.
                "default" => Ok(EvictionPolicy::default()),
                p => EvictionPolicy::parse(p),
            })
            .collect::<Result<_, _>>()?
    };
    println!(
        "trace {}: {} requests, {} blocks of {} tokens, {} distinct; value {} per block; max token hit rate {:.4}",
        source,
        requests.len(),
        requests.iter().map(|r| r.hash_ids.len()).sum::<usize>(),
        BLOCK_TOKENS,
        distinct,
        format_size(value_size),
        max_rate
    );
    println!("{}", TraceRow::header());
    let created = !args.data_dir.exists();
    std::fs::create_dir_all(&args.data_dir)?;
    let mut rows = Vec::new();
    let mut result = Ok(());
    'replays: for &disk in &disks {
        for &memory in &memories {
            for &policy in &policies {
                match replay(
                    args, requests, memory, disk, policy, engine, value_size, max_rate,
                ) {
                    Ok(row) => {
                        println!("{}", row.line());
                        rows.push(row);
                    }
                    Err(e) => {
                        result = Err(e);
                        break 'replays;
                    }
                }
            }
        }
    }
    if created {
        let _ = std::fs::remove_dir_all(&args.data_dir);
    } else {
        let _ = std::fs::remove_dir_all(args.data_dir.join("trace-store"));
    }
    result?;
    Ok(rows)
}

#[expect(clippy::too_many_arguments, reason = "one replay's full configuration")]
fn replay(
    args: &BenchArgs,
    requests: &[Request],
    memory: u64,
    disk: u64,
    policy: EvictionPolicy,
    engine: IoEngineKind,
    value_size: u64,
    max_rate: f64,
) -> BenchResult<TraceRow> {
    let dir = args.data_dir.join("trace-store");
    let _ = std::fs::remove_dir_all(&dir);
    let mut config = Config::new(&dir)
        .memory_capacity(memory)
        .disk_capacity(disk)
        .eviction(policy)
        .time_policy(true)
        .io_engine(engine)
        .io_depth(args.io_depth)
        .read_piece(args.read_piece)
        .max_value_size(value_size);
    if disk > 0 {
        config = config.region_size((64u64 << 20).min(disk / 2 / 4096 * 4096));
    }
    let store = Store::open(config)?;
    let engine_name = store.stats().io_engine;
    let slot = (value_size as usize).div_ceil(4096) * 4096;
    let most_blocks = requests.iter().map(|r| r.hash_ids.len()).max().unwrap_or(0);
    let mut host = super::data::touched_buffer(slot * most_blocks.max(1));
    let mut latency = Histogram::<u64>::new_with_bounds(1, 600_000_000, 3)?;
    let (mut hit_blocks, mut blocks, mut verified, mut written) = (0u64, 0u64, 0u64, 0u64);
    // Loads are split by tier: the hit blocks with a memory copy are read
    // in one call, the rest (disk hits) in another, each timed on its own.
    let memory_load = Cell::new(Load::default());
    let disk_load = Cell::new(Load::default());
    // What the disk loads read in the replay's latest round: the ceiling's
    // share of a round.
    let latest_disk_bytes = Cell::new(0u64);
    // Time the ceiling took: not the replay's (arrival times and `seconds`
    // leave it out).
    let ceiling_time = Cell::new(Duration::ZERO);
    let started = Instant::now();
    let mut replay_side = |round: &Round, (): &()| -> BenchResult<()> {
        let disk_bytes_before = disk_load.get().bytes;
        for request in &requests[round.batches.start as usize..round.batches.end as usize] {
            if let Some(speed) = args.speed.filter(|s| *s > 0.0) {
                let due = Duration::from_secs_f64(request.timestamp as f64 / 1e3 / speed);
                let replayed = started.elapsed().saturating_sub(ceiling_time.get());
                if let Some(wait) = due.checked_sub(replayed) {
                    std::thread::sleep(wait);
                }
            }
            let keys = chain(&request.hash_ids);
            let call = Instant::now();
            let cached = store.prefix_len(&keys);
            let mut loaded = 0;
            if cached > 0 {
                let resident = store.batch_in_memory(&keys[..cached]);
                let mut hit = vec![false; cached];
                let mut slices: Vec<Option<&mut [u8]>> = host
                    .as_mut_slice()
                    .chunks_mut(slot)
                    .take(cached)
                    .map(Some)
                    .collect();
                for in_memory in [true, false] {
                    let picked: Vec<usize> =
                        (0..cached).filter(|&i| resident[i] == in_memory).collect();
                    if picked.is_empty() {
                        continue;
                    }
                    let part_keys: Vec<&[u8; 16]> = picked.iter().map(|&i| &keys[i]).collect();
                    let mut part_bufs: Vec<&mut [u8]> = picked
                        .iter()
                        .map(|&i| slices[i].take().expect("each block is loaded once"))
                        .collect();
                    let part = Instant::now();
                    let results = store.batch_get_into(&part_keys, &mut part_bufs);
                    let tier_load = if in_memory { &memory_load } else { &disk_load };
                    let mut load = tier_load.get();
                    load.busy += part.elapsed();
                    load.calls += 1;
                    for (&i, result) in picked.iter().zip(&results) {
                        match result {
                            Ok(Some(_)) => {
                                hit[i] = true;
                                load.bytes += value_size;
                            }
                            Ok(None) => {}
                            Err(e) => return Err(format!("loading a hit block failed: {e}").into()),
                        }
                    }
                    tier_load.set(load);
                }
                // A block evicted between the lookup and the read ends the hit.
                loaded = hit.iter().take_while(|&&h| h).count();
            }
            let elapsed = call.elapsed();
            latency.saturating_record((elapsed.as_micros() as u64).max(1));
            for (key, buffer) in keys[..loaded].iter().zip(host.as_slice().chunks(slot)) {
                if !data::verify(key, &buffer[..value_size as usize]) {
                    return Err(
                        format!("trace replay read wrong bytes for block {}", hex(key)).into(),
                    );
                }
                verified += value_size;
            }
            hit_blocks += loaded as u64;
            blocks += keys.len() as u64;
            // "Prefill" the rest and store it.
            let missing = &keys[loaded..];
            if !missing.is_empty() {
                let values: Vec<Vec<u8>> = missing
                    .iter()
                    .map(|k| {
                        let mut v = vec![0u8; value_size as usize];
                        data::fill(k, &mut v);
                        v
                    })
                    .collect();
                for result in store.batch_put(missing, &values) {
                    result.map_err(|e| format!("storing prefilled blocks failed: {e}"))?;
                }
                written += missing.len() as u64 * value_size;
            }
        }
        latest_disk_bytes.set(disk_load.get().bytes - disk_bytes_before);
        Ok(())
    };
    // The device limit for this replay's disk reads: raw reads of its
    // transfer size (the value, in pieces of at most the read piece, as
    // the store reads) at its mean depth (pieces of the disk hits per disk
    // load call, at most the store's io_depth), over the store's own
    // region files, continuing where the previous round stopped.
    let mut ceiling = Measurement::new();
    let mut ceiling_at = (0usize, 0u64);
    let mut ceiling_side = |_: &Round, (): &()| -> BenchResult<()> {
        let load = disk_load.get();
        let bytes = latest_disk_bytes.get();
        if bytes == 0 || load.calls == 0 {
            return Ok(());
        }
        let began = Instant::now();
        let values_per_call = (load.bytes / value_size) as f64 / load.calls as f64;
        let piece = args.read_piece as usize;
        let pieces = (value_size as usize).div_ceil(piece);
        let shape = Shape {
            size: (value_size as usize).min(piece),
            depth: ((values_per_call * pieces as f64).round() as usize)
                .clamp(1, args.io_depth as usize),
        };
        let set = FileSet::regions_of(&[dir.as_path()])?;
        let mut reader = CeilingReader::new(&set, shape, 0)?.starting_at(ceiling_at);
        reader.read(bytes, &mut ceiling)?;
        ceiling_at = reader.position();
        ceiling_time.set(ceiling_time.get() + began.elapsed());
        Ok(())
    };
    let round_list = crate::measure::rounds(requests.len() as u64, TRACE_ROUNDS);
    let mut sides: Vec<schedule::Side<'_, ()>> = vec![&mut replay_side];
    if disk > 0 {
        sides.push(&mut ceiling_side);
    }
    schedule::run_rounds(round_list, 1, |_| Ok(()), &mut sides)?;
    drop(sides);
    let seconds = started
        .elapsed()
        .saturating_sub(ceiling_time.get())
        .as_secs_f64();
    let (memory_load, disk_load) = (memory_load.get(), disk_load.get());
    let stats = store.stats();
    let per_entry = |bytes: u64| bytes as f64 / stats.entries.max(1) as f64;
    store.close()?;
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
    let bytes_read = hit_blocks * value_size;
    let load_total = Load {
        busy: memory_load.busy + disk_load.busy,
        bytes: memory_load.bytes + disk_load.bytes,
        calls: memory_load.calls + disk_load.calls,
    };
    let baseline_mb_per_s = ceiling.mb_per_s();
    let token_hit_rate = hit_blocks as f64 / blocks.max(1) as f64;
    Ok(TraceRow {
        workload: String::new(),
        memory,
        memory_tokens: memory / (value_size.div_ceil(4096) * 4096) * BLOCK_TOKENS,
        disk,
        eviction: policy.name().into(),
        requests: requests.len() as u64,
        blocks,
        token_hit_rate,
        max_token_hit_rate: max_rate,
        fraction_of_max: if max_rate > 0.0 {
            token_hit_rate / max_rate
        } else {
            0.0
        },
        memory_hits: stats.memory_hits,
        disk_hits: stats.disk_hits,
        bytes_read,
        bytes_written: written,
        mb_per_s: load_total.mb_per_s(),
        memory_load_mb_per_s: memory_load.mb_per_s(),
        disk_load_mb_per_s: disk_load.mb_per_s(),
        baseline_mb_per_s,
        ratio: if baseline_mb_per_s > 0.0 {
            disk_load.mb_per_s() / baseline_mb_per_s
        } else {
            0.0
        },
        p50_us: latency.value_at_quantile(0.5),
        p99_us: latency.value_at_quantile(0.99),
        verified_bytes: verified,
        value_size,
        seconds,
        io_engine: engine_name.into(),
        policy_ns_per_block: stats.policy_ns as f64 / blocks.max(1) as f64,
        index_bytes_per_entry: per_entry(stats.index_bytes),
        policy_bytes_per_entry: per_entry(stats.policy_bytes),
        eviction_mode: stats.eviction_mode.clone(),
    })
}

/// Time and bytes of one kind of load call.
#[derive(Debug, Default, Clone, Copy)]
struct Load {
    busy: Duration,
    bytes: u64,
    calls: u64,
}

impl Load {
    fn mb_per_s(&self) -> f64 {
        if self.busy.is_zero() {
            0.0
        } else {
            self.bytes as f64 / self.busy.as_secs_f64() / 1e6
        }
    }
}

fn hex(key: &[u8]) -> String {
    key.iter().map(|b| format!("{b:02x}")).collect()
}

impl TraceRow {
    pub fn header() -> String {
        format!(
            "{:>10} {:>10} {:>9} {:>8} {:>8} {:>8} {:>7} {:>8} {:>8} {:>9} {:>9} {:>9} {:>6} {:>8} {:>8} {:>7} {:>7} {:>10}",
            "memory",
            "tokens",
            "disk",
            "policy",
            "hit",
            "max",
            "of max",
            "mem hit",
            "disk hit",
            "mem MB/s",
            "disk MB/s",
            "ceil MB/s",
            "ratio",
            "p50 us",
            "p99 us",
            "ns/blk",
            "B/entry",
            "ends in"
        )
    }

    pub fn line(&self) -> String {
        format!(
            "{:>10} {:>10} {:>9} {:>8} {:>8.4} {:>8.4} {:>7.3} {:>8} {:>8} {:>9.0} {:>9.0} {:>9.0} {:>6.2} {:>8} {:>8} {:>7.0} {:>7.1} {:>10}",
            format_size(self.memory).replace(".00 ", ""),
            self.memory_tokens,
            if self.disk == 0 { "none".to_string() } else { format_size(self.disk).replace(".00 ", "") },
            self.eviction,
            self.token_hit_rate,
            self.max_token_hit_rate,
            self.fraction_of_max,
            self.memory_hits,
            self.disk_hits,
            self.memory_load_mb_per_s,
            self.disk_load_mb_per_s,
            self.baseline_mb_per_s,
            self.ratio,
            self.p50_us,
            self.p99_us,
            self.policy_ns_per_block,
            self.policy_bytes_per_entry,
            self.eviction_mode
        )
    }
}

pub fn write_outputs(args: &BenchArgs, rows: &[TraceRow]) -> BenchResult<()> {
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(rows)?)?;
        println!("wrote {}", path.display());
    }
    if let Some(path) = &args.plot {
        std::fs::write(path, svg(rows))?;
        println!("wrote {}", path.display());
    }
    if let Some(path) = &args.markdown {
        std::fs::write(path, markdown(rows))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

pub fn markdown(rows: &[TraceRow]) -> String {
    let mut out = String::from(
        "| memory | tokens in memory | disk | eviction | token hit rate | max | fraction of max | memory hits | disk hits | memory load MB/s | disk load MB/s | ceiling MB/s | disk / ceiling | p50 µs | p99 µs |\n\
         |---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {:.4} | {:.4} | {:.3} | {} | {} | {:.0} | {:.0} | {} | {} | {} | {} |",
            format_size(r.memory),
            r.memory_tokens,
            if r.disk == 0 {
                "none".to_string()
            } else {
                format_size(r.disk)
            },
            r.eviction,
            r.token_hit_rate,
            r.max_token_hit_rate,
            r.fraction_of_max,
            r.memory_hits,
            r.disk_hits,
            r.memory_load_mb_per_s,
            r.disk_load_mb_per_s,
            if r.baseline_mb_per_s > 0.0 {
                format!("{:.0}", r.baseline_mb_per_s)
            } else {
                "-".into()
            },
            if r.ratio > 0.0 {
                format!("{:.2}", r.ratio)
            } else {
                "-".into()
            },
            r.p50_us,
            r.p99_us
        );
    }
    out
}

/// Hit rate against memory capacity (in tokens), a line per policy and
/// disk setting, with the trace's maximum as a dashed line.
pub fn svg(rows: &[TraceRow]) -> String {
    let (w, h, m) = (640.0, 400.0, 70.0);
    let mut caps: Vec<u64> = rows.iter().map(|r| r.memory_tokens).collect();
    caps.sort_unstable();
    caps.dedup();
    let x_of = |tokens: u64| {
        let i = caps.iter().position(|&c| c == tokens).unwrap_or(0) as f64;
        m + if caps.len() > 1 {
            i / (caps.len() - 1) as f64 * w
        } else {
            w / 2.0
        }
    };
    let y_of = |rate: f64| m + h - rate * h;
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{}" font-family="sans-serif" font-size="12">"#,
        w + 2.0 * m + 160.0,
        h + 2.0 * m
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        out,
        r#"<text x="{m}" y="{}" font-size="14" font-weight="bold">token hit rate against memory capacity</text>"#,
        m - 25.0
    );
    let _ = writeln!(
        out,
        r##"<rect x="{m}" y="{m}" width="{w}" height="{h}" fill="none" stroke="#999"/>"##
    );
    for t in 0..=5 {
        let rate = t as f64 / 5.0;
        let y = y_of(rate);
        let _ = writeln!(
            out,
            r##"<line x1="{m}" y1="{y}" x2="{}" y2="{y}" stroke="#eee"/><text x="{}" y="{}" text-anchor="end">{rate:.1}</text>"##,
            m + w,
            m - 5.0,
            y + 4.0
        );
    }
    for &c in &caps {
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}" text-anchor="middle">{:.1}M</text>"#,
            x_of(c),
            m + h + 16.0,
            c as f64 / 1e6
        );
    }
    let _ = writeln!(
        out,
        r#"<text x="{}" y="{}" text-anchor="middle">tokens in the memory pool</text>"#,
        m + w / 2.0,
        m + h + 36.0
    );
    if let Some(max) = rows.first().map(|r| r.max_token_hit_rate) {
        let y = y_of(max);
        let _ = writeln!(
            out,
            r##"<line x1="{m}" y1="{y}" x2="{}" y2="{y}" stroke="#000" stroke-dasharray="6,4"/><text x="{}" y="{}">max {max:.3}</text>"##,
            m + w,
            m + w + 8.0,
            y + 4.0
        );
    }
    let colors = [
        "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b",
    ];
    let mut series: Vec<(u64, String)> =
        rows.iter().map(|r| (r.disk, r.eviction.clone())).collect();
    series.sort();
    series.dedup();
    for (s, (disk, policy)) in series.iter().enumerate() {
        let color = colors[s % colors.len()];
        let mut points: Vec<&TraceRow> = rows
            .iter()
            .filter(|r| r.disk == *disk && &r.eviction == policy)
            .collect();
        points.sort_by_key(|r| r.memory_tokens);
        let coords: Vec<String> = points
            .iter()
            .map(|r| format!("{:.1},{:.1}", x_of(r.memory_tokens), y_of(r.token_hit_rate)))
            .collect();
        let _ = writeln!(
            out,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"#,
            coords.join(" ")
        );
        for r in &points {
            let _ = writeln!(
                out,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{color}"/>"#,
                x_of(r.memory_tokens),
                y_of(r.token_hit_rate)
            );
        }
        let ly = m + 20.0 + s as f64 * 18.0;
        let label = format!(
            "{policy}, {}",
            if *disk == 0 {
                "memory only".to_string()
            } else {
                format!("+ {} disk", format_size(*disk))
            }
        );
        let _ = writeln!(
            out,
            r#"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="2"/><text x="{}" y="{}">{label}</text>"#,
            m + w + 8.0,
            m + w + 28.0,
            m + w + 32.0,
            ly + 4.0
        );
    }
    out.push_str("</svg>\n");
    out
}
