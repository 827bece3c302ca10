//! Cluster mode on the command line: `serve --cluster NAME --etcd URLS`
//! joins a cluster (the node crate's membership), `kvtier cluster status`
//! shows one. Built with the `cluster` feature (etcd's client needs protoc
//! to build); without it the flags exist and say how to get a binary that
//! has it.

#[cfg(feature = "cluster")]
use std::net::SocketAddr;

/// `serve`'s cluster flags: the node configuration's keys of the same
/// names, laid over the config file's.
#[derive(Debug, Clone, clap::Args, serde::Serialize)]
pub struct ClusterArgs {
    /// Join the cluster of this name, with membership on etcd (--etcd).
    /// Default: none (a single node).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster: Option<String>,
    #[command(flatten)]
    #[serde(flatten)]
    pub etcd: EtcdArgs,
    /// Members that own each block. Default: 1.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replicas: Option<usize>,
    /// Seconds a member stays listed without renewing its lease: a killed
    /// or partitioned node drops out within this. Default: 5.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lease_ttl: Option<f64>,
    /// host:port that peers and clients use to reach this node's TCP
    /// listener. Default: the --listen address (which then must name a
    /// host, not 0.0.0.0).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub advertise: Option<String>,
    /// PEM file of the CA that signs the other members' certificates, for
    /// members whose listeners speak TLS. Default: KVTIER_TLS_CA, else none.
    #[arg(long, env = "KVTIER_TLS_CA")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer_ca: Option<std::path::PathBuf>,
    /// With --shared-dir: seconds a writer of the shared directory that is
    /// no longer a member must have left its log unchanged before a member
    /// collects it (docs/design.md, "Dead writers"). Default: 300.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub adopt_after: Option<f64>,
}

/// Where etcd is and how to reach it safely.
#[derive(Debug, Clone, clap::Args, serde::Serialize)]
pub struct EtcdArgs {
    /// etcd client URLs, comma-separated (http://127.0.0.1:2379,...;
    /// https:// with --etcd-ca). Plain http:// is refused off loopback
    /// unless --etcd-allow-plaintext.
    #[arg(long = "etcd", value_delimiter = ',')]
    #[serde(rename = "etcd", skip_serializing_if = "Vec::is_empty")]
    pub endpoints: Vec<String>,
    /// PEM file of the CA that signs etcd's server certificates. Default:
    /// none (then the endpoints must be http://).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub etcd_ca: Option<std::path::PathBuf>,
    /// PEM client certificate and key for etcd's --client-cert-auth.
    /// Default: none.
    #[arg(long, requires = "etcd_key")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub etcd_cert: Option<std::path::PathBuf>,
    #[arg(long, requires = "etcd_cert")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub etcd_key: Option<std::path::PathBuf>,
    /// etcd user (etcd's `auth enable`); the password is read from
    /// --etcd-password-file. Default: none.
    #[arg(long, requires = "etcd_password_file")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub etcd_user: Option<String>,
    /// File holding the etcd user's password (owner-only, no link).
    #[arg(long, requires = "etcd_user")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub etcd_password_file: Option<std::path::PathBuf>,
    /// Allow plain http:// etcd endpoints off loopback (member records,
    /// leases and the etcd password then cross the network in the
    /// clear). Default: refused.
    #[arg(long)]
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub etcd_allow_plaintext: bool,
}

impl EtcdArgs {
    /// The files read and checked, as the cluster crate takes them.
    #[cfg(feature = "cluster")]
    pub fn access(&self) -> Result<kvtier_cluster::EtcdAccess, String> {
        kvtier_node::etcd_access(&kvtier_node::EtcdConfig {
            endpoints: self.endpoints.clone(),
            ca: self.etcd_ca.clone(),
            cert: self.etcd_cert.clone(),
            key: self.etcd_key.clone(),
            user: self.etcd_user.clone(),
            password_file: self.etcd_password_file.clone(),
            allow_plaintext: self.etcd_allow_plaintext,
        })
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
    Err(kvtier_node::CLUSTER_NOT_BUILT.into())
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
