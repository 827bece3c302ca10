//! The real `kvtier serve` binary keeps what it caches private to its
//! user: started from a shell's umask 022, another uid can read no value,
//! key or secret; a directory another user owns or may write, a planted
//! `auth-token` link and a socket directory others may write are refused.
//!
//! Reading as another uid needs root: without it these tests fail (they
//! never skip), saying so.

use crate::common::{options, ServerProcess, TEST_TOKEN};
use kvtier_client::Client;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

/// The uid the "other user" runs as.
const NOBODY: u32 = 65534;

fn require_root() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "these tests read the data directory as uid {NOBODY} and chown files to it: run them \
         as root (CI does); they do not skip"
    );
}

/// Whether uid `NOBODY` can read `path` (as `cat` run as that user).
fn nobody_reads(path: &Path) -> bool {
    Command::new("cat")
        .arg(path)
        .uid(NOBODY)
        .gid(NOBODY)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .expect("run cat as another uid")
        .success()
}

fn walk(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        out.push(path.clone());
        if std::fs::symlink_metadata(&path).unwrap().is_dir() {
            walk(&path, out);
        }
    }
}

#[test]
fn values_written_under_a_shell_umask_are_private_to_the_server_user() {
    require_root();
    // What a shell gives: new files 0644 and directories 0755 unless the
    // program says otherwise. Process-wide, so for the child too.
    // SAFETY: umask only changes this process's file-creation mask.
    unsafe { libc::umask(0o022) };
    let root = tempfile::tempdir().unwrap();
    // The parent is open to everyone: only the data directory's own modes
    // may keep another user out.
    std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let data = root.path().join("data");
    let server = ServerProcess::start(&data, &[]);
    let mut client = Client::connect_with(&server.unix_url(), options()).unwrap();
    let value = b"secret-kv-bytes-".repeat(4096);
    client.batch_put(&[b"tenant-key"], &[&value]).unwrap()[0]
        .as_ref()
        .unwrap();
    client.flush().unwrap();

    let mut paths = vec![data.clone()];
    walk(&data, &mut paths);
    let mut regions = 0;
    for path in &paths {
        let meta = std::fs::symlink_metadata(path).unwrap();
        let mode = meta.mode() & 0o777;
        assert_eq!(
            mode & 0o077,
            0,
            "{} has mode {mode:o}: group or others have rights",
            path.display()
        );
        if meta.is_file() {
            assert!(!nobody_reads(path), "uid {NOBODY} read {}", path.display());
            regions += usize::from(path.parent().unwrap().ends_with("regions"));
        }
    }
    assert!(regions > 0, "the value reached a region file: {paths:?}");
    assert!(!nobody_reads(&data.join("key-secret")));
    drop(client);
}

#[test]
fn shared_or_foreign_directories_planted_links_and_open_socket_dirs_are_refused() {
    require_root();
    let root = tempfile::tempdir().unwrap();

    // A data directory group and others may write.
    let open = root.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let said = ServerProcess::try_start(&open, &["--auth-token", TEST_TOKEN]);
    assert!(said.contains("written by group or others"), "{said}");

    // A data directory another user owns.
    let foreign = root.path().join("foreign");
    std::fs::create_dir(&foreign).unwrap();
    std::os::unix::fs::chown(&foreign, Some(NOBODY), Some(NOBODY)).unwrap();
    let said = ServerProcess::try_start(&foreign, &["--auth-token", TEST_TOKEN]);
    assert!(said.contains(&format!("owned by uid {NOBODY}")), "{said}");

    // An auth-token planted as a link (to a private file with a valid
    // token: the link itself is what is refused).
    let planted = root.path().join("planted");
    std::fs::create_dir(&planted).unwrap();
    std::fs::set_permissions(&planted, std::fs::Permissions::from_mode(0o700)).unwrap();
    let target = root.path().join("token-elsewhere");
    std::fs::write(&target, format!("{TEST_TOKEN}-and-some-more-hex\n")).unwrap();
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::os::unix::fs::symlink(&target, planted.join("auth-token")).unwrap();
    let said = ServerProcess::try_start(&planted, &[]);
    assert!(said.contains("symbolic link"), "{said}");

    // A socket in a directory others may write (and that is not sticky).
    let shared = root.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
    let data = root.path().join("data");
    let socket = shared.join("kvtier.sock");
    let said = ServerProcess::try_start(
        &data,
        &[
            "--auth-token",
            TEST_TOKEN,
            "--socket",
            socket.to_str().unwrap(),
        ],
    );
    assert!(
        said.contains("another user could replace the socket"),
        "{said}"
    );
    // Sticky (as /tmp): only the socket's owner may remove it there.
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let server = ServerProcess::start(&data, &["--socket", socket.to_str().unwrap()]);
    Client::connect_with(&server.unix_url(), options()).unwrap();
}

/// A first start warns about nothing: the data directory (with a
/// generated token, made before the store opens), a new shared directory
/// and its `nodes/` folder are created private, not made with the
/// umask's 0755 and then "tightened" with a warning. A warning on the
/// happy path teaches operators to ignore warnings.
#[test]
fn a_first_start_is_private_from_the_start_and_prints_no_warning() {
    require_root();
    // SAFETY: umask only changes this process's file-creation mask.
    unsafe { libc::umask(0o022) };
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    let shared = root.path().join("shared");
    let log = root.path().join("stderr.txt");
    let stderr = std::fs::File::create(&log).unwrap();
    let mut server = ServerProcess::start_configured(
        &data,
        &[
            "--generated-token",
            "--shared-dir",
            shared.to_str().unwrap(),
        ],
        |command| {
            command.env("RUST_LOG", "warn").stderr(stderr);
        },
    );
    // A same-user Unix peer needs no token.
    let mut client =
        Client::connect_with(&server.unix_url(), kvtier_client::ClientOptions::default()).unwrap();
    client.batch_put(&[b"k"], &[b"v"]).unwrap()[0]
        .as_ref()
        .unwrap();
    client.flush().unwrap();
    drop(client);
    server.signal(libc::SIGTERM);
    assert!(server.wait().success());
    for dir in [&data, &shared, &shared.join("nodes")] {
        let mode = std::fs::metadata(dir).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o700, "{} has mode {mode:o}", dir.display());
    }
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(
        !said.contains("WARN") && !said.contains("ERROR"),
        "a first start warned:\n{said}"
    );
}
