//! The operations a request of the protocol runs on, whatever serves it:
//! this process's store ([`Store`], or one namespace of it:
//! [`NamespacedStore`]), the cluster ([`Router`]: this node's share on its
//! store, the rest on their owners), or another server ([`ClientPool`],
//! through shared memory where the caller's buffers lie in its registered
//! region). The server dispatches each request once, over this trait,
//! instead of once per kind of backend, and so does the Python binding.
//!
//! Every call returns a whole-call `Result`: an error reaching the backend
//! (a transport failure) is an error, never "absent" or "not present";
//! batch calls also answer per key inside it.

use crate::client::Client;
/// Kept here too, where it was first published.
pub use crate::conn::KnownLen;
use crate::pool::ClientPool;
use crate::routing::Router;
use kvtier::{Error, NamespacedStore, PutOptions, Result, Store, ValueLease};

/// Each key's result of a batch, or the whole call's error for each key.
pub fn per_key<T>(whole: Result<Vec<Result<T>>>, keys: usize) -> Vec<Result<T>> {
    whole.unwrap_or_else(|e| (0..keys).map(|_| Err(e.duplicate())).collect())
}

pub trait KvBackend {
    /// Stores each value (given as segments laid end to end) under its key.
    fn batch_put(
        &self,
        keys: &[&[u8]],
        values: &[&[&[u8]]],
        options: &PutOptions,
    ) -> Result<Vec<Result<()>>>;

    /// Stores each value, given whole. Default: `batch_put` with one
    /// segment each.
    fn batch_put_whole(
        &self,
        keys: &[&[u8]],
        values: &[&[u8]],
        options: &PutOptions,
    ) -> Result<Vec<Result<()>>> {
        let one: Vec<[&[u8]; 1]> = values.iter().map(|v| [*v]).collect();
        let segments: Vec<&[&[u8]]> = one.iter().map(|v| &v[..]).collect();
        self.batch_put(keys, &segments, options)
    }

    /// Reads each key's value into its segments: `Ok(Some(n))`, `Ok(None)`
    /// for a miss, or an error such as `BufferTooSmall`.
    fn batch_get(
        &self,
        keys: &[&[u8]],
        dests: &mut [&mut [&mut [u8]]],
    ) -> Result<Vec<Result<Option<usize>>>>;

    /// Reads each key's value into one buffer. Default: `batch_get` with
    /// one segment each.
    fn batch_get_whole(
        &self,
        keys: &[&[u8]],
        bufs: &mut [&mut [u8]],
    ) -> Result<Vec<Result<Option<usize>>>> {
        let mut one: Vec<[&mut [u8]; 1]> = bufs.iter_mut().map(|b| [&mut b[..]]).collect();
        let mut segments: Vec<&mut [&mut [u8]]> = one.iter_mut().map(|b| &mut b[..]).collect();
        self.batch_get(keys, &mut segments)
    }

    /// One whole value, or `None` for a miss. Default: its length probed,
    /// then read.
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        let len = match self.probe_lens(&[key])[0] {
            KnownLen::Absent => return Ok(None),
            KnownLen::Len(len) => len,
            KnownLen::Unknown => {
                return Err(Error::invalid(
                    "this backend cannot tell the value's length before reading it",
                ))
            }
        };
        let mut buf = vec![0u8; len];
        let got = self.batch_get_whole(&[key], &mut [&mut buf[..]])?;
        match got.into_iter().next() {
            Some(Ok(Some(n))) => {
                buf.truncate(n);
                Ok(Some(buf))
            }
            Some(Ok(None)) | None => Ok(None),
            Some(Err(e)) => Err(e),
        }
    }

    /// Leases on values held in this process's memory, sent with no copy
    /// (see [`NamespacedStore::batch_memory_leases`]); `None` for keys
    /// the caller reads with `batch_get`. Default: none.
    fn batch_memory_leases(
        &self,
        keys: &[&[u8]],
        capacities: &[usize],
    ) -> Vec<Option<Result<ValueLease>>> {
        let _ = capacities;
        keys.iter().map(|_| None).collect()
    }

    /// What is known of `key`'s value length without reading it (to size
    /// the room a reply needs). Default: `Unknown` for every key, and
    /// callers size by the key's capacity instead.
    fn known_len(&self, key: &[u8]) -> KnownLen {
        let _ = key;
        KnownLen::Unknown
    }

    /// What each key's value takes, asking whoever holds the keys when
    /// that is not known here (a round trip per cluster member): for
    /// sizing a reply by the data instead of the request. Default:
    /// [`known_len`](Self::known_len) of each.
    fn probe_lens(&self, keys: &[&[u8]]) -> Vec<KnownLen> {
        keys.iter().map(|k| self.known_len(k)).collect()
    }

    fn batch_exists(&self, keys: &[&[u8]]) -> Result<Vec<bool>>;

    /// How many leading keys are present.
    fn prefix_len(&self, keys: &[&[u8]]) -> Result<usize> {
        Ok(self
            .batch_exists(keys)?
            .into_iter()
            .take_while(|&present| present)
            .count())
    }

    /// Removes `key`; whether it was present.
    fn remove(&self, key: &[u8]) -> Result<bool>;

    /// Returns once everything acknowledged so far is durable.
    fn flush(&self) -> Result<()>;

    /// Removes every block of the backend's namespace, durable on return
    /// (see `NamespacedStore::retire`); a cluster retires it on every
    /// member.
    fn retire_namespace(&self) -> Result<kvtier::RetiredNamespace>;

    /// The `/stats` document of whatever serves this backend. Default: an
    /// error (the cluster has no one document).
    fn stats(&self) -> Result<serde_json::Value> {
        Err(Error::invalid("this backend has no stats document"))
    }

    /// The namespaces this backend's store (or server) holds, with their
    /// census and manifests: `{"node": .., "namespaces": [..]}`. Default:
    /// an error (a cluster has no one list).
    fn namespaces(&self) -> Result<serde_json::Value> {
        Err(Error::invalid("this backend has no namespace list"))
    }

    /// Stores the namespace's manifest (a JSON object), durable on return.
    /// Default: the bytes as given, under `kvtier::MANIFEST_KEY`, put like
    /// any value (a server stamps them first: see the client pool's).
    fn describe_namespace(&self, manifest: &[u8]) -> Result<()> {
        kvtier::validate_manifest(manifest)?;
        let options = PutOptions {
            durable: true,
            ..PutOptions::default()
        };
        self.batch_put_whole(&[kvtier::MANIFEST_KEY], &[manifest], &options)?
            .pop()
            .unwrap_or_else(|| Err(Error::invalid("the manifest's put had no answer")))
    }

    /// Lets go of what this backend holds (the store closes, connections
    /// close). Default: nothing to do.
    fn close(&self) -> Result<()> {
        Ok(())
    }

    /// The store itself, when this backend is one (it then reads from and
    /// writes to foreign memory directly: `batch_put_foreign`,
    /// `batch_get_foreign`); `None` for backends that need private copies.
    fn as_store(&self) -> Option<&NamespacedStore> {
        None
    }
}

impl KvBackend for NamespacedStore {
    fn batch_put(
        &self,
        keys: &[&[u8]],
        values: &[&[&[u8]]],
        options: &PutOptions,
    ) -> Result<Vec<Result<()>>> {
        Ok(self.batch_put_segments(keys, values, options))
    }

    fn batch_put_whole(
        &self,
        keys: &[&[u8]],
        values: &[&[u8]],
        options: &PutOptions,
    ) -> Result<Vec<Result<()>>> {
        Ok(self.batch_put_with(keys, values, options))
    }

    fn batch_get(
        &self,
        keys: &[&[u8]],
        dests: &mut [&mut [&mut [u8]]],
    ) -> Result<Vec<Result<Option<usize>>>> {
        Ok(self.batch_get_segments(keys, dests))
    }

    fn batch_get_whole(
        &self,
        keys: &[&[u8]],
        bufs: &mut [&mut [u8]],
    ) -> Result<Vec<Result<Option<usize>>>> {
        Ok(self.batch_get_into(keys, bufs))
    }

    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        NamespacedStore::get(self, key)
    }

    fn batch_memory_leases(
        &self,
        keys: &[&[u8]],
        capacities: &[usize],
    ) -> Vec<Option<Result<ValueLease>>> {
        NamespacedStore::batch_memory_leases(self, keys, capacities)
    }

    fn known_len(&self, key: &[u8]) -> KnownLen {
        match self.value_len(key) {
            Ok(Some(len)) => KnownLen::Len(len),
            _ => KnownLen::Absent,
        }
    }

    fn batch_exists(&self, keys: &[&[u8]]) -> Result<Vec<bool>> {
        Ok(NamespacedStore::batch_exists(self, keys))
    }

    fn prefix_len(&self, keys: &[&[u8]]) -> Result<usize> {
        // The store's own: an engine's prompt lookup feeds the adaptive
        // eviction policy.
        Ok(NamespacedStore::prefix_len(self, keys))
    }

    fn remove(&self, key: &[u8]) -> Result<bool> {
        NamespacedStore::remove(self, key)
    }

    fn flush(&self) -> Result<()> {
        NamespacedStore::flush(self)
    }

    fn retire_namespace(&self) -> Result<kvtier::RetiredNamespace> {
        NamespacedStore::retire(self)
    }

    fn namespaces(&self) -> Result<serde_json::Value> {
        Err(Error::invalid(
            "a namespace's view lists no namespaces: ask the store",
        ))
    }

    fn as_store(&self) -> Option<&NamespacedStore> {
        Some(self)
    }
}

/// The store's default namespace (its default view's calls), as the
/// Python binding's embedded engine drives it; `close` closes the store.
impl KvBackend for Store {
    fn batch_put(
        &self,
        keys: &[&[u8]],
        values: &[&[&[u8]]],
        options: &PutOptions,
    ) -> Result<Vec<Result<()>>> {
        KvBackend::batch_put(self.default_view(), keys, values, options)
    }

    fn batch_put_whole(
        &self,
        keys: &[&[u8]],
        values: &[&[u8]],
        options: &PutOptions,
    ) -> Result<Vec<Result<()>>> {
        self.default_view().batch_put_whole(keys, values, options)
    }

    fn batch_get(
        &self,
        keys: &[&[u8]],
        dests: &mut [&mut [&mut [u8]]],
    ) -> Result<Vec<Result<Option<usize>>>> {
        KvBackend::batch_get(self.default_view(), keys, dests)
    }

    fn batch_get_whole(
        &self,
        keys: &[&[u8]],
        bufs: &mut [&mut [u8]],
    ) -> Result<Vec<Result<Option<usize>>>> {
        self.default_view().batch_get_whole(keys, bufs)
    }

    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        KvBackend::get(self.default_view(), key)
    }

    fn batch_memory_leases(
        &self,
        keys: &[&[u8]],
        capacities: &[usize],
    ) -> Vec<Option<Result<ValueLease>>> {
        KvBackend::batch_memory_leases(self.default_view(), keys, capacities)
    }

    fn known_len(&self, key: &[u8]) -> KnownLen {
        self.default_view().known_len(key)
    }

    fn batch_exists(&self, keys: &[&[u8]]) -> Result<Vec<bool>> {
        KvBackend::batch_exists(self.default_view(), keys)
    }

    fn prefix_len(&self, keys: &[&[u8]]) -> Result<usize> {
        KvBackend::prefix_len(self.default_view(), keys)
    }

    fn remove(&self, key: &[u8]) -> Result<bool> {
        KvBackend::remove(self.default_view(), key)
    }

    fn flush(&self) -> Result<()> {
        KvBackend::flush(self.default_view())
    }

    fn retire_namespace(&self) -> Result<kvtier::RetiredNamespace> {
        KvBackend::retire_namespace(self.default_view())
    }

    fn namespaces(&self) -> Result<serde_json::Value> {
        let census = Store::namespaces(self)?;
        Ok(serde_json::json!({
            "node": self.node_id(),
            "namespaces": census
                .iter()
                .map(|c| kvtier_wire::stats::namespace_json(c, None))
                .collect::<Vec<_>>(),
        }))
    }

    fn stats(&self) -> Result<serde_json::Value> {
        Ok(kvtier_wire::stats::stats_json(&Store::stats(self)))
    }

    fn close(&self) -> Result<()> {
        Store::close(self)
    }
}

impl KvBackend for Router<'_> {
    fn batch_put(
        &self,
        keys: &[&[u8]],
        values: &[&[&[u8]]],
        options: &PutOptions,
    ) -> Result<Vec<Result<()>>> {
        Ok(self.put(keys, values, options))
    }

    fn batch_get(
        &self,
        keys: &[&[u8]],
        dests: &mut [&mut [&mut [u8]]],
    ) -> Result<Vec<Result<Option<usize>>>> {
        Ok(Router::get(self, keys, dests))
    }

    /// Keys this node reads first (it owns them) are leased from its store
    /// as on the local path; the others are read from their owners.
    fn batch_memory_leases(
        &self,
        keys: &[&[u8]],
        capacities: &[usize],
    ) -> Vec<Option<Result<ValueLease>>> {
        let Some(local) = self.local() else {
            return keys.iter().map(|_| None).collect();
        };
        let mine: Vec<usize> = (0..keys.len())
            .filter(|&i| self.reads_here_first(keys[i]))
            .collect();
        let mine_keys: Vec<&[u8]> = mine.iter().map(|&i| keys[i]).collect();
        let mine_room: Vec<usize> = mine.iter().map(|&i| capacities[i]).collect();
        let mut out: Vec<Option<Result<ValueLease>>> = keys.iter().map(|_| None).collect();
        for (&i, leased) in mine
            .iter()
            .zip(local.batch_memory_leases(&mine_keys, &mine_room))
        {
            out[i] = leased;
        }
        out
    }

    /// Keys this node reads first: their indexed length here (a miss
    /// here may be held by the next owner: unknown). Others: unknown.
    fn known_len(&self, key: &[u8]) -> KnownLen {
        match self.local() {
            Some(local) if self.reads_here_first(key) => match local.value_len(key) {
                Ok(Some(len)) => KnownLen::Len(len),
                _ => KnownLen::Unknown,
            },
            _ => KnownLen::Unknown,
        }
    }

    fn probe_lens(&self, keys: &[&[u8]]) -> Vec<KnownLen> {
        self.value_lens(keys)
    }

    fn batch_exists(&self, keys: &[&[u8]]) -> Result<Vec<bool>> {
        Ok(self.exists(keys))
    }

    fn remove(&self, key: &[u8]) -> Result<bool> {
        Router::remove(self, key)
    }

    fn flush(&self) -> Result<()> {
        Router::flush(self)
    }

    fn retire_namespace(&self) -> Result<kvtier::RetiredNamespace> {
        Router::retire_namespace(self)
    }
}

/// Another server, through a pool of clients. Values and destinations
/// that lie inside a client's registered shared region move through it
/// (the server reads and writes them in place); the others travel in the
/// frames.
impl KvBackend for ClientPool {
    fn batch_put(
        &self,
        keys: &[&[u8]],
        values: &[&[&[u8]]],
        options: &PutOptions,
    ) -> Result<Vec<Result<()>>> {
        let sizes: Vec<u64> = values
            .iter()
            .map(|v| v.iter().map(|s| s.len() as u64).sum())
            .collect();
        let parts = put_parts(self, keys, &sizes, values);
        self.in_parts(parts, |c, range, values| {
            let keys = &keys[range];
            if let Some(segments) = shm_segments(c, values.iter().map(|v| v.iter().copied())) {
                return c.batch_put_registered_segments(keys, &segments, options);
            }
            c.batch_put_segments(keys, values, options)
        })
    }

    fn batch_put_whole(
        &self,
        keys: &[&[u8]],
        values: &[&[u8]],
        options: &PutOptions,
    ) -> Result<Vec<Result<()>>> {
        let sizes: Vec<u64> = values.iter().map(|v| v.len() as u64).collect();
        let parts = put_parts(self, keys, &sizes, values);
        self.in_parts(parts, |c, range, values| {
            let keys = &keys[range];
            if let Some(segments) = shm_segments(c, values.iter().map(|v| std::iter::once(*v))) {
                let ranges: Vec<(u64, u64)> = segments.into_iter().map(|s| s[0]).collect();
                return c.batch_put_registered(keys, &ranges, options);
            }
            c.batch_put_with(keys, values, options)
        })
    }

    fn batch_get(
        &self,
        keys: &[&[u8]],
        dests: &mut [&mut [&mut [u8]]],
    ) -> Result<Vec<Result<Option<usize>>>> {
        // Values in the server's memory first, out of its mapped pool on
        // one connection with every core copying; the rest in parts.
        let copiers = self.copiers();
        let results = self.with(|c| {
            // Destinations in the registered shared buffer are written by
            // the server, a plain copy as the client's own would be, with
            // no lease round trip: only other memory is leased.
            if shm_segments(c, dests.iter().map(|b| b.iter().map(|s| &s[..]))).is_some() {
                return Ok(keys.iter().map(|_| None).collect());
            }
            c.get_leased(keys, dests, copiers)
        })?;
        crate::conn::answer_rest(results, keys, dests, |keys, dests| {
            let sizes: Vec<u64> = dests
                .iter()
                .map(|d| d.iter().map(|s| s.len() as u64).sum())
                .collect();
            let parts = split_parts(self.parts(&sizes), dests);
            self.in_parts(parts, |c, range, dests| {
                let keys = &keys[range];
                let in_shm = shm_segments(c, dests.iter().map(|b| b.iter().map(|s| &s[..])));
                if let Some(segments) = in_shm {
                    return c.batch_get_registered_segments(keys, &segments);
                }
                c.get_segments_unleased(keys, dests)
            })
        })
    }

    fn batch_get_whole(
        &self,
        keys: &[&[u8]],
        bufs: &mut [&mut [u8]],
    ) -> Result<Vec<Result<Option<usize>>>> {
        let mut one: Vec<[&mut [u8]; 1]> = bufs.iter_mut().map(|b| [&mut b[..]]).collect();
        let mut segments: Vec<&mut [&mut [u8]]> = one.iter_mut().map(|b| &mut b[..]).collect();
        KvBackend::batch_get(self, keys, &mut segments)
    }

    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        self.with(|c| c.get(key))
    }

    fn batch_exists(&self, keys: &[&[u8]]) -> Result<Vec<bool>> {
        self.with(|c| c.batch_exists(keys))
    }

    fn prefix_len(&self, keys: &[&[u8]]) -> Result<usize> {
        self.with(|c| c.prefix_len(keys))
    }

    fn remove(&self, key: &[u8]) -> Result<bool> {
        self.with(|c| c.remove(key))
    }

    fn flush(&self) -> Result<()> {
        self.with(|c| c.flush())
    }

    fn retire_namespace(&self) -> Result<kvtier::RetiredNamespace> {
        self.with(|c| c.retire_namespace())
    }

    fn namespaces(&self) -> Result<serde_json::Value> {
        self.with(|c| c.namespaces())
    }

    fn describe_namespace(&self, manifest: &[u8]) -> Result<()> {
        self.with(|c| c.describe_namespace(manifest))
    }

    fn stats(&self) -> Result<serde_json::Value> {
        self.with(|c| c.stats())
    }

    fn close(&self) -> Result<()> {
        ClientPool::close(self);
        Ok(())
    }
}

/// Every value's segments as `(offset, len)` in the client's registered
/// shared region, or `None` if any segment lies outside it (or there is
/// no region).
/// A put's parts (see `ClientPool::parts`), each with its values; one
/// part when a key repeats (the later value of a key must win, as it does
/// in one batch).
fn put_parts<'v, V>(
    pool: &ClientPool,
    keys: &[&[u8]],
    sizes: &[u64],
    values: &'v [V],
) -> Vec<(std::ops::Range<usize>, &'v [V])> {
    let mut ranges = pool.parts(sizes);
    if ranges.len() > 1 {
        let mut seen = std::collections::HashSet::with_capacity(keys.len());
        if !keys.iter().all(|k| seen.insert(*k)) {
            ranges = std::iter::once(0..keys.len()).collect();
        }
    }
    ranges
        .into_iter()
        .map(|r| (r.clone(), &values[r]))
        .collect()
}

/// `items` cut at `ranges` (consecutive, from 0), each range with its
/// part.
fn split_parts<T>(
    ranges: Vec<std::ops::Range<usize>>,
    mut items: &mut [T],
) -> Vec<(std::ops::Range<usize>, &mut [T])> {
    let mut out = Vec::with_capacity(ranges.len());
    for range in ranges {
        let (part, rest) = std::mem::take(&mut items).split_at_mut(range.len());
        items = rest;
        out.push((range, part));
    }
    out
}

fn shm_segments<'a, V, S>(client: &Client, values: V) -> Option<Vec<Vec<(u64, u64)>>>
where
    V: Iterator<Item = S>,
    S: Iterator<Item = &'a [u8]>,
{
    let region = client.registered_region()?;
    let base = region.as_ptr() as usize;
    let end = base + region.len();
    values
        .map(|segments| {
            segments
                .map(|s| {
                    let p = s.as_ptr() as usize;
                    (p >= base && p + s.len() <= end).then(|| ((p - base) as u64, s.len() as u64))
                })
                .collect()
        })
        .collect()
}
