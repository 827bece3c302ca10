//! Miniature simulations for the adaptive eviction policy: LRU and S3-FIFO
//! with probation queues of 10%, 25% and 50% of the pool run side by side
//! on a spatial sample of the keys (a key is sampled when
//! its digest falls in 1/`rate` of the hash space, the SHARDS method of
//! Waldspurger et al., ATC'17), each over `capacity / rate` pages, and score
//! what matters to an engine: the *prefix* each would have served. Every
//! `prefix_len` call is a request: for each simulated policy, the leading
//! sampled keys it holds count as hits and are touched, and the rest are
//! written (the engine recomputes and stores them next), as the live pool
//! sees them. The live pool follows whichever candidate scored most over
//! the recent past. No workload favours one policy everywhere (long-gap
//! reuse wants recency or a long probation, floods of one-time blocks want
//! a short one), so the store measures what the current workload favours.
//!
//! Cost: sampled keys only, at most `SAMPLED_PAGES` pages of metadata per
//! policy, behind its own lock that a busy caller skips (`try_lock`): a
//! skipped request only thins the sample. Clients that never call
//! `prefix_len` leave the pool in its starting mode, S3-FIFO with a 25%
//! probation queue.

use crate::key::DigestHasher;
use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::BuildHasherDefault;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Mutex;

/// A ghost list: the 64-bit fingerprints of recently evicted digests, in
/// eviction order (half the memory of whole digests; two digests sharing a
/// fingerprint only makes one re-insert skip probation).
#[derive(Debug, Default)]
pub struct Ghosts {
    set: HashSet<u64, BuildHasherDefault<DigestHasher>>,
    order: VecDeque<u64>,
}

impl Ghosts {
    fn fingerprint(digest: u128) -> u64 {
        digest as u64 ^ (digest >> 64) as u64
    }

    /// Remembers `digest`, then forgets the oldest beyond `limit`.
    pub fn remember(&mut self, digest: u128, limit: usize) {
        let f = Self::fingerprint(digest);
        if self.set.insert(f) {
            self.order.push_back(f);
        }
        while self.order.len() > limit {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
    }

    /// Whether `digest` was evicted recently; forgets it either way.
    pub fn take(&mut self, digest: u128) -> bool {
        self.set.remove(&Self::fingerprint(digest))
    }

    pub fn heap_bytes(&self) -> usize {
        self.set.capacity() * 9 + self.order.capacity() * 8
    }
}
/// Maps keyed by digests.
type DigestMap<V> = HashMap<u128, V, BuildHasherDefault<DigestHasher>>;

/// Pages each simulation holds at most: every pool up to 128 MiB is
/// simulated whole; larger ones are sampled down to this.
const SAMPLED_PAGES: u64 = 32_768;

/// The live mode the simulations recommend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Lru,
    /// S3-FIFO with a probation queue of this percentage of the pool.
    S3Fifo(u64),
}

/// How much better (in hit rate, over the horizon) another candidate must
/// be before the pool switches to it.
const SWITCH_MARGIN: f64 = 0.006;
/// The same between LRU and S3-FIFO.
const MODE_SWITCH_MARGIN: f64 = 0.012;

/// The candidates, the starting one first.
const CANDIDATES: [Mode; 4] = [
    Mode::S3Fifo(25),
    Mode::S3Fifo(10),
    Mode::S3Fifo(50),
    Mode::Lru,
];

#[derive(Debug)]
pub struct Shadow {
    rate: u64,
    sims: Mutex<Sims>,
    /// Index into `CANDIDATES` of the current pick.
    preferred: AtomicU8,
}

#[derive(Debug)]
enum Sim {
    Lru(LruSim),
    S3(S3Sim),
}

#[derive(Debug)]
struct Sims {
    sims: Vec<Sim>,
    /// Prefix hits per candidate over the recent past (weighted over
    /// `horizon` keys), and the keys they were out of, weighted alike.
    scores: Vec<f64>,
    weight: f64,
    keys: u64,
    horizon: u64,
    /// No switch before this many keys (none right after a switch).
    next_decision: u64,
    current: usize,
    /// Mean pages of the entries written, for keys a request only names.
    pages_per_entry: f64,
}

impl Shadow {
    pub fn new(capacity_pages: u64) -> Shadow {
        let rate = capacity_pages.div_ceil(SAMPLED_PAGES).max(1);
        let pages = (capacity_pages / rate).max(16);
        let sims = CANDIDATES
            .iter()
            .map(|mode| match mode {
                Mode::Lru => Sim::Lru(LruSim::new(pages)),
                Mode::S3Fifo(percent) => Sim::S3(S3Sim::new(pages, *percent)),
            })
            .collect();
        Shadow {
            rate,
            sims: Mutex::new(Sims {
                sims,
                scores: vec![0.0; CANDIDATES.len()],
                weight: 0.0,
                keys: 0,
                horizon: (8 * pages).max(16_384),
                next_decision: 0,
                current: 0,
                pages_per_entry: 1.0,
            }),
            preferred: AtomicU8::new(0),
        }
    }

    fn sampled(&self, digest: u128) -> bool {
        // Mixed once more: sampling must not follow any structure of the
        // key space.
        let mixed = (digest as u64 ^ (digest >> 64) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        mixed.is_multiple_of(self.rate)
    }

    /// A request for a prompt's blocks, in prefix order (`prefix_len`).
    pub fn on_request(&self, digests: impl IntoIterator<Item = u128>) {
        let sampled: Vec<u128> = digests.into_iter().filter(|d| self.sampled(*d)).collect();
        if sampled.is_empty() {
            return;
        }
        let Ok(mut sims) = self.sims.try_lock() else {
            return;
        };
        sims.request(&sampled);
        self.preferred.store(sims.current as u8, Ordering::Relaxed);
    }

    /// A put of `digest` taking `pages` pages: inserted where absent (a
    /// request that named it has already counted it).
    pub fn on_write(&self, digest: u128, pages: u64) {
        if self.sampled(digest) {
            if let Ok(mut sims) = self.sims.try_lock() {
                let pages = pages.max(1);
                sims.pages_per_entry = 0.99 * sims.pages_per_entry + 0.01 * pages as f64;
                for sim in &mut sims.sims {
                    match sim {
                        Sim::Lru(lru) => lru.insert_absent(digest, pages),
                        Sim::S3(s3) => s3.insert_absent(digest, pages),
                    }
                }
            }
        }
    }

    /// Heap bytes of the simulations (bounded by `SAMPLED_PAGES`).
    pub fn heap_bytes(&self) -> u64 {
        let sims = self.sims.lock().unwrap();
        let map = |entries: usize, value: usize| entries * (16 + value + 1);
        sims.sims
            .iter()
            .map(|sim| match sim {
                Sim::Lru(l) => map(l.entries.capacity(), 16) + l.queue.capacity() * 24,
                Sim::S3(s) => {
                    map(s.entries.capacity(), std::mem::size_of::<S3Entry>())
                        + (s.small.capacity() + s.main.capacity()) * 24
                        + s.ghosts.heap_bytes()
                }
            })
            .sum::<usize>() as u64
    }

    /// Makes `mode` the pick, for tests of the live queues' switches.
    #[cfg(test)]
    pub fn force(&self, mode: Mode) {
        let index = CANDIDATES
            .iter()
            .position(|m| *m == mode)
            .expect("a candidate");
        self.preferred.store(index as u8, Ordering::Relaxed);
    }

    pub fn preferred(&self) -> Mode {
        CANDIDATES[usize::from(self.preferred.load(Ordering::Relaxed)) % CANDIDATES.len()]
    }
}

impl Sims {
    fn request(&mut self, keys: &[u128]) {
        let pages = self.pages_per_entry.round().max(1.0) as u64;
        // Exponentially weighted over about one simulated cache's worth of
        // keys: recent enough to follow a phase change, long enough to
        // average over the noise of single requests.
        let decay = (1.0 - 1.0 / self.horizon as f64).powi(keys.len() as i32);
        self.weight = self.weight * decay + keys.len() as f64;
        for (sim, score) in self.sims.iter_mut().zip(&mut self.scores) {
            let hit = match sim {
                Sim::Lru(lru) => lru.request(keys, pages),
                Sim::S3(s3) => s3.request(keys, pages),
            };
            *score = *score * decay + hit as f64;
        }
        self.keys += keys.len() as u64;
        if self.keys < self.next_decision {
            return;
        }
        // Switch only on a clear margin, in hit-rate points: a switch costs
        // the live pool some of what it holds, so it must not flap on noise.
        let (best, best_score) =
            self.scores
                .iter()
                .copied()
                .enumerate()
                .fold(
                    (self.current, f64::MIN),
                    |a, b| if b.1 > a.1 { b } else { a },
                );
        // Between S3-FIFO sizes only a target moves; to or from LRU the
        // queues are rebuilt, so that needs a wider margin.
        let margin = match (CANDIDATES[self.current], CANDIDATES[best]) {
            (Mode::S3Fifo(_), Mode::S3Fifo(_)) => SWITCH_MARGIN,
            _ => MODE_SWITCH_MARGIN,
        };
        if best != self.current && (best_score - self.scores[self.current]) / self.weight > margin {
            self.current = best;
            self.next_decision = self.keys + self.horizon / 8;
        }
    }
}

/// What a simulated policy does with one request: the leading keys it
/// holds are hits (touched); every later key is written again, as the
/// engine recomputes and stores it. Returns the prefix hit.
trait SimPolicy {
    fn contains(&self, digest: u128) -> bool;
    fn touch(&mut self, digest: u128);
    fn write(&mut self, digest: u128, pages: u64);

    fn request(&mut self, keys: &[u128], pages: u64) -> usize {
        let hit = keys.iter().take_while(|k| self.contains(**k)).count();
        for &k in &keys[..hit] {
            self.touch(k);
        }
        for &k in &keys[hit..] {
            self.write(k, pages);
        }
        hit
    }
}

/// Exact LRU over pages, with lazily deleted queue entries.
#[derive(Debug)]
struct LruSim {
    capacity: u64,
    used: u64,
    /// digest -> (stamp of its latest queue entry, pages)
    entries: DigestMap<(u64, u64)>,
    queue: VecDeque<(u128, u64)>,
    stamp: u64,
}

impl LruSim {
    fn new(capacity: u64) -> LruSim {
        LruSim {
            capacity,
            used: 0,
            entries: DigestMap::default(),
            queue: VecDeque::new(),
            stamp: 0,
        }
    }

    fn insert_absent(&mut self, digest: u128, pages: u64) {
        if !self.entries.contains_key(&digest) {
            self.write(digest, pages);
        }
    }

    fn compact(&mut self) {
        if self.queue.len() > 4 * self.entries.len() + 1024 {
            let entries = &self.entries;
            self.queue
                .retain(|(d, at)| entries.get(d).is_some_and(|e| e.0 == *at));
        }
    }
}

impl SimPolicy for LruSim {
    fn contains(&self, digest: u128) -> bool {
        self.entries.contains_key(&digest)
    }

    fn touch(&mut self, digest: u128) {
        self.stamp += 1;
        if let Some(entry) = self.entries.get_mut(&digest) {
            entry.0 = self.stamp;
            self.queue.push_back((digest, self.stamp));
            self.compact();
        }
    }

    fn write(&mut self, digest: u128, pages: u64) {
        self.stamp += 1;
        let stamp = self.stamp;
        if let Some(old) = self.entries.insert(digest, (stamp, pages)) {
            self.used -= old.1;
        }
        self.queue.push_back((digest, stamp));
        self.used += pages;
        while self.used > self.capacity {
            let Some((old, at)) = self.queue.pop_front() else {
                break;
            };
            if self.entries.get(&old).is_some_and(|e| e.0 == at) {
                let (_, freed) = self.entries.remove(&old).unwrap();
                self.used -= freed;
            }
        }
        self.compact();
    }
}

/// S3-FIFO as the live pool runs it: a small FIFO whose entries hit there
/// move to the main FIFO, a ghost of small's evictions (as many as there
/// are entries), and a 2-bit frequency aged by one each time main's head
/// is passed over. Queue items carry a stamp; a rewritten entry's old item
/// is skipped when it reaches the head.
#[derive(Debug)]
struct S3Sim {
    capacity: u64,
    /// The probation queue's share of `capacity`, in percent.
    small_percent: u64,
    small_used: u64,
    main_used: u64,
    /// digest -> entry
    entries: DigestMap<S3Entry>,
    small: VecDeque<(u128, u64)>,
    main: VecDeque<(u128, u64)>,
    ghosts: Ghosts,
    stamp: u64,
}

#[derive(Debug, Clone, Copy)]
struct S3Entry {
    in_small: bool,
    freq: u8,
    pages: u64,
    stamp: u64,
}

impl S3Sim {
    fn new(capacity: u64, small_percent: u64) -> S3Sim {
        S3Sim {
            capacity,
            small_percent,
            small_used: 0,
            main_used: 0,
            entries: DigestMap::default(),
            small: VecDeque::new(),
            main: VecDeque::new(),
            ghosts: Ghosts::default(),
            stamp: 0,
        }
    }

    fn insert_absent(&mut self, digest: u128, pages: u64) {
        if !self.entries.contains_key(&digest) {
            self.write(digest, pages);
        }
    }

    fn forget(&mut self, entry: S3Entry) {
        if entry.in_small {
            self.small_used -= entry.pages;
        } else {
            self.main_used -= entry.pages;
        }
    }

    fn evict(&mut self) -> bool {
        loop {
            let from_small = !self.small.is_empty()
                && (self.main.is_empty()
                    || self.small_used >= self.capacity * self.small_percent / 100);
            let queue = if from_small {
                &mut self.small
            } else {
                &mut self.main
            };
            let Some((digest, stamp)) = queue.pop_front() else {
                return false;
            };
            let Some(entry) = self.entries.get_mut(&digest).filter(|e| e.stamp == stamp) else {
                continue; // rewritten since
            };
            if from_small {
                if entry.freq > 0 {
                    entry.in_small = false;
                    entry.freq = 0;
                    let pages = entry.pages;
                    self.main.push_back((digest, stamp));
                    self.small_used -= pages;
                    self.main_used += pages;
                    continue;
                }
                let pages = entry.pages;
                self.entries.remove(&digest);
                self.small_used -= pages;
                let limit = self.entries.len().max(64);
                self.ghosts.remember(digest, limit);
                return true;
            }
            if entry.freq > 0 {
                entry.freq -= 1;
                self.main.push_back((digest, stamp));
                continue;
            }
            let pages = entry.pages;
            self.entries.remove(&digest);
            self.main_used -= pages;
            return true;
        }
    }

    fn compact(&mut self) {
        let live = self.entries.len();
        if self.small.len() + self.main.len() > 4 * live + 1024 {
            let entries = &self.entries;
            let current = |(d, at): &(u128, u64)| entries.get(d).is_some_and(|e| e.stamp == *at);
            self.small.retain(current);
            self.main.retain(current);
        }
    }
}

impl SimPolicy for S3Sim {
    fn contains(&self, digest: u128) -> bool {
        self.entries.contains_key(&digest)
    }

    fn touch(&mut self, digest: u128) {
        if let Some(entry) = self.entries.get_mut(&digest) {
            entry.freq = (entry.freq + 1).min(3);
        }
    }

    fn write(&mut self, digest: u128, pages: u64) {
        // A rewrite replaces the entry, as a put does in the pool.
        if let Some(old) = self.entries.remove(&digest) {
            self.forget(old);
        }
        while self.small_used + self.main_used + pages > self.capacity && self.evict() {}
        self.stamp += 1;
        let in_small = !self.ghosts.take(digest);
        self.entries.insert(
            digest,
            S3Entry {
                in_small,
                freq: 0,
                pages,
                stamp: self.stamp,
            },
        );
        if in_small {
            self.small.push_back((digest, self.stamp));
            self.small_used += pages;
        } else {
            self.main.push_back((digest, self.stamp));
            self.main_used += pages;
        }
        self.compact();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hot set reused among floods of one-time blocks favours a short
    /// probation queue; everything reused once at a distance just under the
    /// cache size favours LRU. The shadow must pick each in its case.
    #[test]
    fn recommends_the_candidate_that_wins_the_current_pattern() {
        let shadow = Shadow::new(1024);
        assert_eq!(shadow.preferred(), Mode::S3Fifo(25));
        let mut next = 0u128;
        for _ in 0..200 {
            let hot: Vec<u128> = (0..300).collect();
            shadow.on_request(hot);
            for _ in 0..20 {
                let flood: Vec<u128> = (0..100)
                    .map(|_| {
                        next += 1;
                        1_000_000 + next
                    })
                    .collect();
                shadow.on_request(flood);
            }
        }
        assert!(
            matches!(shadow.preferred(), Mode::S3Fifo(p) if p <= 25),
            "{:?}",
            shadow.preferred()
        );
        for round in 0..400u128 {
            let keys: Vec<u128> = (0..900)
                .map(|i| 5_000_000_000 + (round / 2) * 1_000 + i)
                .collect();
            shadow.on_request(keys);
        }
        assert_eq!(shadow.preferred(), Mode::Lru);
    }
}
