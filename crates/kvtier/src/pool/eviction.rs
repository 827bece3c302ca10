//! Eviction order for the memory pool: S3-FIFO, CLOCK-approximated LRU, or
//! the adaptive default, which runs whichever of the two its miniature
//! simulations (`shadow`) find better on the current workload.
//!
//! Queues hold `Weak` references, so a value removed or overwritten
//! elsewhere frees its extent at once; its stale queue item is skipped when
//! it reaches the head. Hits only bump a counter in the slot, so the read
//! path never takes this structure's lock.

use super::shadow::{Ghosts, Mode, Shadow};
use super::PoolSlot;
use crate::config::EvictionPolicy;
use std::collections::VecDeque;
use std::sync::{Arc, Weak};

#[derive(Debug)]
struct QueueItem {
    slot: Weak<PoolSlot>,
    pages: u64,
}

#[derive(Debug)]
pub struct EvictionQueues {
    /// What the queues do now: the policy's, or the shadow's pick.
    mode: Mode,
    /// The adaptive policy's simulations (`None` for a fixed policy).
    shadow: Option<Arc<Shadow>>,
    capacity_pages: u64,
    /// S3-FIFO's probation queue; unused by LRU.
    small: VecDeque<QueueItem>,
    small_pages: u64,
    /// S3-FIFO's main queue, or LRU's clock.
    main: VecDeque<QueueItem>,
    /// Digests recently evicted from `small` (S3-FIFO): re-inserted keys go
    /// straight to `main`.
    ghosts: Ghosts,
    ghost_capacity: usize,
    /// Pages of the most recent batch puts: the probation queue is kept at
    /// least as large as the largest, so a batch never pushes out its own
    /// first entries before they can be read.
    recent_batches: VecDeque<u64>,
}

/// How many recent batches size the probation queue.
const RECENT_BATCHES: usize = 16;

impl EvictionQueues {
    pub fn new(policy: EvictionPolicy, capacity_pages: u64) -> Self {
        let shadow =
            (policy == EvictionPolicy::Adaptive).then(|| Arc::new(Shadow::new(capacity_pages)));
        EvictionQueues {
            mode: match &shadow {
                Some(shadow) => shadow.preferred(),
                None if policy == EvictionPolicy::Lru => Mode::Lru,
                None => Mode::S3Fifo(10),
            },
            shadow,
            capacity_pages,
            small: VecDeque::new(),
            small_pages: 0,
            main: VecDeque::new(),
            ghosts: Ghosts::default(),
            // One ghost per 16 pages (64 KiB, the smallest typical value).
            ghost_capacity: (capacity_pages / 16).max(64) as usize,
            recent_batches: VecDeque::new(),
        }
    }

    /// Tells the policy a batch of `pages` is about to be inserted.
    pub fn note_batch(&mut self, pages: u64) {
        if self.recent_batches.len() == RECENT_BATCHES {
            self.recent_batches.pop_front();
        }
        self.recent_batches.push_back(pages);
    }

    /// S3-FIFO's probation queue size: its share of the pool (10% for the
    /// fixed policy, the shadow's pick for the adaptive one), or the
    /// largest recent batch if that is more (at most half the pool).
    fn small_target(&self) -> u64 {
        let percent = match self.mode {
            Mode::S3Fifo(percent) => percent,
            Mode::Lru => 10,
        };
        let largest = self.recent_batches.iter().copied().max().unwrap_or(0);
        (self.capacity_pages * percent / 100).max(largest.min(self.capacity_pages / 2))
    }

    /// Heap bytes of the queues, the ghosts and the simulations.
    pub fn heap_bytes(&self) -> u64 {
        let item = std::mem::size_of::<QueueItem>();
        let queues = (self.small.capacity() + self.main.capacity()) * item;
        // A hash set slot is the value plus a control byte.
        let ghosts = self.ghosts.heap_bytes();
        (queues + ghosts) as u64 + self.shadow.as_ref().map_or(0, |s| s.heap_bytes())
    }

    /// The live mode's name (see `Stats::eviction_mode`).
    pub fn mode_name(&self) -> String {
        match self.mode {
            Mode::Lru => "lru".into(),
            Mode::S3Fifo(percent) => format!("s3fifo-{percent}"),
        }
    }

    /// The adaptive policy's simulations, for the read path to feed.
    pub fn shadow(&self) -> Option<Arc<Shadow>> {
        self.shadow.clone()
    }

    /// Follows the shadow's pick. To LRU: the probation queue joins the
    /// clock behind main (its entries are the newer ones). To S3-FIFO: new
    /// entries start going through probation.
    fn follow_shadow(&mut self) {
        let Some(shadow) = &self.shadow else { return };
        let want = shadow.preferred();
        if want == self.mode {
            return;
        }
        if want == Mode::Lru {
            self.main.extend(self.small.drain(..));
            self.small_pages = 0;
        }
        // Between S3-FIFO sizes only the probation target moves.
        self.mode = want;
    }

    pub fn insert(&mut self, slot: &Arc<PoolSlot>) {
        let item = QueueItem {
            slot: Arc::downgrade(slot),
            pages: slot.pages(),
        };
        if let Some(shadow) = &self.shadow {
            shadow.on_write(slot.digest().0, item.pages);
        }
        self.follow_shadow();
        match self.mode {
            Mode::Lru => self.main.push_back(item),
            Mode::S3Fifo(_) => {
                if self.ghosts.take(slot.digest().0) {
                    self.main.push_back(item);
                } else {
                    self.small_pages += item.pages;
                    self.small.push_back(item);
                }
            }
        }
        self.compact_if_stale();
    }

    /// The next slot the policy would drop that may be dropped (durable or
    /// memory-only). `None` when nothing in the pool may be dropped now.
    pub fn next_victim(&mut self) -> Option<Arc<PoolSlot>> {
        self.follow_shadow();
        let mut budget = 2 * (self.small.len() + self.main.len()) + 2;
        while budget > 0 {
            budget -= 1;
            let from_small = matches!(self.mode, Mode::S3Fifo(_))
                && !self.small.is_empty()
                && (self.main.is_empty() || self.small_pages >= self.small_target());
            let item = if from_small {
                let item = self.small.pop_front()?;
                self.small_pages -= item.pages;
                item
            } else {
                self.main.pop_front()?
            };
            let Some(slot) = item.slot.upgrade() else {
                continue;
            };
            if !slot.is_evictable() {
                self.requeue(from_small, item);
                continue;
            }
            let hits = slot.hits();
            if from_small {
                if hits > 0 {
                    slot.set_hits(0);
                    self.main.push_back(item);
                    continue;
                }
                self.remember_ghost(slot.digest().0);
                return Some(slot);
            }
            if hits > 0 {
                // LRU (CLOCK) clears the mark; S3-FIFO ages it by one.
                let next = match self.mode {
                    Mode::Lru => 0,
                    Mode::S3Fifo(_) => hits - 1,
                };
                slot.set_hits(next);
                self.main.push_back(item);
                continue;
            }
            return Some(slot);
        }
        None
    }

    fn requeue(&mut self, small: bool, item: QueueItem) {
        if small {
            self.small_pages += item.pages;
            self.small.push_back(item);
        } else {
            self.main.push_back(item);
        }
    }

    fn remember_ghost(&mut self, digest: u128) {
        // As many ghosts as the pool holds entries (S3-FIFO's sizing), at
        // least the configured floor.
        let limit = self.ghost_capacity.max(self.small.len() + self.main.len());
        self.ghosts.remember(digest, limit);
    }

    /// Drops queue items whose slots are gone once they outnumber live ones,
    /// so churn without eviction cannot grow the queues without bound.
    fn compact_if_stale(&mut self) {
        let len = self.small.len() + self.main.len();
        if len < 1024 || len < 4 * self.capacity_pages as usize {
            return;
        }
        self.small.retain(|item| item.slot.strong_count() > 0);
        self.small_pages = self.small.iter().map(|item| item.pages).sum();
        self.main.retain(|item| item.slot.strong_count() > 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::KeyDigest;
    use crate::pool::PoolCore;

    /// The adaptive queues switching between LRU and every S3-FIFO size in
    /// the middle of inserts, hits and evictions: every victim is a live,
    /// evictable slot; the probation accounting matches the queue; and
    /// everything evictable can still be evicted.
    #[test]
    fn switching_modes_keeps_the_queues_consistent() {
        let pool = PoolCore::new(4 << 20).unwrap();
        let mut queues = EvictionQueues::new(EvictionPolicy::Adaptive, pool.capacity_pages());
        let shadow = queues.shadow().unwrap();
        let modes = [
            Mode::Lru,
            Mode::S3Fifo(10),
            Mode::S3Fifo(50),
            Mode::S3Fifo(25),
        ];
        let mut live: Vec<Arc<PoolSlot>> = Vec::new();
        let mut dice = crate::io::faulty::Dice::new(0x2545_f491_4f6c_dd1d);
        let mut next = || dice.roll();
        for step in 0..20_000u64 {
            if step % 997 == 0 {
                shadow.force(modes[(step / 997) as usize % modes.len()]);
            }
            let len = 4096 * (1 + (next() % 3) as usize);
            let slot = loop {
                if let Some(slot) =
                    pool.try_allocate(len, KeyDigest(u128::from(step)), Arc::from(&[0u8][..]))
                {
                    break slot;
                }
                let victim = queues
                    .next_victim()
                    .expect("a full pool of evictable slots has a victim");
                assert!(victim.is_evictable());
                live.retain(|s| !Arc::ptr_eq(s, &victim));
            };
            let slot = Arc::new(slot);
            slot.set_evictable();
            queues.insert(&slot);
            live.push(Arc::clone(&slot));
            // Hits on random live slots; some slots dropped by their owner.
            for _ in 0..2 {
                if !live.is_empty() {
                    live[(next() % live.len() as u64) as usize].record_hit();
                }
            }
            if next() % 10 == 0 && !live.is_empty() {
                live.swap_remove((next() % live.len() as u64) as usize);
            }
            let counted: u64 = queues.small.iter().map(|item| item.pages).sum();
            assert_eq!(
                counted, queues.small_pages,
                "probation pages at step {step}"
            );
        }
        // Everything still held can be evicted.
        let mut evicted = 0;
        while let Some(victim) = queues.next_victim() {
            live.retain(|s| !Arc::ptr_eq(s, &victim));
            evicted += 1;
            assert!(evicted < 100_000, "the queues never run dry");
        }
        assert!(
            live.is_empty(),
            "{} live slots were never offered",
            live.len()
        );
    }
}
