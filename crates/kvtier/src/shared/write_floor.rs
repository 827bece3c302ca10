//! A writer's published write floor (docs/design.md, "The floor"): the
//! number below which it will write no record from now on. Puts it has
//! acknowledged but not yet written (an on-demand flush, a batch being
//! retried) are numbered at or above it, so the nodes that reclaim
//! removals keep every tombstone that may still shadow one of them.
//!
//! The file `nodes/<id>/write-floor`, 24 bytes, replaced whole (written
//! to a temporary name, then renamed):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | magic `KVTWFL01` |
//! | 8 | 8 | the floor, u64 little-endian |
//! | 16 | 8 | XXH3-64 of bytes 0..16, little-endian |
//!
//! Another writer's file is read as hostile: opened non-blocking without
//! following links, a regular file only, at most 64 bytes read; anything
//! else reads as no floor published (the reader then falls back to one
//! past that writer's newest number, which keeps more removals, never
//! fewer).

use crate::key::xxh3_64;
use crate::private;
use std::fs::{self, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// The file's name in a writer's directory.
pub const WRITE_FLOOR_FILE: &str = "write-floor";

const MAGIC: &[u8; 8] = b"KVTWFL01";
const LEN: usize = 24;

/// The file's bytes for `floor`.
fn encode(floor: u64) -> [u8; LEN] {
    let mut out = [0u8; LEN];
    out[..8].copy_from_slice(MAGIC);
    out[8..16].copy_from_slice(&floor.to_le_bytes());
    let sum = xxh3_64(&out[..16]);
    out[16..].copy_from_slice(&sum.to_le_bytes());
    out
}

/// The floor in `bytes`, if they are a whole, intact file.
fn decode(bytes: &[u8]) -> Option<u64> {
    if bytes.len() != LEN || &bytes[..8] != MAGIC {
        return None;
    }
    let sum = u64::from_le_bytes(bytes[16..24].try_into().ok()?);
    if sum != xxh3_64(&bytes[..16]) {
        return None;
    }
    Some(u64::from_le_bytes(bytes[8..16].try_into().ok()?))
}

/// Publishes `floor` in the writer directory `dir` (this node's own).
/// Not synced: the floor is a promise about the future of a running
/// writer; after a crash its unwritten puts are gone, and a restarted
/// writer numbers from its clock (docs/design.md says why that is safe).
pub fn publish(dir: &Path, floor: u64) -> io::Result<()> {
    let tmp = dir.join(format!(".{WRITE_FLOOR_FILE}.tmp"));
    let _ = fs::remove_file(&tmp);
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(private::FILE_MODE)
        .open(&tmp)?;
    file.write_all(&encode(floor))?;
    drop(file);
    fs::rename(&tmp, dir.join(WRITE_FLOOR_FILE))
}

/// The floor another writer published in its directory `dir`: `Ok(None)`
/// when there is no file or it is not an intact one (logged by the
/// caller's fallback), `Err` when the directory could not be read.
pub fn read(dir: &Path) -> io::Result<Option<u64>> {
    let path = dir.join(WRITE_FLOOR_FILE);
    let file = match private::open_untrusted(&path, OpenOptions::new().read(true), 0) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.kind() == io::ErrorKind::InvalidData => return Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut bytes = Vec::with_capacity(LEN);
    file.take(64).read_to_end(&mut bytes)?;
    Ok(decode(&bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_published_floor_reads_back_and_anything_else_reads_as_none() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read(dir.path()).unwrap(), None);
        publish(dir.path(), 1_700_000_000_000_000_000).unwrap();
        assert_eq!(read(dir.path()).unwrap(), Some(1_700_000_000_000_000_000));
        publish(dir.path(), 7).unwrap();
        assert_eq!(read(dir.path()).unwrap(), Some(7));

        let path = dir.path().join(WRITE_FLOOR_FILE);
        let good = fs::read(&path).unwrap();
        // Every single-byte change, a torn file, a longer one.
        for at in 0..LEN {
            let mut bad = good.clone();
            bad[at] ^= 0x40;
            fs::write(&path, &bad).unwrap();
            assert_eq!(read(dir.path()).unwrap(), None, "byte {at} flipped");
        }
        for len in [0, 8, 23, 25, 64, 4096] {
            let mut bad = good.clone();
            bad.resize(len, 0);
            fs::write(&path, &bad).unwrap();
            assert_eq!(read(dir.path()).unwrap(), None, "{len} bytes");
        }
        // A link or a directory in its place is not followed or read.
        fs::remove_file(&path).unwrap();
        let elsewhere = dir.path().join("elsewhere");
        fs::write(&elsewhere, good).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &path).unwrap();
        assert_eq!(read(dir.path()).unwrap(), None);
        fs::remove_file(&path).unwrap();
        fs::create_dir(&path).unwrap();
        assert_eq!(read(dir.path()).unwrap(), None);
        // A FIFO in its place neither hangs the reader nor reads.
        fs::remove_dir(&path).unwrap();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &path,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        assert_eq!(read(dir.path()).unwrap(), None);
    }
}
