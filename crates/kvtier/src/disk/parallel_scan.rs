//! Recovery's region scans on several threads, applied in log order.
//!
//! Reading a region's batch records is a chain of dependent reads (each
//! batch's header gives the next batch's offset), so one region's scan is
//! bound by the device's latency, not its bandwidth or the CPU; regions are
//! independent, so scanning several at once is what reaches the device's
//! depth. What recovery decides from a scan (the gap rule, the tail scrub,
//! setting regions aside, applying entries newest region first) stays on
//! the calling thread, in the order the regions are given: only the reads
//! and the records' verification move to the workers.

use super::format::{RecordEntry, RecordOrigin, RegionHeader, REGION_HEADER_LEN};
use super::scan::{scan_batches, BadPage, RegionReader, ScanEnd};
use crate::error::{Error, Result};
use crate::key::KeySecret;
use crate::units::PAGE_SIZE;
use std::collections::VecDeque;
use std::fs::File;
use std::path::PathBuf;
use std::sync::{Condvar, Mutex};

/// Most threads recovery scans with: the regions' reads are latency-bound,
/// so twice the CPUs (at least 4) keep a device busy without a thread per
/// region.
const MAX_SCAN_THREADS: usize = 16;

/// Threads recovery scans with on this machine.
pub(super) fn scan_threads() -> usize {
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
    (cpus * 2).clamp(4, MAX_SCAN_THREADS)
}

/// A region file recovery opened, to be scanned.
pub(super) struct Candidate {
    pub id: u32,
    /// What its records are bound to.
    pub origin: RecordOrigin,
    pub path: PathBuf,
    pub file: File,
    pub direct: bool,
    pub file_len: u64,
}

/// A candidate with what its scan found.
pub(super) struct Scanned {
    pub candidate: Candidate,
    /// The region's header, or why it does not decode or name the region.
    pub header: std::result::Result<RegionHeader, String>,
    pub scan: ScanEnd,
    /// Every verified batch's entries with the batch's offset, in order.
    pub entries: Vec<(u64, RecordEntry)>,
}

fn scan_one(candidate: Candidate, secret: &KeySecret) -> Scanned {
    let (id, file_len) = (candidate.id, candidate.file_len);
    let mut reader = RegionReader::new(&candidate.file, file_len);
    let header = if file_len < REGION_HEADER_LEN {
        Err("region file shorter than its header".to_string())
    } else {
        reader
            .read(0, PAGE_SIZE as usize, false)
            .map_err(|e| e.to_string())
            .and_then(RegionHeader::decode)
            .and_then(|h| {
                if h.region == id {
                    Ok(h)
                } else {
                    Err(format!("header names region {}", h.region))
                }
            })
    };
    let mut entries = Vec::new();
    let from = REGION_HEADER_LEN;
    let origin = candidate.origin;
    let scan = scan_batches(
        &mut reader,
        &origin,
        secret,
        from,
        BadPage::Resync,
        |batch_start, batch| {
            entries.extend(batch.into_iter().map(|entry| (batch_start, entry)));
        },
    );
    drop(reader);
    Scanned {
        candidate,
        header,
        scan,
        entries,
    }
}

struct Progress {
    queue: VecDeque<(usize, Candidate)>,
    done: Vec<Option<Scanned>>,
    /// Results handed to the consumer so far.
    consumed: usize,
    /// Set when the consumer stops (done or failed): workers take no more.
    stop: bool,
    /// Set by a worker that panicked: the consumer would wait for ever.
    worker_panicked: bool,
}

/// Marks a worker's panic, so the consumer stops waiting for its result.
struct PanicFlag<'a> {
    progress: &'a Mutex<Progress>,
    ready: &'a Condvar,
}

impl Drop for PanicFlag<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            if let Ok(mut progress) = self.progress.lock() {
                progress.worker_panicked = true;
            }
            self.ready.notify_all();
        }
    }
}

/// Scans `candidates` on up to `threads` threads and hands each result to
/// `consume` in the order given, on the calling thread. At most `threads +
/// 1` regions are scanned ahead of `consume`, so memory stays bounded by a
/// few regions' entries whatever the log's length. Stops at the first error
/// `consume` returns.
pub(super) fn scan_in_order(
    candidates: Vec<Candidate>,
    secret: &KeySecret,
    threads: usize,
    mut consume: impl FnMut(Scanned) -> Result<()>,
) -> Result<()> {
    let count = candidates.len();
    if count == 0 {
        return Ok(());
    }
    let threads = threads.clamp(1, count);
    let window = threads + 1;
    let progress = Mutex::new(Progress {
        queue: candidates.into_iter().enumerate().collect(),
        done: (0..count).map(|_| None).collect(),
        consumed: 0,
        stop: false,
        worker_panicked: false,
    });
    let ready = Condvar::new();
    std::thread::scope(|scope| {
        for _ in 0..threads {
            let (progress, ready) = (&progress, &ready);
            let spawned = std::thread::Builder::new()
                .name("kvtier-recover".into())
                .spawn_scoped(scope, move || {
                    let _flag = PanicFlag { progress, ready };
                    loop {
                        let (slot, candidate) = {
                            let mut state = progress.lock().unwrap();
                            loop {
                                if state.stop {
                                    return;
                                }
                                match state.queue.front() {
                                    None => return,
                                    Some(&(slot, _)) if slot < state.consumed + window => {
                                        break state.queue.pop_front().expect("a front item");
                                    }
                                    Some(_) => state = ready.wait(state).unwrap(),
                                }
                            }
                        };
                        let scanned = scan_one(candidate, secret);
                        progress.lock().unwrap().done[slot] = Some(scanned);
                        ready.notify_all();
                    }
                });
            if let Err(e) = spawned {
                progress.lock().unwrap().stop = true;
                ready.notify_all();
                return Err(Error::io("starting a recovery scan thread", e));
            }
        }
        let mut consumed = || -> Result<()> {
            for slot in 0..count {
                let scanned = {
                    let mut state = progress.lock().unwrap();
                    loop {
                        if let Some(scanned) = state.done[slot].take() {
                            state.consumed = slot + 1;
                            break scanned;
                        }
                        if state.worker_panicked {
                            return Err(Error::invalid("a recovery scan thread panicked"));
                        }
                        state = ready.wait(state).unwrap();
                    }
                };
                ready.notify_all();
                consume(scanned)?;
            }
            Ok(())
        };
        let result = consumed();
        progress.lock().unwrap().stop = true;
        ready.notify_all();
        result
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// Files of junk (no header, no batch verifies), of lengths from empty
    /// to several pages, so scans take different times.
    fn junk_candidates(count: u32) -> Vec<Candidate> {
        (0..count)
            .map(|id| {
                let mut file = tempfile::tempfile().unwrap();
                let pages = (id * 7 % 5) as usize;
                file.write_all(&vec![id as u8 ^ 0xA5; pages * PAGE_SIZE as usize])
                    .unwrap();
                Candidate {
                    id: 1000 - id,
                    origin: RecordOrigin {
                        writer: [1; 16],
                        incarnation: 0,
                        region: 1000 - id,
                        accept_unbound: true,
                    },
                    path: PathBuf::from(format!("junk-{id}")),
                    file,
                    direct: false,
                    file_len: (pages as u64) * PAGE_SIZE,
                }
            })
            .collect()
    }

    /// Results come to the consumer in the order given, each exactly once,
    /// whatever order the threads finish in, for any thread count.
    #[test]
    fn results_are_consumed_in_the_order_given() {
        let secret = KeySecret::from_bytes([7; crate::key::KEY_SECRET_LEN]);
        for threads in [1, 2, 4, 16, 64] {
            let candidates = junk_candidates(40);
            let expected: Vec<u32> = candidates.iter().map(|c| c.id).collect();
            let mut seen = Vec::new();
            scan_in_order(candidates, &secret, threads, |scanned| {
                let scan = &scanned.scan;
                assert_eq!(scan.verified_batches, 0);
                assert!(scanned.header.is_err());
                assert!(scanned.entries.is_empty());
                seen.push(scanned.candidate.id);
                Ok(())
            })
            .unwrap();
            assert_eq!(seen, expected, "threads {threads}");
        }
    }

    /// A consumer's error stops the scan and comes back; no worker is left
    /// waiting.
    #[test]
    fn a_consumer_error_stops_the_scan() {
        let secret = KeySecret::from_bytes([7; crate::key::KEY_SECRET_LEN]);
        let mut consumed = 0;
        let result = scan_in_order(junk_candidates(40), &secret, 4, |_| {
            consumed += 1;
            if consumed == 5 {
                return Err(Error::invalid("stop here"));
            }
            Ok(())
        });
        assert!(result.unwrap_err().to_string().contains("stop here"));
        assert_eq!(consumed, 5);
    }
}
