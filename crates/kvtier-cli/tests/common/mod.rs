//! The real `kvtier serve` binary as a child process, for the server tests.

#![allow(dead_code)]

pub mod juicefs;

use kvtier_client::ClientOptions;
use kvtier_wire::protocol::{Header, Op, Writer, HEADER_LEN};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The `kvtier` binary the tests run: this build's, or the one named by
/// `KVTIER_TEST_SERVER_BIN`, to show that a new test fails on an older
/// build (said on stderr, so such a run is never mistaken for this build's).
pub fn kvtier_binary() -> std::path::PathBuf {
    static SAID: std::sync::Once = std::sync::Once::new();
    match std::env::var_os("KVTIER_TEST_SERVER_BIN") {
        Some(other) => {
            SAID.call_once(|| {
                eprintln!(
                    "NOTE: running {} instead of this build's kvtier (KVTIER_TEST_SERVER_BIN)",
                    Path::new(&other).display()
                )
            });
            other.into()
        }
        None => env!("CARGO_BIN_EXE_kvtier").into(),
    }
}

/// A config file (written in `dir`) with frames of at most 64 MiB and a
/// 128 MiB buffer budget: small enough for a test to fill.
pub fn small_buffer_config(dir: &Path) -> std::path::PathBuf {
    let config = dir.join("kvtier.toml");
    std::fs::write(
        &config,
        "max_frame = \"64MiB\"\nmax_buffer_bytes = \"128MiB\"\n",
    )
    .unwrap();
    config
}

/// Sends a frame header announcing a `len`-byte body of `op`, then every
/// body byte (zeros) but the last: a request the server must hold open.
pub fn send_all_but_last_byte(s: &mut impl Write, op: Op, len: usize) {
    let head = Header {
        op: op as u16,
        request_id: 2,
        body_len: len as u32,
        status: 0,
    };
    s.write_all(&head.encode()).unwrap();
    let chunk = vec![0u8; 1 << 20];
    let mut sent = 0;
    while sent < len - 1 {
        let n = chunk.len().min(len - 1 - sent);
        s.write_all(&chunk[..n]).unwrap();
        sent += n;
    }
}

/// The token test servers are started with (unless a test gives its own).
pub const TEST_TOKEN: &str = "kvtier-test-token-0123456789";

/// Client options carrying the test token.
pub fn options() -> ClientOptions {
    ClientOptions {
        auth_token: Some(TEST_TOKEN.into()),
        ..ClientOptions::default()
    }
}

/// Client options of a tenant's token in `namespace` (no shared memory).
pub fn as_tenant(token: &str, namespace: &str) -> ClientOptions {
    ClientOptions {
        auth_token: Some(token.into()),
        namespace: namespace.into(),
        shm_size: 0,
        ..options()
    }
}

/// A hello body: the token, then the namespace.
pub fn hello_body(token: &str, namespace: &str) -> Vec<u8> {
    let mut w = Writer::default();
    w.u32(token.len() as u32)
        .bytes(token.as_bytes())
        .u16(namespace.len() as u16)
        .bytes(namespace.as_bytes());
    w.buf
}

/// A whole request frame: header and body.
pub fn frame(op: Op, id: u64, body: &[u8]) -> Vec<u8> {
    let mut f = Header {
        op: op as u16,
        request_id: id,
        body_len: body.len() as u32,
        status: 0,
    }
    .encode()
    .to_vec();
    f.extend_from_slice(body);
    f
}

/// Reads one response frame: (status, body).
pub fn read_reply(stream: &mut impl Read) -> (i32, Vec<u8>) {
    let mut head = [0u8; HEADER_LEN];
    stream.read_exact(&mut head).unwrap();
    let len = u32::from_le_bytes(head[16..20].try_into().unwrap()) as usize;
    let status = i32::from_le_bytes(head[20..24].try_into().unwrap());
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).unwrap();
    (status, body)
}

/// Reads one response frame, or `None` when the connection ends first.
pub fn try_read_reply(stream: &mut impl Read) -> Option<(i32, Vec<u8>)> {
    let mut head = [0u8; HEADER_LEN];
    stream.read_exact(&mut head).ok()?;
    let len = u32::from_le_bytes(head[16..20].try_into().unwrap()) as usize;
    let status = i32::from_le_bytes(head[20..24].try_into().unwrap());
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).ok()?;
    Some((status, body))
}

/// A memfd of `len` bytes with `seals` added (0: none), as a client
/// would register one.
pub fn memfd(len: i64, seals: i32) -> OwnedFd {
    // SAFETY: creating, sizing and sealing our own memfd.
    unsafe {
        let raw = libc::memfd_create(
            c"test".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        );
        assert!(raw >= 0);
        assert_eq!(libc::ftruncate(raw, len), 0);
        if seals != 0 {
            assert_eq!(libc::fcntl(raw, libc::F_ADD_SEALS, seals), 0);
        }
        OwnedFd::from_raw_fd(raw)
    }
}

pub struct ServerProcess {
    pub child: Child,
    pub tcp: String,
    /// The TCP address when it speaks TLS.
    pub tls: String,
    pub unix: String,
    pub admin: String,
}

impl ServerProcess {
    pub fn start(dir: &Path, extra: &[&str]) -> ServerProcess {
        Self::start_configured(dir, extra, |_| {})
    }

    /// `start`, failing the test (the child killed) when the server has
    /// not said it serves within `limit`: for tests about a start that
    /// used to hang, which must fail rather than hang.
    pub fn start_within(dir: &Path, extra: &[&str], limit: Duration) -> ServerProcess {
        let (tx, rx) = std::sync::mpsc::channel();
        Self::start_configured_then(
            dir,
            extra,
            |_| {},
            |child| {
                let mut stdout = child.stdout.take().expect("piped");
                let pid = child.id();
                std::thread::spawn(move || {
                    let mut line = String::new();
                    let _ = BufReader::new(&mut stdout).read_line(&mut line);
                    let _ = tx.send((line, stdout));
                });
                match rx.recv_timeout(limit) {
                    Ok((line, stdout)) => {
                        child.stdout = Some(stdout);
                        line
                    }
                    Err(_) => {
                        let _ = child.kill();
                        let _ = child.wait();
                        panic!("the server (pid {pid}) did not start within {limit:?}");
                    }
                }
            },
        )
    }

    /// `start`, with `configure` applied to the command before it runs.
    pub fn start_configured(
        dir: &Path,
        extra: &[&str],
        configure: impl FnOnce(&mut Command),
    ) -> ServerProcess {
        Self::start_configured_then(dir, extra, configure, |child| {
            let mut line = String::new();
            BufReader::new(child.stdout.as_mut().unwrap())
                .read_line(&mut line)
                .unwrap();
            line
        })
    }

    /// `start_configured`, with `first_line` reading what the server
    /// printed first.
    fn start_configured_then(
        dir: &Path,
        extra: &[&str],
        configure: impl FnOnce(&mut Command),
        first_line: impl FnOnce(&mut Child) -> String,
    ) -> ServerProcess {
        let mut args = vec![
            "serve".to_string(),
            "--data-dir".into(),
            dir.display().to_string(),
            "--listen".into(),
            "127.0.0.1:0".into(),
        ];
        if !extra.contains(&"--memory") {
            args.extend(["--memory".into(), "64MiB".into()]);
        }
        if !extra.contains(&"--disk") {
            args.extend(["--disk".into(), "1GiB".into()]);
        }
        if !extra.contains(&"--admin") {
            args.extend(["--admin".into(), "127.0.0.1:0".into()]);
        }
        if !extra.contains(&"--auth-token") && !extra.contains(&"--generated-token") {
            args.extend(["--auth-token".into(), TEST_TOKEN.into()]);
        }
        args.extend(
            extra
                .iter()
                .filter(|s| **s != "--generated-token")
                .map(|s| s.to_string()),
        );
        let mut command = Command::new(kvtier_binary());
        command
            .args(&args)
            .env_remove("KVTIER_AUTH_TOKEN")
            .env("RUST_LOG", "error")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        configure(&mut command);
        let mut child = command.spawn().expect("start kvtier serve");
        let line = first_line(&mut child);
        assert!(
            line.starts_with("kvtier serving"),
            "unexpected first line: {line:?}"
        );
        let find = |prefix: &str| -> String {
            line.split([' ', ','])
                .find_map(|part| part.strip_prefix(prefix).map(|s| s.trim().to_string()))
                .unwrap_or_default()
        };
        ServerProcess {
            tcp: find("tcp://"),
            tls: find("tls://"),
            unix: find("unix://"),
            admin: find("http://"),
            child,
        }
    }

    /// Runs a server that must refuse to start; returns what it printed.
    /// A server that starts anyway is killed after 20 s and fails the test
    /// (never a hang).
    pub fn try_start(dir: &Path, extra: &[&str]) -> String {
        let mut child = Command::new(kvtier_binary())
            .args(["serve", "--data-dir", &dir.display().to_string()])
            .args(["--memory", "16MiB", "--admin", "off"])
            .args(if extra.contains(&"--listen") {
                &[][..]
            } else {
                &["--listen", "127.0.0.1:0"][..]
            })
            .args(extra)
            .env_remove("KVTIER_AUTH_TOKEN")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("the server started (still running after 20 s)");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let output = child.wait_with_output().unwrap();
        assert!(!output.status.success(), "the server started");
        String::from_utf8_lossy(&output.stderr).into_owned()
    }

    pub fn tcp_url(&self) -> String {
        format!("tcp://{}", self.tcp)
    }

    pub fn unix_url(&self) -> String {
        format!("unix://{}", self.unix)
    }

    pub fn signal(&self, signal: i32) {
        // SAFETY: signalling our own child process.
        unsafe { libc::kill(self.child.id() as i32, signal) };
    }

    pub fn wait(&mut self) -> std::process::ExitStatus {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "server did not exit");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn stats(&self) -> serde_json::Value {
        let mut stream = TcpStream::connect(&self.admin).unwrap();
        stream
            .write_all(b"GET /stats HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            .unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).unwrap();
        let body = response.split("\r\n\r\n").nth(1).unwrap();
        serde_json::from_str(body).unwrap()
    }

    pub fn http(&self, path: &str) -> String {
        self.http_request(&format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"))
    }

    /// Sends `request` (a whole HTTP/1.1 request) to the admin port and
    /// returns the whole response.
    pub fn http_request(&self, request: &str) -> String {
        let mut stream = TcpStream::connect(&self.admin).unwrap();
        stream.write_all(request.as_bytes()).unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).unwrap();
        response
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A CA and a server certificate for 127.0.0.1 signed by it, made with the
/// `openssl` command (CI installs it): (ca.pem, server.pem, server.key).
pub fn tls_files(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf, std::path::PathBuf) {
    let run = |args: &[&str]| {
        let status = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("the openssl command is needed for the TLS tests (apt-get install openssl)");
        assert!(status.success(), "openssl {args:?} failed");
    };
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n",
    )
    .unwrap();
    let ec_key = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let ca = [
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=kvtier test CA",
    ];
    run(&[&["req", "-x509"][..], &ec_key, &ca].concat());
    let csr = [
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=127.0.0.1",
    ];
    run(&[&["req"][..], &ec_key, &csr].concat());
    run(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "2",
        "-extfile",
        "server.ext",
    ]);
    (
        dir.join("ca.pem"),
        dir.join("server.pem"),
        dir.join("server.key"),
    )
}
