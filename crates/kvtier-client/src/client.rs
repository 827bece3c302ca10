//! The Rust client: a connection to one server, with cluster routing above
//! it when `ClientOptions::route` asks for it (each key's batch sent
//! straight to the members that own it). Without routing, or while the
//! server is not in cluster mode, every call is the connection's.

use crate::conn::KnownLen;
use crate::conn::{check_key, checked_keys, protocol_error, ClientOptions, Connection};
use crate::routing::{DirectRouting, Router, ServerView};
use kvtier::{Error, PutOptions, Result};
use kvtier_wire::shm::SharedRegion;
use std::sync::Arc;

/// A client of a kvtier server. Not shared between threads: open one per
/// thread (or use a `ClientPool`). A broken connection is re-established
/// on the next call.
#[derive(Debug)]
pub struct Client {
    conn: Connection,
    /// With `route`: the cluster behind the server (shared by siblings).
    routing: Option<Arc<DirectRouting>>,
}

impl Client {
    /// Connects to `tcp://host:port`, `tls://host:port` or
    /// `unix:///path/to.sock`.
    pub fn connect(url: &str) -> Result<Client> {
        Client::connect_with(url, ClientOptions::default())
    }

    pub fn connect_with(url: &str, options: ClientOptions) -> Result<Client> {
        let routing = options.route.then(|| {
            Arc::new(DirectRouting::new(
                &options.namespace,
                options.auth_token.clone(),
                options.tls_ca.clone(),
                options.timeout,
            ))
        });
        Ok(Client {
            conn: Connection::connect_with(url, options)?,
            routing,
        })
    }

    /// A second connection to the same server with the same options,
    /// registering the same shared buffer (so views of it work on either).
    pub fn sibling(&self) -> Result<Client> {
        Ok(Client {
            conn: self.conn.sibling()?,
            routing: self.routing.clone(),
        })
    }

    /// This client's settings and shared buffer, without a connection (a
    /// call on it connects first).
    pub(crate) fn sibling_template(&self) -> Client {
        Client {
            conn: self.conn.sibling_template(),
            routing: self.routing.clone(),
        }
    }

    /// The server's ClusterView answer: its member list in cluster mode,
    /// `{"enabled": false}` otherwise (docs/protocol.md).
    pub fn cluster_view(&mut self) -> Result<serde_json::Value> {
        self.conn.cluster_view()
    }

    /// With `route` and a server in cluster mode: `call` run on a router
    /// over the member list (refreshed when due, from this client's server,
    /// else from the members it knew). `None`: send to the server.
    fn routed<T>(&mut self, call: impl FnOnce(&Router<'_>) -> T) -> Option<T> {
        let routing = Arc::clone(self.routing.as_ref()?);
        if routing.due() {
            let answer = if routing.entry_usable() {
                self.conn
                    .cluster_view()
                    .and_then(|json| ServerView::parse(&json).map_err(protocol_error))
            } else {
                Err(Error::invalid(
                    "this client's server failed to answer a moment ago",
                ))
            };
            match answer {
                Ok(view) => routing.update(view),
                Err(e) => {
                    if routing.entry_usable() {
                        routing.entry_failed();
                    }
                    match routing.view_from_members() {
                        Some(view) => routing.update(Some(view)),
                        None => {
                            tracing::warn!(error = %e, "the cluster view could not be refreshed; keeping the last one");
                            routing.keep();
                        }
                    }
                }
            }
        }
        let router = routing.router()?;
        Some(call(&router))
    }

    /// Largest value the server accepts.
    pub fn max_value(&self) -> u64 {
        self.conn.max_value()
    }

    pub fn batch_put<K: AsRef<[u8]>, V: AsRef<[u8]>>(
        &mut self,
        keys: &[K],
        values: &[V],
    ) -> Result<Vec<Result<()>>> {
        self.batch_put_with(keys, values, &PutOptions::default())
    }

    /// Puts each value (sent inline in the frame). Per-key results.
    pub fn batch_put_with<K: AsRef<[u8]>, V: AsRef<[u8]>>(
        &mut self,
        keys: &[K],
        values: &[V],
        options: &PutOptions,
    ) -> Result<Vec<Result<()>>> {
        let values: Vec<[&[u8]; 1]> = values.iter().map(|v| [v.as_ref()]).collect();
        let values: Vec<&[&[u8]]> = values.iter().map(|v| &v[..]).collect();
        self.batch_put_segments(keys, &values, options)
    }

    /// Puts each value given as segments laid end to end (gathered into
    /// the frame as it is built). Per-key results.
    pub fn batch_put_segments<K: AsRef<[u8]>>(
        &mut self,
        keys: &[K],
        values: &[&[&[u8]]],
        options: &PutOptions,
    ) -> Result<Vec<Result<()>>> {
        if self.routing.is_some() {
            Connection::check_batch_pairs(keys.len(), values.len(), "values")?;
            let keys = checked_keys(keys)?;
            if let Some(results) = self.routed(|r| r.put(&keys, values, options)) {
                return Ok(results);
            }
        }
        self.conn.batch_put_segments(keys, values, options)
    }

    /// The value under `key`, or `None`: one round trip, sized by the reply.
    pub fn get(&mut self, key: impl AsRef<[u8]>) -> Result<Option<Vec<u8>>> {
        self.conn.get(key)
    }

    /// Gets each value into its buffer: `Some(n)` bytes, `None` for a miss.
    pub fn batch_get_into<K: AsRef<[u8]>>(
        &mut self,
        keys: &[K],
        bufs: &mut [&mut [u8]],
    ) -> Result<Vec<Result<Option<usize>>>> {
        let mut one: Vec<[&mut [u8]; 1]> = bufs.iter_mut().map(|b| [&mut b[..]]).collect();
        let mut segments: Vec<&mut [&mut [u8]]> = one.iter_mut().map(|b| &mut b[..]).collect();
        self.batch_get_segments(keys, &mut segments)
    }

    /// Gets each value scattered across its segments, in order.
    pub fn batch_get_segments<K: AsRef<[u8]>>(
        &mut self,
        keys: &[K],
        bufs: &mut [&mut [&mut [u8]]],
    ) -> Result<Vec<Result<Option<usize>>>> {
        if self.routing.is_some() {
            Connection::check_batch_pairs(keys.len(), bufs.len(), "buffers")?;
            let keys = checked_keys(keys)?;
            if let Some(results) = self.routed(|r| r.get(&keys, bufs)) {
                return Ok(results);
            }
        }
        self.conn.batch_get_segments(keys, bufs)
    }

    /// The values the server holds in memory, copied out of its mapped
    /// pool (see `Connection::get_leased`); every key `None` (to get
    /// otherwise) for a routing client, whose keys live on many members.
    pub fn get_leased<K: AsRef<[u8]>>(
        &mut self,
        keys: &[K],
        bufs: &mut [&mut [&mut [u8]]],
        copiers: usize,
    ) -> Result<Vec<Option<Result<Option<usize>>>>> {
        if self.routing.is_some() {
            return Ok(keys.iter().map(|_| None).collect());
        }
        self.conn.get_leased(keys, bufs, copiers)
    }

    /// `batch_get_segments` without leasing (for keys `get_leased` left).
    pub fn get_segments_unleased<K: AsRef<[u8]>>(
        &mut self,
        keys: &[K],
        bufs: &mut [&mut [&mut [u8]]],
    ) -> Result<Vec<Result<Option<usize>>>> {
        if self.routing.is_some() {
            return self.batch_get_segments(keys, bufs);
        }
        self.conn.get_segments_unleased(keys, bufs)
    }

    /// What each key's value takes, learned without moving any value (see
    /// `Connection::batch_value_lens`).
    pub fn batch_value_lens<K: AsRef<[u8]>>(&mut self, keys: &[K]) -> Result<Vec<KnownLen>> {
        self.conn.batch_value_lens(keys)
    }

    /// Whether the server reads and writes this process's own memory for
    /// the socket forms of the batch calls (`ClientOptions::cross_memory`).
    pub fn cross_memory(&self) -> bool {
        self.conn.cross_memory()
    }

    /// Whether values in the server's memory are copied out of a read-only
    /// mapping of its pool by this client (`ClientOptions::map_pool`).
    pub fn maps_pool(&self) -> bool {
        self.conn.maps_pool()
    }

    /// The registered shared buffer (Unix sockets only): place values here
    /// and use the `_registered` calls to move them without socket copies.
    pub fn registered_buffer(&mut self) -> Option<&mut [u8]> {
        self.conn.registered_buffer()
    }

    /// The registered shared buffer as a handle (see
    /// `Connection::registered_region`).
    pub fn registered_region(&self) -> Option<Arc<SharedRegion>> {
        self.conn.registered_region()
    }

    /// Puts values placed in the registered buffer: `(offset, len)` each.
    pub fn batch_put_registered<K: AsRef<[u8]>>(
        &mut self,
        keys: &[K],
        ranges: &[(u64, u64)],
        options: &PutOptions,
    ) -> Result<Vec<Result<()>>> {
        self.conn.batch_put_registered(keys, ranges, options)
    }

    /// Puts values gathered from segments of the registered buffer.
    pub fn batch_put_registered_segments<K: AsRef<[u8]>>(
        &mut self,
        keys: &[K],
        segments: &[Vec<(u64, u64)>],
        options: &PutOptions,
    ) -> Result<Vec<Result<()>>> {
        self.conn
            .batch_put_registered_segments(keys, segments, options)
    }

    /// Gets values into the registered buffer: `(offset, capacity)` each.
    pub fn batch_get_registered<K: AsRef<[u8]>>(
        &mut self,
        keys: &[K],
        ranges: &[(u64, u64)],
    ) -> Result<Vec<Result<Option<usize>>>> {
        self.conn.batch_get_registered(keys, ranges)
    }

    /// Gets values scattered into segments of the registered buffer.
    pub fn batch_get_registered_segments<K: AsRef<[u8]>>(
        &mut self,
        keys: &[K],
        segments: &[Vec<(u64, u64)>],
    ) -> Result<Vec<Result<Option<usize>>>> {
        self.conn.batch_get_registered_segments(keys, segments)
    }

    pub fn batch_exists<K: AsRef<[u8]>>(&mut self, keys: &[K]) -> Result<Vec<bool>> {
        if self.routing.is_some() {
            let keys = checked_keys(keys)?;
            if let Some(present) = self.routed(|r| r.exists(&keys)) {
                return Ok(present);
            }
        }
        self.conn.batch_exists(keys)
    }

    /// How many of `keys`, from the first, are present.
    pub fn prefix_len<K: AsRef<[u8]>>(&mut self, keys: &[K]) -> Result<usize> {
        if self.routing.is_some() {
            let keys = checked_keys(keys)?;
            if let Some(present) = self.routed(|r| r.exists(&keys)) {
                return Ok(present.iter().take_while(|&&p| p).count());
            }
        }
        self.conn.prefix_len(keys)
    }

    pub fn remove(&mut self, key: impl AsRef<[u8]>) -> Result<bool> {
        if self.routing.is_some() {
            let key = check_key(key.as_ref())?;
            if let Some(removed) = self.routed(|r| r.remove(key)) {
                return removed;
            }
        }
        self.conn.remove(key)
    }

    pub fn flush(&mut self) -> Result<()> {
        self.conn.flush()
    }

    /// The server's `/stats` document.
    pub fn stats(&mut self) -> Result<serde_json::Value> {
        self.conn.stats()
    }

    /// The namespaces this client's credential covers, with their blocks,
    /// bytes and manifests (the server it is connected to counts its own).
    pub fn namespaces(&mut self) -> Result<serde_json::Value> {
        self.conn.namespaces()
    }

    /// Removes every block of this client's namespace, durable on return;
    /// a server in cluster mode retires it on every member.
    pub fn retire_namespace(&mut self) -> Result<kvtier::RetiredNamespace> {
        self.conn.retire_namespace()
    }

    /// Stores this client's namespace's manifest (a JSON object).
    pub fn describe_namespace(&mut self, manifest: &[u8]) -> Result<()> {
        self.conn.describe_namespace(manifest)
    }
}
