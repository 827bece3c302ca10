//! The seed's workflow on a shared directory: a prefill node (B) puts and
//! flushes blocks into its log on a file system every node mounts; a
//! decode node (C), another store with its own data directory reaching the
//! same directory through its own mount, finds them by following B's
//! records and reads them straight from B's files. The get rows compare
//! C's reads with raw reads of the same files through C's mount, in the
//! same rounds: first both O_DIRECT (C's `shared_read_mode` direct, against
//! the disk get cases' sides: the engine against the raw device path),
//! then as a user runs it (C's default read mode for the mount) against a
//! plain program's buffered reads of the same values, cold (page cache
//! copies dropped before each side) and warm (read again at once).

use super::disk::{get_cases, Copies};
use super::{SizeCases, PUT_ROUNDS};
use crate::data;
use crate::measure::{on_callers, BenchResult, Measurement};
use crate::progress::Progress;
use crate::report::Row;
use crate::sides::device;
use crate::sides::plain::PlainReader;
use crate::sides::store::{get_round, host_buffers, prepare_round, put_disk};
use kvtier::{format_size, Config, SharedReadMode, Store};
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
                .shared_dir(shared(mounts.1, batch, copy))
                .shared_read_mode(SharedReadMode::Direct);
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
    let result = result.and_then(|()| {
        plain_cases(size, progress, rows, |batch| {
            size.config_in(dir("c-plain", batch, ""))
                .shared_dir(shared(mounts.1, batch, ""))
        })
    });
    for &batch in &args.batches {
        let _ = std::fs::remove_dir_all(dir("c-plain", batch, ""));
        for copy in ["", "-twin"] {
            let _ = std::fs::remove_dir_all(dir("b", batch, copy));
            let _ = std::fs::remove_dir_all(shared(mounts.0, batch, copy));
        }
    }
    result
}

/// The user's view: C in its default read mode for the mount against a
/// plain program's buffered reads of the same values through the same
/// mount, batch by batch: each side reads a batch cold (its page cache
/// copies dropped just before), then each reads it again warm. The batch
/// is read once untimed before, so the file system's own cache (JuiceFS's
/// local block cache) is warm for whichever side reads first; which side
/// does still alternates by batch.
fn plain_cases(
    size: &SizeCases<'_>,
    progress: &mut Progress,
    rows: &mut Vec<Row>,
    config: impl Fn(usize) -> Config,
) -> BenchResult<()> {
    let value_size = size.value_size;
    for &batch in &size.args.batches {
        let case = size.case(batch);
        progress.case(
            &format!(
                "get shared (plain reads) {} x{batch}",
                format_size(value_size)
            ),
            case.batches as usize,
        );
        let store = Store::open(config(batch))?;
        store.follow_shared_now();
        let keys = case.batches * batch as u64;
        let plain = PlainReader::new(
            device::locations(
                &store,
                (0..keys).map(|i| data::key("disk", value_size, batch, i)),
            )?,
            batch,
        )?;
        let slot = (value_size as usize).div_ceil(4096) * 4096;
        let mut hosts = host_buffers(&case, 1);
        let mut plain_hosts = host_buffers(&case, 1);
        let (mut store_cold, mut plain_cold, mut store_warm, mut plain_warm) = (
            Measurement::new(),
            Measurement::new(),
            Measurement::new(),
            Measurement::new(),
        );
        let (mut verified_cold, mut verified_warm) = (0u64, 0u64);
        for b in 0..case.batches {
            let one = b..b + 1;
            let bytes = case.bytes(&one);
            let mut store_side = |m: &mut Measurement| {
                get_round(&store, &case, "disk", one.clone(), u64::MAX, &mut hosts, m)
            };
            let mut plain_side = |m: &mut Measurement| {
                on_callers(one.clone(), &mut plain_hosts, m, bytes, |b, host| {
                    plain.read_batch(b, host.as_mut_slice(), slot)
                })
            };
            // Read once untimed first, so that JuiceFS's own block cache (a
            // local disk cache the page cache's drop does not empty) holds
            // the batch for both sides: "cold" is the page cache cold,
            // whoever reads first. Without it, a case of one batch always
            // had the store fetch from the object store what the plain
            // program then found in that cache.
            plain_side(&mut Measurement::new())?;
            if b % 2 == 0 {
                plain.drop_cached(b);
                verified_cold += store_side(&mut store_cold)?;
                plain.drop_cached(b);
                plain_side(&mut plain_cold)?;
                verified_warm += store_side(&mut store_warm)?;
                plain_side(&mut plain_warm)?;
            } else {
                plain.drop_cached(b);
                plain_side(&mut plain_cold)?;
                plain.drop_cached(b);
                verified_cold += store_side(&mut store_cold)?;
                plain_side(&mut plain_warm)?;
                verified_warm += store_side(&mut store_warm)?;
            }
            progress.round_done();
        }
        let stats = store.stats();
        if stats.memory_hits > 0 || stats.shared_reads == 0 {
            return Err(format!(
                "a shared get was not read from another writer's files ({} memory hits, {} \
                 shared reads): the case is invalid",
                stats.memory_hits, stats.shared_reads
            )
            .into());
        }
        let mode = if stats.shared_buffered_regions > 0 {
            "buffered"
        } else {
            "O_DIRECT"
        };
        for (tier, store_side, plain_side, verified) in [
            ("shared-cold", &store_cold, &plain_cold, verified_cold),
            ("shared-warm", &store_warm, &plain_warm, verified_warm),
        ] {
            let mut row = Row::new(
                "get",
                tier,
                value_size,
                batch,
                store_side,
                plain_side,
                &format!("plain buffered pread per value; the store read {mode}"),
                stats.io_engine,
                verified,
            );
            row.tier = tier.to_string();
            progress.row(&row);
            rows.push(row);
        }
        store.close()?;
    }
    Ok(())
}
