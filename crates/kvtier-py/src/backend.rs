//! What an `Engine` runs on: an embedded store or a client of a server.

use kvtier::{PutOptions, Store};
use kvtier_client::{Client, ClientPool};
use std::sync::Arc;

/// The backend a Python object drives: an embedded store or a client.
pub(crate) enum Backend {
    Store(Arc<Store>),
    Client(Box<ClientPool>),
}

impl Backend {
    pub(crate) fn put(
        &self,
        keys: &[Vec<u8>],
        values: &[&[u8]],
        options: &PutOptions,
    ) -> kvtier::Result<Vec<kvtier::Result<()>>> {
        match self {
            Backend::Store(store) => Ok(store.batch_put_with(keys, values, options)),
            Backend::Client(client) => with_client(client, |c| {
                // Values inside the registered shared region are read by
                // the server in place, as gets are written there.
                if let Some(segments) = shm_segments(c, values.iter().map(|v| std::iter::once(*v)))
                {
                    let ranges: Vec<(u64, u64)> = segments.into_iter().map(|s| s[0]).collect();
                    return c.batch_put_registered(keys, &ranges, options);
                }
                c.batch_put_with(keys, values, options)
            }),
        }
    }

    pub(crate) fn get(
        &self,
        keys: &[Vec<u8>],
        bufs: &mut [&mut [u8]],
    ) -> kvtier::Result<Vec<kvtier::Result<Option<usize>>>> {
        match self {
            Backend::Store(store) => Ok(store.batch_get_into(keys, bufs)),
            Backend::Client(client) => with_client(client, |c| {
                // Destinations inside the registered shared region go
                // through it (the server writes there directly).
                let in_shm = shm_segments(c, bufs.iter().map(|b| std::iter::once(&b[..])));
                if let Some(segments) = in_shm {
                    let ranges: Vec<(u64, u64)> = segments.into_iter().map(|s| s[0]).collect();
                    return c.batch_get_registered(keys, &ranges);
                }
                c.batch_get_into(keys, bufs)
            }),
        }
    }

    pub(crate) fn put_segments(
        &self,
        keys: &[Vec<u8>],
        values: &[&[&[u8]]],
        options: &PutOptions,
    ) -> kvtier::Result<Vec<kvtier::Result<()>>> {
        match self {
            Backend::Store(store) => Ok(store.batch_put_segments(keys, values, options)),
            Backend::Client(client) => with_client(client, |c| {
                // Segments inside the registered shared region are read by
                // the server in place; others travel in the frame.
                if let Some(segments) = shm_segments(c, values.iter().map(|v| v.iter().copied())) {
                    return c.batch_put_registered_segments(keys, &segments, options);
                }
                c.batch_put_segments(keys, values, options)
            }),
        }
    }

    pub(crate) fn get_segments(
        &self,
        keys: &[Vec<u8>],
        bufs: &mut [&mut [&mut [u8]]],
    ) -> kvtier::Result<Vec<kvtier::Result<Option<usize>>>> {
        match self {
            Backend::Store(store) => Ok(store.batch_get_segments(keys, bufs)),
            Backend::Client(client) => with_client(client, |c| {
                let in_shm = shm_segments(c, bufs.iter().map(|b| b.iter().map(|s| &s[..])));
                if let Some(segments) = in_shm {
                    return c.batch_get_registered_segments(keys, &segments);
                }
                c.batch_get_segments(keys, bufs)
            }),
        }
    }

    pub(crate) fn exists(&self, keys: &[Vec<u8>]) -> kvtier::Result<Vec<bool>> {
        match self {
            Backend::Store(store) => Ok(store.batch_exists(keys)),
            Backend::Client(client) => with_client(client, |c| c.batch_exists(keys)),
        }
    }

    pub(crate) fn prefix_len(&self, keys: &[Vec<u8>]) -> kvtier::Result<usize> {
        match self {
            Backend::Store(store) => Ok(store.prefix_len(keys)),
            Backend::Client(client) => with_client(client, |c| c.prefix_len(keys)),
        }
    }

    pub(crate) fn remove(&self, key: &[u8]) -> kvtier::Result<bool> {
        match self {
            Backend::Store(store) => store.remove(key),
            Backend::Client(client) => with_client(client, |c| c.remove(key)),
        }
    }

    pub(crate) fn flush(&self) -> kvtier::Result<()> {
        match self {
            Backend::Store(store) => store.flush(),
            Backend::Client(client) => with_client(client, |c| c.flush()),
        }
    }

    /// One whole value, or `None` for a miss.
    pub(crate) fn get_one(&self, key: &[u8]) -> kvtier::Result<Option<Vec<u8>>> {
        match self {
            Backend::Store(store) => store.get(key),
            Backend::Client(client) => with_client(client, |c| c.get(key)),
        }
    }

    pub(crate) fn close(&self) -> kvtier::Result<()> {
        match self {
            Backend::Store(store) => store.close(),
            Backend::Client(pool) => {
                pool.close();
                Ok(())
            }
        }
    }

    pub(crate) fn stats(&self) -> kvtier::Result<serde_json::Value> {
        match self {
            Backend::Store(store) => Ok(kvtier_wire::stats::stats_json(&store.stats())),
            Backend::Client(client) => with_client(client, |c| c.stats()),
        }
    }
}

/// Every value's segments as `(offset, len)` in the client's registered
/// shared region, or `None` if any segment lies outside it.
pub(crate) fn shm_segments<'a, V, S>(client: &Client, values: V) -> Option<Vec<Vec<(u64, u64)>>>
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

pub(crate) fn with_client<T>(
    pool: &ClientPool,
    f: impl FnOnce(&mut Client) -> kvtier::Result<T>,
) -> kvtier::Result<T> {
    pool.with(f)
}
