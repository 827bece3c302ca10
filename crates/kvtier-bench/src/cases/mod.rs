//! The local cases: for each value size and batch count, put to disk, get
//! from disk, put to memory and get from memory. A case is built from
//! sides (`sides`) run on the one round scheduler (`schedule`); this
//! module owns what the cases of a value size share (the store's
//! configuration, scratch paths, the batch arithmetic) and their order.

mod disk;
mod memory;
mod shared;

use super::report::Row;
use crate::args::{wants, BenchArgs};
use crate::case::{batches_for, Case};
use crate::index;
use crate::measure::BenchResult;
use crate::progress::Progress;
use kvtier::parse_size;
use kvtier::{Config, EvictionPolicy, IoEngineKind};
use std::path::PathBuf;

/// Rounds per put case: each ends with a flush (and the baseline's
/// fdatasync), so they stay few and long.
pub(crate) const PUT_ROUNDS: u64 = 8;
/// Rounds per get case: this machine's disk switches between throughput
/// modes every few seconds, so store and baseline alternate finely (a batch
/// or a few per round) to meet the same conditions.
pub(crate) const GET_ROUNDS: u64 = 64;

/// What every case of one value size shares.
struct SizeCases<'a> {
    args: &'a BenchArgs,
    value_size: u64,
    memory: u64,
    disk: u64,
    eviction: EvictionPolicy,
    engine: IoEngineKind,
    store_dir: PathBuf,
}

impl<'a> SizeCases<'a> {
    /// The store's configuration for a data directory.
    fn config_in(&self, dir: PathBuf) -> Config {
        let args = self.args;
        Config::new(dir)
            .memory_capacity(self.memory)
            .disk_capacity(self.disk)
            .eviction(self.eviction)
            .max_value_size(self.value_size)
            .io_engine(self.engine)
            .io_registration(args.io_registration)
            .io_depth(args.io_depth)
            .read_piece(args.read_piece)
    }

    /// A scratch file for a raw side.
    fn scratch(&self, name: &str) -> PathBuf {
        self.args
            .data_dir
            .join(format!("{name}-{}.scratch", self.value_size))
    }

    fn case(&self, batch: usize) -> Case<'a> {
        Case {
            args: self.args,
            value_size: self.value_size,
            batch,
            batches: batches_for(self.args.bytes_per_case, self.value_size, batch),
        }
    }
}

/// Runs every wanted case, then the index and reopen cases.
pub fn run_cases(args: &BenchArgs, engine: IoEngineKind) -> BenchResult<Vec<Row>> {
    let memory = args.memory.first().copied().unwrap_or(2 << 30);
    let disk = match args.disk.first() {
        Some(text) => parse_size(text)?,
        None => 16 << 30,
    };
    let eviction = match args.eviction.first().map(String::as_str) {
        None | Some("default") => EvictionPolicy::default(),
        Some(name) => EvictionPolicy::parse(name)?,
    };
    let mut rows = Vec::new();
    let cases_per_size = [
        ("put", "disk"),
        ("get", "disk"),
        ("put", "memory"),
        ("get", "memory"),
        ("get", "shared"),
    ]
    .iter()
    .filter(|(op, tier)| wants(args, op, tier))
    .count();
    let mut progress = Progress::new(args.value_sizes.len() * args.batches.len() * cases_per_size);
    println!("{}", Row::header());
    let store_dir = args.data_dir.join("store");
    for &value_size in &args.value_sizes {
        let _ = std::fs::remove_dir_all(&store_dir);
        let size = SizeCases {
            args,
            value_size,
            memory,
            disk,
            eviction,
            engine,
            store_dir: store_dir.clone(),
        };
        if wants(args, "put", "disk") || wants(args, "get", "disk") {
            disk::run(&size, &mut progress, &mut rows)?;
            let _ = std::fs::remove_dir_all(&store_dir);
        }
        if wants(args, "put", "memory") || wants(args, "get", "memory") {
            memory::run(&size, &mut progress, &mut rows)?;
            let _ = std::fs::remove_dir_all(&store_dir);
        }
        if wants(args, "get", "shared") {
            let [b, c] = &args.shared_mounts[..] else {
                return Err("the shared tier needs --shared-mounts B,C".into());
            };
            shared::run(&size, (b, c), &mut progress, &mut rows)?;
            let _ = std::fs::remove_dir_all(&store_dir);
        }
    }
    progress.finish();
    if args.index_entries > 0 {
        let row = index::exists_case(args.index_entries, &store_dir)?;
        println!("{}", row.line());
        rows.push(row);
    }
    for &entries in &args.follow_entries {
        rows.extend(index::follow_case(&store_dir, entries, engine)?);
    }
    if args.reopen_entries > 0 {
        for row in index::reopen_case(&store_dir, args.reopen_entries, engine)? {
            println!("{}", row.line());
            rows.push(row);
        }
        let _ = std::fs::remove_dir_all(&store_dir);
    }
    Ok(rows)
}
