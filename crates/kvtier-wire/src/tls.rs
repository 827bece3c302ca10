//! TLS for TCP (rustls with the ring provider): the server's certificate
//! and key, the client's trusted CA, both from PEM files. Off loopback a
//! TCP listener speaks only TLS, so the token never crosses a network in
//! the clear.

use rustls::crypto::ring::default_provider;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::io;
use std::path::Path;
use std::sync::Arc;

fn invalid(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, what)
}

fn certificates(path: &Path) -> io::Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| invalid(format!("reading certificates from {}: {e}", path.display())))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(format!("parsing certificates in {}: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(invalid(format!(
            "{} holds no PEM certificate",
            path.display()
        )));
    }
    Ok(certs)
}

/// The server side: a certificate chain and its private key (PEM files).
pub fn server_config(cert: &Path, key: &Path) -> io::Result<Arc<rustls::ServerConfig>> {
    let chain = certificates(cert)?;
    let key = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| invalid(format!("reading the private key {}: {e}", key.display())))?;
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| invalid(format!("TLS versions: {e}")))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| invalid(format!("TLS certificate and key: {e}")))?;
    Ok(Arc::new(config))
}

/// The client side: the CA certificates (PEM) that may sign the server's.
pub fn client_config(ca: &Path) -> io::Result<Arc<rustls::ClientConfig>> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in certificates(ca)? {
        roots
            .add(cert)
            .map_err(|e| invalid(format!("CA certificate in {}: {e}", ca.display())))?;
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| invalid(format!("TLS versions: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}
