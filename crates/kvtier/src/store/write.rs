//! The write path: a put's two halves (an extent taken, then the filled
//! value entered into the index, the eviction queues and the flusher's
//! queue), the pool's eviction when it is short of room, and removes.

use super::{Inner, PutOptions, PutTier};
use crate::config::FlushPolicy;
use crate::error::{Error, Result};
use crate::events::{BlockEvent, Medium, QualifiedKey};
use crate::foreign::Source;
use crate::index::Entry;
use crate::key::{validate_key, KeyDigest, Namespace, ValueChecksum};
use crate::pool::PoolSlot;
use crate::stats::Counters;
use crate::write_log::QueuedWrite;
use std::sync::Arc;
use std::time::{Duration, Instant};

impl Inner {
    /// Returns the put's sequence number, or `None` if it was skipped.
    pub(super) fn put_one(
        &self,
        ns: &Namespace,
        key: &[u8],
        value: impl Source,
        options: &PutOptions,
    ) -> Result<Option<u64>> {
        let Some(mut put) = self.begin_put(ns, key, value.len() as u64, options)? else {
            return Ok(None);
        };
        // Copied chunk by chunk into the pool extent; the checksum is
        // taken from the copy (private memory), never from the source. A
        // value that is not hashed (memory-only) lands in one piece, with
        // non-temporal stores from 256 KiB: nothing reads its fresh
        // extent soon, and a plain copy would first read every line of it.
        let streamed = !put.hashed();
        let mut at = 0;
        put.fill_in(value.len(), |chunk| {
            if streamed {
                value.copy_to_elsewhere(at, chunk);
            } else {
                value.copy_to(at, chunk);
            }
            at += chunk.len();
            Ok(())
        })
        .expect("copying from memory cannot fail");
        self.commit_put(ns, key, put).map(Some)
    }

    /// The first half of a put: checks the key and length and takes a pool
    /// extent for the value. `None`: `skip_existing` and the key is there.
    pub(crate) fn begin_put(
        &self,
        ns: &Namespace,
        key: &[u8],
        len: u64,
        options: &PutOptions,
    ) -> Result<Option<ReceivingValue>> {
        self.check_open()?;
        validate_key(key)?;
        // The manifest key is reserved: whatever writes under it (DESCRIBE,
        // or an ordinary put naming it) writes at most a manifest's length,
        // so a census never reads more than that per namespace.
        if key == crate::key::MANIFEST_KEY && len > crate::key::MAX_MANIFEST_LEN as u64 {
            return Err(Error::invalid(format!(
                "the key {:?} is reserved for the namespace's manifest (DESCRIBE_NAMESPACE, at \
                 most {} bytes), not a {len}-byte value",
                String::from_utf8_lossy(crate::key::MANIFEST_KEY),
                crate::key::MAX_MANIFEST_LEN
            )));
        }
        if len == 0 {
            return Err(Error::invalid(format!(
                "value is empty: values are 1 to {} bytes",
                self.config.max_value_size
            )));
        }
        if len > self.config.max_value_size {
            return Err(Error::invalid(format!(
                "value is {len} bytes: the max value size is {} bytes",
                self.config.max_value_size
            )));
        }
        let to_disk = options.tier == PutTier::MemoryAndDisk && self.writes_below;
        let limit = self.max_put_len;
        if len > limit {
            return Err(Error::no_space(format!(
                "value is {len} bytes but at most {limit} fit (memory capacity {}, disk capacity {})",
                self.config.memory_capacity, self.config.disk_capacity
            )));
        }
        let digest = ns.digest(key);
        if options.skip_existing && self.index.lock(digest).get(digest).is_some() {
            return Ok(None);
        }
        let slot = self.allocate_slot(len as usize, digest, ns)?;
        Ok(Some(ReceivingValue {
            digest,
            slot,
            checksum: to_disk.then(|| ValueChecksum::new(digest)),
        }))
    }

    /// The second half of a put: the filled value enters the index, the
    /// eviction queues and (write-through) the flusher's queue. Returns its
    /// sequence number.
    pub(crate) fn commit_put(
        &self,
        ns: &Namespace,
        key: &[u8],
        put: ReceivingValue,
    ) -> Result<u64> {
        let ReceivingValue {
            digest,
            mut slot,
            checksum,
        } = put;
        let to_disk = checksum.is_some();
        let checksum = checksum.map_or(0, |c| c.finish());
        // The page padding goes to disk with the value and comes back with
        // direct reads: it must not hold an earlier value's bytes.
        slot.zero_padding();
        let slot = Arc::new(slot);
        if !to_disk {
            slot.set_evictable();
        }
        let value_len = slot.len();
        let mut replaced = None;
        let seq = self.log.append(|seq| {
            replaced = self.index.lock(digest).insert(
                digest,
                Entry::new(seq, 0, Some(Arc::clone(&slot)), None, value_len as u32),
            );
            to_disk.then(|| QueuedWrite::Put {
                digest,
                key: ns.qualify(key),
                seq,
                slot: Arc::clone(&slot),
                checksum,
            })
        })?;
        crate::fail::fail_point!("put-indexed");
        // Freed outside the queue lock.
        drop(replaced);
        self.timed(|| self.eviction.lock().unwrap().insert(&slot));
        Counters::add(&self.counters.puts, 1);
        if !to_disk && key != crate::key::MANIFEST_KEY {
            // Durable only in memory: it can be served from now on. A
            // write-through value is announced by the flusher, once on disk.
            // (A namespace's manifest is not a KV block: never announced.)
            self.emit(|| BlockEvent::Stored {
                medium: Medium::Memory,
                digest,
                qualified: QualifiedKey::of(ns, key),
            });
        }
        if to_disk && self.config.flush == FlushPolicy::WriteThrough {
            self.wake_flusher(false);
        }
        Ok(seq)
    }

    /// An extent for `len` bytes: evicts what may be evicted, then waits
    /// (up to `put_wait`) for the flusher to make more evictable.
    pub(super) fn allocate_slot(
        &self,
        len: usize,
        digest: KeyDigest,
        ns: &Namespace,
    ) -> Result<PoolSlot> {
        let deadline = Instant::now() + self.config.put_wait;
        loop {
            if let Some(slot) = self.pool.try_allocate(len, digest, ns.prefix_shared()) {
                return Ok(slot);
            }
            if self.evict_one() {
                continue;
            }
            let now = Instant::now();
            if !self.writes_below || now >= deadline {
                return Err(Error::no_space(format!(
                    "memory pool has no room for {len} bytes: {} of {} bytes in use, none of it \
                     evictable{}",
                    self.pool.capacity() - self.pool.free_bytes(),
                    self.pool.capacity(),
                    if self.writes_below {
                        format!(" after waiting {:?} for the flusher", self.config.put_wait)
                    } else {
                        String::new()
                    }
                )));
            }
            self.wake_flusher(true);
            self.log
                .wait_progress((deadline - now).min(Duration::from_millis(10)));
        }
    }

    /// Drops one memory value the policy picks. Returns false when nothing
    /// in the pool may be dropped right now.
    pub(super) fn evict_one(&self) -> bool {
        let mut queues = self.eviction.lock().unwrap();
        let Some(slot) = self.timed(|| queues.next_victim()) else {
            return false;
        };
        let digest = slot.digest();
        let mut shard = self.index.lock(digest);
        if shard.drop_mem(digest, &slot) {
            Counters::add(&self.counters.evictions, 1);
            if shard.get(digest).is_none() {
                // Its last copy: this node no longer holds the block.
                self.emit(|| BlockEvent::Removed {
                    medium: Medium::Memory,
                    digest,
                });
            }
        }
        drop(shard);
        drop(queues);
        drop(slot);
        true
    }

    pub(super) fn remove(&self, ns: &Namespace, key: &[u8]) -> Result<bool> {
        self.check_open()?;
        validate_key(key)?;
        let digest = ns.digest(key);
        let mut removed = None;
        let seq = self.log.append(|seq| {
            let mut shard = self.index.lock(digest);
            removed = shard.remove(digest);
            if let Some(follower) = &self.follower {
                // Under the shard lock: another writer's older put of this
                // key, read from now on, is not indexed.
                follower.note_removal(digest, seq);
            }
            drop(shard);
            // Logged even for a key the index does not know: an older
            // durable value may still lie on disk (replaced by a
            // memory-only put that was then evicted) and must not come
            // back after a restart.
            self.writes_below.then(|| QueuedWrite::Tombstone {
                digest,
                key: ns.qualify(key),
                seq,
            })
        })?;
        let was_present = removed.is_some();
        let medium = match &removed {
            Some(entry) if entry.disk().is_some() => Medium::Storage,
            _ => Medium::Memory,
        };
        drop(removed);
        if was_present {
            Counters::add(&self.counters.removes, 1);
        }
        if self.writes_below {
            self.wait_durable(seq, seq)?;
        }
        if was_present {
            // After the removal is durable: announced, it holds.
            self.emit(|| BlockEvent::Removed { medium, digest });
        }
        Ok(was_present)
    }

    /// Hands an event to the configured sink; builds none without one.
    pub(super) fn emit(&self, event: impl FnOnce() -> BlockEvent) {
        if let Some(sink) = &self.config.events {
            sink.emit(event());
        }
    }

    /// Queues a tombstone for a qualified key the index no longer holds
    /// (one the tail scrub found lost); returns its sequence number, for
    /// `wait_durable`.
    pub(super) fn log_removal(&self, digest: KeyDigest, key: Box<[u8]>) -> Result<u64> {
        self.log
            .append(|seq| Some(QueuedWrite::Tombstone { digest, key, seq }))
    }
}

/// Bytes a put copies before adding them to the value's checksum: small
/// enough to still be in the core's cache when hashed.
const COPY_CHUNK: usize = 64 << 10;

/// A value between [`Inner::begin_put`] and [`Inner::commit_put`]: its
/// pool extent, filled a cache-sized chunk at a time.
#[derive(Debug)]
pub struct ReceivingValue {
    digest: KeyDigest,
    slot: PoolSlot,
    /// A write-through value's checksum, taken as each chunk lands, while
    /// the chunk is still in cache.
    checksum: Option<ValueChecksum>,
}

impl ReceivingValue {
    pub fn len(&self) -> usize {
        self.slot.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slot.is_empty()
    }

    /// Whether the value is hashed as it lands (write-through values).
    pub(crate) fn hashed(&self) -> bool {
        self.checksum.is_some()
    }

    /// Fills the value front to back: `read` is given each chunk (at most
    /// 64 KiB) in order and must fill it whole.
    pub fn fill(
        &mut self,
        read: impl FnMut(&mut [u8]) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        self.fill_in(COPY_CHUNK, read)
    }

    /// `fill` in chunks of at most `chunk_len` bytes (a value that is not
    /// hashed may be filled in one piece).
    pub(crate) fn fill_in(
        &mut self,
        chunk_len: usize,
        mut read: impl FnMut(&mut [u8]) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        let chunk_len = if self.hashed() {
            COPY_CHUNK
        } else {
            chunk_len.max(1)
        };
        for chunk in self.slot.bytes_mut().chunks_mut(chunk_len) {
            read(chunk)?;
            if let Some(checksum) = &mut self.checksum {
                checksum.update(chunk);
            }
        }
        Ok(())
    }
}
