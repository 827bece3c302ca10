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
use std::os::unix::io::{AsRawFd, RawFd};
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

/// One raw transfer: `len` bytes at `offset` of the file `fd`.
#[derive(Debug, Clone, Copy)]
struct Transfer {
    fd: RawFd,
    offset: u64,
    len: usize,
}

/// Keeps `depth` transfers in flight (refilling as each completes, as fio
/// does at `iodepth=depth`) until every one is done. Transfer `n` uses
/// buffer `buffer_of(n)`. Records per-transfer latencies into `m`.
fn stream(
    ring: &mut IoUring,
    bufs: &mut [AlignedBuf],
    buffer_of: impl Fn(usize) -> usize,
    transfers: &[Transfer],
    depth: usize,
    write: bool,
    m: &mut Measurement,
) -> io::Result<()> {
    let mut done = vec![0usize; transfers.len()];
    let mut started = vec![Instant::now(); transfers.len()];
    let mut next = 0usize;
    let mut retry: Vec<usize> = Vec::new();
    let mut in_flight = 0usize;
    let mut finished = 0usize;
    while finished < transfers.len() {
        while in_flight < depth && (next < transfers.len() || !retry.is_empty()) {
            let n = retry.pop().unwrap_or_else(|| {
                next += 1;
                next - 1
            });
            if done[n] == 0 {
                started[n] = Instant::now();
            }
            let t = transfers[n];
            let buf = &mut bufs[buffer_of(n)];
            assert!(
                t.len <= buf.len(),
                "baseline transfer larger than its buffer"
            );
            // SAFETY: `done[n] < t.len <= buffer length`.
            let at = unsafe { buf.as_mut_slice().as_mut_ptr().add(done[n]) };
            let remaining = (t.len - done[n]) as u32;
            let offset = t.offset + done[n] as u64;
            let fd = types::Fd(t.fd);
            let entry = if write {
                opcode::Write::new(fd, at, remaining).offset(offset).build()
            } else {
                opcode::Read::new(fd, at, remaining).offset(offset).build()
            };
            // SAFETY: the buffers outlive this call, which waits for every
            // submitted operation before returning.
            unsafe { ring.submission().push(&entry.user_data(n as u64)) }
                .map_err(|_| io::Error::other("baseline ring too small"))?;
            in_flight += 1;
        }
        ring.submit_and_wait(1)?;
        let completions: Vec<(usize, i32)> = ring
            .completion()
            .map(|c| (c.user_data() as usize, c.result()))
            .collect();
        for (n, result) in completions {
            in_flight -= 1;
            if result < 0 {
                return Err(io::Error::from_raw_os_error(-result));
            }
            if result == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "baseline transfer made no progress",
                ));
            }
            done[n] += result as usize;
            if done[n] < transfers[n].len {
                retry.push(n);
            } else {
                finished += 1;
                m.record_call(started[n].elapsed());
            }
        }
    }
    Ok(())
}

/// A scratch file moved with raw O_DIRECT io_uring transfers of
/// `value_size` bytes, keeping `batch` in flight continuously: the device
/// limit at that depth, what fio reports at `iodepth=batch`. Values are
/// laid out back to back, as the store lays out a batch. Rows built from
/// it report per-transfer latency for the baseline.
pub struct RawFile {
    file: File,
    ring: IoUring,
    read_bufs: Vec<AlignedBuf>,
    value_size: usize,
    padded: usize,
    batch: usize,
}

impl RawFile {
    /// A fresh (truncated) file; writes extend it, as the store's regions
    /// are extended.
    pub fn create(path: &Path, value_size: usize, batch: usize) -> io::Result<RawFile> {
        let file = open_direct(path, true)?;
        let read_bufs: Vec<AlignedBuf> = (0..batch)
            .map(|_| super::data::touched_buffer(value_size))
            .collect();
        Ok(RawFile {
            file,
            ring: IoUring::new(batch.next_power_of_two().max(2) as u32)?,
            padded: read_bufs[0].len(),
            read_bufs,
            value_size,
            batch,
        })
    }

    fn transfers(&self, offsets: &[u64]) -> Vec<Transfer> {
        offsets
            .iter()
            .map(|&offset| Transfer {
                fd: self.file.as_raw_fd(),
                offset,
                len: self.padded,
            })
            .collect()
    }

    fn offsets(&self, range: &std::ops::Range<u64>) -> Vec<u64> {
        (range.start * self.batch as u64..range.end * self.batch as u64)
            .map(|v| v * self.padded as u64)
            .collect()
    }

    /// Writes batches `range` (data generated first, untimed), then
    /// `fdatasync`, timed into `m`.
    pub fn write(&mut self, range: std::ops::Range<u64>, m: &mut Measurement) -> io::Result<()> {
        let offsets = self.offsets(&range);
        let mut prepared: Vec<AlignedBuf> = (0..offsets.len())
            .map(|n| {
                let mut buf = AlignedBuf::zeroed(self.value_size);
                let key = format!("raw/{}/{}/{}", self.value_size, self.batch, offsets[n]);
                super::data::fill(key.as_bytes(), &mut buf.as_mut_slice()[..self.value_size]);
                buf
            })
            .collect();
        let transfers = self.transfers(&offsets);
        let started = Instant::now();
        stream(
            &mut self.ring,
            &mut prepared,
            |n| n,
            &transfers,
            self.batch,
            true,
            m,
        )?;
        self.file.sync_data()?;
        m.add_span(
            started.elapsed(),
            offsets.len() as u64 * self.value_size as u64,
        );
        Ok(())
    }

    /// Reads batches `range` (written before by `write`), timed into `m`.
    pub fn read(&mut self, range: std::ops::Range<u64>, m: &mut Measurement) -> io::Result<()> {
        let offsets = self.offsets(&range);
        let depth = self.batch;
        let transfers = self.transfers(&offsets);
        let started = Instant::now();
        stream(
            &mut self.ring,
            &mut self.read_bufs,
            |n| n % depth,
            &transfers,
            depth,
            false,
            m,
        )?;
        m.add_span(
            started.elapsed(),
            offsets.len() as u64 * self.value_size as u64,
        );
        Ok(())
    }
}

/// memcpy of `batch` values of `value_size` bytes per call into distinct
/// (pre-touched) destinations, from sources cycling over a working set as
/// large as the store case's, so neither side runs from cache alone. With
/// `threads` > 1, as many threads copy their shares of a round at once
/// (each with its own destinations), as the store case's callers do, and
/// the round counts the busiest thread's time, as theirs does.
pub struct Memcpy {
    sources: Vec<Vec<u8>>,
    /// `batch` destinations per thread.
    dests: Vec<Vec<AlignedBuf>>,
    value_size: usize,
}

impl Memcpy {
    pub fn new(
        value_size: usize,
        batch: usize,
        working_set_values: usize,
        threads: usize,
    ) -> Memcpy {
        Memcpy {
            sources: (0..working_set_values.max(batch))
                .map(|i| {
                    let mut v = vec![0u8; value_size];
                    super::data::fill(format!("memcpy/{i}").as_bytes(), &mut v);
                    v
                })
                .collect(),
            dests: (0..threads.max(1))
                .map(|_| {
                    (0..batch)
                        .map(|_| super::data::touched_buffer(value_size))
                        .collect()
                })
                .collect(),
            value_size,
        }
    }

    pub fn run(&mut self, range: std::ops::Range<u64>, m: &mut Measurement) {
        let sources = &self.sources;
        let value_size = self.value_size;
        let bytes = (range.end - range.start) * (self.dests[0].len() * value_size) as u64;
        // Each call copies the values the store case's call for the same
        // batch number reads.
        let copied = super::on_callers(range, &mut self.dests, m, bytes, |b, dests| {
            let call = Instant::now();
            let mut next = (b as usize * dests.len()) % sources.len();
            for dst in dests.iter_mut() {
                dst.as_mut_slice()[..value_size].copy_from_slice(&sources[next]);
                next = (next + 1) % sources.len();
            }
            std::hint::black_box(&mut *dests);
            Ok((call.elapsed(), 0))
        });
        copied.expect("memcpy cannot fail");
    }
}
