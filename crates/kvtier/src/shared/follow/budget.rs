//! The descriptor budget for other writers' region files: a region past
//! it is not followed (its blocks are misses), counted and said once; a
//! smaller budget closes what is past it.

use super::*;

impl Follower {
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

    /// Whether another writer's region not yet followed may be opened:
    /// its descriptor fits the budget. When it does not, the region is
    /// not followed (its blocks are misses; what it holds is unknown, so
    /// the pass counts as incomplete and keeps every removal), counted,
    /// and said once until every region is followed again.
    pub(super) fn room_for_another_file(&self, path: &Path) -> bool {
        if self.disk.room_for_other_file() {
            return true;
        }
        self.note_over_budget(path);
        false
    }

    /// A region not followed for want of a descriptor (see
    /// `room_for_another_file`).
    pub(super) fn note_over_budget(&self, path: &Path) {
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
}
