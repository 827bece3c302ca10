//! kvtier's wire format and what both ends of a connection share: frames,
//! operations, status codes and put flags (docs/protocol.md), framed
//! transports over Unix sockets, TCP and TLS, shared-memory regions passed
//! as descriptors, and the cluster's member view. The client
//! (`kvtier-client`) and the server (`kvtier-server`) both build on it;
//! it links neither.

pub mod cluster;
pub mod proof;
pub mod protocol;
pub mod shm;
pub mod stats;
pub mod tls;
pub mod transport;
