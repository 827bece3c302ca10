//! Cluster mode against real etcd (Debian's etcd-server, 3 members on
//! loopback) and real `kvtier serve` processes. Every process is stopped by
//! PID on drop and every wait is bounded. Figures the issue asks for
//! (detection time, misses in the window, hit rates, remapped share) are
//! printed; run with `--nocapture` to see them.

mod common;

use common::{options, tls_files, ServerProcess};
use kvtier_client::{Client, ClientOptions};
use kvtier_wire::cluster::{key_hash, owners, Member};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const LEASE_TTL: &str = "2";

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn etcd_binary() -> &'static str {
    for candidate in ["/usr/bin/etcd", "/usr/local/bin/etcd"] {
        if Path::new(candidate).exists() {
            return candidate;
        }
    }
    panic!("etcd is not installed: apt-get install etcd-server (scripts/system-packages does it)");
}

/// A static etcd cluster of `n` members on loopback.
struct Etcd {
    dir: PathBuf,
    names: Vec<String>,
    clients: Vec<String>,
    peers: Vec<String>,
    children: Vec<Option<Child>>,
}

impl Etcd {
    /// Starts `n` members. A port picked free can be taken by another
    /// test before etcd binds it (the tests run in parallel): a member
    /// that exits at start is retried on fresh ports, up to three times.
    fn start(dir: &Path, n: usize) -> Etcd {
        for attempt in 1..=3 {
            let mut etcd = Etcd::start_once(dir, n);
            match etcd.wait_healthy_or_exited(&(0..n).collect::<Vec<_>>()) {
                Ok(()) => return etcd,
                Err(why) if attempt < 3 => {
                    eprintln!("etcd start attempt {attempt}: {why}; retrying on fresh ports");
                    for i in 0..n {
                        etcd.kill_member(i);
                        let _ = std::fs::remove_dir_all(dir.join(&etcd.names[i]));
                    }
                }
                Err(why) => panic!("{why}"),
            }
        }
        unreachable!("the last attempt panics")
    }

    fn start_once(dir: &Path, n: usize) -> Etcd {
        let names: Vec<String> = (0..n).map(|i| format!("etcd{i}")).collect();
        let clients: Vec<String> = (0..n)
            .map(|_| format!("http://127.0.0.1:{}", free_port()))
            .collect();
        let peers: Vec<String> = (0..n)
            .map(|_| format!("http://127.0.0.1:{}", free_port()))
            .collect();
        let mut etcd = Etcd {
            dir: dir.to_path_buf(),
            names,
            clients,
            peers,
            children: (0..n).map(|_| None).collect(),
        };
        for i in 0..n {
            etcd.start_member(i);
        }
        etcd
    }

    fn start_member(&mut self, i: usize) {
        let initial: Vec<String> = self
            .names
            .iter()
            .zip(&self.peers)
            .map(|(n, p)| format!("{n}={p}"))
            .collect();
        let log = std::fs::File::create(self.dir.join(format!("{}.log", self.names[i]))).unwrap();
        let child = Command::new(etcd_binary())
            .args([
                "--name",
                &self.names[i],
                "--data-dir",
                self.dir.join(&self.names[i]).to_str().unwrap(),
                "--listen-client-urls",
                &self.clients[i],
                "--advertise-client-urls",
                &self.clients[i],
                "--listen-peer-urls",
                &self.peers[i],
                "--initial-advertise-peer-urls",
                &self.peers[i],
                "--initial-cluster",
                &initial.join(","),
                "--initial-cluster-state",
                "new",
                "--heartbeat-interval",
                "50",
                "--election-timeout",
                "500",
            ])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start etcd");
        self.children[i] = Some(child);
    }

    fn kill_member(&mut self, i: usize) {
        if let Some(mut child) = self.children[i].take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn endpoints(&self) -> String {
        self.clients.join(",")
    }

    /// Waits (bounded) until the given members answer as healthy; an
    /// error names a member whose process exited (its log says why).
    fn wait_healthy_or_exited(&mut self, members: &[usize]) -> Result<(), String> {
        let endpoints: Vec<String> = members.iter().map(|&i| self.clients[i].clone()).collect();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            for &i in members {
                if let Some(Ok(Some(status))) = self.children[i].as_mut().map(|c| c.try_wait()) {
                    let log =
                        std::fs::read_to_string(self.dir.join(format!("{}.log", self.names[i])))
                            .unwrap_or_default();
                    let tail: String = log.lines().rev().take(5).collect::<Vec<_>>().join(" | ");
                    return Err(format!("etcd member {i} exited ({status}): {tail}"));
                }
            }
            let status = Command::new("etcdctl")
                .env("ETCDCTL_API", "3")
                .args(["--endpoints", &endpoints.join(","), "endpoint", "health"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .expect("etcdctl (apt-get install etcd-client)");
            if status.success() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!("etcd members {members:?} never became healthy"));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Waits (bounded) until the given members answer as healthy.
    fn wait_healthy(&mut self, members: &[usize]) {
        if let Err(why) = self.wait_healthy_or_exited(members) {
            panic!("{why}");
        }
    }

    /// The index of the current leader.
    fn leader(&self) -> usize {
        let out = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args([
                "--endpoints",
                &self.endpoints(),
                "endpoint",
                "status",
                "--write-out",
                "json",
            ])
            .output()
            .unwrap();
        let statuses: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        for status in statuses.as_array().unwrap() {
            let s = &status["Status"];
            if s["leader"] == s["header"]["member_id"] {
                let endpoint = status["Endpoint"].as_str().unwrap();
                return self.clients.iter().position(|c| c == endpoint).unwrap();
            }
        }
        panic!("no etcd leader in {statuses}");
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        for i in 0..self.children.len() {
            self.kill_member(i);
        }
    }
}

fn node(dir: &Path, etcd: &Etcd, extra: &[&str]) -> ServerProcess {
    node_at(dir, &etcd.endpoints(), extra)
}

/// A member of cluster "test" whose etcd is at `endpoints`.
fn node_at(dir: &Path, endpoints: &str, extra: &[&str]) -> ServerProcess {
    let mut args = vec![
        "--cluster",
        "test",
        "--etcd",
        endpoints,
        "--lease-ttl",
        LEASE_TTL,
    ];
    args.extend_from_slice(extra);
    ServerProcess::start(dir, &args)
}

fn members_seen(server: &ServerProcess) -> Vec<Member> {
    serde_json::from_value(server.stats()["cluster"]["members"].clone()).unwrap()
}

/// Waits (bounded) until every node sees `n` members; returns how long.
fn wait_for_members(nodes: &[&ServerProcess], n: usize, limit: Duration) -> Duration {
    let started = Instant::now();
    loop {
        if nodes.iter().all(|s| members_seen(s).len() == n) {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < limit,
            "nodes did not all see {n} members within {limit:?}: {:?}",
            nodes
                .iter()
                .map(|s| members_seen(s).len())
                .collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn value(i: usize, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    let tag = (i as u64).to_le_bytes();
    for (j, b) in v.iter_mut().enumerate() {
        *b = tag[j % 8] ^ (j as u8);
    }
    v
}

fn keys(n: usize) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| format!("block-{i:06}").into_bytes())
        .collect()
}

const VALUE_LEN: usize = 8 << 10;

fn put_all(client: &mut Client, keys: &[Vec<u8>]) {
    for (chunk_index, chunk) in keys.chunks(256).enumerate() {
        let values: Vec<Vec<u8>> = (0..chunk.len())
            .map(|j| value(chunk_index * 256 + j, VALUE_LEN))
            .collect();
        for (j, result) in client
            .batch_put(chunk, &values)
            .unwrap()
            .into_iter()
            .enumerate()
        {
            result.unwrap_or_else(|e| panic!("put {}: {e}", chunk_index * 256 + j));
        }
    }
}

/// Reads every key; returns (hits, misses, wrong bytes, slowest call).
fn read_all(client: &mut Client, keys: &[Vec<u8>]) -> (usize, usize, usize, Duration) {
    let (mut hits, mut misses, mut wrong) = (0, 0, 0);
    let mut slowest = Duration::ZERO;
    for (chunk_index, chunk) in keys.chunks(256).enumerate() {
        let mut bufs: Vec<Vec<u8>> = chunk.iter().map(|_| vec![0u8; VALUE_LEN]).collect();
        let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        let started = Instant::now();
        let results = client.batch_get_into(chunk, &mut slices).unwrap();
        slowest = slowest.max(started.elapsed());
        for (j, result) in results.into_iter().enumerate() {
            match result {
                Ok(Some(n)) => {
                    hits += 1;
                    if n != VALUE_LEN || bufs[j] != value(chunk_index * 256 + j, VALUE_LEN) {
                        wrong += 1;
                    }
                }
                _ => misses += 1,
            }
        }
    }
    (hits, misses, wrong, slowest)
}

#[test]
fn three_nodes_serve_one_cache_and_survive_failures() {
    let dir = tempfile::tempdir().unwrap();
    let mut etcd = Etcd::start(dir.path(), 3);
    let dirs: Vec<PathBuf> = (1..=4)
        .map(|i| dir.path().join(format!("node{i}")))
        .collect();
    let n1 = node(&dirs[0], &etcd, &[]);
    let mut n2 = node(&dirs[1], &etcd, &[]);
    let n3 = node(&dirs[2], &etcd, &[]);
    wait_for_members(&[&n1, &n2, &n3], 3, Duration::from_secs(20));
    // `kvtier cluster status` lists them, all answering.
    let status = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args([
            "cluster",
            "status",
            "--etcd",
            &etcd.endpoints(),
            "--cluster",
            "test",
            "--json",
        ])
        .env("KVTIER_AUTH_TOKEN", common::TEST_TOKEN)
        .output()
        .unwrap();
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    let listed: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    let listed = listed.as_array().unwrap();
    assert_eq!(listed.len(), 3, "{listed:?}");
    for member in listed {
        assert_eq!(member["tcp_answers"], true, "{member}");
        assert_eq!(member["admin_healthy"], true, "{member}");
    }

    // 10,000 blocks through node 1, read through node 3.
    let all = keys(10_000);
    let mut c1 = Client::connect_with(&n1.unix_url(), options()).unwrap();
    let mut c3 = Client::connect_with(&n3.unix_url(), options()).unwrap();
    put_all(&mut c1, &all);
    let (hits, misses, wrong, _) = read_all(&mut c3, &all);
    assert_eq!((hits, misses, wrong), (10_000, 0, 0), "read through node 3");
    let per_node: Vec<u64> = [&n1, &n2, &n3]
        .iter()
        .map(|s| s.stats()["store"]["entries"].as_u64().unwrap())
        .collect();
    eprintln!("keys per node: {per_node:?}");
    assert_eq!(per_node.iter().sum::<u64>(), 10_000);
    for &k in &per_node {
        assert!(
            (k as f64 - 10_000.0 / 3.0).abs() < 10_000.0 / 3.0 * 0.10,
            "{per_node:?}"
        );
    }
    // prefix_len through any node equals the single-node answer.
    let mut with_gap = all[..5000].to_vec();
    with_gap.push(b"never-stored".to_vec());
    with_gap.extend_from_slice(&all[5000..6000]);
    let mut c2 = Client::connect_with(&n2.unix_url(), options()).unwrap();
    for client in [&mut c1, &mut c2, &mut c3] {
        assert_eq!(client.prefix_len(&all).unwrap(), 10_000);
        assert_eq!(client.prefix_len(&with_gap).unwrap(), 5000);
    }
    drop(c2);

    // SIGKILL node 2 under reads through node 1.
    let owned_by_2 = per_node[1] as usize;
    n2.signal(libc::SIGKILL);
    n2.wait();
    let killed = Instant::now();
    // Reads through node 1 while its view still lists node 2, and a watch
    // on both views for when node 2 leaves them.
    let ((hits, misses, wrong, slowest), detected) = std::thread::scope(|scope| {
        let watcher = scope.spawn(|| {
            wait_for_members(&[&n1, &n3], 2, Duration::from_secs(15));
            killed.elapsed()
        });
        (read_all(&mut c1, &all), watcher.join().unwrap())
    });
    eprintln!(
        "SIGKILL: node 2 left both views after {detected:?} (lease TTL {LEASE_TTL} s, renewals every TTL/3)"
    );
    eprintln!(
        "reads in the window: {hits} hits, {misses} misses, {wrong} wrong, slowest batch of 256 {slowest:?}"
    );
    assert_eq!(wrong, 0);
    assert_eq!(hits + misses, 10_000);
    assert!(misses >= owned_by_2, "node 2's keys must read as misses");
    assert!(slowest < Duration::from_secs(5), "a call hung: {slowest:?}");
    // Lease TTL plus one renewal period, with slack for a loaded machine.
    assert!(detected < Duration::from_secs(6), "{detected:?}");
    let (hits, misses, wrong, _) = read_all(&mut c1, &all);
    let rate = hits as f64 / 10_000.0;
    eprintln!("after detection: hit rate {rate:.3} with 1 replica ({misses} misses)");
    assert_eq!(wrong, 0);
    assert!((rate - 2.0 / 3.0).abs() < 0.05, "{rate}");

    // Restarted on its data directory: its blocks hit again.
    let n2 = node(&dirs[1], &etcd, &[]);
    wait_for_members(&[&n1, &n2, &n3], 3, Duration::from_secs(20));
    let (hits, misses, wrong, _) = read_all(&mut c1, &all);
    eprintln!("after node 2 restarted: {hits} hits, {misses} misses");
    assert_eq!((hits, misses, wrong), (10_000, 0, 0));

    // SIGSTOP node 3 past its lease, then SIGCONT: a new incarnation.
    let before = n3.stats()["cluster"].clone();
    n3.signal(libc::SIGSTOP);
    wait_for_members(&[&n1, &n2], 2, Duration::from_secs(15));
    let (_, _, wrong, _) = read_all(&mut c1, &all);
    assert_eq!(wrong, 0);
    n3.signal(libc::SIGCONT);
    wait_for_members(&[&n1, &n2, &n3], 3, Duration::from_secs(20));
    let after = n3.stats()["cluster"].clone();
    eprintln!(
        "node 3 after SIGSTOP/SIGCONT: incarnation {} -> {}, registrations {} -> {}, lease losses {}",
        before["incarnation"], after["incarnation"], before["registrations"], after["registrations"], after["lease_losses"]
    );
    assert_ne!(before["incarnation"], after["incarnation"]);
    assert_eq!(after["lease_losses"], 1);
    let (hits, _, wrong, _) = read_all(&mut c1, &all);
    assert_eq!((hits, wrong), (10_000, 0));

    // etcd: the leader dies, then 2 of 3 members; kvtier keeps serving.
    let leader = etcd.leader();
    etcd.kill_member(leader);
    let (hits, _, wrong, _) = read_all(&mut c3, &all);
    assert_eq!((hits, wrong), (10_000, 0), "after the etcd leader died");
    let other = (0..3).find(|&i| i != leader).unwrap();
    etcd.kill_member(other);
    std::thread::sleep(Duration::from_secs(3)); // past the lease TTL, without quorum
    let (hits, _, wrong, _) = read_all(&mut c3, &all);
    assert_eq!((hits, wrong), (10_000, 0), "with etcd out of quorum");
    for s in [&n1, &n2, &n3] {
        assert_eq!(members_seen(s).len(), 3, "the last view is kept");
        assert_eq!(s.stats()["cluster"]["etcd_reachable"], false);
    }
    etcd.start_member(leader);
    etcd.start_member(other);
    etcd.wait_healthy(&[0, 1, 2]);
    wait_for_members(&[&n1, &n2, &n3], 3, Duration::from_secs(20));
    let deadline = Instant::now() + Duration::from_secs(20);
    while [&n1, &n2, &n3]
        .iter()
        .any(|s| s.stats()["cluster"]["etcd_reachable"] != true)
    {
        assert!(Instant::now() < deadline, "nodes never reached etcd again");
        std::thread::sleep(Duration::from_millis(100));
    }
    let registrations: Vec<u64> = [&n1, &n2, &n3]
        .iter()
        .map(|s| s.stats()["cluster"]["registrations"].as_u64().unwrap())
        .collect();
    eprintln!("registrations after the etcd outage: {registrations:?}");
    let (hits, _, wrong, _) = read_all(&mut c3, &all);
    assert_eq!((hits, wrong), (10_000, 0), "after etcd came back");

    // A fourth node joins: the share of keys whose owner changed.
    let before: Vec<Member> = members_seen(&n1);
    let n4 = node(&dirs[3], &etcd, &[]);
    wait_for_members(&[&n1, &n2, &n3, &n4], 4, Duration::from_secs(20));
    let after: Vec<Member> = members_seen(&n1);
    let moved = all
        .iter()
        .filter(|k| {
            let h = key_hash("", k);
            owners(h, &before, 1)[0].id != owners(h, &after, 1)[0].id
        })
        .count();
    let share = moved as f64 / all.len() as f64;
    eprintln!("a 4th node joined: {share:.3} of the keys remapped");
    assert!((share - 0.25).abs() < 0.05, "{share}");
    // Remapped keys are misses until written again; never wrong bytes.
    let (hits, misses, wrong, _) = read_all(&mut c1, &all);
    eprintln!("after the join: {hits} hits, {misses} misses");
    assert_eq!(wrong, 0);
    assert_eq!(misses, moved);
    // No kvtier process exited along the way: each still answers.
    for s in [&n1, &n2, &n3, &n4] {
        assert_eq!(s.http("/health").split("\r\n\r\n").nth(1), Some("ok\n"));
    }
}

/// Three members of one cluster keeping two replicas of each block, all
/// seeing each other; etcd with them (dropped last).
fn three_members_two_replicas(dir: &Path) -> (Etcd, Vec<ServerProcess>) {
    let etcd = Etcd::start(dir, 1);
    let nodes: Vec<ServerProcess> = (1..=3)
        .map(|i| node(&dir.join(format!("node{i}")), &etcd, &["--replicas", "2"]))
        .collect();
    let refs: Vec<&ServerProcess> = nodes.iter().collect();
    wait_for_members(&refs, 3, Duration::from_secs(20));
    (etcd, nodes)
}

#[test]
fn two_replicas_keep_every_block_when_a_node_dies() {
    let dir = tempfile::tempdir().unwrap();
    let (_etcd, nodes) = three_members_two_replicas(dir.path());
    let all = keys(3000);
    let mut c1 = Client::connect_with(&nodes[0].unix_url(), options()).unwrap();
    put_all(&mut c1, &all);
    let stored: u64 = nodes
        .iter()
        .map(|s| s.stats()["store"]["entries"].as_u64().unwrap())
        .sum();
    assert_eq!(stored, 6000, "every block on two members");
    let mut nodes = nodes;
    nodes[1].signal(libc::SIGKILL);
    nodes[1].wait();
    let (hits, misses, wrong, slowest) = read_all(&mut c1, &all);
    eprintln!("2 replicas, one node killed: {hits} hits, {misses} misses, slowest {slowest:?}");
    assert_eq!((hits, wrong), (3000, 0));
}

#[test]
fn a_namespace_retired_through_one_member_is_gone_from_every_member() {
    let dir = tempfile::tempdir().unwrap();
    let (_etcd, nodes) = three_members_two_replicas(dir.path());
    let in_namespace = |node: &ServerProcess, namespace: &str| {
        Client::connect_with(
            &node.unix_url(),
            ClientOptions {
                namespace: namespace.into(),
                ..options()
            },
        )
        .unwrap()
    };
    let all = keys(600);
    put_all(&mut in_namespace(&nodes[0], "old-model"), &all);
    put_all(&mut in_namespace(&nodes[1], "kept-model"), &all);
    let entries = || -> u64 {
        nodes
            .iter()
            .map(|s| s.stats()["store"]["entries"].as_u64().unwrap())
            .sum()
    };
    assert_eq!(entries(), 2400, "every block on two members");
    // Retired through the third member: every member removes its copies.
    let retired = in_namespace(&nodes[2], "old-model")
        .retire_namespace()
        .unwrap();
    assert_eq!(retired.blocks, 1200, "both copies of each block");
    assert_eq!(retired.bytes, 1200 * VALUE_LEN as u64);
    assert_eq!(entries(), 1200);
    for node in &nodes {
        let (hits, _, wrong, _) = read_all(&mut in_namespace(node, "old-model"), &all);
        assert_eq!(
            (hits, wrong),
            (0, 0),
            "a retired block read through {}",
            node.unix
        );
        let (hits, _, wrong, _) = read_all(&mut in_namespace(node, "kept-model"), &all);
        assert_eq!((hits, wrong), (600, 0));
    }
}

#[test]
fn members_whose_listeners_speak_tls_forward_over_tls() {
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    std::fs::create_dir(&certs).unwrap();
    let (ca, cert, key) = tls_files(&certs);
    let etcd = Etcd::start(dir.path(), 1);
    let tls = [
        "--tls-cert",
        cert.to_str().unwrap(),
        "--tls-key",
        key.to_str().unwrap(),
        "--peer-ca",
        ca.to_str().unwrap(),
    ];
    let nodes: Vec<ServerProcess> = (1..=2)
        .map(|i| node(&dir.path().join(format!("node{i}")), &etcd, &tls))
        .collect();
    let refs: Vec<&ServerProcess> = nodes.iter().collect();
    wait_for_members(&refs, 2, Duration::from_secs(20));
    assert!(members_seen(&nodes[0]).iter().all(|m| m.tls));
    let all = keys(1000);
    let mut c1 = Client::connect_with(&nodes[0].unix_url(), options()).unwrap();
    put_all(&mut c1, &all);
    let mut c2 = Client::connect_with(&nodes[1].unix_url(), options()).unwrap();
    let (hits, misses, wrong, _) = read_all(&mut c2, &all);
    assert_eq!((hits, misses, wrong), (1000, 0, 0));
    let held: Vec<u64> = nodes
        .iter()
        .map(|s| s.stats()["store"]["entries"].as_u64().unwrap())
        .collect();
    assert!(
        held.iter().all(|&h| h > 300),
        "both members hold keys: {held:?}"
    );
    let peers = &nodes[1].stats()["cluster"]["peers"];
    let errors: u64 = peers
        .as_object()
        .unwrap()
        .values()
        .map(|p| p["errors"].as_u64().unwrap())
        .sum();
    assert_eq!(errors, 0, "{peers}");
}

/// Requests one node sent to other members (its forwarding), by its stats.
fn forwarded_requests(server: &ServerProcess) -> u64 {
    server.stats()["cluster"]["peers"]
        .as_object()
        .map_or(0, |peers| {
            peers
                .values()
                .map(|p| p["requests"].as_u64().unwrap())
                .sum()
        })
}

#[test]
fn a_routing_client_sends_each_key_to_its_owners() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path(), 1);
    let mut nodes: Vec<ServerProcess> = (1..=3)
        .map(|i| node(&dir.path().join(format!("node{i}")), &etcd, &[]))
        .collect();
    let refs: Vec<&ServerProcess> = nodes.iter().collect();
    wait_for_members(&refs, 3, Duration::from_secs(20));
    let routing = ClientOptions {
        route: true,
        ..options()
    };
    let mut routed = Client::connect_with(&nodes[0].tcp_url(), routing).unwrap();
    let view = routed.cluster_view().unwrap();
    assert_eq!(view["members"].as_array().unwrap().len(), 3, "{view}");
    let all = keys(3000);
    put_all(&mut routed, &all);
    let (hits, misses, wrong, _) = read_all(&mut routed, &all);
    assert_eq!((hits, misses, wrong), (3000, 0, 0));
    // Every key went straight to its owner: no node forwarded anything,
    // and each holds its share.
    let held: Vec<u64> = nodes
        .iter()
        .map(|s| s.stats()["store"]["entries"].as_u64().unwrap())
        .collect();
    assert_eq!(held.iter().sum::<u64>(), 3000, "{held:?}");
    assert!(held.iter().all(|&h| h > 800), "{held:?}");
    for s in &nodes {
        assert_eq!(forwarded_requests(s), 0, "a node forwarded");
    }
    // A forwarding client through another node sees the same cache.
    let mut plain = Client::connect_with(&nodes[1].unix_url(), options()).unwrap();
    assert_eq!(read_all(&mut plain, &all).0, 3000);
    let mut with_gap = all[..1000].to_vec();
    with_gap.push(b"never-stored".to_vec());
    with_gap.extend_from_slice(&all[1000..]);
    assert_eq!(routed.prefix_len(&all).unwrap(), 3000);
    assert_eq!(routed.prefix_len(&with_gap).unwrap(), 1000);
    let present = routed.batch_exists(&with_gap).unwrap();
    assert_eq!(present.iter().filter(|&&p| p).count(), 3000);
    assert!(!present[1000]);
    // A bad key fails the call, not a member: the next call still hits.
    let bad: Vec<&[u8]> = vec![b"block-000000", b""];
    assert!(routed.batch_exists(&bad).is_err());
    assert_eq!(read_all(&mut routed, &all[..256]).0, 256);
    assert!(routed.remove(&all[0]).unwrap());
    assert!(!routed.remove(&all[0]).unwrap());
    assert_eq!(plain.batch_exists(&all[..1]).unwrap(), vec![false]);

    // SIGKILL node 3: its keys are misses for the routing client (no
    // hang, no wrong bytes), before and after the others' views drop it.
    let owned_by_3 = held[2] as usize;
    nodes[2].signal(libc::SIGKILL);
    nodes[2].wait();
    let (hits, misses, wrong, slowest) = read_all(&mut routed, &all);
    eprintln!(
        "routing client, node 3 killed: {hits} hits, {misses} misses, slowest batch {slowest:?}"
    );
    assert_eq!(wrong, 0);
    assert!(misses >= owned_by_3, "node 3's keys read as misses");
    assert!(slowest < Duration::from_secs(5), "a call hung: {slowest:?}");
    wait_for_members(&[&nodes[0], &nodes[1]], 2, Duration::from_secs(15));
    // The client asks for the member list again a second after the last.
    std::thread::sleep(Duration::from_millis(1200));
    let (hits_after, _, wrong, _) = read_all(&mut routed, &all);
    assert_eq!(wrong, 0);
    // Node 3's keys now map to the others, which never held them.
    assert_eq!(hits_after, hits);
    assert_eq!(
        routed.cluster_view().unwrap()["members"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
    // Puts after the view dropped node 3 all land on live members.
    let fresh: Vec<Vec<u8>> = (0..500)
        .map(|i| format!("after-{i}").into_bytes())
        .collect();
    put_all(&mut routed, &fresh);
    assert_eq!(read_all(&mut routed, &fresh).0, 500);

    // The client's own server dies: the client carries on with the member
    // that is left, asking it for the member list from then on.
    let on_node_2 = nodes[1].stats()["store"]["entries"].as_u64().unwrap();
    nodes[0].signal(libc::SIGKILL);
    nodes[0].wait();
    wait_for_members(&[&nodes[1]], 1, Duration::from_secs(15));
    std::thread::sleep(Duration::from_millis(1200));
    let started = Instant::now();
    let (hits, _, wrong, slowest) = read_all(&mut routed, &fresh);
    eprintln!(
        "routing client, its own server killed: {hits} of 500 hit on the member left, slowest batch {slowest:?}, {:?} in all",
        started.elapsed()
    );
    assert_eq!(wrong, 0);
    assert!(
        hits > 100 && hits < 500,
        "{hits} (node 2 held {on_node_2} keys)"
    );
    let later: Vec<Vec<u8>> = (0..300)
        .map(|i| format!("later-{i}").into_bytes())
        .collect();
    put_all(&mut routed, &later);
    assert_eq!(
        read_all(&mut routed, &later).0,
        300,
        "all on the member left"
    );
}

/// Writes `value` under `key` in etcd, as anyone who can write to etcd can.
fn etcd_put(etcd: &Etcd, key: &str, value: &[u8]) {
    let status = Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .args(["--endpoints", &etcd.endpoints(), "put", key])
        .arg(String::from_utf8(value.to_vec()).unwrap())
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
}

/// Waits (bounded) until `node` lists a member with `id`.
fn wait_for_member(node: &ServerProcess, id: &str) -> Vec<Member> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let seen = members_seen(node);
        if seen.iter().any(|m| m.id == id) {
            return seen;
        }
        assert!(Instant::now() < deadline, "{id} never showed: {seen:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Member records are signed with a key derived from the cluster's token:
/// a writer to etcd without the token cannot add a member (unsigned as
/// before, or signed with another token), cannot move a genuine record
/// to another id's key, and even a validly signed record claiming a huge
/// capacity is weighed at most 4 times the median.
#[test]
fn forged_member_records_are_ignored_and_capacities_capped() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path(), 1);
    let nodes: Vec<ServerProcess> = (1..=2)
        .map(|i| node(&dir.path().join(format!("node{i}")), &etcd, &[]))
        .collect();
    let refs: Vec<&ServerProcess> = nodes.iter().collect();
    wait_for_members(&refs, 2, Duration::from_secs(20));
    let real = members_seen(&nodes[1]);
    let victim = real
        .iter()
        .find(|m| m.address == nodes[0].tcp)
        .unwrap()
        .clone();
    let ours = kvtier_wire::proof::member_record_key(common::TEST_TOKEN.as_bytes());
    let theirs = kvtier_wire::proof::member_record_key(b"an-attackers-own-token-0123");
    let evil = Member {
        id: "evil".into(),
        address: "127.0.0.1:1".into(),
        capacity: u64::MAX / 2,
        ..victim.clone()
    };
    // Unsigned (what every record was before), signed with another token,
    // and the victim's id at another key with a genuine-looking signature
    // for the victim's own key.
    etcd_put(
        &etcd,
        "/kvtier/test/members/evil",
        &serde_json::to_vec(&evil).unwrap(),
    );
    etcd_put(
        &etcd,
        "/kvtier/test/members/evil2",
        &kvtier_wire::cluster::sign_member(
            &theirs,
            "/kvtier/test/members/evil2",
            &Member {
                id: "evil2".into(),
                ..evil.clone()
            },
        ),
    );
    let impostor = Member {
        address: "127.0.0.1:1".into(),
        ..victim.clone()
    };
    etcd_put(
        &etcd,
        "/kvtier/test/members/zz-impostor",
        &kvtier_wire::cluster::sign_member(
            &ours,
            &format!("/kvtier/test/members/{}", victim.id),
            &impostor,
        ),
    );
    // Then a record the cluster's token signed (as a member would), with
    // a huge capacity: once it shows, the forged ones had their chance.
    let big = Member {
        id: "big".into(),
        ..evil.clone()
    };
    etcd_put(
        &etcd,
        "/kvtier/test/members/big",
        &kvtier_wire::cluster::sign_member(&ours, "/kvtier/test/members/big", &big),
    );
    for node in &nodes {
        let seen = wait_for_member(node, "big");
        let ids: Vec<&str> = seen.iter().map(|m| m.id.as_str()).collect();
        assert_eq!(ids.len(), 3, "forged records were taken: {seen:?}");
        assert!(
            !ids.contains(&"evil") && !ids.contains(&"evil2"),
            "{seen:?}"
        );
        let victim_seen = seen.iter().find(|m| m.id == victim.id).unwrap();
        assert_eq!(
            victim_seen.address, victim.address,
            "an impostor replaced {}",
            victim.id
        );
        let big_seen = seen.iter().find(|m| m.id == "big").unwrap();
        assert!(
            big_seen.capacity <= 4 * victim.capacity,
            "a capacity of {} was taken as it is",
            big_seen.capacity
        );
    }
}

/// A member record whose address now belongs to someone else (a replayed
/// old record, a port taken over after a member died): the node dials it
/// but the squatter cannot prove it holds the token, so the node sends it
/// neither the token nor any request, and its keys are misses, never the
/// squatter's bytes.
#[test]
fn a_squatter_at_a_members_address_never_sees_the_token() {
    use kvtier_wire::protocol::{Header, Op, HEADER_LEN};
    use std::io::{Read, Write};
    use std::sync::{Arc, Mutex};
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path(), 1);
    let n1 = node(&dir.path().join("node1"), &etcd, &[]);
    wait_for_members(&[&n1], 1, Duration::from_secs(20));
    let all = keys(400);
    let mut client = Client::connect_with(&n1.tcp_url(), options()).unwrap();
    put_all(&mut client, &all);
    // The squatter: answers a challenge with a proof it cannot make, and
    // anything else by closing; keeps every byte it receives.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let received = Arc::new(Mutex::new(Vec::<u8>::new()));
    let ops = Arc::new(Mutex::new(Vec::<u16>::new()));
    {
        let (received, ops) = (Arc::clone(&received), Arc::clone(&ops));
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut s) = stream else { return };
                let (received, ops) = (Arc::clone(&received), Arc::clone(&ops));
                std::thread::spawn(move || loop {
                    let mut head = [0u8; HEADER_LEN];
                    if s.read_exact(&mut head).is_err() {
                        return;
                    }
                    let header = Header::decode(&head, 1 << 20).unwrap();
                    let mut body = vec![0u8; header.body_len as usize];
                    if s.read_exact(&mut body).is_err() {
                        return;
                    }
                    received.lock().unwrap().extend_from_slice(&head);
                    received.lock().unwrap().extend_from_slice(&body);
                    ops.lock().unwrap().push(header.op);
                    if header.op != Op::Challenge as u16 {
                        return;
                    }
                    let reply = common::frame(Op::Challenge, header.request_id, &[0x55; 64]);
                    if s.write_all(&reply).is_err() {
                        return;
                    }
                });
            }
        });
    }
    let ours = kvtier_wire::proof::member_record_key(common::TEST_TOKEN.as_bytes());
    let me = members_seen(&n1)[0].clone();
    let squatter = Member {
        id: "squatter".into(),
        address: address.clone(),
        ..me.clone()
    };
    etcd_put(
        &etcd,
        "/kvtier/test/members/squatter",
        &kvtier_wire::cluster::sign_member(&ours, "/kvtier/test/members/squatter", &squatter),
    );
    let members = wait_for_member(&n1, "squatter");
    let owned: Vec<usize> = (0..all.len())
        .filter(|&i| owners(key_hash("", &all[i]), &members, 1)[0].id == "squatter")
        .collect();
    assert!(owned.len() > 50, "the squatter owns {} keys", owned.len());
    let owned_keys: Vec<Vec<u8>> = owned.iter().map(|&i| all[i].clone()).collect();
    let mut bufs: Vec<Vec<u8>> = owned.iter().map(|_| vec![0u8; VALUE_LEN]).collect();
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let results = client.batch_get_into(&owned_keys, &mut slices).unwrap();
    for ((result, buf), &i) in results.into_iter().zip(&bufs).zip(&owned) {
        match result {
            Ok(Some(n)) => assert!(
                n == VALUE_LEN && *buf == value(i, VALUE_LEN),
                "key {i}: served bytes that are not its value"
            ),
            Ok(None) => {}
            Err(e) => panic!("key {i}: {e} (a member that cannot prove itself is a miss)"),
        }
    }
    let received = received.lock().unwrap().clone();
    let ops = ops.lock().unwrap().clone();
    assert!(!ops.is_empty(), "the node never dialled the squatter");
    assert!(
        ops.iter().all(|&op| op == Op::Challenge as u16),
        "the node sent the squatter more than challenges: ops {ops:?}"
    );
    let token = common::TEST_TOKEN.as_bytes();
    assert!(
        !received.windows(token.len()).any(|w| w == token),
        "the token crossed the wire to the squatter"
    );
}

/// Issue 39, finding 1: a process without the token on a dead member's
/// address that relays everything to a live member (so the live member
/// answers the challenge for it) is refused: the challenge names the
/// member the node dialled, the live member proves its own id, and the
/// node sends nothing after the challenge. Before, the relay passed the
/// hello and carried the node's gets and puts.
#[test]
fn a_relay_on_a_dead_members_address_cannot_borrow_a_live_members_proof() {
    use kvtier_wire::protocol::{Header, Op, HEADER_LEN};
    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::sync::{Arc, Mutex};
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path(), 1);
    let n1 = node(&dir.path().join("node1"), &etcd, &[]);
    let n2 = node(&dir.path().join("node2"), &etcd, &[]);
    wait_for_members(&[&n1, &n2], 2, Duration::from_secs(20));
    // The relay: every frame from the dialling node goes to n2 (ops kept),
    // every byte back goes to the node unchanged.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let ops = Arc::new(Mutex::new(Vec::<u16>::new()));
    {
        let (ops, target) = (Arc::clone(&ops), n2.tcp.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut from_node) = stream else { return };
                let Ok(mut to_live) = TcpStream::connect(&target) else {
                    return;
                };
                let (mut back_from, mut back_to) =
                    (to_live.try_clone().unwrap(), from_node.try_clone().unwrap());
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut back_from, &mut back_to);
                    let _ = back_to.shutdown(std::net::Shutdown::Both);
                });
                let ops = Arc::clone(&ops);
                std::thread::spawn(move || loop {
                    let mut head = [0u8; HEADER_LEN];
                    if from_node.read_exact(&mut head).is_err() {
                        let _ = to_live.shutdown(std::net::Shutdown::Both);
                        return;
                    }
                    let header = Header::decode(&head, 1 << 30).unwrap();
                    let mut body = vec![0u8; header.body_len as usize];
                    if from_node.read_exact(&mut body).is_err() {
                        return;
                    }
                    ops.lock().unwrap().push(header.op);
                    if to_live.write_all(&head).is_err() || to_live.write_all(&body).is_err() {
                        return;
                    }
                });
            }
        });
    }
    let ours = kvtier_wire::proof::member_record_key(common::TEST_TOKEN.as_bytes());
    let me = members_seen(&n1)[0].clone();
    let dead = Member {
        id: "dead-member".into(),
        address,
        ..me.clone()
    };
    etcd_put(
        &etcd,
        "/kvtier/test/members/dead-member",
        &kvtier_wire::cluster::sign_member(&ours, "/kvtier/test/members/dead-member", &dead),
    );
    let members = wait_for_member(&n1, "dead-member");
    let all = keys(400);
    let owned: Vec<Vec<u8>> = all
        .iter()
        .filter(|k| owners(key_hash("", k), &members, 1)[0].id == "dead-member")
        .cloned()
        .collect();
    assert!(
        owned.len() > 50,
        "the dead member owns {} keys",
        owned.len()
    );
    let mut client = Client::connect_with(&n1.tcp_url(), options()).unwrap();
    // Puts of its keys are not forwarded through the relay, gets of them
    // are misses.
    for chunk in owned.chunks(16) {
        let values: Vec<Vec<u8>> = chunk.iter().map(|_| vec![7u8; VALUE_LEN]).collect();
        let _ = client.batch_put(chunk, &values).unwrap();
    }
    let mut bufs: Vec<Vec<u8>> = owned.iter().map(|_| vec![0u8; VALUE_LEN]).collect();
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    for result in client.batch_get_into(&owned, &mut slices).unwrap() {
        assert!(
            matches!(result, Ok(None)),
            "a key of the relayed member: {result:?} (a member that cannot prove itself is a miss)"
        );
    }
    let ops = ops.lock().unwrap().clone();
    assert!(!ops.is_empty(), "the node never dialled the relay");
    assert!(
        ops.iter().all(|&op| op == Op::Challenge as u16),
        "the node went on past the challenge through the relay: ops {ops:?}"
    );
    // The live member's own keys still go to it, proven as itself.
    let live = members
        .iter()
        .find(|m| m.address == n2.tcp)
        .expect("n2's record")
        .id
        .clone();
    let theirs: Vec<Vec<u8>> = all
        .iter()
        .filter(|k| owners(key_hash("", k), &members, 1)[0].id == live)
        .cloned()
        .collect();
    assert!(!theirs.is_empty());
    let forwarded_before = forwarded_requests(&n1);
    put_all(&mut client, &theirs);
    let mut direct = Client::connect_with(&n2.tcp_url(), options()).unwrap();
    for k in &theirs {
        assert!(
            direct.get(k).unwrap().is_some(),
            "{k:?} was not forwarded to its owner"
        );
    }
    assert!(forwarded_requests(&n1) > forwarded_before);
}

/// One etcd on loopback, started with `args` on top of the basics.
fn single_etcd(dir: &Path, client_url: &str, args: &[&str]) -> Child {
    let log = std::fs::File::create(dir.join("etcd.log")).unwrap();
    let peer = format!("http://127.0.0.1:{}", free_port());
    Command::new(etcd_binary())
        .args([
            "--name",
            "solo",
            "--data-dir",
            dir.join("solo").to_str().unwrap(),
            "--listen-client-urls",
            client_url,
            "--advertise-client-urls",
            client_url,
            "--listen-peer-urls",
            &peer,
            "--initial-advertise-peer-urls",
            &peer,
            "--initial-cluster",
            &format!("solo={peer}"),
        ])
        .args(args)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start etcd")
}

/// Waits (bounded) until `node` lists `n` members; false if it never did.
fn sees_members(node: &ServerProcess, n: usize, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if members_seen(node).len() == n {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}

/// etcd over TLS with client certificates, and etcd's own users: a node
/// with the right CA, certificate or password registers and `cluster
/// status` lists it; one without cannot; plain http:// off loopback is
/// refused at start.
#[test]
fn etcd_over_tls_with_client_certificates_and_users() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = common::tls_files(dir.path());
    let url = format!("https://127.0.0.1:{}", free_port());
    let cert_s = cert.to_str().unwrap();
    let key_s = key.to_str().unwrap();
    let ca_s = ca.to_str().unwrap();
    let mut etcd = single_etcd(
        dir.path(),
        &url,
        &[
            "--cert-file",
            cert_s,
            "--key-file",
            key_s,
            "--client-cert-auth",
            "--trusted-ca-file",
            ca_s,
        ],
    );
    let tls_args = [
        "--etcd-ca",
        ca_s,
        "--etcd-cert",
        cert_s,
        "--etcd-key",
        key_s,
    ];
    let with_tls = |name: &str, extra: &[&str]| node_at(&dir.path().join(name), &url, extra);
    let n1 = with_tls("node1", &tls_args);
    assert!(
        sees_members(&n1, 1, Duration::from_secs(20)),
        "a node with the CA and a client certificate did not register over TLS"
    );
    // Without a client certificate etcd refuses the node.
    let n2 = with_tls("node2", &tls_args[..2]);
    assert!(
        !sees_members(&n2, 1, Duration::from_secs(5)),
        "a node without a client certificate registered"
    );
    assert!(!sees_members(&n1, 2, Duration::from_millis(500)));
    let status = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args([
            "cluster",
            "status",
            "--etcd",
            &url,
            "--cluster",
            "test",
            "--json",
        ])
        .args(tls_args)
        .env("KVTIER_AUTH_TOKEN", common::TEST_TOKEN)
        .output()
        .unwrap();
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    let listed: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(listed.as_array().unwrap().len(), 1, "{listed}");
    drop((n1, n2));
    let _ = etcd.kill();
    let _ = etcd.wait();

    // etcd's users, on a loopback etcd: the right password registers.
    let plain_dir = dir.path().join("users");
    std::fs::create_dir(&plain_dir).unwrap();
    let url = format!("http://127.0.0.1:{}", free_port());
    let mut etcd = single_etcd(&plain_dir, &url, &[]);
    let etcdctl = |args: &[&str]| {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let ok = Command::new("etcdctl")
                .env("ETCDCTL_API", "3")
                .args(["--endpoints", &url])
                .args(args)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .unwrap()
                .success();
            if ok {
                return;
            }
            assert!(Instant::now() < deadline, "etcdctl {args:?} kept failing");
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    etcdctl(&["user", "add", "root", "--new-user-password", "root-pw"]);
    etcdctl(&["user", "add", "kvtier", "--new-user-password", "s3cret-pw"]);
    etcdctl(&["role", "add", "kvtier"]);
    etcdctl(&[
        "role",
        "grant-permission",
        "kvtier",
        "--prefix=true",
        "readwrite",
        "/kvtier/",
    ]);
    etcdctl(&["user", "grant-role", "kvtier", "kvtier"]);
    etcdctl(&["auth", "enable"]);
    let password = plain_dir.join("etcd-password");
    std::fs::write(&password, "s3cret-pw\n").unwrap();
    std::fs::set_permissions(
        &password,
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    let with_user = |name: &str, extra: &[&str]| node_at(&plain_dir.join(name), &url, extra);
    let n3 = with_user(
        "node3",
        &[
            "--etcd-user",
            "kvtier",
            "--etcd-password-file",
            password.to_str().unwrap(),
        ],
    );
    assert!(
        sees_members(&n3, 1, Duration::from_secs(20)),
        "a node with etcd's user and password did not register"
    );
    let n4 = with_user("node4", &[]);
    assert!(
        !sees_members(&n4, 1, Duration::from_secs(5)),
        "a node without etcd's password registered"
    );
    drop((n3, n4));
    let _ = etcd.kill();
    let _ = etcd.wait();

    // Plain text off loopback: refused before anything is sent.
    let refused = ServerProcess::try_start(
        &dir.path().join("node5"),
        &["--cluster", "test", "--etcd", "http://10.255.255.1:2379"],
    );
    assert!(refused.contains("--etcd-allow-plaintext"), "{refused}");
}

/// A client cycling made-up namespaces on one node cannot fill another
/// node's connection slots through the forwarding pool: idle peer
/// connections are bounded per member (and closed after 30 s idle).
#[test]
fn made_up_namespaces_do_not_pile_up_peer_connections() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path(), 1);
    let a = node(&dir.path().join("a"), &etcd, &[]);
    let b = node(&dir.path().join("b"), &etcd, &[]);
    wait_for_members(&[&a, &b], 2, Duration::from_secs(20));
    let before = b.stats()["server"]["connections"].as_u64().unwrap();
    for i in 0..200 {
        let options = ClientOptions {
            namespace: format!("made-up-{i}"),
            shm_size: 0,
            ..options()
        };
        let mut client = Client::connect_with(&a.tcp_url(), options).unwrap();
        // Eight keys: some are b's, so a forwards them in this namespace.
        let keys = keys(8);
        let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; 16]).collect();
        let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        for result in client.batch_get_into(&keys, &mut slices).unwrap() {
            assert!(result.unwrap().is_none());
        }
    }
    let after = b.stats()["server"]["connections"].as_u64().unwrap();
    eprintln!("node b's connections: {before} before, {after} after 200 namespaces through a");
    assert!(
        after <= before + 20,
        "200 made-up namespaces left {after} connections open on b (before: {before})"
    );
    // b still serves its own clients.
    let mut own = Client::connect_with(&b.tcp_url(), options()).unwrap();
    own.flush().unwrap();
}

/// Cluster mode over a shared directory: puts land on the node that got
/// them (nothing is forwarded), every member reads every member's flushed
/// blocks from the shared files, and when a member dies for good a
/// surviving member collects its log (etcd says who is dead; the writer's
/// lock on the file system lets one collector in).
#[test]
fn members_share_a_directory_and_collect_a_dead_members_log() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path(), 3);
    let shared = dir.path().join("shared");
    let shared = shared.display().to_string();
    let extra = ["--shared-dir", &shared, "--adopt-after", "1"];
    let a = node(&dir.path().join("a"), &etcd, &extra);
    let c = node(&dir.path().join("c"), &etcd, &extra);
    let mut b = node(&dir.path().join("b"), &etcd, &extra);
    wait_for_members(&[&a, &b, &c], 3, Duration::from_secs(30));
    let b_id = b.stats()["cluster"]["node_id"]
        .as_str()
        .unwrap()
        .to_string();
    let keys = keys(300);
    let mut on_b = Client::connect_with(&b.tcp_url(), options()).unwrap();
    put_all(&mut on_b, &keys);
    on_b.flush().unwrap();
    let stat = |s: &ServerProcess, name: &str| s.stats()["store"][name].as_u64().unwrap();
    assert_eq!(
        stat(&b, "puts"),
        300,
        "every put stays on the node that got it"
    );
    assert_eq!(stat(&a, "puts") + stat(&c, "puts"), 0);
    for reader in [&a, &c] {
        reads_every_block_once_followed(reader, &keys);
        assert_eq!(forwarded_requests(reader), 0, "nothing is forwarded");
    }
    assert!(stat(&a, "shared_reads") >= 300);
    b.signal(libc::SIGKILL);
    b.wait();
    let b_dir = Path::new(&shared).join("nodes").join(&b_id);
    let started = Instant::now();
    while b_dir.exists() {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "no member collected the dead member's log"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    println!(
        "dead member's log collected {:.1} s after its kill (lease {LEASE_TTL} s, adopt-after 1 s)",
        started.elapsed().as_secs_f64()
    );
    let mut on_a = Client::connect_with(&a.tcp_url(), options()).unwrap();
    let started = Instant::now();
    while on_a.prefix_len(&keys[..1]).unwrap() > 0 {
        assert!(started.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(20));
    }
    let (hits, _, wrong, _) = read_all(&mut on_a, &keys);
    assert_eq!((hits, wrong), (0, 0));
}

/// Waits (20 s at most) until `reader` finds every key, then reads them
/// all: every one a hit with its own bytes.
fn reads_every_block_once_followed(reader: &ServerProcess, keys: &[Vec<u8>]) {
    let mut client = Client::connect_with(&reader.tcp_url(), options()).unwrap();
    let started = Instant::now();
    while client.prefix_len(keys).unwrap() < keys.len() {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the other node's blocks never showed"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let (hits, misses, wrong, _) = read_all(&mut client, keys);
    assert_eq!((hits, misses, wrong), (keys.len(), 0, 0));
}

/// The bounded index mode (`--shared-index share`): each member indexes
/// only its share of the other writers' blocks (the index of a directory
/// past one node's memory), a read it misses asks the member whose share
/// holds the key, every block reads right through every member, and a
/// removal through any member wins on all of them.
#[test]
fn members_in_the_bounded_index_mode_share_the_index_and_ask_each_other() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path(), 3);
    let shared = dir.path().join("shared");
    let shared = shared.display().to_string();
    let extra = ["--shared-dir", &shared, "--shared-index", "share"];
    let a = node(&dir.path().join("a"), &etcd, &extra);
    let b = node(&dir.path().join("b"), &etcd, &extra);
    let c = node(&dir.path().join("c"), &etcd, &extra);
    wait_for_members(&[&a, &b, &c], 3, Duration::from_secs(30));
    let keys = keys(300);
    let mut on_b = Client::connect_with(&b.tcp_url(), options()).unwrap();
    put_all(&mut on_b, &keys);
    on_b.flush().unwrap();
    let stat = |s: &ServerProcess, name: &str| s.stats()["store"][name].as_u64().unwrap();
    assert_eq!(stat(&b, "puts"), 300, "puts stay on the node that got them");
    for reader in [&a, &c] {
        reads_every_block_once_followed(reader, &keys);
        assert_eq!(reader.stats()["store"]["shared_index_share"], true);
    }
    // Each of A and C indexes its share of B's blocks, not all of them
    // (B indexes its own log whole); what is outside a share was asked of
    // its owner.
    let (in_a, in_c) = (stat(&a, "entries"), stat(&c, "entries"));
    assert!(
        in_a > 0 && in_c > 0 && in_a + in_c < 300,
        "A {in_a}, C {in_c}"
    );
    assert!(stat(&a, "shared_outside_share") > 0);
    assert!(forwarded_requests(&a) > 0 && forwarded_requests(&c) > 0);
    println!("bounded index: A holds {in_a}, C {in_c} of B's 300 blocks");
    // Removes through A: misses through every member.
    let mut on_a = Client::connect_with(&a.tcp_url(), options()).unwrap();
    for key in &keys[..30] {
        on_a.remove(key).unwrap();
    }
    for reader in [&a, &b, &c] {
        let mut client = Client::connect_with(&reader.tcp_url(), options()).unwrap();
        let started = Instant::now();
        while client.batch_exists(&keys[..30]).unwrap().iter().any(|e| *e) {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "a removal never reached a member"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let (hits, misses, wrong, _) = read_all(&mut client, &keys);
        assert_eq!((hits, misses, wrong), (270, 30, 0));
    }
}

/// Issue 39, finding 7 (routed gets): gets of absent keys with large
/// rooms, repeated on two connections, held a node's whole buffer budget
/// (its reply staging was sized by the rooms before any member answered),
/// and another client's puts got LIMIT. Now a node asks the members for
/// the lengths first when staging by room would pass 1 MiB: absent keys
/// stage nothing, present ones their length.
#[test]
fn routed_gets_stage_what_the_members_hold_not_what_the_request_asks() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    const MIB: usize = 1 << 20;
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path(), 1);
    let config = common::small_buffer_config(dir.path());
    let config = ["--config", config.to_str().unwrap()];
    let a = node(&dir.path().join("a"), &etcd, &config);
    let b = node(&dir.path().join("b"), &etcd, &config);
    wait_for_members(&[&a, &b], 2, Duration::from_secs(20));
    let absent: Vec<Vec<u8>> = (0..60)
        .map(|i| format!("absent-{i}").into_bytes())
        .collect();
    let stop = AtomicBool::new(false);
    let rounds = AtomicU64::new(0);
    let buffer_bytes = std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                let mut client = Client::connect_with(&a.tcp_url(), options()).unwrap();
                let mut bufs: Vec<Vec<u8>> = absent.iter().map(|_| vec![0u8; MIB]).collect();
                while !stop.load(Ordering::Acquire) {
                    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
                    for result in client.batch_get_into(&absent, &mut slices).unwrap() {
                        assert_eq!(result.unwrap(), None);
                    }
                    rounds.fetch_add(1, Ordering::AcqRel);
                }
            });
        }
        let started = Instant::now();
        while rounds.load(Ordering::Acquire) < 6 {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "the gets did not run"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let held = a.stats()["budgets"]["buffer_bytes"].as_u64();
        // While they run: another client's 1 MiB puts.
        let mut other = Client::connect_with(&a.tcp_url(), options()).unwrap();
        let keys: Vec<Vec<u8>> = (0..8).map(|i| format!("put-{i}").into_bytes()).collect();
        let values: Vec<Vec<u8>> = (0..8).map(|i| value(i, MIB)).collect();
        let results = other.batch_put(&keys, &values).unwrap();
        let refused = results.iter().filter(|r| r.is_err()).count();
        stop.store(true, Ordering::Release);
        assert_eq!(refused, 0, "puts refused while the gets ran: {results:?}");
        held
    });
    let held = buffer_bytes.expect("budgets.buffer_bytes in node a's /stats");
    eprintln!("node a's buffers while the gets of absent keys ran: {held} bytes");
    assert!(held < 4 * MIB as u64, "{held} bytes staged for absent keys");
    // Present keys (on both members) with rooms far above their length:
    // exact bytes back, staged by their length.
    let present = keys(40);
    let mut client = Client::connect_with(&a.tcp_url(), options()).unwrap();
    let values: Vec<Vec<u8>> = (0..40).map(|i| value(i, 8 << 10)).collect();
    for r in client.batch_put(&present, &values).unwrap() {
        r.unwrap();
    }
    let mut bufs: Vec<Vec<u8>> = present.iter().map(|_| vec![0u8; MIB]).collect();
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let got = client.batch_get_into(&present, &mut slices).unwrap();
    for (i, result) in got.into_iter().enumerate() {
        assert_eq!(result.unwrap(), Some(8 << 10), "key {i}");
        assert_eq!(&bufs[i][..8 << 10], &values[i][..], "key {i}");
    }
    // Rooms smaller than the values (keys of both members): each
    // BUFFER_TOO_SMALL says the value's length, across the hop too.
    let mut small: Vec<[u8; 100]> = present.iter().map(|_| [0u8; 100]).collect();
    let mut slices: Vec<&mut [u8]> = small.iter_mut().map(|b| &mut b[..]).collect();
    let got = client.batch_get_into(&present, &mut slices).unwrap();
    for (i, result) in got.iter().enumerate() {
        let e = result.as_ref().unwrap_err();
        assert!(
            e.to_string().contains("value is 8192 bytes"),
            "key {i}: {e}"
        );
    }
}

/// Issue 39, item 6 (cluster puts streamed to their owners): a member
/// read a routed put's whole frame into its buffer budget before sending
/// any of it on, so one slow 96 MiB put held 96 MiB of a 128 MiB budget
/// for as long as its client took, and another client's 96 MiB put was
/// refused LIMIT. Now a member reads a routed put in groups of 8 MiB and
/// sends each to its keys' owners before reading the next: the slow put
/// holds a group, the other put is stored, and so is the slow one once
/// its last byte comes; every byte on its owners.
#[test]
fn a_routed_put_holds_a_group_of_the_buffer_budget_not_its_whole_frame() {
    use kvtier_wire::protocol::Op;
    use std::io::Write;
    const MIB: usize = 1 << 20;
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path(), 1);
    let config = dir.path().join("kvtier.toml");
    std::fs::write(
        &config,
        "max_frame = \"128MiB\"\nmax_buffer_bytes = \"128MiB\"\n",
    )
    .unwrap();
    let args = ["--config", config.to_str().unwrap(), "--memory", "512MiB"];
    let a = node(&dir.path().join("a"), &etcd, &args);
    let b = node(&dir.path().join("b"), &etcd, &args);
    wait_for_members(&[&a, &b], 2, Duration::from_secs(20));
    // The slow put: 24 values of 4 MiB, every byte sent but the last.
    let slow_keys: Vec<Vec<u8>> = (0..24).map(|i| format!("slow-{i}").into_bytes()).collect();
    let slow_values: Vec<Vec<u8>> = (0..24).map(|i| value(100 + i, 4 * MIB)).collect();
    let mut body = vec![0u8];
    body.extend_from_slice(&24u32.to_le_bytes());
    for (key, value) in slow_keys.iter().zip(&slow_values) {
        body.extend_from_slice(&(key.len() as u16).to_le_bytes());
        body.extend_from_slice(key);
        body.extend_from_slice(&(value.len() as u64).to_le_bytes());
        body.extend_from_slice(value);
    }
    let request = common::frame(Op::BatchPut, 2, &body);
    let mut slow = std::net::TcpStream::connect(&a.tcp).unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    slow.write_all(&common::frame(
        Op::Hello,
        1,
        &common::hello_body(common::TEST_TOKEN, ""),
    ))
    .unwrap();
    assert_eq!(common::read_reply(&mut slow).0, 0, "hello refused");
    slow.write_all(&request[..request.len() - 1]).unwrap();
    // `write_all` returned: the member has read all of it but what the
    // two sockets' buffers hold (a few MiB).
    let held = a.stats()["budgets"]["buffer_bytes"].as_u64().unwrap();
    eprintln!("member a's buffers while a 96 MiB put waits for its last byte: {held} bytes");
    assert!(
        held <= 20 * MIB as u64,
        "member a holds {held} bytes for the slow put"
    );
    // Meanwhile another client's 96 MiB put.
    let keys = keys(24);
    let values: Vec<Vec<u8>> = (0..24).map(|i| value(i, 4 * MIB)).collect();
    let mut client = Client::connect_with(&a.tcp_url(), options()).unwrap();
    let results = client.batch_put(&keys, &values).unwrap();
    let stored = results.iter().filter(|r| r.is_ok()).count();
    assert_eq!(stored, 24, "while a slow put waited: {results:?}");
    assert!(forwarded_requests(&a) > 0, "no key went to member b");
    // The slow put's last byte: it is stored too.
    slow.write_all(&request[request.len() - 1..]).unwrap();
    let (status, reply) = common::read_reply(&mut slow);
    assert_eq!(status, 0, "{}", String::from_utf8_lossy(&reply));
    assert_eq!(&reply[..4], &24u32.to_le_bytes());
    assert!(reply[4..].chunks(4).all(|c| c == [0, 0, 0, 0]), "{reply:?}");
    // Every value, whole, read through the other member.
    let mut reader = Client::connect_with(&b.tcp_url(), options()).unwrap();
    for (key, value) in keys
        .iter()
        .zip(&values)
        .chain(slow_keys.iter().zip(&slow_values))
    {
        let got = reader.get(key).unwrap();
        assert!(
            got.as_deref() == Some(&value[..]),
            "{}",
            String::from_utf8_lossy(key)
        );
    }
}
