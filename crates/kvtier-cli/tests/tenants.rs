//! Tokens scoped to namespace prefixes, against the real `kvtier serve`:
//! a tenant uses only its own namespaces, sees no server-wide view, and
//! the admin endpoint (every tenant's traffic) asks for the server's token.

mod common;

use common::{options, ServerProcess, TEST_TOKEN};
use kvtier_client::{Client, ClientOptions};
use std::os::unix::fs::PermissionsExt;

const TOKEN_A: &str = "tenant-a-token-0123456789abcdef";
const TOKEN_B: &str = "tenant-b-token-0123456789abcdef";

fn as_tenant(token: &str, namespace: &str) -> ClientOptions {
    ClientOptions {
        auth_token: Some(token.into()),
        namespace: namespace.into(),
        shm_size: 0,
        ..options()
    }
}

#[test]
fn a_tenant_uses_only_its_namespaces_and_sees_no_other_tenant() {
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
    let server = ServerProcess::start(&data, &["--tenants", tenants.to_str().unwrap()]);

    // Tenant a, in its own namespace, over TCP.
    let mut a =
        Client::connect_with(&server.tcp_url(), as_tenant(TOKEN_A, "tenant-a/llama")).unwrap();
    a.batch_put(&[b"block-0"], &[b"a's bytes"]).unwrap()[0]
        .as_ref()
        .unwrap();
    let mut buf = [0u8; 16];
    let got = a
        .batch_get_into(&[b"block-0"], &mut [&mut buf[..]])
        .unwrap();
    assert_eq!(got[0].as_ref().unwrap(), &Some(9));

    // Tenant a cannot name b's namespace, nor the default one.
    for namespace in ["tenant-b/llama", "", "tenant-ab"] {
        let e = Client::connect_with(&server.tcp_url(), as_tenant(TOKEN_A, namespace)).unwrap_err();
        assert!(
            e.to_string().contains("outside tenant a"),
            "{namespace:?}: {e}"
        );
    }
    // Nor see the server's statistics or the cluster view.
    assert!(a.stats().is_err(), "a tenant read the server's STATS");
    assert!(a.cluster_view().is_err(), "a tenant read the cluster view");

    // Tenant b, in its namespace, finds nothing of a's.
    let mut b =
        Client::connect_with(&server.tcp_url(), as_tenant(TOKEN_B, "tenant-b/llama")).unwrap();
    let got = b
        .batch_get_into(&[b"block-0"], &mut [&mut buf[..]])
        .unwrap();
    assert_eq!(got[0].as_ref().unwrap(), &None);

    // The server's token opens every namespace, and the statistics.
    let mut operator = Client::connect_with(
        &server.tcp_url(),
        ClientOptions {
            namespace: "tenant-a/llama".into(),
            shm_size: 0,
            ..options()
        },
    )
    .unwrap();
    let got = operator
        .batch_get_into(&[b"block-0"], &mut [&mut buf[..]])
        .unwrap();
    assert_eq!(got[0].as_ref().unwrap(), &Some(9));
    assert!(operator.stats().is_ok());

    // The admin views need the server's token even on loopback; liveness
    // does not.
    assert!(
        server.http("/stats").starts_with("HTTP/1.1 401"),
        "admin /stats without the token"
    );
    assert!(server.http("/health").starts_with("HTTP/1.1 200"));
    let with_token = server.http_request(&format!(
        "GET /stats HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TEST_TOKEN}\r\n\r\n"
    ));
    assert!(with_token.starts_with("HTTP/1.1 200"), "{with_token}");
}

#[test]
fn a_tenants_file_that_is_open_to_others_or_malformed_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let tenants = dir.path().join("tenants.toml");
    std::fs::write(
        &tenants,
        format!("[[tenant]]\nname = \"a\"\ntoken = \"{TOKEN_A}\"\nnamespaces = [\"tenant-a/\"]\n"),
    )
    .unwrap();
    std::fs::set_permissions(&tenants, std::fs::Permissions::from_mode(0o644)).unwrap();
    let said = ServerProcess::try_start(
        &dir.path().join("d1"),
        &[
            "--auth-token",
            TEST_TOKEN,
            "--tenants",
            tenants.to_str().unwrap(),
        ],
    );
    assert!(said.contains("chmod 600"), "{said}");
    std::fs::write(
        &tenants,
        format!("[[tenant]]\nname = \"a\"\ntoken = \"{TOKEN_A}\"\nnamespaces = [\"\"]\n"),
    )
    .unwrap();
    std::fs::set_permissions(&tenants, std::fs::Permissions::from_mode(0o600)).unwrap();
    let said = ServerProcess::try_start(
        &dir.path().join("d2"),
        &[
            "--auth-token",
            TEST_TOKEN,
            "--tenants",
            tenants.to_str().unwrap(),
        ],
    );
    assert!(said.contains("non-empty namespace prefix"), "{said}");
}
