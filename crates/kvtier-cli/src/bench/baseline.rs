//! What the machine can do without kvtier, measured in the same run:
//! raw O_DIRECT io_uring reads and writes of the same sizes at the same
//! depth on a scratch file (what fio would get), and memcpy bandwidth.
//! Written against the io_uring crate directly, independent of kvtier's
//! own engine, so the baseline shares none of its code.

use super::Measurement;
use io_uring::{opcode, types, IoUring};
use kvtier::disk::io::AlignedBuf;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::time::Instant;

fn open_direct(path: &Path, create: bool) -> io::Result<File> {
    let mut options = OpenOptions::new();
    options.read(true).write(true);
    if create {
        options.create(true).truncate(true);
    }
    let mut direct = options.clone();
    direct.custom_flags(libc::O_DIRECT);
    direct.open(path).or_else(|_| options.open(path))
}

/// Runs `n` transfers of `len` bytes at `offsets`, all submitted at once,
/// and waits for all of them. `write` picks the direction.
fn transfer(
    ring: &mut IoUring,
    file: &File,
    bufs: &mut [AlignedBuf],
    offsets: &[u64],
    len: usize,
    write: bool,
) -> io::Result<()> {
    let fd = types::Fd(file.as_raw_fd());
    let mut done = vec![0usize; offsets.len()];
    let mut pending: Vec<usize> = (0..offsets.len()).collect();
    while !pending.is_empty() {
        for &i in &pending {
            let ptr = bufs[i].as_mut_slice().as_mut_ptr();
            // SAFETY: `done[i] < len <= buffer length`.
            let at = unsafe { ptr.add(done[i]) };
            let remaining = (len - done[i]) as u32;
            let offset = offsets[i] + done[i] as u64;
            let entry = if write {
                opcode::Write::new(fd, at, remaining).offset(offset).build()
            } else {
                opcode::Read::new(fd, at, remaining).offset(offset).build()
            };
            // SAFETY: the buffers outlive this call, which waits for every
            // submitted operation before returning.
            unsafe { ring.submission().push(&entry.user_data(i as u64)) }
                .map_err(|_| io::Error::other("baseline ring too small"))?;
        }
        let submitted = pending.len();
        pending.clear();
        let mut completed = 0;
        while completed < submitted {
            ring.submit_and_wait(submitted - completed)?;
            for cqe in ring.completion() {
                completed += 1;
                let i = cqe.user_data() as usize;
                let result = cqe.result();
                if result < 0 {
                    return Err(io::Error::from_raw_os_error(-result));
                }
                if result == 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "baseline transfer made no progress",
                    ));
                }
                done[i] += result as usize;
                if done[i] < len {
                    pending.push(i);
                }
            }
        }
    }
    Ok(())
}

/// A scratch file moved with raw O_DIRECT io_uring transfers of
/// `value_size` bytes, `batch` per submission: batch `b` covers values
/// `b * batch ..`, laid out back to back as the store lays out a batch.
pub struct RawFile {
    file: File,
    ring: IoUring,
    bufs: Vec<AlignedBuf>,
    value_size: usize,
    padded: usize,
    batch: usize,
}

impl RawFile {
    /// A fresh (truncated) file; writes extend it, as the store's regions
    /// are extended.
    pub fn create(path: &Path, value_size: usize, batch: usize) -> io::Result<RawFile> {
        let file = open_direct(path, true)?;
        let bufs: Vec<AlignedBuf> = (0..batch)
            .map(|i| {
                let mut b = AlignedBuf::zeroed(value_size);
                super::data::fill(
                    format!("baseline/{i}").as_bytes(),
                    &mut b.as_mut_slice()[..value_size],
                );
                b
            })
            .collect();
        Ok(RawFile {
            file,
            ring: IoUring::new(batch.next_power_of_two().max(2) as u32)?,
            padded: bufs[0].len(),
            bufs,
            value_size,
            batch,
        })
    }

    fn offsets(&self, b: u64) -> Vec<u64> {
        (0..self.batch as u64)
            .map(|i| (b * self.batch as u64 + i) * self.padded as u64)
            .collect()
    }

    /// Writes batches `range`, then `fdatasync`, all timed into `m`.
    pub fn write(&mut self, range: std::ops::Range<u64>, m: &mut Measurement) -> io::Result<()> {
        let started = Instant::now();
        for b in range.clone() {
            let offsets = self.offsets(b);
            let call = Instant::now();
            transfer(
                &mut self.ring,
                &self.file,
                &mut self.bufs,
                &offsets,
                self.padded,
                true,
            )?;
            m.record_call(call.elapsed());
        }
        self.file.sync_data()?;
        m.add_span(
            started.elapsed(),
            (range.end - range.start) * (self.batch * self.value_size) as u64,
        );
        Ok(())
    }

    /// Reads batches `range` (written before by `write`), timed into `m`.
    pub fn read(&mut self, range: std::ops::Range<u64>, m: &mut Measurement) -> io::Result<()> {
        let started = Instant::now();
        for b in range.clone() {
            let offsets = self.offsets(b);
            let call = Instant::now();
            transfer(
                &mut self.ring,
                &self.file,
                &mut self.bufs,
                &offsets,
                self.padded,
                false,
            )?;
            m.record_call(call.elapsed());
        }
        m.add_span(
            started.elapsed(),
            (range.end - range.start) * (self.batch * self.value_size) as u64,
        );
        Ok(())
    }
}

/// memcpy of `batch` values of `value_size` bytes per call into distinct
/// (pre-touched) destinations, from sources cycling over a working set as
/// large as the store case's, so neither side runs from cache alone.
pub struct Memcpy {
    sources: Vec<Vec<u8>>,
    dests: Vec<AlignedBuf>,
    value_size: usize,
    next: usize,
}

impl Memcpy {
    pub fn new(value_size: usize, batch: usize, working_set_values: usize) -> Memcpy {
        Memcpy {
            sources: (0..working_set_values.max(batch))
                .map(|i| {
                    let mut v = vec![0u8; value_size];
                    super::data::fill(format!("memcpy/{i}").as_bytes(), &mut v);
                    v
                })
                .collect(),
            dests: (0..batch).map(|_| AlignedBuf::zeroed(value_size)).collect(),
            value_size,
            next: 0,
        }
    }

    pub fn run(&mut self, range: std::ops::Range<u64>, m: &mut Measurement) {
        let started = Instant::now();
        for _ in range.clone() {
            let call = Instant::now();
            for dst in self.dests.iter_mut() {
                dst.as_mut_slice()[..self.value_size].copy_from_slice(&self.sources[self.next]);
                self.next = (self.next + 1) % self.sources.len();
            }
            std::hint::black_box(&mut self.dests);
            m.record_call(call.elapsed());
        }
        m.add_span(
            started.elapsed(),
            (range.end - range.start) * (self.dests.len() * self.value_size) as u64,
        );
    }
}
