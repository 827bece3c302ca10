//! A small pool of connections to one server, so that calls from several
//! threads run in parallel instead of queueing on one socket. Connections
//! open on demand, up to a limit, and share one registered shared buffer.

use crate::client::Client;
/// Kept here too, where it was first published.
pub use crate::conn::PARALLEL_FROM;
use kvtier::{Error, ErrorKind, Result};
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// Connections kept by default: enough for an engine's scheduler thread
/// plus a few loading and saving threads.
pub const DEFAULT_CONNECTIONS: usize = 4;

/// The least a part of such a batch carries.
const PART_BYTES: u64 = 4 << 20;

#[derive(Debug)]
struct State {
    idle: Vec<Client>,
    /// Connections open, idle or in use.
    open: usize,
    closed: bool,
}

#[derive(Debug)]
pub struct ClientPool {
    state: Mutex<State>,
    returned: Condvar,
    /// The first connection's settings and shared buffer, unconnected:
    /// new connections open from it while every pooled one is busy.
    seed: Mutex<Client>,
    max: usize,
    /// Parts a large batch is cut into at most: the connections, and no
    /// more than this machine's cores.
    parts: usize,
}

impl ClientPool {
    /// A pool around `first` that opens up to `max` connections in all.
    pub fn new(first: Client, max: usize) -> Result<ClientPool> {
        if max == 0 {
            return Err(Error::invalid(
                "a connection pool needs at least 1 connection",
            ));
        }
        let seed = first.sibling_template();
        Ok(ClientPool {
            state: Mutex::new(State {
                idle: vec![first],
                open: 1,
                closed: false,
            }),
            returned: Condvar::new(),
            seed: Mutex::new(seed),
            max,
            parts: max.min(std::thread::available_parallelism().map_or(1, |n| n.get())),
        })
    }

    /// Threads a copy out of a mapped pool may use: as many as a batch's
    /// parts.
    pub(crate) fn copiers(&self) -> usize {
        self.parts
    }

    /// Item ranges cutting a batch of items of `sizes` bytes into parts to
    /// move at once (see `PARALLEL_FROM`): one range for a smaller batch.
    pub(crate) fn parts(&self, sizes: &[u64]) -> Vec<Range<usize>> {
        cut_into_parts(sizes, self.parts)
    }

    /// Runs `call` on each part at once, each on a connection of its own
    /// (the first on this thread), and returns the per-item results in
    /// order; the first whole-call error, if a part had one.
    pub(crate) fn in_parts<P: Send, T: Send>(
        &self,
        parts: Vec<(Range<usize>, P)>,
        call: impl Fn(&mut Client, Range<usize>, P) -> Result<Vec<T>> + Sync,
    ) -> Result<Vec<T>> {
        let mut parts = parts.into_iter();
        let Some((first_range, first)) = parts.next() else {
            return Ok(Vec::new());
        };
        let call = &call;
        std::thread::scope(|scope| {
            let others: Vec<_> = parts
                .map(|(range, part)| scope.spawn(move || self.with(|c| call(c, range, part))))
                .collect();
            let mut out = self.with(|c| call(c, first_range, first))?;
            let mut failed = None;
            for other in others {
                match other.join() {
                    Ok(Ok(results)) => out.extend(results),
                    Ok(Err(e)) => failed = failed.or(Some(e)),
                    Err(panic) => std::panic::resume_unwind(panic),
                }
            }
            match failed {
                Some(e) => Err(e),
                None => Ok(out),
            }
        })
    }

    /// Runs `f` on a connection of its own: an idle one, a new one while
    /// fewer than `max` are open, or the next one returned.
    pub fn with<T>(&self, f: impl FnOnce(&mut Client) -> Result<T>) -> Result<T> {
        let mut client = self.take()?;
        let result = f(&mut client);
        let mut state = self.state.lock().unwrap();
        if state.closed {
            state.open -= 1;
        } else {
            state.idle.push(client);
        }
        drop(state);
        self.returned.notify_one();
        result
    }

    fn take(&self) -> Result<Client> {
        let mut state = self.state.lock().unwrap();
        loop {
            if state.closed {
                return Err(Error::closed());
            }
            if let Some(client) = state.idle.pop() {
                return Ok(client);
            }
            if state.open < self.max {
                state.open += 1;
                drop(state);
                let opened = self.seed.lock().unwrap().sibling();
                if opened.is_err() {
                    self.state.lock().unwrap().open -= 1;
                    self.returned.notify_one();
                }
                return opened;
            }
            state = self.returned.wait(state).unwrap();
        }
    }

    /// Starts `call` on a pooled connection in the background and returns
    /// at once: the overlapped form of every batch call, so one caller can
    /// keep a batch in flight while it prepares or consumes the next. The
    /// call owns what it reads from and writes into (move the buffers in,
    /// return them in `T`): no buffer is shared with the caller while it
    /// runs.
    ///
    /// ```no_run
    /// # use std::sync::Arc;
    /// # fn f(pool: Arc<kvtier_client::ClientPool>) -> kvtier::Result<()> {
    /// let keys = vec![b"block-0".to_vec()];
    /// let pending = pool.spawn(move |c| {
    ///     let mut buf = vec![0u8; 1 << 20];
    ///     let got = c.batch_get_into(&keys, &mut [&mut buf[..]])?;
    ///     Ok((buf, got))
    /// });
    /// // ... other work while the get runs ...
    /// let (buf, got) = pending.wait()?;
    /// # Ok(()) }
    /// ```
    pub fn spawn<T, F>(self: &Arc<Self>, call: F) -> Pending<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Client) -> Result<T> + Send + 'static,
    {
        let pool = Arc::clone(self);
        let handle = std::thread::Builder::new()
            .name("kvtier-pending".into())
            .spawn(move || pool.with(call));
        Pending {
            handle: Some(handle.map_err(|e| Error::io("starting a background call", e))),
        }
    }

    /// Connections open now (idle or in use).
    pub fn open_connections(&self) -> usize {
        self.state.lock().unwrap().open
    }

    /// Closes every idle connection; those in use close when their call
    /// returns. Later calls fail with `Closed`.
    pub fn close(&self) {
        let mut state = self.state.lock().unwrap();
        state.closed = true;
        let idle = std::mem::take(&mut state.idle);
        state.open -= idle.len();
        drop(state);
        drop(idle);
        self.returned.notify_all();
    }
}

/// `sizes` cut into at most `most` consecutive ranges of about equal bytes,
/// each of `PART_BYTES` or more where the total allows; one range below
/// `PARALLEL_FROM` bytes in all.
fn cut_into_parts(sizes: &[u64], most: usize) -> Vec<Range<usize>> {
    let total = sizes.iter().fold(0u64, |a, &b| a.saturating_add(b));
    let count = if total < PARALLEL_FROM {
        1
    } else {
        most.min(usize::try_from(total / PART_BYTES).unwrap_or(usize::MAX))
            .min(sizes.len())
            .max(1)
    };
    if count == 1 {
        return std::iter::once(0..sizes.len()).collect();
    }
    // Cut where the running total passes each part's share.
    let share = total.div_ceil(count as u64);
    let mut ranges = Vec::with_capacity(count);
    let (mut start, mut sum) = (0usize, 0u64);
    for (i, &size) in sizes.iter().enumerate() {
        sum = sum.saturating_add(size);
        if sum >= share.saturating_mul(ranges.len() as u64 + 1) && ranges.len() + 1 < count {
            ranges.push(start..i + 1);
            start = i + 1;
        }
    }
    if start < sizes.len() {
        ranges.push(start..sizes.len());
    }
    ranges
}

/// A call started by [`ClientPool::spawn`]: `is_done` polls, `wait` blocks
/// for its result. Dropping it waits too (the call owns its buffers until
/// it ends).
#[derive(Debug)]
pub struct Pending<T> {
    handle: Option<std::result::Result<JoinHandle<Result<T>>, Error>>,
}

impl<T> Pending<T> {
    /// Whether the call has ended (`wait` then returns at once).
    pub fn is_done(&self) -> bool {
        match &self.handle {
            Some(Ok(handle)) => handle.is_finished(),
            _ => true,
        }
    }

    /// The call's result, once it ends.
    pub fn wait(mut self) -> Result<T> {
        match self.handle.take().expect("waited once") {
            Ok(handle) => handle.join().unwrap_or_else(|_| {
                Err(Error::new(
                    ErrorKind::Io,
                    "the background call panicked; its connection was dropped",
                ))
            }),
            Err(e) => Err(e),
        }
    }
}

impl<T> Drop for Pending<T> {
    fn drop(&mut self) {
        if let Some(Ok(handle)) = self.handle.take() {
            let _ = handle.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Over many batches (sizes from a fixed-seed generator, from empty
    /// to hundreds of items, tiny to 64 MiB): the parts cover the batch in
    /// order without gaps, number at most `most` (one below
    /// `PARALLEL_FROM`), and none carries more than its share plus one
    /// item.
    #[test]
    fn parts_cover_the_batch_in_order_and_share_it() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..5000 {
            let n = (next() % 300) as usize;
            let scale = [1u64 << 10, 1 << 16, 1 << 20, 64 << 20][(next() % 4) as usize];
            let sizes: Vec<u64> = (0..n).map(|_| next() % scale).collect();
            let most = 1 + (next() % 8) as usize;
            let parts = cut_into_parts(&sizes, most);
            let total: u64 = sizes.iter().sum();
            assert!(!parts.is_empty() && parts.len() <= most.max(1));
            if total < PARALLEL_FROM {
                assert_eq!(parts.len(), 1);
            }
            let mut at = 0;
            for part in &parts {
                assert_eq!(part.start, at, "a gap or an overlap");
                at = part.end;
            }
            assert_eq!(at, n, "not every item is in a part");
            let share = total.div_ceil(parts.len() as u64);
            let largest = sizes.iter().copied().max().unwrap_or(0);
            for part in &parts {
                let bytes: u64 = sizes[part.clone()].iter().sum();
                assert!(
                    bytes <= share + largest,
                    "a part of {bytes} bytes, share {share}"
                );
            }
        }
    }
}
