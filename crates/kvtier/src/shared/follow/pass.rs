//! A follow pass (docs/design.md, "Following other writers"): listing the
//! writers, stepping through each one's regions under the step deadline,
//! reading the batch records appended since the last pass, and dropping
//! what vanished.

use super::*;

impl Follower {
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
    pub(super) fn follow_step(&self, node: &str, dir: &Path, known: bool) -> bool {
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
    pub(super) fn drop_vanished(&self, vanished: &HashSet<u32>) {
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

    /// What reading another writer's `what` gave: a failure marks the pass
    /// incomplete (the floor is 0) and is said once when the file turns
    /// unreadable (`unreadable` remembers it) and once when it reads
    /// again, not at every pass (5 a second).
    pub(super) fn readable<T>(
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

    pub(super) fn follow_writer(&self, node: &str, dir: &Path, vanished: &mut HashSet<u32>) {
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
    pub(super) fn read_region(
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
}
