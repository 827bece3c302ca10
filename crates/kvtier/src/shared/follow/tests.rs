//! The follower over a bare index, write log and disk tier (no store):
//! another writer's log is written by the disk tier's own writer, in
//! the layout of a shared directory.
use super::*;
use crate::config::{Config, IoEngineKind};
use crate::disk::format::RecordEntry;
use crate::disk::RecoveryChecks;
use crate::io::AlignedBuf;
use crate::key::{value_checksum, KeySecret, KEY_SECRET_LEN};
use crate::tier::PendingBatch;

const OWN_NODE: &str = "00000000000000000000000000000001";
const OTHER: &str = "00000000000000000000000000000002";

struct Setup {
    root: tempfile::TempDir,
    secret: Arc<KeySecret>,
    config: Config,
    follower: Arc<Follower>,
    index: Arc<Index>,
    own_disk: Arc<DiskTier>,
    floor: Arc<AtomicU64>,
    /// Sequence numbers of the test's entries count from here: a
    /// second behind this node's clock when the test began.
    base: u64,
}

fn config(root: &Path) -> Config {
    let config = Config::new(root.join("unused"))
        .disk_capacity(1 << 30)
        .region_size(64 << 10)
        .shared_dir(root);
    Config {
        io_engine: IoEngineKind::Psync,
        ..config
    }
}

fn open_log(setup_root: &Path, config: &Config, secret: &Arc<KeySecret>, node: &str) -> DiskTier {
    let dir = setup_root.join(NODES_DIR).join(node);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(crate::shared::dir::WRITER_LOCK_FILE), b"").unwrap();
    let (tier, _) = DiskTier::open(
        config,
        &dir,
        Arc::clone(secret),
        node,
        RecoveryChecks::default(),
        |_| {},
    )
    .unwrap();
    tier
}

fn setup() -> Setup {
    let root = tempfile::tempdir().unwrap();
    let secret = Arc::new(KeySecret::from_bytes([3; KEY_SECRET_LEN]));
    let config = config(root.path());
    let own_disk = Arc::new(open_log(root.path(), &config, &secret, OWN_NODE));
    let index = Arc::new(Index::default());
    let log = Arc::new(WriteLog::with_clock(1, false, true));
    let floor = Arc::new(AtomicU64::new(u64::MAX));
    let follower = Follower::new(
        root.path(),
        OWN_NODE,
        Arc::clone(&own_disk),
        Arc::clone(&index),
        Arc::clone(&log),
        HashMap::new(),
        Arc::clone(&floor),
    );
    let follower = Arc::new(follower);
    Setup {
        root,
        secret,
        config,
        follower,
        index,
        own_disk,
        floor,
        base: log.wall_nanos() - 1_000_000_000,
    }
}

impl Setup {
    fn digest(&self, key: &str) -> KeyDigest {
        let mut qualified = vec![0u8];
        qualified.extend_from_slice(key.as_bytes());
        self.secret.digest_qualified(&qualified)
    }

    /// The test's `n`th sequence number.
    fn seq(&self, n: u64) -> u64 {
        self.base + n
    }

    /// Writes `puts` (key, seq, value length) and `removes` (key, seq)
    /// to `writer`'s log as one batch.
    fn write(&self, writer: &DiskTier, puts: &[(&str, u64, usize)], removes: &[(&str, u64)]) {
        let bufs: Vec<AlignedBuf> = puts
            .iter()
            .map(|&(_, _, len)| {
                let mut buf = AlignedBuf::zeroed(len.div_ceil(4096) * 4096);
                buf.as_mut_slice()[..len].fill(0x5A);
                buf
            })
            .collect();
        let mut batch = PendingBatch::default();
        for (&(key, seq, len), buf) in puts.iter().zip(&bufs) {
            let digest = self.digest(key);
            batch.entries.push(RecordEntry {
                kind: RecordKind::Put,
                seq,
                digest,
                value_offset: 0,
                value_len: len as u32,
                checksum: value_checksum(digest, &buf.as_slice()[..len]),
                key: [&[0u8][..], key.as_bytes()].concat(),
            });
            batch.values.push(buf.as_slice());
        }
        for &(key, seq) in removes {
            batch.entries.push(RecordEntry {
                kind: RecordKind::Tombstone,
                seq,
                digest: self.digest(key),
                value_offset: 0,
                value_len: 0,
                checksum: 0,
                key: [&[0u8][..], key.as_bytes()].concat(),
            });
        }
        let first = puts
            .iter()
            .map(|p| p.1)
            .chain(removes.iter().map(|r| r.1))
            .min();
        writer.write_batch(&mut batch, first.unwrap()).unwrap();
    }

    fn other(&self) -> DiskTier {
        open_log(self.root.path(), &self.config, &self.secret, OTHER)
    }

    /// The index's entry for `key`: (seq, handle) if it names a disk
    /// location.
    fn indexed(&self, key: &str) -> Option<(u64, u32)> {
        let digest = self.digest(key);
        let shard = self.index.lock(digest);
        let entry = shard.get(digest)?;
        Some((entry.seq(), entry.disk()?.region()))
    }
}

#[test]
fn another_writers_puts_are_indexed_where_its_values_are() {
    let s = setup();
    let other = s.other();
    s.write(&other, &[("a", s.seq(1), 5000), ("b", s.seq(2), 100)], &[]);
    s.follower.poll();
    let (seq, handle) = s.indexed("a").unwrap();
    assert_eq!(seq, s.seq(1));
    assert!(
        handle >= OTHERS_BASE,
        "another writer's region gets a handle"
    );
    // The handle reads that writer's file, and the value verifies.
    let region = s.own_disk.region(handle).unwrap();
    assert_eq!(region.path(), other.region(0).unwrap().path());
    let digest = s.digest("a");
    let (loc, checksum) = {
        let shard = s.index.lock(digest);
        let entry = shard.get(digest).unwrap();
        (entry.disk().unwrap(), entry.checksum())
    };
    let read = crate::disk::ValueRead {
        digest,
        region,
        loc,
        len: 5000,
        checksum,
    };
    let mut buf = vec![0u8; 5000];
    let outcomes = s.own_disk.read_values(&[Some(read)], &mut [&mut buf[..]]);
    assert!(matches!(
        outcomes[0],
        Some(crate::disk::ReadOutcome::Verified)
    ));
    assert!(buf.iter().all(|&b| b == 0x5A));
    // The floor: its lowest put (no write floor published).
    assert_eq!(s.floor.load(Ordering::Acquire), s.seq(1));
    let writers = s.follower.writers();
    assert_eq!(writers.len(), 1);
    assert_eq!((writers[0].node.as_str(), writers[0].regions), (OTHER, 1));
    assert_eq!(writers[0].newest_seq, s.seq(2));
}

#[test]
fn later_batches_are_read_from_where_the_last_pass_stopped() {
    let s = setup();
    let other = s.other();
    s.write(&other, &[("a", s.seq(1), 100)], &[]);
    s.follower.poll();
    assert_eq!(s.follower.counters.batches.load(Ordering::Relaxed), 1);
    // Nothing new: nothing read again.
    s.follower.poll();
    assert_eq!(s.follower.counters.batches.load(Ordering::Relaxed), 1);
    s.write(&other, &[("b", s.seq(3), 100)], &[("a", s.seq(2))]);
    s.follower.poll();
    assert_eq!(s.follower.counters.batches.load(Ordering::Relaxed), 2);
    assert!(s.indexed("a").is_none(), "removed by a newer tombstone");
    assert_eq!(s.indexed("b").map(|e| e.0), Some(s.seq(3)));
    // An older put read after the removal stays removed.
    s.write(&other, &[("a", s.seq(1), 100)], &[]);
    s.follower.poll();
    assert!(s.indexed("a").is_none());
}

#[test]
fn reclaimed_regions_and_vanished_writers_take_their_entries_with_them() {
    let s = setup();
    let other = s.other();
    // 40 KiB values in 64 KiB regions: one batch per region.
    for (i, key) in ["a", "b", "c"].iter().enumerate() {
        s.write(&other, &[(key, s.seq(i as u64 + 1), 40 << 10)], &[]);
    }
    s.follower.poll();
    assert_eq!(s.follower.writers()[0].regions, 3);
    let handle_a = s.indexed("a").unwrap().1;
    other.remove_region(0).unwrap();
    s.follower.poll();
    assert!(s.indexed("a").is_none());
    assert!(
        s.own_disk.region(handle_a).is_none(),
        "its reader is dropped"
    );
    assert!(s.indexed("b").is_some() && s.indexed("c").is_some());
    assert_eq!(s.floor.load(Ordering::Acquire), s.seq(2));
    drop(other);
    std::fs::remove_dir_all(s.root.path().join(NODES_DIR).join(OTHER)).unwrap();
    s.follower.poll();
    assert!(s.indexed("b").is_none() && s.indexed("c").is_none());
    assert!(s.follower.writers().is_empty());
}

#[test]
fn regions_behind_a_missing_one_are_not_followed() {
    let s = setup();
    let other = s.other();
    for (i, key) in ["a", "b", "c"].iter().enumerate() {
        s.write(&other, &[(key, s.seq(i as u64 + 1), 40 << 10)], &[]);
    }
    std::fs::remove_file(other.region(1).unwrap().path()).unwrap();
    s.follower.poll();
    assert!(s.indexed("a").is_none() && s.indexed("b").is_none());
    assert!(s.indexed("c").is_some());
    assert_eq!(
        s.follower
            .counters
            .regions_behind_gap
            .load(Ordering::Relaxed),
        1
    );
    assert_eq!(
        s.floor.load(Ordering::Acquire),
        0,
        "what they hold is unknown"
    );
}

#[test]
fn regions_past_the_descriptor_budget_are_not_followed_and_can_be_closed() {
    let s = setup();
    let other = s.other();
    for (i, key) in ["a", "b", "c"].iter().enumerate() {
        s.write(&other, &[(key, s.seq(i as u64 + 1), 40 << 10)], &[]);
    }
    s.own_disk.set_other_files_budget(2);
    s.follower.poll();
    assert_eq!(
        s.follower
            .counters
            .regions_over_budget
            .load(Ordering::Relaxed),
        1
    );
    assert_eq!(s.follower.writers()[0].regions, 2);
    assert!(s.indexed("a").is_some() && s.indexed("b").is_some());
    assert!(s.indexed("c").is_none(), "a miss, never a wrong block");
    assert_eq!(s.floor.load(Ordering::Acquire), 0);
    // The budget lowered below what is open: the newest handles close.
    s.own_disk.set_other_files_budget(1);
    s.follower.close_past_budget();
    assert_eq!(s.follower.writers()[0].regions, 1);
    assert!(s.indexed("a").is_some() && s.indexed("b").is_none());
    // Room again: the next pass follows them all.
    s.own_disk.set_other_files_budget(100);
    s.follower.poll();
    assert!(["a", "b", "c"].iter().all(|k| s.indexed(k).is_some()));
    assert_eq!(s.floor.load(Ordering::Acquire), s.seq(1));
}

#[test]
fn a_torn_tail_waits_in_the_newest_region_and_is_read_once_whole() {
    use std::os::unix::fs::FileExt;
    let s = setup();
    let other = s.other();
    s.write(&other, &[("a", s.seq(1), 100)], &[]);
    s.write(&other, &[("b", s.seq(2), 100)], &[]);
    // The second batch's record not yet whole (its writer mid-flush).
    let path = other.region(0).unwrap().path().to_path_buf();
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    let at = 3 * 4096;
    let mut saved = [0u8; 64];
    file.read_exact_at(&mut saved, at).unwrap();
    file.write_all_at(&[0; 64], at).unwrap();
    s.follower.poll();
    assert!(s.indexed("a").is_some() && s.indexed("b").is_none());
    assert_eq!(s.follower.counters.stuck_regions.load(Ordering::Relaxed), 1);
    file.write_all_at(&saved, at).unwrap();
    s.follower.poll();
    assert!(
        s.indexed("b").is_some(),
        "read again though the file did not grow"
    );
    assert_eq!(s.follower.counters.stuck_regions.load(Ordering::Relaxed), 0);
}

/// Writers whose steps hang hold at most `max_held_steps` threads: once
/// that many are held, no other step starts (the pass is incomplete);
/// when they answer, every writer is followed again. Four writers
/// hang, the cap is two: two steps ever start until the gate opens.
#[test]
fn steps_held_by_hanging_writers_are_capped() {
    let mut s = setup();
    let hanging: Vec<String> = (3..7).map(|n| format!("{n:032}")).collect();
    let _logs: Vec<DiskTier> = hanging
        .iter()
        .map(|node| open_log(s.root.path(), &s.config, &s.secret, node))
        .collect();
    let open = Arc::new((Mutex::new(false), std::sync::Condvar::new()));
    {
        let follower = Arc::get_mut(&mut s.follower).expect("no other handle yet");
        follower.step_deadline = Some(Duration::from_millis(10));
        follower.gate_steps(hanging.iter().cloned().collect(), Arc::clone(&open), 2);
    }
    // Passes until two steps are held (a loaded machine's listing may
    // overrun a pass too), then more: none starts past the cap.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let mut extra = 0;
    while extra < 10 {
        assert!(
            std::time::Instant::now() < deadline,
            "two steps were never held"
        );
        s.follower.poll();
        let stalled = s.follower.counters.writers_stalled.load(Ordering::Relaxed);
        assert!(stalled <= 2, "{stalled} steps held, past the cap of 2");
        if stalled == 2 {
            extra += 1;
        }
    }
    assert_eq!(
        s.follower.gated.lock().unwrap().len(),
        2,
        "steps started past the cap (or too few reached it)"
    );
    assert_eq!(
        s.follower.floor.load(Ordering::Acquire),
        0,
        "an incomplete pass keeps floor 0"
    );
    // The files answer: the held steps end, the others are followed.
    *open.0.lock().unwrap() = true;
    open.1.notify_all();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let followed = |s: &Setup| {
        let gated = s.follower.gated.lock().unwrap();
        gated.iter().collect::<HashSet<_>>().len()
    };
    while followed(&s) < 4 || s.follower.counters.writers_stalled.load(Ordering::Relaxed) > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the writers were not followed again"
        );
        s.follower.poll();
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(followed(&s), 4);
}
