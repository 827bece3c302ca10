//! What the disk tier knows about the file system a region file lives on:
//! whether a read of it can stall for as long as a server elsewhere is
//! gone (docs/design.md, "Deadlines on storage I/O").
//!
//! A read of a local disk ends: the block layer times out and fails a
//! request a device does not answer. A read of a network or FUSE file
//! system waits on another process or host (a FUSE daemon stopped or out
//! of memory, an NFS server gone), as long as it is gone; hard NFS mounts
//! and FUSE wait for ever. Those are the reads the store bounds.

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
}
