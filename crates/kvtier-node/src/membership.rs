//! This node in its cluster: the member it registers on etcd, from the
//! node's start to its end. Built with the `cluster` feature (etcd's client
//! needs protoc to build); without it a configuration naming a cluster is
//! refused with how to get a build that has it.

use crate::{EtcdConfig, NodeConfig};
use kvtier_wire::cluster::ClusterView;
use std::net::SocketAddr;
use std::sync::Arc;

/// This node as a member, between `prepare` and `leave`.
#[cfg_attr(not(feature = "cluster"), allow(dead_code))]
pub(crate) struct ClusterMember {
    pub view: Arc<ClusterView>,
    advertise: Option<String>,
    #[cfg(feature = "cluster")]
    membership: Option<kvtier_cluster::Membership>,
    #[cfg(feature = "cluster")]
    config: kvtier_cluster::MembershipConfig,
}

impl std::fmt::Debug for ClusterMember {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterMember")
            .field("view", &self.view)
            .finish()
    }
}

/// The member this node will be when `cluster` is set: `node_id` (the data
/// directory's), a fresh incarnation and `capacity` as its weight. `token`
/// is the servers' auth token: members share it, and it signs their
/// records in etcd.
pub(crate) fn prepare(
    config: &NodeConfig,
    node_id: &str,
    capacity: u64,
    token: Option<&str>,
) -> Result<Option<ClusterMember>, String> {
    let etcd = config.etcd();
    let Some(name) = &config.cluster else {
        if !etcd.endpoints.is_empty() {
            return Err("--etcd needs --cluster NAME".into());
        }
        return Ok(None);
    };
    if name.is_empty()
        || name.len() > 64
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
    {
        return Err(format!(
            "cluster name {name:?}: use 1-64 letters, digits, '-', '_' or '.'"
        ));
    }
    if etcd.endpoints.is_empty() {
        return Err("--cluster needs --etcd with at least one etcd URL".into());
    }
    let replicas = config.replicas.unwrap_or(1);
    if replicas == 0 {
        return Err("--replicas must be at least 1".into());
    }
    let lease_ttl = config.lease_ttl.unwrap_or(crate::config::DEFAULT_LEASE_TTL);
    let ttl = std::time::Duration::try_from_secs_f64(lease_ttl)
        .ok()
        .filter(|t| t.as_secs() >= 1)
        .ok_or_else(|| {
            format!(
                "--lease-ttl {lease_ttl}: give at least 1 second (etcd leases count whole seconds)"
            )
        })?;
    let token = token.ok_or(
        "cluster mode needs the TCP listener (--listen) and its auth token: members reach \
         each other over TCP and sign their records with the token",
    )?;
    let me = kvtier_wire::cluster::Member {
        id: node_id.to_string(),
        address: String::new(),
        capacity,
        incarnation: 0,
        admin: None,
        tls: false,
    };
    member(
        name,
        me,
        replicas,
        config.advertise.clone(),
        &etcd,
        ttl,
        token,
    )
}

#[cfg(feature = "cluster")]
fn member(
    name: &str,
    mut me: kvtier_wire::cluster::Member,
    replicas: usize,
    advertise: Option<String>,
    etcd: &EtcdConfig,
    ttl: std::time::Duration,
    token: &str,
) -> Result<Option<ClusterMember>, String> {
    me.incarnation = kvtier_cluster::new_incarnation();
    let mut config =
        kvtier_cluster::MembershipConfig::new(etcd.endpoints.clone(), token.as_bytes());
    config.access = etcd_access(etcd)?;
    config.lease_ttl = ttl;
    Ok(Some(ClusterMember {
        view: ClusterView::new(name, me, replicas),
        advertise,
        membership: None,
        config,
    }))
}

#[cfg(not(feature = "cluster"))]
fn member(
    _: &str,
    _: kvtier_wire::cluster::Member,
    _: usize,
    _: Option<String>,
    _: &EtcdConfig,
    _: std::time::Duration,
    _: &str,
) -> Result<Option<ClusterMember>, String> {
    Err(NOT_BUILT.into())
}

/// Why a build without the `cluster` feature refuses cluster mode.
pub const NOT_BUILT: &str = "this kvtier was built without cluster mode: build it with \
     `cargo build --release -p kvtier-cli --features cluster` (needs protoc: \
     apt-get install protobuf-compiler libprotobuf-dev)";

/// etcd's files read and checked, as the cluster crate takes them: keys
/// and passwords only from our own owner-only files, never through a link.
#[cfg(feature = "cluster")]
pub fn etcd_access(etcd: &EtcdConfig) -> Result<kvtier_cluster::EtcdAccess, String> {
    let read = |path: &std::path::Path, what: &str| {
        std::fs::read(path).map_err(|e| format!("{what} {}: {e}", path.display()))
    };
    let ca_pem = match &etcd.ca {
        Some(path) => Some(read(path, "--etcd-ca")?),
        None => None,
    };
    let read_secret = |path: &std::path::Path, what: &str| {
        let mut bytes = Vec::new();
        kvtier::private_files::open_secret(path)
            .and_then(|mut file| std::io::Read::read_to_end(&mut file, &mut bytes))
            .map_err(|e| format!("{what} {}: {e}", path.display()))?;
        Ok::<_, String>(bytes)
    };
    let identity = match (&etcd.cert, &etcd.key) {
        (Some(cert), Some(key)) => {
            Some((read(cert, "--etcd-cert")?, read_secret(key, "--etcd-key")?))
        }
        (None, None) => None,
        _ => return Err("--etcd-cert and --etcd-key go together".into()),
    };
    let user = match (&etcd.user, &etcd.password_file) {
        (Some(user), Some(path)) => {
            let password = String::from_utf8(read_secret(path, "--etcd-password-file")?)
                .map_err(|_| format!("--etcd-password-file {}: not UTF-8", path.display()))?;
            Some((
                user.clone(),
                password.trim_end_matches(['\n', '\r']).to_string(),
            ))
        }
        (None, None) => None,
        _ => return Err("--etcd-user and --etcd-password-file go together".into()),
    };
    let access = kvtier_cluster::EtcdAccess {
        ca_pem,
        identity,
        user,
        allow_plaintext: etcd.allow_plaintext,
    };
    access.check(&etcd.endpoints)?;
    Ok(access)
}

#[cfg_attr(not(feature = "cluster"), allow(dead_code))]
impl ClusterMember {
    /// Registers once the listeners are bound: `tcp` is what was bound,
    /// `advertise` what peers should dial.
    pub fn join(
        &mut self,
        tcp: Option<SocketAddr>,
        tls: bool,
        admin: Option<SocketAddr>,
    ) -> Result<(), String> {
        let address = match (&self.advertise, tcp) {
            (Some(advertised), _) => advertised.clone(),
            (None, Some(bound)) if !bound.ip().is_unspecified() => bound.to_string(),
            (None, Some(bound)) => {
                return Err(format!(
                    "listening on {bound}: say which address peers reach this node at with --advertise HOST:PORT"
                ))
            }
            (None, None) => {
                return Err(
                    "cluster mode needs the TCP listener (--listen): peers reach members over TCP"
                        .into(),
                )
            }
        };
        self.view
            .set_address(address, admin.map(|a| a.to_string()), tls);
        self.start()
    }

    #[cfg(feature = "cluster")]
    fn start(&mut self) -> Result<(), String> {
        let membership =
            kvtier_cluster::Membership::start(self.config.clone(), Arc::clone(&self.view))
                .map_err(|e| format!("starting cluster membership: {e}"))?;
        self.membership = Some(membership);
        Ok(())
    }

    #[cfg(not(feature = "cluster"))]
    fn start(&mut self) -> Result<(), String> {
        Err(NOT_BUILT.into())
    }

    /// Leaves the cluster (revokes the lease) before the server stops.
    pub fn leave(self) {
        #[cfg(feature = "cluster")]
        if let Some(membership) = self.membership {
            membership.leave();
        }
    }
}
