//! Who may talk to the server: every admission and authorisation
//! decision about a peer is made here, and nowhere else.
//!
//! - Listeners: TCP needs a token; TCP off loopback needs TLS; an admin
//!   endpoint off loopback needs a token ([`Auth::check_listeners`]).
//! - A connection's hello ([`Auth::admit_hello`]), and an admin request
//!   ([`Auth::admits_admin_request`]).
//!
//! - TCP (loopback included): the token, always. Any local user can reach
//!   a loopback port, so loopback alone proves nothing.
//! - Unix socket: the socket file is 0600 in the data directory; a peer
//!   running as the server's user (or root) is trusted by its kernel
//!   credentials (SO_PEERCRED), any other peer needs the token.
//! - Admin HTTP off loopback: the token as `Authorization: Bearer`.
//!
//! - Connection slots ([`Admission`]): unauthenticated connections wait
//!   in their own small budget, per-address caps on TCP, reserved slots
//!   for same-user Unix peers.
//!
//! Tokens are compared in constant time (`subtle`), must be at least
//! [`MIN_TOKEN_LEN`] bytes, are compared at most
//! `Limits::max_failed_hellos_per_second` times a second when they do not
//! match ([`GuessBudget`]), and a refused hello is answered only after
//! `Limits::failed_auth_delay`.

use kvtier_governor::Principal;
use kvtier_wire::proof::{self, TokenKey};
use kvtier_wire::transport::Transport;
use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::net::SocketAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Instant;
use subtle::ConstantTimeEq;

pub use crate::admission::Peer;
pub use kvtier_governor::GuessBudget;

/// Shortest token accepted.
pub const MIN_TOKEN_LEN: usize = 16;

/// Where `kvtier serve` keeps the token it generated at first start.
pub const TOKEN_FILE: &str = "auth-token";

/// The server's token and identity.
#[derive(Clone)]
pub struct Auth {
    token: Option<Box<[u8]>>,
    /// The server token's proof keys (challenge-response hellos).
    token_key: Option<TokenKey>,
    server_uid: u32,
    /// Tokens scoped to namespace prefixes (`tenants`).
    tenants: Vec<Tenant>,
}

/// A token that may use only namespaces starting with one of its
/// prefixes, and sees no other tenant (no STATS, no cluster view).
#[derive(Clone)]
pub struct Tenant {
    pub name: String,
    token: Box<[u8]>,
    key: TokenKey,
    pub prefixes: Vec<String>,
}

impl std::fmt::Debug for Tenant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tenant")
            .field("name", &self.name)
            .field("prefixes", &self.prefixes)
            .finish()
    }
}

impl Tenant {
    fn scope(&self) -> Scope {
        Scope::Tenant {
            name: self.name.clone(),
            prefixes: self.prefixes.clone(),
        }
    }
}

/// A challenge this server answered on a connection: its hello must carry
/// the client's proof for these nonces.
#[derive(Debug, Clone)]
pub struct Issued {
    client_nonce: [u8; proof::NONCE_LEN],
    server_nonce: [u8; proof::NONCE_LEN],
    /// Whose token the client named.
    holder: Holder,
    /// The cluster member the client meant, if it named one, and whether
    /// that is this server: a hello after a challenge meant for another
    /// member is refused (the client was relayed here).
    member: Option<(String, bool)>,
}

#[derive(Debug, Clone, Copy)]
enum Holder {
    Server,
    Tenant(usize),
}

/// What a hello presents.
#[derive(Debug)]
pub enum Credential<'a> {
    /// The token itself (clients that skip the challenge).
    Token(&'a [u8]),
    /// A proof for a challenge answered on this connection.
    Proof {
        issued: &'a Issued,
        proof: &'a [u8],
        namespace: &'a str,
    },
}

impl Credential<'_> {
    fn is_empty(&self) -> bool {
        matches!(self, Credential::Token(t) if t.is_empty())
    }
}

/// What a connection may do once its hello succeeded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// The server's token, or a Unix peer of the server's user: anything.
    Full,
    /// A tenant's token: its namespaces only, and no server-wide views.
    Tenant { name: String, prefixes: Vec<String> },
}

impl Scope {
    /// Why `namespace` is refused to this scope, if it is.
    pub fn refuses_namespace(&self, namespace: &str) -> Option<String> {
        match self {
            Scope::Full => None,
            Scope::Tenant { name, prefixes } => {
                (!prefixes.iter().any(|p| namespace_within(p, namespace))).then(|| {
                    format!(
                        "namespace {namespace:?} is outside tenant {name}'s namespaces \
                         ({prefixes:?})"
                    )
                })
            }
        }
    }

    /// Whether server-wide views (STATS, the cluster view) are open to it.
    pub fn sees_the_server(&self) -> bool {
        matches!(self, Scope::Full)
    }
}

/// Separates the components of a namespace (`vllm/llama/float16/0/...`):
/// tenant prefixes are compared on these boundaries only.
pub const NAMESPACE_SEPARATOR: char = '/';

/// Whether `namespace` lies within the tenant prefix `prefix`, compared by
/// whole components: `team1` and `team1/` cover `team1` and `team1/x`,
/// never `team10` (a prefix that matched characters would hand tenant
/// `team1` every namespace of tenant `team10`).
pub fn namespace_within(prefix: &str, namespace: &str) -> bool {
    let Some(rest) = namespace.strip_prefix(prefix) else {
        return false;
    };
    rest.is_empty()
        || prefix.ends_with(NAMESPACE_SEPARATOR)
        || rest.starts_with(NAMESPACE_SEPARATOR)
}

/// Whether some namespace lies within both prefixes (one covers the
/// other, by whole components).
fn prefixes_overlap(a: &str, b: &str) -> bool {
    let a = a.trim_end_matches(NAMESPACE_SEPARATOR);
    let b = b.trim_end_matches(NAMESPACE_SEPARATOR);
    namespace_within(a, b) || namespace_within(b, a)
}

/// The tenants file (TOML): one `[[tenant]]` table per tenant, with
/// `name`, `token` (at least `MIN_TOKEN_LEN` bytes) and `namespaces` (the
/// prefixes its namespaces must start with, compared by whole
/// `/`-separated components; at least one, none empty). Two tenants whose
/// prefixes overlap (one within the other) are refused: one would read the
/// other's values.
/// Opened as a secret (no link, the server's own, no group/other rights).
pub fn read_tenants(path: &Path) -> io::Result<Vec<Tenant>> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct File {
        #[serde(default)]
        tenant: Vec<Entry>,
    }
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Entry {
        name: String,
        token: String,
        namespaces: Vec<String>,
    }
    let invalid = |why: String| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: {why}", path.display()),
        )
    };
    let mut text = String::new();
    io::Read::read_to_string(&mut kvtier::private_files::open_secret(path)?, &mut text)?;
    let file: File = toml::from_str(&text).map_err(|e| invalid(e.to_string()))?;
    let mut tenants: Vec<Tenant> = Vec::new();
    for entry in file.tenant {
        check_token(&entry.token).map_err(|e| invalid(format!("tenant {}: {e}", entry.name)))?;
        if entry.namespaces.is_empty() || entry.namespaces.iter().any(String::is_empty) {
            return Err(invalid(format!(
                "tenant {} needs at least one non-empty namespace prefix",
                entry.name
            )));
        }
        if tenants
            .iter()
            .any(|t| t.name == entry.name || *t.token == *entry.token.as_bytes())
        {
            return Err(invalid(format!(
                "tenant {} (or its token) appears twice",
                entry.name
            )));
        }
        for other in &tenants {
            let clash = other.prefixes.iter().find_map(|theirs| {
                entry
                    .namespaces
                    .iter()
                    .find(|ours| prefixes_overlap(ours, theirs))
                    .map(|ours| (ours, theirs))
            });
            if let Some((ours, theirs)) = clash {
                return Err(invalid(format!(
                    "the namespace prefixes of tenants {} ({ours:?}) and {} ({theirs:?}) \
                     overlap: one tenant would read and remove the other's values. Give every \
                     tenant prefixes of its own (compared by whole '/'-separated components)",
                    entry.name, other.name
                )));
            }
        }
        tenants.push(Tenant {
            name: entry.name,
            key: TokenKey::new(entry.token.as_bytes()),
            token: entry.token.into_bytes().into(),
            prefixes: entry.namespaces,
        });
    }
    Ok(tenants)
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth")
            .field("token", &self.token.as_ref().map(|_| ".."))
            .field("server_uid", &self.server_uid)
            .finish()
    }
}

impl Auth {
    /// Checks the token's length (a short token can be guessed).
    pub fn new(token: Option<&str>) -> io::Result<Auth> {
        if let Some(token) = token {
            check_token(token)?;
        }
        Ok(Auth {
            token: token.map(|t| t.as_bytes().into()),
            token_key: token.map(|t| TokenKey::new(t.as_bytes())),
            server_uid: rustix::process::geteuid().as_raw(),
            tenants: Vec::new(),
        })
    }

    /// Adds tokens scoped to namespace prefixes (see `read_tenants`); none
    /// may equal the server's token.
    pub fn with_tenants(mut self, tenants: Vec<Tenant>) -> io::Result<Auth> {
        if tenants
            .iter()
            .any(|t| self.token.as_deref() == Some(&*t.token))
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a tenant's token is the server's token: give every tenant a token of its own",
            ));
        }
        self.tenants = tenants;
        Ok(self)
    }

    /// Whether tokens scoped to tenants are configured (then the admin
    /// endpoint asks for the server's token even on loopback: its views
    /// show every tenant).
    pub fn has_tenants(&self) -> bool {
        !self.tenants.is_empty()
    }

    /// The scope `presented` opens: the server's token, a tenant's, or
    /// none. Every token is compared, each in constant time.
    pub fn scope_of_token(&self, presented: &[u8]) -> Option<Scope> {
        let mut scope = self.token_matches(presented).then_some(Scope::Full);
        for tenant in &self.tenants {
            let matches =
                tenant.token.len() == presented.len() && bool::from(tenant.token.ct_eq(presented));
            if matches && scope.is_none() {
                scope = Some(tenant.scope());
            }
        }
        scope
    }

    /// The scope a credential opens, if any.
    fn scope_of(&self, credential: &Credential<'_>) -> Option<Scope> {
        match credential {
            Credential::Token(token) => self.scope_of_token(token),
            Credential::Proof {
                issued,
                proof,
                namespace,
            } => {
                let (key, scope) = match issued.holder {
                    Holder::Server => (self.token_key.as_ref()?, Scope::Full),
                    Holder::Tenant(i) => {
                        let tenant = self.tenants.get(i)?;
                        (&tenant.key, tenant.scope())
                    }
                };
                let expected = match &issued.member {
                    None => key.client_proof(&issued.client_nonce, &issued.server_nonce, namespace),
                    Some((_, false)) => return None,
                    Some((member, true)) => key.client_proof_for(
                        &issued.client_nonce,
                        &issued.server_nonce,
                        namespace,
                        member,
                    ),
                };
                proof::proofs_equal(proof, &expected).then_some(scope)
            }
        }
    }

    /// Answers a client's challenge: a fresh nonce and the proof that this
    /// server holds the token the client names by `token_id`. Naming a
    /// token the server does not hold is a refused guess, exactly as a
    /// wrong token in a hello: it takes a turn of `guesses` and is
    /// answered only after its delay (else the challenge would test
    /// guesses faster than hellos may).
    ///
    /// A challenge that names the member the client meant (`member`) is
    /// answered with this server's own member id (`own_id`) and a proof
    /// bound to it, whichever member was named: the client then knows
    /// whom it reached, and a hello after a challenge meant for another
    /// member is refused.
    #[allow(clippy::too_many_arguments)]
    pub fn challenge(
        &self,
        client_nonce: &[u8; proof::NONCE_LEN],
        token_id: &[u8; proof::TOKEN_ID_LEN],
        member: Option<&str>,
        own_id: &str,
        guesses: &GuessBudget,
        deadline: Instant,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<(Issued, Vec<u8>), String> {
        let found = if self.token_key.as_ref().is_some_and(|k| k.id() == *token_id) {
            Some(Holder::Server)
        } else {
            self.tenants
                .iter()
                .position(|t| t.key.id() == *token_id)
                .map(Holder::Tenant)
        };
        let found = found.and_then(|holder| {
            let key = match holder {
                Holder::Server => self.token_key.as_ref()?,
                Holder::Tenant(i) => &self.tenants[i].key,
            };
            Some((holder, key))
        });
        // Only a refusal waits for a turn (a name that matches spends none,
        // so guessers cannot hold a token holder's challenge back).
        let Some((holder, key)) = found else {
            if !guesses.take_turn(deadline, cancelled) {
                return Err("too many refused hellos on this server: retry later".into());
            }
            guesses.refusal_pause(cancelled);
            return Err("wrong auth token".into());
        };
        let server_nonce = proof::nonce().map_err(|e| e.to_string())?;
        let mut reply = Vec::with_capacity(proof::NONCE_LEN + proof::PROOF_LEN + 2 + own_id.len());
        reply.extend_from_slice(&server_nonce);
        match member {
            None => reply.extend_from_slice(&key.server_proof(client_nonce, &server_nonce)),
            Some(_) => {
                reply.extend_from_slice(&key.server_proof_as(client_nonce, &server_nonce, own_id));
                reply.extend_from_slice(&(own_id.len() as u16).to_le_bytes());
                reply.extend_from_slice(own_id.as_bytes());
            }
        }
        Ok((
            Issued {
                client_nonce: *client_nonce,
                server_nonce,
                holder,
                member: member.map(|m| (m.to_string(), m == own_id)),
            },
            reply,
        ))
    }

    /// Whether `token_id` names a token this server holds (its own or a
    /// tenant's): a connection whose first message says so is a token
    /// holder about to prove it, never closed for a newcomer.
    pub fn names_held_token(&self, token_id: &[u8; proof::TOKEN_ID_LEN]) -> bool {
        self.token_key.as_ref().is_some_and(|k| k.id() == *token_id)
            || self.tenants.iter().any(|t| t.key.id() == *token_id)
    }

    /// The principal a challenge naming `token_id` is charged to while it
    /// waits for its hello; unauthenticated peers when no token of this
    /// server has that name.
    pub fn principal_of_token_id(&self, token_id: &[u8; proof::TOKEN_ID_LEN]) -> Principal {
        if self.token_key.as_ref().is_some_and(|k| k.id() == *token_id) {
            return Principal::Server;
        }
        self.tenants
            .iter()
            .position(|t| t.key.id() == *token_id)
            .map_or(Principal::Anonymous, Principal::Tenant)
    }

    /// The principal a connection of `scope` is charged to: the server's
    /// own for the full scope, the tenant's (by its place in the tenants
    /// file, as the governor counts them) otherwise.
    pub fn principal_of(&self, scope: &Scope) -> Principal {
        match scope {
            Scope::Full => Principal::Server,
            Scope::Tenant { name, .. } => self
                .tenants
                .iter()
                .position(|t| &t.name == name)
                .map_or(Principal::Anonymous, Principal::Tenant),
        }
    }

    pub fn has_token(&self) -> bool {
        self.token.is_some()
    }

    /// Whether `presented` is the token (constant time in its contents).
    pub fn token_matches(&self, presented: &[u8]) -> bool {
        match &self.token {
            Some(token) => token.len() == presented.len() && bool::from(token.ct_eq(presented)),
            None => false,
        }
    }

    /// HMAC-SHA256 of `label` keyed with the server's token: a secret only
    /// holders of that token can compute (the event feed's CURVE server
    /// key), stable for as long as the token is.
    pub fn derived_from_server_token(&self, label: &[u8]) -> Option<[u8; 32]> {
        self.token.as_deref().map(|t| hmac_sha256(t, label))
    }

    /// HMAC-SHA256 of `label` keyed with every token this server holds,
    /// the server's first, each with what it opens: what a holder of that
    /// token derives with the same label (the event feed's CURVE client
    /// keys) and what the server then lets it see.
    pub fn derived_from_each_token(&self, label: &[u8]) -> Vec<([u8; 32], Scope)> {
        let server = self
            .token
            .as_deref()
            .map(|t| (hmac_sha256(t, label), Scope::Full));
        server
            .into_iter()
            .chain(
                self.tenants
                    .iter()
                    .map(|t| (hmac_sha256(&t.token, label), t.scope())),
            )
            .collect()
    }
    /// Refuses listeners that would expose the store: TCP without a token
    /// (any local user can reach a TCP port), TCP off loopback without TLS
    /// (the token and values would cross the network in the clear), and
    /// an admin endpoint off loopback without a token.
    pub fn check_listeners(
        &self,
        listen: Option<SocketAddr>,
        tls: bool,
        admin: Option<SocketAddr>,
    ) -> io::Result<()> {
        let refuse =
            |message: String| Err(io::Error::new(io::ErrorKind::PermissionDenied, message));
        if let Some(addr) = listen {
            if !self.has_token() {
                return refuse(format!(
                    "refusing to listen on TCP {addr} without an auth token: any local user \
                     can reach a TCP port. Set --auth-token or KVTIER_AUTH_TOKEN (kvtier \
                     serve generates one in <data_dir>/{TOKEN_FILE}), or use only the Unix socket"
                ));
            }
            if !addr.ip().is_loopback() && !tls {
                return refuse(format!(
                    "refusing to listen on non-loopback {addr} without TLS: the token and \
                     the values would cross the network in the clear. Give --tls-cert and \
                     --tls-key"
                ));
            }
        }
        if let Some(addr) = admin {
            if !addr.ip().is_loopback() && !self.has_token() {
                return refuse(format!(
                    "refusing to serve admin HTTP on non-loopback {addr} without an auth token"
                ));
            }
        }
        Ok(())
    }

    /// Decides a connection's hello: a Unix-socket peer running as the
    /// server's user (or root) is trusted by its credentials, every other
    /// peer must present the token. A refusal is answered only after
    /// `delay` (it slows guessing) and says why.
    ///
    /// A refusal waits for a turn of `guesses` (server-wide), so parallel
    /// connections cannot learn answers to guesses faster than its rate;
    /// without a turn before `deadline` the hello is refused unanswered.
    /// A credential that matches is admitted at once.
    pub fn admit_hello(
        &self,
        peer: &Peer,
        credential: &Credential<'_>,
        guesses: &GuessBudget,
        deadline: Instant,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<Scope, &'static str> {
        if peer.trusted_by_credentials {
            // A peer trusted whole may still ask for less: one that proves
            // a tenant's token gets that tenant's scope (engines of several
            // tenants run as one user and reach the Unix socket, which the
            // shared-memory transfers need). Any other credential, or none,
            // leaves it trusted whole, as before tenants.
            return Ok(match self.scope_of(credential) {
                Some(scope @ Scope::Tenant { .. }) => scope,
                _ => Scope::Full,
            });
        }
        // Only a refusal waits for a turn: a credential that matches spends
        // none, so guessers cannot hold a token holder's hello back (the
        // answers to guesses are still paced by the turns and the delay).
        if let Some(scope) = self.scope_of(credential) {
            return Ok(scope);
        }
        if !guesses.take_turn(deadline, cancelled) {
            return Err("too many refused hellos on this server: retry later");
        }
        guesses.refusal_pause(cancelled);
        Err(if peer.unix {
            "this Unix-socket peer runs as another user: present the server's auth token"
        } else if credential.is_empty() {
            "TCP clients must present the server's auth token (KVTIER_AUTH_TOKEN; kvtier \
             serve keeps a generated one in <data_dir>/auth-token)"
        } else {
            "wrong auth token"
        })
    }

    /// What the server knows of a new connection's peer before its hello.
    pub fn peer(&self, transport: &Transport) -> Peer {
        match transport {
            Transport::Unix(stream) => Peer {
                unix: true,
                trusted_by_credentials: self.trusts_unix_peer(stream),
                pid: rustix::net::sockopt::socket_peercred(stream)
                    .ok()
                    .map(|cred| cred.pid.as_raw_nonzero().get())
                    .filter(|&pid| pid > 0),
            },
            Transport::Tcp(_) | Transport::TlsServer(_) | Transport::TlsClient(_) => Peer {
                unix: false,
                trusted_by_credentials: false,
                pid: None,
            },
        }
    }

    /// Whether an admin request may be answered for the `Host` it names.
    /// With a token required (off loopback) the token decides. On loopback
    /// without one, only loopback names and `allowed` are answered: a
    /// browser page whose name an attacker rebound to 127.0.0.1 (DNS
    /// rebinding) still sends its own name. A request without `Host`
    /// (HTTP/1.0 tools) comes from no browser and is answered.
    pub fn admin_host_allowed(needs_token: bool, host: Option<&str>, allowed: &[String]) -> bool {
        let Some(host) = host else {
            return true;
        };
        if needs_token {
            return true;
        }
        let name = match host.strip_prefix('[') {
            // [v6]:port
            Some(rest) => rest.split(']').next().unwrap_or(""),
            None => host.rsplit_once(':').map_or(host, |(name, _)| name),
        };
        let name = name.to_ascii_lowercase();
        if name == "localhost" || name.ends_with(".localhost") {
            return true;
        }
        if name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
        {
            return true;
        }
        allowed.iter().any(|a| a.eq_ignore_ascii_case(&name))
    }

    /// Whether an admin endpoint listening on `addr` asks for the token
    /// (off loopback; an address it cannot tell counts as off).
    pub fn admin_needs_token(addr: Option<SocketAddr>) -> bool {
        addr.is_none_or(|a| !a.ip().is_loopback())
    }

    /// Whether an admin request may be answered: always on loopback, and
    /// off it with the token as `Authorization: Bearer` (the page's own
    /// static files are public).
    pub fn admits_admin_request(&self, needs_token: bool, authorization: Option<&str>) -> bool {
        !needs_token || self.bearer_matches(authorization)
    }

    /// Whether a Unix-socket peer runs as the server's user or as root.
    fn trusts_unix_peer(&self, stream: &std::os::unix::net::UnixStream) -> bool {
        peer_uid(stream).is_some_and(|uid| uid == self.server_uid || uid == 0)
    }

    /// Whether an admin request's `Authorization` header value carries the
    /// token.
    fn bearer_matches(&self, header: Option<&str>) -> bool {
        header
            .and_then(|h| h.trim().strip_prefix("Bearer "))
            .is_some_and(|t| self.token_matches(t.trim().as_bytes()))
    }
}

/// A token must be long enough not to be guessed, and printable.
pub fn check_token(token: &str) -> io::Result<()> {
    if token.len() < MIN_TOKEN_LEN {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "the auth token is {} bytes: tokens must be at least {MIN_TOKEN_LEN} (use a \
                 random one, e.g. `openssl rand -hex 32`)",
                token.len()
            ),
        ));
    }
    if token.len() > kvtier_wire::protocol::MAX_TOKEN_LEN || token.chars().any(char::is_control) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "the auth token must be at most {} printable bytes",
                kvtier_wire::protocol::MAX_TOKEN_LEN
            ),
        ));
    }
    Ok(())
}

/// The token kept in `<data_dir>/auth-token`, generated (64 hex digits
/// from the kernel's random source, file mode 0600) if there is none yet.
pub fn data_dir_token(data_dir: &Path) -> io::Result<(String, PathBuf)> {
    let path = data_dir.join(TOKEN_FILE);
    // Never through a link, and only a regular file of ours that no other
    // user can read (checked on the open descriptor).
    match kvtier::private_files::open_secret(&path) {
        Ok(mut file) => {
            let mut text = String::new();
            io::Read::read_to_string(&mut file, &mut text)?;
            let token = text.trim().to_string();
            check_token(&token)?;
            Ok((token, path))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            kvtier::private_files::create_dir(data_dir)?;
            let secret = kvtier::KeySecret::generate().map_err(io::Error::other)?;
            let token: String = secret
                .as_bytes()
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            let tmp = data_dir.join(format!("{TOKEN_FILE}.tmp"));
            let _ = fs::remove_file(&tmp);
            let mut file = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(kvtier::private_files::FILE_MODE)
                .open(&tmp)?;
            file.write_all(format!("{token}\n").as_bytes())?;
            file.sync_all()?;
            fs::rename(&tmp, &path)?;
            Ok((token, path))
        }
        Err(e) => Err(e),
    }
}

/// The peer's user id from its kernel credentials (SO_PEERCRED), as it
/// was when it connected.
fn peer_uid(stream: &std::os::unix::net::UnixStream) -> Option<u32> {
    rustix::net::sockopt::socket_peercred(stream)
        .ok()
        .map(|cred| cred.uid.as_raw())
}

/// HMAC-SHA256 (RFC 2104) of `message` under `key`: the derivation any
/// client can repeat with its language's standard library.
fn hmac_sha256(key: &[u8], message: &[u8]) -> [u8; 32] {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key);
    let tag = ring::hmac::sign(&key, message);
    tag.as_ref().try_into().expect("SHA-256 tags are 32 bytes")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;
    use std::time::Duration;

    #[test]
    fn tenant_prefixes_cover_whole_components_only() {
        for (prefix, namespace, within) in [
            ("team1", "team1", true),
            ("team1", "team1/llama", true),
            ("team1/", "team1/llama", true),
            ("team1/", "team1", false),
            ("team1", "team10", false),
            ("team1", "team10/llama", false),
            ("team1/", "team10/llama", false),
            ("tenant-a/", "tenant-ab", false),
            ("a/b", "a/b/c", true),
            ("a/b", "a/bc", false),
            ("team1", "", false),
        ] {
            assert_eq!(
                namespace_within(prefix, namespace),
                within,
                "{prefix:?} over {namespace:?}"
            );
        }
        assert!(prefixes_overlap("team1", "team1/x"));
        assert!(prefixes_overlap("team1/", "team1"));
        assert!(!prefixes_overlap("team1", "team10"));
        assert!(!prefixes_overlap("team1/", "team10/"));
    }

    #[test]
    fn a_tenants_file_with_overlapping_prefixes_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tenants.toml");
        let write = |body: &str| {
            std::fs::write(&path, body).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        };
        let token_a = "token-of-team-one-0123456789";
        let token_b = "token-of-team-ten-0123456789";
        write(&format!(
            "[[tenant]]\nname = \"one\"\ntoken = \"{token_a}\"\nnamespaces = [\"team1\"]\n\
             [[tenant]]\nname = \"ten\"\ntoken = \"{token_b}\"\nnamespaces = [\"team10\"]\n"
        ));
        let tenants = read_tenants(&path).unwrap();
        assert_eq!(tenants.len(), 2);
        assert!(tenants[0]
            .scope()
            .refuses_namespace("team10/llama")
            .is_some());
        assert!(tenants[0]
            .scope()
            .refuses_namespace("team1/llama")
            .is_none());
        write(&format!(
            "[[tenant]]\nname = \"one\"\ntoken = \"{token_a}\"\nnamespaces = [\"x/\", \"team1\"]\n\
             [[tenant]]\nname = \"sub\"\ntoken = \"{token_b}\"\nnamespaces = [\"team1/sub\"]\n"
        ));
        let e = read_tenants(&path).unwrap_err().to_string();
        assert!(e.contains("overlap") && e.contains("team1/sub"), "{e}");
    }

    #[test]
    fn admin_hosts_are_loopback_names_unless_a_token_guards_the_port() {
        let allowed = ["kvtier.internal".to_string()];
        for host in [
            "127.0.0.1",
            "127.0.0.1:7701",
            "localhost",
            "LOCALHOST:7701",
            "[::1]:7701",
            "kvtier.internal:80",
        ] {
            assert!(
                Auth::admin_host_allowed(false, Some(host), &allowed),
                "{host}"
            );
        }
        for host in [
            "evil.example",
            "evil.example:7701",
            "10.0.0.1",
            "[::2]:1",
            "",
        ] {
            assert!(
                !Auth::admin_host_allowed(false, Some(host), &allowed),
                "{host}"
            );
        }
        assert!(Auth::admin_host_allowed(
            true,
            Some("evil.example"),
            &allowed
        ));
        assert!(Auth::admin_host_allowed(false, None, &allowed));
    }

    #[test]
    fn challenges_prove_the_named_token_and_spend_a_guess_on_any_other() {
        let token = "0123456789abcdef0123";
        let auth = Auth::new(Some(token)).unwrap();
        let guesses = GuessBudget::new(1, Duration::ZERO);
        let deadline = Instant::now() + Duration::from_millis(200);
        let key = TokenKey::new(token.as_bytes());
        let cn = [7u8; proof::NONCE_LEN];
        let peer = Peer {
            unix: false,
            trusted_by_credentials: false,
            pid: None,
        };
        // The right token, many times: no turn is spent.
        for _ in 0..5 {
            let (issued, reply) = auth
                .challenge(&cn, &key.id(), None, "me", &guesses, deadline, &|| false)
                .unwrap();
            let sn: [u8; 32] = reply[..32].try_into().unwrap();
            assert!(proof::proofs_equal(
                &reply[32..],
                &key.server_proof(&cn, &sn)
            ));
            let good = key.client_proof(&cn, &sn, "ns");
            let credential = Credential::Proof {
                issued: &issued,
                proof: &good,
                namespace: "ns",
            };
            assert_eq!(
                auth.admit_hello(&peer, &credential, &guesses, deadline, &|| false),
                Ok(Scope::Full)
            );
            // The proof is bound to its namespace.
            let credential = Credential::Proof {
                issued: &issued,
                proof: &good,
                namespace: "other",
            };
            assert!(auth
                .admit_hello(&peer, &credential, &guesses, deadline, &|| false)
                .is_err());
            guesses.refill();
        }
        // Another token: refused, and it spends the only turn, so the next
        // guess before the deadline finds none.
        let wrong = TokenKey::new(b"0123456789abcdef0124");
        assert!(auth
            .challenge(&cn, &wrong.id(), None, "me", &guesses, deadline, &|| false)
            .is_err());
        let err = auth
            .challenge(
                &cn,
                &wrong.id(),
                None,
                "me",
                &guesses,
                Instant::now(),
                &|| false,
            )
            .unwrap_err();
        assert!(err.contains("too many refused"), "{err}");
    }

    /// Issue 39, finding 1: a challenge naming the member the client meant
    /// is answered with the server's own id, proven; a relay passing a
    /// challenge meant for dead member C to live member D gets D's id
    /// proven back (the client refuses), and D refuses the hello.
    #[test]
    fn a_challenge_meant_for_another_member_proves_who_answered_and_admits_nothing() {
        let token = "0123456789abcdef0123";
        let auth = Auth::new(Some(token)).unwrap();
        let guesses = GuessBudget::new(1, Duration::ZERO);
        let deadline = Instant::now() + Duration::from_millis(200);
        let key = TokenKey::new(token.as_bytes());
        let cn = [9u8; proof::NONCE_LEN];
        let peer = Peer {
            unix: false,
            trusted_by_credentials: false,
            pid: None,
        };
        let answer = |meant: &str| {
            let (issued, reply) = auth
                .challenge(
                    &cn,
                    &key.id(),
                    Some(meant),
                    "member-d",
                    &guesses,
                    deadline,
                    &|| false,
                )
                .unwrap();
            let sn: [u8; 32] = reply[..32].try_into().unwrap();
            let proof = &reply[32..64];
            let len = u16::from_le_bytes(reply[64..66].try_into().unwrap()) as usize;
            let stated = std::str::from_utf8(&reply[66..66 + len])
                .unwrap()
                .to_string();
            assert_eq!(reply.len(), 66 + len);
            (issued, sn, proof.to_vec(), stated)
        };
        // Meant for D, answered by D: proven as D, and D admits the hello.
        let (issued, sn, proof, stated) = answer("member-d");
        assert_eq!(stated, "member-d");
        assert!(proof::proofs_equal(
            &proof,
            &key.server_proof_as(&cn, &sn, "member-d")
        ));
        assert!(!proof::proofs_equal(
            &proof,
            &key.server_proof_as(&cn, &sn, "member-c")
        ));
        assert!(!proof::proofs_equal(&proof, &key.server_proof(&cn, &sn)));
        let good = key.client_proof_for(&cn, &sn, "ns", "member-d");
        let hello = |issued: &Issued, proof: &[u8]| {
            auth.admit_hello(
                &peer,
                &Credential::Proof {
                    issued,
                    proof,
                    namespace: "ns",
                },
                &guesses,
                deadline,
                &|| false,
            )
        };
        assert_eq!(hello(&issued, &good), Ok(Scope::Full));
        // The member-bound hello proof is not the plain one.
        guesses.refill();
        assert!(hello(&issued, &key.client_proof(&cn, &sn, "ns")).is_err());
        guesses.refill();
        // Meant for C, relayed to D: D states and proves D (the client sees
        // it is not C), and refuses any hello after it.
        let (issued, sn, proof, stated) = answer("member-c");
        assert_eq!(stated, "member-d");
        assert!(!proof::proofs_equal(
            &proof,
            &key.server_proof_as(&cn, &sn, "member-c")
        ));
        assert!(hello(&issued, &key.client_proof_for(&cn, &sn, "ns", "member-c")).is_err());
        guesses.refill();
        assert!(hello(&issued, &key.client_proof_for(&cn, &sn, "ns", "member-d")).is_err());
    }

    #[test]
    fn tokens_are_checked_for_length_and_compared_exactly() {
        assert!(Auth::new(Some("short")).is_err());
        let auth = Auth::new(Some("0123456789abcdef0123")).unwrap();
        assert!(auth.token_matches(b"0123456789abcdef0123"));
        assert!(!auth.token_matches(b"0123456789abcdef012"));
        assert!(!auth.token_matches(b"0123456789abcdef0124"));
        assert!(!auth.token_matches(b""));
        assert!(auth.bearer_matches(Some("Bearer 0123456789abcdef0123")));
        assert!(!auth.bearer_matches(Some("Basic 0123456789abcdef0123")));
        assert!(!Auth::new(None).unwrap().token_matches(b""));
    }

    #[test]
    fn data_dir_token_is_generated_once_and_private() {
        let dir = tempfile::tempdir().unwrap();
        let (a, path) = data_dir_token(dir.path()).unwrap();
        let (b, _) = data_dir_token(dir.path()).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.len(), 64);
        assert_eq!(
            fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
        assert!(data_dir_token(dir.path()).is_err());
        // A planted link is refused even to a private file of ours.
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
        let elsewhere = dir.path().join("elsewhere");
        fs::rename(&path, &elsewhere).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &path).unwrap();
        let e = data_dir_token(dir.path()).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
    }

    #[test]
    fn keys_derived_from_tokens_are_rfc_4231_hmac_sha256_each_with_its_scope() {
        // RFC 4231, test case 2: what any HMAC-SHA256 library computes.
        let tag = hmac_sha256(b"Jefe", b"what do ya want for nothing?");
        let hex: String = tag.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        let auth = Auth::new(Some("server-token-0123456789"))
            .unwrap()
            .with_tenants(vec![Tenant {
                name: "a".into(),
                token: b"tenant-a-token-0123456789".as_slice().into(),
                key: TokenKey::new(b"tenant-a-token-0123456789"),
                prefixes: vec!["a".into()],
            }])
            .unwrap();
        let each = auth.derived_from_each_token(b"label");
        assert_eq!(each.len(), 2);
        assert_eq!(
            each[0],
            (
                hmac_sha256(b"server-token-0123456789", b"label"),
                Scope::Full
            )
        );
        assert_eq!(
            each[1].0,
            hmac_sha256(b"tenant-a-token-0123456789", b"label")
        );
        assert!(matches!(&each[1].1, Scope::Tenant { name, .. } if name == "a"));
        assert_eq!(
            auth.derived_from_server_token(b"other"),
            Some(hmac_sha256(b"server-token-0123456789", b"other"))
        );
        assert_ne!(auth.derived_from_server_token(b"other"), Some(each[0].0));
        assert!(Auth::new(None)
            .unwrap()
            .derived_from_each_token(b"label")
            .is_empty());
    }
}
