//! The store's events into numbered, encoded batches: one per namespace's
//! run of events, `AllBlocksCleared` where events were lost, kept for
//! replay and queued for each subscriber that wants it.

use crate::config::KvEventsConfig;
use crate::msgpack::{encode_batch, WireEvent};
use crate::shared::{as_seen, Published, Shared};
use kvtier::{split_qualified, BlockEvent, EventSink, Medium};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, TryRecvError, TrySendError};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

fn medium_name(m: Medium) -> &'static str {
    match m {
        Medium::Memory => "CPU",
        Medium::Storage => "STORAGE",
    }
}

/// Key digests are keyed BLAKE3 output, already uniform: the tracked map
/// uses their low 64 bits as the hash rather than hashing them again.
#[derive(Debug, Default, Clone, Copy)]
struct DigestHash;

#[derive(Debug, Default)]
struct DigestHasher(u64);

impl std::hash::BuildHasher for DigestHash {
    type Hasher = DigestHasher;
    fn build_hasher(&self) -> DigestHasher {
        DigestHasher(0)
    }
}

impl std::hash::Hasher for DigestHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.0 = self.0.rotate_left(29) ^ u64::from_le_bytes(word);
        }
    }
    fn write_u128(&mut self, n: u128) {
        self.0 = n as u64;
    }
}

/// Turns the store's events into numbered, encoded batches.
pub(crate) struct Batcher<'a> {
    shared: &'a Shared,
    config: &'a KvEventsConfig,
    sink: &'a EventSink,
    /// Announced blocks: digest to (qualified key, medium), for removals.
    tracked: HashMap<u128, (Box<[u8]>, Medium), DigestHash>,
    next_seq: u64,
    seen_dropped: u64,
}

impl<'a> Batcher<'a> {
    pub(crate) fn new(shared: &'a Shared, config: &'a KvEventsConfig, sink: &'a EventSink) -> Self {
        Batcher {
            shared,
            config,
            sink,
            tracked: HashMap::default(),
            next_seq: 0,
            seen_dropped: 0,
        }
    }

    pub(crate) fn run(mut self, rx: Receiver<BlockEvent>) {
        // Whatever a router knew of this node before this start is void.
        self.publish(
            self.config.topic.as_bytes().to_vec(),
            vec![WireEvent::AllBlocksCleared],
        );
        // Polled, never waited on: a receiver blocked in the channel would
        // make every put wake it (a futex call and a context switch per
        // block on the data path); a poll every batch interval costs the
        // puts nothing.
        let interval = self.config.batch_interval.max(Duration::from_millis(1));
        loop {
            if self.shared.stop.load(Ordering::Acquire) {
                return;
            }
            std::thread::sleep(interval);
            let mut pending: Vec<BlockEvent> = Vec::new();
            let closed = loop {
                match rx.try_recv() {
                    Ok(e) => {
                        pending.push(e);
                        if pending.len() >= self.config.max_batch_events {
                            self.flush(std::mem::take(&mut pending));
                        }
                    }
                    Err(TryRecvError::Empty) => break false,
                    Err(TryRecvError::Disconnected) => break true,
                }
            };
            if !pending.is_empty() {
                self.flush(pending);
            }
            if closed {
                return;
            }
        }
    }

    fn flush(&mut self, events: Vec<BlockEvent>) {
        let dropped = self.sink.dropped();
        if dropped > self.seen_dropped {
            // Some change went unannounced: have routers forget this node.
            self.seen_dropped = dropped;
            self.tracked.clear();
            self.publish(
                self.config.topic.as_bytes().to_vec(),
                vec![WireEvent::AllBlocksCleared],
            );
        }
        // Consecutive events of one namespace form a batch (its topic);
        // consecutive events of one kind and medium, one event.
        let mut namespace: Option<Vec<u8>> = None;
        let mut batch: Vec<WireEvent> = Vec::new();
        let mut count = 0usize;
        for event in events {
            let Some((digest, qualified, stored, medium)) = self.resolve(event) else {
                continue;
            };
            let Some((ns, key)) = split_qualified(&qualified) else {
                continue;
            };
            if namespace.as_deref() != Some(ns) || count >= self.config.max_batch_events {
                if let Some(done) = namespace.take() {
                    self.publish_ns(&done, std::mem::take(&mut batch));
                }
                namespace = Some(ns.to_vec());
                count = 0;
            }
            count += 1;
            let name = medium_name(medium);
            let key = key.to_vec();
            match (batch.last_mut(), stored) {
                (
                    Some(WireEvent::BlockStored {
                        block_hashes,
                        medium,
                    }),
                    true,
                ) if *medium == name => block_hashes.push(key),
                (
                    Some(WireEvent::BlockRemoved {
                        block_hashes,
                        medium,
                    }),
                    false,
                ) if *medium == name => block_hashes.push(key),
                (_, true) => batch.push(WireEvent::BlockStored {
                    block_hashes: vec![key],
                    medium: name,
                }),
                (_, false) => batch.push(WireEvent::BlockRemoved {
                    block_hashes: vec![key],
                    medium: name,
                }),
            }
            if stored
                && (self.tracked.len() < self.config.tracked_blocks
                    || self.tracked.contains_key(&digest))
            {
                self.tracked.insert(digest, (qualified, medium));
            }
        }
        if let Some(ns) = namespace {
            self.publish_ns(&ns, batch);
        }
    }

    /// (digest, qualified key, stored?, medium) of an event worth
    /// publishing.
    fn resolve(&mut self, event: BlockEvent) -> Option<(u128, Box<[u8]>, bool, Medium)> {
        match event {
            BlockEvent::Stored {
                medium,
                digest,
                qualified,
            } => Some((digest.0, qualified.to_qualified(), true, medium)),
            BlockEvent::Removed { medium, digest } => {
                let Some((qualified, announced)) = self.tracked.remove(&digest.0) else {
                    self.shared
                        .unannounced_removals
                        .fetch_add(1, Ordering::Relaxed);
                    return None;
                };
                if announced != medium {
                    // E.g. the memory copy of a block announced on disk:
                    // it is still announced where it was.
                    self.tracked.insert(digest.0, (qualified, announced));
                    return None;
                }
                Some((digest.0, qualified, false, medium))
            }
        }
    }

    fn publish_ns(&mut self, namespace: &[u8], events: Vec<WireEvent>) {
        let mut topic = self.config.topic.as_bytes().to_vec();
        topic.push(b'@');
        topic.extend_from_slice(namespace);
        let namespace = String::from_utf8_lossy(namespace).into_owned();
        self.publish_in(topic, Some(namespace), events);
    }

    /// A batch for every namespace.
    fn publish(&mut self, topic: Vec<u8>, events: Vec<WireEvent>) {
        self.publish_in(topic, None, events);
    }

    fn publish_in(&mut self, topic: Vec<u8>, namespace: Option<String>, events: Vec<WireEvent>) {
        if events.is_empty() {
            return;
        }
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let n: usize = events
            .iter()
            .map(|e| match e {
                WireEvent::BlockStored { block_hashes, .. }
                | WireEvent::BlockRemoved { block_hashes, .. } => block_hashes.len(),
                WireEvent::AllBlocksCleared => 1,
            })
            .sum();
        // Only peers that logged in can be shown a stand-in.
        let scoped = self.config.logs_in();
        let redacted = namespace.as_ref().filter(|_| scoped).map(|_| {
            Arc::new(Published {
                seq: self.next_seq,
                topic: self.config.topic.as_bytes().to_vec(),
                namespace: None,
                payload: encode_batch(ts, &[]),
                redacted: None,
            })
        });
        let published = Arc::new(Published {
            seq: self.next_seq,
            topic,
            namespace,
            payload: encode_batch(ts, &events),
            redacted,
        });
        self.next_seq += 1;
        {
            let mut guard = self.shared.ring.lock().unwrap();
            let (ring, bytes) = &mut *guard;
            while !ring.is_empty()
                && (ring.len() >= self.config.replay_batches.max(1)
                    || *bytes + published.size() > self.config.replay_bytes)
            {
                if let Some(old) = ring.pop_front() {
                    *bytes -= old.size();
                }
            }
            *bytes += published.size();
            ring.push_back(Arc::clone(&published));
        }
        let mut subscribers = self.shared.subscribers.lock().unwrap();
        subscribers.retain(|s| s.alive.load(Ordering::Acquire));
        for s in subscribers.iter() {
            let published = as_seen(&s.scope, &published);
            if !s.wants(&published.topic) {
                continue;
            }
            let size = published.size();
            if s.queued_bytes.load(Ordering::Acquire) + size > self.config.subscriber_bytes
                || self.shared.queued_total.load(Ordering::Acquire) + size
                    > self.config.subscribers_bytes_total
            {
                self.shared
                    .subscriber_dropped
                    .fetch_add(1, Ordering::Relaxed);
                continue;
            }
            match s.tx.try_send(Arc::clone(published)) {
                Ok(()) => {
                    s.queued_bytes.fetch_add(size, Ordering::AcqRel);
                    self.shared.queued_total.fetch_add(size, Ordering::AcqRel);
                }
                Err(TrySendError::Full(_)) => {
                    self.shared
                        .subscriber_dropped
                        .fetch_add(1, Ordering::Relaxed);
                }
                Err(TrySendError::Disconnected(_)) => s.alive.store(false, Ordering::Release),
            }
        }
        self.shared.batches.fetch_add(1, Ordering::Relaxed);
        self.shared.events.fetch_add(n as u64, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::Subscriber;
    use crate::testing::{contains, stored};
    use kvtier::KeyDigest;
    use std::sync::atomic::{AtomicBool, AtomicUsize};
    use std::sync::mpsc::sync_channel;
    use std::sync::Mutex;

    /// Runs a batcher over what `sink` holds: once the sink (the only
    /// sender) is dropped, it publishes the rest and returns.
    fn run(config: KvEventsConfig, sink: Arc<EventSink>, rx: Receiver<BlockEvent>) -> Shared {
        let shared = Shared::default();
        drop(sink);
        let counts = EventSink::channel(1).0;
        Batcher::new(&shared, &config, &counts).run(rx);
        shared
    }

    fn batches(shared: &Shared) -> Vec<(u64, String, Vec<u8>)> {
        shared
            .ring
            .lock()
            .unwrap()
            .0
            .iter()
            .map(|p| {
                (
                    p.seq,
                    String::from_utf8(p.topic.clone()).unwrap(),
                    p.payload.clone(),
                )
            })
            .collect()
    }

    #[test]
    fn events_become_numbered_batches_per_namespace_and_removals_need_an_announcement() {
        let (sink, rx) = EventSink::channel(64);
        sink.emit(stored("a", b"k1", 1, Medium::Memory));
        sink.emit(stored("a", b"k2", 2, Medium::Memory));
        sink.emit(BlockEvent::Removed {
            medium: Medium::Memory,
            digest: KeyDigest(1),
        });
        // Never announced: not published.
        sink.emit(BlockEvent::Removed {
            medium: Medium::Storage,
            digest: KeyDigest(77),
        });
        // Announced on disk; a memory copy's removal does not retract it.
        sink.emit(stored("b", b"k3", 3, Medium::Storage));
        sink.emit(BlockEvent::Removed {
            medium: Medium::Memory,
            digest: KeyDigest(3),
        });
        let shared = run(crate::testing::config(), sink, rx);
        let got = batches(&shared);
        let topics: Vec<(u64, &str)> = got.iter().map(|(s, t, _)| (*s, t.as_str())).collect();
        assert_eq!(topics, [(0, "kv@n1"), (1, "kv@n1@a"), (2, "kv@n1@b")]);
        assert_eq!(contains(&got[0].2, b"AllBlocksCleared"), 1);
        // One BlockStored event for both keys, then one BlockRemoved.
        assert_eq!(contains(&got[1].2, b"BlockStored"), 1);
        assert_eq!(contains(&got[1].2, b"BlockRemoved"), 1);
        assert_eq!(contains(&got[1].2, b"k1"), 2);
        assert_eq!(contains(&got[2].2, b"BlockRemoved"), 0);
        assert_eq!(contains(&got[2].2, b"STORAGE"), 1);
        assert_eq!(shared.unannounced_removals.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn events_the_store_dropped_reset_the_routers_view() {
        let (sink, rx) = EventSink::channel(2);
        for i in 0..5u128 {
            sink.emit(stored("a", format!("k{i}").as_bytes(), i, Medium::Memory));
        }
        assert_eq!(sink.dropped(), 3);
        let shared = Shared::default();
        let config = crate::testing::config();
        let batcher = Batcher::new(&shared, &config, &sink);
        let events: Vec<BlockEvent> = rx.try_iter().collect();
        let mut batcher = batcher;
        batcher.flush(events);
        let got = batches(&shared);
        // AllBlocksCleared first, then what did arrive.
        assert_eq!(got.len(), 2);
        assert_eq!(contains(&got[0].2, b"AllBlocksCleared"), 1);
        assert_eq!(contains(&got[1].2, b"BlockStored"), 1);
        // Only once per drop episode.
        batcher.flush(vec![stored("a", b"later", 99, Medium::Memory)]);
        assert_eq!(batches(&shared).len(), 3);
    }

    #[test]
    fn the_replay_ring_is_bounded_by_bytes() {
        let shared = Shared::default();
        let mut config = crate::testing::config();
        config.replay_bytes = 4096;
        let (sink, _rx) = EventSink::channel(1);
        let mut batcher = Batcher::new(&shared, &config, &sink);
        for i in 0..200u128 {
            batcher.flush(vec![stored("a", &[i as u8; 200], i, Medium::Memory)]);
        }
        let ring = shared.ring.lock().unwrap();
        assert!(ring.1 <= 4096 && ring.1 == ring.0.iter().map(|p| p.size()).sum::<usize>());
        assert_eq!(ring.0.back().unwrap().seq, 199);
    }

    /// Issue 39, finding 4: what all subscribers hold queued together is
    /// bounded (63 slow subscribers used to hold 1.1 GiB): past the total
    /// a subscriber misses batches as past its own cap.
    #[test]
    fn queued_batches_are_bounded_across_subscribers() {
        let shared = Shared::default();
        let mut config = crate::testing::config();
        config.subscribers_bytes_total = 64 << 10;
        let mut receivers = Vec::new();
        for _ in 0..8 {
            let (tx, rx) = sync_channel(10_000);
            receivers.push(rx);
            shared
                .subscribers
                .lock()
                .unwrap()
                .push(Arc::new(Subscriber {
                    scope: None,
                    tx,
                    filters: Mutex::new(vec![Vec::new()]),
                    alive: AtomicBool::new(true),
                    queued_bytes: AtomicUsize::new(0),
                    last_sent: Mutex::new(std::time::Instant::now()),
                }));
        }
        let (sink, _rx) = EventSink::channel(1);
        let mut batcher = Batcher::new(&shared, &config, &sink);
        for i in 0..400u128 {
            batcher.flush(vec![stored("a", &[i as u8; 200], i, Medium::Memory)]);
        }
        let total = shared.queued_total.load(Ordering::Relaxed);
        let held: usize = receivers
            .iter()
            .map(|rx| rx.try_iter().map(|p| p.size()).sum::<usize>())
            .sum();
        assert_eq!(total, held);
        assert!(total <= 64 << 10, "{total} bytes queued");
        assert!(shared.subscriber_dropped.load(Ordering::Relaxed) > 0);
    }
}
