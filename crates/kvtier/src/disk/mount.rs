//! What the disk tier knows about the file system a region file lives on:
//! whether a read of it can stall for as long as a server elsewhere is
//! gone (docs/design.md, "Deadlines on storage I/O"), and which read mode
//! it serves best (docs/design.md, "Read modes per mount").
//!
//! A read of a local disk ends: the block layer times out and fails a
//! request a device does not answer. A read of a network or FUSE file
//! system waits on another process or host (a FUSE daemon stopped or out
//! of memory, an NFS server gone), as long as it is gone; hard NFS mounts
//! and FUSE wait for ever. Those are the reads the store bounds.

use crate::config::SharedReadMode;
use std::fs::File;

/// `statfs` magic numbers (`linux/magic.h` and the file systems' own
/// headers) of file systems whose reads wait on a daemon or a remote host.
const MAY_STALL: &[u64] = &[
    0x6573_5546, // FUSE: JuiceFS, 3FS's FUSE client, s3fs, sshfs, ...
    0x0000_6969, // nfs
    0x0000_517b, // smb
    0xff53_4d42, // cifs
    0xfe53_4d42, // smb2
    0x00c3_6400, // ceph
    0x0bd0_0bd0, // lustre
    0x4750_4653, // gpfs
    0x0102_1997, // 9p
    0x5346_414f, // afs
    0x6b41_4653, // kAFS
    0x2003_0528, // orangefs
    0x7461_636f, // ocfs2
    0x0116_1970, // gfs2
];

/// Whether reads of `file` may stall on another process or host; `false`
/// for a local file system (or when `fstatfs` fails: the caller then
/// treats it as local, its reads as they always were).
pub(crate) fn may_stall(file: &File) -> bool {
    rustix::fs::fstatfs(file).is_ok_and(|stat| stall_prone(&stat))
}

/// `may_stall` of the file system holding `path`.
pub(crate) fn may_stall_at(path: &std::path::Path) -> bool {
    rustix::fs::statfs(path).is_ok_and(|stat| stall_prone(&stat))
}

fn stall_prone(stat: &rustix::fs::StatFs) -> bool {
    // `f_type` is signed on some targets; the magic numbers are 32-bit.
    MAY_STALL.contains(&((stat.f_type as u64) & 0xffff_ffff))
}

/// How a region file is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReadMode {
    /// O_DIRECT straight from the device (or the remote file system's
    /// direct path) into the destination: no page cache.
    #[default]
    Direct,
    /// Through the page cache, with sequential readahead.
    Buffered,
}

/// The read mode for `file` under `choice`. Auto: buffered on the file
/// systems whose reads go to a daemon or a remote host (`MAY_STALL`:
/// FUSE, NFS, CephFS, Lustre, ...), whose O_DIRECT path sends a value to
/// the server in small requests one after another (JuiceFS: 128 KiB FUSE
/// reads) where the page cache's readahead sends large ones ahead of the
/// reader and keeps what was read for the next get; direct on local
/// disks, where O_DIRECT at depth is the device's best and the page cache
/// would only copy. Values read from disk never enter the memory pool, so
/// a buffered read caches nothing twice.
pub(crate) fn read_mode(file: &File, choice: SharedReadMode) -> ReadMode {
    match choice {
        SharedReadMode::Direct => ReadMode::Direct,
        SharedReadMode::Buffered => ReadMode::Buffered,
        SharedReadMode::Auto if may_stall(file) => ReadMode::Buffered,
        SharedReadMode::Auto => ReadMode::Direct,
    }
}

/// Turns O_DIRECT on for an open file; `false` (the file stays buffered)
/// where its file system refuses it.
pub(crate) fn set_direct(file: &File) -> bool {
    use rustix::fs::{fcntl_getfl, fcntl_setfl, OFlags};
    fcntl_getfl(file)
        .and_then(|flags| fcntl_setfl(file, flags | OFlags::DIRECT))
        .is_ok()
}

/// Asks the kernel for sequential readahead on a buffered file (values are
/// read whole, front to back). A hint: its failure changes nothing read.
pub(crate) fn advise_sequential(file: &File) {
    let _ = rustix::fs::fadvise(file, 0, None, rustix::fs::Advice::Sequential);
}

/// Drops the page cache's copy of `len` bytes at `offset` of a buffered
/// file, so the next read asks the file system again. Another writer
/// appends to its files while this node reads them: a page read (by the
/// follower's scan, or by readahead past a value) before its writer's
/// bytes landed stays cached as it was, and a network or FUSE file system
/// need not invalidate it when another client writes. A hint that cannot
/// fail a read: at worst the stale copy stays and the value misses.
pub(crate) fn drop_cached(file: &File, offset: u64, len: u64) {
    if let Some(len) = std::num::NonZeroU64::new(len) {
        let _ = rustix::fs::fadvise(file, offset, Some(len), rustix::fs::Advice::DontNeed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The test's own temporary directory is on a local file system here
    /// (ext4 or tmpfs); a FUSE mount's magic is in the table.
    #[test]
    fn local_files_are_not_stall_prone() {
        let file = tempfile::tempfile().unwrap();
        let stat = rustix::fs::fstatfs(&file).unwrap();
        let magic = (stat.f_type as u64) & 0xffff_ffff;
        assert!(
            !may_stall(&file),
            "temporary files live on file system 0x{magic:x} here"
        );
        assert!(MAY_STALL.contains(&0x6573_5546), "FUSE");
    }

    #[test]
    fn the_read_mode_follows_the_mount_unless_told() {
        let file = tempfile::tempfile().unwrap();
        assert_eq!(read_mode(&file, SharedReadMode::Auto), ReadMode::Direct);
        assert_eq!(
            read_mode(&file, SharedReadMode::Buffered),
            ReadMode::Buffered
        );
        assert_eq!(read_mode(&file, SharedReadMode::Direct), ReadMode::Direct);
        for (text, mode) in [
            ("auto", SharedReadMode::Auto),
            ("direct", SharedReadMode::Direct),
            ("buffered", SharedReadMode::Buffered),
        ] {
            assert_eq!(SharedReadMode::parse(text).unwrap(), mode);
        }
        let err = SharedReadMode::parse("cached").unwrap_err();
        assert!(
            err.to_string().contains("auto, direct or buffered"),
            "{err}"
        );
        // Hints never fail a read: on a file without a page cache copy, or
        // past its end, they are no-ops.
        drop_cached(&file, 0, 4096);
        drop_cached(&file, 1 << 40, 0);
        advise_sequential(&file);
    }
}
