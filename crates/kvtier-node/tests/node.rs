//! A whole node started as an embedding program starts it: the store, the
//! server on TCP, a Unix socket and the admin port, and the KV-event feed,
//! through `Node::start`; values put through a client survive a stop and a
//! second start on the same data directory; a start that cannot bind
//! leaves nothing held.

use kvtier_client::{Client, ClientOptions};
use kvtier_node::{Node, NodeConfig, Size};
use std::io::{Read, Write};
use std::path::Path;

fn config(dir: &Path) -> NodeConfig {
    NodeConfig {
        data_dir: Some(dir.to_path_buf()),
        listen: Some("127.0.0.1:0".into()),
        admin: Some("127.0.0.1:0".into()),
        memory: Some(Size(64 << 20)),
        disk: Some(Size(64 << 20)),
        kv_events: Some("tcp://127.0.0.1:0".into()),
        ..NodeConfig::default()
    }
}

fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    answer
}

fn value(i: u8) -> Vec<u8> {
    vec![i; 64 << 10]
}

#[test]
fn a_node_serves_stops_and_comes_back_with_what_it_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(config(dir.path())).unwrap();
    let bound = node.bound().clone();
    let (tcp, admin, socket) = (
        bound.tcp.unwrap(),
        bound.admin.unwrap(),
        bound.socket.clone().unwrap(),
    );
    assert_ne!(tcp.port(), 0);
    let line = node.serving_line();
    for part in [
        format!("tcp://{tcp}"),
        format!("unix://{}", socket.display()),
        format!("admin http://{admin}"),
        "kv events tcp://127.0.0.1:".to_string(),
    ] {
        assert!(line.contains(&part), "{part} missing from {line:?}");
    }
    // TCP on loopback without a token given: the node made one, private.
    let token_file = node.token_file().unwrap().to_path_buf();
    let token = std::fs::read_to_string(&token_file).unwrap();
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&token_file).unwrap().permissions().mode() & 0o777,
        0o600
    );

    let keys: Vec<Vec<u8>> = (0..8u8).map(|i| vec![b'k', i]).collect();
    let values: Vec<Vec<u8>> = (0..8u8).map(value).collect();
    let mut tcp_client = Client::connect_with(
        &format!("tcp://{tcp}"),
        ClientOptions {
            auth_token: Some(token.trim().to_string()),
            ..ClientOptions::default()
        },
    )
    .unwrap();
    let put = tcp_client.batch_put(&keys[..4], &values[..4]).unwrap();
    assert!(put.iter().all(|r| r.is_ok()), "{put:?}");
    let mut unix_client = Client::connect(&format!("unix://{}", socket.display())).unwrap();
    let put = unix_client.batch_put(&keys[4..], &values[4..]).unwrap();
    assert!(put.iter().all(|r| r.is_ok()), "{put:?}");
    unix_client.flush().unwrap();
    assert_eq!(
        tcp_client.get(&keys[7]).unwrap().as_deref(),
        Some(&values[7][..])
    );

    // The feed's section of /stats comes from the node, not the server.
    let stats = http_get(admin, "/stats");
    assert!(stats.starts_with("HTTP/1.1 200"), "{stats}");
    let body = &stats[stats.find("\r\n\r\n").unwrap() + 4..];
    let json: serde_json::Value = serde_json::from_str(body).unwrap();
    assert_eq!(json["kv_events"]["enabled"], true, "{body}");

    drop((tcp_client, unix_client));
    node.stop_and_wait().unwrap();
    // Stopped: the server is gone and took its socket with it (not a
    // connect to the old port: another process may have been given it).
    assert!(!socket.exists(), "{} left behind", socket.display());

    // A second start on the same directory finds every value.
    let node = Node::start(NodeConfig {
        kv_events: None,
        ..config(dir.path())
    })
    .unwrap();
    let socket = node.bound().socket.clone().unwrap();
    let admin = node.bound().admin.unwrap();
    let mut client = Client::connect(&format!("unix://{}", socket.display())).unwrap();
    for (key, value) in keys.iter().zip(&values) {
        assert_eq!(client.get(key).unwrap().as_deref(), Some(&value[..]));
    }
    let stats = http_get(admin, "/stats");
    let body = &stats[stats.find("\r\n\r\n").unwrap() + 4..];
    let json: serde_json::Value = serde_json::from_str(body).unwrap();
    assert_eq!(json["kv_events"]["enabled"], false, "{body}");
    drop(client);
    let stopper = node.stopper();
    let waiter = std::thread::spawn(move || node.wait());
    stopper.stop();
    waiter.join().unwrap().unwrap();
}

#[test]
fn a_start_that_fails_says_why_and_holds_nothing() {
    let dir = tempfile::tempdir().unwrap();
    // A port someone else holds: the server cannot bind it.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy = NodeConfig {
        listen: Some(taken.local_addr().unwrap().to_string()),
        ..config(dir.path())
    };
    let err = Node::start(busy).unwrap_err().to_string();
    assert!(err.to_lowercase().contains("in use"), "{err}");
    // The store it opened was closed: the directory's writer lock is
    // free for the next start.
    let node = Node::start(config(dir.path())).unwrap();
    // While it runs, a second node on the same directory is refused.
    let second = Node::start(config(dir.path())).unwrap_err().to_string();
    assert!(second.to_lowercase().contains("lock"), "{second}");
    node.stop_and_wait().unwrap();

    // Bad configuration is refused before anything opens.
    for (bad, says) in [
        (
            NodeConfig {
                listen: Some("0.0.0.0:0".into()),
                ..config(dir.path())
            },
            "without an auth token",
        ),
        (
            NodeConfig {
                kv_events_replay: Some("tcp://127.0.0.1:0".into()),
                kv_events: None,
                ..config(dir.path())
            },
            "kv_events_replay needs kv_events",
        ),
        (
            NodeConfig {
                etcd: Some(vec!["http://127.0.0.1:2379".into()]),
                ..config(dir.path())
            },
            "--etcd needs --cluster",
        ),
    ] {
        let err = Node::start(bad).unwrap_err().to_string();
        assert!(err.contains(says), "{err:?} should say {says:?}");
    }
}
