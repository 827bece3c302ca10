//! One node's configuration: every key of `kvtier serve`'s TOML file, in
//! one serde type. The command line does not merge its flags field by
//! field: it serializes the flags it was given into a table of the same
//! keys and lays it over the file's (`NodeConfig::layered`), so a key is
//! named, typed and defaulted once, here. docs/server.md lists every key
//! with its default.

use kvtier::{parse_size, Config, EvictionPolicy, FlushPolicy, IoEngineKind};
use kvtier_server::{Limits, ServerConfig};
use serde::{Deserialize, Deserializer, Serialize};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A byte count: an integer, or a string with a unit (`"64MiB"`, `"4G"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Size(pub u64);

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Size, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Size;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a size: a number of bytes or a string such as \"64MiB\"")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Size, E> {
                Ok(Size(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Size, E> {
                u64::try_from(v)
                    .map(Size)
                    .map_err(|_| E::custom(format!("{v}: a size cannot be negative")))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Size, E> {
                parse_size(v).map(Size).map_err(E::custom)
            }
        }
        d.deserialize_any(Visitor)
    }
}

/// Every setting of a node; `None` is the documented default. Field names
/// are the TOML keys (and, with `-` for `_`, the flags of `kvtier serve`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    // --- the store ---
    /// Data directory. Default: ./kvtier-data.
    pub data_dir: Option<PathBuf>,
    /// Memory pool capacity. Default: 1 GiB.
    pub memory: Option<Size>,
    /// Disk tier capacity (0: memory only). Default: 16 GiB.
    pub disk: Option<Size>,
    /// Region size of the disk log. Default: the store's.
    pub region_size: Option<Size>,
    /// `uring` or `psync`. Default: uring.
    pub io_engine: Option<String>,
    /// io_uring queue depth. Default: the store's.
    pub io_depth: Option<u32>,
    /// Largest single read of a value. Default: the store's.
    pub read_piece: Option<Size>,
    /// Eviction policy of the memory pool. Default: the store's.
    pub eviction: Option<String>,
    /// `write-through` or `on-demand`. Default: write-through.
    pub flush: Option<String>,
    /// Seconds write-through writes wait at most for gets to pause; 0:
    /// never. Default: 1.
    pub flush_yield: Option<f64>,
    /// The shared directory every node mounts. Default: none.
    pub shared_dir: Option<PathBuf>,
    /// Seconds between looks for other writers' blocks. Default: 0.2.
    pub shared_poll: Option<f64>,
    /// How other writers' files are read: `auto` (by file system:
    /// buffered on network and FUSE, O_DIRECT on local disks), `direct`
    /// or `buffered`. Default: auto.
    pub shared_read: Option<String>,
    /// Seconds a caller waits on a file system that can stall; 0: none.
    /// Default: 5.
    pub io_deadline: Option<f64>,
    /// The deadline on the local data directory too. Default: false.
    pub io_deadline_local: Option<bool>,
    /// `all` or `share` (needs `cluster`). Default: all.
    pub shared_index: Option<String>,

    // --- the server ---
    /// TCP address, or `off`. Default: 127.0.0.1:7700.
    pub listen: Option<String>,
    /// Unix socket path, or `off`. Default: <data_dir>/kvtier.sock.
    pub socket: Option<String>,
    /// Admin HTTP address, or `off`. Default: 127.0.0.1:7701.
    pub admin: Option<String>,
    /// The server's token. Default: generated into <data_dir>/auth-token
    /// when TCP is served on loopback.
    pub auth_token: Option<String>,
    /// PEM certificate chain for TLS on TCP. Default: none.
    pub tls_cert: Option<PathBuf>,
    /// PEM key of `tls_cert`. Default: none.
    pub tls_key: Option<PathBuf>,
    /// Tokens scoped to namespace prefixes. Default: none.
    pub tenants_file: Option<PathBuf>,
    /// Host names the loopback admin endpoint answers. Default: none.
    pub admin_allowed_hosts: Option<Vec<String>>,
    /// Same-host clients' own buffers read and written by cross-memory
    /// attach (docs/server.md, "Cross-memory transfers"). Default: true.
    pub cross_memory: Option<bool>,
    /// Same-user, full-scope clients on the Unix socket map the memory
    /// pool read-only and copy leased values themselves (docs/server.md,
    /// "Pool mapping"). Default: true (the pool is then a sealed memory
    /// file; off the Unix socket it stays private).
    pub map_pool: Option<bool>,
    pub max_frame: Option<Size>,
    pub max_batch: Option<u32>,
    pub max_connections: Option<usize>,
    pub max_pending_connections: Option<usize>,
    pub reserved_local_connections: Option<usize>,
    pub max_connections_per_address: Option<usize>,
    pub max_lobby_connections: Option<usize>,
    pub max_lobby_per_address: Option<usize>,
    pub max_failed_hellos_per_second: Option<u32>,
    pub handshake_timeout: Option<f64>,
    pub idle_timeout: Option<f64>,
    pub frame_timeout: Option<f64>,
    pub min_frame_rate: Option<Size>,
    pub max_registered: Option<Size>,
    pub max_registered_total: Option<Size>,
    pub max_registered_buffers_total: Option<usize>,
    pub max_receiving: Option<Size>,
    pub max_buffer_bytes: Option<Size>,
    pub tenant_share_percent: Option<u8>,
    pub tenant_reserve_percent: Option<u8>,
    pub anonymous_share_percent: Option<u8>,
    pub max_admin_connections: Option<usize>,
    pub admin_timeout: Option<f64>,
    pub peer_timeout: Option<f64>,

    // --- the KV-event feed ---
    /// ZeroMQ PUB endpoint. Default: off.
    pub kv_events: Option<String>,
    /// ZeroMQ ROUTER endpoint answering replays. Default: off.
    pub kv_events_replay: Option<String>,
    /// Topic prefix. Default: kv@<node id>.
    pub kv_events_topic: Option<String>,
    /// `none`, `plain` or `curve` (docs/integrations.md, "KV events").
    /// Default: none.
    pub kv_events_auth: Option<String>,
    /// Serve the feed off loopback or beside tenants without logins.
    /// Default: false.
    pub kv_events_unauthenticated: Option<bool>,

    // --- the cluster ---
    /// The cluster's name. Default: none (a single node).
    pub cluster: Option<String>,
    /// etcd client URLs. Default: none.
    pub etcd: Option<Vec<String>>,
    /// PEM CA of etcd's server certificates. Default: none.
    pub etcd_ca: Option<PathBuf>,
    /// PEM client certificate for etcd. Default: none.
    pub etcd_cert: Option<PathBuf>,
    /// PEM key of `etcd_cert`. Default: none.
    pub etcd_key: Option<PathBuf>,
    /// etcd user. Default: none.
    pub etcd_user: Option<String>,
    /// File holding the etcd user's password. Default: none.
    pub etcd_password_file: Option<PathBuf>,
    /// Allow http:// etcd endpoints off loopback. Default: false.
    pub etcd_allow_plaintext: Option<bool>,
    /// Members that own each block. Default: 1.
    pub replicas: Option<usize>,
    /// Seconds a member stays listed without renewing. Default: 5.
    pub lease_ttl: Option<f64>,
    /// host:port peers dial. Default: the listen address.
    pub advertise: Option<String>,
    /// PEM CA of the other members' certificates. Default: none.
    pub peer_ca: Option<PathBuf>,
    /// Seconds a dead writer's log stays untouched before a member
    /// collects it. Default: 300.
    pub adopt_after: Option<f64>,
}

/// Where etcd is and how to reach it (the `etcd*` keys).
#[derive(Debug, Clone, Default)]
pub struct EtcdConfig {
    pub endpoints: Vec<String>,
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub user: Option<String>,
    pub password_file: Option<PathBuf>,
    pub allow_plaintext: bool,
}

/// The default seconds of `lease_ttl` and `adopt_after`.
pub const DEFAULT_LEASE_TTL: f64 = 5.0;
pub const DEFAULT_ADOPT_AFTER: f64 = 300.0;

impl NodeConfig {
    /// The file's keys, checked (unknown keys and wrong types are errors
    /// naming the key and line).
    pub fn from_file(path: &Path) -> Result<NodeConfig, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("reading {}: {e}", path.display()))?;
        toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// `self` with every key `over` sets laid over it: the command line's
    /// flags over the file. `over` is any serializable set of the same
    /// keys (absent or `None`: not given).
    pub fn layered(self, over: &impl Serialize) -> Result<NodeConfig, String> {
        let mut table = match toml::Value::try_from(&self) {
            Ok(toml::Value::Table(table)) => table,
            other => return Err(format!("the configuration as a table: {other:?}")),
        };
        match toml::Value::try_from(over) {
            Ok(toml::Value::Table(given)) => table.extend(given),
            Ok(other) => return Err(format!("flags as a table: {other:?}")),
            Err(e) => return Err(format!("flags as a table: {e}")),
        }
        toml::Value::Table(table)
            .try_into()
            .map_err(|e: toml::de::Error| e.message().to_string())
    }

    pub fn data_dir(&self) -> PathBuf {
        self.data_dir
            .clone()
            .unwrap_or_else(|| "./kvtier-data".into())
    }

    pub fn etcd(&self) -> EtcdConfig {
        EtcdConfig {
            endpoints: self.etcd.clone().unwrap_or_default(),
            ca: self.etcd_ca.clone(),
            cert: self.etcd_cert.clone(),
            key: self.etcd_key.clone(),
            user: self.etcd_user.clone(),
            password_file: self.etcd_password_file.clone(),
            allow_plaintext: self.etcd_allow_plaintext.unwrap_or(false),
        }
    }

    /// Whether clients may map the pool: asked for (the default) and a
    /// Unix socket to hand it over.
    fn map_pool(&self) -> bool {
        self.map_pool.unwrap_or(true) && self.socket.as_deref() != Some("off")
    }

    /// The store's configuration (the event sink is added by the node).
    pub(crate) fn store_config(&self) -> Result<Config, String> {
        let mut config = Config::new(self.data_dir()).shareable_memory(self.map_pool());
        if let Some(Size(memory)) = self.memory {
            config = config.memory_capacity(memory);
        }
        if let Some(Size(disk)) = self.disk {
            config = config.disk_capacity(disk);
        }
        if let Some(Size(region)) = self.region_size {
            config = config.region_size(region);
        }
        if let Some(engine) = &self.io_engine {
            config = config.io_engine(IoEngineKind::parse(engine).map_err(|e| e.to_string())?);
        }
        if let Some(depth) = self.io_depth {
            config = config.io_depth(depth);
        }
        if let Some(Size(piece)) = self.read_piece {
            config = config.read_piece(piece);
        }
        if let Some(policy) = &self.eviction {
            config = config.eviction(EvictionPolicy::parse(policy).map_err(|e| e.to_string())?);
        }
        if let Some(dir) = &self.shared_dir {
            config = config.shared_dir(dir);
        }
        if let Some(mode) = &self.shared_read {
            config = config
                .shared_read_mode(kvtier::SharedReadMode::parse(mode).map_err(|e| e.to_string())?);
        }
        if let Some(every) = seconds(self.shared_poll, "shared_poll")? {
            config = config.shared_poll(every);
        }
        match self.io_deadline {
            Some(0.0) => config = config.io_deadline(Duration::ZERO),
            other => {
                if let Some(deadline) = seconds(other, "io_deadline")? {
                    config = config.io_deadline(deadline);
                }
            }
        }
        if let Some(local) = self.io_deadline_local {
            config = config.io_deadline_local(local);
        }
        match self.shared_index.as_deref() {
            None | Some("all") => {}
            Some("share") => {
                if self.cluster.is_none() {
                    return Err(
                        "--shared-index share divides the index between cluster members: \
                         it needs --cluster"
                            .into(),
                    );
                }
                config = config.shared_index_share(true);
            }
            Some(other) => {
                return Err(format!(
                    "--shared-index must be `all` or `share`, not {other:?}"
                ))
            }
        }
        match self.flush_yield {
            Some(0.0) => config = config.flush_yield(Duration::ZERO),
            other => {
                if let Some(most) = seconds(other, "flush_yield")? {
                    config = config.flush_yield(most);
                }
            }
        }
        match self.flush.as_deref() {
            None | Some("write-through") => {}
            Some("on-demand") => config = config.flush_policy(FlushPolicy::OnDemand),
            Some(other) => {
                return Err(format!(
                    "flush {other:?}: expected write-through or on-demand"
                ))
            }
        }
        Ok(config)
    }

    /// The server's addresses, TLS and limits; the token and tenants are
    /// the node's to settle (`Node::start`).
    pub(crate) fn server_config(&self) -> Result<ServerConfig, String> {
        let data_dir = self.data_dir();
        let listen = address(
            self.listen.as_deref().unwrap_or("127.0.0.1:7700"),
            "listen address",
        )?;
        let admin = address(
            self.admin.as_deref().unwrap_or("127.0.0.1:7701"),
            "admin address",
        )?;
        let socket = match self.socket.as_deref() {
            Some("off") => None,
            Some(path) => Some(PathBuf::from(path)),
            None => Some(data_dir.join("kvtier.sock")),
        };
        let tls = match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => {
                Some(kvtier_wire::tls::server_config(cert, key).map_err(|e| e.to_string())?)
            }
            (None, None) => None,
            _ => return Err("TLS needs both --tls-cert and --tls-key".into()),
        };
        Ok(ServerConfig {
            listen,
            socket,
            admin,
            auth_token: self.auth_token.clone().filter(|t| !t.is_empty()),
            tls,
            limits: self.limits()?,
            peer_tls_ca: self.peer_ca.clone(),
            admin_allowed_hosts: self.admin_allowed_hosts.clone().unwrap_or_default(),
            cross_memory: self.cross_memory.unwrap_or(true),
            map_pool: self.map_pool(),
            ..ServerConfig::default()
        })
    }

    fn limits(&self) -> Result<Limits, String> {
        let mut limits = Limits::default();
        if let Some(Size(max_frame)) = self.max_frame {
            limits.max_frame = max_frame;
        }
        if let Some(max_batch) = self.max_batch {
            limits.max_batch = max_batch;
        }
        if let Some(n) = self.max_connections {
            limits.max_connections = n;
        }
        if let Some(n) = self.max_pending_connections {
            limits.max_pending_connections = n;
        }
        if let Some(n) = self.reserved_local_connections {
            limits.reserved_local_connections = n;
        }
        if let Some(n) = self.max_lobby_connections {
            limits.max_lobby_connections = n;
        }
        if let Some(n) = self.max_lobby_per_address {
            limits.max_lobby_per_address = n;
        }
        if let Some(n) = self.max_connections_per_address {
            limits.max_connections_per_address = n;
        }
        if let Some(n) = self.max_failed_hellos_per_second {
            limits.max_failed_hellos_per_second = n;
        }
        if let Some(t) = seconds(self.handshake_timeout, "handshake_timeout")? {
            limits.handshake_timeout = t;
        }
        if let Some(t) = seconds(self.idle_timeout, "idle_timeout")? {
            limits.idle_timeout = t;
        }
        if let Some(t) = seconds(self.frame_timeout, "frame_timeout")? {
            limits.frame_timeout = t;
        }
        if let Some(Size(rate)) = self.min_frame_rate {
            limits.min_frame_rate = rate;
        }
        if let Some(Size(bytes)) = self.max_registered {
            limits.max_registered_bytes = bytes;
        }
        if let Some(Size(bytes)) = self.max_buffer_bytes {
            limits.max_buffer_bytes = Some(bytes);
        }
        if let Some(percent) = self.tenant_share_percent {
            if !(1..=100).contains(&percent) {
                return Err(format!("tenant_share_percent {percent}: give 1 to 100"));
            }
            limits.tenant_share_percent = percent;
        }
        if let Some(percent) = self.tenant_reserve_percent {
            if percent > 90 {
                return Err(format!(
                    "tenant_reserve_percent {percent}: give 0 to 90 (the tenants need some of the budget)"
                ));
            }
            limits.tenant_reserve_percent = percent;
        }
        if let Some(percent) = self.anonymous_share_percent {
            if !(1..=100).contains(&percent) {
                return Err(format!("anonymous_share_percent {percent}: give 1 to 100"));
            }
            limits.anonymous_share_percent = percent;
        }
        if let Some(Size(bytes)) = self.max_receiving {
            limits.max_receiving_bytes = Some(bytes);
        }
        if let Some(n) = self.max_registered_buffers_total {
            limits.max_registered_buffers_total = n;
        }
        if let Some(Size(bytes)) = self.max_registered_total {
            limits.max_registered_bytes_total = bytes;
        }
        if let Some(n) = self.max_admin_connections {
            limits.max_admin_connections = n;
        }
        if let Some(t) = seconds(self.admin_timeout, "admin_timeout")? {
            limits.admin_timeout = t;
        }
        if let Some(t) = seconds(self.peer_timeout, "peer_timeout")? {
            limits.peer_timeout = t;
        }
        Ok(limits)
    }

    /// `adopt_after` as a duration (its default when not given).
    pub(crate) fn adopt_after(&self) -> Result<Duration, String> {
        Ok(seconds(
            Some(self.adopt_after.unwrap_or(DEFAULT_ADOPT_AFTER)),
            "adopt_after",
        )?
        .unwrap_or_default())
    }
}

/// A positive number of seconds.
pub(crate) fn seconds(value: Option<f64>, what: &str) -> Result<Option<Duration>, String> {
    value
        .map(|s| {
            Duration::try_from_secs_f64(s)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or_else(|| format!("{what}: {s} is not a positive number of seconds"))
        })
        .transpose()
}

fn address(text: &str, what: &str) -> Result<Option<SocketAddr>, String> {
    if text == "off" {
        return Ok(None);
    }
    text.parse()
        .map(Some)
        .map_err(|e| format!("{what} {text:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize)]
    struct Flags {
        #[serde(skip_serializing_if = "Option::is_none")]
        memory: Option<u64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        listen: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        etcd: Option<Vec<String>>,
    }

    #[test]
    fn flags_given_win_over_the_file_and_absent_flags_keep_it() {
        let file: NodeConfig = toml::from_str(
            "memory = \"2GiB\"\nlisten = \"127.0.0.1:9000\"\nmax_frame = 1048576\nshared_poll = 1\n",
        )
        .unwrap();
        assert_eq!(file.memory, Some(Size(2 << 30)));
        assert_eq!(file.max_frame, Some(Size(1 << 20)));
        assert_eq!(file.shared_poll, Some(1.0));
        let flags = Flags {
            memory: Some(4096),
            listen: None,
            etcd: Some(vec!["http://127.0.0.1:2379".into()]),
        };
        let both = file.clone().layered(&flags).unwrap();
        assert_eq!(both.memory, Some(Size(4096)));
        assert_eq!(both.listen.as_deref(), Some("127.0.0.1:9000"));
        assert_eq!(both.max_frame, Some(Size(1 << 20)));
        assert_eq!(both.etcd().endpoints, ["http://127.0.0.1:2379"]);
        // Nothing given: the file unchanged.
        let none = Flags {
            memory: None,
            listen: None,
            etcd: None,
        };
        assert_eq!(file.clone().layered(&none).unwrap(), file);
    }

    #[test]
    fn bad_keys_and_values_are_errors_that_name_them() {
        let unknown = toml::from_str::<NodeConfig>("memroy = \"1GiB\"\n").unwrap_err();
        assert!(unknown.to_string().contains("memroy"), "{unknown}");
        let size = toml::from_str::<NodeConfig>("disk = \"12 parsecs\"\n").unwrap_err();
        assert!(size.to_string().contains("disk"), "{size}");
        let negative = toml::from_str::<NodeConfig>("disk = -1\n").unwrap_err();
        assert!(negative.to_string().contains("negative"), "{negative}");
        let config: NodeConfig = toml::from_str("shared_poll = 0\n").unwrap();
        let err = config.store_config().unwrap_err();
        assert!(err.contains("shared_poll"), "{err}");
        let config: NodeConfig = toml::from_str("flush_yield = -0.5\n").unwrap();
        let err = config.store_config().unwrap_err();
        assert!(err.contains("flush_yield"), "{err}");
        let config: NodeConfig = toml::from_str("shared_read = \"cached\"\n").unwrap();
        assert!(config
            .store_config()
            .unwrap_err()
            .contains("auto, direct or buffered"));
        let config: NodeConfig = toml::from_str("tenant_share_percent = 0\n").unwrap();
        assert!(config
            .limits()
            .unwrap_err()
            .contains("tenant_share_percent"));
        let config: NodeConfig = toml::from_str("shared_index = \"share\"\n").unwrap();
        assert!(config
            .store_config()
            .unwrap_err()
            .contains("needs --cluster"));
        let config: NodeConfig = toml::from_str("tls_cert = \"/x.pem\"\n").unwrap();
        assert!(config
            .server_config()
            .unwrap_err()
            .contains("both --tls-cert and --tls-key"));
    }

    #[test]
    fn defaults_are_the_documented_ones() {
        let config = NodeConfig::default();
        assert_eq!(config.data_dir(), PathBuf::from("./kvtier-data"));
        let server = config.server_config().unwrap();
        assert_eq!(server.listen, Some("127.0.0.1:7700".parse().unwrap()));
        assert_eq!(server.admin, Some("127.0.0.1:7701".parse().unwrap()));
        assert_eq!(
            server.socket,
            Some(PathBuf::from("./kvtier-data/kvtier.sock"))
        );
        let limits = Limits::default();
        assert_eq!(server.limits.max_frame, limits.max_frame);
        assert_eq!(server.limits.max_connections, limits.max_connections);
        assert_eq!(config.adopt_after().unwrap(), Duration::from_secs(300));
        let store = config.store_config().unwrap();
        assert_eq!(store.configured_flush_yield(), Duration::from_secs(1));
        let never: NodeConfig = toml::from_str("flush_yield = 0\n").unwrap();
        assert_eq!(
            never.store_config().unwrap().configured_flush_yield(),
            Duration::ZERO
        );
        let off: NodeConfig =
            toml::from_str("listen = \"off\"\nadmin = \"off\"\nsocket = \"off\"\n").unwrap();
        let server = off.server_config().unwrap();
        assert_eq!(
            (server.listen, server.admin, server.socket),
            (None, None, None)
        );
    }
}
