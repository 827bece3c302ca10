//! The device's side of every disk case, measured over the same files in
//! the same run, with raw O_DIRECT io_uring transfers written against the
//! io_uring crate directly (no kvtier engine code):
//!
//! - the **ceiling**: a sweep of transfer size x queue depth, as fio
//!   would run it, whose best shape is then re-measured round by round
//!   beside the store; nothing can read or write the device faster, so the
//!   store's ratio to it is at most 1 (the ceiling is the best rate any side
//!   reached in the case, the store's included);
//!   The ceiling's transfers land in (or come from) as many buffers as it
//!   keeps in flight, reused again and again, as fio's are: a few MiB that
//!   can stay in the CPU's caches. The store cannot do that (a batch lands
//!   in, or comes from, the caller's memory: value size x batch), so disk
//!   cases also measure the same best shape **in the batch's memory**
//!   (enough buffers, taken in turn, to cover the batch's bytes): what
//!   separates the two is what the cache-resident buffers are worth on
//!   this host, not the store;
//! - the **shape-matched** stream: exactly the store's requests (same
//!   offsets, piece size and depth; for puts, the flusher's batches, writes
//!   and syncs), verified as the store verifies (reads are checksummed
//!   piece by piece as they complete, inside the timed region); the store's
//!   ratio to it is its software overhead.
//!
//! Every descriptor is checked for O_DIRECT: a file system that refuses it
//! makes the bench fail instead of reporting page-cache speed.

use crate::measure::Measurement;
use io_uring::{opcode, squeue, types, IoUring};
use kvtier::internals::BatchBudget;
use kvtier::AlignedBuf;
use kvtier::{DiskLocation, ValueChecksum};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
/// The io_uring engine's write chunk, from the core.
pub const STORE_WRITE_CHUNK: usize = kvtier::internals::WRITE_CHUNK;
/// Transfer sizes and depths the ceiling sweep tries.
const SWEEP_SIZES: [usize; 10] = [
    128 * KIB,
    256 * KIB,
    512 * KIB,
    MIB,
    2 * MIB,
    4 * MIB,
    8 * MIB,
    16 * MIB,
    32 * MIB,
    64 * MIB,
];
const SWEEP_DEPTHS: [usize; 8] = [1, 2, 4, 8, 16, 32, 64, 128];
/// At most this many bytes in flight (and in buffers) at one sweep point.
const SWEEP_MAX_IN_FLIGHT: usize = 256 * MIB;

/// Fails unless O_DIRECT is in effect on `file`.
pub fn require_direct(file: &File, path: &Path) -> io::Result<()> {
    // SAFETY: F_GETFL reads the descriptor's flags; `file` keeps it open.
    let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    if flags & libc::O_DIRECT == 0 {
        return Err(io::Error::other(format!(
            "O_DIRECT is not in effect on {}: the bench refuses to report a disk baseline through the page cache",
            path.display()
        )));
    }
    Ok(())
}

fn open_direct(path: &Path, write: bool, create: bool) -> io::Result<File> {
    let mut options = OpenOptions::new();
    options.read(true).write(write).custom_flags(libc::O_DIRECT);
    if create {
        options.create(true).truncate(true);
    }
    let file = options.open(path).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("opening {} with O_DIRECT: {e}", path.display()),
        )
    })?;
    require_direct(&file, path)?;
    Ok(file)
}

/// A transfer size and queue depth.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub size: usize,
    pub depth: usize,
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.size >= MIB {
            write!(f, "{}MiB x {}", self.size / MIB, self.depth)
        } else {
            write!(f, "{}KiB x {}", self.size / KIB, self.depth)
        }
    }
}

/// Runs `count` transfers on `ring`, at most `depth` in flight, refilling
/// as each completes (fio's `iodepth`). `prepare(i, done, slot)` builds the
/// SQE for the rest of transfer `i` after `done` bytes, in buffer slot
/// `slot` of `slots` (at least `depth`; a slot is free again once its
/// transfer completes, and free slots are taken in turn, oldest first);
/// `len(i)` is its length; `on_done(i)` runs when it completes, in
/// completion order.
///
/// # Safety
/// The SQEs must point into buffers that stay valid until this returns,
/// and no two transfers in flight at once may share bytes of a buffer
/// (slots exist for that).
unsafe fn run(
    ring: &mut IoUring,
    count: usize,
    depth: usize,
    slots: usize,
    len: impl Fn(usize) -> usize,
    prepare: impl Fn(usize, usize, usize) -> squeue::Entry,
    mut on_done: impl FnMut(usize),
) -> io::Result<()> {
    let mut done = vec![0usize; count];
    let mut slot_of = vec![usize::MAX; count];
    let mut free: std::collections::VecDeque<usize> = (0..slots.max(depth)).collect();
    let mut queue: std::collections::VecDeque<usize> = (0..count).collect();
    let mut in_flight = 0usize;
    let mut finished = 0usize;
    let mut failure = None;
    while finished < count && failure.is_none() || in_flight > 0 {
        while failure.is_none() && in_flight < depth {
            let Some(&i) = queue.front() else { break };
            if slot_of[i] == usize::MAX {
                match free.pop_front() {
                    Some(slot) => slot_of[i] = slot,
                    None => break,
                }
            }
            let entry = prepare(i, done[i], slot_of[i]).user_data(i as u64);
            // SAFETY: the caller's contract; this function returns only
            // after every submitted transfer has completed.
            if unsafe { ring.submission().push(&entry) }.is_err() {
                break;
            }
            queue.pop_front();
            in_flight += 1;
        }
        if let Err(e) = ring.submit_and_wait(1) {
            if !matches!(
                e.raw_os_error(),
                Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY)
            ) {
                // Buffers may still be in the kernel's hands: stop here.
                eprintln!("kvtier bench: io_uring submission failed: {e}");
                std::process::abort();
            }
        }
        let completed: Vec<(usize, i32)> = ring
            .completion()
            .map(|c| (c.user_data() as usize, c.result()))
            .collect();
        in_flight -= completed.len();
        for (i, result) in completed {
            if result == -libc::EINTR || result == -libc::EAGAIN {
                queue.push_front(i);
            } else if result < 0 {
                failure.get_or_insert(io::Error::from_raw_os_error(-result));
            } else if result == 0 {
                failure.get_or_insert(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "raw transfer made no progress",
                ));
            } else {
                done[i] += result as usize;
                if done[i] < len(i) {
                    queue.push_front(i);
                } else {
                    finished += 1;
                    free.push_back(slot_of[i]);
                    on_done(i);
                }
            }
        }
    }
    match failure {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

fn ring_for(depth: usize) -> io::Result<IoUring> {
    IoUring::new(depth.next_power_of_two().max(2) as u32)
}

/// The buffers a ceiling's transfers land in (reads) or come from
/// (writes): transfer-sized slots in one page-aligned area, one per
/// transfer in flight (fio's layout), or enough to cover `footprint`
/// bytes when that is more (a batch's memory).
struct Slots {
    area: AlignedBuf,
    size: usize,
    count: usize,
}

impl Slots {
    fn new(shape: Shape, footprint: usize) -> Slots {
        let count = shape.depth.max(footprint.div_ceil(shape.size));
        Slots {
            area: crate::data::touched_buffer(count * shape.size),
            size: shape.size,
            count,
        }
    }

    fn base(&mut self) -> *mut u8 {
        self.area.as_mut_slice().as_mut_ptr()
    }
}

/// A set of files (a store's region files) opened O_DIRECT for reading.
pub struct FileSet {
    files: Vec<(PathBuf, File, u64)>,
}

impl FileSet {
    pub fn open(paths: &[PathBuf]) -> io::Result<FileSet> {
        let mut files = Vec::with_capacity(paths.len());
        for path in paths {
            let file = open_direct(path, false, false)?;
            let len = file.metadata()?.len() / 4096 * 4096;
            if len > 0 {
                files.push((path.clone(), file, len));
            }
        }
        if files.is_empty() {
            return Err(io::Error::other("no data to read for the device ceiling"));
        }
        Ok(FileSet { files })
    }

    /// Every `*.kvr` region file under each store directory's `regions`.
    pub fn regions_of(dirs: &[&Path]) -> io::Result<FileSet> {
        let mut paths = Vec::new();
        for dir in dirs {
            let mut found: Vec<PathBuf> = std::fs::read_dir(dir.join("regions"))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "kvr"))
                .collect();
            found.sort();
            paths.extend(found);
        }
        FileSet::open(&paths)
    }

    pub fn total(&self) -> u64 {
        self.files.iter().map(|f| f.2).sum()
    }

    /// The position (a file of the set and a page-aligned offset in it)
    /// half of the set's bytes in: where a second reader starts so that
    /// two readers taking the same steps never read the same blocks (on a
    /// disk with a cache below it, the second reader of a block is served
    /// from that cache).
    pub fn halfway(&self) -> (usize, u64) {
        let mut left = self.total() / 2 / 4096 * 4096;
        for (i, (_, _, len)) in self.files.iter().enumerate() {
            if left < *len {
                return (i, left);
            }
            left -= len;
        }
        (0, 0)
    }

    fn fd(&self, path: &Path) -> Option<RawFd> {
        self.files
            .iter()
            .find(|f| f.0 == path)
            .map(|f| f.1.as_raw_fd())
    }
}

/// Raw reads of `shape` front to back over a file set, wrapping around,
/// from where the last call stopped.
pub struct CeilingReader<'a> {
    set: &'a FileSet,
    shape: Shape,
    ring: IoUring,
    slots: Slots,
    file: usize,
    offset: u64,
}

impl<'a> CeilingReader<'a> {
    /// Reads landing in `shape.depth` reused buffers, or in buffers
    /// covering `footprint` bytes, taken in turn, when that is more.
    pub fn new(set: &'a FileSet, shape: Shape, footprint: usize) -> io::Result<Self> {
        Ok(CeilingReader {
            set,
            shape,
            ring: ring_for(shape.depth)?,
            slots: Slots::new(shape, footprint),
            file: 0,
            offset: 0,
        })
    }

    /// The reader, continuing at `(file, offset)` of its set (from an
    /// earlier reader's `position` over the same files, some of which may
    /// have grown since); from the start where that is past the set.
    pub fn starting_at(mut self, (file, offset): (usize, u64)) -> Self {
        if self.set.files.get(file).is_some_and(|f| offset < f.2) {
            (self.file, self.offset) = (file, offset);
        }
        self
    }

    /// Where the next read starts: a file of the set and an offset in it.
    pub fn position(&self) -> (usize, u64) {
        (self.file, self.offset)
    }

    /// Reads at least `bytes` (whole transfers), timed into `m` as one span.
    pub fn read(&mut self, bytes: u64, m: &mut Measurement) -> io::Result<()> {
        let mut plan: Vec<(RawFd, u64, usize)> = Vec::new();
        let mut planned = 0u64;
        while planned < bytes {
            let (_, file, len) = &self.set.files[self.file];
            let take = (len - self.offset).min(self.shape.size as u64) as usize;
            plan.push((file.as_raw_fd(), self.offset, take));
            planned += take as u64;
            self.offset += take as u64;
            if self.offset >= *len {
                self.offset = 0;
                self.file = (self.file + 1) % self.set.files.len();
            }
        }
        let (base, size, slots) = (self.slots.base(), self.slots.size, self.slots.count);
        let started = Instant::now();
        // SAFETY: each transfer reads into its own slot, which lives in
        // `self` across the call; slots are never shared in flight.
        unsafe {
            run(
                &mut self.ring,
                plan.len(),
                self.shape.depth,
                slots,
                |i| plan[i].2,
                |i, done, slot| {
                    let (fd, offset, len) = plan[i];
                    let into = base.add(slot * size + done);
                    opcode::Read::new(types::Fd(fd), into, (len - done) as u32)
                        .offset(offset + done as u64)
                        .build()
                },
                |_| {},
            )?;
        }
        let elapsed = started.elapsed();
        m.add_span(elapsed, planned);
        m.record_call(elapsed);
        Ok(())
    }
}

/// Bytes each sweep point moves: enough to fill the queue several times,
/// within `budget`.
fn point_bytes(shape: Shape, budget: u64) -> u64 {
    ((4 * shape.size * shape.depth) as u64)
        .clamp(32 << 20, 512 << 20)
        .min(budget)
}

/// The sweep's shapes: every size and depth with at most
/// `SWEEP_MAX_IN_FLIGHT` (and no more than `data` bytes) in flight.
fn sweep_shapes(data: u64) -> Vec<Shape> {
    let mut shapes = Vec::new();
    for &size in &SWEEP_SIZES {
        for &depth in &SWEEP_DEPTHS {
            let in_flight = size * depth;
            if in_flight <= SWEEP_MAX_IN_FLIGHT && in_flight as u64 <= data.max(size as u64) {
                shapes.push(Shape { size, depth });
            }
        }
    }
    shapes
}

/// Runs `point` for every sweep shape (`data` bounds the bytes in flight)
/// with the bytes each point moves; returns the fastest shape.
fn sweep(
    data: u64,
    budget: u64,
    mut point: impl FnMut(Shape, u64, &mut Measurement) -> io::Result<()>,
) -> io::Result<Shape> {
    let mut best = None;
    // KVTIER_BENCH_SWEEP_TRACE=1 prints every point (to see a file
    // system's read shape, not just its best point).
    let trace = std::env::var_os("KVTIER_BENCH_SWEEP_TRACE").is_some();
    for shape in sweep_shapes(data) {
        let mut m = Measurement::new();
        point(shape, point_bytes(shape, budget), &mut m)?;
        if trace {
            eprintln!(
                "sweep {} KiB x {}: {:.0} MB/s",
                shape.size >> 10,
                shape.depth,
                m.mb_per_s()
            );
        }
        if best.is_none_or(|(_, rate)| m.mb_per_s() > rate) {
            best = Some((shape, m.mb_per_s()));
        }
    }
    best.map(|(shape, _)| shape)
        .ok_or_else(|| io::Error::other("no shape to sweep"))
}

/// The read sweep over `set`: its fastest shape.
pub fn sweep_reads(set: &FileSet, budget: u64) -> io::Result<Shape> {
    sweep(set.total(), budget, |shape, bytes, m| {
        CeilingReader::new(set, shape, 0)?.read(bytes, m)
    })
}

/// Raw writes of `shape`, appended to a scratch file, then `fdatasync`.
pub struct CeilingWriter {
    path: PathBuf,
    file: File,
    shape: Shape,
    ring: IoUring,
    slots: Slots,
    offset: u64,
}

impl CeilingWriter {
    /// Writes coming from `shape.depth` reused buffers, or from buffers
    /// covering `footprint` bytes, taken in turn, when that is more.
    pub fn create(path: &Path, shape: Shape, footprint: usize) -> io::Result<Self> {
        let mut slots = Slots::new(shape, footprint);
        crate::data::fill(b"ceiling", slots.area.as_mut_slice());
        Ok(CeilingWriter {
            path: path.to_path_buf(),
            file: open_direct(path, true, true)?,
            shape,
            ring: ring_for(shape.depth)?,
            slots,
            offset: 0,
        })
    }

    /// Writes at least `bytes` (whole transfers) and syncs them, timed
    /// into `m` as one span.
    pub fn write(&mut self, bytes: u64, m: &mut Measurement) -> io::Result<()> {
        let count = bytes.div_ceil(self.shape.size as u64) as usize;
        let size = self.shape.size;
        let fd = self.file.as_raw_fd();
        let base = self.offset;
        let (from, slots) = (self.slots.base().cast_const(), self.slots.count);
        let started = Instant::now();
        // SAFETY: writes only read their slot, owned by `self`.
        unsafe {
            run(
                &mut self.ring,
                count,
                self.shape.depth,
                slots,
                |_| size,
                |i, done, slot| {
                    let source = from.add(slot * size + done);
                    opcode::Write::new(types::Fd(fd), source, (size - done) as u32)
                        .offset(base + (i * size + done) as u64)
                        .build()
                },
                |_| {},
            )?;
        }
        self.file.sync_data()?;
        let elapsed = started.elapsed();
        m.add_span(elapsed, (count * size) as u64);
        m.record_call(elapsed);
        self.offset += (count * size) as u64;
        Ok(())
    }
}

impl Drop for CeilingWriter {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The write sweep on a scratch file at `path` (writes plus the final
/// `fdatasync`): its fastest shape.
pub fn sweep_writes(path: &Path, budget: u64) -> io::Result<Shape> {
    sweep(u64::MAX, budget, |shape, bytes, m| {
        CeilingWriter::create(path, shape, 0)?.write(bytes, m)
    })
}

/// The store's read stream replayed raw: per batch call, every value of
/// the batch cut into the store's read pieces at the value's offset in
/// its region file, all queued at once with at most `depth` in flight (the
/// store's `io_depth`), into a page-aligned host buffer; each value is
/// checksummed piece by piece, in order, as its pieces complete, and
/// compared with the checksum the store's index holds, as the store does.
pub struct ShapeReader<'a> {
    set: &'a FileSet,
    /// Per key number of the case: where its value lies.
    locations: &'a [DiskLocation],
    depth: usize,
    piece: usize,
}

/// Fails unless the shape-matched stream verified as many bytes as the
/// store's gets did: both must have read the case's values, all of them.
pub fn check_same_verified(shape: u64, store: u64) -> Result<(), String> {
    if shape == store {
        Ok(())
    } else {
        Err(format!(
            "the shape-matched reader verified {shape} bytes, the store {store}"
        ))
    }
}

/// One caller thread's ring and host buffer for a `ShapeReader`.
pub struct ShapeCaller {
    ring: IoUring,
    host: AlignedBuf,
}

impl ShapeCaller {
    pub fn new(depth: usize, host_len: usize) -> io::Result<ShapeCaller> {
        Ok(ShapeCaller {
            ring: ring_for(depth)?,
            host: crate::data::touched_buffer(host_len),
        })
    }
}

/// Pieces of one value still to be checksummed, in order.
struct PieceCheck {
    checksum: ValueChecksum,
    done: Vec<bool>,
    next: usize,
}

impl<'a> ShapeReader<'a> {
    pub fn new(
        set: &'a FileSet,
        locations: &'a [DiskLocation],
        depth: usize,
        piece: usize,
    ) -> Self {
        ShapeReader {
            set,
            locations,
            depth,
            piece,
        }
    }

    /// Reads the values of key numbers `keys` into `caller`'s host buffer
    /// (one page-rounded slot each) and verifies them. Returns the call's
    /// time and the bytes verified.
    pub fn read_batch(
        &self,
        keys: std::ops::Range<u64>,
        caller: &mut ShapeCaller,
    ) -> Result<(Duration, u64), String> {
        struct Piece {
            fd: RawFd,
            offset: u64,
            at: usize,
            len: usize,
            value: usize,
            index: usize,
        }
        let piece = self.piece;
        let values: Vec<&DiskLocation> = keys.map(|k| &self.locations[k as usize]).collect();
        let mut pieces = Vec::new();
        let mut slot_start = 0usize;
        for (v, location) in values.iter().enumerate() {
            let fd = self
                .set
                .fd(&location.path)
                .ok_or_else(|| format!("{} is not in the file set", location.path.display()))?;
            let read_len = (location.len as usize).div_ceil(4096) * 4096;
            for (index, start) in (0..read_len).step_by(piece).enumerate() {
                pieces.push(Piece {
                    fd,
                    offset: location.offset + start as u64,
                    at: slot_start + start,
                    len: (read_len - start).min(piece),
                    value: v,
                    index,
                });
            }
            slot_start += read_len;
        }
        if slot_start > caller.host.len() {
            return Err("host buffer too small for the batch".into());
        }
        let mut checks: Vec<PieceCheck> = values
            .iter()
            .map(|l| PieceCheck {
                checksum: ValueChecksum::new(l.digest),
                done: vec![false; ((l.len as usize).div_ceil(4096) * 4096).div_ceil(piece)],
                next: 0,
            })
            .collect();
        let host = caller.host.as_mut_slice().as_mut_ptr();
        let value_start: Vec<usize> = {
            let mut starts = Vec::with_capacity(values.len());
            let mut at = 0;
            for l in &values {
                starts.push(at);
                at += (l.len as usize).div_ceil(4096) * 4096;
            }
            starts
        };
        let started = Instant::now();
        // SAFETY: pieces read into disjoint ranges of the host buffer,
        // which `caller` owns for the whole call.
        unsafe {
            run(
                &mut caller.ring,
                pieces.len(),
                self.depth,
                self.depth,
                |i| pieces[i].len,
                |i, done, _slot| {
                    let p = &pieces[i];
                    opcode::Read::new(
                        types::Fd(p.fd),
                        host.add(p.at + done),
                        (p.len - done) as u32,
                    )
                    .offset(p.offset + done as u64)
                    .build()
                },
                |i| {
                    let p = &pieces[i];
                    let check = &mut checks[p.value];
                    check.done[p.index] = true;
                    let len = values[p.value].len as usize;
                    while check.done.get(check.next).copied().unwrap_or(false) {
                        let from = check.next * piece;
                        let to = ((check.next + 1) * piece).min(len);
                        if from < to {
                            // SAFETY: this piece's read has completed and
                            // nothing else writes its range now.
                            let bytes = std::slice::from_raw_parts(
                                host.add(value_start[p.value] + from),
                                to - from,
                            );
                            check.checksum.update(bytes);
                        }
                        check.next += 1;
                    }
                },
            )
        }
        .map_err(|e| format!("shape-matched read failed: {e}"))?;
        let mut verified = 0u64;
        for (check, location) in checks.into_iter().zip(&values) {
            if check.checksum.finish() != location.checksum {
                return Err(format!(
                    "shape-matched read of {} at {} failed its checksum",
                    location.path.display(),
                    location.offset
                ));
            }
            verified += u64::from(location.len);
        }
        Ok((started.elapsed(), verified))
    }
}

/// The flusher's write stream replayed raw on a scratch file: values
/// grouped into batches as the flusher groups them (record pages plus
/// padded values within `flush_batch_bytes`), each batch's values written
/// as chunks of at most `STORE_WRITE_CHUNK` (never splitting a value), all
/// in flight at once up to `depth`, then `fdatasync`, then the record
/// pages, then `fdatasync` again: the crash protocol's two phases.
pub struct ShapeWriter {
    path: PathBuf,
    file: File,
    ring: IoUring,
    depth: usize,
    flush_batch_bytes: u64,
    offset: u64,
}

/// One flush batch, laid out as the store lays it out, ready to write.
pub struct PreparedFlush {
    buf: AlignedBuf,
    record_len: usize,
    /// (start, len) of each value chunk in `buf`.
    chunks: Vec<(usize, usize)>,
}

impl ShapeWriter {
    pub fn create(path: &Path, depth: usize, flush_batch_bytes: u64) -> io::Result<ShapeWriter> {
        Ok(ShapeWriter {
            path: path.to_path_buf(),
            file: open_direct(path, true, true)?,
            ring: ring_for(depth)?,
            depth,
            flush_batch_bytes,
            offset: 0,
        })
    }

    /// Lays out values (with their qualified key lengths) as the flusher
    /// would batch them. Untimed: the store's values are in its pool
    /// already when the flusher writes them.
    pub fn prepare(&self, values: &[(usize, &[u8])]) -> Vec<PreparedFlush> {
        let pad = |n: usize| n.div_ceil(4096) * 4096;
        let mut flushes = Vec::new();
        let mut i = 0;
        while i < values.len() {
            // The flusher's own rule, from the core.
            let mut budget = BatchBudget::new(self.flush_batch_bytes);
            let take = values[i..]
                .iter()
                .take_while(|v| budget.admit(v.0, pad(v.1.len()) as u64))
                .count();
            let batch = &values[i..i + take];
            let record_len = pad(kvtier::internals::format::record_len(
                batch.iter().map(|v| v.0),
            ));
            let total = record_len + batch.iter().map(|v| pad(v.1.len())).sum::<usize>();
            let mut buf = AlignedBuf::zeroed(total);
            let mut chunks: Vec<(usize, usize)> = Vec::new();
            let mut at = record_len;
            for (_, value) in batch {
                buf.as_mut_slice()[at..at + value.len()].copy_from_slice(value);
                let len = pad(value.len());
                match chunks.last_mut() {
                    Some(chunk) if chunk.1 + len <= STORE_WRITE_CHUNK => chunk.1 += len,
                    _ => chunks.push((at, len)),
                }
                at += len;
            }
            flushes.push(PreparedFlush {
                buf,
                record_len,
                chunks,
            });
            i += take;
        }
        flushes
    }

    /// Writes prepared batches, timed into `m` as one span of `bytes`
    /// (the values' bytes, as the store's side counts).
    pub fn write(
        &mut self,
        flushes: &[PreparedFlush],
        bytes: u64,
        m: &mut Measurement,
    ) -> io::Result<()> {
        let fd = self.file.as_raw_fd();
        let started = Instant::now();
        for flush in flushes {
            let base = self.offset;
            let ptr = flush.buf.as_slice().as_ptr();
            let chunks = &flush.chunks;
            // SAFETY: writes read disjoint ranges of `flush.buf`, which
            // outlives the call.
            unsafe {
                run(
                    &mut self.ring,
                    chunks.len(),
                    self.depth,
                    self.depth,
                    |i| chunks[i].1,
                    |i, done, _| {
                        let (at, len) = chunks[i];
                        opcode::Write::new(types::Fd(fd), ptr.add(at + done), (len - done) as u32)
                            .offset(base + (at + done) as u64)
                            .build()
                    },
                    |_| {},
                )?;
            }
            self.file.sync_data()?;
            let record_len = flush.record_len;
            // SAFETY: as above.
            unsafe {
                run(
                    &mut self.ring,
                    1,
                    1,
                    1,
                    |_| record_len,
                    |_, done, _| {
                        opcode::Write::new(types::Fd(fd), ptr.add(done), (record_len - done) as u32)
                            .offset(base + done as u64)
                            .build()
                    },
                    |_| {},
                )?;
            }
            self.file.sync_data()?;
            self.offset += flush.buf.len() as u64;
        }
        let elapsed = started.elapsed();
        m.add_span(elapsed, bytes);
        m.record_call(elapsed);
        Ok(())
    }
}

impl Drop for ShapeWriter {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Each key's disk location in `store`, by key number.
pub fn locations(
    store: &kvtier::Store,
    keys: impl Iterator<Item = Vec<u8>>,
) -> Result<Vec<DiskLocation>, String> {
    keys.map(|key| {
        store
            .disk_location(&key)
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("{} is not on disk", String::from_utf8_lossy(&key)))
    })
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reader_started_halfway_never_reads_what_one_from_the_start_reads() {
        let dir = tempfile::tempdir().unwrap();
        let mut paths = Vec::new();
        for (i, pages) in [2usize, 5, 3].into_iter().enumerate() {
            let path = dir.path().join(format!("{i}.kvr"));
            std::fs::write(&path, vec![i as u8 + 1; pages * 4096]).unwrap();
            paths.push(path);
        }
        let set = FileSet::open(&paths).unwrap();
        // 10 pages: the middle is page 5, the fourth page of the second file.
        assert_eq!(set.halfway(), (1, 3 * 4096));
        let shape = Shape {
            size: 4096,
            depth: 1,
        };
        let mut first = CeilingReader::new(&set, shape, 0).unwrap();
        let mut second = CeilingReader::new(&set, shape, 0)
            .unwrap()
            .starting_at(set.halfway());
        let mut m = Measurement::new();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for _ in 0..5 {
            a.push(first.position());
            b.push(second.position());
            first.read(4096, &mut m).unwrap();
            second.read(4096, &mut m).unwrap();
        }
        assert!(a.iter().all(|p| !b.contains(p)), "{a:?} {b:?}");
        // Past the end, it wraps to the start.
        assert_eq!(second.position(), (0, 0));
    }
}
