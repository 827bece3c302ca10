//! Index-scale cases: batch_exists on a large index, and reopen time.

use super::report::Row;
use hdrhistogram::Histogram;
use kvtier::internals::{prefetch, DiskLoc, Entry, Index};
use kvtier::{Config, IoEngineKind, KeySecret, Namespace, PutOptions, Store};
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
    let new_histogram = || Histogram::<u64>::new_with_bounds(1, 60_000_000, 3);
    let (mut histogram, mut hashing, mut lookups) =
        (new_histogram()?, new_histogram()?, new_histogram()?);
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
        let digests = namespace.digest_many(&keys);
        let hashed = started.elapsed();
        let present = index.contains_many(&digests);
        let total = started.elapsed();
        histogram.saturating_record((total.as_nanos() as u64 / 1000).max(1));
        hashing.saturating_record((hashed.as_nanos() as u64 / 1000).max(1));
        lookups.saturating_record(((total - hashed).as_nanos() as u64 / 1000).max(1));
        found += present.iter().filter(|&&p| p).count() as u64;
    }
    if found != rounds * 1024.min(entries) {
        return Err(format!(
            "index lookups found {found} of {} present keys",
            rounds * 1024
        )
        .into());
    }
    let random_lines = random_lines_reference(counts.table_bytes, rounds)?;
    let mut row = empty_row("exists", "index", "-");
    row.batch = 1024;
    row.p50_us = histogram.value_at_quantile(0.5);
    row.p90_us = histogram.value_at_quantile(0.9);
    row.p99_us = histogram.value_at_quantile(0.99);
    row.p999_us = histogram.value_at_quantile(0.999);
    row.batches_per_s = 1e6 / histogram.mean();
    row.index_entries = Some(counts.entries);
    row.index_bytes_per_entry = Some(counts.table_bytes as f64 / counts.entries as f64);
    row.index_hash_p50_us = Some(hashing.value_at_quantile(0.5));
    row.index_lookup_p50_us = Some(lookups.value_at_quantile(0.5));
    row.index_random_lines_p50_us = Some(random_lines);
    let (policy_bytes, pool_entries) = policy_probe(dir)?;
    row.policy_bytes = Some(policy_bytes);
    row.pool_entries = Some(pool_entries);
    Ok(row)
}

/// A reference for the lookups of one batch: 2,048 reads of
/// random 64-byte lines (two per key, what each lookup of the index reads:
/// a bucket and an entry) over memory the size of the index, prefetched
/// in groups of 16 and then read, as the index's batch lookups do, with
/// none of their work between. Not a floor: a prompt's consecutive
/// blocks were inserted together, so their arena entries sit close. Median
/// microseconds per batch over `rounds` batches.
fn random_lines_reference(bytes: u64, rounds: u64) -> Result<u64, Box<dyn std::error::Error>> {
    let lines = (bytes / 64).max(1) as usize;
    // Touched once, so every page is mapped before the clock starts.
    let memory: Vec<[u64; 8]> = (0..lines as u64).map(|i| [i; 8]).collect();
    let mut histogram = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut sum = 0u64;
    let mut picks = vec![0usize; 2048];
    for _ in 0..rounds {
        for pick in picks.iter_mut() {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            *pick = (state % lines as u64) as usize;
        }
        let started = Instant::now();
        // As the index reads: a group's lines requested, then read.
        for group in picks.chunks(16) {
            for &pick in group {
                prefetch(&memory[pick]);
            }
            for &pick in group {
                sum = sum.wrapping_add(memory[pick][0]);
            }
        }
        histogram.saturating_record((started.elapsed().as_nanos() as u64 / 1000).max(1));
    }
    std::hint::black_box(sum);
    Ok(histogram.value_at_quantile(0.5))
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

/// Writes `entries` 4 KiB values through a store, closes it cleanly
/// (writing its index checkpoint), and times `Store::open` twice: loading
/// that checkpoint (the `checkpoint` row, with the close's time), then,
/// with the checkpoint removed, reading every batch record (the `disk`
/// row; docs/design.md, "Recovery" and "Local index checkpoints"). The pool is
/// kept small (16 MiB) so the open time is recovery, not backing the pool
/// with memory, which is measured on its own just before: an empty
/// directory opened with a 256 MiB pool (on the development VM, right
/// after gigabytes of writes, the host backed fresh memory at a few hundred
/// MB/s, so that alone took about a second).
pub fn reopen_case(
    dir: &Path,
    entries: u64,
    engine: IoEngineKind,
) -> Result<Vec<Row>, Box<dyn std::error::Error>> {
    let _ = std::fs::remove_dir_all(dir);
    let value = 4096u64;
    let config = Config::new(dir)
        .memory_capacity(16 << 20)
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
    // The clean close writes the index checkpoint the first reopen loads.
    let started = Instant::now();
    store.close()?;
    let close_seconds = started.elapsed().as_secs_f64();
    drop(store);
    // Beside it, at the same moment of the machine (just after the writes):
    // an empty directory with a 256 MiB pool.
    let empty_dir = dir.with_extension("empty");
    let _ = std::fs::remove_dir_all(&empty_dir);
    let started = Instant::now();
    Store::open(
        Config::new(&empty_dir)
            .memory_capacity(256 << 20)
            .disk_capacity(8 << 30)
            .io_engine(engine),
    )?
    .close()?;
    let pool_open_seconds = started.elapsed().as_secs_f64();
    let _ = std::fs::remove_dir_all(&empty_dir);
    let reopen =
        |config: Config, loaded: u64, tier: &str| -> Result<Row, Box<dyn std::error::Error>> {
            let started = Instant::now();
            let store = Store::open(config)?;
            let seconds = started.elapsed().as_secs_f64();
            let stats = store.stats();
            if stats.entries != entries {
                return Err(format!("reopen found {} of {entries} entries", stats.entries).into());
            }
            if stats.checkpoint_entries_loaded != loaded {
                return Err(format!(
                    "the {tier} reopen loaded {} entries from a checkpoint, not {loaded}",
                    stats.checkpoint_entries_loaded
                )
                .into());
            }
            let mut row = empty_row("open", tier, engine_name);
            row.seconds = seconds;
            row.p50_us = (seconds * 1e6) as u64;
            row.bytes = stats.disk_used_bytes;
            row.index_entries = Some(stats.entries);
            store.close()?;
            Ok(row)
        };
    // From the checkpoint the clean close wrote; then, with it removed and
    // none written at that close, reading every batch record.
    let mut from_checkpoint = reopen(config.clone(), entries, "checkpoint")?;
    from_checkpoint.close_seconds = Some(close_seconds);
    std::fs::remove_dir_all(dir.join("checkpoints"))?;
    let mut from_records = reopen(config.local_index_checkpoints(false), 0, "disk")?;
    from_records.pool_open_seconds = Some(pool_open_seconds);
    Ok(vec![from_records, from_checkpoint])
}

/// A node starting beside another writer's log of `entries` blocks in a
/// shared directory under `dir` (docs/design.md, "Index checkpoints"):
/// once reading every batch record of the log, once loading the writer's
/// index checkpoint (and the records after it, none here). The log is laid
/// out directly as region files of batch records over sparse value pages
/// (each value 4 KiB of zeros, verified by its checksum if read), since
/// writing 10 M values would need 40 GiB; recovery and following read only
/// the records. Returns the two rows.
pub fn follow_case(
    dir: &Path,
    entries: u64,
    engine: IoEngineKind,
) -> Result<Vec<Row>, Box<dyn std::error::Error>> {
    use kvtier::internals::format::{self, RecordEntry, RecordKind, RegionHeader};
    use std::os::unix::fs::FileExt;
    let _ = std::fs::remove_dir_all(dir);
    let shared = dir.join("shared");
    const VALUE: u64 = 4096;
    let per_batch = kvtier::internals::MAX_BATCH_ENTRIES as u64;
    let batches_per_region = 32u64;
    let capacity = entries * (VALUE + 256) + (4 << 30);
    let config = |name: &str| {
        Config::new(dir.join(name))
            .memory_capacity(64 << 20)
            .disk_capacity(capacity)
            .region_size(1 << 30)
            .io_engine(engine)
            .shared_dir(&shared)
    };
    // The writer: its directory and node id, then its log laid out.
    let writer = Store::open(config("b"))?;
    let node = writer.node_id().to_string();
    writer.close()?;
    drop(writer);
    let secret = {
        let bytes = std::fs::read(shared.join("key-secret"))?;
        KeySecret::from_bytes(bytes.try_into().map_err(|_| "key-secret is not 32 bytes")?)
    };
    let regions_dir = shared.join("nodes").join(&node).join("regions");
    std::fs::create_dir_all(&regions_dir)?;
    let zeros = vec![0u8; VALUE as usize];
    let mut next = 0u64;
    let mut region = 0u32;
    let started = Instant::now();
    while next < entries {
        let path = regions_dir.join(format!("{node}-{:016x}-{region:08x}.kvr", 1u64));
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)?;
        let mut page = vec![0u8; 4096];
        RegionHeader {
            region,
            first_seq: next + 1,
        }
        .encode(&mut page);
        file.write_all_at(&page, 0)?;
        let mut offset = 4096u64;
        for _ in 0..batches_per_region {
            if next >= entries {
                break;
            }
            let n = per_batch.min(entries - next);
            let keys: Vec<Vec<u8>> = (next..next + n)
                .map(|i| {
                    let mut q = vec![0u8];
                    q.extend_from_slice(format!("follow/{i:012}").as_bytes());
                    q
                })
                .collect();
            let record_len = format::record_len(keys.iter().map(Vec::len)) as u64;
            let padded = record_len.div_ceil(4096) * 4096;
            let batch_len = padded + n * VALUE;
            let records: Vec<RecordEntry> = keys
                .into_iter()
                .enumerate()
                .map(|(j, key)| {
                    let digest = secret.digest_qualified(&key);
                    RecordEntry {
                        kind: RecordKind::Put,
                        seq: next + j as u64 + 1,
                        digest,
                        value_offset: padded + j as u64 * VALUE,
                        value_len: VALUE as u32,
                        checksum: kvtier::value_checksum(digest, &zeros),
                        key,
                    }
                })
                .collect();
            let mut out = vec![0u8; padded as usize];
            let origin = format::RecordOrigin {
                writer: format::RecordOrigin::node_bytes(&node).ok_or("a bad node id")?,
                incarnation: 1,
                region,
                accept_unbound: false,
            };
            format::encode_record(&mut out, &origin, offset, batch_len, &records, &secret);
            file.write_all_at(&out, offset)?;
            offset += batch_len;
            next += n;
        }
        file.set_len(offset)?;
        file.sync_all()?;
        region += 1;
    }
    eprintln!(
        "laid out {entries} entries in {region} regions in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let mut rows = Vec::new();
    let mut measure =
        |name: &str, op: &str, checkpoints: u64| -> Result<(), Box<dyn std::error::Error>> {
            let started = Instant::now();
            let reader = Store::open(config(name))?;
            let seconds = started.elapsed().as_secs_f64();
            let stats = reader.stats();
            if stats.entries != entries || stats.shared_checkpoints_loaded != checkpoints {
                return Err(format!(
                    "{op}: the reader indexed {} of {entries} entries, {} checkpoints",
                    stats.entries, stats.shared_checkpoints_loaded
                )
                .into());
            }
            let mut row = empty_row(op, "shared", stats.io_engine);
            row.seconds = seconds;
            row.p50_us = (seconds * 1e6) as u64;
            row.index_entries = Some(entries);
            row.bytes = stats.shared_bytes;
            println!("{}", row.line());
            rows.push(row);
            reader.close()?;
            Ok(())
        };
    measure("c", "follow-records", 0)?;
    // The writer reopens (its own recovery) and closes: a clean close
    // writes its index checkpoint.
    let started = Instant::now();
    let writer = Store::open(config("b"))?;
    writer.close()?;
    drop(writer);
    eprintln!(
        "writer reopened and wrote its checkpoint in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    measure("c2", "follow-checkpoint", 1)?;
    let _ = std::fs::remove_dir_all(dir);
    Ok(rows)
}
