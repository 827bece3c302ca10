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

use crate::key::{KeyDigest, Namespace, MAX_KEY_LEN, MAX_NAMESPACE_LEN};
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

/// The longest qualified key: length byte, namespace, key.
pub const MAX_QUALIFIED_LEN: usize = 1 + MAX_NAMESPACE_LEN + MAX_KEY_LEN;

/// A qualified key held inline, so that making an event allocates nothing
/// on the put path (and nothing is freed on another thread).
#[derive(Clone)]
pub struct QualifiedKey {
    len: u16,
    bytes: [u8; MAX_QUALIFIED_LEN],
}

impl QualifiedKey {
    /// `None` if `qualified` is longer than any qualified key can be.
    pub fn new(qualified: &[u8]) -> Option<Self> {
        let mut key = QualifiedKey {
            len: u16::try_from(qualified.len()).ok()?,
            bytes: [0; MAX_QUALIFIED_LEN],
        };
        key.bytes
            .get_mut(..qualified.len())?
            .copy_from_slice(qualified);
        Some(key)
    }

    pub(crate) fn of(ns: &Namespace, key: &[u8]) -> Self {
        let prefix = ns.prefix();
        let mut q = QualifiedKey {
            len: (prefix.len() + key.len()) as u16,
            bytes: [0; MAX_QUALIFIED_LEN],
        };
        q.bytes[..prefix.len()].copy_from_slice(prefix);
        q.bytes[prefix.len()..prefix.len() + key.len()].copy_from_slice(key);
        q
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }
}

impl PartialEq for QualifiedKey {
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for QualifiedKey {}

impl std::fmt::Debug for QualifiedKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("QualifiedKey")
            .field(&String::from_utf8_lossy(self.as_bytes()))
            .finish()
    }
}

/// One change to the set of blocks this store can serve.
// The key is inline on purpose (see `QualifiedKey`): events are moved by
// value through a preallocated channel, never boxed.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlockEvent {
    /// The block under `qualified` (namespace and key, see
    /// [`crate::split_qualified`]) is held in `medium`.
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
