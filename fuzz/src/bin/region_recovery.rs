//! Any bytes as a region file, recovered by the disk tier. Properties:
//! - recovery never panics and never fails on bad content (it skips or
//!   quarantines what it cannot read);
//! - every entry it applies carries a digest keyed from its own key;
//! - recovery changes nothing it keeps: opening the directory again
//!   recovers exactly the same entries.

use kvtier::internals::{DiskTier, RecoveryChecks};
use kvtier::{Config, IoEngineKind, KeySecret};
use kvtier_fuzz::{sample_region, NODE_ID};
use std::sync::Arc;

fn recover(config: &Config, secret: &Arc<KeySecret>) -> Vec<(u64, u128, u32, u32)> {
    let mut seen = Vec::new();
    // Region files named by id alone (format 2's names) are still read.
    let node_id = NODE_ID;
    let checks = RecoveryChecks {
        identity_confirmed: true,
        scrub_tail: true,
        // Records only: the fuzzer's input is the region files.
        recorded: None,
    };
    let log_dir = config.data_dir().to_path_buf();
    let (_tier, _report) =
        DiskTier::open(config, &log_dir, Arc::clone(secret), node_id, checks, |r| {
            assert_eq!(secret.digest_qualified(&r.entry.key), r.entry.digest);
            seen.push((r.entry.seq, r.entry.digest.0, r.loc.region(), r.loc.page()));
        })
        .expect("recovery of damaged content must not fail");
    seen
}

fn main() {
    let dir = std::env::temp_dir().join(format!("kvtier-fuzz-recovery-{}", std::process::id()));
    let secret = Arc::new(KeySecret::from_bytes([7; 32]));
    if let Ok(out) = std::env::var("KVTIER_FUZZ_SEEDS") {
        std::fs::write(format!("{out}/region"), sample_region(&secret)).unwrap();
        return;
    }
    afl::fuzz!(|data: &[u8]| {
        let config = Config::new(&dir)
            .io_engine(IoEngineKind::Psync)
            .io_threads(1)
            .direct_io(false)
            .disk_capacity(64 << 20)
            .region_size(1 << 20);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("regions")).unwrap();
        std::fs::write(dir.join("regions").join("00000000.kvr"), data).unwrap();
        let first = recover(&config, &secret);
        let second = recover(&config, &secret);
        assert_eq!(first, second, "a second recovery saw something else");
    });
}
