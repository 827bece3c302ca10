//! A whole kvtier node from one configuration: the store, the server,
//! cluster membership, the index-share keeper, the dead-writer adopter and
//! the KV-event feed. `kvtier serve` is a front end over it (flags laid
//! over a TOML file, signals, the serving line); an embedding program or a
//! test starts the same node with `Node::start`.
//!
//! - `config`: `NodeConfig`, every key and its default, and how it becomes
//!   the store's and the server's configurations.
//! - `node`: `Node::start` composing the parts in order, `Node::wait`
//!   taking them down in reverse.
//! - `feed_config`: the event feed's keys checked (who may reach it); the
//!   feed itself (vLLM's format over ZeroMQ) is the `kvtier-events` crate.
//! - `membership`: this node as a cluster member on etcd (`cluster`
//!   feature).
//! - `share_keeper`, `adopter`: the cluster-mode workers over the store.
//!
//! ```no_run
//! let mut config = kvtier_node::NodeConfig::default();
//! config.data_dir = Some("/var/lib/kvtier".into());
//! let node = kvtier_node::Node::start(config)?;
//! println!("{}", node.serving_line());
//! node.wait()?;
//! # Ok::<(), kvtier_node::NodeError>(())
//! ```

mod adopter;
mod config;
mod feed_config;
mod membership;
mod node;
mod share_keeper;

pub use config::{EtcdConfig, NodeConfig, Size};
#[cfg(feature = "cluster")]
pub use membership::etcd_access;
pub use membership::NOT_BUILT as CLUSTER_NOT_BUILT;
pub use node::{Node, NodeError, Stopper};
