//! A data directory damaged by a careless operator, a failing disk or a
//! hostile local writer: recovery never destroys what the damage did not
//! touch, never brings a removed key back, never reports a key it cannot
//! read, and never hangs or refuses the whole open for one bad file.

use crate::common::*;
use kvtier::internals::format::BatchHeader;
use kvtier::{ErrorKind, Store};
use std::fs::{self, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const VALUE: usize = DAMAGE_VALUE;

/// Opens `dir` on a thread and fails if the open takes longer than a
/// minute (a hang; not a timing assertion on speed).
fn open_bounded(dir: &Path) -> kvtier::Result<Store> {
    let config = small_config(dir);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(Store::open(config));
    });
    rx.recv_timeout(Duration::from_secs(60))
        .expect("the open hung on damaged content")
}

fn quarantined(dir: &Path) -> usize {
    fs::read_dir(dir.join("quarantine")).map_or(0, |d| {
        d.filter(|e| {
            !e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .ends_with(".why")
        })
        .count()
    })
}

/// Finding 1: one flipped bit in `key-secret` is refused by name, nothing
/// is moved or reclaimed, and the right secret brings every value back.
/// An older directory (no `key-check`) is refused too, when nothing in it
/// verifies under the secret but something would under another.
#[test]
fn a_damaged_key_secret_is_refused_and_destroys_nothing() {
    for_each_engine(|_| {
        let dir = tempfile::tempdir().unwrap();
        let n = 30;
        fill(dir.path(), n);
        let secret_path = dir.path().join("key-secret");
        let good = fs::read(&secret_path).unwrap();
        let mut bad = good.clone();
        bad[3] ^= 0x10;
        fs::write(&secret_path, &bad).unwrap();
        let e = open_bounded(dir.path()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corruption, "{e}");
        assert!(e.to_string().contains("key-check"), "{e}");

        // As a directory written before key-check existed.
        fs::remove_file(dir.path().join("key-check")).unwrap();
        let regions_before = region_files(dir.path());
        let e = open_bounded(dir.path()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corruption, "{e}");
        assert!(e.to_string().contains("key-secret"), "{e}");
        assert_eq!(region_files(dir.path()), regions_before, "nothing moved");
        assert_eq!(quarantined(dir.path()), 0);

        fs::write(&secret_path, &good).unwrap();
        let store = open(small_config(dir.path()));
        assert_eq!(check_all(&store, n), n, "every value is back");
        store.close().unwrap();
        // The first verified open wrote the check value back.
        assert!(dir.path().join("key-check").exists());
    });
}

/// Finding 2: a batch length that would wrap the scan's offset (the record
/// trailer recomputed, as anyone who can write the file can) is damage,
/// not a loop; the batches around it still verify.
#[test]
fn a_wrapping_batch_length_never_hangs_the_open() {
    for_each_engine(|_| {
        let dir = tempfile::tempdir().unwrap();
        let n = 30;
        fill(dir.path(), n);
        let files = region_files(dir.path());
        // Records an earlier build wrote, whose trailer is a checksum
        // alone (still read in a data directory): the forger's way in.
        unbind_records(&files[0], &secret_of(dir.path()));
        let offsets = batch_offsets(&files[0]);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&files[0])
            .unwrap();
        let at = offsets[1];
        let mut page = vec![0u8; 4096];
        file.read_exact_at(&mut page, at).unwrap();
        let record_len = u32::from_le_bytes(page[20..24].try_into().unwrap()) as usize;
        // u64::MAX rounded down to a page: offset + batch_len wraps.
        let huge = u64::MAX / 4096 * 4096 - at + 4096;
        page[24..32].copy_from_slice(&huge.to_le_bytes());
        let sum = xxhash_rust::xxh3::xxh3_64(&page[..record_len - 8]);
        page[record_len - 8..record_len].copy_from_slice(&sum.to_le_bytes());
        file.write_all_at(&page, at).unwrap();
        file.sync_all().unwrap();
        drop(file);
        forget_checkpoint(dir.path());
        let store = open_bounded(dir.path()).unwrap();
        let hits = check_all(&store, n);
        assert!(
            (n - 5..n).contains(&hits),
            "{hits}: only the forged batch is lost"
        );
    });
}

/// A tmpfs-like file system that refuses O_DIRECT (ramfs), mounted for the
/// test (root needed, as CI has; without it the test fails, never skips).
struct Ramfs {
    mount: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Ramfs {
    fn new() -> Ramfs {
        let dir = tempfile::tempdir().unwrap();
        let mount = dir.path().join("ramfs");
        fs::create_dir(&mount).unwrap();
        let status = Command::new("mount")
            .args(["-t", "ramfs", "none"])
            .arg(&mount)
            .status()
            .expect("mount is needed for the per-file O_DIRECT test");
        assert!(
            status.success(),
            "mounting ramfs failed: this test needs root (CI has it); it never skips"
        );
        Ramfs { mount, _dir: dir }
    }
}

impl Drop for Ramfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mount).status();
    }
}

/// Finding 3: a region file on a file system that refuses O_DIRECT
/// (moved there and linked back) is read buffered on its own; every other
/// region keeps O_DIRECT and every key reads, through aligned and
/// unaligned buffers.
#[test]
fn one_file_refusing_o_direct_leaves_the_others_direct() {
    for_each_engine(|_| {
        let dir = tempfile::tempdir().unwrap();
        let ramfs = Ramfs::new();
        let n = 40;
        fill(dir.path(), n);
        let files = region_files(dir.path());
        assert!(files.len() >= 3, "{files:?}");
        let moved = ramfs.mount.join("moved.kvr");
        fs::copy(&files[1], &moved).unwrap();
        fs::remove_file(&files[1]).unwrap();
        std::os::unix::fs::symlink(&moved, &files[1]).unwrap();
        let store = open(small_config(dir.path()));
        assert_eq!(store.recovery_report().buffered_regions, 1);
        assert_eq!(store.stats().buffered_regions, 1);
        assert!(store.stats().direct_io, "the directory keeps O_DIRECT");
        assert_eq!(check_all(&store, n), n);
        let mut aligned = kvtier::AlignedBuf::zeroed(VALUE);
        let mut unaligned = vec![0u8; VALUE + 1];
        for i in 0..n {
            for direct in [true, false] {
                let buf: &mut [u8] = if direct {
                    &mut aligned.as_mut_slice()[..VALUE]
                } else {
                    &mut unaligned[1..]
                };
                let got = store.batch_get_into(&[key(i)], &mut [buf]).remove(0);
                assert_eq!(got.unwrap(), Some(VALUE), "key {i}");
            }
        }
        drop(store);
    });
}

/// Finding 4: a region file deleted under a running store counts as
/// removed when reclaim reaches it; the tier stays within its capacity
/// and flushes keep succeeding.
#[test]
fn a_region_deleted_under_a_running_store_does_not_wedge_reclaim() {
    for_each_engine(|_| {
        let dir = tempfile::tempdir().unwrap();
        let config = small_config(dir.path()).disk_capacity(8 * MIB);
        let store = open(config);
        for i in 0..40 {
            store.put(key(i), value_for(&key(i), 7, VALUE)).unwrap();
        }
        store.flush().unwrap();
        let first = region_files(dir.path()).remove(0);
        fs::remove_file(&first).unwrap();
        for i in 40..400 {
            store.put(key(i), value_for(&key(i), 7, VALUE)).unwrap();
            if i % 10 == 0 {
                store.flush().unwrap();
            }
        }
        store.flush().unwrap();
        let stats = store.stats();
        assert!(stats.disk_used_bytes <= 8 * MIB, "{stats:?}");
        assert!(stats.reclaimed_regions > 0);
        store.close().unwrap();
    });
}

/// Finding 5: a region whose records no longer read when reclaim comes
/// leaves no index entry behind: `exists` and `prefix_len` do not count
/// keys whose every read misses.
#[test]
fn no_phantoms_after_reclaiming_a_region_whose_records_do_not_read() {
    for_each_engine(|_| {
        let dir = tempfile::tempdir().unwrap();
        let config = small_config(dir.path())
            .disk_capacity(8 * MIB)
            .memory_capacity(MIB);
        let store = open(config);
        let old: Vec<Vec<u8>> = (0..12).map(|i| format!("old-{i}").into_bytes()).collect();
        for k in &old {
            store.put(k, value_for(k, 1, VALUE)).unwrap();
        }
        store.flush().unwrap();
        // Damage every batch record of the oldest region in place.
        let first = region_files(dir.path()).remove(0);
        let file = OpenOptions::new().write(true).open(&first).unwrap();
        for offset in batch_offsets(&first) {
            file.write_all_at(&[0u8; 64], offset).unwrap();
        }
        file.sync_all().unwrap();
        drop(file);
        for i in 0..300 {
            store.put(key(i), value_for(&key(i), 7, VALUE)).unwrap();
            if i % 10 == 0 {
                store.flush().unwrap();
            }
        }
        store.flush().unwrap();
        assert!(
            !region_files(dir.path()).contains(&first),
            "the damaged region was reclaimed"
        );
        for k in &old {
            assert_eq!(store.get(k).unwrap(), None);
        }
        assert_eq!(store.batch_exists(&old), vec![false; old.len()]);
        assert_eq!(store.prefix_len(&old), 0);
        store.close().unwrap();
    });
}

/// Finding 6: one damaged byte in a region header hides nothing: the
/// region's batches verify on their own, its removes stay removes.
#[test]
fn a_damaged_region_header_keeps_its_batches_and_its_removes() {
    for_each_engine(|_| {
        let dir = tempfile::tempdir().unwrap();
        let n = 12;
        {
            let store = open(small_config(dir.path()));
            for i in 0..n {
                store.put(key(i), value_for(&key(i), 7, VALUE)).unwrap();
            }
            store.flush().unwrap();
            for i in 0..6 {
                assert!(store.remove(key(i)).unwrap());
            }
            store.close().unwrap();
        }
        let files = region_files(dir.path());
        assert_eq!(files.len(), 1, "one region holds the puts and removes");
        flip(&files[0], 13); // the region id in the header
        forget_checkpoint(dir.path());
        let store = open(small_config(dir.path()));
        let report = store.recovery_report().clone();
        assert_eq!(report.damaged_headers, 1, "{report:?}");
        assert_eq!(report.quarantined_regions, 0, "{report:?}");
        for i in 0..6 {
            assert_eq!(
                store.get(key(i)).unwrap(),
                None,
                "removed key {i} came back"
            );
        }
        for i in 6..n {
            assert_eq!(
                store.get(key(i)).unwrap().unwrap(),
                value_for(&key(i), 7, VALUE)
            );
        }
        store.close().unwrap();
    });
}

/// Finding 7: whatever sits under a region name that is not a usable
/// region file (a directory, dangling and looping links, a FIFO, a socket,
/// a link to /dev/null, a mode-000 file, ids at the top of the id space)
/// is set aside; the open succeeds, every value reads, writes continue.
#[test]
fn unusable_things_under_region_names_do_not_refuse_the_open() {
    for_each_engine(|_| {
        let dir = tempfile::tempdir().unwrap();
        let n = 20;
        fill(dir.path(), n);
        let regions = dir.path().join("regions");
        fs::create_dir(regions.join("00001000.kvr")).unwrap();
        std::os::unix::fs::symlink(regions.join("nowhere"), regions.join("00001001.kvr")).unwrap();
        std::os::unix::fs::symlink(regions.join("00001002.kvr"), regions.join("00001002.kvr"))
            .unwrap();
        let fifo = std::ffi::CString::new(
            regions
                .join("00001003.kvr")
                .to_str()
                .unwrap()
                .as_bytes()
                .to_vec(),
        )
        .unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        let _socket = std::os::unix::net::UnixListener::bind(regions.join("00001004.kvr")).unwrap();
        std::os::unix::fs::symlink("/dev/null", regions.join("00001005.kvr")).unwrap();
        fs::write(regions.join("00001006.kvr"), vec![0xAB; 8192]).unwrap();
        fs::set_permissions(
            regions.join("00001006.kvr"),
            std::os::unix::fs::PermissionsExt::from_mode(0o000),
        )
        .unwrap();
        fs::write(regions.join("fffffffe.kvr"), vec![0xCD; 8192]).unwrap();
        fs::write(regions.join("ffffffff.kvr"), vec![0xCD; 8192]).unwrap();
        let store = open_bounded(dir.path()).unwrap();
        let report = store.recovery_report().clone();
        assert_eq!(
            report.quarantined_regions + report.skipped_files,
            9,
            "{report:?}"
        );
        assert_eq!(check_all(&store, n), n);
        // Writes continue (no id was taken from the top of the space).
        store.put(b"after", value_for(b"after", 1, VALUE)).unwrap();
        store.flush().unwrap();
        store.close().unwrap();
        let store = open(small_config(dir.path()));
        assert_eq!(check_all(&store, n), n);
        assert!(store.get(b"after").unwrap().is_some());
        store.close().unwrap();
    });
}

/// Finding 7: a quarantine never overwrites an earlier quarantined file of
/// the same name (two opens within one second quarantine the same name).
#[test]
fn quarantine_names_never_collide() {
    let dir = tempfile::tempdir().unwrap();
    fill(dir.path(), 5);
    let regions = dir.path().join("regions");
    for round in 0..3u8 {
        fs::write(regions.join("000000fe.kvr"), vec![round; 8192]).unwrap();
        open(small_config(dir.path())).close().unwrap();
    }
    assert_eq!(quarantined(dir.path()), 3);
    let mut contents: Vec<u8> = fs::read_dir(dir.path().join("quarantine"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_none_or(|x| x != "why"))
        .map(|p| fs::read(p).unwrap()[0])
        .collect();
    contents.sort_unstable();
    assert_eq!(contents, vec![0, 1, 2], "every quarantined file kept");
}

/// Finding 7: deleting `LOCK` does not let a second store open the
/// directory (the directory itself is locked).
#[test]
fn deleting_the_lock_file_does_not_admit_a_second_store() {
    let dir = tempfile::tempdir().unwrap();
    let first = open(small_config(dir.path()));
    fs::remove_file(dir.path().join("LOCK")).unwrap();
    let e = Store::open(small_config(dir.path())).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Locked, "{e}");
    first.close().unwrap();
    open(small_config(dir.path())).close().unwrap();
}

/// Finding 7 (deleted region files): a region missing from the middle of
/// the log, or the newest one the log head names, may have held the
/// tombstones of older puts: those older entries are not indexed, so no
/// removed key comes back; newer regions are kept.
#[test]
fn missing_regions_never_resurrect_removed_keys() {
    for_each_engine(|_| {
        for missing in ["middle", "newest"] {
            let dir = tempfile::tempdir().unwrap();
            {
                let store = open(small_config(dir.path()));
                // Region A: the puts. Region B: only the removes. Region C:
                // later puts (only in the "middle" case).
                for i in 0..10 {
                    store.put(key(i), value_for(&key(i), 7, VALUE)).unwrap();
                }
                for i in 10..24 {
                    store.put(key(i), value_for(&key(i), 7, VALUE)).unwrap();
                }
                store.flush().unwrap();
                for i in 0..5 {
                    assert!(store.remove(key(i)).unwrap());
                }
                store.flush().unwrap();
                if missing == "middle" {
                    for i in 100..130 {
                        store.put(key(i), value_for(&key(i), 7, VALUE)).unwrap();
                    }
                }
                store.close().unwrap();
            }
            // The regions holding the tombstones: batches of a record alone.
            let files = region_files(dir.path());
            let tombstones: Vec<_> = files
                .iter()
                .filter(|f| {
                    let bytes = fs::read(f).unwrap();
                    batch_offsets(f).iter().any(|&at| {
                        BatchHeader::decode(&bytes[at as usize..], &origin_of(f))
                            .unwrap()
                            .batch_len
                            == 4096
                    })
                })
                .cloned()
                .collect();
            assert!(!tombstones.is_empty());
            assert_eq!(
                tombstones.contains(files.last().unwrap()),
                missing == "newest",
                "{missing}: {tombstones:?} of {files:?}"
            );
            for f in &tombstones {
                fs::remove_file(f).unwrap();
            }
            let store = open(small_config(dir.path()));
            assert!(store.recovery_report().regions_behind_gap > 0);
            for i in 0..5 {
                assert_eq!(
                    store.get(key(i)).unwrap(),
                    None,
                    "{missing}: key {i} came back"
                );
                assert!(!store.exists(key(i)));
            }
            if missing == "middle" {
                // Newer regions are kept (the deleted one held some of
                // these puts too: at most a region's worth).
                let mut kept = 0;
                for i in 100..130 {
                    if let Some(v) = store.get(key(i)).unwrap() {
                        assert_eq!(v, value_for(&key(i), 7, VALUE));
                        kept += 1;
                    }
                }
                assert!(kept >= 10, "{kept} newer keys kept");
            }
            store.close().unwrap();
        }
    });
}

/// Finding 8: a device that acknowledged a flush it did not do loses the
/// tail of the newest region after an unclean shutdown; the records
/// survive, their values do not. The tail scrub verifies those values
/// before `exists` reports them.
#[test]
fn the_tail_scrub_drops_values_a_lying_device_lost() {
    for_each_engine(|_| {
        let dir = tempfile::tempdir().unwrap();
        let n = 30;
        fill(dir.path(), n);
        // An unclean shutdown: no marker of a clean close.
        fs::remove_file(dir.path().join("clean-shutdown")).unwrap();
        // Every value of the newest region's last batch lost; its record kept.
        let newest = region_files(dir.path()).pop().unwrap();
        let len = fs::metadata(&newest).unwrap().len();
        let last = *batch_offsets(&newest).last().unwrap();
        let bytes = fs::read(&newest).unwrap();
        let lost = u64::from(
            BatchHeader::decode(&bytes[last as usize..], &origin_of(&newest))
                .unwrap()
                .entries,
        );
        let file = OpenOptions::new().write(true).open(&newest).unwrap();
        let zeros = vec![0u8; (len - last - 4096) as usize];
        file.write_all_at(&zeros, last + 4096).unwrap();
        file.sync_all().unwrap();
        drop(file);
        let store = open(small_config(dir.path()));
        let report = store.recovery_report().clone();
        assert_eq!(report.scrub_dropped, lost, "{report:?}");
        assert!(report.scrubbed_entries > report.scrub_dropped, "{report:?}");
        let hits = check_all(&store, n);
        assert_eq!(hits, n - lost);
        assert_eq!(store.stats().checksum_failures, 0, "no read found a loss");
        store.close().unwrap();
        // After a clean close there is nothing to scrub.
        let store = open(small_config(dir.path()));
        assert_eq!(store.recovery_report().scrubbed_entries, 0);
        assert_eq!(check_all(&store, n), hits);
    });
}

mod model {
    //! Model-based property test over directory damage: runs of puts,
    //! overwrites and removes, each run closed and the directory damaged
    //! (truncations, byte flips in values, records and headers, deleted,
    //! duplicated, renamed and replaced files, an unclean shutdown), then
    //! reopened and checked against a per-key model:
    //! - 0 wrong bytes: a hit is always the exact bytes of a version that
    //!   was put for that key (never another key's, never torn);
    //! - 0 resurrected removes and 0 stale versions for keys the damage did
    //!   not touch (a key is touched when a record of it lies in a damaged
    //!   file or a file older than a missing one: those may read as any of
    //!   their versions or miss);
    //! - 0 phantoms: `exists` implies a hit, unless the read found damage;
    //! - nothing acknowledged and untouched is lost;
    //! - every open finishes (bounded) and none is refused.
    //!
    //! `KVTIER_DAMAGE_CASES` sets the case count (CI: the default; the long
    //! run is `scripts/damage-campaign`).

    use super::*;
    use kvtier::internals::format::REGION_HEADER_LEN;
    use kvtier::KeySecret;
    use proptest::prelude::*;
    use std::collections::{BTreeSet, HashMap};
    use std::path::PathBuf;

    const KEYS: u8 = 16;

    #[derive(Debug, Clone)]
    enum Op {
        Put { key: u8, pages: u8 },
        Remove { key: u8 },
        Flush,
    }

    #[derive(Debug, Clone)]
    enum Damage {
        None,
        FlipValue { file: usize, at: u64 },
        FlipRecord { file: usize, batch: usize, at: u64 },
        FlipHeader { file: usize, at: u64 },
        TruncateNewest { pages: u64 },
        Delete { file: usize },
        Duplicate { file: usize },
        Rename { file: usize },
        Replace { file: usize, byte: u8 },
        Unclean,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (0..KEYS, 1u8..5).prop_map(|(key, pages)| Op::Put { key, pages }),
            2 => (0..KEYS).prop_map(|key| Op::Remove { key }),
            1 => Just(Op::Flush),
        ]
    }

    fn damage() -> impl Strategy<Value = Damage> {
        let file = any::<usize>();
        prop_oneof![
            1 => Just(Damage::None),
            2 => (file, any::<u64>()).prop_map(|(file, at)| Damage::FlipValue { file, at }),
            2 => (file, any::<usize>(), 0u64..4096)
                .prop_map(|(file, batch, at)| Damage::FlipRecord { file, batch, at }),
            2 => (file, 0u64..32).prop_map(|(file, at)| Damage::FlipHeader { file, at }),
            2 => (1u64..6).prop_map(|pages| Damage::TruncateNewest { pages }),
            1 => file.prop_map(|file| Damage::Delete { file }),
            1 => file.prop_map(|file| Damage::Duplicate { file }),
            1 => file.prop_map(|file| Damage::Rename { file }),
            1 => (file, any::<u8>()).prop_map(|(file, byte)| Damage::Replace { file, byte }),
            1 => Just(Damage::Unclean),
        ]
    }

    fn config(dir: &Path, engine: kvtier::IoEngineKind) -> kvtier::Config {
        kvtier::Config::new(dir)
            .memory_capacity(MIB)
            .disk_capacity(16 * MIB)
            .region_size(64 * KIB)
            .io_engine(engine)
    }

    fn mkey(k: u8) -> Vec<u8> {
        format!("model-{k}").into_bytes()
    }

    fn value(k: u8, version: u32, pages: u8) -> Vec<u8> {
        value_for(&mkey(k), u64::from(version), usize::from(pages) * 4000 + 7)
    }

    /// Keys with any record in `path`, and where its batches start.
    fn records_of(path: &Path, secret: &KeySecret) -> (BTreeSet<u8>, Vec<u64>) {
        let mut keys = BTreeSet::new();
        let mut batches = Vec::new();
        for (at, entries) in verified_records(path, secret) {
            batches.push(at);
            for e in entries {
                // Default namespace: a zero length byte, then the key.
                let k = std::str::from_utf8(&e.key[1..]).unwrap();
                keys.insert(k.trim_start_matches("model-").parse().unwrap());
            }
        }
        (keys, batches)
    }

    /// Applies `damage`; returns the keys it touched.
    fn apply(dir: &Path, damage: &Damage) -> BTreeSet<u8> {
        let secret = secret_of(dir);
        let files = region_files(dir);
        let mut touched = BTreeSet::new();
        if files.is_empty() {
            return touched;
        }
        let pick = |i: usize| files[i % files.len()].clone();
        let older_than = |path: &PathBuf, touched: &mut BTreeSet<u8>| {
            // A missing region hides everything older than it too.
            for f in &files {
                if region_id(f) <= region_id(path) {
                    touched.extend(records_of(f, &secret).0);
                }
            }
        };
        match damage {
            Damage::None | Damage::Unclean => {}
            Damage::FlipValue { file, at } => {
                let f = pick(*file);
                let len = fs::metadata(&f).unwrap().len();
                if len > REGION_HEADER_LEN {
                    touched.extend(records_of(&f, &secret).0);
                    flip(&f, REGION_HEADER_LEN + at % (len - REGION_HEADER_LEN));
                }
            }
            Damage::FlipRecord { file, batch, at } => {
                let f = pick(*file);
                let (keys, batches) = records_of(&f, &secret);
                if !batches.is_empty() {
                    touched.extend(keys);
                    let start = batches[batch % batches.len()];
                    flip(&f, start + at % 200);
                }
            }
            Damage::FlipHeader { file, at } => flip(&pick(*file), *at),
            Damage::TruncateNewest { pages } => {
                let f = files.last().unwrap().clone();
                let len = fs::metadata(&f).unwrap().len();
                touched.extend(records_of(&f, &secret).0);
                let cut = len.saturating_sub(pages * 4096).max(REGION_HEADER_LEN);
                OpenOptions::new()
                    .write(true)
                    .open(&f)
                    .unwrap()
                    .set_len(cut)
                    .unwrap();
            }
            Damage::Delete { file } => {
                let f = pick(*file);
                older_than(&f, &mut touched);
                fs::remove_file(&f).unwrap();
            }
            Damage::Duplicate { file } => {
                let f = pick(*file);
                let name = f.file_name().unwrap().to_str().unwrap().to_string();
                let parts: Vec<&str> = name.split('-').collect();
                // A name no file has (never the source itself: a copy onto
                // itself would empty it).
                let twin = (1u64..)
                    .map(|n| f.with_file_name(format!("{}-{n:016x}-{}", parts[0], parts[2])))
                    .find(|twin| !twin.exists())
                    .unwrap();
                fs::copy(&f, twin).unwrap();
            }
            Damage::Rename { file } => {
                let f = pick(*file);
                older_than(&f, &mut touched);
                let name = f.file_name().unwrap().to_str().unwrap().to_string();
                let parts: Vec<&str> = name.split('-').collect();
                let renamed = format!("{}-{}-{:08x}.kvr", parts[0], parts[1], region_id(&f) + 1000);
                fs::rename(&f, f.with_file_name(renamed)).unwrap();
            }
            Damage::Replace { file, byte } => {
                let f = pick(*file);
                older_than(&f, &mut touched);
                let len = fs::metadata(&f).unwrap().len() as usize;
                fs::write(&f, vec![*byte; len]).unwrap();
            }
        }
        if matches!(damage, Damage::Unclean) {
            let _ = fs::remove_file(dir.join("clean-shutdown"));
        }
        touched
    }

    /// Per key: every version ever put (by number) and the newest state.
    #[derive(Debug, Default, Clone)]
    struct Model {
        versions: HashMap<u8, Vec<(u32, u8)>>,
        latest: HashMap<u8, Option<(u32, u8)>>,
        /// Keys the damage touched since they were last written.
        touched: BTreeSet<u8>,
    }

    fn run(
        rounds: Vec<(Vec<Op>, Damage)>,
        engine: kvtier::IoEngineKind,
    ) -> Result<(), TestCaseError> {
        let dir = tempfile::tempdir().unwrap();
        let mut model = Model::default();
        let mut next_version = 1u32;
        for (ops, damage) in rounds {
            let store = {
                let config = config(dir.path(), engine);
                let (tx, rx) = std::sync::mpsc::channel();
                std::thread::spawn(move || {
                    let _ = tx.send(Store::open(config));
                });
                rx.recv_timeout(Duration::from_secs(60))
                    .map_err(|_| TestCaseError::fail("an open hung"))?
                    .map_err(|e| TestCaseError::fail(format!("open refused: {e}")))?
            };
            if std::env::var("KVTIER_DAMAGE_DEBUG").is_ok() {
                eprintln!("open: {:?}", store.recovery_report());
            }
            check(&store, &model)?;
            for op in ops {
                match op {
                    Op::Put { key, pages } => {
                        let v = next_version;
                        next_version += 1;
                        store.put(mkey(key), value(key, v, pages)).unwrap();
                        model.versions.entry(key).or_default().push((v, pages));
                        model.latest.insert(key, Some((v, pages)));
                        model.touched.remove(&key);
                    }
                    Op::Remove { key } => {
                        store.remove(mkey(key)).unwrap();
                        model.latest.insert(key, None);
                        model.touched.remove(&key);
                    }
                    Op::Flush => store.flush().unwrap(),
                }
            }
            store.close().unwrap();
            drop(store);
            if std::env::var("KVTIER_DAMAGE_DEBUG").is_ok() {
                eprintln!(
                    "damage {damage:?} on {:?}",
                    region_files(dir.path())
                        .iter()
                        .map(|f| (
                            f.file_name().unwrap().to_owned(),
                            fs::metadata(f).unwrap().len()
                        ))
                        .collect::<Vec<_>>()
                );
            }
            model.touched.extend(apply(dir.path(), &damage));
        }
        let store = Store::open(config(dir.path(), engine))
            .map_err(|e| TestCaseError::fail(format!("final open refused: {e}")))?;
        check(&store, &model)
    }

    fn check(store: &Store, model: &Model) -> Result<(), TestCaseError> {
        for k in 0..KEYS {
            let failures_before = store.stats().checksum_failures;
            let exists = store.exists(mkey(k));
            let got = store.get(mkey(k)).unwrap();
            let damage_found = store.stats().checksum_failures > failures_before;
            prop_assert!(
                !exists || got.is_some() || damage_found,
                "key {k}: exists, but reads as a miss with no damage found"
            );
            let versions = model.versions.get(&k).cloned().unwrap_or_default();
            let latest = model.latest.get(&k).copied().flatten();
            let touched = model.touched.contains(&k);
            match &got {
                Some(bytes) => {
                    let which = versions
                        .iter()
                        .find(|(v, pages)| value(k, *v, *pages) == *bytes);
                    prop_assert!(which.is_some(), "key {k}: bytes of no version of it");
                    let (v, _) = which.unwrap();
                    if !touched {
                        prop_assert!(
                            latest.is_some_and(|(l, _)| l == *v),
                            "key {k}: version {v} read, the model has {latest:?} (removed or overwritten, untouched)"
                        );
                    }
                }
                None => {
                    prop_assert!(
                        touched || latest.is_none() || damage_found,
                        "key {k}: acknowledged {latest:?} lost, untouched by damage; {:?}",
                        store.recovery_report()
                    );
                }
            }
        }
        Ok(())
    }

    fn cases() -> u32 {
        std::env::var("KVTIER_DAMAGE_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(300)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: cases(), max_shrink_iters: std::env::var("KVTIER_DAMAGE_DEBUG").map_or(200, |_| 0), ..ProptestConfig::default() })]
        #[test]
        fn damage_never_returns_wrong_bytes_or_resurrects(
            rounds in proptest::collection::vec((proptest::collection::vec(op(), 1..30), damage()), 1..5),
            uring in any::<bool>(),
        ) {
            let engine = if uring { kvtier::IoEngineKind::Uring } else { kvtier::IoEngineKind::Psync };
            run(rounds, engine)?;
        }
    }
}
