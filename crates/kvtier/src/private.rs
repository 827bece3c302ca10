//! Private at rest: the data directory and everything in it belong to the
//! store's user alone, whatever the umask it was started with. Directories
//! are created 0700 and files 0600; a directory another user owns, or one
//! group or others may write, is refused (they could plant or replace
//! files in it); secrets are opened without following a link and checked
//! on the open descriptor, so what is checked is what is read.

use std::fs::{DirBuilder, File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// Mode of every directory the store creates.
pub const DIR_MODE: u32 = 0o700;
/// Mode of every file the store creates.
pub const FILE_MODE: u32 = 0o600;

fn refuse(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::PermissionDenied, message)
}

fn euid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// Creates `path` and any missing parents with mode 0700 (existing ones
/// are left as they are; `check_dir` judges the data directory itself).
pub fn create_dir(path: &Path) -> io::Result<()> {
    DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(path)
}

/// Checks that `path` is a directory this user owns and that nobody else
/// may write; takes away read and search rights of group and others if it
/// has them (returns whether it did). A refusal says what to change.
pub fn check_dir(path: &Path) -> io::Result<bool> {
    let meta = std::fs::metadata(path)?;
    if !meta.is_dir() {
        return Err(refuse(format!("{} is not a directory", path.display())));
    }
    check_owner(
        path,
        &meta,
        ": another user could read the cached values or plant files in it. Use a \
         directory of your own (or chown it)",
    )?;
    let mode = meta.mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Err(refuse(format!(
            "{} may be written by group or others (mode {mode:o}): they could plant or \
             replace its files. chmod 700 it",
            path.display()
        )));
    }
    make_private(path, &meta)
}

/// Refuses `path` unless this process's user owns it; `advice` ends the
/// message.
fn check_owner(path: &Path, meta: &std::fs::Metadata, advice: &str) -> io::Result<()> {
    if meta.uid() == euid() {
        return Ok(());
    }
    Err(refuse(format!(
        "{} is owned by uid {}, not by this process's uid {}{advice}",
        path.display(),
        meta.uid(),
        euid()
    )))
}

/// Takes group and other rights away from the directory `path` (mode
/// 0700) if it has any; returns whether it had.
fn make_private(path: &Path, meta: &std::fs::Metadata) -> io::Result<bool> {
    if meta.mode() & 0o077 == 0 {
        return Ok(false);
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(DIR_MODE))?;
    Ok(true)
}

/// Takes group and other rights away from the directory `path` (which
/// must be this user's: it lies inside a directory `check_dir` accepted);
/// returns whether it had any. For folders inside a private root that an
/// earlier release created with the umask's modes.
pub fn tighten_dir(path: &Path) -> io::Result<bool> {
    let meta = std::fs::symlink_metadata(path)?;
    if !meta.is_dir() {
        return Err(refuse(format!("{} is not a directory", path.display())));
    }
    check_owner(path, &meta, ": chown it")?;
    make_private(path, &meta)
}

/// Opens the secret `path` for reading: never through a symbolic link,
/// and only a regular file this user owns that group and others cannot
/// read or write (checked on the open descriptor).
pub fn open_secret(path: &Path) -> io::Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| {
            if e.raw_os_error() == Some(libc::ELOOP) {
                refuse(format!(
                    "{} is a symbolic link: a secret is read only from a regular file of \
                     its own",
                    path.display()
                ))
            } else {
                e
            }
        })?;
    let meta = file.metadata()?;
    if !meta.file_type().is_file() {
        return Err(refuse(format!("{} is not a regular file", path.display())));
    }
    check_owner(path, &meta, "")?;
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(refuse(format!(
            "{} is open to other users (mode {mode:o}): chmod 600 it",
            path.display()
        )));
    }
    Ok(file)
}

/// Opens a file another process may have planted (a shared directory's
/// other writers' files) with `options` plus `extra_flags`: never through
/// a symbolic link, never blocking in `open` (a FIFO named as a region or a
/// checkpoint used to hang every starting node), and only a regular file,
/// checked on the open descriptor; blocking mode is restored after.
pub fn open_untrusted(path: &Path, options: &OpenOptions, extra_flags: i32) -> io::Result<File> {
    let mut options = options.clone();
    options.custom_flags(extra_flags | libc::O_NONBLOCK | libc::O_NOFOLLOW | libc::O_CLOEXEC);
    let file = options.open(path)?;
    if !file.metadata()?.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} is not a regular file", path.display()),
        ));
    }
    let flags = rustix::fs::fcntl_getfl(&file)?;
    rustix::fs::fcntl_setfl(&file, flags - rustix::fs::OFlags::NONBLOCK)?;
    Ok(file)
}

/// Checks the directory a Unix socket is bound in: another user who may
/// write there could remove the socket and bind one of their own in its
/// place. Owned by this user or root, and not writable by group or others
/// unless sticky (as /tmp is: there only a file's owner may remove it).
pub fn check_socket_dir(dir: &Path) -> io::Result<()> {
    let meta = std::fs::metadata(dir)?;
    let mode = meta.mode() & 0o7777;
    if meta.uid() != euid() && meta.uid() != 0 {
        return Err(refuse(format!(
            "the socket's directory {} is owned by uid {}: its owner could replace the \
             socket. Put the socket in a directory of your own",
            dir.display(),
            meta.uid()
        )));
    }
    if mode & 0o022 != 0 && mode & 0o1000 == 0 {
        return Err(refuse(format!(
            "the socket's directory {} may be written by group or others and is not \
             sticky (mode {mode:o}): another user could replace the socket. Put it in a \
             directory only you can write",
            dir.display()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directories_are_created_private_and_checked() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("a/b");
        create_dir(&dir).unwrap();
        let mode = std::fs::metadata(&dir).unwrap().mode() & 0o777;
        assert_eq!(mode & 0o077, 0, "{mode:o}");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(check_dir(&dir).unwrap(), "read rights are taken away");
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
        assert!(!check_dir(&dir).unwrap());
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = check_dir(&dir).unwrap_err();
        assert!(e.to_string().contains("written by group or others"), "{e}");
    }

    #[test]
    fn folders_inside_a_private_root_are_tightened_whatever_their_mode() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("nodes");
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(tighten_dir(&dir).unwrap());
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
        assert!(!tighten_dir(&dir).unwrap(), "nothing left to take away");
        let file = root.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        assert!(tighten_dir(&file).is_err(), "a file is not a folder");
    }

    #[test]
    fn untrusted_files_are_regular_files_opened_without_blocking_or_links() {
        let dir = tempfile::tempdir().unwrap();
        let mut read = OpenOptions::new();
        read.read(true);
        let file = dir.path().join("region");
        std::fs::write(&file, b"bytes").unwrap();
        let opened = open_untrusted(&file, &read, 0).unwrap();
        let flags = rustix::fs::fcntl_getfl(&opened).unwrap();
        assert!(
            !flags.contains(rustix::fs::OFlags::NONBLOCK),
            "blocking again"
        );
        // A FIFO nobody writes: refused at once, not a hang.
        let fifo = dir.path().join("fifo");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        let e = open_untrusted(&fifo, &read, 0).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        assert!(open_untrusted(&link, &read, 0).is_err(), "no links");
        assert!(
            open_untrusted(dir.path(), &read, 0).is_err(),
            "no directories"
        );
    }

    #[test]
    fn secrets_are_never_read_through_links_or_when_open_to_others() {
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("secret");
        std::fs::write(&secret, b"s").unwrap();
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
        open_secret(&secret).unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&secret, &link).unwrap();
        let e = open_secret(&link).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o640)).unwrap();
        let e = open_secret(&secret).unwrap_err();
        assert!(e.to_string().contains("chmod 600"), "{e}");
        let e = open_secret(dir.path()).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
    }

    #[test]
    fn a_socket_directory_others_may_write_is_refused_unless_sticky() {
        let dir = tempfile::tempdir().unwrap();
        check_socket_dir(dir.path()).unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(check_socket_dir(dir.path()).is_err());
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
        check_socket_dir(dir.path()).unwrap();
    }
}
