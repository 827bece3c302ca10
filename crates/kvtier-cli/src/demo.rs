//! `kvtier demo`: the engine flow end to end against an embedded store.
//!
//! A synthetic prompt is cut into token blocks and keyed with chained
//! prefix keys; the demo asks how much of the prompt is cached, writes the
//! missing blocks, makes them durable, reads every block back and verifies
//! each byte. Run it twice: the second run finds the prompt cached on disk.

use kvtier::format_size;
use kvtier::AlignedBuf;
use kvtier::{block_keys, Config, PutOptions, Store};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Data directory (created if missing).
    #[arg(long, default_value = "./kvtier-data")]
    pub data_dir: PathBuf,
    /// Number of KV blocks in the synthetic prompt.
    #[arg(long, default_value_t = 64)]
    pub blocks: usize,
    /// Bytes of KV data per block.
    #[arg(long, default_value = "1MiB", value_parser = kvtier::parse_size)]
    pub value_size: u64,
    /// Tokens per block.
    #[arg(long, default_value_t = 256)]
    pub block_tokens: usize,
    /// Memory pool capacity (store default: 1 GiB).
    #[arg(long, value_parser = kvtier::parse_size)]
    pub memory: Option<u64>,
    /// Disk tier capacity (store default: 16 GiB).
    #[arg(long, value_parser = kvtier::parse_size)]
    pub disk: Option<u64>,
}

/// Bytes standing in for a block's KV tensors: derived from the key so a
/// read of the wrong block can never verify.
fn block_bytes(key: &[u8], len: usize) -> Vec<u8> {
    kvtier::pattern::value(key, len)
}

pub fn run(args: &DemoArgs) -> Result<(), Box<dyn std::error::Error>> {
    let mut config = Config::new(&args.data_dir);
    if let Some(memory) = args.memory {
        config = config.memory_capacity(memory);
    }
    if let Some(disk) = args.disk {
        config = config.disk_capacity(disk);
    }
    let value_size = usize::try_from(args.value_size)?;
    let opened = Instant::now();
    let store = Store::open(config)?;
    let report = store.recovery_report().clone();
    let recovered = if report.from_checkpoint {
        format!(
            "{} entries from its index checkpoint",
            report.checkpoint_entries
        )
    } else {
        format!("{} records recovered", report.records)
    };
    println!(
        "opened {} in {:.1} ms: {} regions, {recovered}, {} entries",
        args.data_dir.display(),
        opened.elapsed().as_secs_f64() * 1e3,
        report.regions,
        store.stats().entries
    );

    let tokens: Vec<u32> = (0..(args.blocks * args.block_tokens) as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % 151_936)
        .collect();
    let keys = block_keys(&tokens, args.block_tokens, b"kvtier-demo");
    let cached = store.prefix_len(&keys);
    println!(
        "prompt of {} tokens = {} blocks of {} tokens; {} blocks already cached",
        tokens.len(),
        keys.len(),
        args.block_tokens,
        cached
    );

    let missing = &keys[cached..];
    if !missing.is_empty() {
        let values: Vec<Vec<u8>> = missing
            .iter()
            .map(|k| block_bytes(k.as_ref(), value_size))
            .collect();
        let started = Instant::now();
        let options = PutOptions {
            skip_existing: true,
            durable: true,
            ..Default::default()
        };
        let failed = store
            .batch_put_with(missing, &values, &options)
            .into_iter()
            .filter_map(Result::err)
            .inspect(|e| eprintln!("put failed: {e}"))
            .count();
        let seconds = started.elapsed().as_secs_f64();
        let bytes = (missing.len() * value_size) as u64;
        println!(
            "wrote {} blocks ({}) durably in {:.1} ms: {:.0} MB/s{}",
            missing.len(),
            format_size(bytes),
            seconds * 1e3,
            bytes as f64 / seconds / 1e6,
            if failed > 0 {
                format!(", {failed} failed")
            } else {
                String::new()
            }
        );
    }

    // One page-aligned host buffer cut into per-block slots, as an engine's
    // KV pool is: disk reads land in it directly (O_DIRECT, no bounce).
    let slot = value_size.div_ceil(4096) * 4096;
    let mut host = AlignedBuf::zeroed(slot * keys.len());
    let started = Instant::now();
    let results = {
        let mut slices: Vec<&mut [u8]> = host.as_mut_slice().chunks_mut(slot).collect();
        store.batch_get_into(&keys, &mut slices)
    };
    let seconds = started.elapsed().as_secs_f64();
    let mut verified = 0u64;
    let mut wrong = 0usize;
    let mut misses = 0usize;
    for ((key, buffer), result) in keys.iter().zip(host.as_slice().chunks(slot)).zip(&results) {
        match result {
            Ok(Some(n)) if buffer[..*n] == block_bytes(key.as_ref(), value_size)[..] => {
                verified += *n as u64
            }
            Ok(Some(_)) => wrong += 1,
            Ok(None) => misses += 1,
            Err(e) => return Err(format!("reading block {}: {e}", key.to_hex()).into()),
        }
    }
    let stats = store.stats();
    println!(
        "read {} blocks back in {:.1} ms ({:.0} MB/s): {} verified, {} misses, {} wrong",
        keys.len(),
        seconds * 1e3,
        verified as f64 / seconds / 1e6,
        format_size(verified),
        misses,
        wrong
    );
    println!(
        "store: {} entries; memory {} of {} ({} hits); disk {} in {} regions of {} ({} hits); io engine {}",
        stats.entries,
        format_size(stats.memory_bytes),
        format_size(stats.memory_capacity),
        stats.memory_hits,
        format_size(stats.disk_used_bytes),
        stats.disk_regions,
        format_size(stats.disk_capacity),
        stats.disk_hits,
        stats.io_engine
    );
    store.close()?;
    if wrong > 0 || misses > 0 {
        return Err(
            format!("{wrong} blocks returned wrong bytes and {misses} were missing").into(),
        );
    }
    println!("ok: run it again to load the whole prompt from the cache");
    Ok(())
}
