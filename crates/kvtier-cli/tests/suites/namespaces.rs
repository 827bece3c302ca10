//! Namespaces an operator can see and retire, against the real `kvtier
//! serve` with tenants: each credential lists only its own namespaces, a
//! manifest keeps when it was first described, a retirement removes a
//! whole namespace durably (after a restart too) and nothing else, and the
//! `kvtier namespaces` command does both.

use crate::common::{as_tenant, kvtier_binary, options, ServerProcess, TEST_TOKEN};
use kvtier_client::Client;
use serde_json::Value;
use std::os::unix::fs::PermissionsExt;

const TOKEN_A: &str = "tenant-a-token-0123456789abcdef";
const TOKEN_B: &str = "tenant-b-token-0123456789abcdef";

fn client(server: &ServerProcess, token: &str, namespace: &str) -> Client {
    Client::connect_with(&server.tcp_url(), as_tenant(token, namespace)).unwrap()
}

fn put_blocks(c: &mut Client, n: u32, len: usize) {
    let keys: Vec<Vec<u8>> = (0..n).map(|i| format!("block-{i}").into_bytes()).collect();
    let values: Vec<Vec<u8>> = keys
        .iter()
        .map(|k| kvtier::pattern::value(k, len))
        .collect();
    for r in c.batch_put(&keys, &values).unwrap() {
        r.unwrap();
    }
}

/// Name -> (blocks, bytes, manifest) of a listing.
fn listed(c: &mut Client) -> std::collections::BTreeMap<String, (u64, u64, Value)> {
    let doc = c.namespaces().unwrap();
    doc["namespaces"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            (
                n["name"].as_str().unwrap().to_owned(),
                (
                    n["blocks"].as_u64().unwrap(),
                    n["bytes"].as_u64().unwrap(),
                    n["manifest"].clone(),
                ),
            )
        })
        .collect()
}

fn run_cli(server: &ServerProcess, args: &[&str]) -> String {
    let out = std::process::Command::new(kvtier_binary())
        .arg("namespaces")
        .args(args)
        .args(["--url", &server.unix_url()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kvtier namespaces {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn each_credential_lists_its_namespaces_and_a_retirement_removes_one_whole_namespace_for_good() {
    let dir = tempfile::tempdir().unwrap();
    let tenants = dir.path().join("tenants.toml");
    std::fs::write(
        &tenants,
        format!(
            "[[tenant]]\nname = \"a\"\ntoken = \"{TOKEN_A}\"\nnamespaces = [\"tenant-a/\"]\n\n\
             [[tenant]]\nname = \"b\"\ntoken = \"{TOKEN_B}\"\nnamespaces = [\"tenant-b/\"]\n"
        ),
    )
    .unwrap();
    std::fs::set_permissions(&tenants, std::fs::Permissions::from_mode(0o600)).unwrap();
    let data = dir.path().join("data");
    let args = ["--tenants", tenants.to_str().unwrap()];
    let server = ServerProcess::start(&data, &args);

    let mut a1 = client(&server, TOKEN_A, "tenant-a/m1");
    let mut a2 = client(&server, TOKEN_A, "tenant-a/m2");
    let mut b1 = client(&server, TOKEN_B, "tenant-b/m1");
    put_blocks(&mut a1, 20, 3000);
    put_blocks(&mut a2, 5, 1000);
    put_blocks(&mut b1, 7, 2000);
    a1.describe_namespace(br#"{"engine":"vllm","model":"m1","dtype":"bfloat16"}"#)
        .unwrap();
    // Not a JSON object: refused, nothing stored.
    for bad in [&b"[1, 2]"[..], b"not json"] {
        let e = a2.describe_namespace(bad).unwrap_err();
        assert_eq!(e.kind(), kvtier::ErrorKind::InvalidArgument, "{e}");
    }

    // Each tenant sees its own namespaces only; the server's token all.
    let seen_by_a = listed(&mut a1);
    assert_eq!(
        seen_by_a.keys().collect::<Vec<_>>(),
        ["tenant-a/m1", "tenant-a/m2"]
    );
    assert_eq!(
        (seen_by_a["tenant-a/m1"].0, seen_by_a["tenant-a/m1"].1),
        (20, 60_000)
    );
    assert_eq!(
        (seen_by_a["tenant-a/m2"].0, seen_by_a["tenant-a/m2"].1),
        (5, 5_000)
    );
    let manifest = &seen_by_a["tenant-a/m1"].2;
    assert_eq!(manifest["model"], "m1");
    let first = manifest["first_described_unix_s"].as_u64().unwrap();
    assert!(manifest["last_described_unix_s"].as_u64().unwrap() >= first);
    assert!(seen_by_a["tenant-a/m2"].2.is_null());
    let seen_by_b = listed(&mut b1);
    assert_eq!(seen_by_b.keys().collect::<Vec<_>>(), ["tenant-b/m1"]);
    let mut admin = Client::connect_with(&server.tcp_url(), options()).unwrap();
    let everything = listed(&mut admin);
    assert_eq!(everything.len(), 3);
    // /stats holds the server's last census and each namespace's last use.
    let response = server.http_request(&format!(
        "GET /stats HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TEST_TOKEN}\r\n\r\n"
    ));
    let stats: Value = serde_json::from_str(response.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    let census = stats["namespaces"]["last_census"]["namespaces"]
        .as_array()
        .unwrap();
    assert_eq!(census.len(), 3);
    assert!(census
        .iter()
        .all(|n| n["last_used_unix_s"].as_u64().is_some()));

    // Described again: the first description's time is kept.
    a1.describe_namespace(br#"{"engine":"vllm","model":"m1","dtype":"bfloat16","v":2}"#)
        .unwrap();
    let again = &listed(&mut a1)["tenant-a/m1"].2;
    assert_eq!(again["first_described_unix_s"].as_u64(), Some(first));
    assert_eq!(again["v"], 2);

    // The CLI, as the server's own user over the Unix socket: a dry run
    // removes nothing; with --yes the namespace goes.
    let table = run_cli(&server, &["list"]);
    assert!(
        table.contains("tenant-a/m1") && table.contains("model=m1"),
        "{table}"
    );
    let dry = run_cli(&server, &["retire", "tenant-a/m2"]);
    assert!(
        dry.contains("would retire") && dry.contains("5 blocks"),
        "{dry}"
    );
    assert_eq!(listed(&mut admin)["tenant-a/m2"].0, 5);
    let done = run_cli(&server, &["retire", "tenant-a/m2", "--yes"]);
    assert!(done.contains("5 blocks"), "{done}");

    // Tenant a retires m1 through its own credential (manifest included).
    let manifest_len = a1.get(kvtier::MANIFEST_KEY).unwrap().unwrap().len() as u64;
    let retired = a1.retire_namespace().unwrap();
    assert_eq!((retired.blocks, retired.bytes), (21, 60_000 + manifest_len));
    let keys: Vec<Vec<u8>> = (0..20).map(|i| format!("block-{i}").into_bytes()).collect();
    assert!(a1.batch_exists(&keys).unwrap().iter().all(|p| !p));
    assert!(b1.batch_exists(&keys[..7]).unwrap().iter().all(|&p| p));
    assert_eq!(
        listed(&mut admin).keys().collect::<Vec<_>>(),
        ["tenant-b/m1"]
    );
    drop((a1, a2, b1, admin));

    // After a restart (clean: from the index checkpoint) they stay gone.
    server.signal(libc::SIGTERM);
    let mut server = server;
    assert!(server.wait().success());
    drop(server);
    let server = ServerProcess::start(&data, &args);
    let mut a1 = client(&server, TOKEN_A, "tenant-a/m1");
    assert!(a1.batch_exists(&keys).unwrap().iter().all(|p| !p));
    let mut admin = Client::connect_with(&server.tcp_url(), options()).unwrap();
    let after = listed(&mut admin);
    assert_eq!(after.keys().collect::<Vec<_>>(), ["tenant-b/m1"]);
    assert_eq!(
        (after["tenant-b/m1"].0, after["tenant-b/m1"].1),
        (7, 14_000)
    );
}
