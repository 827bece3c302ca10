//! What recovery costs, measured on this machine's disk (docs/design.md,
//! "Tail scrub" and "Recovery"):
//!
//! - the open of a healthy directory, clean and after an unclean shutdown
//!   (the tail scrub reads the newest region's values: one full region);
//! - the open of the same directory with every batch record damaged, so
//!   that recovery resynchronises through every page of every region.
//!
//!   cargo run --release -p kvtier --example recovery_cost -- [DIR] [GIB] [REGION_MIB]
//!
//! Defaults: a temporary directory, 1.25 GiB of 1 MiB values, 256 MiB
//! regions. Prints one JSON object; each open is timed three times (the
//! median is reported with the runs).

use kvtier::{Config, Store};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

const VALUE: usize = 1 << 20;

fn config(dir: &Path, disk: u64, region: u64) -> Config {
    Config::new(dir)
        .memory_capacity(256 << 20)
        .disk_capacity(disk)
        .region_size(region)
}

/// Opens and closes `dir`, `prepare` run before each open; the open times
/// in seconds and the last open's report.
fn time_opens(
    config: &Config,
    mut prepare: impl FnMut(),
) -> (Vec<f64>, kvtier::RecoveryReport, u64) {
    let mut times = Vec::new();
    let mut report = kvtier::RecoveryReport::default();
    let mut entries = 0;
    for _ in 0..3 {
        prepare();
        let started = Instant::now();
        let store = Store::open(config.clone()).expect("open");
        times.push(started.elapsed().as_secs_f64());
        report = store.recovery_report().clone();
        entries = store.stats().entries;
        store.close().expect("close");
    }
    (times, report, entries)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn region_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir.join("regions"))
        .expect("regions/")
        .map(|e| e.expect("entry").path())
        .collect();
    files.sort();
    files
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let scratch = tempfile::tempdir().expect("temporary directory");
    let dir = args
        .get(1)
        .map_or_else(|| scratch.path().join("data"), PathBuf::from);
    let gib: f64 = args.get(2).map_or(1.25, |v| v.parse().expect("GIB"));
    let region_mib: u64 = args.get(3).map_or(256, |v| v.parse().expect("REGION_MIB"));
    let bytes = (gib * f64::from(1u32 << 30)) as u64;
    let region = region_mib << 20;
    let config = config(&dir, bytes * 2 + region, region);
    {
        let store = Store::open(config.clone()).expect("open");
        let values = bytes / VALUE as u64;
        for i in 0..values {
            let value = vec![(i % 251) as u8 + 1; VALUE];
            store.put(format!("block-{i}"), value).expect("put");
        }
        store.close().expect("close");
    }
    let marker = dir.join("clean-shutdown");
    let (clean, clean_report, entries) = time_opens(&config, || {});
    let (unclean, unclean_report, _) = time_opens(&config, || {
        let _ = std::fs::remove_file(&marker);
    });
    // Damage every batch record (its first page: magic and lengths), so
    // nothing verifies and recovery crosses every page of every region.
    for path in region_files(&dir) {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .expect("region file");
        let len = file.metadata().expect("metadata").len();
        let mut at = 4096;
        let mut page = vec![0u8; 4096];
        while at + 4096 <= len {
            file.read_exact_at(&mut page, at).expect("read");
            if &page[..8] == b"KVTBATCH" {
                page[..8].copy_from_slice(b"DAMAGED!");
                file.write_all_at(&page, at).expect("write");
            }
            at += 4096;
        }
        file.sync_all().expect("sync");
    }
    let (damaged, damaged_report, damaged_entries) = time_opens(&config, || {});
    println!(
        "{{\"bytes\": {}, \"region_bytes\": {region}, \"regions\": {}, \"entries\": {entries}, \
         \"clean_open_s\": {:.3}, \"clean_open_runs_s\": {clean:?}, \
         \"unclean_open_s\": {:.3}, \"unclean_open_runs_s\": {unclean:?}, \
         \"scrubbed_entries\": {}, \"scrub_ms\": {}, \
         \"damaged_open_s\": {:.3}, \"damaged_open_runs_s\": {damaged:?}, \
         \"damaged_skipped_pages\": {}, \"damaged_entries\": {damaged_entries}}}",
        bytes,
        clean_report.regions,
        median(clean.clone()),
        median(unclean.clone()),
        unclean_report.scrubbed_entries,
        unclean_report.scrub_ms,
        median(damaged.clone()),
        damaged_report.skipped_pages,
    );
}
