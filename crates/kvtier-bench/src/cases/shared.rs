//! The seed's workflow on a shared directory: a prefill node (B) puts and
//! flushes blocks into its log on a file system every node mounts; a
//! decode node (C), another store with its own data directory reaching the
//! same directory through its own mount, finds them by following B's
//! records and reads them straight from B's files. The get rows compare
//! C's reads with raw reads of the same files through C's mount, in the
//! same rounds (the disk get cases' sides).

use super::disk::{get_cases, Copies};
use super::{SizeCases, PUT_ROUNDS};
use crate::report::Row;
use crate::sides::store::{prepare_round, put_disk};
use crate::{BenchResult, Measurement, Progress};
use kvtier::{format_size, Store};
use std::collections::HashMap;
use std::path::PathBuf;

/// Runs the shared get cases of one value size; `mounts` are one shared
/// directory as B's mount and as C's mount show it.
pub(super) fn run(
    size: &SizeCases<'_>,
    mounts: (&PathBuf, &PathBuf),
    progress: &mut Progress,
    rows: &mut Vec<Row>,
) -> BenchResult<()> {
    let args = size.args;
    let dir = |side: &str, batch: usize, copy: &str| {
        size.store_dir.join(format!("{side}-x{batch}{copy}"))
    };
    let shared = |mount: &PathBuf, batch: usize, copy: &str| mount.join(format!("x{batch}{copy}"));
    let mut writers: HashMap<(usize, &str), String> = HashMap::new();
    for &batch in &args.batches {
        let case = size.case(batch);
        progress.note(&format!(
            "prefill on B: {} x{batch}, {} batches",
            format_size(size.value_size),
            case.batches
        ));
        for copy in ["", "-twin"] {
            let config = size
                .config_in(dir("b", batch, copy))
                .shared_dir(shared(mounts.0, batch, copy));
            let store = Store::open(config)?;
            for round in case.rounds(PUT_ROUNDS) {
                let bytes = case.bytes(&round);
                put_disk(
                    &store,
                    &prepare_round(&case, round),
                    bytes,
                    &mut Measurement::new(),
                )?;
            }
            writers.insert((batch, copy), store.node_id().to_string());
            store.close()?;
        }
    }
    let result = get_cases(size, progress, rows, "shared", |batch| {
        let copy_of = |copy: &'static str| {
            let config = size
                .config_in(dir("c", batch, copy))
                .shared_dir(shared(mounts.1, batch, copy));
            // B's log as C's mount shows it: what the raw sides read.
            let b_log = shared(mounts.1, batch, copy)
                .join("nodes")
                .join(&writers[&(batch, copy)]);
            (config, b_log)
        };
        let (one, one_log) = copy_of("");
        let (two, two_log) = copy_of("-twin");
        Copies {
            read: [one, two],
            region_dirs: [one_log, two_log],
        }
    });
    for &batch in &args.batches {
        for copy in ["", "-twin"] {
            let _ = std::fs::remove_dir_all(dir("b", batch, copy));
            let _ = std::fs::remove_dir_all(shared(mounts.0, batch, copy));
        }
    }
    result
}
