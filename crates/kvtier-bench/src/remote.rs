//! `kvtier bench --connect URL`: the same cases through the client, against
//! a running server. Over `unix://` values move through the registered
//! shared buffer (the engine's zero-copy path); over `tcp://` they travel
//! in the frames. Baselines, measured in this process: memcpy (unix memory
//! rows), a raw TCP loopback stream (tcp memory rows), raw O_DIRECT reads
//! and writes on a scratch file (disk rows).

use super::cases::{GET_ROUNDS, PUT_ROUNDS};
use super::report::Row;
use super::schedule::{self, Round};
use super::sides::device;
use super::sides::memcpy::Memcpy;
use super::sides::tcp::TcpStreamBaseline;
use crate::args::BenchArgs;
use crate::data;
use crate::measure::{rounds, BenchResult, Measurement};
use kvtier::format_size;
use kvtier::{PutOptions, PutTier};
use kvtier_client::{Client, ClientOptions};
use std::time::Instant;

struct Remote {
    client: Client,
    unix: bool,
    value_size: usize,
    run: String,
}

impl Remote {
    fn key(&self, tier: &str, batch: usize, i: u64) -> Vec<u8> {
        format!("bench/{}/{tier}/{}/{batch}/{i}", self.run, self.value_size).into_bytes()
    }

    fn slot(&self) -> usize {
        self.value_size.div_ceil(4096) * 4096
    }

    /// Generates the values of `keys` into value places `first..` (of the
    /// shared buffer on unix, of `scratch` over TCP), untimed, for `put`.
    fn stage(
        &mut self,
        keys: &[Vec<u8>],
        first: usize,
        scratch: &mut [Vec<u8>],
    ) -> BenchResult<()> {
        let (slot, value_size) = (self.slot(), self.value_size);
        if self.unix {
            let shm = self
                .client
                .registered_buffer()
                .ok_or("no registered buffer")?;
            for (i, key) in keys.iter().enumerate() {
                let at = (first + i) * slot;
                data::fill(key, &mut shm[at..at + value_size]);
            }
        } else {
            for (key, value) in keys.iter().zip(&mut scratch[first..]) {
                data::fill(key, value);
            }
        }
        Ok(())
    }

    /// Puts one batch whose values `stage` placed at value places
    /// `first..`; only the client call is timed.
    fn put(
        &mut self,
        keys: &[Vec<u8>],
        first: usize,
        options: &PutOptions,
        scratch: &[Vec<u8>],
        m: &mut Measurement,
    ) -> BenchResult<()> {
        let slot = self.slot();
        let results = if self.unix {
            let ranges: Vec<(u64, u64)> = (0..keys.len())
                .map(|i| (((first + i) * slot) as u64, self.value_size as u64))
                .collect();
            let call = Instant::now();
            let results = self.client.batch_put_registered(keys, &ranges, options)?;
            let elapsed = call.elapsed();
            m.record_call(elapsed);
            m.add_span(elapsed, (keys.len() * self.value_size) as u64);
            results
        } else {
            let call = Instant::now();
            let results =
                self.client
                    .batch_put_with(keys, &scratch[first..first + keys.len()], options)?;
            let elapsed = call.elapsed();
            m.record_call(elapsed);
            m.add_span(elapsed, (keys.len() * self.value_size) as u64);
            results
        };
        if let Some(e) = results.into_iter().find_map(Result::err) {
            return Err(format!("remote put failed: {e}").into());
        }
        Ok(())
    }

    /// Gets one batch and verifies it (untimed); returns bytes verified.
    fn get(
        &mut self,
        keys: &[Vec<u8>],
        scratch: &mut [Vec<u8>],
        m: &mut Measurement,
    ) -> BenchResult<u64> {
        let slot = self.slot();
        let value_size = self.value_size;
        let mut verified = 0;
        if self.unix {
            let ranges: Vec<(u64, u64)> = (0..keys.len())
                .map(|i| ((i * slot) as u64, slot as u64))
                .collect();
            let call = Instant::now();
            let results = self.client.batch_get_registered(keys, &ranges)?;
            let elapsed = call.elapsed();
            m.record_call(elapsed);
            m.add_span(elapsed, (keys.len() * value_size) as u64);
            let shm = self
                .client
                .registered_buffer()
                .ok_or("no registered buffer")?;
            for (i, (key, result)) in keys.iter().zip(results).enumerate() {
                check(key, result, &shm[i * slot..i * slot + value_size])?;
                verified += value_size as u64;
            }
        } else {
            let call = Instant::now();
            let results = {
                let mut slices: Vec<&mut [u8]> = scratch
                    .iter_mut()
                    .take(keys.len())
                    .map(|v| &mut v[..])
                    .collect();
                self.client.batch_get_into(keys, &mut slices)?
            };
            let elapsed = call.elapsed();
            m.record_call(elapsed);
            m.add_span(elapsed, (keys.len() * value_size) as u64);
            for ((key, result), buf) in keys.iter().zip(results).zip(scratch.iter()) {
                check(key, result, &buf[..value_size])?;
                verified += value_size as u64;
            }
        }
        Ok(verified)
    }
}

fn check(key: &[u8], result: kvtier::Result<Option<usize>>, bytes: &[u8]) -> BenchResult<()> {
    let name = String::from_utf8_lossy(key);
    match result {
        Ok(Some(n)) if n == bytes.len() && data::verify(key, bytes) => Ok(()),
        Ok(Some(_)) => Err(format!("wrong bytes for {name}").into()),
        Ok(None) => Err(format!("miss for {name}: raise the server's capacities").into()),
        Err(e) => Err(format!("get of {name} failed: {e}").into()),
    }
}

pub fn run(args: &BenchArgs, url: &str) -> BenchResult<Vec<Row>> {
    let unix = url.starts_with("unix://");
    let max_batch = *args.batches.iter().max().unwrap_or(&1);
    let max_value = *args.value_sizes.iter().max().unwrap_or(&1) as usize;
    // Room for the values of a disk put round (staged before its clock).
    let shm_size = if unix {
        args.value_sizes
            .iter()
            .map(|&v| round_places(args, v) * (v as usize).div_ceil(4096) * 4096)
            .max()
            .unwrap_or(0)
    } else {
        0
    };
    let options = ClientOptions {
        shm_size,
        auth_token: std::env::var("KVTIER_AUTH_TOKEN").ok(),
        route: args.route,
        ..Default::default()
    };
    let mut client = Client::connect_with(url, options)?;
    let stats = client.stats()?;
    let memory = stats["store"]["memory_capacity"].as_u64().unwrap_or(0);
    let path = if unix {
        "unix (registered shared buffer)"
    } else if args.route {
        "tcp, the client sending each key to its owners"
    } else {
        "tcp"
    };
    println!(
        "connected to {url} ({path}); server memory pool {}",
        format_size(memory)
    );
    let run_id = format!(
        "{:x}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_nanos()
    );
    std::fs::create_dir_all(&args.data_dir)?;
    let mut rows = Vec::new();
    println!("{}", Row::header());
    let engine = stats["store"]["io_engine"]
        .as_str()
        .unwrap_or("-")
        .to_string();
    // A routing client talks to every member at once.
    let streams = if args.route {
        let view = client.cluster_view()?;
        view["members"].as_array().map_or(1, |m| m.len().max(1))
    } else {
        1
    };
    let mut tcp_baseline = if unix {
        None
    } else {
        Some(TcpStreamBaseline::start(max_batch * max_value, streams)?)
    };
    for &value_size in &args.value_sizes {
        let value_size = value_size as usize;
        let mut remote = Remote {
            client,
            unix,
            value_size,
            run: run_id.clone(),
        };
        let mut scratch: Vec<Vec<u8>> = if unix {
            Vec::new()
        } else {
            (0..round_places(args, value_size as u64))
                .map(|_| vec![0u8; value_size])
                .collect()
        };
        for &batch in &args.batches {
            let batches = crate::case::batches_for(args.bytes_per_case, value_size as u64, batch);
            let wants = |op: &str, tier: &str| crate::args::wants(args, op, tier);
            if (wants("put", "memory") || wants("get", "memory"))
                && (value_size * batch) as u64 <= memory / 2
            {
                // Memory rows: memory-only puts over a working set of half
                // the pool, then gets of them.
                let set = ((memory / 2) / (value_size * batch) as u64).max(1);
                let memory_only = PutOptions {
                    tier: PutTier::MemoryOnly,
                    ..Default::default()
                };
                let (mut put, mut get, mut base) =
                    (Measurement::new(), Measurement::new(), Measurement::new());
                // Puts have a baseline of their own: over TCP the put
                // direction's stream, over Unix a put-shaped copy.
                let mut base_put = Measurement::new();
                // One client connection: one copying thread.
                let mut memcpy = Memcpy::new(
                    value_size,
                    batch,
                    (set as usize * batch).min(batches as usize * batch),
                    1,
                );
                let mut verified = 0;
                {
                    // Warm-up, untimed: both sides grow their reusable
                    // buffers to this batch size once.
                    let keys: Vec<Vec<u8>> = (0..batch as u64)
                        .map(|i| remote.key("memory", batch, i))
                        .collect();
                    let mut ignored = Measurement::new();
                    remote.stage(&keys, 0, &mut scratch)?;
                    remote.put(&keys, 0, &memory_only, &scratch, &mut ignored)?;
                    remote.get(&keys, &mut scratch, &mut ignored)?;
                    if let Some(tcp) = &mut tcp_baseline {
                        tcp.run(value_size * batch, true, 0..1, &mut ignored)?;
                        tcp.run(value_size * batch, false, 0..1, &mut ignored)?;
                    }
                }
                // The store's side puts a round's batches, then reads them
                // back; the baseline moves the same bytes each way.
                let mut store_side = |r: &Round, (): &()| -> BenchResult<()> {
                    let keys = |remote: &Remote, b: u64| -> Vec<Vec<u8>> {
                        (0..batch as u64)
                            .map(|i| remote.key("memory", batch, (b % set) * batch as u64 + i))
                            .collect()
                    };
                    for b in r.batches.clone() {
                        let keys = keys(&remote, b);
                        remote.stage(&keys, 0, &mut scratch)?;
                        remote.put(&keys, 0, &memory_only, &scratch, &mut put)?;
                    }
                    for b in r.batches.clone() {
                        let keys = keys(&remote, b);
                        verified += remote.get(&keys, &mut scratch, &mut get)?;
                    }
                    Ok(())
                };
                let mut baseline_side = |r: &Round, (): &()| -> BenchResult<()> {
                    match &mut tcp_baseline {
                        Some(tcp) => {
                            tcp.run(value_size * batch, true, r.batches.clone(), &mut base_put)?;
                            tcp.run(value_size * batch, false, r.batches.clone(), &mut base)?;
                        }
                        None => {
                            memcpy.run_put(r.batches.clone(), &mut base_put);
                            memcpy.run(r.batches.clone(), &mut base);
                        }
                    }
                    Ok(())
                };
                schedule::run_rounds(
                    rounds(batches, PUT_ROUNDS),
                    1,
                    |_| Ok(()),
                    &mut [&mut store_side, &mut baseline_side],
                )?;
                // Leave the pool as it was found for the next case.
                for b in 0..set.min(batches) {
                    for i in 0..batch as u64 {
                        remote
                            .client
                            .remove(remote.key("memory", batch, b * batch as u64 + i))?;
                    }
                }
                let kind = match &tcp_baseline {
                    Some(tcp) => tcp.describe(),
                    None => "memcpy".to_string(),
                };
                let put_kind = match &tcp_baseline {
                    Some(tcp) => format!("{}, put direction", tcp.describe()),
                    None => "memcpy".to_string(),
                };
                if wants("put", "memory") {
                    rows.push(Row::new(
                        "put",
                        "memory",
                        value_size as u64,
                        batch,
                        &put,
                        &base_put,
                        &put_kind,
                        &engine,
                        0,
                    ));
                    println!("{}", rows.last().unwrap().line());
                }
                if wants("get", "memory") {
                    rows.push(Row::new(
                        "get",
                        "memory",
                        value_size as u64,
                        batch,
                        &get,
                        &base,
                        &kind,
                        &engine,
                        verified,
                    ));
                    println!("{}", rows.last().unwrap().line());
                }
            }
            if wants("put", "disk") || wants("get", "disk") {
                // Disk rows: write the case's keys plus as much again as the
                // server's pool, so the first keys are only on disk. The
                // device ceiling: a size x depth sweep, then its best shape
                // re-measured each round: for reads over the server's region
                // files when --server-data-dir names them (the bench runs
                // beside the server with read access), else over a scratch
                // file the bench writes in --data-dir; for writes always on
                // such a scratch file. With --server-data-dir, disk gets also
                // replay the server's reads raw (shape-matched).
                let filler_batches = memory.div_ceil((value_size * batch) as u64) + 1;
                let write_through = PutOptions::default();
                let sweep_budget = (2 * args.bytes_per_case).max(16 << 20);
                let scratch_path = args
                    .data_dir
                    .join(format!("remote-ceiling-{value_size}-{batch}.scratch"));
                let write_shape = device::sweep_writes(&scratch_path, sweep_budget)?;
                let mut writer = device::CeilingWriter::create(&scratch_path, write_shape, 0)?;
                let (mut put, mut base_write) = (Measurement::new(), Measurement::new());
                let bytes =
                    |r: &Round| (r.batches.end - r.batches.start) * (batch * value_size) as u64;
                // The round's values are generated before its clock starts
                // (the server's flusher writes in the background, so no
                // untimed gap may fall between the calls); the calls and the
                // flush are timed together on the wall clock.
                let mut store_side = |r: &Round, (): &()| -> BenchResult<()> {
                    let batches_keys: Vec<Vec<Vec<u8>>> = r
                        .batches
                        .clone()
                        .map(|b| {
                            (0..batch as u64)
                                .map(|i| remote.key("disk", batch, b * batch as u64 + i))
                                .collect()
                        })
                        .collect();
                    for (j, keys) in batches_keys.iter().enumerate() {
                        remote.stage(keys, j * batch, &mut scratch)?;
                    }
                    let started = Instant::now();
                    let mut calls = Measurement::new();
                    for (j, keys) in batches_keys.iter().enumerate() {
                        remote.put(keys, j * batch, &write_through, &scratch, &mut calls)?;
                    }
                    remote.client.flush()?;
                    put.add_span(started.elapsed(), bytes(r));
                    put.merge_calls(&calls);
                    Ok(())
                };
                let mut ceiling_side =
                    |r: &Round, (): &()| Ok(writer.write(bytes(r), &mut base_write)?);
                schedule::run_rounds(
                    rounds(batches, PUT_ROUNDS),
                    1,
                    |_| Ok(()),
                    &mut [&mut store_side, &mut ceiling_side],
                )?;
                let mut ignored = Measurement::new();
                for b in batches..batches + filler_batches {
                    let keys: Vec<Vec<u8>> = (0..batch as u64)
                        .map(|i| remote.key("disk", batch, b * batch as u64 + i))
                        .collect();
                    remote.stage(&keys, 0, &mut scratch)?;
                    remote.put(&keys, 0, &write_through, &scratch, &mut ignored)?;
                }
                remote.client.flush()?;
                if wants("put", "disk") {
                    rows.push(Row::against_device(
                        "put",
                        value_size as u64,
                        batch,
                        &put,
                        None,
                        &base_write,
                        None,
                        format!("{write_shape} on a scratch file beside the bench"),
                        &engine,
                        0,
                    ));
                    println!("{}", rows.last().unwrap().line());
                }
                if wants("get", "disk") {
                    let (set, place) = match &args.server_data_dir {
                        Some(dir) => (
                            device::FileSet::regions_of(&[dir.as_path()])?,
                            "the server's region files",
                        ),
                        None => (
                            device::FileSet::open(std::slice::from_ref(&scratch_path))?,
                            "a scratch file beside the bench",
                        ),
                    };
                    let read_shape = device::sweep_reads(&set, sweep_budget)?;
                    let mut reader = device::CeilingReader::new(&set, read_shape, 0)?;
                    let before = remote.client.stats()?;
                    // Beside the server, also the shape-matched stream: the
                    // server's own disk reads of the case's values (where
                    // their batch records put them, in its read pieces at
                    // its io_depth), raw and verified as it verifies.
                    let located = match &args.server_data_dir {
                        Some(dir) => Some(server_locations(
                            dir,
                            &before,
                            (0..batches * batch as u64).map(|i| remote.key("disk", batch, i)),
                        )?),
                        None => None,
                    };
                    let shape_reader = located.as_ref().map(|(at, depth, piece)| {
                        device::ShapeReader::new(&set, at, *depth, *piece)
                    });
                    let mut callers = match &located {
                        Some((_, depth, _)) => {
                            vec![device::ShapeCaller::new(*depth, remote.slot() * batch)?]
                        }
                        None => Vec::new(),
                    };
                    let (mut get, mut base, mut shape) =
                        (Measurement::new(), Measurement::new(), Measurement::new());
                    let (mut verified, mut shape_verified) = (0, 0);
                    let mut store_side = |r: &Round, (): &()| -> BenchResult<()> {
                        for b in r.batches.clone() {
                            let keys: Vec<Vec<u8>> = (0..batch as u64)
                                .map(|i| remote.key("disk", batch, b * batch as u64 + i))
                                .collect();
                            verified += remote.get(&keys, &mut scratch, &mut get)?;
                        }
                        Ok(())
                    };
                    let mut ceiling_side = |r: &Round, (): &()| {
                        let bytes = (r.batches.end - r.batches.start) * (batch * value_size) as u64;
                        Ok(reader.read(bytes, &mut base)?)
                    };
                    let mut shape_side = |r: &Round, (): &()| -> BenchResult<()> {
                        let Some(shape_reader) = &shape_reader else {
                            return Ok(());
                        };
                        let bytes = (r.batches.end - r.batches.start) * (batch * value_size) as u64;
                        shape_verified += crate::measure::on_callers(
                            r.batches.clone(),
                            &mut callers,
                            &mut shape,
                            bytes,
                            |b, caller| {
                                let first = b * batch as u64;
                                shape_reader.read_batch(first..first + batch as u64, caller)
                            },
                        )?;
                        Ok(())
                    };
                    let mut sides: Vec<schedule::Side<'_, ()>> =
                        vec![&mut store_side, &mut ceiling_side];
                    if shape_reader.is_some() {
                        sides.push(&mut shape_side);
                    }
                    schedule::run_rounds(rounds(batches, GET_ROUNDS), 1, |_| Ok(()), &mut sides)?;
                    drop(sides);
                    if shape_reader.is_some() {
                        device::check_same_verified(shape_verified, verified)?;
                    }
                    let after = remote.client.stats()?;
                    let memory_hits = after["store"]["memory_hits"].as_u64().unwrap_or(0)
                        - before["store"]["memory_hits"].as_u64().unwrap_or(0);
                    if memory_hits > 0 {
                        eprintln!("note: {memory_hits} of the disk-case gets were served from the server's memory");
                    }
                    rows.push(Row::against_device(
                        "get",
                        value_size as u64,
                        batch,
                        &get,
                        shape_reader.is_some().then_some(&shape),
                        &base,
                        None,
                        format!("{read_shape} on {place}"),
                        &engine,
                        verified,
                    ));
                    println!("{}", rows.last().unwrap().line());
                }
                drop(writer);
            }
        }
        client = remote.client;
    }
    Ok(rows)
}

/// Where the server keeps each of `keys` (read from its batch records in
/// `data_dir`, beside it) and the shape of its disk reads (its io_depth
/// and read piece, from `stats`): what the shape-matched stream replays.
fn server_locations(
    data_dir: &std::path::Path,
    stats: &serde_json::Value,
    keys: impl Iterator<Item = Vec<u8>>,
) -> BenchResult<(Vec<kvtier::DiskLocation>, usize, usize)> {
    let reported = |field: &str| {
        stats["store"][field]
            .as_u64()
            .filter(|v| *v > 0)
            .ok_or_else(|| {
                format!("the server's stats carry no {field} (a server older than this bench?)")
            })
    };
    let depth = reported("io_depth")? as usize;
    let piece = reported("read_piece")? as usize;
    // Batch records hold qualified keys (namespace length, namespace,
    // key); the bench knows its keys unqualified.
    let mut by_key = std::collections::HashMap::new();
    for (qualified, location) in kvtier::internals::value_locations(data_dir)? {
        let Some((&ns_len, rest)) = qualified.split_first() else {
            continue;
        };
        if let Some(key) = rest.get(ns_len as usize..) {
            by_key.insert(key.to_vec(), location);
        }
    }
    let located = keys
        .map(|key| {
            by_key.remove(&key).ok_or_else(|| {
                format!(
                    "{} is in no batch record under {}",
                    String::from_utf8_lossy(&key),
                    data_dir.display()
                )
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok((located, depth, piece))
}

/// Values of `value_size` in the largest disk put round of any batch count
/// (at least one batch): what the staging places must hold.
fn round_places(args: &BenchArgs, value_size: u64) -> usize {
    args.batches
        .iter()
        .map(|&batch| {
            let batches = crate::case::batches_for(args.bytes_per_case, value_size, batch);
            let most = rounds(batches, PUT_ROUNDS)
                .iter()
                .map(|r| r.end - r.start)
                .max()
                .unwrap_or(1);
            most as usize * batch
        })
        .max()
        .unwrap_or(1)
}
