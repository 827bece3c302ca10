//! A small pool of connections to one server, so that calls from several
//! threads run in parallel instead of queueing on one socket. Connections
//! open on demand, up to a limit, and share one registered shared buffer.

use crate::client::Client;
use kvtier::{Error, ErrorKind, Result};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// Connections kept by default: enough for an engine's scheduler thread
/// plus a few loading and saving threads.
pub const DEFAULT_CONNECTIONS: usize = 4;

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
