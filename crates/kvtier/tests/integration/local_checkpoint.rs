//! A local directory's index checkpoint (docs/design.md, "Local index
//! checkpoints"): loaded after a clean close when the region files are
//! still exactly the ones it recorded, never otherwise, and the index it
//! gives is the one reading every record gives.

use crate::common::*;
use kvtier::{Config, Store};
use std::fs;
use std::path::Path;

const N: u64 = 60;

fn config(dir: &Path, checkpoints: bool) -> Config {
    small_config(dir).local_index_checkpoints(checkpoints)
}

/// The one checkpoint a clean close left in `dir`.
fn only_checkpoint(dir: &Path) -> std::path::PathBuf {
    let mut found: Vec<_> = fs::read_dir(dir.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(found.len(), 1, "one checkpoint, the newest: {found:?}");
    found.pop().unwrap()
}

/// Which of 0..N are present, and each present one reads its `fill`
/// value (check_all's rule: no wrong bytes, no phantoms).
fn present(store: &Store) -> Vec<bool> {
    check_all(store, N);
    (0..N).map(|i| store.exists(key(i))).collect()
}

#[test]
fn a_clean_reopen_loads_the_checkpoint_and_gives_the_same_index_as_the_records() {
    let dir = tempfile::tempdir().unwrap();
    fill(dir.path(), N);
    let store = open(config(dir.path(), true));
    // Removals before the close: the checkpoint holds live entries only.
    for i in (0..N).step_by(7) {
        assert!(store.remove(key(i)).unwrap());
    }
    store.close().unwrap();
    let expected: Vec<bool> = (0..N).map(|i| i % 7 != 0).collect();

    let store = open(config(dir.path(), true));
    let stats = store.stats();
    assert_eq!(
        stats.checkpoint_entries_loaded,
        expected.iter().filter(|&&p| p).count() as u64
    );
    assert_eq!(stats.entries, stats.checkpoint_entries_loaded);
    assert_eq!(present(&store), expected);
    assert_eq!(store.stats().checksum_failures, 0);
    // Reads and new writes go on as after any open.
    store
        .put(key(N), value_for(&key(N), 7, DAMAGE_VALUE))
        .unwrap();
    store.close().unwrap();

    // The same directory read record by record: the same index.
    let store = open(config(dir.path(), false));
    assert_eq!(store.stats().checkpoint_entries_loaded, 0);
    assert_eq!(present(&store), expected);
    assert!(store.exists(key(N)));
    store.close().unwrap();
}

#[test]
fn a_checkpoint_the_log_outgrew_is_never_used() {
    let dir = tempfile::tempdir().unwrap();
    fill(dir.path(), N);
    let store = open(config(dir.path(), true));
    store.close().unwrap();
    let checkpoints = fs::read_dir(dir.path().join("checkpoints"))
        .unwrap()
        .count();
    assert_eq!(checkpoints, 1, "one checkpoint, the newest");
    // A run that closes cleanly but leaves no new checkpoint, after
    // removing keys (tombstones appended to the log): the old checkpoint
    // still lists them.
    let store = open(config(dir.path(), false));
    for i in 0..10 {
        assert!(store.remove(key(i)).unwrap());
    }
    store.close().unwrap();
    let store = open(config(dir.path(), true));
    assert_eq!(
        store.stats().checkpoint_entries_loaded,
        0,
        "the stale checkpoint was used"
    );
    let expected: Vec<bool> = (0..N).map(|i| i >= 10).collect();
    assert_eq!(present(&store), expected, "a removed key came back");
    store.close().unwrap();
}

#[test]
fn after_an_unclean_stop_the_checkpoint_is_not_used() {
    let dir = tempfile::tempdir().unwrap();
    fill(dir.path(), N);
    let store = open(config(dir.path(), true));
    store.close().unwrap();
    // The files as a crash would leave them: the checkpoint matches the
    // regions, but nothing says the run that wrote them closed.
    fs::remove_file(dir.path().join("clean-shutdown")).unwrap();
    let store = open(config(dir.path(), true));
    assert_eq!(store.stats().checkpoint_entries_loaded, 0);
    assert_eq!(present(&store), vec![true; N as usize]);
    store.close().unwrap();
}

#[test]
fn a_damaged_or_foreign_checkpoint_is_refused_and_every_record_read() {
    let dir = tempfile::tempdir().unwrap();
    fill(dir.path(), N);
    let store = open(config(dir.path(), true));
    store.close().unwrap();
    let path = only_checkpoint(dir.path());
    let original = fs::read(&path).unwrap();
    // One byte of an entry changed: the MAC no longer verifies.
    let mut damaged = original.clone();
    let at = damaged.len() / 2;
    damaged[at] ^= 0x40;
    fs::write(&path, &damaged).unwrap();
    let store = open(config(dir.path(), true));
    assert_eq!(store.stats().checkpoint_entries_loaded, 0);
    assert_eq!(present(&store), vec![true; N as usize]);
    store.close().unwrap();
    // The close wrote a good one again.
    let store = open(config(dir.path(), true));
    assert_eq!(store.stats().checkpoint_entries_loaded, N);
    store.close().unwrap();
    // Another directory's checkpoint (keyed with another secret) under
    // this node's name: refused.
    let other = tempfile::tempdir().unwrap();
    fill(other.path(), 5);
    let theirs = only_checkpoint(other.path());
    let ours = only_checkpoint(dir.path());
    fs::copy(&theirs, &ours).unwrap();
    let store = open(config(dir.path(), true));
    assert_eq!(store.stats().checkpoint_entries_loaded, 0);
    assert_eq!(present(&store), vec![true; N as usize]);
    store.close().unwrap();
}
