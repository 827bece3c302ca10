//! Cluster mode on the command line: `serve --cluster NAME --etcd URLS`
//! joins a cluster, `kvtier cluster status` shows one. Built with the
//! `cluster` feature (etcd's client needs protoc to build); without it the
//! flags exist and say how to get a binary that has it.

use kvtier_wire::cluster::ClusterView;
use std::net::SocketAddr;
use std::sync::Arc;

#[derive(Debug, Clone, clap::Args)]
pub struct ClusterArgs {
    /// Join the cluster of this name, with membership on etcd (--etcd).
    /// Default: none (a single node).
    #[arg(long)]
    pub cluster: Option<String>,
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// Members that own each block. Default: 1.
    #[arg(long, default_value_t = 1)]
    pub replicas: usize,
    /// Seconds a member stays listed without renewing its lease: a killed
    /// or partitioned node drops out within this. Default: 5.
    #[arg(long, default_value_t = 5.0)]
    pub lease_ttl: f64,
    /// host:port that peers and clients use to reach this node's TCP
    /// listener. Default: the --listen address (which then must name a
    /// host, not 0.0.0.0).
    #[arg(long)]
    pub advertise: Option<String>,
    /// PEM file of the CA that signs the other members' certificates, for
    /// members whose listeners speak TLS. Default: KVTIER_TLS_CA, else none.
    #[arg(long, env = "KVTIER_TLS_CA")]
    pub peer_ca: Option<std::path::PathBuf>,
    /// With --shared-dir: seconds a writer of the shared directory that is
    /// no longer a member must have left its log unchanged before a member
    /// collects it (docs/design.md, "Dead writers"). Default: 300.
    #[arg(long, default_value_t = 300.0)]
    pub adopt_after: f64,
}

/// Where etcd is and how to reach it safely.
#[derive(Debug, Clone, clap::Args)]
pub struct EtcdArgs {
    /// etcd client URLs, comma-separated (http://127.0.0.1:2379,...;
    /// https:// with --etcd-ca). Plain http:// is refused off loopback
    /// unless --etcd-allow-plaintext.
    #[arg(long = "etcd", value_delimiter = ',')]
    pub endpoints: Vec<String>,
    /// PEM file of the CA that signs etcd's server certificates. Default:
    /// none (then the endpoints must be http://).
    #[arg(long)]
    pub etcd_ca: Option<std::path::PathBuf>,
    /// PEM client certificate and key for etcd's --client-cert-auth.
    /// Default: none.
    #[arg(long, requires = "etcd_key")]
    pub etcd_cert: Option<std::path::PathBuf>,
    #[arg(long, requires = "etcd_cert")]
    pub etcd_key: Option<std::path::PathBuf>,
    /// etcd user (etcd's `auth enable`); the password is read from
    /// --etcd-password-file. Default: none.
    #[arg(long, requires = "etcd_password_file")]
    pub etcd_user: Option<String>,
    /// File holding the etcd user's password (owner-only, no link).
    #[arg(long, requires = "etcd_user")]
    pub etcd_password_file: Option<std::path::PathBuf>,
    /// Allow plain http:// etcd endpoints off loopback (member records,
    /// leases and the etcd password then cross the network in the
    /// clear). Default: refused.
    #[arg(long)]
    pub etcd_allow_plaintext: bool,
}

impl EtcdArgs {
    /// The files read and checked, as the cluster crate takes them.
    #[cfg(feature = "cluster")]
    pub fn access(&self) -> Result<kvtier_cluster::EtcdAccess, String> {
        let read = |path: &std::path::Path, what: &str| {
            std::fs::read(path).map_err(|e| format!("{what} {}: {e}", path.display()))
        };
        let ca_pem = match &self.etcd_ca {
            Some(path) => Some(read(path, "--etcd-ca")?),
            None => None,
        };
        // Keys and passwords: never through a link, only our own
        // owner-only file.
        let read_secret = |path: &std::path::Path, what: &str| {
            let mut bytes = Vec::new();
            kvtier::private_files::open_secret(path)
                .and_then(|mut file| std::io::Read::read_to_end(&mut file, &mut bytes))
                .map_err(|e| format!("{what} {}: {e}", path.display()))?;
            Ok::<_, String>(bytes)
        };
        let identity = match (&self.etcd_cert, &self.etcd_key) {
            (Some(cert), Some(key)) => {
                Some((read(cert, "--etcd-cert")?, read_secret(key, "--etcd-key")?))
            }
            _ => None,
        };
        let user = match (&self.etcd_user, &self.etcd_password_file) {
            (Some(user), Some(path)) => {
                let password = String::from_utf8(read_secret(path, "--etcd-password-file")?)
                    .map_err(|_| format!("--etcd-password-file {}: not UTF-8", path.display()))?;
                Some((
                    user.clone(),
                    password.trim_end_matches(['\n', '\r']).to_string(),
                ))
            }
            _ => None,
        };
        let access = kvtier_cluster::EtcdAccess {
            ca_pem,
            identity,
            user,
            allow_plaintext: self.etcd_allow_plaintext,
        };
        access.check(&self.endpoints)?;
        Ok(access)
    }
}

/// This node in its cluster, from `serve`'s start to its end.
pub struct Node {
    pub view: Arc<ClusterView>,
    #[cfg(feature = "cluster")]
    membership: Option<kvtier_cluster::Membership>,
    #[cfg(feature = "cluster")]
    config: kvtier_cluster::MembershipConfig,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node").field("view", &self.view).finish()
    }
}

/// The node `serve` will be, when `--cluster` is given: `node_id` (the data
/// directory's), a fresh incarnation and `capacity` as its weight.
/// `token` is the servers' auth token: members share it, and it signs
/// their records in etcd.
pub fn prepare(
    args: &ClusterArgs,
    node_id: &str,
    capacity: u64,
    token: Option<&str>,
) -> Result<Option<Node>, String> {
    let Some(name) = &args.cluster else {
        if !args.etcd.endpoints.is_empty() {
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
    if args.etcd.endpoints.is_empty() {
        return Err("--cluster needs --etcd with at least one etcd URL".into());
    }
    if args.replicas == 0 {
        return Err("--replicas must be at least 1".into());
    }
    let ttl = std::time::Duration::try_from_secs_f64(args.lease_ttl)
        .ok()
        .filter(|t| t.as_secs() >= 1)
        .ok_or_else(|| {
            format!(
                "--lease-ttl {}: give at least 1 second (etcd leases count whole seconds)",
                args.lease_ttl
            )
        })?;
    let token = token.ok_or(
        "cluster mode needs the TCP listener (--listen) and its auth token: members reach \
         each other over TCP and sign their records with the token",
    )?;
    prepare_node(args, name, node_id, capacity, ttl, token)
}

#[cfg(feature = "cluster")]
fn prepare_node(
    args: &ClusterArgs,
    name: &str,
    node_id: &str,
    capacity: u64,
    ttl: std::time::Duration,
    token: &str,
) -> Result<Option<Node>, String> {
    let me = kvtier_wire::cluster::Member {
        id: node_id.to_string(),
        address: String::new(),
        capacity,
        incarnation: kvtier_cluster::new_incarnation(),
        admin: None,
        tls: false,
    };
    let mut config =
        kvtier_cluster::MembershipConfig::new(args.etcd.endpoints.clone(), token.as_bytes());
    config.access = args.etcd.access()?;
    config.lease_ttl = ttl;
    Ok(Some(Node {
        view: ClusterView::new(name, me, args.replicas),
        membership: None,
        config,
    }))
}

#[cfg(not(feature = "cluster"))]
fn prepare_node(
    _: &ClusterArgs,
    _: &str,
    _: &str,
    _: u64,
    _: std::time::Duration,
    _: &str,
) -> Result<Option<Node>, String> {
    Err(NOT_BUILT.into())
}

#[cfg(not(feature = "cluster"))]
const NOT_BUILT: &str = "this kvtier was built without cluster mode: build it with \
     `cargo build --release -p kvtier-cli --features cluster` (needs protoc: \
     apt-get install protobuf-compiler libprotobuf-dev)";

impl Node {
    /// Registers once the listeners are bound: `tcp` is what was bound,
    /// `--advertise` what peers should dial.
    pub fn join(
        &mut self,
        args: &ClusterArgs,
        tcp: Option<SocketAddr>,
        tls: bool,
        admin: Option<SocketAddr>,
    ) -> Result<(), String> {
        let address = match (&args.advertise, tcp) {
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

#[derive(Debug, clap::Args)]
pub struct ClusterCommand {
    #[command(subcommand)]
    pub action: ClusterAction,
}

#[derive(Debug, clap::Subcommand)]
pub enum ClusterAction {
    /// List a cluster's members from etcd, with whether each answers.
    Status(StatusArgs),
}

#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// The cluster's name.
    #[arg(long)]
    pub cluster: String,
    /// Seconds to wait for etcd and for each member. Default: 3.
    #[arg(long, default_value_t = 3.0)]
    pub timeout: f64,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// The cluster's auth token: only records it signed are listed.
    /// Default: KVTIER_AUTH_TOKEN.
    #[arg(long, env = "KVTIER_AUTH_TOKEN", hide_env_values = true)]
    pub auth_token: String,
}

pub fn run(command: &ClusterCommand) -> Result<(), Box<dyn std::error::Error>> {
    match &command.action {
        ClusterAction::Status(args) => status(args),
    }
}

#[cfg(not(feature = "cluster"))]
fn status(_: &StatusArgs) -> Result<(), Box<dyn std::error::Error>> {
    Err(NOT_BUILT.into())
}

#[cfg(feature = "cluster")]
fn status(args: &StatusArgs) -> Result<(), Box<dyn std::error::Error>> {
    if args.etcd.endpoints.is_empty() {
        return Err("--etcd URLS is required".into());
    }
    let timeout = std::time::Duration::try_from_secs_f64(args.timeout)
        .map_err(|_| format!("--timeout {}: not a number of seconds", args.timeout))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let members = runtime
        .block_on(kvtier_cluster::list_members(
            &args.etcd.endpoints,
            &args.etcd.access()?,
            &args.cluster,
            &kvtier_wire::proof::member_record_key(args.auth_token.as_bytes()),
            timeout,
        ))
        .map_err(|e| format!("reading cluster {:?} from etcd: {e}", args.cluster))?;
    let health: Vec<(bool, Option<bool>)> = members
        .iter()
        .map(|m| {
            (
                tcp_answers(&m.address, timeout),
                m.admin.as_deref().map(|a| admin_healthy(a, timeout)),
            )
        })
        .collect();
    if args.json {
        let rows: Vec<serde_json::Value> = members
            .iter()
            .zip(&health)
            .map(|(m, (tcp, admin))| {
                let mut row = serde_json::to_value(m).expect("a member serializes");
                row["tcp_answers"] = (*tcp).into();
                row["admin_healthy"] = (*admin).into();
                row
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    println!("cluster {:?}: {} members", args.cluster, members.len());
    println!(
        "{:<34} {:<22} {:>12} {:>20} {:>6} {:>7}",
        "node", "address", "capacity", "incarnation", "tcp", "health"
    );
    for (m, (tcp, admin)) in members.iter().zip(&health) {
        println!(
            "{:<34} {:<22} {:>12} {:>20} {:>6} {:>7}",
            m.id,
            m.address,
            kvtier::format_size(m.capacity),
            m.incarnation,
            if *tcp { "up" } else { "DOWN" },
            match admin {
                Some(true) => "ok",
                Some(false) => "FAILING",
                None => "-",
            }
        );
    }
    Ok(())
}

#[cfg(feature = "cluster")]
fn tcp_answers(address: &str, timeout: std::time::Duration) -> bool {
    use std::net::ToSocketAddrs;
    address
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .is_some_and(|a| std::net::TcpStream::connect_timeout(&a, timeout).is_ok())
}

#[cfg(feature = "cluster")]
fn admin_healthy(address: &str, timeout: std::time::Duration) -> bool {
    use std::io::{Read, Write};
    let Ok(addr) = address.parse::<SocketAddr>() else {
        return false;
    };
    let Ok(mut stream) = std::net::TcpStream::connect_timeout(&addr, timeout) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(timeout));
    let _ = stream.set_write_timeout(Some(timeout));
    // The address as Host: an admin endpoint without a token (it has none
    // only on loopback) answers loopback names only.
    let request = format!("GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    if stream.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut answer = String::new();
    let _ = stream.take(4096).read_to_string(&mut answer);
    // 401: alive, behind its token (an admin port off loopback).
    (answer.starts_with("HTTP/1.1 200") && answer.ends_with("ok\n"))
        || answer.starts_with("HTTP/1.1 401")
}
