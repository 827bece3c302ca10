//! The real `kvtier serve` binary under the common open-file limit of
//! 1,024 (soft and hard): registered shared buffers hold no descriptor,
//! the connection caps are fitted under the limit, and durable puts and
//! new clients keep working however many buffers and sockets clients hold.

mod common;

use common::{frame, hello_body, memfd, options, read_reply, ServerProcess, TEST_TOKEN};
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

#[test]
fn registered_buffers_and_sockets_cannot_starve_durable_puts_of_descriptors() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start_configured(dir.path(), &[], |command| {
        // SAFETY: setrlimit is async-signal-safe; the child sets its own
        // limit before exec.
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
    });
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
        let value = kvtier::internals::pattern::value(&key, 256 << 10);
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
    assert!(kvtier::internals::pattern::verify(&key, &buf));
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
