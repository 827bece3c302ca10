//! A region log in a temporary directory for the disk tier's unit tests:
//! opened by `DiskTier::open` as the store opens it, written by the
//! tier's own writer, with batches built the way the flusher builds them.

use super::format::{RecordEntry, RecordKind};
use super::{DiskTier, RecoveredEntry, RecoveryChecks, RecoveryReport};
use crate::config::{Config, IoEngineKind};
use crate::disk::DiskLoc;
use crate::error::Result;
use crate::io::AlignedBuf;
use crate::key::{value_checksum, KeySecret, KEY_SECRET_LEN};
use crate::tier::PendingBatch;
use crate::units::page_round_up;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub(super) const NODE: &str = "0123456789abcdef0123456789abcdef";

pub(super) struct TestLog {
    pub dir: tempfile::TempDir,
    pub config: Config,
    pub secret: Arc<KeySecret>,
}

/// One write of a test batch: a put of `len` bytes of `fill`, or a
/// tombstone (`len` `None`).
pub(super) struct Item<'a> {
    pub key: &'a [u8],
    pub seq: u64,
    pub len: Option<usize>,
    pub fill: u8,
}

pub(super) fn put(key: &[u8], seq: u64, len: usize, fill: u8) -> Item<'_> {
    Item {
        key,
        seq,
        len: Some(len),
        fill,
    }
}

pub(super) fn tombstone(key: &[u8], seq: u64) -> Item<'_> {
    Item {
        key,
        seq,
        len: None,
        fill: 0,
    }
}

/// A qualified key in the default namespace (a zero length byte).
pub(super) fn qualified(key: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8];
    out.extend_from_slice(key);
    out
}

impl TestLog {
    /// A log with regions of `region_size` bytes, psync I/O (so the tests
    /// run where io_uring is off too) and O_DIRECT where the file system
    /// takes it.
    pub fn new(region_size: u64) -> TestLog {
        let dir = tempfile::tempdir().unwrap();
        let config = Config::new(dir.path())
            .disk_capacity(1 << 30)
            .region_size(region_size);
        let config = Config {
            io_engine: IoEngineKind::Psync,
            ..config
        };
        TestLog {
            dir,
            config,
            secret: Arc::new(KeySecret::from_bytes([7; KEY_SECRET_LEN])),
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn regions_dir(&self) -> PathBuf {
        self.path().join(super::REGION_DIR)
    }

    /// Opens the log; every recovered entry in the order applied.
    pub fn open(&self, checks: RecoveryChecks) -> (DiskTier, Vec<RecoveredEntry>, RecoveryReport) {
        self.try_open(&self.secret, checks).unwrap()
    }

    pub fn try_open(
        &self,
        secret: &Arc<KeySecret>,
        checks: RecoveryChecks,
    ) -> Result<(DiskTier, Vec<RecoveredEntry>, RecoveryReport)> {
        let mut applied = Vec::new();
        let (tier, report) = DiskTier::open(
            &self.config,
            self.path(),
            Arc::clone(secret),
            NODE,
            checks,
            |entry| applied.push(entry),
        )?;
        Ok((tier, applied, report))
    }

    /// Writes `items` as one batch; the locations of its puts.
    pub fn write(&self, tier: &DiskTier, items: &[Item<'_>]) -> Result<Vec<DiskLoc>> {
        let buffers: Vec<AlignedBuf> = items
            .iter()
            .filter_map(|item| {
                let len = item.len?;
                let mut buf = AlignedBuf::zeroed(page_round_up(len.max(1) as u64) as usize);
                buf.as_mut_slice()[..len].fill(item.fill);
                Some(buf)
            })
            .collect();
        let mut batch = PendingBatch::default();
        let mut values = buffers.iter();
        for item in items {
            let key = qualified(item.key);
            let digest = self.secret.digest_qualified(&key);
            match item.len {
                Some(len) => {
                    let buf = values.next().unwrap();
                    batch.entries.push(RecordEntry {
                        kind: RecordKind::Put,
                        seq: item.seq,
                        digest,
                        value_offset: 0,
                        value_len: len as u32,
                        checksum: value_checksum(digest, &buf.as_slice()[..len]),
                        key,
                    });
                    batch.values.push(buf.as_slice());
                }
                None => batch.entries.push(RecordEntry {
                    kind: RecordKind::Tombstone,
                    seq: item.seq,
                    digest,
                    value_offset: 0,
                    value_len: 0,
                    checksum: 0,
                    key,
                }),
            }
        }
        let first_seq = items.iter().map(|i| i.seq).min().unwrap_or(1);
        tier.write_batch(&mut batch, first_seq)
    }

    /// The region files' paths, by region id (parsed from their names).
    pub fn region_files(&self) -> Vec<(u32, PathBuf)> {
        let mut files: Vec<(u32, PathBuf)> = std::fs::read_dir(self.regions_dir())
            .unwrap()
            .map(|item| item.unwrap().path())
            .filter_map(|path| {
                let name = path.file_name()?.to_string_lossy().into_owned();
                Some((super::parse_region_name(&name)?.id, path))
            })
            .collect();
        files.sort();
        files
    }
}

/// The keys (without the namespace byte) and sequences of `entries`.
pub(super) fn keys_and_seqs(entries: &[RecoveredEntry]) -> Vec<(Vec<u8>, u64)> {
    entries
        .iter()
        .map(|e| (e.entry.key[1..].to_vec(), e.entry.seq))
        .collect()
}
