//! Index-scale cases: batch_exists on a large index, and reopen time.

use super::report::Row;
use hdrhistogram::Histogram;
use kvtier::internals::{DiskLoc, Entry, Index};
use kvtier::{Config, IoEngineKind, KeyDigest, KeySecret, Namespace, PutOptions, Store};
use std::path::Path;
use std::time::Instant;

fn empty_row(op: &str, tier: &str, engine: &str) -> Row {
    Row {
        op: op.into(),
        tier: tier.into(),
        io_engine: engine.into(),
        ..Row::default()
    }
}

/// `batch_exists` of 1,024 keys against an index of `entries` entries: the
/// same work `Store::batch_exists` does (hash each key, then look up the
/// batch taking each shard lock once), on an index filled directly with
/// disk-resident entries, since writing that many values through the
/// store would need tens of GiB of disk.
pub fn exists_case(entries: u64, dir: &Path) -> Result<Row, Box<dyn std::error::Error>> {
    let index = Index::default();
    let namespace = Namespace::new(
        std::sync::Arc::new(KeySecret::generate()?),
        "llama3-8b/bf16/tp0of2/page64",
    )?;
    let key = |i: u64| format!("prefix-block-{i:012}").into_bytes();
    for i in 0..entries {
        let digest = namespace.digest(&key(i));
        index.lock(digest).insert(
            digest,
            Entry::new(
                i + 1,
                i,
                None,
                Some(DiskLoc::new((i >> 16) as u32, (i & 0xffff) as u32)),
                1 << 20,
            ),
        );
    }
    let counts = index.counts();
    let mut histogram = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let rounds = 2_000;
    let mut found = 0u64;
    for _ in 0..rounds {
        // 1,024 keys of one prompt: a random run of consecutive blocks.
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let first = state % entries.saturating_sub(1024).max(1);
        let keys: Vec<Vec<u8>> = (first..first + 1024).map(key).collect();
        let started = Instant::now();
        let digests: Vec<KeyDigest> = keys.iter().map(|k| namespace.digest(k)).collect();
        let present = index.contains_many(&digests);
        let micros = started.elapsed().as_nanos() as u64 / 1000;
        histogram.saturating_record(micros.max(1));
        found += present.iter().filter(|&&p| p).count() as u64;
    }
    if found != rounds * 1024.min(entries) {
        return Err(format!(
            "index lookups found {found} of {} present keys",
            rounds * 1024
        )
        .into());
    }
    let mut row = empty_row("exists", "index", "-");
    row.batch = 1024;
    row.p50_us = histogram.value_at_quantile(0.5);
    row.p90_us = histogram.value_at_quantile(0.9);
    row.p99_us = histogram.value_at_quantile(0.99);
    row.p999_us = histogram.value_at_quantile(0.999);
    row.batches_per_s = 1e6 / histogram.mean();
    row.index_entries = Some(counts.entries);
    row.index_bytes_per_entry = Some(counts.table_bytes as f64 / counts.entries as f64);
    let (policy_bytes, pool_entries) = policy_probe(dir)?;
    row.policy_bytes = Some(policy_bytes);
    row.pool_entries = Some(pool_entries);
    Ok(row)
}

/// The default eviction policy's metadata for a full pool: a memory-only
/// store with a 1 GiB pool of 64 KiB values (16,384 entries, the smallest
/// value size kvtier is built for, so the most entries per byte of pool),
/// written three times over with every third key read back, so that the
/// queues, the ghosts and the simulations all hold what they hold in
/// steady state. Returns (policy bytes, pool entries).
pub fn policy_probe(dir: &Path) -> Result<(u64, u64), Box<dyn std::error::Error>> {
    let _ = std::fs::remove_dir_all(dir);
    let pool = 1u64 << 30;
    let value = 64usize << 10;
    let store = Store::open(Config::new(dir).memory_capacity(pool).disk_capacity(0))?;
    let payload = vec![0x3Cu8; value];
    let per_pool = pool / value as u64;
    for i in 0..3 * per_pool {
        store.put(format!("probe/{i}"), &payload)?;
        if i % 3 == 0 && i >= 64 {
            store.get(format!("probe/{}", i - 64))?;
        }
    }
    let stats = store.stats();
    if stats.evictions == 0 {
        return Err("the policy probe never filled its pool".into());
    }
    store.close()?;
    drop(store);
    let _ = std::fs::remove_dir_all(dir);
    Ok((stats.policy_bytes, stats.memory_entries))
}

/// Writes `entries` 4 KiB values through a store, closes it cleanly, and
/// times `Store::open` (recovery from the batch records). The pool is
/// kept small so the open time is recovery, not pre-faulting.
pub fn reopen_case(
    dir: &Path,
    entries: u64,
    engine: IoEngineKind,
) -> Result<Row, Box<dyn std::error::Error>> {
    let _ = std::fs::remove_dir_all(dir);
    let value = 4096u64;
    let config = Config::new(dir)
        .memory_capacity(256 << 20)
        .disk_capacity((entries * (value + 128) + (4 << 30)).max(8 << 30))
        .io_engine(engine);
    let store = Store::open(config.clone())?;
    let engine_name = store.stats().io_engine;
    let payload = vec![0x5Au8; value as usize];
    let chunk = 1024u64;
    let mut next = 0u64;
    while next < entries {
        let keys: Vec<Vec<u8>> = (next..(next + chunk).min(entries))
            .map(|i| format!("reopen/{i}").into_bytes())
            .collect();
        let values: Vec<&[u8]> = keys.iter().map(|_| &payload[..]).collect();
        for result in store.batch_put_with(&keys, &values, &PutOptions::default()) {
            result?;
        }
        next += keys.len() as u64;
    }
    store.close()?;
    drop(store);
    let started = Instant::now();
    let store = Store::open(config)?;
    let seconds = started.elapsed().as_secs_f64();
    let stats = store.stats();
    if stats.entries != entries {
        return Err(format!("reopen found {} of {entries} entries", stats.entries).into());
    }
    let mut row = empty_row("open", "disk", engine_name);
    row.seconds = seconds;
    row.p50_us = (seconds * 1e6) as u64;
    row.bytes = stats.disk_used_bytes;
    row.index_entries = Some(stats.entries);
    store.close()?;
    Ok(row)
}
