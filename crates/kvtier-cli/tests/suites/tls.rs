//! TLS on the TCP listener, against the real binary: a client that trusts
//! the right CA gets verified bytes; a plaintext client, a client that
//! trusts another CA, and an off-loopback listener without TLS are refused.

use crate::common::{options, tls_files, ServerProcess};
use kvtier_client::{Client, ClientOptions};

#[test]
fn tls_clients_round_trip_and_others_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    std::fs::create_dir(&certs).unwrap();
    let (ca, cert, key) = tls_files(&certs);
    let server = ServerProcess::start(
        &dir.path().join("data"),
        &[
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
        ],
    );
    assert!(!server.tls.is_empty(), "the ready line names tls://");
    let url = format!("tls://{}", server.tls);
    let secure = ClientOptions {
        tls_ca: Some(ca.clone()),
        ..options()
    };
    let mut client = Client::connect_with(&url, secure.clone()).unwrap();
    let keys: Vec<Vec<u8>> = (0..8).map(|i| format!("tls/{i}").into_bytes()).collect();
    let values: Vec<Vec<u8>> = keys
        .iter()
        .map(|k| kvtier::pattern::value(k, 3 << 20))
        .collect();
    for r in client.batch_put(&keys, &values).unwrap() {
        r.unwrap();
    }
    let mut bufs: Vec<Vec<u8>> = values.iter().map(|v| vec![0u8; v.len()]).collect();
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    for r in client.batch_get_into(&keys, &mut slices).unwrap() {
        assert_eq!(r.unwrap(), Some(3 << 20));
    }
    assert_eq!(bufs, values);

    // Plain TCP to the TLS port: the hello is not TLS, nothing is served.
    assert!(Client::connect_with(&format!("tcp://{}", server.tls), options()).is_err());
    // A client trusting another CA refuses the server's certificate.
    let other = dir.path().join("other");
    std::fs::create_dir(&other).unwrap();
    let (other_ca, _, _) = tls_files(&other);
    let distrustful = ClientOptions {
        tls_ca: Some(other_ca),
        ..options()
    };
    let err = Client::connect_with(&url, distrustful).unwrap_err();
    assert!(
        err.to_string().to_lowercase().contains("certificate"),
        "{err}"
    );
    // TLS without the token is still refused.
    let anonymous = ClientOptions {
        auth_token: None,
        ..secure
    };
    let err = Client::connect_with(&url, anonymous).unwrap_err();
    assert!(err.to_string().contains("unauthorized"), "{err}");
    // The bystander connection never noticed.
    assert_eq!(client.prefix_len(&keys).unwrap(), 8);
}

#[test]
fn off_loopback_tcp_needs_tls() {
    let dir = tempfile::tempdir().unwrap();
    let stderr = ServerProcess::try_start(
        dir.path(),
        &[
            "--listen",
            "0.0.0.0:0",
            "--auth-token",
            "a-token-of-our-own-0123456789",
        ],
    );
    assert!(stderr.contains("without TLS"), "{stderr}");
}
