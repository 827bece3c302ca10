//! How a node reaches etcd: TLS (a CA for etcd's server certificates, and
//! a client certificate where etcd asks for one) and etcd's own
//! authentication. Plain `http://` is refused off loopback unless allowed
//! explicitly: a member record, a lease and an etcd password would cross
//! the network in the clear.

use etcd_client::{Certificate, ConnectOptions, Identity, TlsOptions};
use std::time::Duration;

/// What a node presents to etcd. `Default`: plain, loopback only.
#[derive(Clone, Default)]
pub struct EtcdAccess {
    /// PEM of the CA that signs etcd's server certificates (needed for
    /// `https://` endpoints).
    pub ca_pem: Option<Vec<u8>>,
    /// PEM client certificate and key, for etcd's `--client-cert-auth`.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
    /// An etcd user and password (etcd's `auth enable`).
    pub user: Option<(String, String)>,
    /// Allow `http://` endpoints off loopback.
    pub allow_plaintext: bool,
}

impl std::fmt::Debug for EtcdAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdAccess")
            .field("tls", &self.ca_pem.is_some())
            .field("client_certificate", &self.identity.is_some())
            .field("user", &self.user.as_ref().map(|u| &u.0))
            .field("allow_plaintext", &self.allow_plaintext)
            .finish()
    }
}

/// Whether `endpoint` (`scheme://host:port` or `host:port`) speaks TLS, and
/// whether its host is a loopback name or address.
fn endpoint_facts(endpoint: &str) -> Result<(bool, bool), String> {
    let (tls, rest) = if let Some(rest) = endpoint.strip_prefix("https://") {
        (true, rest)
    } else if let Some(rest) = endpoint.strip_prefix("http://") {
        (false, rest)
    } else if endpoint.contains("://") {
        return Err(format!(
            "etcd endpoint {endpoint:?}: use http:// or https://"
        ));
    } else {
        (false, endpoint)
    };
    let authority = rest.split('/').next().unwrap_or_default();
    let host = if let Some(bracketed) = authority.strip_prefix('[') {
        bracketed.split(']').next().unwrap_or_default()
    } else {
        authority.rsplit_once(':').map_or(authority, |(h, _)| h)
    };
    let loopback = host == "localhost"
        || host.ends_with(".localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    Ok((tls, loopback))
}

impl EtcdAccess {
    /// Refuses endpoints this access cannot use safely: `https://` without
    /// a CA, `http://` off loopback (unless `allow_plaintext`), a mix of
    /// both, and a CA or certificate given for plain endpoints.
    pub fn check(&self, endpoints: &[String]) -> Result<(), String> {
        let mut schemes = Vec::new();
        for endpoint in endpoints {
            let (tls, loopback) = endpoint_facts(endpoint)?;
            if tls && self.ca_pem.is_none() {
                return Err(format!(
                    "etcd endpoint {endpoint} speaks TLS: give --etcd-ca with the CA that signs \
                     etcd's certificates"
                ));
            }
            if !tls && !loopback && !self.allow_plaintext {
                return Err(format!(
                    "refusing plain-text etcd at {endpoint}: member records, leases{} would \
                     cross the network in the clear. Use https:// with --etcd-ca (and \
                     --etcd-cert/--etcd-key if etcd asks for client certificates), or \
                     --etcd-allow-plaintext on a network you trust",
                    if self.user.is_some() {
                        " and the etcd password"
                    } else {
                        ""
                    }
                ));
            }
            schemes.push(tls);
        }
        if schemes.iter().any(|&t| t) && schemes.iter().any(|&t| !t) {
            return Err("etcd endpoints mix http:// and https://: use one".into());
        }
        if !schemes.iter().any(|&t| t) && (self.ca_pem.is_some() || self.identity.is_some()) {
            return Err(
                "--etcd-ca/--etcd-cert given, but the etcd endpoints are http://: use https://"
                    .into(),
            );
        }
        Ok(())
    }

    /// Connection options with every call bounded by `timeout`.
    pub(crate) fn options(&self, timeout: Duration) -> ConnectOptions {
        let mut options = ConnectOptions::new()
            .with_connect_timeout(timeout)
            .with_timeout(timeout);
        if let Some(ca) = &self.ca_pem {
            let mut tls = TlsOptions::new().ca_certificate(Certificate::from_pem(ca));
            if let Some((cert, key)) = &self.identity {
                tls = tls.identity(Identity::from_pem(cert, key));
            }
            options = options.with_tls(tls);
        }
        if let Some((name, password)) = &self.user {
            options = options.with_user(name.clone(), password.clone());
        }
        options
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoints(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn plain_text_is_for_loopback_unless_allowed() {
        let plain = EtcdAccess::default();
        for ok in [
            "http://127.0.0.1:2379",
            "localhost:2379",
            "http://[::1]:2379",
        ] {
            assert!(plain.check(&endpoints(&[ok])).is_ok(), "{ok}");
        }
        let err = plain
            .check(&endpoints(&["http://10.0.0.1:2379"]))
            .unwrap_err();
        assert!(err.contains("--etcd-allow-plaintext"), "{err}");
        assert!(plain.check(&endpoints(&["https://10.0.0.1:2379"])).is_err());
        assert!(plain.check(&endpoints(&["unix://x"])).is_err());
        let allowed = EtcdAccess {
            allow_plaintext: true,
            ..EtcdAccess::default()
        };
        assert!(allowed.check(&endpoints(&["http://10.0.0.1:2379"])).is_ok());
        let tls = EtcdAccess {
            ca_pem: Some(b"pem".to_vec()),
            ..EtcdAccess::default()
        };
        assert!(tls.check(&endpoints(&["https://10.0.0.1:2379"])).is_ok());
        assert!(tls
            .check(&endpoints(&[
                "https://10.0.0.1:2379",
                "http://127.0.0.1:2379"
            ]))
            .is_err());
        assert!(tls.check(&endpoints(&["http://127.0.0.1:2379"])).is_err());
    }
}
