//! Every batch record the tier reads from, for the namespace census and
//! retirement (`store::namespaces`): this log's regions whole, and other
//! writers' regions of a shared directory up to where they were followed
//! (what the index may hold of them). Read through the one scanner, every
//! record verified, so a key handed over is one the directory's secret
//! made.

use super::format::{RecordEntry, REGION_HEADER_LEN};
use super::scan::{scan_batches, value_loc, BadPage, RegionReader};
use super::{DiskLoc, DiskTier, Region};
use crate::error::{Error, Result};
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// Entries a bounded scan's thread hands over at a time, at most.
const SCAN_CHUNK: usize = 4096;
/// A bounded scan's thread hands over what it has at least this often.
const SCAN_HANDOVER: Duration = Duration::from_millis(100);

/// A region file to read records from: the region the index names, the
/// id its records carry (another writer's own id, not the handle), and
/// how far to read.
struct RecordSource {
    region: Arc<Region>,
    file_id: u32,
    until: u64,
    other_writers: bool,
}

impl DiskTier {
    /// Hands every entry of every verified record to `visit`, with the
    /// index location of a put's value (`None` for a tombstone, or a put
    /// no location can name). Regions reclaimed meanwhile are read from
    /// the descriptor held (their entries are gone from the index, so
    /// they match nothing there). Reads are plain `pread`s of the records
    /// only (about one page per batch), on the caller's thread, unbounded:
    /// callers go through `visit_records_within`.
    pub(crate) fn visit_records(&self, mut visit: impl FnMut(Option<DiskLoc>, RecordEntry)) {
        for source in self.record_sources() {
            let mut reader = RegionReader::new(&source.region.file, source.until);
            let (index_id, file_id) = (source.region.id, source.file_id);
            let origin = if source.other_writers {
                super::names::record_origin(source.region.path(), file_id, "", false)
            } else {
                self.own_origin(source.region.path(), file_id)
            };
            scan_batches(
                &mut reader,
                &origin,
                &self.secret,
                REGION_HEADER_LEN,
                BadPage::Resync,
                |batch_start, entries| {
                    for entry in entries {
                        let loc = (entry.kind == super::format::RecordKind::Put)
                            .then(|| value_loc(index_id, batch_start, &entry))
                            .flatten();
                        visit(loc, entry);
                    }
                },
            );
            if source.other_writers {
                // What was read of another writer's buffered file may be
                // kept by the page cache: never let it serve a later scan
                // or value read (see `other_logs::files::scan_new_batches`).
                super::mount::drop_cached(
                    &source.region.file,
                    REGION_HEADER_LEN,
                    source.until.saturating_sub(REGION_HEADER_LEN),
                );
            }
        }
    }

    /// `visit_records`, within the storage deadline (`Config::io_deadline`;
    /// unbounded when it is zero): the records are read on a thread of
    /// their own, which hands entries over as it goes, and the caller
    /// gives up once it waited a deadline for the next (a file system
    /// that stopped answering), with a `TimedOut` error that says so. The
    /// thread stays parked in the kernel until the file system answers;
    /// while one is, further scans fail at once instead of parking more.
    /// Before this, a stalled mount held the namespace census and
    /// retirement, operators' commands, until it came back.
    ///
    /// A scan given up on has visited part of the records only: callers
    /// must not act on what it saw (the census and retirement fail whole).
    pub(crate) fn visit_records_within(
        self: &Arc<Self>,
        mut visit: impl FnMut(Option<DiskLoc>, RecordEntry),
    ) -> Result<()> {
        let deadline = self.io_deadline;
        if deadline.is_zero() {
            self.visit_records(visit);
            return Ok(());
        }
        let timed_out =
            |why: String| Error::io(why, std::io::Error::from(std::io::ErrorKind::TimedOut));
        if self.scans_held.load(Ordering::Acquire) > 0 {
            return Err(timed_out(format!(
                "an earlier scan of the batch records is still waiting for the file system, past \
                 the storage deadline (io_deadline, {deadline:?}); try again once it answers"
            )));
        }
        // Chunks in flight are bounded: a slow caller holds the thread
        // back, never memory.
        let (tx, rx) = mpsc::sync_channel::<Vec<(Option<DiskLoc>, RecordEntry)>>(4);
        // (finished, given up), for whichever of the two sides is last.
        let state = Arc::new(Mutex::new((false, false)));
        let tier = Arc::clone(self);
        let scan_state = Arc::clone(&state);
        std::thread::Builder::new()
            .name("kvtier-record-scan".into())
            .spawn(move || {
                #[cfg(test)]
                {
                    // Held at most a minute: a test that never opens the
                    // gate fails instead of hanging.
                    let (gate, opened) = &*tier.scan_gate;
                    let held = gate.lock().unwrap();
                    let _ = opened.wait_timeout_while(held, Duration::from_secs(60), |h| *h);
                }
                let mut chunk = Vec::new();
                let mut handed = Instant::now();
                let mut gone = false;
                tier.visit_records(|loc, entry| {
                    if gone {
                        return;
                    }
                    chunk.push((loc, entry));
                    if chunk.len() >= SCAN_CHUNK || handed.elapsed() >= SCAN_HANDOVER {
                        gone = tx.send(std::mem::take(&mut chunk)).is_err();
                        handed = Instant::now();
                    }
                });
                if !gone {
                    let _ = tx.send(chunk);
                }
                drop(tx);
                let mut state = scan_state.lock().unwrap_or_else(|e| e.into_inner());
                state.0 = true;
                if state.1 {
                    tier.scans_held.fetch_sub(1, Ordering::AcqRel);
                }
            })
            .map_err(|e| Error::io("starting a record scan", e))?;
        loop {
            match rx.recv_timeout(deadline) {
                Ok(chunk) => {
                    for (loc, entry) in chunk {
                        visit(loc, entry);
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => return Ok(()),
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    let mut state = state.lock().unwrap_or_else(|e| e.into_inner());
                    if state.0 {
                        // Finished meanwhile: what it sent is still to come.
                        continue;
                    }
                    state.1 = true;
                    self.scans_held.fetch_add(1, Ordering::AcqRel);
                    return Err(timed_out(format!(
                        "the batch records were not read within the storage deadline \
                         (io_deadline, {deadline:?}): the file system is not answering; \
                         nothing was changed, try again once it answers"
                    )));
                }
            }
        }
    }

    /// Record scans given up on whose thread still waits (for tests).
    #[cfg(test)]
    pub(crate) fn scans_held(&self) -> u64 {
        self.scans_held.load(Ordering::Acquire)
    }

    fn record_sources(&self) -> Vec<RecordSource> {
        let mut sources: Vec<RecordSource> = self
            .regions
            .read()
            .unwrap()
            .values()
            .map(|region| RecordSource {
                region: Arc::clone(region),
                file_id: region.id,
                until: region.len(),
                other_writers: false,
            })
            .collect();
        let followed = self.followed_regions();
        let others = self.others.read().unwrap();
        for (handle, file_id, until) in followed {
            if let Some(region) = others.get(&handle) {
                sources.push(RecordSource {
                    region: Arc::clone(region),
                    file_id,
                    until: until.min(region.len()),
                    other_writers: true,
                });
            }
        }
        sources
    }
}
