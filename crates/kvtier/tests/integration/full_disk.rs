//! A real full disk: a 64 MiB ext4 file system on a loop device (the test
//! needs root to mount it, which CI has; without it the test fails, it
//! never skips). The store runs with a configured capacity far above what
//! the file system holds, so the file system fills first:
//!
//! - writes fail with ENOSPC; the store reclaims what it can and retries;
//! - with nothing left to reclaim, unwritten values stay pinned, the pool
//!   fills, and puts fail with `NoSpace` after their bounded wait;
//! - gets keep working throughout, and never return wrong bytes;
//! - when space returns, the retries land by themselves, flush succeeds,
//!   and after a reopen every value acknowledged since is there.

use crate::common::*;
use kvtier::{Config, ErrorKind};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// A mounted loop file system, unmounted on drop.
struct LoopFs {
    mount: PathBuf,
    _dir: tempfile::TempDir,
}

impl LoopFs {
    fn new(size_mib: u64) -> LoopFs {
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("fs.img");
        let mount = dir.path().join("mnt");
        std::fs::create_dir(&mount).unwrap();
        std::fs::File::create(&image)
            .unwrap()
            .set_len(size_mib * MIB)
            .unwrap();
        let run = |cmd: &str, args: &[&Path]| {
            let status = Command::new(cmd).args(args).status().unwrap_or_else(|e| {
                panic!("{cmd} is needed for the full-disk test (e2fsprogs, mount): {e}")
            });
            assert!(
                status.success(),
                "{cmd} {args:?} failed: the full-disk test mounts a loop device and needs root"
            );
        };
        run("mkfs.ext4", &[Path::new("-q"), Path::new("-F"), &image]);
        run(
            "mount",
            &[Path::new("-o"), Path::new("loop"), &image, &mount],
        );
        LoopFs { mount, _dir: dir }
    }
}

impl Drop for LoopFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mount).status();
    }
}

/// Fills the file system with a file until it is full; returns its path.
fn fill_up(dir: &Path) -> PathBuf {
    let path = dir.join("filler");
    let mut file = std::fs::File::create(&path).unwrap();
    let chunk = vec![0x5Au8; 256 * 1024];
    while file.write_all(&chunk).is_ok() {}
    let _ = file.sync_all();
    path
}

fn config(dir: &Path) -> Config {
    Config::new(dir)
        .io_engine(engine())
        .memory_capacity(16 * MIB)
        .disk_capacity(1024 * MIB)
        .region_size(MIB)
        .put_wait(Duration::from_millis(300))
}

const VALUE: usize = 256 * 1024;

#[test]
fn a_full_disk_fails_puts_cleanly_and_recovers_by_itself() {
    for_each_engine(|_| {
        let fs = LoopFs::new(64);
        let data = fs.mount.join("data");
        let store = open(config(&data));
        for i in 0..8 {
            store.put(key(i), value_for(&key(i), 1, VALUE)).unwrap();
        }
        store.flush().unwrap();

        let filler = fill_up(&fs.mount);
        // Puts until the pool is full of values the disk cannot take.
        let mut accepted = Vec::new();
        let mut refused = None;
        for i in 100..400u64 {
            match store.put(key(i), value_for(&key(i), 2, VALUE)) {
                Ok(()) => accepted.push(i),
                Err(e) => {
                    refused = Some(e);
                    break;
                }
            }
        }
        let err = refused.expect("puts never stopped on a full disk");
        assert_eq!(err.kind(), ErrorKind::NoSpace, "{err}");
        assert!(!accepted.is_empty());
        assert!(store.flush().is_err(), "flush must not claim durability");
        assert!(store.stats().retrying_writes > 0);
        // Gets keep working: every accepted value, exactly; the early
        // ones are there or reclaimed (a miss), never wrong.
        for &i in &accepted {
            assert_eq!(
                store.get(key(i)).unwrap().unwrap(),
                value_for(&key(i), 2, VALUE)
            );
        }
        for i in 0..8 {
            if let Some(v) = store.get(key(i)).unwrap() {
                assert_eq!(v, value_for(&key(i), 1, VALUE));
            }
        }

        // Space returns: the store catches up by itself.
        std::fs::remove_file(&filler).unwrap();
        let caught_up = flush_succeeds_within(&store, 500);
        assert!(caught_up, "the store did not recover when space returned");
        store
            .put(key(1000), value_for(&key(1000), 3, VALUE))
            .unwrap();
        store.flush().unwrap();
        store.close().unwrap();

        let store = open(config(&data));
        for &i in accepted.iter().chain([1000u64].iter()) {
            let version = if i == 1000 { 3 } else { 2 };
            assert_eq!(
                store.get(key(i)).unwrap().unwrap(),
                value_for(&key(i), version, VALUE),
                "key {i} acknowledged by the flush that followed recovery"
            );
        }
        assert_eq!(store.stats().checksum_failures, 0);
        drop(store);
    });
}
