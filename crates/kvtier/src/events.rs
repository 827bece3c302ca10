//! Block events: what a store announces about the blocks it can serve, for
//! cache-aware routers (the server publishes them in vLLM's KV-event
//! format; see docs/integrations.md, "KV events").
//!
//! A block is announced only once the state the announcement names holds:
//! `Stored { medium: Storage }` after the batch holding it is durable on
//! disk, `Stored { medium: Memory }` when a memory-only put is in the pool,
//! `Removed` after a remove is durable, when eviction drops a block's last
//! copy in memory, and when reclaim drops a block's disk copy. The data path
//! never waits on a reader: events go through a bounded channel, and one
//! that does not fit is counted in [`EventSink::dropped`] and lost.

use crate::key::{KeyDigest, Namespace};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;

/// Where a block lives, in the terms of vLLM's event media.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Medium {
    /// The memory pool (vLLM's `CPU`).
    Memory,
    /// The disk tier, local or a shared directory (vLLM's `STORAGE`).
    Storage,
}

/// Key bytes an event holds inline; longer keys are boxed.
const INLINE_KEY: usize = 46;

#[derive(Clone)]
enum KeyBytes {
    Inline { len: u8, bytes: [u8; INLINE_KEY] },
    Heap(Box<[u8]>),
}

/// A block's namespace and key as an event carries them: the namespace
/// shared with the store's own handle (a reference count, no copy) and
/// the key inline when short (engine block hashes are 8 to 40 bytes), so
/// that making an event on the put path allocates nothing and the event
/// stays small (about 100 bytes: the channel's slots stay in cache).
#[derive(Clone)]
pub struct QualifiedKey {
    /// The namespace's length byte and name, as in a qualified key.
    prefix: Arc<[u8]>,
    key: KeyBytes,
}

impl QualifiedKey {
    /// From a qualified key (see [`crate::split_qualified`]); `None` if it
    /// is not one.
    pub fn new(qualified: &[u8]) -> Option<Self> {
        let (ns, key) = crate::key::split_qualified(qualified)?;
        Some(QualifiedKey {
            prefix: Arc::from(&qualified[..1 + ns.len()]),
            key: KeyBytes::of(key),
        })
    }

    pub(crate) fn of(ns: &Namespace, key: &[u8]) -> Self {
        QualifiedKey {
            prefix: ns.prefix_shared(),
            key: KeyBytes::of(key),
        }
    }

    /// From a namespace prefix already shared (the flusher reuses one
    /// across a batch) and a key.
    pub(crate) fn with_prefix(prefix: Arc<[u8]>, key: &[u8]) -> Self {
        QualifiedKey {
            prefix,
            key: KeyBytes::of(key),
        }
    }

    /// The namespace's name.
    pub fn namespace(&self) -> &[u8] {
        &self.prefix[1..]
    }

    pub fn key(&self) -> &[u8] {
        match &self.key {
            KeyBytes::Inline { len, bytes } => &bytes[..usize::from(*len)],
            KeyBytes::Heap(b) => b,
        }
    }

    /// The qualified key: length byte, namespace, key.
    pub fn to_qualified(&self) -> Box<[u8]> {
        let mut q = Vec::with_capacity(self.prefix.len() + self.key().len());
        q.extend_from_slice(&self.prefix);
        q.extend_from_slice(self.key());
        q.into()
    }
}

impl KeyBytes {
    fn of(key: &[u8]) -> Self {
        if key.len() <= INLINE_KEY {
            let mut bytes = [0; INLINE_KEY];
            bytes[..key.len()].copy_from_slice(key);
            KeyBytes::Inline {
                len: key.len() as u8,
                bytes,
            }
        } else {
            KeyBytes::Heap(key.into())
        }
    }
}

impl PartialEq for QualifiedKey {
    fn eq(&self, other: &Self) -> bool {
        self.prefix == other.prefix && self.key() == other.key()
    }
}

impl Eq for QualifiedKey {}

impl std::fmt::Debug for QualifiedKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QualifiedKey")
            .field("namespace", &String::from_utf8_lossy(self.namespace()))
            .field("key", &String::from_utf8_lossy(self.key()))
            .finish()
    }
}

/// One change to the set of blocks this store can serve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlockEvent {
    /// The block `qualified` names is held in `medium`.
    Stored {
        medium: Medium,
        digest: KeyDigest,
        qualified: QualifiedKey,
    },
    /// The block `digest` is no longer held in `medium`. The key is not
    /// carried: the index keeps digests only, and a reader that announced
    /// the block knows its key.
    Removed { medium: Medium, digest: KeyDigest },
}

/// The sending half a store writes its events into
/// ([`crate::Config::events`]).
#[derive(Debug)]
pub struct EventSink {
    tx: SyncSender<BlockEvent>,
    dropped: AtomicU64,
    sent: AtomicU64,
}

impl EventSink {
    /// A sink holding at most `capacity` unread events, and its reader.
    pub fn channel(capacity: usize) -> (Arc<EventSink>, Receiver<BlockEvent>) {
        let (tx, rx) = sync_channel(capacity.max(1));
        let sink = EventSink {
            tx,
            dropped: AtomicU64::new(0),
            sent: AtomicU64::new(0),
        };
        (Arc::new(sink), rx)
    }

    /// Hands an event to the reader without waiting; a full channel (or a
    /// reader that is gone) drops it and counts the drop.
    pub fn emit(&self, event: BlockEvent) {
        match self.tx.try_send(event) {
            Ok(()) => {
                self.sent.fetch_add(1, Ordering::Relaxed);
            }
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Events lost because the reader was behind (or gone).
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Events handed to the reader.
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qualified_keys_round_trip_short_and_long() {
        for len in [1usize, 46, 47, 256] {
            let key: Vec<u8> = (0..len).map(|i| i as u8).collect();
            let mut q = vec![3u8];
            q.extend_from_slice(b"abc");
            q.extend_from_slice(&key);
            let k = QualifiedKey::new(&q).unwrap();
            assert_eq!((k.namespace(), k.key()), (&b"abc"[..], &key[..]));
            assert_eq!(&k.to_qualified()[..], &q[..]);
        }
        assert!(QualifiedKey::new(&[9, b'a']).is_none());
        assert!(std::mem::size_of::<BlockEvent>() <= 112);
    }

    #[test]
    fn a_full_channel_drops_and_counts_without_waiting() {
        let (sink, rx) = EventSink::channel(2);
        for i in 0..5u128 {
            sink.emit(BlockEvent::Removed {
                medium: Medium::Memory,
                digest: KeyDigest(i),
            });
        }
        assert_eq!((sink.sent(), sink.dropped()), (2, 3));
        let got: Vec<_> = rx.try_iter().collect();
        assert_eq!(got.len(), 2);
        drop(rx);
        sink.emit(BlockEvent::Removed {
            medium: Medium::Storage,
            digest: KeyDigest(9),
        });
        assert_eq!(sink.dropped(), 4);
    }
}
