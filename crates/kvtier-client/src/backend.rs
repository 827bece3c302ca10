//! The operations a request of the protocol runs on, whatever serves it:
//! this process's store ([`NamespacedStore`]), the cluster ([`Router`]:
//! this node's share on its store, the rest on their owners), or another
//! server ([`ClientPool`]). The server dispatches each request once, over
//! this trait, instead of once per kind of backend.

use crate::pool::ClientPool;
use crate::routing::Router;
use kvtier::{NamespacedStore, PutOptions, Result, ValueLease};

pub trait KvBackend {
    /// Stores each value (given as segments laid end to end) under its key.
    fn batch_put(
        &self,
        keys: &[&[u8]],
        values: &[&[&[u8]]],
        options: &PutOptions,
    ) -> Vec<Result<()>>;

    /// Reads each key's value into its segments: `Ok(Some(n))`, `Ok(None)`
    /// for a miss, or an error such as `BufferTooSmall`.
    fn batch_get(
        &self,
        keys: &[&[u8]],
        dests: &mut [&mut [&mut [u8]]],
    ) -> Vec<Result<Option<usize>>>;

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

    fn batch_exists(&self, keys: &[&[u8]]) -> Vec<bool>;

    /// How many leading keys are present.
    fn prefix_len(&self, keys: &[&[u8]]) -> usize {
        self.batch_exists(keys)
            .into_iter()
            .take_while(|&present| present)
            .count()
    }

    /// Removes `key`; whether it was present.
    fn remove(&self, key: &[u8]) -> Result<bool>;

    /// Returns once everything acknowledged so far is durable.
    fn flush(&self) -> Result<()>;

    /// The store itself, when this backend is one (it then reads from and
    /// writes to foreign memory directly: `batch_put_foreign`,
    /// `batch_get_foreign`); `None` for backends that need private copies.
    fn as_store(&self) -> Option<&NamespacedStore> {
        None
    }
}

/// What a backend knows of a value's length before reading it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KnownLen {
    /// The value is this long (its index entry says so).
    Len(usize),
    /// No such key (here, now).
    Absent,
    /// Not known without reading it (another member may hold it).
    Unknown,
}

impl KvBackend for NamespacedStore {
    fn batch_put(
        &self,
        keys: &[&[u8]],
        values: &[&[&[u8]]],
        options: &PutOptions,
    ) -> Vec<Result<()>> {
        self.batch_put_segments(keys, values, options)
    }

    fn batch_get(
        &self,
        keys: &[&[u8]],
        dests: &mut [&mut [&mut [u8]]],
    ) -> Vec<Result<Option<usize>>> {
        self.batch_get_segments(keys, dests)
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

    fn batch_exists(&self, keys: &[&[u8]]) -> Vec<bool> {
        NamespacedStore::batch_exists(self, keys)
    }

    fn prefix_len(&self, keys: &[&[u8]]) -> usize {
        // The store's own: an engine's prompt lookup feeds the adaptive
        // eviction policy.
        NamespacedStore::prefix_len(self, keys)
    }

    fn remove(&self, key: &[u8]) -> Result<bool> {
        NamespacedStore::remove(self, key)
    }

    fn flush(&self) -> Result<()> {
        NamespacedStore::flush(self)
    }

    fn as_store(&self) -> Option<&NamespacedStore> {
        Some(self)
    }
}

impl KvBackend for Router<'_> {
    fn batch_put(
        &self,
        keys: &[&[u8]],
        values: &[&[&[u8]]],
        options: &PutOptions,
    ) -> Vec<Result<()>> {
        self.put(keys, values, options)
    }

    fn batch_get(
        &self,
        keys: &[&[u8]],
        dests: &mut [&mut [&mut [u8]]],
    ) -> Vec<Result<Option<usize>>> {
        self.get(keys, dests)
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

    fn batch_exists(&self, keys: &[&[u8]]) -> Vec<bool> {
        self.exists(keys)
    }

    fn remove(&self, key: &[u8]) -> Result<bool> {
        Router::remove(self, key)
    }

    fn flush(&self) -> Result<()> {
        Router::flush(self)
    }
}

impl KvBackend for ClientPool {
    fn batch_put(
        &self,
        keys: &[&[u8]],
        values: &[&[&[u8]]],
        options: &PutOptions,
    ) -> Vec<Result<()>> {
        self.with(|c| c.batch_put_segments(keys, values, options))
            .unwrap_or_else(|e| keys.iter().map(|_| Err(e.duplicate())).collect())
    }

    fn batch_get(
        &self,
        keys: &[&[u8]],
        dests: &mut [&mut [&mut [u8]]],
    ) -> Vec<Result<Option<usize>>> {
        self.with(|c| c.batch_get_segments(keys, dests))
            .unwrap_or_else(|e| keys.iter().map(|_| Err(e.duplicate())).collect())
    }

    fn batch_exists(&self, keys: &[&[u8]]) -> Vec<bool> {
        self.with(|c| c.batch_exists(keys))
            .unwrap_or_else(|_| vec![false; keys.len()])
    }

    fn prefix_len(&self, keys: &[&[u8]]) -> usize {
        self.with(|c| c.prefix_len(keys)).unwrap_or(0)
    }

    fn remove(&self, key: &[u8]) -> Result<bool> {
        self.with(|c| c.remove(key))
    }

    fn flush(&self) -> Result<()> {
        self.with(|c| c.flush())
    }
}
