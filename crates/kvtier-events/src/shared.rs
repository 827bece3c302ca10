//! What the batcher and the connections share: the batches as published
//! (kept for replay, queued for subscribers), the subscribers, every
//! connection, and the counters `/stats` reads.

use crate::zmtp;
use std::collections::VecDeque;
use std::io;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Mutex};

#[derive(Debug)]
pub(crate) struct Published {
    pub(crate) seq: u64,
    pub(crate) topic: Vec<u8>,
    /// The namespace its events are in (`None`: a batch for every
    /// namespace, such as `AllBlocksCleared`).
    pub(crate) namespace: Option<String>,
    pub(crate) payload: Vec<u8>,
    /// What a peer whose credential does not open `namespace` gets in its
    /// place: the same number, the bare topic prefix and no events, so
    /// every peer's numbers stay gapless (a router asks the replay socket
    /// for any gap) and nothing of the namespace shows.
    pub(crate) redacted: Option<Arc<Published>>,
}

/// The batch a peer with `scope` gets for `p`: itself where the scope
/// opens its namespace, its redacted stand-in elsewhere.
pub(crate) fn as_seen<'p>(
    scope: &Option<kvtier_server::Scope>,
    p: &'p Arc<Published>,
) -> &'p Arc<Published> {
    match (scope, &p.namespace, &p.redacted) {
        (Some(scope), Some(ns), Some(redacted)) if scope.refuses_namespace(ns).is_some() => {
            redacted
        }
        _ => p,
    }
}

impl Published {
    pub(crate) fn size(&self) -> usize {
        self.topic.len() + self.payload.len() + 64
    }
}

#[derive(Debug)]
pub(crate) struct Subscriber {
    /// What its credential opens (`None`: every namespace).
    pub(crate) scope: Option<kvtier_server::Scope>,
    pub(crate) tx: SyncSender<Arc<Published>>,
    pub(crate) filters: Mutex<Vec<Vec<u8>>>,
    pub(crate) alive: AtomicBool,
    /// Bytes of the batches in `tx` not yet written.
    pub(crate) queued_bytes: AtomicUsize,
}

/// A connection, as the accept loop sees it.
#[derive(Debug)]
pub(crate) struct Peer {
    pub(crate) replay: bool,
    pub(crate) closer: TcpStream,
    /// Set once its handshake is done (subscribers).
    pub(crate) subscriber: Option<std::sync::Weak<Subscriber>>,
}

impl Peer {
    /// Whether it may be closed for a newcomer: a subscriber still in its
    /// handshake or with no subscription (it receives nothing), or any
    /// replay peer (they hold nothing between requests).
    pub(crate) fn idle(&self) -> bool {
        self.replay
            || self
                .subscriber
                .as_ref()
                .and_then(std::sync::Weak::upgrade)
                .is_none_or(|s| s.filters.lock().unwrap().is_empty())
    }
}

impl Subscriber {
    pub(crate) fn wants(&self, topic: &[u8]) -> bool {
        self.filters
            .lock()
            .unwrap()
            .iter()
            .any(|f| topic.starts_with(f))
    }
}

#[derive(Debug, Default)]
pub(crate) struct Shared {
    pub(crate) stop: AtomicBool,
    pub(crate) subscribers: Mutex<Vec<Arc<Subscriber>>>,
    /// Every connection of both sockets, oldest first, to close one for a
    /// newcomer at the limit.
    pub(crate) peers: Mutex<std::collections::BTreeMap<u64, Peer>>,
    pub(crate) next_peer: AtomicU64,
    pub(crate) peers_closed: AtomicU64,
    /// Bytes queued for all subscribers together.
    pub(crate) queued_total: AtomicUsize,
    /// Kept batches and their bytes.
    pub(crate) ring: Mutex<(VecDeque<Arc<Published>>, usize)>,
    pub(crate) connections: AtomicUsize,
    pub(crate) replay_connections: AtomicUsize,
    pub(crate) batches: AtomicU64,
    pub(crate) events: AtomicU64,
    pub(crate) subscriber_dropped: AtomicU64,
    pub(crate) replay_requests: AtomicU64,
    pub(crate) unannounced_removals: AtomicU64,
}

pub(crate) fn put_batch(
    frames: &mut zmtp::FrameWriter,
    out: &mut Vec<u8>,
    p: &Published,
    delimited: bool,
) -> io::Result<()> {
    let seq = p.seq.to_be_bytes();
    if delimited {
        frames.put_message(out, &[b"", &p.topic, &seq, &p.payload])
    } else {
        frames.put_message(out, &[&p.topic, &seq, &p.payload])
    }
}
