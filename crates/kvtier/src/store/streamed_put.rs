//! Puts whose values arrive piece by piece: a server reading a BatchPut
//! frame from its socket receives each value straight into its pool
//! extent, instead of into a frame buffer that is then copied into the
//! pool (one copy of every put byte fewer).
//!
//! Values enter the index when the batch finishes, last first, as
//! [`NamespacedStore::batch_put_segments`] enters them (the eviction order
//! reaches a prompt's later blocks before its earlier ones). Until then
//! they hold their extents; when the pool runs short of room for the next
//! value, the values received so far are entered first, so a batch larger
//! than the pool behaves as an in-memory batch does.

use super::{NamespacedStore, PutOptions, ReceivingValue};
use crate::error::{ErrorKind, Result};
use crate::units::PAGE_SIZE;

/// One batch of streamed puts (see [`NamespacedStore::streamed_puts`]).
#[derive(Debug)]
pub struct StreamedPuts {
    store: NamespacedStore,
    options: PutOptions,
    /// Received values not yet in the index, in arrival order, with their
    /// item's position and key.
    pending: Vec<(usize, Box<[u8]>, ReceivingValue)>,
    results: Vec<Result<()>>,
    /// The lowest and highest sequence numbers entered (for `durable`).
    seqs: (u64, u64),
}

impl NamespacedStore {
    /// A batch of `items` puts whose values (`bytes` in all, about) will
    /// arrive piece by piece, each received straight into its pool extent
    /// (see [`StreamedPuts`]).
    pub fn streamed_puts(&self, options: &PutOptions, items: usize, bytes: u64) -> StreamedPuts {
        StreamedPuts::new(self.clone(), options, items, bytes)
    }
}

impl StreamedPuts {
    pub(crate) fn new(
        store: NamespacedStore,
        options: &PutOptions,
        items: usize,
        bytes: u64,
    ) -> StreamedPuts {
        if items > 1 {
            store.inner().note_batch(bytes);
        }
        StreamedPuts {
            store,
            options: *options,
            pending: Vec::new(),
            results: Vec::with_capacity(items),
            seqs: (u64::MAX, 0),
        }
    }

    /// An extent for the next item's value of `len` bytes: fill it, then
    /// hand it to [`received`](Self::received). `None`: the item is
    /// answered already (a bad key or length, no room, or `skip_existing`
    /// and the key is present), and the caller discards its bytes.
    pub fn begin(&mut self, key: &[u8], len: u64) -> Option<ReceivingValue> {
        if !self.pending.is_empty()
            && self.store.inner().pool_free_bytes() < len.div_ceil(PAGE_SIZE) * PAGE_SIZE
        {
            self.enter_pending();
        }
        let mut begun =
            self.store
                .inner()
                .begin_put(self.store.namespace(), key, len, &self.options);
        // Free bytes are not free extents: a pool short of a long enough one
        // gets the received values entered (so they may be evicted), and one
        // more try.
        if matches!(&begun, Err(e) if e.kind() == ErrorKind::NoSpace) && !self.pending.is_empty() {
            self.enter_pending();
            begun = self
                .store
                .inner()
                .begin_put(self.store.namespace(), key, len, &self.options);
        }
        match begun {
            Ok(Some(value)) => Some(value),
            Ok(None) => {
                self.results.push(Ok(()));
                None
            }
            Err(e) => {
                self.results.push(Err(e));
                None
            }
        }
    }

    /// Answers the next item with `error` without taking an extent (the
    /// caller discards its bytes): a limit of the caller's own said no.
    pub fn refuse(&mut self, error: crate::Error) {
        self.results.push(Err(error));
    }

    /// The item's value, filled.
    pub fn received(&mut self, key: &[u8], value: ReceivingValue) {
        self.pending.push((self.results.len(), key.into(), value));
        // Its answer comes when it enters the index.
        self.results.push(Ok(()));
    }

    /// Enters every received value, then (with `durable`) waits for them
    /// to reach the disk. One result per item, in order.
    pub fn finish(mut self) -> Vec<Result<()>> {
        self.enter_pending();
        if self.options.durable && self.seqs.1 > 0 {
            if let Err(e) = self.store.inner().wait_durable(self.seqs.0, self.seqs.1) {
                for result in self.results.iter_mut().filter(|r| r.is_ok()) {
                    *result = Err(e.duplicate());
                }
            }
        }
        std::mem::take(&mut self.results)
    }

    /// Enters the received values into the index, last first.
    fn enter_pending(&mut self) {
        while let Some((item, key, value)) = self.pending.pop() {
            match self
                .store
                .inner()
                .commit_put(self.store.namespace(), &key, value)
            {
                Ok(seq) => self.seqs = (self.seqs.0.min(seq), self.seqs.1.max(seq)),
                Err(e) => self.results[item] = Err(e),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::{Config, ErrorKind, PutOptions, PutTier, Store};
    use proptest::prelude::*;

    fn value(seed: usize, len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 31 + seed * 7) as u8).collect()
    }

    fn open(dir: &std::path::Path, memory: u64) -> Store {
        Store::open(
            Config::new(dir)
                .memory_capacity(memory)
                .disk_capacity(64 << 20)
                .region_size(4 << 20),
        )
        .unwrap()
    }

    /// Streams `values` as a server would: each value's bytes handed over
    /// in reads of `read` bytes at most.
    fn stream(
        store: &Store,
        keys: &[Vec<u8>],
        values: &[Vec<u8>],
        options: &PutOptions,
        read: usize,
    ) -> Vec<crate::Result<()>> {
        let ns = store.in_namespace(store.default_namespace());
        let total = values.iter().map(|v| v.len() as u64).sum();
        let mut batch = ns.streamed_puts(options, keys.len(), total);
        for (key, bytes) in keys.iter().zip(values) {
            let Some(mut receiving) = batch.begin(key, bytes.len() as u64) else {
                continue;
            };
            let mut at = 0;
            receiving
                .fill(|chunk| {
                    let mut filled = 0;
                    while filled < chunk.len() {
                        let n = read.min(chunk.len() - filled);
                        chunk[filled..filled + n].copy_from_slice(&bytes[at..at + n]);
                        filled += n;
                        at += n;
                    }
                    Ok(())
                })
                .unwrap();
            batch.received(key, receiving);
        }
        batch.finish()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        /// Streamed puts store what `batch_put` stores, in memory and
        /// through to disk (read back after a reopen, checksums checked).
        #[test]
        fn streamed_puts_store_what_batch_puts_store(
            lens in prop::collection::vec(1usize..200_000, 1..12),
            read in 1usize..100_000,
            durable in any::<bool>(),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let keys: Vec<Vec<u8>> = (0..lens.len()).map(|i| format!("k{i}").into_bytes()).collect();
            let values: Vec<Vec<u8>> = lens.iter().enumerate().map(|(i, &l)| value(i, l)).collect();
            {
                let store = open(dir.path(), 16 << 20);
                let options = PutOptions { durable, ..Default::default() };
                for r in stream(&store, &keys, &values, &options, read) {
                    prop_assert!(r.is_ok());
                }
                for (k, v) in keys.iter().zip(&values) {
                    prop_assert_eq!(store.get(k).unwrap(), Some(v.clone()));
                }
                store.close().unwrap();
            }
            let store = open(dir.path(), 16 << 20);
            for (k, v) in keys.iter().zip(&values) {
                prop_assert_eq!(store.get(k).unwrap(), Some(v.clone()));
            }
        }
    }

    #[test]
    fn bad_items_are_answered_and_the_rest_stored() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path(), 8 << 20);
        store.put(b"present", b"old").unwrap();
        let ns = store.in_namespace(store.default_namespace());
        let skip = PutOptions {
            skip_existing: true,
            tier: PutTier::MemoryOnly,
            ..Default::default()
        };
        let mut batch = ns.streamed_puts(&skip, 4, 0);
        assert!(batch.begin(b"present", 10).is_none(), "skipped");
        assert!(batch.begin(b"empty", 0).is_none());
        assert!(batch.begin(b"huge", 1 << 40).is_none());
        let mut ok = batch.begin(b"new", 5).unwrap();
        ok.fill(|c| {
            c.copy_from_slice(b"fresh");
            Ok(())
        })
        .unwrap();
        batch.received(b"new", ok);
        let results = batch.finish();
        assert!(results[0].is_ok());
        assert_eq!(
            results[1].as_ref().unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        assert!(results[2].is_err());
        assert!(results[3].is_ok());
        assert_eq!(store.get(b"present").unwrap().unwrap(), b"old");
        assert_eq!(store.get(b"new").unwrap().unwrap(), b"fresh");
    }

    /// A batch abandoned part-way (its connection broke) enters nothing and
    /// gives back every extent it took.
    #[test]
    fn an_abandoned_batch_stores_nothing_and_frees_its_extents() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path(), 8 << 20);
        let free = store.stats().memory_bytes;
        let ns = store.in_namespace(store.default_namespace());
        let mut batch = ns.streamed_puts(&PutOptions::default(), 3, 3 << 20);
        let mut first = batch.begin(b"a", 1 << 20).unwrap();
        first
            .fill(|c| {
                c.fill(1);
                Ok(())
            })
            .unwrap();
        batch.received(b"a", first);
        let mut second = batch.begin(b"b", 1 << 20).unwrap();
        let broke = second.fill(|_| Err(std::io::ErrorKind::ConnectionReset.into()));
        assert!(broke.is_err());
        drop(second);
        drop(batch);
        assert_eq!(store.get(b"a").unwrap(), None);
        assert_eq!(store.stats().memory_bytes, free);
    }

    /// A memory-only batch larger than the pool: every put succeeds, as
    /// with `batch_put` (the batch's own earlier values make room).
    #[test]
    fn a_batch_larger_than_the_pool_behaves_as_batch_put() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path(), 4 << 20);
        let memory_only = PutOptions {
            tier: PutTier::MemoryOnly,
            ..Default::default()
        };
        let keys: Vec<Vec<u8>> = (0..12).map(|i| format!("big{i}").into_bytes()).collect();
        let values: Vec<Vec<u8>> = (0..12).map(|i| value(i, 1 << 20)).collect();
        let results = stream(&store, &keys, &values, &memory_only, 1 << 16);
        assert!(results.iter().all(|r| r.is_ok()), "{results:?}");
        let held = keys
            .iter()
            .zip(&values)
            .filter(|(k, v)| store.get(k).unwrap().as_ref() == Some(*v))
            .count();
        assert!((2..=4).contains(&held), "{held}");
    }
}
