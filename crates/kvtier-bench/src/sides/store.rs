//! The store's side of the local cases: its own calls, with the values
//! and host buffers prepared before any timing.

use crate::case::Case;
use crate::data;
use crate::measure::{on_callers, shares, BenchResult, Measurement};
use kvtier::AlignedBuf;
use kvtier::{PutOptions, PutTier, Store};
use std::time::Instant;

/// A batch's keys and values, generated before the timing starts.
pub type PreparedBatch = (Vec<Vec<u8>>, Vec<Vec<u8>>);

/// The round's batches (keys and key-derived values), one share per caller
/// thread, generated before any timing.
pub fn prepare_round(case: &Case<'_>, round: std::ops::Range<u64>) -> Vec<Vec<PreparedBatch>> {
    shares(round, case.args.threads)
        .into_iter()
        .map(|share| {
            share
                .map(|b| {
                    let keys = case.keys("disk", b, u64::MAX);
                    let values = keys
                        .iter()
                        .map(|k| {
                            let mut v = vec![0u8; case.value_size as usize];
                            data::fill(k, &mut v);
                            v
                        })
                        .collect();
                    (keys, values)
                })
                .collect()
        })
        .collect()
}

/// Write-through puts of a round's prepared batches (`bytes` in all), then
/// `flush`, timed together on the wall clock, so the flusher's background
/// writes all fall inside the timing.
pub fn put_disk(
    store: &Store,
    prepared: &[Vec<PreparedBatch>],
    bytes: u64,
    m: &mut Measurement,
) -> BenchResult<()> {
    let started = Instant::now();
    let parts: Vec<Result<Measurement, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = prepared
            .iter()
            .map(|share| {
                scope.spawn(move || {
                    let mut calls = Measurement::new();
                    for (keys, values) in share {
                        let call = Instant::now();
                        let results = store.batch_put(keys, values);
                        calls.record_call(call.elapsed());
                        if let Some(e) = results.into_iter().find_map(Result::err) {
                            return Err(format!("put failed: {e}"));
                        }
                    }
                    Ok(calls)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("bench thread"))
            .collect()
    });
    store.flush()?;
    m.add_span(started.elapsed(), bytes);
    for part in parts {
        m.merge_calls(&part?);
    }
    Ok(())
}

/// One page-aligned host buffer per caller thread, each with room for a
/// batch, allocated and touched once per case (before any timing), as an
/// engine's pinned host buffers are.
pub fn host_buffers(case: &Case<'_>, callers: usize) -> Vec<AlignedBuf> {
    let slot = (case.value_size as usize).div_ceil(4096) * 4096;
    (0..callers)
        .map(|_| data::touched_buffer(slot * case.batch))
        .collect()
}

/// Reads the round's keys, `batch` per call, into the threads' host
/// buffers; only the calls are timed (the busiest thread's total), the
/// verification of every byte between them is not. Returns bytes verified.
pub fn get_round(
    store: &Store,
    case: &Case<'_>,
    tier: &str,
    round: std::ops::Range<u64>,
    modulo: u64,
    hosts: &mut [AlignedBuf],
    m: &mut Measurement,
) -> BenchResult<u64> {
    let slot = (case.value_size as usize).div_ceil(4096) * 4096;
    let verified = on_callers(round.clone(), hosts, m, case.bytes(&round), |b, host| {
        let keys = case.keys(tier, b, modulo);
        let call = Instant::now();
        let results = {
            let mut slices: Vec<&mut [u8]> = host.as_mut_slice().chunks_mut(slot).collect();
            store.batch_get_into(&keys, &mut slices)
        };
        let elapsed = call.elapsed();
        let mut verified = 0u64;
        for ((key, result), buffer) in keys.iter().zip(results).zip(host.as_slice().chunks(slot)) {
            let name = String::from_utf8_lossy(key);
            match result {
                Ok(Some(n)) if data::verify(key, &buffer[..n]) => verified += n as u64,
                Ok(Some(_)) => return Err(format!("wrong bytes for {name}")),
                Ok(None) => {
                    return Err(format!(
                        "miss for {name}: evicted or reclaimed? raise --memory or --disk"
                    ))
                }
                Err(e) => return Err(format!("get of {name} failed: {e}")),
            }
        }
        Ok((elapsed, verified))
    })?;
    Ok(verified)
}

/// Memory-only puts over a working set of `keys_in_set` keys, the round's
/// batches split among `--threads` callers; only the calls are timed (the
/// busiest thread's total, as for gets).
pub fn put_memory(
    store: &Store,
    case: &Case<'_>,
    round: std::ops::Range<u64>,
    keys_in_set: u64,
    m: &mut Measurement,
) -> BenchResult<()> {
    let options = PutOptions {
        tier: PutTier::MemoryOnly,
        ..Default::default()
    };
    let mut values: Vec<Vec<Vec<u8>>> = (0..case.args.threads)
        .map(|_| {
            (0..case.batch)
                .map(|_| vec![0u8; case.value_size as usize])
                .collect()
        })
        .collect();
    on_callers(
        round.clone(),
        &mut values,
        m,
        case.bytes(&round),
        |b, values| {
            let keys = case.keys("memory", b, keys_in_set);
            for (k, v) in keys.iter().zip(values.iter_mut()) {
                data::fill(k, v);
            }
            let call = Instant::now();
            let results = store.batch_put_with(&keys, values, &options);
            let elapsed = call.elapsed();
            if let Some(e) = results.into_iter().find_map(Result::err) {
                return Err(format!("memory put failed: {e}"));
            }
            Ok((elapsed, 0))
        },
    )?;
    Ok(())
}
