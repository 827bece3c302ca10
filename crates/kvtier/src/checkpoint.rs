//! Index checkpoints (docs/design.md, "Index checkpoints"): a log's live
//! entries and removals up to a point of it, in one file. A node starting
//! beside another writer's large log in a shared directory loads that
//! writer's newest checkpoint and reads only the records after it; a store
//! reopening its own log after a clean close loads the checkpoint it wrote
//! at that close and reads no record at all ("Local index checkpoints").
//! Authenticated with a MAC keyed by the directory's secret: only a holder
//! of the secret can make one that is read.
//!
//! Layout (little endian): a 32-byte header, the covered regions, the
//! entries, the removals, a 32-byte footer of counts, a 32-byte MAC.

use crate::disk::format::{u32_at, u64_at};
use crate::disk::{DiskTier, OTHERS_BASE};
use crate::error::{Error, Result};
use crate::index::Index;
use crate::key::{KeyDigest, KeySecret};
use crate::write_log::WriteLog;
use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, Read, Seek, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const CHECKPOINT_DIR: &str = "checkpoints";
const MAGIC: &[u8; 8] = b"KVTCKPT1";
const VERSION: u32 = 1;
const HEADER_LEN: usize = 32;
const REGION_LEN: usize = 24;
const ENTRY_LEN: usize = 48;
const TOMBSTONE_LEN: usize = 24;
const FOOTER_LEN: usize = 32;
const MAC_LEN: usize = 32;
const SUFFIX: &str = ".kvc";
/// Context of the MAC's key: a checkpoint never verifies as anything else
/// keyed with the secret.
const MAC_CONTEXT: &[u8] = b"kvtier index checkpoint v1\0";
/// Checkpoints larger than this are not read (a damaged or hostile length
/// must not make a node allocate without bound): 2^26 entries of 48 bytes
/// and room to spare.
pub const MAX_CHECKPOINT_BYTES: u64 = 8 << 30;

/// A region the checkpoint covers, up to `covered` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CoveredRegion {
    pub id: u32,
    pub incarnation: u64,
    pub covered: u64,
}

/// A put the checkpoint names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointEntry {
    pub digest: KeyDigest,
    pub seq: u64,
    pub checksum: u64,
    pub region: u32,
    pub page: u32,
    pub len: u32,
}

/// A loaded checkpoint.
#[derive(Debug, Default)]
pub struct Checkpoint {
    pub seq: u64,
    pub regions: Vec<CoveredRegion>,
    pub entries: Vec<CheckpointEntry>,
    pub tombstones: Vec<(KeyDigest, u64)>,
}

/// Who writes a checkpoint and what it covers besides its entries.
pub struct CheckpointOf<'a> {
    pub node: &'a str,
    /// The writer's open (in the file's name, so two opens never collide).
    pub incarnation: u64,
    /// The highest sequence number the log had handed out.
    pub seq: u64,
    pub regions: &'a [CoveredRegion],
    pub tombstones: &'a [(KeyDigest, u64)],
}

/// Writes a checkpoint into `dir` (its writer directory's `checkpoints/`):
/// regions and removals given whole, entries streamed by `entries` (which
/// calls its sink once per entry). The file appears whole under its final
/// name or not at all (a synced temporary file renamed, the directory
/// synced), and older checkpoints of the writer are removed after.
/// Returns the path.
pub fn write(
    dir: &Path,
    secret: &KeySecret,
    of: &CheckpointOf<'_>,
    entries: impl FnOnce(&mut dyn FnMut(CheckpointEntry)),
) -> Result<PathBuf> {
    let CheckpointOf {
        node,
        incarnation,
        seq,
        regions,
        tombstones,
    } = *of;
    crate::private::create_dir(dir)
        .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    let name = format!("{node}-{incarnation:016x}-{seq:016x}{SUFFIX}");
    let path = dir.join(&name);
    let tmp = dir.join(format!(".{name}.tmp"));
    let _ = fs::remove_file(&tmp);
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(crate::private::FILE_MODE)
        .open(&tmp)
        .map_err(|e| Error::io(format!("creating {}", tmp.display()), e))?;
    let mut out = MacWriter {
        inner: BufWriter::with_capacity(1 << 20, file),
        mac: mac_hasher(secret),
        error: None,
    };
    let mut header = [0u8; HEADER_LEN];
    header[..8].copy_from_slice(MAGIC);
    header[8..12].copy_from_slice(&VERSION.to_le_bytes());
    header[16..32].copy_from_slice(&node_bytes(node));
    out.put(&header);
    for r in regions {
        let mut b = [0u8; REGION_LEN];
        b[..4].copy_from_slice(&r.id.to_le_bytes());
        b[8..16].copy_from_slice(&r.incarnation.to_le_bytes());
        b[16..24].copy_from_slice(&r.covered.to_le_bytes());
        out.put(&b);
    }
    let mut count = 0u64;
    entries(&mut |e: CheckpointEntry| {
        let mut b = [0u8; ENTRY_LEN];
        b[..16].copy_from_slice(&e.digest.0.to_le_bytes());
        b[16..24].copy_from_slice(&e.seq.to_le_bytes());
        b[24..32].copy_from_slice(&e.checksum.to_le_bytes());
        b[32..36].copy_from_slice(&e.region.to_le_bytes());
        b[36..40].copy_from_slice(&e.page.to_le_bytes());
        b[40..44].copy_from_slice(&e.len.to_le_bytes());
        out.put(&b);
        count += 1;
    });
    for (digest, seq) in tombstones {
        let mut b = [0u8; TOMBSTONE_LEN];
        b[..16].copy_from_slice(&digest.0.to_le_bytes());
        b[16..24].copy_from_slice(&seq.to_le_bytes());
        out.put(&b);
    }
    let mut footer = [0u8; FOOTER_LEN];
    footer[..8].copy_from_slice(&seq.to_le_bytes());
    footer[8..16].copy_from_slice(&(regions.len() as u64).to_le_bytes());
    footer[16..24].copy_from_slice(&count.to_le_bytes());
    footer[24..32].copy_from_slice(&(tombstones.len() as u64).to_le_bytes());
    out.put(&footer);
    let mac = *out.mac.finalize().as_bytes();
    let MacWriter { inner, error, .. } = out;
    let finished = match error {
        Some(e) => Err(e),
        None => inner
            .into_inner()
            .map_err(|e| e.into_error())
            .and_then(|mut file| {
                file.write_all(&mac)?;
                file.sync_all()
            }),
    };
    if let Err(e) = finished.and_then(|()| fs::rename(&tmp, &path)) {
        let _ = fs::remove_file(&tmp);
        return Err(Error::io(format!("writing {}", path.display()), e));
    }
    crate::data_dir::sync_dir(dir)?;
    // Older checkpoints of this writer: the new one covers what they did.
    for (_, older) in list(dir, node).into_iter().filter(|(_, p)| *p != path) {
        let _ = fs::remove_file(older);
    }
    Ok(path)
}

/// `node`'s checkpoints in `dir`, oldest first, by the sequence number in
/// the name.
pub fn list(dir: &Path, node: &str) -> Vec<(u64, PathBuf)> {
    let Ok(listing) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut found: Vec<(u64, PathBuf)> = listing
        .flatten()
        .filter_map(|item| {
            let name = item.file_name().to_string_lossy().into_owned();
            let stem = name.strip_suffix(SUFFIX)?;
            let mut parts = stem.split('-');
            let (owner, _incarnation, seq) = (parts.next()?, parts.next()?, parts.next()?);
            if owner != node || parts.next().is_some() || seq.len() != 16 {
                return None;
            }
            Some((u64::from_str_radix(seq, 16).ok()?, item.path()))
        })
        .collect();
    found.sort();
    found
}

/// Checks the MAC of the `len`-byte checkpoint `file` (from its start) in
/// fixed pieces, allocating one piece.
fn verify_mac_streaming(
    file: &mut File,
    len: u64,
    secret: &KeySecret,
) -> std::result::Result<(), String> {
    const PIECE: usize = 1 << 20;
    let body_len = len - MAC_LEN as u64;
    let mut hasher = mac_hasher(secret);
    let mut piece = vec![0u8; PIECE];
    let mut left = body_len;
    while left > 0 {
        let n = usize::try_from(left.min(PIECE as u64)).expect("at most a piece");
        file.read_exact(&mut piece[..n])
            .map_err(|e| format!("changed while read ({e})"))?;
        hasher.update(&piece[..n]);
        left -= n as u64;
        crate::io::progress::note();
    }
    let mut mac = [0u8; MAC_LEN];
    file.read_exact(&mut mac)
        .map_err(|e| format!("changed while read ({e})"))?;
    if hasher.finalize() != blake3::Hash::from_bytes(mac) {
        return Err("its MAC does not verify under the directory's secret".into());
    }
    Ok(())
}

/// Reads and verifies a checkpoint of `node`. Any fault (length, MAC,
/// node, counts) is an error naming it; the caller then reads the log's
/// records instead.
pub fn read(
    path: &Path,
    node: &str,
    secret: &KeySecret,
) -> std::result::Result<Checkpoint, String> {
    // Planted files are hostile: no links, no blocking open (a FIFO hung
    // every starting node), regular files only.
    let mut options = OpenOptions::new();
    options.read(true);
    let mut file = crate::private::open_untrusted(path, &options, 0).map_err(|e| e.to_string())?;
    let len = file.metadata().map_err(|e| e.to_string())?.len();
    if len > MAX_CHECKPOINT_BYTES {
        return Err(format!(
            "{len} bytes, more than the {MAX_CHECKPOINT_BYTES} a checkpoint may hold"
        ));
    }
    let min = (HEADER_LEN + FOOTER_LEN + MAC_LEN) as u64;
    if len < min {
        return Err(format!("{len} bytes, shorter than an empty checkpoint"));
    }
    // The MAC first, streamed in fixed pieces: nothing is allocated from a
    // length in the file before the file proves it came from a node that
    // holds the secret (a sparse 1.5 GiB file cost each starting node 1.5
    // GiB of memory).
    verify_mac_streaming(&mut file, len, secret)?;
    file.seek(std::io::SeekFrom::Start(0))
        .map_err(|e| e.to_string())?;
    // In pieces, each a sign of progress to a follow pass waiting on it.
    let mut bytes = vec![0u8; len as usize];
    for piece in bytes.chunks_mut(1 << 20) {
        file.read_exact(piece)
            .map_err(|e| format!("changed while read ({e})"))?;
        crate::io::progress::note();
    }
    let (body, mac) = bytes.split_at(bytes.len() - MAC_LEN);
    let mut hasher = mac_hasher(secret);
    hasher.update(body);
    if hasher.finalize() != blake3::Hash::from_bytes(mac.try_into().expect("32 bytes")) {
        return Err("its MAC does not verify under the directory's secret".into());
    }
    if &body[..8] != MAGIC || u32_at(body, 8) != VERSION {
        return Err("not a version-1 checkpoint".into());
    }
    if body[16..32] != node_bytes(node) {
        return Err("it names another writer".into());
    }
    let footer = &body[body.len() - FOOTER_LEN..];
    let seq = u64_at(footer, 0);
    let counts = [u64_at(footer, 8), u64_at(footer, 16), u64_at(footer, 24)];
    let expected = [REGION_LEN, ENTRY_LEN, TOMBSTONE_LEN]
        .iter()
        .zip(counts)
        .try_fold((HEADER_LEN + FOOTER_LEN) as u64, |sum, (size, n)| {
            n.checked_mul(*size as u64).and_then(|b| sum.checked_add(b))
        });
    if expected != Some(body.len() as u64) {
        return Err("its counts do not match its length".into());
    }
    let mut at = HEADER_LEN;
    let mut take = |size: usize| {
        let piece = &body[at..at + size];
        at += size;
        piece
    };
    let mut checkpoint = Checkpoint {
        seq,
        ..Checkpoint::default()
    };
    for _ in 0..counts[0] {
        let b = take(REGION_LEN);
        checkpoint.regions.push(CoveredRegion {
            id: u32_at(b, 0),
            incarnation: u64_at(b, 8),
            covered: u64_at(b, 16),
        });
    }
    checkpoint.entries.reserve(counts[1] as usize);
    for _ in 0..counts[1] {
        let b = take(ENTRY_LEN);
        checkpoint.entries.push(CheckpointEntry {
            digest: KeyDigest(u128_at(b, 0)),
            seq: u64_at(b, 16),
            checksum: u64_at(b, 24),
            region: u32_at(b, 32),
            page: u32_at(b, 36),
            len: u32_at(b, 40),
        });
    }
    for _ in 0..counts[2] {
        let b = take(TOMBSTONE_LEN);
        checkpoint
            .tombstones
            .push((KeyDigest(u128_at(b, 0)), u64_at(b, 16)));
    }
    Ok(checkpoint)
}

fn mac_hasher(secret: &KeySecret) -> blake3::Hasher {
    let mut hasher = blake3::Hasher::new_keyed(secret.as_bytes());
    hasher.update(MAC_CONTEXT);
    hasher
}

/// A node id's 32 hex digits as 16 bytes (zeros for anything else).
/// A node id as the 16 bytes the header holds (zeros for a name that is
/// not one: no checkpoint names it).
fn node_bytes(node: &str) -> [u8; 16] {
    crate::disk::format::RecordOrigin::node_bytes(node).unwrap_or([0; 16])
}

/// Writes through a buffer while feeding the MAC; keeps the first error.
struct MacWriter {
    inner: BufWriter<File>,
    mac: blake3::Hasher,
    error: Option<std::io::Error>,
}

impl MacWriter {
    fn put(&mut self, bytes: &[u8]) {
        if self.error.is_some() {
            return;
        }
        self.mac.update(bytes);
        if let Err(e) = self.inner.write_all(bytes) {
            self.error = Some(e);
        }
    }
}

fn u128_at(b: &[u8], at: usize) -> u128 {
    u128::from_le_bytes(b[at..at + 16].try_into().expect("16 bytes"))
}

/// Writes this node's checkpoints: on the flusher's thread after a batch,
/// at most every `every` (and only when batches were written since), and
/// once more at a clean close. Built from the handles it reads.
/// Where a checkpoint writer learns this log's own removals: the shared
/// directory's follower keeps them (a callback, so the checkpoint sits
/// below the follower that reads checkpoints).
pub(crate) type OwnRemovals = Arc<dyn Fn() -> Vec<(KeyDigest, u64)> + Send + Sync>;

pub(crate) struct CheckpointWriter {
    dir: PathBuf,
    node: String,
    secret: Arc<KeySecret>,
    disk: Arc<DiskTier>,
    index: Arc<Index>,
    log: Arc<WriteLog>,
    /// This log's removals, as the shared directory's follower knows
    /// them; none for a local directory, whose checkpoints are read only
    /// when they match the log exactly (no record is read, so no removal
    /// is needed to hide an older put).
    own_removals: Option<OwnRemovals>,
    every: Duration,
    /// When the last checkpoint was written, and the batch count then.
    last: Mutex<(Instant, u64)>,
    batches: AtomicU64,
}

impl std::fmt::Debug for CheckpointWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckpointWriter")
            .field("dir", &self.dir)
            .finish()
    }
}

impl CheckpointWriter {
    #[expect(clippy::too_many_arguments, reason = "the handles it is built from")]
    pub fn new(
        writer_dir: &Path,
        node: &str,
        secret: Arc<KeySecret>,
        disk: Arc<DiskTier>,
        index: Arc<Index>,
        log: Arc<WriteLog>,
        own_removals: Option<OwnRemovals>,
        every: Duration,
    ) -> CheckpointWriter {
        CheckpointWriter {
            dir: writer_dir.join(CHECKPOINT_DIR),
            node: node.to_string(),
            secret,
            disk,
            index,
            log,
            own_removals,
            every,
            last: Mutex::new((Instant::now(), 0)),
            batches: AtomicU64::new(0),
        }
    }

    /// Called by the flusher after each batch it wrote.
    pub fn after_batch(&self) {
        let batches = self.batches.fetch_add(1, Ordering::Relaxed) + 1;
        let due = {
            let last = self.last.lock().unwrap();
            last.0.elapsed() >= self.every && batches > last.1
        };
        if due {
            if let Err(e) = self.write_now() {
                tracing::warn!(error = %e, "writing an index checkpoint failed; other nodes read this log's records instead");
            }
        }
    }

    /// Writes a checkpoint of this node's log now. Call only where no
    /// batch is being written (the flusher's thread, or after it stopped).
    pub fn write_now(&self) -> Result<PathBuf> {
        let batches = self.batches.load(Ordering::Relaxed);
        let regions: Vec<CoveredRegion> = self
            .disk
            .own_regions()
            .into_iter()
            .map(|(id, incarnation, covered)| CoveredRegion {
                id,
                incarnation,
                covered,
            })
            .collect();
        let tombstones = self
            .own_removals
            .as_ref()
            .map_or_else(Vec::new, |own_removals| own_removals());
        let seq = self.log.next_seq().saturating_sub(1);
        let started = Instant::now();
        let mut count = 0u64;
        let of = CheckpointOf {
            node: &self.node,
            incarnation: self.disk.incarnation(),
            seq,
            regions: &regions,
            tombstones: &tombstones,
        };
        let path = write(&self.dir, &self.secret, &of, |sink| {
            // Copied out a shard at a time: no shard lock is held while the
            // checkpoint file is written.
            self.index.visit_by_shard(
                |digest, entry| {
                    let loc = entry.disk()?;
                    (loc.region() < OTHERS_BASE).then(|| CheckpointEntry {
                        digest,
                        seq: entry.seq(),
                        checksum: entry.checksum(),
                        region: loc.region(),
                        page: loc.page(),
                        len: entry.value_len(),
                    })
                },
                |entries| {
                    count += entries.len() as u64;
                    for entry in entries {
                        sink(entry);
                    }
                },
            );
        })?;
        tracing::debug!(path = %path.display(), entries = count, tombstones = tombstones.len(), elapsed_ms = started.elapsed().as_millis() as u64, "wrote an index checkpoint");
        *self.last.lock().unwrap() = (Instant::now(), batches);
        Ok(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> (
        Vec<CoveredRegion>,
        Vec<CheckpointEntry>,
        Vec<(KeyDigest, u64)>,
    ) {
        let regions = vec![
            CoveredRegion {
                id: 3,
                incarnation: 77,
                covered: 8192,
            },
            CoveredRegion {
                id: 4,
                incarnation: 78,
                covered: 1 << 30,
            },
        ];
        let entries = (0..1000u32)
            .map(|i| CheckpointEntry {
                digest: KeyDigest(u128::from(i) * 0x9e37_79b9_7f4a_7c15),
                seq: u64::from(i) + 10,
                checksum: u64::from(i) ^ 0xabcdef,
                region: 3 + i % 2,
                page: i,
                len: 4096 + i,
            })
            .collect();
        let tombstones = vec![(KeyDigest(5), 99), (KeyDigest(6), 100)];
        (regions, entries, tombstones)
    }

    #[test]
    fn a_checkpoint_reads_back_as_written_and_replaces_older_ones() {
        let dir = tempfile::tempdir().unwrap();
        let secret = KeySecret::from_bytes([3; 32]);
        let node = "0123456789abcdef0123456789abcdef";
        let (regions, entries, tombstones) = sample();
        let write_one = |seq| {
            let of = CheckpointOf {
                node,
                incarnation: 1,
                seq,
                regions: &regions,
                tombstones: &tombstones,
            };
            write(dir.path(), &secret, &of, |sink| {
                for e in &entries {
                    sink(*e);
                }
            })
            .unwrap()
        };
        write_one(5);
        let path = write_one(9);
        assert_eq!(list(dir.path(), node), vec![(9, path.clone())]);
        let back = read(&path, node, &secret).unwrap();
        assert_eq!(back.seq, 9);
        assert_eq!(back.regions, regions);
        assert_eq!(back.entries, entries);
        assert_eq!(back.tombstones, tombstones);
        assert!(read(&path, "ffffffffffffffffffffffffffffffff", &secret).is_err());
        assert!(read(&path, node, &KeySecret::from_bytes([4; 32])).is_err());
    }

    #[test]
    fn any_flipped_byte_or_cut_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let secret = KeySecret::from_bytes([3; 32]);
        let node = "0123456789abcdef0123456789abcdef";
        let (regions, entries, tombstones) = sample();
        let of = CheckpointOf {
            node,
            incarnation: 1,
            seq: 1,
            regions: &regions,
            tombstones: &tombstones,
        };
        let path = write(dir.path(), &secret, &of, |sink| {
            for e in &entries {
                sink(*e);
            }
        })
        .unwrap();
        let good = fs::read(&path).unwrap();
        for at in (0..good.len()).step_by(97).chain([good.len() - 1]) {
            let mut bad = good.clone();
            bad[at] ^= 0x20;
            fs::write(&path, &bad).unwrap();
            assert!(read(&path, node, &secret).is_err(), "flip at {at} accepted");
        }
        for cut in [0, 10, good.len() / 2, good.len() - 1] {
            fs::write(&path, &good[..cut]).unwrap();
            assert!(read(&path, node, &secret).is_err(), "cut at {cut} accepted");
        }
    }
}
