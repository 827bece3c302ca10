//! The data directory's identity: its format version, the secret every
//! key digest is keyed with, and the node id its region files are named
//! by (docs/design.md, "Data directory").
//!
//! A directory written by another format is refused with a message that
//! says what to do, never read with the wrong digests: a format-1 directory
//! (unkeyed digests, no namespaces) would otherwise have every record
//! rejected and, worse, look like a directory of damaged regions.

use crate::error::{Error, ErrorKind, Result};
use crate::key::{KeySecret, KEY_SECRET_LEN};
use crate::private::FILE_MODE;
use std::fs::{self, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// The format this build writes: 4, whose new batch records carry a MAC
/// binding them to their writer (docs/design.md, section 3.3). Format 3
/// (records without it, still read here) and format 2 (also without
/// `node-id`, region files named by id alone) are upgraded in place on
/// open; a build of format 3 refuses format 4 rather than take records it
/// cannot read for damage.
pub const DATA_DIR_FORMAT: u32 = 4;
pub const FORMAT_FILE: &str = "FORMAT";
pub const KEY_SECRET_FILE: &str = "key-secret";
pub const NODE_ID_FILE: &str = "node-id";
/// The secret's check value (`KeySecret::check_value`): a damaged or
/// swapped `key-secret` is refused by name instead of read as a directory
/// of damaged regions (which reclaim would then destroy).
pub const KEY_CHECK_FILE: &str = "key-check";

/// Who a data directory is: the key of its digests, and the node it makes
/// (stable for the directory's life; 32 lower-case hex digits).
#[derive(Debug)]
pub struct Identity {
    pub secret: KeySecret,
    pub node_id: String,
    /// Whether `key-check` confirmed the secret. Directories written
    /// before it existed have none: the store confirms the secret against
    /// their records instead, then writes it.
    pub confirmed: bool,
}
const FORMAT_PREFIX: &str = "kvtier data directory format ";

/// Checks the directory's format and returns its identity, creating it in
/// a directory that holds no data yet and upgrading a format-2 one. Call
/// with the directory locked.
pub fn open_or_create(dir: &Path, region_dir: &Path) -> Result<Identity> {
    let format_path = dir.join(FORMAT_FILE);
    match fs::read_to_string(&format_path) {
        Ok(text) => {
            let version = text
                .trim()
                .strip_prefix(FORMAT_PREFIX)
                .and_then(|v| v.parse::<u32>().ok());
            match version {
                Some(DATA_DIR_FORMAT) => {
                    let secret = read_secret(dir)?;
                    let confirmed = check_secret(dir, &secret)?;
                    Ok(Identity {
                    secret,
                    confirmed,
                    node_id: read_node_id(dir)?.ok_or_else(|| {
                        Error::new(
                            ErrorKind::Corruption,
                            format!(
                                "{} is missing: a format-{DATA_DIR_FORMAT} directory names its region \
                                 files by it; restore it",
                                dir.join(NODE_ID_FILE).display()
                            ),
                        )
                    })?,
                })
                }
                Some(2 | 3) => upgrade(dir),
                Some(other) => Err(Error::new(
                    ErrorKind::InvalidArgument,
                    format!(
                        "{} holds a kvtier data directory of format {other}; this kvtier reads \
                         format {DATA_DIR_FORMAT} only: open it with a matching kvtier, or move it \
                         aside and start with an empty directory",
                        dir.display()
                    ),
                )),
                None => Err(Error::new(
                    ErrorKind::Corruption,
                    format!(
                        "{} is not a kvtier format file (expected \"{FORMAT_PREFIX}N\"); refusing \
                         to guess how to read {}",
                        format_path.display(),
                        dir.display()
                    ),
                )),
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if holds_regions(region_dir)? {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    format!(
                        "{} holds region files but no {FORMAT_FILE} file: it was written by kvtier \
                         format 1 (unkeyed digests, no namespaces), which this kvtier does not \
                         read. Its blocks are a cache: move the directory aside (or delete its \
                         regions/ folder) and start empty",
                        dir.display()
                    ),
                ));
            }
            create(dir)
        }
        Err(e) => Err(Error::io(format!("reading {}", format_path.display()), e)),
    }
}

/// Format 2 or 3 to 4: a node id where format 2 had none (kept if an
/// interrupted upgrade left one), then the format line. A crash between
/// the two leaves the old format with a node id, which the next open
/// finishes upgrading. Region files named by id alone stay readable, as
/// do records without a MAC; new files carry the node id, new records
/// the MAC.
fn upgrade(dir: &Path) -> Result<Identity> {
    let secret = read_secret(dir)?;
    let node_id = match read_node_id(dir)? {
        Some(id) => id,
        None => {
            let id = new_node_id()?;
            write_synced(dir, NODE_ID_FILE, format!("{id}\n").as_bytes(), FILE_MODE)?;
            id
        }
    };
    let format = format!("{FORMAT_PREFIX}{DATA_DIR_FORMAT}\n");
    write_synced(dir, FORMAT_FILE, format.as_bytes(), FILE_MODE)?;
    sync_dir(dir)?;
    tracing::info!(dir = %dir.display(), node_id = %node_id, "upgraded the data directory to format {DATA_DIR_FORMAT}");
    let confirmed = check_secret(dir, &secret)?;
    Ok(Identity {
        secret,
        node_id,
        confirmed,
    })
}

/// The node id in `dir`, if the file exists; an error if it is not one.
pub(crate) fn read_node_id(dir: &Path) -> Result<Option<String>> {
    let path = dir.join(NODE_ID_FILE);
    match fs::read_to_string(&path) {
        Ok(text) => {
            let id = text.trim();
            if is_node_id(id) {
                Ok(Some(id.to_string()))
            } else {
                Err(Error::new(
                    ErrorKind::Corruption,
                    format!("{} does not hold a node id (32 hex digits)", path.display()),
                ))
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(format!("reading {}", path.display()), e)),
    }
}

/// Whether `key-check` confirms `secret`: `Ok(true)` if it does,
/// `Ok(false)` if the file is absent (older directories), an error naming
/// the file if it does not match or is damaged.
fn check_secret(dir: &Path, secret: &KeySecret) -> Result<bool> {
    let path = dir.join(KEY_CHECK_FILE);
    match fs::read_to_string(&path) {
        Ok(text) if text.trim() == secret.check_value() => Ok(true),
        Ok(_) => Err(Error::new(
            ErrorKind::Corruption,
            format!(
                "{} does not match {}: the key-secret is damaged or belongs to another \
                 directory, and every stored block would fail verification. Restore the \
                 right key-secret (nothing was changed)",
                path.display(),
                dir.join(KEY_SECRET_FILE).display()
            ),
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(Error::io(format!("reading {}", path.display()), e)),
    }
}

/// Writes `key-check` for `secret` (once the secret is known to be right);
/// the caller syncs the directory.
fn write_key_check_file(dir: &Path, secret: &KeySecret) -> Result<()> {
    let text = format!("{}\n", secret.check_value());
    write_synced(dir, KEY_CHECK_FILE, text.as_bytes(), FILE_MODE)
}

/// Writes `key-check` for `secret` and syncs the directory.
pub fn write_key_check(dir: &Path, secret: &KeySecret) -> Result<()> {
    write_key_check_file(dir, secret)?;
    sync_dir(dir)
}

/// Left by a clean close, taken by the next open: its absence at open
/// means the previous run ended without closing (docs/design.md, "Tail
/// scrub").
pub const CLEAN_MARKER_FILE: &str = "clean-shutdown";

/// Whether the previous run closed cleanly; removes the marker (synced),
/// so that this run's crash is noticed by the next open.
pub fn take_clean_marker(dir: &Path) -> Result<bool> {
    let path = dir.join(CLEAN_MARKER_FILE);
    match fs::remove_file(&path) {
        Ok(()) => {
            sync_dir(dir)?;
            Ok(true)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(Error::io(format!("removing {}", path.display()), e)),
    }
}

/// Marks the shutdown clean (after the last flush succeeded).
pub fn leave_clean_marker(dir: &Path) -> Result<()> {
    write_synced(dir, CLEAN_MARKER_FILE, b"closed cleanly\n", FILE_MODE)?;
    sync_dir(dir)
}

/// Whether `text` is a node id: 32 lower-case hex digits.
pub fn is_node_id(text: &str) -> bool {
    text.len() == 32 && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// 128 random bits, as 32 lower-case hex digits.
fn new_node_id() -> Result<String> {
    let random = KeySecret::generate()?;
    Ok(random.as_bytes()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    crate::io::sync_dir(dir).map_err(|e| Error::io(format!("syncing {}", dir.display()), e))
}

fn holds_regions(region_dir: &Path) -> Result<bool> {
    match fs::read_dir(region_dir) {
        Ok(mut listing) => Ok(listing.next().is_some()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(Error::io(format!("listing {}", region_dir.display()), e)),
    }
}

pub(crate) fn read_secret(dir: &Path) -> Result<KeySecret> {
    let path = dir.join(KEY_SECRET_FILE);
    let mut bytes = Vec::new();
    // Never through a link, and only a file no other user can read or
    // have written.
    crate::private::open_secret(&path)
        .and_then(|mut f| f.read_to_end(&mut bytes))
        .map_err(|e| {
            Error::io(
                format!(
                    "reading {} (without it no stored block can be verified)",
                    path.display()
                ),
                e,
            )
        })?;
    let bytes: [u8; KEY_SECRET_LEN] = bytes.try_into().map_err(|b: Vec<u8>| {
        Error::new(
            ErrorKind::Corruption,
            format!(
                "{} is {} bytes, not {KEY_SECRET_LEN}",
                path.display(),
                b.len()
            ),
        )
    })?;
    Ok(KeySecret::from_bytes(bytes))
}

/// Writes the secret, then the format file, each through a synced
/// temporary file and a rename, then syncs the directory: a crash leaves
/// either no format file (and so a directory that is created again) or
/// both files complete.
fn create(dir: &Path) -> Result<Identity> {
    let secret = KeySecret::generate()?;
    write_synced(dir, KEY_SECRET_FILE, secret.as_bytes(), FILE_MODE)?;
    write_key_check_file(dir, &secret)?;
    let node_id = new_node_id()?;
    write_synced(
        dir,
        NODE_ID_FILE,
        format!("{node_id}\n").as_bytes(),
        FILE_MODE,
    )?;
    let format = format!("{FORMAT_PREFIX}{DATA_DIR_FORMAT}\n");
    write_synced(dir, FORMAT_FILE, format.as_bytes(), FILE_MODE)?;
    sync_dir(dir)?;
    Ok(Identity {
        secret,
        node_id,
        confirmed: true,
    })
}

fn write_synced(dir: &Path, name: &str, bytes: &[u8], mode: u32) -> Result<()> {
    replace_file(dir, name, bytes, mode)
        .map_err(|e| Error::io(format!("writing {}", dir.join(name).display()), e))
}

/// Replaces `dir/name` with `bytes` whole: a synced temporary file renamed
/// over it (the caller syncs `dir` when the rename must survive a crash).
pub(crate) fn replace_file(dir: &Path, name: &str, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    let tmp = dir.join(format!("{name}.tmp"));
    let _ = fs::remove_file(&tmp);
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    drop(file);
    fs::rename(&tmp, dir.join(name))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn created_once_then_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let regions = dir.path().join("regions");
        let first = open_or_create(dir.path(), &regions).unwrap();
        let again = open_or_create(dir.path(), &regions).unwrap();
        assert_eq!(first.secret.as_bytes(), again.secret.as_bytes());
        assert_eq!(first.node_id, again.node_id);
        assert!(is_node_id(&first.node_id));
        let mode = fs::metadata(dir.path().join(KEY_SECRET_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    #[test]
    fn older_and_foreign_directories_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let regions = dir.path().join("regions");
        fs::create_dir(&regions).unwrap();
        fs::write(regions.join("region-00000000.kvt"), b"old").unwrap();
        let e = open_or_create(dir.path(), &regions).unwrap_err();
        assert!(e.to_string().contains("format 1"), "{e}");
        assert!(!dir.path().join(FORMAT_FILE).exists());

        fs::write(
            dir.path().join(FORMAT_FILE),
            "kvtier data directory format 9\n",
        )
        .unwrap();
        let e = open_or_create(dir.path(), &regions).unwrap_err();
        assert!(e.to_string().contains("format 9"), "{e}");

        fs::write(dir.path().join(FORMAT_FILE), "garbage").unwrap();
        assert_eq!(
            open_or_create(dir.path(), &regions).unwrap_err().kind(),
            ErrorKind::Corruption
        );
    }

    #[test]
    fn format_2_is_upgraded_in_place_keeping_its_secret() {
        let dir = tempfile::tempdir().unwrap();
        let regions = dir.path().join("regions");
        let created = open_or_create(dir.path(), &regions).unwrap();
        // Back to what a format-2 build left.
        fs::remove_file(dir.path().join(NODE_ID_FILE)).unwrap();
        fs::write(
            dir.path().join(FORMAT_FILE),
            "kvtier data directory format 2\n",
        )
        .unwrap();
        let upgraded = open_or_create(dir.path(), &regions).unwrap();
        assert_eq!(upgraded.secret.as_bytes(), created.secret.as_bytes());
        assert!(fs::read_to_string(dir.path().join(FORMAT_FILE))
            .unwrap()
            .contains("format 4"));
        assert_eq!(
            open_or_create(dir.path(), &regions).unwrap().node_id,
            upgraded.node_id
        );
        // An upgrade interrupted after the node id keeps that id.
        fs::write(
            dir.path().join(FORMAT_FILE),
            "kvtier data directory format 2\n",
        )
        .unwrap();
        assert_eq!(
            open_or_create(dir.path(), &regions).unwrap().node_id,
            upgraded.node_id
        );
        // Format 3 is upgraded keeping its id.
        fs::write(
            dir.path().join(FORMAT_FILE),
            "kvtier data directory format 3\n",
        )
        .unwrap();
        assert_eq!(
            open_or_create(dir.path(), &regions).unwrap().node_id,
            upgraded.node_id
        );
        assert!(fs::read_to_string(dir.path().join(FORMAT_FILE))
            .unwrap()
            .contains("format 4"));
        // Format 4 without its node id, or with a damaged one, is refused.
        fs::write(dir.path().join(NODE_ID_FILE), "xyz").unwrap();
        assert_eq!(
            open_or_create(dir.path(), &regions).unwrap_err().kind(),
            ErrorKind::Corruption
        );
        fs::remove_file(dir.path().join(NODE_ID_FILE)).unwrap();
        let e = open_or_create(dir.path(), &regions).unwrap_err();
        assert!(e.to_string().contains("node-id"), "{e}");
    }

    #[test]
    fn a_damaged_secret_is_refused_by_its_check_value() {
        let dir = tempfile::tempdir().unwrap();
        let regions = dir.path().join("regions");
        let created = open_or_create(dir.path(), &regions).unwrap();
        assert!(created.confirmed);
        let path = dir.path().join(KEY_SECRET_FILE);
        let mut bytes = fs::read(&path).unwrap();
        bytes[5] ^= 1;
        fs::write(&path, &bytes).unwrap();
        let e = open_or_create(dir.path(), &regions).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corruption);
        assert!(e.to_string().contains(KEY_CHECK_FILE), "{e}");
        // Without the check value (an older directory) the secret is
        // taken as unconfirmed, for the store to check against records.
        fs::remove_file(dir.path().join(KEY_CHECK_FILE)).unwrap();
        assert!(!open_or_create(dir.path(), &regions).unwrap().confirmed);
    }

    #[test]
    fn a_missing_secret_is_an_error_not_a_new_secret() {
        let dir = tempfile::tempdir().unwrap();
        let regions = dir.path().join("regions");
        open_or_create(dir.path(), &regions).unwrap();
        fs::remove_file(dir.path().join(KEY_SECRET_FILE)).unwrap();
        assert!(open_or_create(dir.path(), &regions).is_err());
    }
}
