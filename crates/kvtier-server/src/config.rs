//! How a server listens and what it allows (`ServerConfig`), and the
//! sections other parts of a node add to its status (`StatusSection`).

use crate::limits::Limits;
use crate::trust::Tenant;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

/// How the server listens and what it allows.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// TCP address. TCP always requires `auth_token`, loopback included.
    pub listen: Option<SocketAddr>,
    /// Unix socket path (created with mode 0600).
    pub socket: Option<PathBuf>,
    /// Admin HTTP address (`/metrics`, `/health`, `/stats`); off loopback
    /// it requires the token.
    pub admin: Option<SocketAddr>,
    /// Token clients present at hello (at least 16 bytes).
    pub auth_token: Option<String>,
    /// TLS for the TCP listener (see `kvtier_wire::tls::server_config`); required
    /// off loopback, so the token never travels in the clear.
    pub tls: Option<Arc<rustls::ServerConfig>>,
    pub limits: Limits,
    /// This node's view of its cluster, when it is in one (shown on the
    /// admin endpoint; `kvtier-cluster` keeps it current).
    pub cluster: Option<Arc<kvtier_wire::cluster::ClusterView>>,
    /// CA of the other members' certificates, when their listeners speak
    /// TLS. Default: none.
    pub peer_tls_ca: Option<PathBuf>,
    /// Host names (without port) the admin endpoint answers besides the
    /// loopback ones, when it listens on loopback without a token: a web
    /// page that rebinds its own name to 127.0.0.1 sends its own name and
    /// is turned away. Default: none.
    pub admin_allowed_hosts: Vec<String>,
    /// Tokens scoped to namespace prefixes (`read_tenants`). With any, the
    /// admin endpoint asks for the server's token on loopback too.
    /// Default: none.
    pub tenants: Vec<Tenant>,
    /// Clients on the Unix socket may have their own memory read and
    /// written by cross-memory attach (`process_vm_readv`/`writev`): a
    /// value crosses once, from the pool into the client's buffer, where
    /// the kernel lets this process reach the client's (same user, and
    /// ptrace allowed by Yama). Default: true.
    pub cross_memory: bool,
    /// Same-user, full-scope clients on the Unix socket may map the memory
    /// pool read-only and copy leased values out of it themselves
    /// (docs/protocol.md, "Pool mapping"), when the store was opened with
    /// `kvtier::Config::shareable_memory`. Default: true.
    pub map_pool: bool,
    /// More sections of `/stats`, from the parts of a node that are not
    /// the server (the KV-event feed). Default: none.
    pub status_sections: Vec<Arc<dyn StatusSection>>,
}

/// A part of a node beside the server that shows its state on the admin
/// endpoint's `/stats` as `"<name>": <json>` (the node crate's KV-event
/// feed). Called on every `/stats` request, so it must not block.
pub trait StatusSection: std::fmt::Debug + Send + Sync {
    /// The key in `/stats`.
    fn name(&self) -> &str;
    /// The section's value.
    fn json(&self) -> serde_json::Value;
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: Some(SocketAddr::from(([127, 0, 0, 1], 7700))),
            socket: None,
            admin: Some(SocketAddr::from(([127, 0, 0, 1], 7701))),
            auth_token: None,
            tls: None,
            limits: Limits::default(),
            cluster: None,
            peer_tls_ca: None,
            admin_allowed_hosts: Vec::new(),
            tenants: Vec::new(),
            cross_memory: true,
            map_pool: true,
            status_sections: Vec::new(),
        }
    }
}
