//! The memory cases: memory-only puts and gets from the pool, each
//! against memcpy of the same bytes.

use super::{SizeCases, GET_ROUNDS, PUT_ROUNDS};
use crate::args::wants;
use crate::data;
use crate::measure::{BenchResult, Measurement};
use crate::progress::Progress;
use crate::report::Row;
use crate::schedule::{self, Round};
use crate::sides::memcpy::Memcpy;
use crate::sides::store::{get_round, host_buffers, put_memory};
use kvtier::{format_size, Store};

/// Runs the wanted memory cases of one value size, appending their rows.
pub(super) fn run(
    size: &SizeCases<'_>,
    progress: &mut Progress,
    rows: &mut Vec<Row>,
) -> BenchResult<()> {
    let (args, value_size, memory) = (size.args, size.value_size, size.memory);
    let config = size.config_in(size.store_dir.clone());
    // Memory cases need no disk tier; each case removes its keys
    // afterwards so the next starts with an empty pool.
    let store = Store::open(config.clone().disk_capacity(0))?;
    let engine_name = store.stats().io_engine;
    for &batch in &args.batches {
        if value_size * batch as u64 > memory / 2 {
            eprintln!(
                "skipping memory cases for {} x{batch}: a batch needs more than half of the {} pool",
                format_size(value_size),
                format_size(memory)
            );
            continue;
        }
        let case = size.case(batch);
        // A working set of at most half the pool, cycled: each put
        // replaces an earlier value, so the pool never fills.
        let keys_in_set = (memory / 2 / value_size / batch as u64).max(1) * batch as u64;
        let mut memcpy = Memcpy::new(
            value_size as usize,
            batch,
            keys_in_set.min(case.batches * batch as u64) as usize,
            args.threads,
        );
        progress.case(
            &format!("put memory {} x{batch}", format_size(value_size)),
            case.rounds(PUT_ROUNDS).len(),
        );
        let (mut put, mut base) = (Measurement::new(), Measurement::new());
        schedule::run_rounds(
            case.rounds(PUT_ROUNDS),
            1,
            |_| {
                progress.round_done();
                Ok(())
            },
            &mut [
                &mut |r: &Round, (): &()| {
                    put_memory(&store, &case, r.batches.clone(), keys_in_set, &mut put)
                },
                &mut |r: &Round, (): &()| {
                    memcpy.run_put(r.batches.clone(), &mut base);
                    Ok(())
                },
            ],
        )?;
        if wants(args, "put", "memory") {
            let row = Row::new(
                "put",
                "memory",
                value_size,
                batch,
                &put,
                &base,
                "memcpy",
                engine_name,
                0,
            );
            progress.row(&row);
            rows.push(row);
        }
        if wants(args, "get", "memory") {
            progress.case(
                &format!("get memory {} x{batch}", format_size(value_size)),
                case.rounds(GET_ROUNDS).len(),
            );
            let (mut get, mut base) = (Measurement::new(), Measurement::new());
            let mut verified = 0;
            let resident = keys_in_set.min(case.batches * batch as u64);
            let mut hosts = host_buffers(&case, args.threads);
            schedule::run_rounds(
                case.rounds(GET_ROUNDS),
                1,
                |_| {
                    progress.round_done();
                    Ok(())
                },
                &mut [
                    &mut |r: &Round, (): &()| {
                        verified += get_round(
                            &store,
                            &case,
                            "memory",
                            r.batches.clone(),
                            resident,
                            &mut hosts,
                            &mut get,
                        )?;
                        Ok(())
                    },
                    &mut |r: &Round, (): &()| {
                        memcpy.run(r.batches.clone(), &mut base);
                        Ok(())
                    },
                ],
            )?;
            if store.stats().disk_hits > 0 {
                return Err("a memory get was served from disk: the case is invalid".into());
            }
            let row = Row::new(
                "get",
                "memory",
                value_size,
                batch,
                &get,
                &base,
                "memcpy",
                engine_name,
                verified,
            );
            progress.row(&row);
            rows.push(row);
        }
        for i in 0..keys_in_set {
            store.remove(data::key("memory", value_size, batch, i))?;
        }
    }
    store.close()?;
    Ok(())
}
