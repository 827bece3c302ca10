//! Loading another writer's newest index checkpoint when it is first
//! seen, so a long log is not read record by record.

use super::*;

impl Follower {
    /// Loads the newest index checkpoint of a writer seen for the first
    /// time: the regions it covers are then read only past what it covers.
    /// A checkpoint that does not verify, or whose regions are gone or
    /// differ, is passed over (the records are read instead).
    pub(super) fn load_checkpoint(&self, node: &str, dir: &Path, listing: &RegionListing) {
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
