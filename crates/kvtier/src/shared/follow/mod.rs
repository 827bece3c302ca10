//! Following the other writers of a shared directory (docs/design.md,
//! "Following other writers"): their batch records are the meta persisted
//! with the data, so this node's index learns their blocks by reading the
//! records they append, exactly as recovery reads its own log: a record
//! counts only once it verifies (checksums and keyed digests), so a batch
//! its writer is still writing, or tore by dying, is never indexed.
//!
//! Order across writers: every writer's sequence numbers are hybrid
//! logical clock readings (`WriteLog` in shared mode), and each record
//! entry read here advances this node's clock past it, so a remove issued
//! here after this node saw a put outranks that put everywhere. Per key the
//! highest sequence number wins, a tombstone on a tie.
//!
//! By concern: here the follower's state and what the store asks of it;
//! `pass` (a follow pass over every writer), `apply` (the rules for what a
//! pass reads), `budget` (descriptors for other writers' files), `unclean`
//! (a writer's newest region verified after it stopped uncleanly), `load`
//! (another writer's index checkpoint).

mod apply;
mod budget;
mod load;
mod pass;
mod unclean;

use crate::checkpoint;
use crate::disk::format::{RecordEntry, RecordKind};
use crate::disk::DiskLoc;
use crate::disk::{
    parse_region_name, read_other_head, value_loc, DiskTier, RegionListing, RegionRead, NO_HANDLE,
    OTHERS_BASE,
};
use crate::index::{Entry, Index};
use crate::key::KeyDigest;
use crate::shared::dir::{SharedDir, NODES_DIR};
use crate::shared::write_floor;
use crate::units::PAGE_SIZE;
use crate::write_log::WriteLog;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, SystemTime};

/// A tombstone's origin: another writer's region (its handle), or this
/// node's own log (`OWN`, a handle no region gets), whose tombstones are
/// kept until the store closes.
const OWN: u32 = NO_HANDLE;

/// Which keys (by `KeyDigest::share_hash`) this node indexes of the
/// other writers' logs in the bounded mode (`Config::shared_index_share`).
pub type IndexShare = Arc<dyn Fn(u64) -> bool + Send + Sync>;

/// The bounded mode's current share (`None` until one is given).
#[derive(Default)]
struct ShareSlot(RwLock<Option<IndexShare>>);

impl std::fmt::Debug for ShareSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let given = self.0.read().map(|s| s.is_some()).unwrap_or(false);
        f.debug_struct("ShareSlot").field("given", &given).finish()
    }
}

/// What one other writer's log looks like from here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedWriter {
    /// Its node id (the name of its writer directory).
    pub node: String,
    /// Region files of it this node follows, and their bytes.
    pub regions: u64,
    pub bytes: u64,
    /// The highest sequence number read from its records.
    pub newest_seq: u64,
    /// Milliseconds since the Unix epoch when its log last changed as seen
    /// from here (a new batch, region or removal); 0 if never.
    pub last_change_unix_ms: u64,
}

#[derive(Debug, Default)]
struct WriterLog {
    /// Per followed region (by handle): the lowest sequence number of any
    /// put entry in it (`u64::MAX` while none was read; 0 when unknown: a
    /// region first learned from an index checkpoint, which lists only
    /// live entries, so the puts other writers' removals shadow are not in
    /// it). The regions themselves (files, cursors) are the disk tier's.
    min_put_seq: HashMap<u32, u64>,
    /// The highest sequence number read from its log.
    newest_seq: u64,
    /// The write floor it published (`write_floor`), read before its
    /// listing at the last pass; `None` when it published none that reads
    /// intact.
    published_floor: Option<u64>,
    /// Whether a pass has listed its regions (its checkpoint is looked
    /// for at the first).
    listed: bool,
    /// Its write floor, or its log head, could not be read at the last
    /// pass (said once until it reads again).
    floor_unreadable: bool,
    head_unreadable: bool,
    /// Its region files behind a gap at the last pass (not followed).
    behind_gap: u64,
    last_change: Option<SystemTime>,
    /// Its newest region whose values were verified after it stopped
    /// without closing (once per region; cleared when it runs again), and
    /// when its lock was last looked at (every 5 s at most: two metadata
    /// operations on the shared file system per writer).
    verified_after_stop: Option<u32>,
    stop_checked_at: Option<std::time::Instant>,
}

#[derive(Debug)]
struct FollowState {
    writers: BTreeMap<String, WriterLog>,
    /// Per key digest: the newest removal known (sequence number, origin),
    /// so a put with a lower number read later (a writer whose flush came
    /// after the remove, or whose log this node reads later) is not
    /// indexed.
    tombstones: HashMap<u128, (u64, u32)>,
}

/// How often a follower looks at whether another writer stopped without
/// closing.
const STOP_CHECK_EVERY: Duration = Duration::from_secs(5);

/// Counters for `Stats`.
#[derive(Debug, Default)]
pub(crate) struct FollowCounters {
    pub writers: AtomicU64,
    pub regions: AtomicU64,
    pub bytes: AtomicU64,
    pub batches: AtomicU64,
    pub stuck_regions: AtomicU64,
    pub tombstones: AtomicU64,
    pub polls: AtomicU64,
    /// Index checkpoints of other writers loaded, and the entries they
    /// gave (instead of reading those writers' records).
    pub checkpoints_loaded: AtomicU64,
    pub checkpoint_entries: AtomicU64,
    /// Milliseconds since the Unix epoch when the last pass began.
    pub last_pass_unix_ms: AtomicU64,
    /// Bounded mode: put entries of other writers passed over (another
    /// node's share), and the times a new share made this node read every
    /// other writer's records again.
    pub outside_share: AtomicU64,
    pub share_rereads: AtomicU64,
    /// Entries of other writers not indexed because their numbers read
    /// more than `MAX_CLOCK_AHEAD_NANOS` ahead of this node's clock.
    pub clock_ahead: AtomicU64,
    /// Other writers' region files not followed at the last pass because
    /// a region between them and their writer's head is missing.
    pub regions_behind_gap: AtomicU64,
    /// Other writers' region files not followed at the last pass because
    /// the descriptor budget for them was spent.
    pub regions_over_budget: AtomicU64,
    /// Directories under `nodes/` not followed at the last pass because
    /// they never held a `LOCK` (no writer made them).
    pub writers_without_lock: AtomicU64,
    /// Writers whose step of a pass has run past the storage deadline and
    /// not finished yet (their files hang), at the end of the last pass.
    pub writers_stalled: AtomicU64,
}

/// Whether `dir` (a writer directory) holds a regular file named `LOCK`.
fn holds_a_lock_file(dir: &Path) -> bool {
    std::fs::symlink_metadata(dir.join(crate::shared::dir::WRITER_LOCK_FILE))
        .is_ok_and(|m| m.file_type().is_file())
}

/// Follows every other writer of one shared directory into this node's
/// index. Built from the handles it needs; a thread polls it.
#[derive(Debug)]
pub(crate) struct Follower {
    root: PathBuf,
    own: String,
    disk: Arc<DiskTier>,
    index: Arc<Index>,
    log: Arc<WriteLog>,
    state: Mutex<FollowState>,
    pub counters: FollowCounters,
    /// The reclaim floor (docs/design.md, "Removes and reclaim across
    /// writers"): no other writer's log holds, or will write, a put
    /// numbered below it (puts acknowledged and not yet written included,
    /// by the write floors writers publish). A tombstone of this node's
    /// log at or above it may still shadow such a put, so the reclaimer
    /// rewrites it instead of dropping it.
    floor: Arc<AtomicU64>,
    stop: (Mutex<bool>, Condvar),
    /// One pass at a time (the thread's and `Store::follow_shared_now`'s):
    /// a region first seen by two passes at once must get one handle.
    passes: Mutex<()>,
    /// Set by a pass that could not read some writer's directory or file:
    /// its floor is then unknown, and 0 (keep every removal) is used.
    pass_incomplete: std::sync::atomic::AtomicBool,
    /// Regions this pass did not follow for want of descriptors, and
    /// whether that was said (once, until all are followed again).
    over_budget_this_pass: AtomicU64,
    over_budget_said: std::sync::atomic::AtomicBool,
    /// The bounded mode's share: `None` indexes every writer's entries
    /// (the default mode); `Some(None)`, bounded with no share given yet,
    /// indexes none of theirs.
    share: Option<ShareSlot>,
    /// Set when the share changed: the next pass drops entries outside
    /// the new share and reads every other writer's records again.
    reread: std::sync::atomic::AtomicBool,
    /// Set while publishing this writer's write floor fails (logged once).
    publish_failed: std::sync::atomic::AtomicBool,
    /// How long a pass waits for one writer's step (and for the listing of
    /// the writers): `Config::io_deadline`; `None` (a deadline of 0) runs
    /// the steps on the pass's thread, unbounded.
    step_deadline: Option<Duration>,
    steps: super::steps::StepRunner,
    /// Writers whose step is running, and those of them whose step ran
    /// past its deadline: passes skip them until it ends.
    in_flight: Mutex<StepsInFlight>,
    /// Most steps held past their deadline at once (`MAX_HELD_STEPS`).
    max_held_steps: usize,
    /// Set while that many are held (the warning is said once a time).
    steps_at_cap: std::sync::atomic::AtomicBool,
    /// Tests: writers whose step waits at its start until the gate opens
    /// (a writer whose files hang, without a file system that hangs).
    #[cfg(test)]
    step_gate: Mutex<Option<(HashSet<String>, Arc<Gate>)>>,
    /// Tests: the writers whose steps reached the gate, in order.
    #[cfg(test)]
    gated: Mutex<Vec<String>>,
}

/// Tests: a gate steps wait at until it is open (set and notified).
#[cfg(test)]
type Gate = (Mutex<bool>, std::sync::Condvar);

/// Steps held past their deadline at once, each on a thread of its own
/// (parked in the kernel on files that do not answer): while this many
/// are, no new step starts and the pass is incomplete (other writers'
/// new blocks are misses, the reclaim floor 0). A writer directory is
/// anyone's to plant, each with its own stalled mount or link: without a
/// cap every one of them kept a thread.
pub(crate) const MAX_HELD_STEPS: usize = 64;

#[derive(Debug, Default)]
struct StepsInFlight {
    running: HashSet<String>,
    overran: HashSet<String>,
}

impl Follower {
    pub fn new(
        root: &Path,
        own: &str,
        disk: Arc<DiskTier>,
        index: Arc<Index>,
        log: Arc<WriteLog>,
        own_tombstones: HashMap<u128, u64>,
        floor: Arc<AtomicU64>,
    ) -> Follower {
        // Unknown until a pass completes: keep every removal meanwhile.
        floor.store(0, Ordering::Release);
        let follower = Follower {
            root: root.to_path_buf(),
            own: own.to_string(),
            disk,
            index,
            log,
            state: Mutex::new(FollowState {
                writers: BTreeMap::new(),
                tombstones: own_tombstones
                    .into_iter()
                    .map(|(digest, seq)| (digest, (seq, OWN)))
                    .collect(),
            }),
            counters: FollowCounters::default(),
            floor,
            stop: (Mutex::new(false), Condvar::new()),
            passes: Mutex::new(()),
            pass_incomplete: std::sync::atomic::AtomicBool::new(false),
            over_budget_this_pass: AtomicU64::new(0),
            over_budget_said: std::sync::atomic::AtomicBool::new(false),
            share: None,
            reread: std::sync::atomic::AtomicBool::new(false),
            publish_failed: std::sync::atomic::AtomicBool::new(false),
            step_deadline: None,
            steps: super::steps::StepRunner::default(),
            in_flight: Mutex::new(StepsInFlight::default()),
            max_held_steps: MAX_HELD_STEPS,
            steps_at_cap: std::sync::atomic::AtomicBool::new(false),
            #[cfg(test)]
            step_gate: Mutex::new(None),
            #[cfg(test)]
            gated: Mutex::new(Vec::new()),
        };
        // From the start, so the other nodes' floors need not wait for this
        // writer's first pass (one without a floor holds theirs low).
        follower.publish_write_floor();
        follower
    }

    /// Publishes this writer's write floor for the other nodes (see
    /// `write_floor`); a failure is logged once until it heals (the other
    /// nodes then keep more removals, never fewer).
    fn publish_write_floor(&self) {
        let dir = self.root.join(NODES_DIR).join(&self.own);
        match write_floor::publish(&dir, self.log.write_floor()) {
            Ok(()) => {
                if self.publish_failed.swap(false, Ordering::Relaxed) {
                    tracing::info!(dir = %dir.display(), "publishing this writer's write floor works again");
                }
            }
            Err(e) => {
                if !self.publish_failed.swap(true, Ordering::Relaxed) {
                    tracing::warn!(dir = %dir.display(), error = %e, "cannot publish this writer's write floor; the other nodes keep every removal newer than its last one");
                }
            }
        }
    }

    /// The bounded mode (`Config::shared_index_share`) when `bounded`:
    /// none of the other writers' entries until `set_share` gives a share.
    pub fn bounded(mut self, bounded: bool) -> Follower {
        self.share = bounded.then(ShareSlot::default);
        self
    }

    /// Waits at most `deadline` for each writer's step of a pass (and for
    /// the listing of the writers); zero runs them unbounded.
    pub fn step_deadline(mut self, deadline: Duration) -> Follower {
        self.step_deadline = (!deadline.is_zero()).then_some(deadline);
        self
    }

    /// Bounded mode: index from now on only the other writers' keys
    /// `share` accepts (by `KeyDigest::share_hash`). The next pass drops
    /// the entries outside it and reads every other writer's records
    /// again for the keys it adds. Whether the mode is on.
    pub fn set_share(&self, share: IndexShare) -> bool {
        let Some(slot) = &self.share else {
            return false;
        };
        *slot.0.write().unwrap() = Some(share);
        self.reread.store(true, Ordering::Release);
        true
    }

    /// Whether this node indexes `digest` of another writer's log.
    fn owns(&self, digest: KeyDigest) -> bool {
        match &self.share {
            None => true,
            Some(slot) => slot
                .0
                .read()
                .unwrap()
                .as_ref()
                .is_some_and(|share| share(digest.share_hash())),
        }
    }

    /// A new share: entries and removals outside it go, and every followed
    /// region is read from its first batch again at this pass (its
    /// handle kept, so entries inside the share stay readable meanwhile).
    fn begin_reread(&self) {
        self.counters.share_rereads.fetch_add(1, Ordering::Relaxed);
        let dropped = self
            .index
            .clear_disk_where(|region, digest| region >= OTHERS_BASE && !self.owns(digest));
        let mut state = self.state.lock().unwrap();
        state
            .tombstones
            .retain(|digest, (_, origin)| *origin == OWN || self.owns(KeyDigest(*digest)));
        drop(state);
        self.disk.rewind_others();
        tracing::info!(
            dropped,
            "the index share changed; reading the other writers' records again"
        );
    }

    /// A removal this node logged (called under the key's index shard
    /// lock, so a put of another writer applied concurrently sees it).
    pub fn note_removal(&self, digest: KeyDigest, seq: u64) {
        let mut state = self.state.lock().unwrap();
        let slot = state.tombstones.entry(digest.0).or_insert((seq, OWN));
        if slot.0 <= seq {
            *slot = (seq, OWN);
        }
    }

    /// This node's own removals known now (for its index checkpoints).
    pub fn own_tombstones(&self) -> Vec<(KeyDigest, u64)> {
        let state = self.state.lock().unwrap();
        state
            .tombstones
            .iter()
            .filter(|(_, (_, origin))| *origin == OWN)
            .map(|(digest, (seq, _))| (KeyDigest(*digest), *seq))
            .collect()
    }

    /// Each other writer's log as seen now.
    pub fn writers(&self) -> Vec<SharedWriter> {
        let sizes = self.disk.followed_sizes();
        let state = self.state.lock().unwrap();
        state
            .writers
            .iter()
            .map(|(node, log)| SharedWriter {
                node: node.clone(),
                regions: sizes.get(node).map_or(0, |s| s.0.regions),
                bytes: sizes.get(node).map_or(0, |s| s.0.bytes),
                newest_seq: log.newest_seq,
                last_change_unix_ms: log
                    .last_change
                    .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
                    .map_or(0, |d| d.as_millis() as u64),
            })
            .collect()
    }

    /// Polls every `every` until `shut_down`.
    pub fn run(self: &Arc<Self>, every: Duration) {
        loop {
            {
                let stopped = self.stop.0.lock().unwrap();
                let (stopped, _) = self
                    .stop
                    .1
                    .wait_timeout_while(stopped, every, |s| !*s)
                    .unwrap();
                if *stopped {
                    return;
                }
            }
            self.poll();
        }
    }

    pub fn shut_down(&self) {
        *self.stop.0.lock().unwrap() = true;
        self.stop.1.notify_all();
    }
}

#[cfg(test)]
impl Follower {
    /// Tests: `writers`' steps wait at their start until `open` is set.
    fn gate_steps(&mut self, writers: HashSet<String>, open: Arc<Gate>, max_held_steps: usize) {
        *self.step_gate.get_mut().unwrap() = Some((writers, open));
        self.max_held_steps = max_held_steps;
    }

    fn wait_at_gate(&self, node: &str) {
        let gate = self.step_gate.lock().unwrap().clone();
        if let Some((writers, open)) = gate {
            if writers.contains(node) {
                self.gated.lock().unwrap().push(node.to_string());
                let (flag, opened) = &*open;
                let _open = opened
                    .wait_while(flag.lock().unwrap(), |open| !*open)
                    .unwrap();
            }
        }
    }
}

#[cfg(test)]
mod tests;
