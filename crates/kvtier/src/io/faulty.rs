//! A fault-injecting io engine: the test seam for durability (like
//! raft-engine's fail points and redb's crash backend). It wraps a real
//! engine and can
//!
//! - fail reads, writes or syncs with an errno (EIO, ENOSPC, ...);
//! - cut the power: from that instant every write and sync fails, and
//!   [`FaultyEngine::apply_power_loss`] then rewrites each file as a disk
//!   might have left it: every write not covered by a completed sync of its
//!   file is kept, dropped, or torn (a random subset of its 4 KiB pages
//!   kept, which also models reordering), chosen by a seed.
//!
//! Writes go to the real files as usual (so reads in the same run see
//! them); the engine remembers, per file, each write since that file's last
//! completed sync, and the file's length at that sync.

use super::{IoEngine, LongLivedMemory, ReadOp};
use crate::units::PAGE_SIZE;
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{self, IoSlice};
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

/// Which operations a rule fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultOp {
    Read,
    Write,
    Sync,
}

#[derive(Debug)]
struct Rule {
    op: FaultOp,
    /// Let this many matching operations pass first.
    skip: u64,
    /// Then fail this many (u64::MAX: all).
    count: u64,
    errno: i32,
}

/// One write not yet covered by a sync of its file.
#[derive(Debug)]
struct PendingWrite {
    offset: u64,
    data: Vec<u8>,
}

#[derive(Debug, Default)]
struct FileLog {
    path: PathBuf,
    /// Length at the last completed sync (what survives a power loss for
    /// sure).
    synced_len: u64,
    pending: Vec<PendingWrite>,
}

/// What a power loss did, for the test's report.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PowerLossReport {
    pub files: u64,
    pub writes_kept: u64,
    pub writes_dropped: u64,
    pub writes_torn: u64,
}

/// The fault-injecting engine. Cheap to share: `Arc` it, hand a clone to
/// `Config::wrap_io_engine`, and keep one to steer it.
#[derive(Debug)]
pub struct FaultyEngine {
    inner: Arc<dyn IoEngine>,
    rules: Mutex<Vec<Rule>>,
    files: Mutex<HashMap<(u64, u64), FileLog>>,
    power_cut: AtomicBool,
    /// Panic inside the next operation of this kind (a flusher that dies).
    panic_on: Mutex<Option<FaultOp>>,
    /// Completed operations, for choosing a cut point: writes and syncs.
    operations: AtomicU64,
    /// Cut the power when `operations` reaches this (0: never).
    cut_at: AtomicU64,
    /// Operations held at the gate: a file system that stopped answering.
    gate: Mutex<Gate>,
    gate_opened: Condvar,
    /// Read batches still to come back stale (`stale_reads`).
    stale_reads: AtomicU64,
}

/// What `FaultyEngine::stall` holds, and how many operations wait there.
#[derive(Debug, Default)]
struct Gate {
    reads: bool,
    writes: bool,
    waiting: u64,
    /// Operations that have waited at the gate since the engine was made.
    held: u64,
    /// Reads still let through while `reads` holds (`stall_reads_after`).
    reads_let_through: u64,
    /// Read batches that passed the gate since the engine was made.
    reads_passed: u64,
}

fn file_id(file: &File) -> io::Result<(u64, u64)> {
    let meta = file.metadata()?;
    use std::os::unix::fs::MetadataExt;
    Ok((meta.dev(), meta.ino()))
}

fn errno(code: i32) -> io::Error {
    io::Error::from_raw_os_error(code)
}

/// The one seeded generator the tests draw from (fault dice, crash
/// workloads, hostile byte streams): fastrand's wyrand, so a seed replays.
#[derive(Debug, Clone)]
pub struct Dice(fastrand::Rng);

impl Dice {
    pub fn new(seed: u64) -> Self {
        Dice(fastrand::Rng::with_seed(seed))
    }

    /// A uniform 64-bit draw.
    pub fn roll(&mut self) -> u64 {
        self.0.u64(..)
    }

    /// A uniform draw in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.0.u64(0..n.max(1))
    }
}

impl FaultyEngine {
    pub fn new(inner: Arc<dyn IoEngine>) -> Arc<FaultyEngine> {
        Arc::new(FaultyEngine {
            inner,
            rules: Mutex::new(Vec::new()),
            files: Mutex::new(HashMap::new()),
            power_cut: AtomicBool::new(false),
            panic_on: Mutex::new(None),
            operations: AtomicU64::new(0),
            cut_at: AtomicU64::new(0),
            gate: Mutex::default(),
            gate_opened: Condvar::new(),
            stale_reads: AtomicU64::new(0),
        })
    }

    /// The next `batches` read batches return every piece with its first
    /// byte flipped, as a page cache's copy read before another writer's
    /// bytes landed would (the reads themselves succeed).
    pub fn stale_reads(&self, batches: u64) {
        self.stale_reads.store(batches, Ordering::Release);
    }

    /// Holds every later read (with `reads`) and every write and sync
    /// (with `writes`) until `resume`: a file system whose daemon or
    /// server stopped answering. Operations already running finish.
    pub fn stall(&self, reads: bool, writes: bool) {
        let mut gate = self.gate.lock().unwrap();
        gate.reads = reads;
        gate.writes = writes;
        gate.reads_let_through = 0;
    }

    /// Lets the next `reads` read batches through, then holds every later
    /// one until `resume`: a file system that stops answering partway
    /// through a stream of reads.
    pub fn stall_reads_after(&self, reads: u64) {
        let mut gate = self.gate.lock().unwrap();
        gate.reads = true;
        gate.reads_let_through = reads;
    }

    /// Lets every held operation go on, and stops holding new ones.
    pub fn resume(&self) {
        let mut gate = self.gate.lock().unwrap();
        gate.reads = false;
        gate.writes = false;
        gate.reads_let_through = 0;
        self.gate_opened.notify_all();
    }

    /// Read batches that have gone past the gate (held ones once let go)
    /// since the engine was made.
    pub fn reads_passed(&self) -> u64 {
        self.gate.lock().unwrap().reads_passed
    }

    /// Operations held at the gate now, and since the engine was made.
    pub fn held(&self) -> (u64, u64) {
        let gate = self.gate.lock().unwrap();
        (gate.waiting, gate.held)
    }

    fn pass_gate(&self, op: FaultOp) {
        let mut gate = self.gate.lock().unwrap();
        let holds = |gate: &Gate| match op {
            FaultOp::Read => gate.reads,
            FaultOp::Write | FaultOp::Sync => gate.writes,
        };
        let is_read = op == FaultOp::Read;
        if holds(&gate) {
            if is_read && gate.reads_let_through > 0 {
                gate.reads_let_through -= 1;
            } else {
                gate.waiting += 1;
                gate.held += 1;
                while holds(&gate) {
                    gate = self.gate_opened.wait(gate).unwrap();
                }
                gate.waiting -= 1;
            }
        }
        if is_read {
            gate.reads_passed += 1;
        }
    }

    /// Fails `count` operations of kind `op` with `errno`, after letting
    /// `skip` pass.
    pub fn fail(&self, op: FaultOp, skip: u64, count: u64, errno: i32) {
        self.rules.lock().unwrap().push(Rule {
            op,
            skip,
            count,
            errno,
        });
    }

    /// Panics inside the next operation of kind `op`, as a bug in the io
    /// path would.
    pub fn panic_on_next(&self, op: FaultOp) {
        *self.panic_on.lock().unwrap() = Some(op);
    }

    pub fn clear_faults(&self) {
        self.rules.lock().unwrap().clear();
    }

    /// Cuts the power now: every later write and sync fails with EIO.
    pub fn cut_power(&self) {
        self.power_cut.store(true, Ordering::SeqCst);
    }

    /// Cuts the power once `n` more writes and syncs have been attempted.
    pub fn cut_power_after(&self, n: u64) {
        let now = self.operations.load(Ordering::SeqCst);
        self.cut_at.store(now + n.max(1), Ordering::SeqCst);
    }

    pub fn is_power_cut(&self) -> bool {
        self.power_cut.load(Ordering::SeqCst)
    }

    /// Writes and syncs attempted so far.
    pub fn operations(&self) -> u64 {
        self.operations.load(Ordering::SeqCst)
    }

    /// After the store using this engine is gone: rewrites every file the
    /// engine wrote as the power loss left it (see the module doc), then
    /// forgets everything and restores power. Files removed meanwhile are
    /// skipped.
    pub fn apply_power_loss(&self, seed: u64) -> io::Result<PowerLossReport> {
        let mut dice = Dice::new(seed);
        let mut report = PowerLossReport::default();
        let logs: Vec<FileLog> = self.files.lock().unwrap().drain().map(|(_, v)| v).collect();
        for log in logs {
            if log.pending.is_empty() {
                continue;
            }
            let Ok(file) = OpenOptions::new().write(true).open(&log.path) else {
                continue;
            };
            report.files += 1;
            // Start from the synced state: nothing past the synced length,
            // then each unsynced write's fate.
            let mut len = log.synced_len;
            let mut kept_pages: Vec<(u64, Vec<u8>)> = Vec::new();
            let mut lost: Vec<(u64, usize)> = Vec::new();
            for write in &log.pending {
                let pages = write.data.chunks(PAGE_SIZE as usize);
                match dice.below(3) {
                    0 => {
                        report.writes_kept += 1;
                        kept_pages.push((write.offset, write.data.clone()));
                        len = len.max(write.offset + write.data.len() as u64);
                    }
                    1 => {
                        report.writes_dropped += 1;
                        lost.push((write.offset, write.data.len()));
                    }
                    _ => {
                        report.writes_torn += 1;
                        for (i, page) in pages.enumerate() {
                            let at = write.offset + (i as u64) * PAGE_SIZE;
                            if dice.below(2) == 0 {
                                kept_pages.push((at, page.to_vec()));
                                len = len.max(at + page.len() as u64);
                            } else {
                                lost.push((at, page.len()));
                            }
                        }
                    }
                }
            }
            // Lost bytes read back as zeros (a fresh append never reached
            // the disk); kept ones as written, in write order.
            for (at, n) in lost {
                if at < len {
                    let n = (n as u64).min(len - at) as usize;
                    file.write_all_at(&vec![0u8; n], at)?;
                }
            }
            for (at, bytes) in kept_pages {
                file.write_all_at(&bytes, at)?;
            }
            file.set_len(len)?;
            file.sync_all()?;
        }
        self.power_cut.store(false, Ordering::SeqCst);
        self.cut_at.store(0, Ordering::SeqCst);
        self.clear_faults();
        Ok(report)
    }

    /// Counts the operation, applies a power cut due now, and returns the
    /// error a rule or the cut injects, if any.
    fn inject(&self, op: FaultOp) -> Option<io::Error> {
        if self
            .panic_on
            .lock()
            .unwrap()
            .take_if(|p| *p == op)
            .is_some()
        {
            panic!("injected panic in a {op:?} operation");
        }
        if op != FaultOp::Read {
            let n = self.operations.fetch_add(1, Ordering::SeqCst) + 1;
            let cut_at = self.cut_at.load(Ordering::SeqCst);
            if cut_at != 0 && n >= cut_at {
                self.power_cut.store(true, Ordering::SeqCst);
            }
            if self.power_cut.load(Ordering::SeqCst) {
                return Some(errno(libc::EIO));
            }
        }
        let mut rules = self.rules.lock().unwrap();
        for rule in rules.iter_mut().filter(|r| r.op == op) {
            if rule.skip > 0 {
                rule.skip -= 1;
                continue;
            }
            if rule.count > 0 {
                if rule.count != u64::MAX {
                    rule.count -= 1;
                }
                return Some(errno(rule.errno));
            }
        }
        None
    }

    fn log_write(&self, file: &File, offset: u64, bufs: &[IoSlice<'_>]) -> io::Result<()> {
        let id = file_id(file)?;
        let mut files = self.files.lock().unwrap();
        let log = match files.get_mut(&id) {
            Some(log) => log,
            None => {
                let path = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))?;
                // A file first seen now: what it holds is synced (it was
                // written before this engine saw it, or is new and empty).
                let synced_len = file.metadata()?.len();
                files.entry(id).or_insert(FileLog {
                    path,
                    synced_len,
                    pending: Vec::new(),
                })
            }
        };
        let mut data = Vec::with_capacity(bufs.iter().map(|b| b.len()).sum());
        for buf in bufs {
            data.extend_from_slice(buf);
        }
        log.pending.push(PendingWrite { offset, data });
        Ok(())
    }
}

impl IoEngine for FaultyEngine {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn read_batch_then(&self, reads: &mut [ReadOp<'_>], on_read: &(dyn Fn(usize, &[u8]) + Sync)) {
        self.pass_gate(FaultOp::Read);
        if let Some(e) = self.inject(FaultOp::Read) {
            let code = e.raw_os_error().unwrap_or(libc::EIO);
            for read in reads.iter_mut() {
                read.result = Err(errno(code));
            }
            return;
        }
        let stale = self
            .stale_reads
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok();
        if !stale {
            self.inner.read_batch_then(reads, on_read);
            return;
        }
        self.inner.read_batch_then(reads, &|_, _| {});
        for (i, read) in reads.iter_mut().enumerate() {
            if read.result.is_ok() {
                if let Some(first) = read.buf.first_mut() {
                    *first ^= 0xff;
                }
                on_read(i, read.buf);
            }
        }
    }

    fn write_vectored_at(&self, file: &File, offset: u64, bufs: &[IoSlice<'_>]) -> io::Result<()> {
        self.pass_gate(FaultOp::Write);
        if let Some(e) = self.inject(FaultOp::Write) {
            return Err(e);
        }
        self.log_write(file, offset, bufs)?;
        self.inner.write_vectored_at(file, offset, bufs)
    }

    fn sync_data(&self, file: &File) -> io::Result<()> {
        self.pass_gate(FaultOp::Sync);
        if let Some(e) = self.inject(FaultOp::Sync) {
            return Err(e);
        }
        self.inner.sync_data(file)?;
        let id = file_id(file)?;
        let len = file.metadata()?.len();
        if let Some(log) = self.files.lock().unwrap().get_mut(&id) {
            log.pending.clear();
            log.synced_len = len;
        }
        Ok(())
    }

    fn register_memory(&self, memory: Arc<dyn LongLivedMemory>) -> bool {
        self.inner.register_memory(memory)
    }

    fn register_file(&self, file: &File) {
        self.inner.register_file(file)
    }

    fn unregister_file(&self, file: &File) {
        self.inner.unregister_file(file)
    }

    fn hold_until_idle(&self, file: &File) -> bool {
        self.inner.hold_until_idle(file)
    }

    fn release_hold(&self, file: &File) {
        self.inner.release_hold(file)
    }

    fn uses_fixed_buffers(&self) -> bool {
        self.inner.uses_fixed_buffers()
    }

    fn uses_registered_files(&self) -> bool {
        self.inner.uses_registered_files()
    }
}
