//! After another writer stopped uncleanly: the values of its newest
//! region are read back and verified before this node serves them.

use super::*;

impl Follower {
    /// A writer that stopped without closing (its lock free, no clean
    /// marker in its directory: killed, or its host lost power) may have
    /// lost the end of its newest region after this node indexed it (a
    /// power loss takes what its disk had not made durable, or a device
    /// that lied takes more): every value this node indexed from that
    /// region is read and verified once, and the ones that do not verify
    /// are dropped, so `exists` and prefix lookups stop reporting blocks
    /// no read returns (before, until the writer restarted, and for ever
    /// if it never did).
    pub(super) fn verify_after_unclean_stop(&self, node: &str, dir: &Path, newest: u32) {
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
            let outcomes = self.disk.read_values(&reads, &mut dests);
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
}
