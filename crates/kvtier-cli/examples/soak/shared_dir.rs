//! The shared directory's side of the soak (issues 38 and 39): with the
//! server's log in a shared directory (`--shared-dir`), attackers that can
//! write that directory (another client of the volume, no secret) plant
//! files under `nodes/` as made-up writers, hold them a while and take
//! them away: FIFOs named as a region and a checkpoint, a sparse 1.5 GiB
//! checkpoint, many junk writer directories, copies of the server's own
//! regions with their values damaged. The legitimate clients' checks
//! (wrong bytes, resurrections, errors) and the RSS bound cover what the
//! files must not do to them; a *breach* here is a follower that stops
//! (no follow pass begun for 20 s) or a server that stops answering.

use kvtier_client::{Client, ClientOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::time::Duration;

/// Shared-directory attack classes, in the order each attacker runs them.
pub const CLASSES: [&str; 4] = [
    "shared_fifos",
    "shared_sparse_checkpoints",
    "shared_junk_writers",
    "shared_damaged_region_copies",
];

/// A writer id no node has: 32 hex digits, marked so cleanup finds it.
fn made_up_writer(id: usize, round: usize, n: usize) -> String {
    format!("5a5a{:012x}{:08x}{:08x}", id, round as u32, n as u32)
}

fn mkfifo(path: &Path) {
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
        return;
    };
    // SAFETY: a valid NUL-terminated path.
    unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
}

/// The server's own writer directory: the one `nodes/` entry that is not
/// made up.
fn own_writer(shared: &Path) -> Option<PathBuf> {
    std::fs::read_dir(shared.join("nodes"))
        .ok()?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| !n.to_string_lossy().starts_with("5a5a"))
        })
}

/// Whether the server still answers and its follower still runs: a pass
/// begun within the last 20 s.
fn follower_alive(tcp: &str, token: &str) -> bool {
    let options = ClientOptions {
        auth_token: Some(token.to_string()),
        shm_size: 0,
        ..ClientOptions::default()
    };
    let Ok(mut client) = Client::connect_with(tcp, options) else {
        return false;
    };
    client.stats().is_ok_and(|stats| {
        stats["store"]["shared_follow_age_ms"]
            .as_u64()
            .is_some_and(|age| age < 20_000)
    })
}

/// Runs attack `which` once; `true` when the server let it through.
pub fn attack(
    which: usize,
    id: usize,
    round: usize,
    shared: &Path,
    tcp: &str,
    token: &str,
    stop: &AtomicBool,
) -> bool {
    let nodes = shared.join("nodes");
    let mut planted: Vec<PathBuf> = Vec::new();
    let mut writer = |n: usize| {
        let name = made_up_writer(id, round, n);
        let dir = nodes.join(&name);
        let _ = std::fs::create_dir_all(dir.join("regions"));
        let _ = std::fs::create_dir_all(dir.join("checkpoints"));
        planted.push(dir.clone());
        (name, dir)
    };
    match which {
        0 => {
            let (name, dir) = writer(0);
            mkfifo(
                &dir.join("regions")
                    .join(format!("{name}-ffffffffffffffff-00000000.kvr")),
            );
            mkfifo(
                &dir.join("checkpoints")
                    .join(format!("{name}-ffffffffffffffff-fffffffffffffff0.kvc")),
            );
        }
        1 => {
            let (name, dir) = writer(0);
            if let Ok(file) = std::fs::File::create(
                dir.join("checkpoints")
                    .join(format!("{name}-ffffffffffffffff-fffffffffffffff1.kvc")),
            ) {
                let _ = file.set_len(1536 << 20);
            }
        }
        2 => {
            for n in 0..64 {
                let (name, dir) = writer(n);
                let junk: Vec<u8> = (0..65536u32).map(|i| (i * 2654435761) as u8).collect();
                let _ = std::fs::write(
                    dir.join("regions")
                        .join(format!("{name}-0000000000000001-00000000.kvr")),
                    junk,
                );
            }
        }
        _ => {
            let (name, dir) = writer(0);
            if let Some(own) = own_writer(shared) {
                let mut regions: Vec<PathBuf> = std::fs::read_dir(own.join("regions"))
                    .map(|l| l.flatten().map(|e| e.path()).collect())
                    .unwrap_or_default();
                regions.sort();
                for (n, region) in regions.iter().rev().take(2).enumerate() {
                    let Ok(bytes) = std::fs::read(region) else {
                        continue;
                    };
                    let copy = dir
                        .join("regions")
                        .join(format!("{name}-0000000000000001-{n:08x}.kvr"));
                    if std::fs::write(&copy, &bytes).is_err() {
                        continue;
                    }
                    // Every value page after the first batch's record
                    // damaged; the records themselves kept.
                    if let Ok(file) = std::fs::OpenOptions::new().write(true).open(&copy) {
                        let mut at = 3 * 4096u64;
                        while at < bytes.len() as u64 {
                            let _ = file.write_all_at(&[0xa5; 64], at);
                            at += 4096;
                        }
                    }
                }
            }
        }
    }
    crate::attacks::sleep_unless(stop, Duration::from_secs(2));
    let alive = follower_alive(tcp, token);
    for dir in planted {
        let _ = std::fs::remove_dir_all(dir);
    }
    !alive
}
