//! The disk cases: put to disk (puts, then `flush`, timed together) and
//! get from disk (after a reopen, so the memory pool is empty and every
//! read comes from disk), each against the device's sides: the ceiling,
//! the ceiling in the batch's memory and the shape-matched stream.

use super::{SizeCases, GET_ROUNDS, PUT_ROUNDS};
use crate::args::wants;
use crate::data;
use crate::measure::{on_callers, rounds, BenchResult, Measurement};
use crate::progress::Progress;
use crate::report::Row;
use crate::schedule::{self, Round};
use crate::sides::device;
use crate::sides::store::{get_round, host_buffers, prepare_round, put_disk, PreparedBatch};
use kvtier::{format_size, Store};

/// Runs the wanted disk cases of one value size, appending their rows.
pub(super) fn run(
    size: &SizeCases<'_>,
    progress: &mut Progress,
    rows: &mut Vec<Row>,
) -> BenchResult<()> {
    let (args, value_size, store_dir) = (size.args, size.value_size, &size.store_dir);
    // One store per batch count, and a twin written with the same
    // calls in the same rounds: two copies of the case's data with
    // the same layout, write pattern and age, on different blocks.
    // The get cases read one with the store and the other raw,
    // swapping every round.
    let case_config = |batch: usize| size.config_in(store_dir.join(format!("x{batch}")));
    let twin_config = |batch: usize| size.config_in(store_dir.join(format!("x{batch}-twin")));
    // The write ceiling: a size x depth sweep on a scratch file,
    // whose best shape is re-measured in every put round.
    let sweep_budget = (2 * args.bytes_per_case).max(16 << 20);
    let write_ceiling = if wants(args, "put", "disk") {
        progress.note(&format!("write ceiling sweep {}", format_size(value_size)));
        device::sweep_writes(&size.scratch("ceiling-sweep"), sweep_budget)?
    } else {
        device::Shape {
            size: 4 << 20,
            depth: 16,
        }
    };
    for &batch in &args.batches {
        let case = size.case(batch);
        progress.case(
            &format!("put disk {} x{batch}", format_size(value_size)),
            case.rounds(PUT_ROUNDS).len(),
        );
        let store = Store::open(case_config(batch))?;
        let twin = Store::open(twin_config(batch))?;
        let stats = store.stats();
        let engine_name = stats.io_engine;
        if !stats.direct_io {
            return Err("the store is not using O_DIRECT: the bench refuses to report disk cases through the page cache".into());
        }
        let qualified = |key: &[u8]| store.default_namespace().qualify(key).len();
        let mut shape_writer = device::ShapeWriter::create(
            &size.scratch("shape"),
            store.config().configured_io_depth() as usize,
            store.config().configured_flush_batch_bytes(),
        )?;
        let mut ceiling_writer =
            device::CeilingWriter::create(&size.scratch("ceiling"), write_ceiling, 0)?;
        let mut landed_writer = device::CeilingWriter::create(
            &size.scratch("ceiling-batch-memory"),
            write_ceiling,
            value_size as usize * batch,
        )?;
        let (mut put, mut shape, mut ceiling, mut landed) = (
            Measurement::new(),
            Measurement::new(),
            Measurement::new(),
            Measurement::new(),
        );
        // The twin and the raw sides get the same prepared values,
        // laid out before any timing.
        let mut store_side = |_: &Round, (prepared, bytes): &(Vec<Vec<PreparedBatch>>, u64)| {
            put_disk(&store, prepared, *bytes, &mut put)?;
            put_disk(&twin, prepared, *bytes, &mut Measurement::new())
        };
        let mut shape_side = |_: &Round, (prepared, bytes): &(Vec<Vec<PreparedBatch>>, u64)| {
            let flat: Vec<(usize, &[u8])> = prepared
                .iter()
                .flatten()
                .flat_map(|(keys, values)| {
                    keys.iter()
                        .zip(values)
                        .map(|(k, v)| (qualified(k), v.as_slice()))
                })
                .collect();
            // Laid out untimed: `write` times only the writes.
            let flushes = shape_writer.prepare(&flat);
            Ok(shape_writer.write(&flushes, *bytes, &mut shape)?)
        };
        let mut ceiling_side = |_: &Round, (_, bytes): &(Vec<Vec<PreparedBatch>>, u64)| {
            Ok(ceiling_writer.write(*bytes, &mut ceiling)?)
        };
        let mut landed_side = |_: &Round, (_, bytes): &(Vec<Vec<PreparedBatch>>, u64)| {
            Ok(landed_writer.write(*bytes, &mut landed)?)
        };
        schedule::run_rounds(
            case.rounds(PUT_ROUNDS),
            1,
            |round| {
                progress.round_done();
                Ok((
                    prepare_round(&case, round.batches.clone()),
                    case.bytes(&round.batches),
                ))
            },
            &mut [
                &mut store_side,
                &mut shape_side,
                &mut ceiling_side,
                &mut landed_side,
            ],
        )?;
        store.close()?;
        twin.close()?;
        drop((twin, shape_writer, ceiling_writer, landed_writer));
        if wants(args, "put", "disk") {
            let row = Row::against_device(
                "put",
                value_size,
                batch,
                &put,
                Some(&shape),
                &ceiling,
                Some(&landed),
                write_ceiling.to_string(),
                engine_name,
                0,
            );
            progress.row(&row);
            rows.push(row);
        }
    }
    if wants(args, "get", "disk") {
        get_cases(size, progress, rows, "disk", |batch| Copies {
            read: [case_config(batch), twin_config(batch)],
            region_dirs: [
                case_config(batch).data_dir().to_path_buf(),
                twin_config(batch).data_dir().to_path_buf(),
            ],
        })?;
    }
    Ok(())
}

/// The two copies a get case reads: the stores that read them (in the
/// disk cases the stores that wrote them; in the shared cases other nodes'
/// stores, which find them in a shared directory) and the directories
/// holding their region files, which the raw sides read.
pub(super) struct Copies {
    pub read: [kvtier::Config; 2],
    pub region_dirs: [std::path::PathBuf; 2],
}

/// The get cases of one value size over the copies `copies(batch)` names,
/// each against the device's sides on the same files: the ceiling (a size
/// x depth sweep), the ceiling in the batch's memory and the shape-matched
/// stream. Rows are reported under `tier`.
pub(super) fn get_cases(
    size: &SizeCases<'_>,
    progress: &mut Progress,
    rows: &mut Vec<Row>,
    tier: &str,
    copies: impl Fn(usize) -> Copies,
) -> BenchResult<()> {
    let (args, value_size) = (size.args, size.value_size);
    let sweep_budget = (2 * args.bytes_per_case).max(16 << 20);
    {
        // The read ceiling: a sweep over the first case's two
        // copies (the same kind of files every case reads).
        progress.note(&format!("read ceiling sweep {}", format_size(value_size)));
        let first = args.batches[0];
        let read_ceiling = {
            let dirs = copies(first).region_dirs;
            let set = device::FileSet::regions_of(&[&dirs[0], &dirs[1]])?;
            device::sweep_reads(&set, sweep_budget)?
        };
        for &batch in &args.batches {
            let case = size.case(batch);
            progress.case(
                &format!("get disk {} x{batch}", format_size(value_size)),
                case.rounds(GET_ROUNDS).len(),
            );
            // Reopen both copies: the pools start empty, so every get
            // reads the disk. In even rounds the store reads its copy
            // and the raw sides the twin's files; in odd rounds the
            // other way round. Each side reads half of each copy, so
            // where the host placed each copy (which on this disk
            // decides its speed) weighs the same on every side.
            let Copies { read, region_dirs } = copies(batch);
            let mut stores = Vec::new();
            let mut sets = Vec::new();
            let mut located = Vec::new();
            let keys = case.batches * batch as u64;
            for (copy, region_dir) in read.iter().zip(&region_dirs) {
                let store = Store::open(copy.clone())?;
                if !store.stats().direct_io {
                    return Err("the store is not using O_DIRECT: the bench refuses to report disk cases through the page cache".into());
                }
                located.push(device::locations(
                    &store,
                    (0..keys).map(|i| data::key("disk", value_size, batch, i)),
                )?);
                sets.push(device::FileSet::regions_of(&[region_dir])?);
                stores.push(store);
            }
            let engine_name = stores[0].stats().io_engine;
            let depth = stores[0].config().configured_io_depth() as usize;
            let shapes: Vec<device::ShapeReader<'_>> = sets
                .iter()
                .zip(&located)
                .map(|(set, at)| device::ShapeReader::new(set, at, depth, args.read_piece as usize))
                .collect();
            let slot = (value_size as usize).div_ceil(4096) * 4096;
            let mut ceilings = sets
                .iter()
                .map(|set| device::CeilingReader::new(set, read_ceiling, 0))
                .collect::<std::io::Result<Vec<_>>>()?;
            // The ceiling reads each copy from its start; this side
            // from its middle, so the two never read the same blocks.
            let mut landed_readers = sets
                .iter()
                .map(|set| {
                    let reader = device::CeilingReader::new(set, read_ceiling, slot * batch)?;
                    Ok(reader.starting_at(set.halfway()))
                })
                .collect::<std::io::Result<Vec<_>>>()?;
            let in_flight = args.threads * args.pipeline;
            let mut callers = (0..in_flight)
                .map(|_| device::ShapeCaller::new(depth, slot * batch))
                .collect::<std::io::Result<Vec<_>>>()?;
            let (mut get, mut shape, mut ceiling, mut landed) = (
                Measurement::new(),
                Measurement::new(),
                Measurement::new(),
                Measurement::new(),
            );
            let mut verified = 0;
            let mut shape_verified = 0;
            let mut hosts = host_buffers(&case, in_flight);
            let round_list = rounds(
                case.batches,
                GET_ROUNDS.min(case.batches / in_flight as u64).max(1),
            );
            progress.set_rounds(round_list.len());
            // In even rounds the store reads its copy and the raw
            // sides the twin's files; in odd rounds the other way
            // round. An order is held for two rounds, so each side
            // reads each copy from each place in the order.
            let store_copy = |r: &Round| r.index % 2;
            let raw_copy = |r: &Round| 1 - r.index % 2;
            let mut store_side = |r: &Round, (): &()| {
                verified += get_round(
                    &stores[store_copy(r)],
                    &case,
                    "disk",
                    r.batches.clone(),
                    u64::MAX,
                    &mut hosts,
                    &mut get,
                )?;
                Ok(())
            };
            let mut shape_side = |r: &Round, (): &()| {
                let reader = &shapes[raw_copy(r)];
                shape_verified += on_callers(
                    r.batches.clone(),
                    &mut callers,
                    &mut shape,
                    case.bytes(&r.batches),
                    |b, caller| {
                        let first = b * batch as u64;
                        reader.read_batch(first..first + batch as u64, caller)
                    },
                )?;
                Ok(())
            };
            let mut ceiling_side = |r: &Round, (): &()| {
                Ok(ceilings[raw_copy(r)].read(case.bytes(&r.batches), &mut ceiling)?)
            };
            let mut landed_side = |r: &Round, (): &()| {
                let reader = &mut landed_readers[raw_copy(r)];
                Ok(reader.read(case.bytes(&r.batches), &mut landed)?)
            };
            schedule::run_rounds(
                round_list,
                2,
                |_| {
                    progress.round_done();
                    Ok(())
                },
                &mut [
                    &mut store_side,
                    &mut shape_side,
                    &mut ceiling_side,
                    &mut landed_side,
                ],
            )?;
            if stores.iter().any(|s| s.stats().memory_hits > 0) {
                return Err("a disk get was served from memory: the case is invalid".into());
            }
            if tier == "shared" && stores.iter().map(|s| s.stats().shared_reads).sum::<u64>() == 0 {
                return Err(
                    "a shared get was not served from another writer's files: the case is invalid"
                        .into(),
                );
            }
            device::check_same_verified(shape_verified, verified)?;
            let mut row = Row::against_device(
                "get",
                value_size,
                batch,
                &get,
                Some(&shape),
                &ceiling,
                Some(&landed),
                read_ceiling.to_string(),
                engine_name,
                verified,
            );
            row.pipeline = (args.pipeline > 1).then_some(args.pipeline);
            row.tier = tier.to_string();
            progress.row(&row);
            rows.push(row);
            drop((ceilings, landed_readers, shapes));
            for store in stores {
                store.close()?;
            }
            for copy in &read {
                let _ = std::fs::remove_dir_all(copy.data_dir());
            }
        }
    }
    Ok(())
}
