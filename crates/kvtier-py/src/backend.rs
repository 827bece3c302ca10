//! What an `Engine` runs on: any `KvBackend` (an embedded store, or a pool
//! of clients of a server, which moves values through its shared memory
//! when the caller's buffers lie there). The dispatch is the client
//! crate's; this adapts the binding's owned keys to it.

use kvtier::PutOptions;
use kvtier_client::KvBackend;
use std::sync::Arc;

/// The backend a Python object drives.
pub(crate) struct Backend(Arc<dyn KvBackend + Send + Sync>);

fn refs(keys: &[Vec<u8>]) -> Vec<&[u8]> {
    keys.iter().map(|k| &k[..]).collect()
}

impl Backend {
    pub(crate) fn new(backend: Arc<dyn KvBackend + Send + Sync>) -> Backend {
        Backend(backend)
    }

    pub(crate) fn put(
        &self,
        keys: &[Vec<u8>],
        values: &[&[u8]],
        options: &PutOptions,
    ) -> kvtier::Result<Vec<kvtier::Result<()>>> {
        self.0.batch_put_whole(&refs(keys), values, options)
    }

    pub(crate) fn get(
        &self,
        keys: &[Vec<u8>],
        bufs: &mut [&mut [u8]],
    ) -> kvtier::Result<Vec<kvtier::Result<Option<usize>>>> {
        self.0.batch_get_whole(&refs(keys), bufs)
    }

    pub(crate) fn put_segments(
        &self,
        keys: &[Vec<u8>],
        values: &[&[&[u8]]],
        options: &PutOptions,
    ) -> kvtier::Result<Vec<kvtier::Result<()>>> {
        self.0.batch_put(&refs(keys), values, options)
    }

    pub(crate) fn get_segments(
        &self,
        keys: &[Vec<u8>],
        bufs: &mut [&mut [&mut [u8]]],
    ) -> kvtier::Result<Vec<kvtier::Result<Option<usize>>>> {
        self.0.batch_get(&refs(keys), bufs)
    }

    pub(crate) fn exists(&self, keys: &[Vec<u8>]) -> kvtier::Result<Vec<bool>> {
        self.0.batch_exists(&refs(keys))
    }

    pub(crate) fn prefix_len(&self, keys: &[Vec<u8>]) -> kvtier::Result<usize> {
        self.0.prefix_len(&refs(keys))
    }

    pub(crate) fn remove(&self, key: &[u8]) -> kvtier::Result<bool> {
        self.0.remove(key)
    }

    pub(crate) fn flush(&self) -> kvtier::Result<()> {
        self.0.flush()
    }

    /// One whole value, or `None` for a miss.
    pub(crate) fn get_one(&self, key: &[u8]) -> kvtier::Result<Option<Vec<u8>>> {
        self.0.get(key)
    }

    pub(crate) fn close(&self) -> kvtier::Result<()> {
        self.0.close()
    }

    pub(crate) fn stats(&self) -> kvtier::Result<serde_json::Value> {
        self.0.stats()
    }

    pub(crate) fn namespaces(&self) -> kvtier::Result<serde_json::Value> {
        self.0.namespaces()
    }

    pub(crate) fn retire_namespace(&self) -> kvtier::Result<kvtier::RetiredNamespace> {
        self.0.retire_namespace()
    }

    pub(crate) fn describe_namespace(&self, manifest: &[u8]) -> kvtier::Result<()> {
        self.0.describe_namespace(manifest)
    }
}
