//! Cluster peers' side of the soak (issue 39): with the server a member
//! of a cluster (`scripts/soak --cluster`: a one-member etcd and a second
//! kvtier member, two replicas, so the legitimate clients' gets and puts
//! are forwarded between the members all along), attackers go at what
//! peers trust:
//!
//! - `forged_member_records`: an attacker that can write etcd (no token)
//!   lists made-up members that point at a listener of its own: a record
//!   without a signature, one with a wrong signature, the other member's
//!   genuine record copied under a new key, and that record with its id
//!   and address changed. Each round also asks the server (as a token
//!   holder) for gets and puts of many keys, so that any member it had
//!   listed would be dialled. A *breach*: the server's view lists a
//!   made-up member, or anything connects to the attacker's listener.
//! - `crossed_member_proofs`: an attacker without the token (but with its
//!   public id, as anyone on the path sees it) challenges both members at
//!   once, each time naming the other as the member it meant, and hands
//!   each member's proof to the other as its hello; then the same without
//!   naming members. A *breach*: any hello answered OK.
//!
//! The other classes (`attacks.rs`, the feed's) run against the same
//! member meanwhile: in cluster mode, gets of absent keys stage replies
//! for keys the other member owns (issue 39, finding 7).

use crate::attacks::{connect, frame, hello_body, reply_status, sleep_unless};
use kvtier_client::{Client, ClientOptions};
use kvtier_wire::proof;
use kvtier_wire::protocol::{code, Header, Op, Writer, HEADER_LEN};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Cluster attack classes, in the order each attacker runs them.
pub const CLASSES: [&str; 2] = ["forged_member_records", "crossed_member_proofs"];

/// Where the soak's cluster is.
pub struct Cluster {
    /// etcd's client URL.
    pub etcd: String,
    /// The cluster's name (`--cluster`).
    pub name: String,
    /// The other member's `HOST:PORT`.
    pub peer: String,
}

impl Cluster {
    fn members_prefix(&self) -> String {
        format!("/kvtier/{}/members/", self.name)
    }

    fn etcdctl(&self, args: &[&str]) -> Option<String> {
        let out = Command::new("etcdctl")
            .arg("--endpoints")
            .arg(&self.etcd)
            .args(args)
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The genuine member records, parsed: not the ones other attackers
    /// are planting meanwhile (their ids start with `5a5a`).
    fn records(&self) -> Vec<serde_json::Value> {
        self.etcdctl(&[
            "get",
            "--prefix",
            "--print-value-only",
            &self.members_prefix(),
        ])
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|r| {
            r["signature"].is_string()
                && r["member"]["id"]
                    .as_str()
                    .is_some_and(|id| !id.starts_with("5a5a"))
        })
        .collect()
    }
}

/// Runs attack `which` once; `true` when the server let it through.
pub fn attack(
    which: usize,
    id: usize,
    round: usize,
    cluster: &Cluster,
    tcp: &str,
    token: &str,
    stop: &AtomicBool,
) -> bool {
    match which {
        0 => forged_member_records(id, round, cluster, tcp, token, stop),
        _ => crossed_member_proofs(id, cluster, tcp, token),
    }
}

fn forged_member_records(
    id: usize,
    round: usize,
    cluster: &Cluster,
    tcp: &str,
    token: &str,
    stop: &AtomicBool,
) -> bool {
    let Ok(listener) = TcpListener::bind("127.0.0.1:0") else {
        return false;
    };
    let Ok(listening) = listener.local_addr() else {
        return false;
    };
    let _ = listener.set_nonblocking(true);
    let dialled = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (dialled, done) = (Arc::clone(&dialled), Arc::clone(&done));
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok(_) => {
                        dialled.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        })
    };
    let Some(genuine) = cluster.records().into_iter().next() else {
        eprintln!("attacker {id}: forged_member_records: no member record in etcd; this round attacked nothing");
        done.store(true, Ordering::Relaxed);
        let _ = watcher.join();
        return false;
    };
    let fake = |n: u32| format!("5a5a{:012x}{:08x}{n:08x}", id, round as u32);
    let member = |fake_id: &str| {
        let mut m = genuine["member"].clone();
        m["id"] = fake_id.into();
        m["address"] = listening.to_string().into();
        m
    };
    let records = [
        // No signature at all.
        (
            fake(0),
            serde_json::json!({ "member": member(&fake(0)) }).to_string(),
        ),
        // A signature that is not the token's.
        (
            fake(1),
            serde_json::json!({ "member": member(&fake(1)), "signature": "00".repeat(32) })
                .to_string(),
        ),
        // The other member's genuine record under another key (the
        // signature binds the key).
        (fake(2), genuine.to_string()),
        // That record with its id and address changed, the genuine
        // signature kept.
        (
            fake(3),
            serde_json::json!({ "member": member(&fake(3)), "signature": genuine["signature"] })
                .to_string(),
        ),
    ];
    let prefix = cluster.members_prefix();
    for (fake_id, record) in &records {
        let _ = cluster.etcdctl(&["put", &format!("{prefix}{fake_id}"), record]);
    }
    // Gets and puts of many keys while the records are listed: a member
    // the server took would own some of them and be dialled.
    let options = ClientOptions {
        auth_token: Some(token.to_string()),
        shm_size: 0,
        namespace: format!("soak-attacker/{id}"),
        ..ClientOptions::default()
    };
    let mut listed = false;
    if let Ok(mut client) = Client::connect_with(&format!("tcp://{tcp}"), options) {
        let keys: Vec<Vec<u8>> = (0..64)
            .map(|k| format!("forged/{round}/{k}").into_bytes())
            .collect();
        let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
        let values: Vec<&[u8]> = refs.iter().map(|_| &b"forged-member-bait"[..]).collect();
        for _ in 0..3 {
            let _ = client.batch_put(&refs, &values);
            let _ = client.batch_exists(&refs);
            if let Ok(view) = client.cluster_view() {
                let members = view["members"].to_string();
                listed |= records.iter().any(|(fake_id, _)| members.contains(fake_id));
            }
            sleep_unless(stop, Duration::from_millis(500));
        }
    }
    for (fake_id, _) in &records {
        let _ = cluster.etcdctl(&["del", &format!("{prefix}{fake_id}")]);
    }
    done.store(true, Ordering::Relaxed);
    let _ = watcher.join();
    let dialled = dialled.load(Ordering::Relaxed);
    if listed || dialled > 0 {
        eprintln!(
            "attacker {id}: forged_member_records: listed {listed}, the attacker's listener \
             dialled {dialled} times"
        );
    }
    listed || dialled > 0
}

/// A Challenge's reply: the server's nonce, its proof and the member id
/// it stated (when the challenge named one).
fn challenge(
    s: &mut TcpStream,
    nonce: &[u8; proof::NONCE_LEN],
    token_id: &[u8],
    member: Option<&str>,
) -> Option<Vec<u8>> {
    let mut w = Writer::default();
    w.buf.extend_from_slice(nonce);
    w.buf.extend_from_slice(token_id);
    if let Some(m) = member {
        w.u16(m.len() as u16).bytes(m.as_bytes());
    }
    s.write_all(&frame(Op::Challenge, 1, &w.buf)).ok()?;
    let mut head = [0u8; HEADER_LEN];
    s.read_exact(&mut head).ok()?;
    let header = Header::decode(&head, 1 << 20).ok()?;
    let mut body = vec![0u8; header.body_len as usize];
    s.read_exact(&mut body).ok()?;
    (header.status == code::OK && body.len() >= 2 * proof::NONCE_LEN).then_some(body)
}

fn hello_with_proof(s: &mut TcpStream, proof: &[u8]) -> bool {
    s.write_all(&frame(Op::Hello, 2, &hello_body(proof)))
        .is_ok()
        && reply_status(s) == Some(code::OK)
}

fn crossed_member_proofs(id: usize, cluster: &Cluster, tcp: &str, token: &str) -> bool {
    let token_id = proof::TokenKey::new(token.as_bytes()).id();
    // The members' ids, as an etcd reader sees them: which one is the
    // server under test does not matter, each is named to the other.
    let ids: Vec<String> = cluster
        .records()
        .iter()
        .filter_map(|r| r["member"]["id"].as_str().map(str::to_string))
        .collect();
    if ids.len() < 2 {
        eprintln!("attacker {id}: crossed_member_proofs: fewer than two members listed; this round attacked nothing");
        return false;
    }
    let mut let_through = false;
    for named in [true, false] {
        let (Some(mut x), Some(mut y)) = (connect(tcp), connect(&cluster.peer)) else {
            return false;
        };
        let Ok(nonce_x) = proof::nonce() else {
            return false;
        };
        // Each member is asked to prove itself as the other; the nonce
        // given to the second is the first's, so its proof covers what
        // the first expects to see proven.
        let Some(from_x) = challenge(
            &mut x,
            &nonce_x,
            &token_id,
            named.then_some(ids[1].as_str()),
        ) else {
            continue;
        };
        let server_nonce_x: [u8; proof::NONCE_LEN] = from_x[..proof::NONCE_LEN].try_into().unwrap();
        let Some(from_y) = challenge(
            &mut y,
            &server_nonce_x,
            &token_id,
            named.then_some(ids[0].as_str()),
        ) else {
            continue;
        };
        let proof_x = &from_x[proof::NONCE_LEN..2 * proof::NONCE_LEN];
        let proof_y = &from_y[proof::NONCE_LEN..2 * proof::NONCE_LEN];
        let_through |= hello_with_proof(&mut x, proof_y);
        let_through |= hello_with_proof(&mut y, proof_x);
    }
    let_through
}
