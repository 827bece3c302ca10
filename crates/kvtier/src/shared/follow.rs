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

    /// One pass over every other writer: new regions opened, grown ones
    /// scanned from where the last pass stopped, vanished ones dropped
    /// (with their index entries). Errors (a file system hiccup) are
    /// logged and retried next pass; they never stop the follower.
    pub fn poll(self: &Arc<Self>) {
        let _one_pass = self.passes.lock().unwrap_or_else(|p| p.into_inner());
        self.pass_incomplete.store(false, Ordering::Relaxed);
        self.over_budget_this_pass.store(0, Ordering::Relaxed);
        if self.reread.swap(false, Ordering::AcqRel) {
            self.begin_reread();
        }
        let began = SystemTime::now();
        // A writer this pass does not see yet (a new directory) can only
        // number its puts from its clock on, so the floor never rises above
        // this node's clock at the pass's start (within the clocks' bound).
        let clock_at_start = self.log.wall_nanos();
        self.publish_write_floor();
        self.counters.last_pass_unix_ms.store(
            began
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            Ordering::Relaxed,
        );
        let listing = {
            let (root, own) = (self.root.clone(), self.own.clone());
            let list = move || SharedDir::other_writers(&root, &own);
            match self.step_deadline {
                None => Some(list()),
                Some(deadline) => self.steps.run(deadline, list),
            }
        };
        let writers = match listing {
            Some(Ok(writers)) => writers,
            Some(Err(e)) => {
                tracing::warn!(dir = %self.root.display(), error = %e, "cannot list the shared directory's writers; will retry");
                return;
            }
            None => {
                tracing::warn!(dir = %self.root.display(), "listing the shared directory's writers ran past the storage deadline (its file system does not answer); will retry");
                return;
            }
        };
        let mut vanished: HashSet<u32> = HashSet::new();
        let mut state = self.state.lock().unwrap();
        // Writers whose directory went (removed by `kvtier shared gc` or
        // an adopter): every region of theirs is gone.
        let present: HashSet<&str> = writers.iter().map(|(n, _)| n.as_str()).collect();
        let gone: Vec<String> = state
            .writers
            .keys()
            .filter(|n| !present.contains(n.as_str()))
            .cloned()
            .collect();
        for node in gone {
            state.writers.remove(&node);
            vanished.extend(self.disk.forget_other_writer(&node));
        }
        // A directory this node does not follow yet is a writer only once
        // it holds a `LOCK` (every writer makes one before its first
        // region): planted directories that never did cost no descriptor
        // and no read. One already followed stays followed without it (a
        // deleted `LOCK` must not make its removals forgotten).
        let known: HashSet<String> = state.writers.keys().cloned().collect();
        drop(state);
        self.drop_vanished(&vanished);
        let mut without_lock = 0u64;
        // What this pass has waited for steps that overran: past one
        // deadline, the writers left are skipped (their mount may be the
        // one stalling) instead of costing a deadline each.
        let mut overrun = Duration::ZERO;
        for (node, dir) in writers {
            if self.in_flight.lock().unwrap().running.contains(&node) {
                // Its last step still hangs: nothing of it is new here.
                self.pass_incomplete.store(true, Ordering::Relaxed);
                continue;
            }
            let known = known.contains(&node);
            let Some(deadline) = self.step_deadline else {
                without_lock += u64::from(!self.follow_step(&node, &dir, known));
                continue;
            };
            if overrun >= deadline {
                self.pass_incomplete.store(true, Ordering::Relaxed);
                continue;
            }
            let held = self.in_flight.lock().unwrap().overran.len();
            if held >= self.max_held_steps {
                self.pass_incomplete.store(true, Ordering::Relaxed);
                if !self.steps_at_cap.swap(true, Ordering::Relaxed) {
                    tracing::warn!(held, "as many follow steps as may be are held by writers whose files do not answer; no other writer is followed until one answers (their new blocks are misses)");
                }
                continue;
            }
            self.steps_at_cap.store(false, Ordering::Relaxed);
            self.in_flight.lock().unwrap().running.insert(node.clone());
            let me = Arc::clone(self);
            let step_node = node.clone();
            let started = std::time::Instant::now();
            match self.steps.run(deadline, move || {
                let followed = me.follow_step(&step_node, &dir, known);
                let mut in_flight = me.in_flight.lock().unwrap();
                in_flight.running.remove(&step_node);
                if in_flight.overran.remove(&step_node) {
                    tracing::warn!(writer = %step_node, "another writer's files answer again; its log is followed again");
                }
                followed
            }) {
                Some(followed) => without_lock += u64::from(!followed),
                None => {
                    overrun += started.elapsed();
                    self.pass_incomplete.store(true, Ordering::Relaxed);
                    let mut in_flight = self.in_flight.lock().unwrap();
                    // Unless it ended meanwhile.
                    if in_flight.running.contains(&node) && in_flight.overran.insert(node.clone()) {
                        tracing::warn!(writer = %node, deadline_ms = deadline.as_millis() as u64, "another writer's files do not answer within the storage deadline; its log is not followed (its new blocks are misses) until they do");
                    }
                }
            }
        }
        self.counters
            .writers_without_lock
            .store(without_lock, Ordering::Relaxed);
        self.counters.writers_stalled.store(
            self.in_flight.lock().unwrap().overran.len() as u64,
            Ordering::Relaxed,
        );
        let mut state = self.state.lock().unwrap();
        let mut floor = clock_at_start;
        let (mut regions, mut bytes, mut stuck, mut behind_gap) = (0u64, 0u64, 0u64, 0u64);
        let sizes = self.disk.followed_sizes();
        for (node, log) in state.writers.iter_mut() {
            // Puts it will write are at or above its published write floor
            // (one past its newest number without one: a writer of an older
            // version, or a damaged file); puts in its log at or above its
            // regions' lowest. Regions behind a gap are not followed, so
            // what they hold is unknown.
            floor = floor.min(
                log.published_floor
                    .unwrap_or(log.newest_seq.saturating_add(1)),
            );
            if log.behind_gap > 0 {
                floor = 0;
            }
            behind_gap += log.behind_gap;
            let Some((followed, handles)) = sizes.get(node) else {
                log.min_put_seq.clear();
                continue;
            };
            // Regions no longer followed no longer hold the floor down.
            log.min_put_seq.retain(|handle, _| handles.contains(handle));
            for handle in handles {
                floor = floor.min(log.min_put_seq.get(handle).copied().unwrap_or(u64::MAX));
            }
            regions += followed.regions;
            bytes += followed.bytes;
            stuck += followed.stuck;
        }
        if self.pass_incomplete.load(Ordering::Relaxed) {
            floor = 0;
        }
        self.floor.store(floor, Ordering::Release);
        self.counters
            .writers
            .store(state.writers.len() as u64, Ordering::Relaxed);
        self.counters.regions.store(regions, Ordering::Relaxed);
        self.counters.bytes.store(bytes, Ordering::Relaxed);
        self.counters.stuck_regions.store(stuck, Ordering::Relaxed);
        self.counters
            .regions_behind_gap
            .store(behind_gap, Ordering::Relaxed);
        let over_budget = self.over_budget_this_pass.load(Ordering::Relaxed);
        self.counters
            .regions_over_budget
            .store(over_budget, Ordering::Relaxed);
        if over_budget == 0 && self.over_budget_said.swap(false, Ordering::Relaxed) {
            tracing::warn!("every region of the other writers is followed again");
        }
        self.counters
            .tombstones
            .store(state.tombstones.len() as u64, Ordering::Relaxed);
        drop(state);
        self.counters.polls.fetch_add(1, Ordering::Relaxed);
    }

    /// One writer's step of a pass: whether it was followed (`false`: a
    /// directory this node does not follow yet that holds no `LOCK`, so no
    /// writer made it). The regions that went are dropped here, so a step
    /// that finishes after its pass gave up on it leaves nothing undone.
    fn follow_step(&self, node: &str, dir: &Path, known: bool) -> bool {
        #[cfg(test)]
        self.wait_at_gate(node);
        if !known && !holds_a_lock_file(dir) {
            return false;
        }
        let mut vanished = HashSet::new();
        self.follow_writer(node, dir, &mut vanished);
        self.drop_vanished(&vanished);
        true
    }

    /// Forgets regions that are gone: their files, the removals they
    /// carried, and their index entries (which would count in `exists`
    /// and `prefix_len` but miss on read), in one sweep.
    fn drop_vanished(&self, vanished: &HashSet<u32>) {
        if vanished.is_empty() {
            return;
        }
        for handle in vanished {
            self.disk.drop_other(*handle);
        }
        self.state
            .lock()
            .unwrap()
            .tombstones
            .retain(|_, (_, origin)| !vanished.contains(origin));
        self.index
            .clear_regions(|region| vanished.contains(&region));
    }

    /// Stops following the regions held past the descriptor budget (it
    /// was lowered below what is open: the server fits its connection
    /// caps after the store's first pass). The newest handles go first;
    /// their entries are dropped (misses), the removals they carried are
    /// kept (a removal kept too long is a miss, never a resurrection), and
    /// the floor is 0 until a pass has read every region again.
    pub fn close_past_budget(&self) {
        let _one_pass = self.passes.lock().unwrap_or_else(|p| p.into_inner());
        let budget = self.disk.other_files_budget();
        let closed: HashSet<u32> = self.disk.close_others_past(budget).into_iter().collect();
        if closed.is_empty() {
            return;
        }
        let excess = closed.len();
        self.floor.store(0, Ordering::Release);
        self.counters
            .regions
            .store(budget as u64, Ordering::Relaxed);
        self.counters
            .regions_over_budget
            .fetch_add(excess as u64, Ordering::Relaxed);
        for handle in &closed {
            self.disk.drop_other(*handle);
        }
        self.index.clear_regions(|region| closed.contains(&region));
        tracing::warn!(
            closed = closed.len(),
            budget,
            "closed other writers' region files past the descriptor budget: their blocks are \
             misses until there is room"
        );
    }

    /// A writer that stopped without closing (its lock free, no clean
    /// marker in its directory: killed, or its host lost power) may have
    /// lost the end of its newest region after this node indexed it (a
    /// power loss takes what its disk had not made durable, or a device
    /// that lied takes more): every value this node indexed from that
    /// region is read and verified once, and the ones that do not verify
    /// are dropped, so `exists` and prefix lookups stop reporting blocks
    /// no read returns (before, until the writer restarted, and for ever
    /// if it never did).
    fn verify_after_unclean_stop(&self, node: &str, dir: &Path, newest: u32) {
        {
            let mut state = self.state.lock().unwrap();
            let Some(log) = state.writers.get_mut(node) else {
                return;
            };
            if log
                .stop_checked_at
                .is_some_and(|t| t.elapsed() < STOP_CHECK_EVERY)
            {
                return;
            }
            log.stop_checked_at = Some(std::time::Instant::now());
        }
        let stopped_uncleanly = !crate::shared::writer_lock_held(dir)
            && !dir.join(crate::data_dir::CLEAN_MARKER_FILE).exists();
        let handle = {
            let mut state = self.state.lock().unwrap();
            let Some(log) = state.writers.get_mut(node) else {
                return;
            };
            if !stopped_uncleanly {
                log.verified_after_stop = None;
                return;
            }
            if log.verified_after_stop == Some(newest) {
                return;
            }
            let Some(handle) = self.disk.other_region_handle(node, newest) else {
                return;
            };
            log.verified_after_stop = Some(newest);
            handle
        };
        let Some(region) = self.disk.region(handle) else {
            return;
        };
        let mut indexed: Vec<(KeyDigest, u64, DiskLoc, u32, u64)> = Vec::new();
        self.index.visit_by_shard(
            |digest, entry| {
                let loc = entry.disk()?;
                (loc.region() == handle).then(|| {
                    (
                        digest,
                        entry.seq(),
                        loc,
                        entry.value_len(),
                        entry.checksum(),
                    )
                })
            },
            |picked| indexed.extend(picked),
        );
        let (checked, mut dropped) = (indexed.len(), 0u64);
        // At most 64 MiB of values read at once.
        let mut at = 0;
        while at < indexed.len() {
            let mut end = at;
            let mut bytes = 0u64;
            while end < indexed.len()
                && (end == at || bytes + u64::from(indexed[end].3) <= 64 << 20)
            {
                bytes += u64::from(indexed[end].3);
                end += 1;
            }
            let chunk = &indexed[at..end];
            at = end;
            let reads: Vec<Option<crate::disk::ValueRead>> = chunk
                .iter()
                .map(|&(digest, _, loc, len, checksum)| {
                    Some(crate::disk::ValueRead {
                        digest,
                        region: Arc::clone(&region),
                        loc,
                        len: len as usize,
                        checksum,
                    })
                })
                .collect();
            let mut bufs: Vec<Vec<u8>> = chunk.iter().map(|c| vec![0u8; c.3 as usize]).collect();
            let mut dests: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
            let outcomes = self.disk.read_verified(&reads, &mut dests);
            for (outcome, &(digest, seq, loc, ..)) in outcomes.iter().zip(chunk) {
                if matches!(outcome, Some(crate::disk::ReadOutcome::Rejected(_)))
                    && self.index.lock(digest).clear_disk(digest, seq, loc)
                {
                    dropped += 1;
                }
            }
        }
        tracing::warn!(
            writer = node,
            region = newest,
            checked,
            dropped,
            "another writer stopped without closing: the values indexed from its newest region \
             were verified, and those that no longer read were dropped"
        );
    }

    /// Whether another writer's region not yet followed may be opened:
    /// its descriptor fits the budget. When it does not, the region is
    /// not followed (its blocks are misses; what it holds is unknown, so
    /// the pass counts as incomplete and keeps every removal), counted,
    /// and said once until every region is followed again.
    fn room_for_another_file(&self, path: &Path) -> bool {
        if self.disk.room_for_other_file() {
            return true;
        }
        self.note_over_budget(path);
        false
    }

    /// A region not followed for want of a descriptor (see
    /// `room_for_another_file`).
    fn note_over_budget(&self, path: &Path) {
        self.pass_incomplete.store(true, Ordering::Relaxed);
        self.over_budget_this_pass.fetch_add(1, Ordering::Relaxed);
        if !self.over_budget_said.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                path = %path.display(),
                budget = self.disk.other_files_budget(),
                "the descriptors this node keeps for other writers' region files are spent: \
                 regions past them are not followed (their blocks are misses) until some \
                 are collected. Raise the open-file limit (ulimit -n, LimitNOFILE=), or \
                 look for junk writer directories in the shared directory"
            );
        }
    }

    /// What reading another writer's `what` gave: a failure marks the pass
    /// incomplete (the floor is 0) and is said once when the file turns
    /// unreadable (`unreadable` remembers it) and once when it reads
    /// again, not at every pass (5 a second).
    fn readable<T>(
        &self,
        read: std::io::Result<Option<T>>,
        unreadable: &mut bool,
        dir: &Path,
        what: &str,
        meanwhile: &str,
    ) -> Option<T> {
        match read {
            Ok(value) => {
                if std::mem::take(unreadable) {
                    tracing::info!(dir = %dir.display(), "another writer's {what} reads again");
                }
                value
            }
            Err(e) => {
                if !std::mem::replace(unreadable, true) {
                    tracing::warn!(dir = %dir.display(), error = %e, "cannot read another writer's {what}; {meanwhile}");
                }
                self.pass_incomplete.store(true, Ordering::Relaxed);
                None
            }
        }
    }

    fn follow_writer(&self, node: &str, dir: &Path, vanished: &mut HashSet<u32>) {
        // Its write floor before anything else: every put it writes after
        // publishing it is numbered at or above it, and everything it had
        // written by then is in the listing read below.
        let published = write_floor::read(dir);
        // The head before the listing: its writer creates a region's file
        // before it names the region in its head, so every id up to the
        // head read here has a file in the listing unless it was deleted
        // (reclaim takes only the oldest, which leaves no gap).
        let head = read_other_head(dir);
        let head = {
            let mut state = self.state.lock().unwrap();
            let log = state.writers.entry(node.to_string()).or_default();
            log.published_floor = self.readable(
                published,
                &mut log.floor_unreadable,
                dir,
                "write floor",
                "keeping every removal until it reads",
            );
            self.readable(
                head,
                &mut log.head_unreadable,
                dir,
                "log head",
                "keeping every removal, and a deleted newest region of its log would not be noticed, until it reads",
            )
        };
        let listing = match self.disk.list_other_regions(node, dir, head) {
            Ok(Some(listing)) => listing,
            // A writer that has not created its first region yet.
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "cannot list another writer's regions; will retry");
                self.pass_incomplete.store(true, Ordering::Relaxed);
                return;
            }
        };
        let first_sight = self
            .state
            .lock()
            .unwrap()
            .writers
            .get(node)
            .is_none_or(|log| !log.listed);
        if first_sight {
            self.load_checkpoint(node, dir, &listing);
        }
        let reconciled = self.disk.reconcile_other(node, &listing);
        {
            let mut state = self.state.lock().unwrap();
            let log = state.writers.entry(node.to_string()).or_default();
            log.listed = true;
            if log.behind_gap == 0 && listing.behind_gap > 0 {
                tracing::error!(writer = node, regions = listing.behind_gap, "region files are missing from the middle of another writer's log (deleted, renamed or unreadable): its older regions are not indexed, since the missing ones may have removed their puts");
            }
            log.behind_gap = listing.behind_gap;
            if !reconciled.dropped.is_empty() {
                log.last_change = Some(SystemTime::now());
            }
        }
        // Regions gone, behind a gap, replaced or cut short: dropped; the
        // entries of a file still listed go before it is read again.
        vanished.extend(reconciled.dropped.iter().copied());
        if !reconciled.reread.is_empty() {
            self.index
                .clear_regions(|region| reconciled.reread.contains(&region));
        }
        for (id, sealed) in reconciled.to_read {
            self.read_region(node, id, &listing, sealed, vanished);
        }
        if let Some(newest) = listing.newest() {
            self.verify_after_unclean_stop(node, dir, newest);
        }
    }

    /// Indexes the batches of region `id` of `node` past where the last
    /// read stopped (the disk tier opens it afresh and verifies every
    /// record).
    fn read_region(
        &self,
        node: &str,
        id: u32,
        listing: &RegionListing,
        sealed: bool,
        vanished: &mut HashSet<u32>,
    ) {
        let path = || {
            let name = listing.files.get(&id).map_or("", |(name, _)| name.as_str());
            listing.region_dir.join(name)
        };
        let (handle, batches, skipped_pages) = match self
            .disk
            .read_other_region(node, id, listing, sealed)
        {
            RegionRead::Read {
                handle,
                batches,
                skipped_pages,
            } => (handle, batches, skipped_pages),
            RegionRead::OverBudget => return self.note_over_budget(&path()),
            RegionRead::Gone | RegionRead::NoHandle => return,
            RegionRead::Failed(e) => {
                tracing::warn!(path = %path().display(), error = %e, "cannot open another writer's region; will retry");
                self.pass_incomplete.store(true, Ordering::Relaxed);
                return;
            }
            RegionRead::Shrunk {
                handle,
                len,
                scanned_to,
            } => {
                // No writer truncates a region, so this is damage or a
                // replacement. Its entries go; a later pass meets it as
                // a new file only if its name changes.
                tracing::warn!(path = %path().display(), len, scanned_to, "another writer's region shrank; dropping its entries");
                vanished.insert(handle);
                return;
            }
        };
        let mut min_put_seq = u64::MAX;
        let mut max_seq = 0u64;
        for (batch_start, entries) in &batches {
            for entry in entries {
                if entry.kind == RecordKind::Put {
                    min_put_seq = min_put_seq.min(entry.seq);
                }
                max_seq = max_seq.max(entry.seq);
            }
            // The clock first (never under a shard lock: the write log
            // takes shard locks under its own).
            if max_seq > 0 {
                self.log.observe(max_seq);
            }
            for entry in entries {
                self.apply(handle, *batch_start, entry);
            }
            crate::io::progress::note();
        }
        if skipped_pages > 0 {
            tracing::warn!(path = %path().display(), pages = skipped_pages, "pages without a valid batch in another writer's sealed region (a torn tail or damage); skipped them");
        }
        let mut state = self.state.lock().unwrap();
        let Some(log) = state.writers.get_mut(node) else {
            return;
        };
        if !batches.is_empty() {
            log.newest_seq = log.newest_seq.max(max_seq);
            log.last_change = Some(SystemTime::now());
        }
        let least = log.min_put_seq.entry(handle).or_insert(u64::MAX);
        *least = (*least).min(min_put_seq);
        drop(state);
        self.counters
            .batches
            .fetch_add(batches.len() as u64, Ordering::Relaxed);
    }

    /// Whether an entry numbered `seq` reads too far ahead of this node's
    /// clock (counted; the first one warned about): a put is then not
    /// indexed.
    fn refuse_ahead_of_clock(&self, seq: u64) -> bool {
        if !self.log.ahead_of_clock(seq) {
            return false;
        }
        if self.counters.clock_ahead.fetch_add(1, Ordering::Relaxed) == 0 {
            tracing::warn!(
                seq,
                "another writer's entries are numbered more than 5 minutes ahead of this \
                 node's clock (its clock is wrong, or this one's): its puts are not indexed, its \
                 removals still apply (shared_clock_ahead_entries)"
            );
        }
        true
    }

    /// Applies one record entry of another writer (whose region is
    /// `handle`).
    fn apply(&self, handle: u32, batch_start: u64, entry: &RecordEntry) {
        match entry.kind {
            RecordKind::Tombstone => self.apply_tombstone(handle, entry.digest, entry.seq),
            RecordKind::Put => {
                let Some(loc) = value_loc(handle, batch_start, entry) else {
                    return;
                };
                self.apply_put(
                    entry.digest,
                    entry.seq,
                    entry.checksum,
                    loc,
                    entry.value_len,
                );
            }
        }
    }

    /// Per key the highest sequence number wins, a tombstone on a tie.
    fn apply_put(&self, digest: KeyDigest, seq: u64, checksum: u64, loc: DiskLoc, len: u32) {
        if self.refuse_ahead_of_clock(seq) {
            return;
        }
        if !self.owns(digest) {
            self.counters.outside_share.fetch_add(1, Ordering::Relaxed);
            self.outranks_unshared(digest, seq, false);
            return;
        }
        let mut shard = self.index.lock(digest);
        let current = shard.get(digest).map(Entry::seq);
        let removed_after = self
            .state
            .lock()
            .unwrap()
            .tombstones
            .get(&digest.0)
            .is_some_and(|(removed, _)| *removed >= seq);
        if removed_after || current.is_some_and(|s| s >= seq) {
            return;
        }
        shard.insert(digest, Entry::new(seq, checksum, None, Some(loc), len));
    }

    /// A put (or removal) of another writer for a key outside this node's
    /// share still outranks the entry this node may hold of it from its
    /// own log (indexed whole): that entry goes, so a read here asks the
    /// share's owner, which holds the newer state, instead of answering
    /// with a value removed or replaced elsewhere.
    fn outranks_unshared(&self, digest: KeyDigest, seq: u64, tombstone: bool) {
        let mut shard = self.index.lock(digest);
        let outranked = shard
            .get(digest)
            .map(Entry::seq)
            .is_some_and(|current| current < seq || (tombstone && current == seq));
        if outranked {
            shard.remove(digest);
        }
    }

    /// Remembers a removal (from `origin`, a region handle) and drops an
    /// entry it outranks.
    fn apply_tombstone(&self, origin: u32, digest: KeyDigest, seq: u64) {
        // Counted, but applied all the same: a removal is never ignored (a
        // miss is always safe). Until this node's clock catches up with its
        // number, the key misses here even after later puts.
        let _ = self.refuse_ahead_of_clock(seq);
        if !self.owns(digest) {
            // Another node's share: that node indexes the key and keeps
            // the removal.
            self.outranks_unshared(digest, seq, true);
            return;
        }
        let mut shard = self.index.lock(digest);
        let current = shard.get(digest).map(Entry::seq);
        {
            let mut state = self.state.lock().unwrap();
            let slot = state.tombstones.entry(digest.0).or_insert((0, origin));
            if slot.0 <= seq {
                *slot = (seq, origin);
            }
        }
        if current.is_some_and(|s| s <= seq) {
            shard.remove(digest);
        }
    }

    /// Loads the newest index checkpoint of a writer seen for the first
    /// time: the regions it covers are then read only past what it covers.
    /// A checkpoint that does not verify, or whose regions are gone or
    /// differ, is passed over (the records are read instead).
    fn load_checkpoint(&self, node: &str, dir: &Path, listing: &RegionListing) {
        let Some((_, path)) = checkpoint::list(&dir.join(checkpoint::CHECKPOINT_DIR), node).pop()
        else {
            return;
        };
        let loaded = match checkpoint::read(&path, node, self.disk.secret()) {
            Ok(loaded) => loaded,
            Err(why) => {
                tracing::warn!(path = %path.display(), %why, "passing over another writer's index checkpoint; reading its records instead");
                return;
            }
        };
        let mut handles: HashMap<u32, u32> = HashMap::new();
        // The newest region adopted (id, handle): its handle carries the
        // checkpoint's removals.
        let mut newest: Option<(u32, u32)> = None;
        for covered in &loaded.regions {
            let Some((name, listed_len)) = listing.files.get(&covered.id) else {
                continue;
            };
            let same_file =
                parse_region_name(name).is_some_and(|n| n.incarnation == covered.incarnation);
            if !same_file || *listed_len < covered.covered || covered.covered < PAGE_SIZE {
                continue;
            }
            if !self.room_for_another_file(&listing.region_dir.join(name)) {
                continue;
            }
            let Some(handle) = self.disk.adopt_other_region(
                node,
                covered.id,
                &listing.region_dir,
                name,
                covered.covered,
            ) else {
                continue;
            };
            handles.insert(covered.id, handle);
            if newest.is_none_or(|(id, _)| id < covered.id) {
                newest = Some((covered.id, handle));
            }
        }
        let Some((_, origin)) = newest else {
            return;
        };
        let max_seq = loaded
            .entries
            .iter()
            .map(|e| e.seq)
            .chain(loaded.tombstones.iter().map(|t| t.1))
            .max()
            .unwrap_or(0);
        if max_seq > 0 {
            self.log.observe(max_seq);
        }
        {
            let mut state = self.state.lock().unwrap();
            let log = state.writers.entry(node.to_string()).or_default();
            // The checkpoint lists live entries only: the puts it leaves
            // out (removed or overwritten elsewhere) may be older than
            // every one it lists. Unknown, so the floor keeps every removal
            // while these regions exist.
            log.min_put_seq
                .extend(handles.values().map(|&handle| (handle, 0)));
            log.newest_seq = max_seq;
            log.last_change = Some(SystemTime::now());
        }
        for (digest, seq) in &loaded.tombstones {
            self.apply_tombstone(origin, *digest, *seq);
        }
        let mut applied = 0u64;
        for e in &loaded.entries {
            let Some(&handle) = handles.get(&e.region) else {
                continue;
            };
            self.apply_put(
                e.digest,
                e.seq,
                e.checksum,
                DiskLoc::new(handle, e.page),
                e.len,
            );
            applied += 1;
            if applied.is_multiple_of(1024) {
                crate::io::progress::note();
            }
        }
        tracing::info!(
            writer = node,
            seq = loaded.seq,
            entries = applied,
            tombstones = loaded.tombstones.len(),
            "loaded another writer's index checkpoint"
        );
        self.counters
            .checkpoints_loaded
            .fetch_add(1, Ordering::Relaxed);
        self.counters
            .checkpoint_entries
            .fetch_add(applied, Ordering::Relaxed);
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
mod tests {
    //! The follower over a bare index, write log and disk tier (no store):
    //! another writer's log is written by the disk tier's own writer, in
    //! the layout of a shared directory.
    use super::*;
    use crate::config::{Config, IoEngineKind};
    use crate::disk::format::RecordEntry;
    use crate::disk::{PendingBatch, RecoveryChecks};
    use crate::io::AlignedBuf;
    use crate::key::{value_checksum, KeySecret, KEY_SECRET_LEN};

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

    fn open_log(
        setup_root: &Path,
        config: &Config,
        secret: &Arc<KeySecret>,
        node: &str,
    ) -> DiskTier {
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
        let outcomes = s.own_disk.read_verified(&[Some(read)], &mut [&mut buf[..]]);
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
}
