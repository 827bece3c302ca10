//! What the batcher and the connections share: the batches as published
//! (kept for replay, queued for subscribers), the subscribers, every
//! connection, and the counters `/stats` reads.

use crate::zmtp;
use kvtier_governor::Principal;
use std::collections::VecDeque;
use std::io;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

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
    /// When it was last sent a batch (from its handshake on).
    pub(crate) last_sent: Mutex<Instant>,
}

impl Subscriber {
    pub(crate) fn wants(&self, topic: &[u8]) -> bool {
        self.filters
            .lock()
            .unwrap()
            .iter()
            .any(|f| topic.starts_with(f))
    }

    /// Whether it receives nothing: no subscription, or nothing sent for
    /// `idle_limit` (a subscription that never matches holds a slot as
    /// uselessly as none).
    pub(crate) fn idle(&self, idle_limit: Duration) -> bool {
        self.filters.lock().unwrap().is_empty()
            || self.last_sent.lock().unwrap().elapsed() >= idle_limit
    }
}

/// Where a connection is, as far as closing it for a newcomer goes.
#[derive(Debug)]
pub(crate) enum Stage {
    /// In its handshake: it proved nothing yet (closable).
    Handshake,
    /// Its login done, waiting for a slot of its principal: a finished
    /// login, never closed for a newcomer.
    LoggedIn,
    /// A subscriber (closable once idle, `Subscriber::idle`).
    Subscribed(Weak<Subscriber>),
    /// A replay peer that has not sent a whole request since its last
    /// answer (closable).
    ReplayWaiting,
    /// A replay peer being answered: never closed for a newcomer.
    ReplayServing,
}

/// A connection, as the accept loops see it.
#[derive(Debug)]
pub(crate) struct Peer {
    pub(crate) replay: bool,
    pub(crate) closer: TcpStream,
    /// Who its slot is charged to: unauthenticated peers until its
    /// handshake is done, then its login's principal.
    pub(crate) principal: Principal,
    pub(crate) stage: Stage,
    /// Set when it is closed for a newcomer: its waits (a guess turn, the
    /// refusal pause) end at once, so its slot comes back at once.
    pub(crate) closed: Arc<AtomicBool>,
}

impl Peer {
    /// Whether it may be closed for a newcomer: in its handshake, an idle
    /// subscriber, or a replay peer between requests; never a replay being
    /// answered, nor a subscriber being sent batches.
    pub(crate) fn closable(&self, idle_limit: Duration) -> bool {
        match &self.stage {
            Stage::Handshake | Stage::ReplayWaiting => true,
            Stage::LoggedIn | Stage::ReplayServing => false,
            Stage::Subscribed(subscriber) => {
                subscriber.upgrade().is_none_or(|s| s.idle(idle_limit))
            }
        }
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
    /// Connections closed at once at accept or after their handshake: no
    /// room in the budget their principal draws on, and none to make.
    pub(crate) peers_refused: AtomicU64,
    /// Bytes queued for all subscribers together.
    pub(crate) queued_total: AtomicUsize,
    /// Kept batches and their bytes.
    pub(crate) ring: Mutex<(VecDeque<Arc<Published>>, usize)>,
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
