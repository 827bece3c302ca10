//! Damaged region files: reads return misses, never wrong bytes, and the
//! store keeps serving.

use crate::common::*;
use kvtier::Store;
use std::fs::{self, OpenOptions};

const VALUE: usize = DAMAGE_VALUE;

fn still_serves(store: &Store) {
    store.put(b"after", value_for(b"after", 1, VALUE)).unwrap();
    store.flush().unwrap();
    assert_eq!(
        store.get(b"after").unwrap().unwrap(),
        value_for(b"after", 1, VALUE)
    );
}

#[test]
fn flipped_value_bytes_become_misses() {
    for_each_engine(|_engine| {
        let dir = tempfile::tempdir().unwrap();
        let n = 40;
        fill(dir.path(), n);
        let mut flipped = 0;
        for path in region_files(dir.path()) {
            for offset in batch_offsets(&path) {
                // Damage the first value of every batch (it follows the record page).
                flip(&path, offset + 4096 + 1234);
                flipped += 1;
            }
        }
        assert!(flipped >= 8, "{flipped}");
        let store = open(small_config(dir.path()));
        let hits = check_all(&store, n);
        let stats = store.stats();
        assert_eq!(stats.checksum_failures, flipped);
        assert_eq!(hits, n - flipped);
        // The damaged entries were dropped: asking again is a plain miss.
        assert_eq!(check_all(&store, n), hits);
        assert_eq!(store.stats().checksum_failures, flipped);
        still_serves(&store);
    });
}

#[test]
fn damage_while_open_is_caught_on_read() {
    for_each_engine(|_engine| {
        let dir = tempfile::tempdir().unwrap();
        fill(dir.path(), 10);
        let store = open(small_config(dir.path()));
        let path = &region_files(dir.path())[0];
        let first_batch = batch_offsets(path)[0];
        flip(path, first_batch + 4096 + 10);
        assert_eq!(check_all(&store, 10), 9);
        assert_eq!(store.stats().checksum_failures, 1);
        still_serves(&store);
    });
}

#[test]
fn flipped_record_bytes_drop_batches_not_correctness() {
    for_each_engine(|_engine| {
        let dir = tempfile::tempdir().unwrap();
        let n = 40;
        fill(dir.path(), n);
        let files = region_files(dir.path());
        // Damage the second batch record of the first region, in the entries.
        let offsets = batch_offsets(&files[0]);
        assert!(offsets.len() >= 3, "{offsets:?}");
        flip(&files[0], offsets[1] + 40); // the first entry: every record has one
        forget_checkpoint(dir.path());
        let store = open(small_config(dir.path()));
        let report = store.recovery_report().clone();
        assert_eq!(report.damaged_regions, 1, "{report:?}");
        let hits = check_all(&store, n);
        // Only the damaged batch is gone: recovery resynchronises on the
        // batches after it.
        assert!(hits >= n - 5 && hits < n, "{hits}");
        assert_eq!(store.stats().checksum_failures, 0);
        still_serves(&store);
    });
}

#[test]
fn torn_tail_and_garbage_files_are_dropped() {
    for_each_engine(|_engine| {
        let dir = tempfile::tempdir().unwrap();
        let n = 40;
        fill(dir.path(), n);
        let files = region_files(dir.path());
        let last = files.last().unwrap();
        let len = fs::metadata(last).unwrap().len();
        // Tear the last batch in half.
        let file = OpenOptions::new().write(true).open(last).unwrap();
        file.set_len(len - 4096 * 7).unwrap();
        drop(file);
        // A region file whose header is garbage, and one cut short.
        fs::write(dir.path().join("regions/000000ff.kvr"), vec![0xAB; 8192]).unwrap();
        fs::write(dir.path().join("regions/000000fe.kvr"), vec![0; 100]).unwrap();
        let store = open(small_config(dir.path()));
        let report = store.recovery_report().clone();
        // Unreadable headers are quarantined, never deleted.
        assert_eq!(report.quarantined_regions, 2, "{report:?}");
        assert!(report.damaged_regions >= 1, "{report:?}");
        let quarantined: Vec<_> = fs::read_dir(dir.path().join("quarantine"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            quarantined.len(),
            4,
            "two files and their reasons: {quarantined:?}"
        );
        assert!(!dir.path().join("regions/000000ff.kvr").exists());
        let hits = check_all(&store, n);
        assert!(hits >= n - 5 && hits < n, "{hits}");
        still_serves(&store);
        drop(store);
        // And it reopens cleanly afterwards.
        let store = open(small_config(dir.path()));
        assert_eq!(check_all(&store, n), hits);
        assert!(store.get(b"after").unwrap().is_some());
    });
}

/// Values larger than one read piece (2 MiB) are read in pieces and
/// checksummed piece by piece: damage in a later piece is still a miss,
/// damage in the page padding after a value is not part of it, and both
/// the direct path (aligned buffer) and the bounce path (unaligned) agree.
#[test]
fn multi_piece_values_are_verified_whole() {
    for_each_engine(|_engine| {
        let dir = tempfile::tempdir().unwrap();
        let config = small_config(dir.path())
            .memory_capacity(64 * MIB)
            .disk_capacity(256 * MIB)
            .region_size(64 * MIB)
            .max_value_size(16 * MIB);
        let len = 10 * MIB as usize + 123;
        {
            let store = open(config.clone());
            for i in 0..3 {
                store.put(key(i), value_for(&key(i), 7, len)).unwrap();
                store.flush().unwrap(); // one batch (and record) per value
            }
        }
        let path = &region_files(dir.path())[0];
        let offsets = batch_offsets(path);
        assert_eq!(offsets.len(), 3);
        // Key 0: a byte in the last piece. Key 1: a byte in the padding.
        flip(path, offsets[0] + 4096 + 9 * MIB + 5);
        flip(path, offsets[1] + 4096 + len as u64 + 10);
        let store = open(config);
        let mut aligned = kvtier::AlignedBuf::zeroed(len);
        let mut unaligned = vec![0u8; len + 1];
        for direct in [true, false] {
            for i in 0..3u64 {
                let buf: &mut [u8] = if direct {
                    aligned.as_mut_slice()
                } else {
                    &mut unaligned[1..]
                };
                let result = store
                    .batch_get_into(&[key(i)], &mut [buf])
                    .remove(0)
                    .unwrap();
                if i == 0 {
                    assert_eq!(result, None, "damaged value must be a miss");
                } else {
                    assert_eq!(result, Some(len));
                    let got = if direct {
                        &aligned.as_slice()[..len]
                    } else {
                        &unaligned[1..]
                    };
                    assert!(got == value_for(&key(i), 7, len).as_slice(), "key {i}");
                }
            }
        }
        assert_eq!(store.stats().checksum_failures, 1);
    });
}

/// A damaged record does not take the batches after it down with it: a
/// tombstone written after the damage still keeps its key removed.
#[test]
fn a_tombstone_after_a_damaged_record_still_holds() {
    for_each_engine(|_engine| {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = open(small_config(dir.path()));
            store.put(b"removed", vec![9u8; 20_000]).unwrap();
            store.flush().unwrap();
            store.put(b"bystander", vec![8u8; 20_000]).unwrap();
            store.flush().unwrap();
            assert!(store.remove(b"removed").unwrap());
            store.put(b"after", vec![7u8; 20_000]).unwrap();
            store.close().unwrap();
        }
        let files = region_files(dir.path());
        let offsets = batch_offsets(&files[0]);
        assert!(offsets.len() >= 4, "{offsets:?}");
        flip(&files[0], offsets[1] + 40); // the bystander's record
        forget_checkpoint(dir.path());
        let store = open(small_config(dir.path()));
        assert_eq!(store.recovery_report().damaged_regions, 1);
        assert_eq!(
            store.get(b"removed").unwrap(),
            None,
            "a removed key came back"
        );
        assert_eq!(store.get(b"bystander").unwrap(), None);
        assert_eq!(store.get(b"after").unwrap().unwrap(), vec![7u8; 20_000]);
    });
}
