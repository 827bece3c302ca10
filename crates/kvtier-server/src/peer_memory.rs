//! Cross-memory transfers: a same-host client that registered its own
//! memory (RegisterPeerMemory) names, in the shared-memory ops, ranges of
//! its address space instead of a shared buffer, and the server reads and
//! writes them with `process_vm_readv` / `process_vm_writev`. A value then
//! crosses once, between the pool and the client's buffer (LMCache's L1,
//! an engine's host pages), where a shared buffer costs the client a copy
//! in or out of it and the socket costs two.
//!
//! Whose memory: only the process that connected (the kernel's SO_PEERCRED
//! pid), and only after a probe showed that the server reads back what the
//! client holds at an address of its choosing. The kernel checks every
//! call (the same user, and ptrace allowed by Yama): the server reaches no
//! memory the kernel would not let it reach anyway, and a client can make
//! it touch no process but itself. A range that is not the client's
//! readable or writable memory fails its own key (EFAULT), nothing else.
//! Values staged on the server (reads from the disk tier, other backends)
//! come out of the buffer budget; puts take the receiving budget per value
//! before their pool extent, as values arriving over a socket do, so a
//! client whose pages stall (a mapping of a hanging file) pins at most that
//! share of the pool.

use crate::handlers::{
    get_table, put_reply, read_staged, result_code, too_small_lens, usable_ranges_overlap, Reply,
    ValueRanges,
};
use crate::limits::{Budgets, Held};
use crate::metrics::Sample;
use kvtier::PutOptions;
use kvtier_client::backend::per_key;
use kvtier_client::{KnownLen, KvBackend};
use kvtier_wire::protocol::{code, put_flags, PEER_PROBE_LEN};
use std::io;
use std::time::Duration;

/// Another process's memory, reached by cross-memory attach.
#[derive(Debug)]
pub(crate) struct PeerMemory {
    pid: libc::pid_t,
}

/// Most iovecs one call passes (the kernel takes up to IOV_MAX, 1024).
const IOVECS_PER_CALL: usize = 256;

impl PeerMemory {
    /// The memory of `pid`, once this process read back `probe` at
    /// `address` of it: the kernel lets this server reach that process,
    /// and it is the one that holds what the client said.
    pub(crate) fn attach(
        pid: i32,
        address: u64,
        probe: &[u8; PEER_PROBE_LEN],
    ) -> Result<PeerMemory, String> {
        let peer = PeerMemory { pid };
        let mut seen = [0u8; PEER_PROBE_LEN];
        peer.read(address, &mut seen).map_err(|e| {
            format!(
                "the server cannot read this client's memory (process {pid}): {e} (cross-memory \
                 attach needs the same user, and Yama's ptrace_scope at 0, or 1 with this server \
                 allowed as the client's ptracer); values travel by shared buffer or socket"
            )
        })?;
        if seen != *probe {
            return Err(format!(
                "the probe read from process {pid} is not what this connection sent: the socket \
                 is not held by the process that connected it"
            ));
        }
        Ok(peer)
    }

    /// Reads `buf.len()` bytes at `address` of the peer, all or an error.
    pub(crate) fn read(&self, address: u64, buf: &mut [u8]) -> io::Result<()> {
        let mut done = 0usize;
        while done < buf.len() {
            let local = libc::iovec {
                iov_base: buf[done..].as_mut_ptr().cast(),
                iov_len: buf.len() - done,
            };
            let remote = libc::iovec {
                iov_base: remote_address(address, done)?,
                iov_len: buf.len() - done,
            };
            // SAFETY: `local` is this process's writable memory, borrowed
            // for the call; the kernel checks `remote` against the peer.
            let n = unsafe { libc::process_vm_readv(self.pid, &local, 1, &remote, 1, 0) };
            done += transferred(n)?;
        }
        Ok(())
    }

    /// Writes `src` across `segments` of the peer, in order: the first
    /// `src.len()` bytes of their concatenation (which must be as long).
    pub(crate) fn write(&self, src: &[u8], segments: &dyn ValueRanges) -> io::Result<()> {
        let mut remote: Vec<libc::iovec> =
            Vec::with_capacity(segments.count().min(IOVECS_PER_CALL));
        let mut left = src.len();
        let mut sent = 0usize;
        let mut i = 0;
        while left > 0 {
            // The next run of segments, cut to what is left of `src`.
            remote.clear();
            let mut run = 0usize;
            while i < segments.count() && remote.len() < IOVECS_PER_CALL && run < left {
                let (address, len) = segments.range(i);
                let take = usize::try_from(len).unwrap_or(usize::MAX).min(left - run);
                if take > 0 {
                    remote.push(libc::iovec {
                        iov_base: remote_address(address, 0)?,
                        iov_len: take,
                    });
                }
                run += take;
                i += 1;
            }
            if run == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "the ranges are shorter than the value",
                ));
            }
            let mut written = 0usize;
            let mut first = 0usize;
            while written < run {
                let local = libc::iovec {
                    iov_base: src[sent + written..].as_ptr().cast_mut().cast(),
                    iov_len: run - written,
                };
                // SAFETY: `local` is this process's readable memory (the
                // kernel only reads it); the kernel checks `remote`.
                let n = unsafe {
                    libc::process_vm_writev(
                        self.pid,
                        &local,
                        1,
                        remote[first..].as_ptr(),
                        (remote.len() - first) as libc::c_ulong,
                        0,
                    )
                };
                let mut n = transferred(n)?;
                written += n;
                // Partial transfers stop at an iovec's edge or inside one:
                // skip what went, go on from there.
                while n > 0 {
                    let step = n.min(remote[first].iov_len);
                    remote[first].iov_len -= step;
                    // SAFETY: arithmetic on an address the kernel checks.
                    remote[first].iov_base =
                        unsafe { remote[first].iov_base.cast::<u8>().add(step).cast() };
                    n -= step;
                    if remote[first].iov_len == 0 {
                        first += 1;
                    }
                }
            }
            sent += run;
            left -= run;
        }
        Ok(())
    }
}

/// `address + offset` as a remote iovec base (never dereferenced here).
fn remote_address(address: u64, offset: usize) -> io::Result<*mut libc::c_void> {
    address
        .checked_add(offset as u64)
        .and_then(|a| usize::try_from(a).ok())
        .map(|a| a as *mut libc::c_void)
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                "an address past the end of memory",
            )
        })
}

/// A transfer's byte count; 0 bytes moved is a fault (nothing readable or
/// writable there), never a reason to loop.
fn transferred(n: isize) -> io::Result<usize> {
    match n {
        n if n > 0 => Ok(n as usize),
        0 => Err(io::Error::from_raw_os_error(libc::EFAULT)),
        _ => Err(io::Error::last_os_error()),
    }
}

/// Whether every range of every item lies in the address space (no
/// `address + len` past 2^64) and each value's ranges add up within usize.
fn capacity(segments: &dyn ValueRanges) -> Option<usize> {
    let mut total = 0usize;
    for i in 0..segments.count() {
        let (address, len) = segments.range(i);
        address.checked_add(len)?;
        total = total.checked_add(usize::try_from(len).ok()?)?;
    }
    Some(total)
}

fn not_the_clients(e: &io::Error) -> kvtier::Error {
    kvtier::Error::invalid(format!(
        "a range that is not this client's own memory (cross-memory transfer: {e})"
    ))
}

/// Gets values into ranges of the client's memory. Values with a memory
/// copy go straight from the pool (leased for the copy); the others are
/// read into staging from the buffer budget (`grant`; each key's room its
/// capacity bounded by `largest`) and copied from there.
pub(crate) fn batch_get<'b, S: ValueRanges>(
    backend: &dyn KvBackend,
    peer: &PeerMemory,
    items: &[(&[u8], S)],
    largest: u64,
    grant: &mut dyn FnMut(usize) -> bool,
    spent: &dyn Fn() -> String,
) -> Reply<'b> {
    let capacities: Vec<Option<usize>> = items.iter().map(|(_, s)| capacity(s)).collect();
    let usable: Vec<bool> = capacities.iter().map(Option::is_some).collect();
    if usable_ranges_overlap(items, &usable, usize::MAX) {
        return Reply::error(code::INVALID_ARGUMENT, "destination ranges overlap");
    }
    let mut results: Vec<kvtier::Result<Option<usize>>> = capacities
        .iter()
        .map(|c| match c {
            Some(_) => Ok(None),
            None => Err(kvtier::Error::invalid("a range past the end of memory")),
        })
        .collect();
    let asked: Vec<usize> = (0..items.len())
        .filter(|&i| capacities[i].is_some())
        .collect();
    let keys: Vec<&[u8]> = asked.iter().map(|&i| items[i].0).collect();
    let rooms: Vec<usize> = asked.iter().map(|&i| capacities[i].unwrap_or(0)).collect();
    // From the pool, one copy each.
    let mut staged: Vec<usize> = Vec::new();
    match backend.as_store() {
        Some(store) => {
            for ((n, &i), leased) in asked
                .iter()
                .enumerate()
                .zip(store.batch_memory_leases(&keys, &rooms))
            {
                results[i] = match leased {
                    Some(Ok(lease)) => peer
                        .write(lease.bytes(), &items[i].1)
                        .map(|()| Some(lease.len()))
                        .map_err(|e| not_the_clients(&e)),
                    Some(Err(e)) => Err(e),
                    None => {
                        staged.push(n);
                        continue;
                    }
                };
            }
        }
        None => staged = (0..asked.len()).collect(),
    }
    if !staged.is_empty() {
        let keys: Vec<&[u8]> = staged.iter().map(|&n| keys[n]).collect();
        let rooms: Vec<usize> = staged.iter().map(|&n| rooms[n]).collect();
        let Some((copies, got)) = read_staged(backend, &keys, &rooms, largest, grant) else {
            return Reply::error(code::LIMIT, spent());
        };
        for (j, result) in got.into_iter().enumerate() {
            let i = asked[staged[j]];
            results[i] = match result {
                Ok(Some(n)) => peer
                    .write(&copies[j][..n], &items[i].1)
                    .map(|()| Some(n))
                    .map_err(|e| not_the_clients(&e)),
                other => other,
            };
        }
    }
    let all_keys: Vec<&[u8]> = items.iter().map(|i| i.0).collect();
    let needed = too_small_lens(
        backend,
        &all_keys,
        &results,
        &vec![KnownLen::Unknown; items.len()],
    );
    let (w, bytes_out) = get_table(&results, |i| needed[i]);
    Reply::ok(w.buf).with_sample(Sample {
        keys: items.len() as u64,
        bytes_out,
        error: results.iter().any(|r| r.is_err()),
        ..Sample::default()
    })
}

/// How long a value waits for room in the receiving budget (as a value
/// arriving over the socket does).
const RECEIVING_WAIT: Duration = Duration::from_secs(2);

/// Puts values gathered from ranges of the client's memory: read straight
/// into their pool extents when the backend is the store (each value first
/// takes its length from `receiving`), else into staging from the buffer
/// budget (`grant`).
pub(crate) fn batch_put<'b, S: ValueRanges>(
    backend: &dyn KvBackend,
    peer: &PeerMemory,
    flags: u8,
    items: &[(&[u8], S)],
    receiving: &Budgets,
    grant: &mut dyn FnMut(usize) -> bool,
    spent: &dyn Fn() -> String,
) -> Reply<'b> {
    let options: PutOptions = put_flags::decode(flags);
    let lens: Vec<Option<usize>> = items.iter().map(|(_, s)| capacity(s)).collect();
    // Saturating: the lengths are the client's, and a total that wrapped
    // would pass the budget below for staging it cannot hold.
    let bytes_in = lens
        .iter()
        .flatten()
        .fold(0u64, |a, &n| a.saturating_add(n as u64));
    let mut codes = vec![code::OK; items.len()];
    if let Some(store) = backend.as_store() {
        let mut puts = store.streamed_puts(&options, items.len(), bytes_in);
        let mut answered: Vec<usize> = Vec::with_capacity(items.len());
        for (i, ((key, segments), len)) in items.iter().zip(&lens).enumerate() {
            let Some(len) = *len else {
                codes[i] = code::INVALID_ARGUMENT;
                continue;
            };
            answered.push(i);
            let Some(permit) = take_receiving(receiving, len as u64) else {
                puts.refuse(kvtier::Error::new(
                    kvtier::ErrorKind::NoSpace,
                    format!(
                        "the server is receiving {} bytes of unfinished values (max_receiving_bytes, \
                         or a tenant's share: {}); retry",
                        receiving.used().0,
                        receiving.limit()
                    ),
                ));
                continue;
            };
            let Some(mut value) = puts.begin(key, len as u64) else {
                continue;
            };
            let mut at = Cursor::default();
            let filled = value.fill(|chunk| at.read_into(peer, segments, chunk));
            drop(permit);
            match filled {
                Ok(()) => puts.received(key, value),
                Err(e) => {
                    drop(value);
                    puts.refuse(not_the_clients(&e));
                }
            }
        }
        for (i, result) in answered.into_iter().zip(puts.finish()) {
            codes[i] = result_code(&result);
        }
        return put_reply(&codes, bytes_in);
    }
    let total = usize::try_from(bytes_in).unwrap_or(usize::MAX);
    if !grant(total) {
        return Reply::error(code::LIMIT, spent());
    }
    let mut keys = Vec::with_capacity(items.len());
    let mut copies: Vec<Vec<u8>> = Vec::with_capacity(items.len());
    let mut slots = Vec::with_capacity(items.len());
    for (i, ((key, segments), len)) in items.iter().zip(&lens).enumerate() {
        let Some(len) = *len else {
            codes[i] = code::INVALID_ARGUMENT;
            continue;
        };
        let mut copy = vec![0u8; len];
        match Cursor::default().read_into(peer, segments, &mut copy) {
            Ok(()) => {
                keys.push(*key);
                copies.push(copy);
                slots.push(i);
            }
            Err(e) => codes[i] = result_code::<()>(&Err(not_the_clients(&e))),
        }
    }
    let parts: Vec<[&[u8]; 1]> = copies.iter().map(|c| [&c[..]]).collect();
    let refs: Vec<&[&[u8]]> = parts.iter().map(|p| &p[..]).collect();
    let results = per_key(backend.batch_put(&keys, &refs, &options), keys.len());
    for (slot, result) in slots.into_iter().zip(&results) {
        codes[slot] = result_code(result);
    }
    put_reply(&codes, bytes_in)
}

fn take_receiving(receiving: &Budgets, len: u64) -> Option<Held> {
    receiving.take_within(len.min(receiving.limit()), RECEIVING_WAIT)
}

/// Where the next byte of a value comes from in its ranges.
#[derive(Default)]
struct Cursor {
    segment: usize,
    offset: u64,
}

impl Cursor {
    /// Fills `chunk` from the ranges, front to back, from where the last
    /// chunk ended.
    fn read_into(
        &mut self,
        peer: &PeerMemory,
        segments: &dyn ValueRanges,
        chunk: &mut [u8],
    ) -> io::Result<()> {
        let mut filled = 0usize;
        while filled < chunk.len() {
            if self.segment >= segments.count() {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "the ranges are shorter than the value",
                ));
            }
            let (address, len) = segments.range(self.segment);
            let left = len - self.offset;
            if left == 0 {
                self.segment += 1;
                self.offset = 0;
                continue;
            }
            let take = usize::try_from(left)
                .unwrap_or(usize::MAX)
                .min(chunk.len() - filled);
            peer.read(address + self.offset, &mut chunk[filled..filled + take])?;
            filled += take;
            self.offset += take as u64;
        }
        Ok(())
    }
}
