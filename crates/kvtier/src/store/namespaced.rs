//! A store seen through one namespace: what every call goes through.

use super::{check_buffer, mismatched, Inner, PutOptions, ValueLease};
use crate::error::{ErrorKind, Result};
use crate::foreign::{ForeignSegments, Source};
use crate::key::{validate_key, Namespace};
use crate::stats::Counters;
use crate::tier::DiskLocation;
use crate::units::PAGE_SIZE;
use std::sync::Arc;

/// A store seen through one namespace: the same operations as
/// [`Store`](crate::Store), with every key qualified by the namespace. From
/// [`Store::in_namespace`](crate::Store::in_namespace); it shares the store
/// (an `Arc`), so it needs no lifetime and may be kept.
#[derive(Debug, Clone)]
pub struct NamespacedStore {
    inner: Arc<Inner>,
    namespace: Namespace,
}

impl NamespacedStore {
    pub(crate) fn new(inner: Arc<Inner>, namespace: Namespace) -> Self {
        NamespacedStore { inner, namespace }
    }

    pub fn namespace(&self) -> &Namespace {
        &self.namespace
    }

    pub(super) fn inner(&self) -> &Inner {
        &self.inner
    }

    /// Stores `value` under `key` (write-through).
    pub fn put(&self, key: impl AsRef<[u8]>, value: impl AsRef<[u8]>) -> Result<()> {
        self.put_with(key, value, &PutOptions::default())
    }

    pub fn put_with(
        &self,
        key: impl AsRef<[u8]>,
        value: impl AsRef<[u8]>,
        options: &PutOptions,
    ) -> Result<()> {
        self.batch_put_with(&[key], &[value], options)
            .pop()
            .expect("one result per key")
    }

    /// Stores each value under its key; one result per key.
    pub fn batch_put<K: AsRef<[u8]>, V: AsRef<[u8]>>(
        &self,
        keys: &[K],
        values: &[V],
    ) -> Vec<Result<()>> {
        self.batch_put_with(keys, values, &PutOptions::default())
    }

    pub fn batch_put_with<K: AsRef<[u8]>, V: AsRef<[u8]>>(
        &self,
        keys: &[K],
        values: &[V],
        options: &PutOptions,
    ) -> Vec<Result<()>> {
        let values: Vec<[&[u8]; 1]> = values.iter().map(|v| [v.as_ref()]).collect();
        let values: Vec<&[&[u8]]> = values.iter().map(|v| &v[..]).collect();
        self.batch_put_segments(keys, &values, options)
    }

    /// Stores each value given as segments laid end to end (Mooncake's
    /// multi-buffer form: one block's pages scattered across layers become
    /// one value). The segments are copied once, straight into the pool.
    pub fn batch_put_segments<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        values: &[&[&[u8]]],
        options: &PutOptions,
    ) -> Vec<Result<()>> {
        self.put_sources(keys, values, options)
    }

    /// [`batch_put_segments`](Self::batch_put_segments) from memory another
    /// process may write meanwhile (a client's shared buffer): the bytes
    /// are copied out through raw pointers, once, and the checksum is taken
    /// from the copy.
    pub fn batch_put_foreign<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        values: &[ForeignSegments],
        options: &PutOptions,
    ) -> Vec<Result<()>> {
        let sources: Vec<&ForeignSegments> = values.iter().collect();
        self.put_sources(keys, &sources, options)
    }

    fn put_sources<K: AsRef<[u8]>, S: Source + Copy>(
        &self,
        keys: &[K],
        values: &[S],
        options: &PutOptions,
    ) -> Vec<Result<()>> {
        if keys.len() != values.len() {
            return mismatched(keys.len(), "values", values.len());
        }
        if keys.len() > 1 {
            let pages = values
                .iter()
                .map(|v| (v.len() as u64).div_ceil(PAGE_SIZE).max(1))
                .sum();
            self.inner.eviction.lock().unwrap().note_batch(pages);
        }
        let mut results: Vec<Result<()>> = Vec::with_capacity(keys.len());
        let mut seqs = (u64::MAX, 0u64);
        // Last key first: engines put a prompt's blocks in prefix order,
        // and a prefix hit needs every earlier block, so the eviction order
        // should reach a block's descendants before the block itself.
        // Entering the queues deepest-first does that for both policies.
        for (key, value) in keys.iter().zip(values).rev() {
            let result = self
                .inner
                .put_one(&self.namespace, key.as_ref(), *value, options);
            if let Ok(Some(seq)) = &result {
                seqs = (seqs.0.min(*seq), seqs.1.max(*seq));
            }
            results.push(result.map(|_| ()));
        }
        results.reverse();
        // Without a disk tier nothing is ever made durable (and no flusher
        // would answer the wait): memory is all a put there promises.
        if options.durable && seqs.1 > 0 && self.inner.writes_below {
            if let Err(e) = self.inner.wait_durable(seqs.0, seqs.1) {
                for result in results.iter_mut().filter(|r| r.is_ok()) {
                    *result = Err(e.duplicate());
                }
            }
        }
        results
    }

    /// The value under `key`, or `None`.
    pub fn get(&self, key: impl AsRef<[u8]>) -> Result<Option<Vec<u8>>> {
        let key = key.as_ref();
        loop {
            let Some(len) = self.value_len(key)? else {
                // A miss like any other (the hit rate counts it).
                Counters::add(&self.inner.counters.misses, 1);
                return Ok(None);
            };
            let mut value = vec![0u8; len];
            match self
                .inner
                .get_into(&self.namespace, &[key], &mut [&mut value[..]])
                .pop()
                .unwrap()
            {
                Ok(Some(n)) => {
                    value.truncate(n);
                    return Ok(Some(value));
                }
                Ok(None) => return Ok(None),
                // Replaced by a longer value between the two lookups.
                Err(e) if e.kind() == ErrorKind::BufferTooSmall => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// `key`'s hash for the bounded index of a shared directory (see
    /// `Store::set_index_share`): which node indexes it is a function of
    /// this number alone.
    pub fn share_hash(&self, key: impl AsRef<[u8]>) -> u64 {
        self.namespace.digest(key.as_ref()).share_hash()
    }

    /// Length of the value under `key`, without reading it.
    pub fn value_len(&self, key: impl AsRef<[u8]>) -> Result<Option<usize>> {
        self.inner.check_open()?;
        let key = key.as_ref();
        validate_key(key)?;
        let digest = self.namespace.digest(key);
        Ok(self
            .inner
            .index
            .lock(digest)
            .get(digest)
            .map(|e| e.value_len() as usize))
    }

    /// Where the durable copy of `key` lies: its region file, byte offset
    /// and length, with the digest and checksum that verify it. `None` for
    /// a missing key or one not yet on disk. For tools and benchmarks that
    /// read the files themselves (`kvtier bench`'s shape-matched reader).
    pub fn disk_location(&self, key: impl AsRef<[u8]>) -> Result<Option<DiskLocation>> {
        self.inner.check_open()?;
        let key = key.as_ref();
        validate_key(key)?;
        let digest = self.namespace.digest(key);
        let (loc, len, checksum) = {
            let shard = self.inner.index.lock(digest);
            match shard
                .get(digest)
                .and_then(|e| Some((e.disk()?, e.value_len(), e.checksum())))
            {
                Some(found) => found,
                None => return Ok(None),
            }
        };
        Ok(self
            .inner
            .lower
            .as_ref()
            .and_then(|lower| lower.file_location(loc, len, digest, checksum)))
    }

    /// Reads each key's value into its buffer. Per key: `Ok(Some(n))` with
    /// the bytes written, `Ok(None)` for a miss (the buffer's contents are
    /// then unspecified), or an error such as `BufferTooSmall`.
    pub fn batch_get_into<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        bufs: &mut [&mut [u8]],
    ) -> Vec<Result<Option<usize>>> {
        self.inner.get_into(&self.namespace, keys, bufs)
    }

    /// Reads each key's value across its segments, in order (the inverse
    /// of [`batch_put_segments`](Self::batch_put_segments)). Per key:
    /// `Ok(Some(n))` with the bytes written, `Ok(None)` for a miss, or
    /// `BufferTooSmall` when the segments together hold less than the value.
    pub fn batch_get_segments<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        bufs: &mut [&mut [&mut [u8]]],
    ) -> Vec<Result<Option<usize>>> {
        self.inner.get_into(&self.namespace, keys, bufs)
    }

    /// [`batch_get_segments`](Self::batch_get_segments) into memory another
    /// process may write meanwhile (a client's shared buffer): values are
    /// copied in through raw pointers; disk reads land in private memory
    /// and are verified there first, so nothing the other process writes
    /// can make a value count as damaged.
    pub fn batch_get_foreign<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        dests: &mut [ForeignSegments],
    ) -> Vec<Result<Option<usize>>> {
        self.inner.get_into(&self.namespace, keys, dests)
    }

    pub fn exists(&self, key: impl AsRef<[u8]>) -> bool {
        self.batch_exists(&[key])[0]
    }

    /// Whether each key is present (invalid keys are simply absent).
    pub fn batch_exists<K: AsRef<[u8]>>(&self, keys: &[K]) -> Vec<bool> {
        if self.inner.check_open().is_err() {
            return vec![false; keys.len()];
        }
        self.inner.contains_many(&self.namespace, keys)
    }

    /// How many leading keys are present: the cached prefix of a prompt.
    pub fn prefix_len<K: AsRef<[u8]>>(&self, keys: &[K]) -> usize {
        if self.inner.check_open().is_err() {
            return 0;
        }
        // An engine's lookup of a prompt: the adaptive policy's sample.
        let inner = &self.inner;
        inner
            .contains_many_then(&self.namespace, keys, |digests| {
                if let Some(shadow) = &inner.shadow {
                    inner.timed(|| {
                        shadow.on_request(digests.iter().map(|d| d.0));
                    });
                }
            })
            .into_iter()
            .take_while(|&present| present)
            .count()
    }

    /// For each key with a memory copy: a lease on it, or `BufferTooSmall`
    /// if it is longer than the key's capacity (counted as a get of it
    /// would be); `None` for the others, which the caller reads with
    /// `batch_get_into`. The bytes stay valid while the lease lives,
    /// whatever puts or evictions happen meanwhile. For a server sending
    /// values straight from the pool, with no copy into a reply.
    pub fn batch_memory_leases<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        capacities: &[usize],
    ) -> Vec<Option<Result<ValueLease>>> {
        if keys.len() != capacities.len() || self.inner.check_open().is_err() {
            return keys.iter().map(|_| None).collect();
        }
        // The caller copies out of the pool now: write-back yields to it.
        self.inner.log.note_read();
        let digests = self.namespace.digest_many(keys);
        keys.iter()
            .zip(capacities)
            .zip(digests)
            .map(|((key, &capacity), digest)| {
                validate_key(key.as_ref()).ok()?;
                let mut shard = self.inner.index.lock(digest);
                let slot = Arc::clone(shard.get(digest)?.mem()?);
                slot.record_hit();
                shard.mark_accessed(digest);
                drop(shard);
                Some(check_buffer(slot.len(), capacity).map(|()| {
                    Counters::add(&self.inner.counters.memory_hits, 1);
                    ValueLease(slot)
                }))
            })
            .collect()
    }

    /// Whether each key has a memory copy now (a get of it would be served
    /// from the pool, unless it is evicted first). Touches no policy state;
    /// for tools and benchmarks that report memory and disk hits apart.
    pub fn batch_in_memory<K: AsRef<[u8]>>(&self, keys: &[K]) -> Vec<bool> {
        if self.inner.check_open().is_err() {
            return vec![false; keys.len()];
        }
        let digests = self.namespace.digest_many(keys);
        let mut found = self
            .inner
            .index
            .map_many(&digests, false, |e| e.mem().is_some());
        for (resident, key) in found.iter_mut().zip(keys) {
            *resident &= validate_key(key.as_ref()).is_ok();
        }
        found
    }

    /// Returns once everything put so far, in any namespace, is durable
    /// (see [`Store::flush`](crate::Store::flush)).
    pub fn flush(&self) -> Result<()> {
        self.inner.check_open()?;
        self.inner.flush_all()
    }

    /// Removes `key` from every tier; durable on return (a tombstone is
    /// always written, so no older value can come back after a restart).
    /// Returns whether the key was present.
    pub fn remove(&self, key: impl AsRef<[u8]>) -> Result<bool> {
        self.inner.remove(&self.namespace, key.as_ref())
    }
}
