//! A local directory's index checkpoint (docs/design.md, "Local index
//! checkpoints"): written when the store closes cleanly, loaded at the next
//! open instead of reading every batch record, when the region files are
//! still exactly the ones it recorded. After an unclean stop, or if
//! anything about the log differs, the open reads every record as before.

use crate::checkpoint::{self, Checkpoint, CHECKPOINT_DIR};
use crate::disk::{DiskLoc, RecordedRegion};
use crate::index::{Entry, Index};
use crate::key::KeySecret;
use crate::units::PAGE_SIZE;
use std::path::{Path, PathBuf};

/// Where a local directory's checkpoints live.
pub(super) fn dir_of(data_dir: &Path) -> PathBuf {
    data_dir.join(CHECKPOINT_DIR)
}

/// The newest checkpoint this node left in `data_dir`, if it reads, verifies
/// and every entry lies within a region it records; `None` (and a line in
/// the log saying why) otherwise.
pub(super) fn load(data_dir: &Path, node: &str, secret: &KeySecret) -> Option<Checkpoint> {
    let (_, path) = checkpoint::list(&dir_of(data_dir), node).pop()?;
    let loaded = checkpoint::read(&path, node, secret).and_then(|loaded| {
        check_entries(&loaded)?;
        Ok(loaded)
    });
    match loaded {
        Ok(loaded) => Some(loaded),
        Err(reason) => {
            tracing::warn!(path = %path.display(), %reason, "cannot use the index checkpoint; reading every record instead");
            None
        }
    }
}

/// The regions a checkpoint recorded, as the disk tier matches them.
pub(super) fn recorded_regions(checkpoint: &Checkpoint) -> Vec<RecordedRegion> {
    checkpoint
        .regions
        .iter()
        .map(|r| RecordedRegion {
            id: r.id,
            incarnation: r.incarnation,
            len: r.covered,
        })
        .collect()
}

/// Indexes the checkpoint's entries (once the disk tier opened its
/// regions as recorded), the higher sequence number winning as in
/// recovery. Returns how many.
pub(super) fn index_entries(index: &Index, checkpoint: &Checkpoint) -> u64 {
    for e in &checkpoint.entries {
        let mut shard = index.lock(e.digest);
        if shard.get(e.digest).is_some_and(|held| held.seq() >= e.seq) {
            continue;
        }
        let entry = Entry::new(
            e.seq,
            e.checksum,
            None,
            Some(DiskLoc::new(e.region, e.page)),
            e.len,
        );
        shard.insert(e.digest, entry);
    }
    checkpoint.entries.len() as u64
}

/// Every entry names a recorded region and lies within its recorded
/// length, and its sequence number is within the log's: a checkpoint is
/// the writer's own, but an index never points outside its files.
fn check_entries(checkpoint: &Checkpoint) -> std::result::Result<(), String> {
    let lens: std::collections::HashMap<u32, u64> = checkpoint
        .regions
        .iter()
        .map(|r| (r.id, r.covered))
        .collect();
    for e in &checkpoint.entries {
        let Some(&len) = lens.get(&e.region) else {
            return Err(format!(
                "an entry names region {}, which it does not record",
                e.region
            ));
        };
        let end = u64::from(e.page)
            .checked_mul(PAGE_SIZE)
            .and_then(|start| start.checked_add(u64::from(e.len)));
        if end.is_none_or(|end| end > len) {
            return Err(format!("an entry lies past the end of region {}", e.region));
        }
        if e.seq > checkpoint.seq || e.seq >= 1 << 63 {
            return Err("an entry's sequence number is past the checkpoint's".into());
        }
    }
    Ok(())
}
