//! The real `kvtier serve` binary under the common open-file limit of
//! 1,024 (soft and hard): registered shared buffers hold no descriptor,
//! the connection caps are fitted under the limit, and durable puts and
//! new clients keep working however many buffers and sockets clients hold.

use crate::common::{frame, hello_body, memfd, options, read_reply, ServerProcess, TEST_TOKEN};
use kvtier_client::{Client, ClientOptions};
use kvtier_wire::protocol::{Op, Writer};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::time::{Duration, Instant};

fn reply_text(stream: &mut UnixStream) -> (i32, String) {
    let (status, body) = read_reply(stream);
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// Runs the server under the common open-file limit of 1,024 (soft and
/// hard, so it cannot raise it).
fn open_file_limit_1024(command: &mut std::process::Command) {
    // SAFETY: setrlimit is async-signal-safe; the child sets its own limit
    // before exec.
    unsafe {
        command.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: 1024,
                rlim_max: 1024,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

#[test]
fn registered_buffers_and_sockets_cannot_starve_durable_puts_of_descriptors() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start_configured(dir.path(), &[], open_file_limit_1024);
    // 20 Unix connections registering 64 buffers each: 1,280, more than
    // the server's whole descriptor table.
    let mut sessions = Vec::new();
    let (mut registered, mut refused) = (0u32, 0u32);
    for _ in 0..20 {
        let mut s = UnixStream::connect(&server.unix).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(&frame(Op::Hello, 1, &hello_body(TEST_TOKEN, "")))
            .unwrap();
        assert_eq!(reply_text(&mut s).0, 0);
        for i in 0..64u64 {
            let fd = memfd(1 << 16, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW);
            let mut w = Writer::default();
            w.u64(1 << 16);
            kvtier_wire::shm::send_with_fd(
                &s,
                &frame(Op::RegisterBuffer, 2 + i, &w.buf),
                fd.as_raw_fd(),
            )
            .unwrap();
            match reply_text(&mut s) {
                (0, _) => registered += 1,
                (_, why) => {
                    refused += 1;
                    eprintln!("register refused: {why}");
                }
            }
        }
        sessions.push(s);
    }
    eprintln!("buffers registered {registered}, refused {refused}");
    assert_eq!(
        registered, 1280,
        "every buffer within the caps is registered"
    );
    // Durable puts still get their region files, and a new client gets in.
    let started = Instant::now();
    let mut client = Client::connect_with(
        &server.unix_url(),
        ClientOptions {
            shm_size: 1 << 20,
            ..options()
        },
    )
    .unwrap();
    for i in 0..64u32 {
        let key = format!("durable/{i}").into_bytes();
        let value = kvtier::pattern::value(&key, 256 << 10);
        client.batch_put(&[&key], &[&value]).unwrap()[0]
            .as_ref()
            .unwrap();
    }
    client
        .flush()
        .expect("a durable flush with the descriptor table full of buffers");
    let mut tcp = Client::connect_with(&server.tcp_url(), options()).unwrap();
    let key = b"durable/7".to_vec();
    let mut buf = vec![0u8; 256 << 10];
    let got = tcp.batch_get_into(&[&key], &mut [&mut buf[..]]).unwrap();
    assert_eq!(got[0].as_ref().unwrap(), &Some(256 << 10));
    assert!(kvtier::pattern::verify(&key, &buf));
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    // The server's own descriptors stayed well under its limit.
    let open = std::fs::read_dir(format!("/proc/{}/fd", server.child.id()))
        .unwrap()
        .count();
    eprintln!("server descriptors open: {open} of 1024");
    assert!(open < 512, "{open} descriptors open");
    drop(sessions);
}

/// Copies writer directory `from` (of node `from_id`) as writer `to_id`:
/// its files, with its region files renamed for the new writer.
fn copy_writer(from: &std::path::Path, from_id: &str, to: &std::path::Path, to_id: &str) {
    std::fs::create_dir_all(to.join("regions")).unwrap();
    for item in std::fs::read_dir(from).unwrap() {
        let item = item.unwrap();
        if item.file_type().unwrap().is_file() {
            std::fs::copy(item.path(), to.join(item.file_name())).unwrap();
        }
    }
    for item in std::fs::read_dir(from.join("regions")).unwrap() {
        let item = item.unwrap();
        let name = item.file_name().to_string_lossy().replace(from_id, to_id);
        std::fs::copy(item.path(), to.join("regions").join(name)).unwrap();
    }
}

/// Issue 39, finding 6 (descriptors): 1,500 writer directories planted in
/// a shared directory (copies of a real writer's, as any client of the
/// volume can make) under the common open-file limit of 1,024. The
/// server's other-writer region files come from the room its connection
/// caps leave: it starts, 40 TCP clients get in and are served, and the
/// regions past the budget are counted, not opened. Before, the follower
/// opened one descriptor per planted region.
#[test]
fn planted_writer_directories_cannot_take_the_descriptors_connections_need() {
    let dir = tempfile::tempdir().unwrap();
    let shared = dir.path().join("shared");
    let shared_arg = shared.display().to_string();
    let keys: Vec<Vec<u8>> = (0..8)
        .map(|i| format!("planted/{i}").into_bytes())
        .collect();
    let writer_id = {
        let b = ServerProcess::start(&dir.path().join("b"), &["--shared-dir", &shared_arg]);
        let mut client = Client::connect_with(&b.tcp_url(), options()).unwrap();
        let values: Vec<Vec<u8>> = keys
            .iter()
            .map(|k| kvtier::pattern::value(k, 64 << 10))
            .collect();
        for r in client.batch_put(&keys, &values).unwrap() {
            r.unwrap();
        }
        client.flush().unwrap();
        std::fs::read_to_string(dir.path().join("b/node-id"))
            .unwrap()
            .trim()
            .to_string()
    };
    let nodes = shared.join("nodes");
    for i in 0..1500u32 {
        let id = format!("{:032x}", 0xfeed_0000_u64 + u64::from(i));
        copy_writer(&nodes.join(&writer_id), &writer_id, &nodes.join(&id), &id);
    }
    let server = ServerProcess::start_configured(
        &dir.path().join("c"),
        &["--shared-dir", &shared_arg],
        open_file_limit_1024,
    );
    let mut clients = Vec::new();
    for _ in 0..40 {
        let mut client = Client::connect_with(&server.tcp_url(), options())
            .expect("a client gets in beside the planted writers");
        let mut buf = vec![0u8; 64 << 10];
        let got = client
            .batch_get_into(&keys[..1], &mut [&mut buf[..]])
            .unwrap();
        if let Ok(Some(n)) = &got[0] {
            assert!(kvtier::pattern::verify(&keys[0], &buf[..*n]));
        }
        clients.push(client);
    }
    let stats = server.stats();
    let store = &stats["store"];
    let followed = store["shared_regions"].as_u64().unwrap();
    let over = store["shared_regions_over_file_budget"].as_u64().unwrap();
    eprintln!("regions followed {followed}, over the budget {over}");
    assert!(over > 0, "{store}");
    assert!(followed < 1024, "{store}");
    let open = std::fs::read_dir(format!("/proc/{}/fd", server.child.id()))
        .unwrap()
        .count();
    eprintln!("server descriptors open: {open} of 1024");
    assert!(open < 1024, "{open} descriptors open");
}
