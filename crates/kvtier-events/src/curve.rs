//! ZeroMQ's CURVE security mechanism, the server's side (CurveZMQ and
//! ZMTP-CURVE, rfc.zeromq.org/spec/26 and /25), as libzmq speaks it: the
//! feed off the host, encrypted and with every subscriber authenticated
//! by a key only a holder of a kvtier token can have.
//!
//! The handshake, after greetings naming CURVE (this side as-server):
//! - HELLO (client): its short-term key C' and a box of 64 zeros from C'
//!   to our long-term key S (proves it knows S, so it dialled us);
//! - WELCOME: our short-term key S' and a cookie, boxed from S to C';
//! - INITIATE (client): the cookie back, then boxed from C' to S' its
//!   long-term key C, a vouch (C' and S boxed from C to S', proving it
//!   holds C's secret) and its properties (the socket type);
//! - READY: our properties, boxed from S' to C'.
//!
//! Every frame after that is a MESSAGE: an 8-byte nonce that only rises
//! and a box of one flags byte (MORE, COMMAND) and the frame's bytes.
//! Nothing a peer sends is trusted before its box opens, and every length
//! is checked before it is used.
//!
//! Keys come from tokens (docs/integrations.md, "KV events"): a client's
//! secret key is HMAC-SHA256 keyed with its token of the label
//! `CLIENT_KEY_LABEL`; the server's is the same of the server's token with
//! `SERVER_KEY_LABEL`. A subscriber is let in only with the public key of
//! a token this server holds, and sees what that token opens.

use crypto_box::aead::generic_array::GenericArray;
use crypto_box::aead::AeadInPlace;
use crypto_box::{PublicKey, SalsaBox, SecretKey};
use std::io::{self, Read, Write};
use subtle::ConstantTimeEq;

use crate::frame::{self, Frame};

/// What a client's secret key is derived with from its token.
pub const CLIENT_KEY_LABEL: &[u8] = b"kvtier kv-events CURVE client key";
/// What the server's secret key is derived with from the server's token.
pub const SERVER_KEY_LABEL: &[u8] = b"kvtier kv-events CURVE server key";

const KEY: usize = 32;
const TAG: usize = 16;
const HELLO_LEN: usize = 200;
const COOKIE_LEN: usize = 96;
/// INITIATE without properties: name 9, cookie 96, nonce 8, box of C (32),
/// the vouch's nonce (16) and box (80).
const INITIATE_MIN: usize = 9 + COOKIE_LEN + 8 + TAG + 128;
/// Most bytes of INITIATE's properties (a socket type, an identity).
const MAX_PROPERTIES: usize = 4096;
/// A MESSAGE's bytes around the frame it carries: name 8, nonce 8, the
/// box's tag and the flags byte.
const MESSAGE_OVERHEAD: usize = 8 + 8 + TAG + 1;
const MESSAGE: &[u8] = b"\x07MESSAGE";
/// The MESSAGE nonces' prefixes: the server's frames, the client's.
const SERVER_MESSAGES: &[u8; 16] = b"CurveZMQMESSAGES";
const CLIENT_MESSAGES: &[u8; 16] = b"CurveZMQMESSAGEC";
const FLAG_MORE: u8 = 0x01;
const FLAG_COMMAND: u8 = 0x02;

fn invalid(why: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why.into())
}

/// The long-term keys of this side, and who may connect: each client key
/// with what it opens.
pub struct ServerKeys<T> {
    secret: SecretKey,
    public: PublicKey,
    clients: Vec<([u8; KEY], T)>,
}

impl<T: std::fmt::Debug> std::fmt::Debug for ServerKeys<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerKeys")
            .field("public", &z85_encode(self.public.as_bytes()))
            .field("clients", &self.clients.len())
            .finish()
    }
}

impl<T: Clone> ServerKeys<T> {
    /// Keys from the server's derived secret and the clients' derived
    /// secrets (their public keys are computed here).
    pub fn new(server_secret: [u8; KEY], client_secrets: Vec<([u8; KEY], T)>) -> Self {
        let secret = SecretKey::from(server_secret);
        let public = secret.public_key();
        let clients = client_secrets
            .into_iter()
            .map(|(s, t)| (SecretKey::from(s).public_key().to_bytes(), t))
            .collect();
        ServerKeys {
            secret,
            public,
            clients,
        }
    }

    /// The server's public key, in Z85 as ZeroMQ's socket options take it.
    pub fn public_z85(&self) -> String {
        z85_encode(self.public.as_bytes())
    }

    /// What each client key opens, in the order given.
    pub(crate) fn admitted(&self) -> impl Iterator<Item = &T> {
        self.clients.iter().map(|(_, what)| what)
    }

    /// What `client` (a long-term public key) opens, if it is one of ours.
    /// Every key is compared, each in constant time.
    fn admit(&self, client: &[u8; KEY]) -> Option<T> {
        let mut found = None;
        for (key, what) in &self.clients {
            if bool::from(key.ct_eq(client)) && found.is_none() {
                found = Some(what.clone());
            }
        }
        found
    }
}

fn nonce(prefix: &[u8], tail: &[u8]) -> GenericArray<u8, crypto_box::aead::consts::U24> {
    let mut n = [0u8; 24];
    n[..prefix.len()].copy_from_slice(prefix);
    n[prefix.len()..].copy_from_slice(tail);
    n.into()
}

/// Opens a box (tag, then ciphertext) in place: the plaintext, or an
/// error naming `what`.
fn open<'a>(
    b: &SalsaBox,
    n: &GenericArray<u8, crypto_box::aead::consts::U24>,
    sealed: &'a mut [u8],
    what: &str,
) -> io::Result<&'a mut [u8]> {
    if sealed.len() < TAG {
        return Err(invalid(format!("a CURVE {what} shorter than its tag")));
    }
    let (tag, text) = sealed.split_at_mut(TAG);
    b.decrypt_in_place_detached(n, b"", text, GenericArray::from_slice(tag))
        .map_err(|_| invalid(format!("a CURVE {what} that does not open")))?;
    Ok(text)
}

/// Appends `plain` boxed (tag, then ciphertext) to `out`.
fn seal_into(
    b: &SalsaBox,
    n: &GenericArray<u8, crypto_box::aead::consts::U24>,
    plain: &[u8],
    out: &mut Vec<u8>,
) {
    let at = out.len();
    out.resize(at + TAG, 0);
    out.extend_from_slice(plain);
    let (head, text) = out.split_at_mut(at + TAG);
    let tag = b
        .encrypt_in_place_detached(n, b"", text)
        .expect("a box of any length below 2^38 bytes seals");
    head[at..].copy_from_slice(&tag);
}

fn random<const N: usize>() -> io::Result<[u8; N]> {
    let mut bytes = [0u8; N];
    getrandom::fill(&mut bytes).map_err(|e| io::Error::other(format!("no randomness: {e}")))?;
    Ok(bytes)
}

fn read_command(s: &mut impl Read, max: usize, what: &str) -> io::Result<Vec<u8>> {
    match frame::read_frame(s, max)? {
        Frame::Command(body) => Ok(body),
        Frame::Message { .. } => Err(invalid(format!("the peer sent a message before {what}"))),
    }
}

/// Whether `b` is the box of an all-zero shared secret: the client's key
/// is of small order (zero, or a point of order 2, 4 or 8), and the box's
/// key is known to anyone. libsodium refuses such a key; so does this
/// side. (The boxes of two keys seal the same nothing to the same tag
/// only when their keys are the same.)
fn of_zero_secret(b: &SalsaBox) -> bool {
    let zero = SalsaBox::new(&PublicKey::from([0u8; KEY]), &SecretKey::from([1u8; KEY]));
    let n = nonce(b"kvtier zero-key?", &[0u8; 8]);
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    seal_into(b, &n, b"", &mut ours);
    seal_into(&zero, &n, b"", &mut theirs);
    bool::from(ours.ct_eq(&theirs))
}

fn error_frame(reason: &str) -> Vec<u8> {
    let reason = &reason.as_bytes()[..reason.len().min(255)];
    let mut body = b"\x05ERROR".to_vec();
    body.push(reason.len() as u8);
    body.extend_from_slice(reason);
    let mut framed = Vec::new();
    frame::put_frame(&mut framed, &body, false, true);
    framed
}

/// The handshake after the greetings. Returns what the client's key
/// opens and the connection's boxes.
///
/// A client key that is none of ours is refused with `PermissionDenied`:
/// `refused` is called first and returns once the refusal may be
/// answered (`true`: answered ERROR; `false`: closed without an answer).
/// INITIATE's properties go to `check_properties` before READY is sent: a
/// reason it gives is answered ERROR (`InvalidData`), and nothing else.
pub(crate) fn server_handshake<S: Read + Write, T: Clone>(
    s: &mut S,
    keys: &ServerKeys<T>,
    our_properties: &[u8],
    refused: &mut dyn FnMut() -> bool,
    check_properties: &mut dyn FnMut(&[u8]) -> Result<(), String>,
) -> io::Result<(T, Sealer, Opener)> {
    // HELLO: name, version 1.0, 72 bytes of padding, C', nonce, box.
    let mut hello = read_command(s, HELLO_LEN, "HELLO")?;
    if !hello.starts_with(b"\x05HELLO") {
        return Err(invalid("expected a CURVE HELLO"));
    }
    if hello.len() != HELLO_LEN {
        return Err(invalid(format!(
            "a CURVE HELLO of {} bytes ({HELLO_LEN} expected)",
            hello.len()
        )));
    }
    if hello[6..8] != [1, 0] {
        return Err(invalid(format!(
            "CURVE version {}.{} (1.0 spoken here)",
            hello[6], hello[7]
        )));
    }
    let client_short = PublicKey::from(<[u8; KEY]>::try_from(&hello[80..112]).expect("32"));
    let hello_nonce = u64::from_be_bytes(hello[112..120].try_into().expect("8"));
    let to_long = SalsaBox::new(&client_short, &keys.secret);
    if of_zero_secret(&to_long) {
        return Err(invalid(
            "a CURVE HELLO whose short-term key is of small order (a zero shared secret)",
        ));
    }
    let n = nonce(b"CurveZMQHELLO---", &hello[112..120]);
    let signature = open(&to_long, &n, &mut hello[120..], "HELLO")?;
    if signature.iter().any(|&b| b != 0) {
        return Err(invalid("a CURVE HELLO whose box is not 64 zeros"));
    }

    // WELCOME: a long nonce and the box of S' and the cookie. This side
    // keeps its state on the connection's thread, so the cookie is random
    // bytes it compares when they come back.
    let our_short = SecretKey::from(random::<KEY>()?);
    let cookie = random::<COOKIE_LEN>()?;
    let welcome_nonce = random::<16>()?;
    let mut welcome_plain = Vec::with_capacity(KEY + COOKIE_LEN);
    welcome_plain.extend_from_slice(our_short.public_key().as_bytes());
    welcome_plain.extend_from_slice(&cookie);
    let mut welcome = b"\x07WELCOME".to_vec();
    welcome.extend_from_slice(&welcome_nonce);
    seal_into(
        &to_long,
        &nonce(b"WELCOME-", &welcome_nonce),
        &welcome_plain,
        &mut welcome,
    );
    let mut framed = Vec::new();
    frame::put_frame(&mut framed, &welcome, false, true);
    s.write_all(&framed)?;

    // INITIATE: the cookie, a nonce past HELLO's, and the box from C' to
    // S' of C, the vouch and the properties.
    let mut initiate = read_command(s, INITIATE_MIN + MAX_PROPERTIES, "INITIATE")?;
    if !initiate.starts_with(b"\x08INITIATE") {
        return Err(invalid("expected a CURVE INITIATE"));
    }
    if initiate.len() < INITIATE_MIN {
        return Err(invalid(format!(
            "a CURVE INITIATE of {} bytes (at least {INITIATE_MIN})",
            initiate.len()
        )));
    }
    if !bool::from(initiate[9..9 + COOKIE_LEN].ct_eq(&cookie)) {
        return Err(invalid(
            "a CURVE INITIATE with a cookie this server did not give",
        ));
    }
    let initiate_nonce = u64::from_be_bytes(initiate[105..113].try_into().expect("8"));
    if initiate_nonce <= hello_nonce {
        return Err(invalid("a CURVE INITIATE whose nonce does not rise"));
    }
    let short = SalsaBox::new(&client_short, &our_short);
    let n = nonce(b"CurveZMQINITIATE", &initiate[105..113]);
    let inside = open(&short, &n, &mut initiate[113..], "INITIATE")?;
    let client_long: [u8; KEY] = inside[..KEY].try_into().expect("32");
    let vouch_nonce = nonce(b"VOUCH---", &inside[KEY..KEY + 16]);
    let vouch_box = SalsaBox::new(&PublicKey::from(client_long), &our_short);
    let vouch = open(
        &vouch_box,
        &vouch_nonce,
        &mut inside[KEY + 16..KEY + 16 + 80],
        "vouch",
    )?;
    // The vouch names the short-term key of this very handshake (no
    // replayed vouch) and the server the client meant to reach.
    if !bool::from(vouch[..KEY].ct_eq(client_short.as_bytes()))
        || !bool::from(vouch[KEY..].ct_eq(keys.public.as_bytes()))
    {
        return Err(invalid("a CURVE vouch for another connection or server"));
    }
    let properties = &inside[KEY + 16 + 80..];
    let Some(admitted) = keys.admit(&client_long) else {
        if refused() {
            let _ = s.write_all(&error_frame("400"));
        }
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "a CURVE client key derived from no token of this server",
        ));
    };
    // The properties (the socket type) before READY: a peer this side
    // does not talk to never sees it.
    if let Err(why) = check_properties(properties) {
        let _ = s.write_all(&error_frame(&why));
        return Err(invalid(why));
    }

    // READY: our properties, boxed from S' to C', with nonce 1.
    let mut sealer = Sealer {
        // The box is not Clone: each half computes its own.
        boxed: SalsaBox::new(&client_short, &our_short),
        next: 1,
        prefix: SERVER_MESSAGES,
    };
    let mut ready = b"\x05READY".to_vec();
    let nonce_bytes = sealer.take_nonce()?;
    ready.extend_from_slice(&nonce_bytes);
    seal_into(
        &sealer.boxed,
        &nonce(b"CurveZMQREADY---", &nonce_bytes),
        our_properties,
        &mut ready,
    );
    let mut framed = Vec::new();
    frame::put_frame(&mut framed, &ready, false, true);
    s.write_all(&framed)?;
    Ok((
        admitted,
        sealer,
        Opener {
            boxed: short,
            last: initiate_nonce,
            prefix: CLIENT_MESSAGES,
        },
    ))
}

/// This side's half of a connection's boxes: what it sends.
pub(crate) struct Sealer {
    boxed: SalsaBox,
    next: u64,
    /// The nonces' first 16 bytes: which side sealed (no reflection).
    prefix: &'static [u8; 16],
}

impl Sealer {
    fn take_nonce(&mut self) -> io::Result<[u8; 8]> {
        let n = self.next;
        // 2^64 frames on one connection never come; should they, the
        // connection ends rather than reuse a nonce.
        self.next = n
            .checked_add(1)
            .ok_or_else(|| invalid("CURVE nonces exhausted on this connection"))?;
        Ok(n.to_be_bytes())
    }

    /// Appends one frame (`body`, with ZMTP's MORE or COMMAND) as a
    /// MESSAGE, itself sent as a frame that is neither.
    pub(crate) fn put_frame(
        &mut self,
        out: &mut Vec<u8>,
        body: &[u8],
        more: bool,
        command: bool,
    ) -> io::Result<()> {
        let nonce_bytes = self.take_nonce()?;
        let mut message = Vec::with_capacity(MESSAGE_OVERHEAD + body.len());
        message.extend_from_slice(MESSAGE);
        message.extend_from_slice(&nonce_bytes);
        let flags = if more { FLAG_MORE } else { 0 } | if command { FLAG_COMMAND } else { 0 };
        let mut plain = Vec::with_capacity(1 + body.len());
        plain.push(flags);
        plain.extend_from_slice(body);
        seal_into(
            &self.boxed,
            &nonce(self.prefix, &nonce_bytes),
            &plain,
            &mut message,
        );
        frame::put_frame(out, &message, false, false);
        Ok(())
    }
}

/// The other half: what it receives.
pub(crate) struct Opener {
    boxed: SalsaBox,
    /// The last nonce the peer used; each must rise (no replay).
    last: u64,
    prefix: &'static [u8; 16],
}

impl Opener {
    /// Reads one frame carrying at most `max_len` bytes and opens it.
    pub(crate) fn read_frame(&mut self, r: &mut impl Read, max_len: usize) -> io::Result<Frame> {
        let mut body = match frame::read_frame(r, max_len.saturating_add(MESSAGE_OVERHEAD))? {
            Frame::Message { body, .. } | Frame::Command(body) => body,
        };
        if !body.starts_with(MESSAGE) {
            return Err(invalid("a frame that is no CURVE MESSAGE"));
        }
        if body.len() < MESSAGE_OVERHEAD {
            return Err(invalid("a CURVE MESSAGE shorter than its header"));
        }
        let n = u64::from_be_bytes(body[8..16].try_into().expect("8"));
        if n <= self.last {
            return Err(invalid(
                "a CURVE MESSAGE whose nonce does not rise (a replay)",
            ));
        }
        let nonce = nonce(self.prefix, &body[8..16]);
        let plain = open(&self.boxed, &nonce, &mut body[16..], "MESSAGE")?;
        self.last = n;
        let flags = plain[0];
        let frame = plain[1..].to_vec();
        if flags & FLAG_COMMAND != 0 {
            return Ok(Frame::Command(frame));
        }
        Ok(Frame::Message {
            more: flags & FLAG_MORE != 0,
            body: frame,
        })
    }
}

const Z85: &[u8; 85] =
    b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#";

/// Z85 (rfc.zeromq.org/spec/32) of `bytes`, whose length is a multiple
/// of 4: how ZeroMQ prints CURVE keys.
pub fn z85_encode(bytes: &[u8]) -> String {
    assert!(
        bytes.len().is_multiple_of(4),
        "Z85 encodes whole 4-byte groups"
    );
    let mut out = String::with_capacity(bytes.len() / 4 * 5);
    for group in bytes.chunks_exact(4) {
        let mut v = u32::from_be_bytes(group.try_into().expect("4"));
        let mut digits = [0u8; 5];
        for d in digits.iter_mut().rev() {
            *d = Z85[(v % 85) as usize];
            v /= 85;
        }
        out.extend(digits.iter().map(|&d| d as char));
    }
    out
}

/// The bytes of Z85 text; an error for text that is not Z85.
pub fn z85_decode(text: &str) -> Result<Vec<u8>, String> {
    if !text.len().is_multiple_of(5) {
        return Err(format!(
            "{} characters is no Z85 length (a multiple of 5)",
            text.len()
        ));
    }
    let mut out = Vec::with_capacity(text.len() / 5 * 4);
    for group in text.as_bytes().chunks_exact(5) {
        let mut v: u64 = 0;
        for &c in group {
            let d = Z85
                .iter()
                .position(|&z| z == c)
                .ok_or_else(|| format!("{:?} is not a Z85 character", c as char))?;
            v = v * 85 + d as u64;
        }
        let v = u32::try_from(v).map_err(|_| "a Z85 group past 2^32".to_string())?;
        out.extend_from_slice(&v.to_be_bytes());
    }
    Ok(out)
}

/// The client's side, as libzmq speaks it: what a subscriber with
/// `curve_secretkey`, `curve_publickey` and `curve_serverkey` set does
/// (the soak's subscriber), and what an attacker changes in it (the
/// tests').
#[cfg(any(test, feature = "curve-client"))]
pub mod client {
    use super::*;
    use std::net::{SocketAddr, TcpStream};
    use std::time::Duration;

    /// What the client does differently from libzmq.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(crate) enum Tamper {
        None,
        /// HELLO boxed to a server key that is not the server's.
        WrongServerKey,
        /// A vouch naming another server (a relay's).
        VouchForAnotherServer,
        /// INITIATE with the cookie changed.
        ForgedCookie,
        /// An all-zero short-term key (of small order): every box of the
        /// connection under the key of a zero shared secret, which anyone
        /// can compute.
        ZeroShortKey,
    }

    /// The client secret key a holder of `token` derives.
    pub fn client_secret(token: &[u8]) -> [u8; KEY] {
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, token);
        ring::hmac::sign(&key, CLIENT_KEY_LABEL)
            .as_ref()
            .try_into()
            .expect("HMAC-SHA256 is 32 bytes")
    }

    /// A SUB socket of the feed logged in with CURVE.
    pub struct Subscriber {
        stream: TcpStream,
        sealer: Sealer,
        opener: Opener,
    }

    impl std::fmt::Debug for Subscriber {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Subscriber")
                .field("peer", &self.stream.peer_addr().ok())
                .finish_non_exhaustive()
        }
    }

    impl Subscriber {
        /// Connects to the feed at `addr` with the client key `token`
        /// derives, for the server whose key is `server_z85` (the start
        /// line's "CURVE server key"). `PermissionDenied` when the feed
        /// refuses the key.
        pub fn connect(addr: SocketAddr, token: &[u8], server_z85: &str) -> io::Result<Self> {
            let server: [u8; KEY] = z85_decode(server_z85)
                .map_err(invalid)?
                .try_into()
                .map_err(|_| invalid("a CURVE server key is 32 bytes"))?;
            let (stream, sealer, opener) =
                connect(addr, client_secret(token), server, "SUB", Tamper::None)?;
            Ok(Subscriber {
                stream,
                sealer,
                opener,
            })
        }

        /// Subscribes to topics starting with `prefix` (empty: all).
        pub fn subscribe(&mut self, prefix: &[u8]) -> io::Result<()> {
            let mut body = vec![1];
            body.extend_from_slice(prefix);
            let mut out = Vec::new();
            self.sealer.put_frame(&mut out, &body, false, false)?;
            self.stream.write_all(&out)
        }

        /// The next message frame (commands, such as heartbeats, are
        /// skipped), of at most `max_len` bytes; an error when the feed
        /// closed, sent no message within `timeout` (commands do not
        /// extend it, so a peer sending only commands cannot hold the
        /// caller), or sent a frame that does not open.
        pub fn next_message(&mut self, max_len: usize, timeout: Duration) -> io::Result<Vec<u8>> {
            let deadline = std::time::Instant::now() + timeout;
            loop {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                if left.is_zero() {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "no CURVE message within the timeout",
                    ));
                }
                self.stream.set_read_timeout(Some(left))?;
                if let Frame::Message { body, .. } =
                    self.opener.read_frame(&mut self.stream, max_len)?
                {
                    return Ok(body);
                }
            }
        }
    }

    /// Connects and shakes hands as a `socket_type` client holding
    /// `client_secret`, for the server whose public key is `server`.
    /// Returns the stream and its boxes; `PermissionDenied` when the
    /// server answered ERROR.
    pub(crate) fn connect(
        addr: SocketAddr,
        client_secret: [u8; KEY],
        server: [u8; KEY],
        socket_type: &str,
        tamper: Tamper,
    ) -> io::Result<(TcpStream, Sealer, Opener)> {
        let mut s = TcpStream::connect(addr)?;
        s.set_read_timeout(Some(Duration::from_secs(30)))?;
        let mut greeting = [0u8; frame::GREETING_LEN];
        greeting[0] = 0xff;
        greeting[9] = 0x7f;
        greeting[10] = 3;
        greeting[12..17].copy_from_slice(b"CURVE");
        s.write_all(&greeting)?;
        let mut theirs = [0u8; frame::GREETING_LEN];
        s.read_exact(&mut theirs)?;
        if &theirs[12..17] != b"CURVE" || theirs[32] != 1 {
            return Err(invalid("the publisher does not greet as a CURVE server"));
        }
        let server = PublicKey::from(server);
        let long = SecretKey::from(client_secret);
        let short = SecretKey::from(random::<KEY>()?);
        let zero_short = tamper == Tamper::ZeroShortKey;
        // The box between our short-term key and `peer`'s.
        let short_box = |peer: &PublicKey| {
            if zero_short {
                SalsaBox::new(&PublicKey::from([0u8; KEY]), &short)
            } else {
                SalsaBox::new(peer, &short)
            }
        };
        let short_public = if zero_short {
            [0u8; KEY]
        } else {
            *short.public_key().as_bytes()
        };
        let mut frame = Vec::new();

        let mut hello = b"\x05HELLO\x01\x00".to_vec();
        hello.resize(80, 0);
        hello.extend_from_slice(&short_public);
        hello.extend_from_slice(&1u64.to_be_bytes());
        let hello_to = if tamper == Tamper::WrongServerKey {
            SecretKey::from(random::<KEY>()?).public_key()
        } else {
            server.clone()
        };
        seal_into(
            &short_box(&hello_to),
            &nonce(b"CurveZMQHELLO---", &1u64.to_be_bytes()),
            &[0u8; 64],
            &mut hello,
        );
        frame::put_frame(&mut frame, &hello, false, true);
        s.write_all(&frame)?;

        let mut welcome = read_command(&mut s, 4096, "WELCOME")?;
        if !(welcome.starts_with(b"\x07WELCOME") && welcome.len() == 168) {
            return Err(invalid("no WELCOME of 168 bytes"));
        }
        let n = nonce(b"WELCOME-", &welcome[8..24]);
        let inside = open(&short_box(&server), &n, &mut welcome[24..], "WELCOME")?;
        let server_short = PublicKey::from(
            <[u8; KEY]>::try_from(&inside[..KEY]).map_err(|_| invalid("a short WELCOME box"))?,
        );
        let mut cookie = inside[KEY..].to_vec();
        if tamper == Tamper::ForgedCookie {
            cookie[40] ^= 1;
        }

        let vouch_nonce = random::<16>()?;
        let mut vouch_plain = short_public.to_vec();
        let vouched = if tamper == Tamper::VouchForAnotherServer {
            SecretKey::from(random::<KEY>()?).public_key()
        } else {
            server.clone()
        };
        vouch_plain.extend_from_slice(vouched.as_bytes());
        let mut inner = long.public_key().as_bytes().to_vec();
        inner.extend_from_slice(&vouch_nonce);
        seal_into(
            &SalsaBox::new(&server_short, &long),
            &nonce(b"VOUCH---", &vouch_nonce),
            &vouch_plain,
            &mut inner,
        );
        inner.extend_from_slice(&frame::properties(socket_type));
        let mut initiate = b"\x08INITIATE".to_vec();
        initiate.extend_from_slice(&cookie);
        initiate.extend_from_slice(&2u64.to_be_bytes());
        let shared = short_box(&server_short);
        seal_into(
            &shared,
            &nonce(b"CurveZMQINITIATE", &2u64.to_be_bytes()),
            &inner,
            &mut initiate,
        );
        frame.clear();
        frame::put_frame(&mut frame, &initiate, false, true);
        s.write_all(&frame)?;

        let mut ready = read_command(&mut s, 4096, "READY")?;
        if ready.starts_with(b"\x05ERROR") {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                String::from_utf8_lossy(&ready[7..]).into_owned(),
            ));
        }
        if !ready.starts_with(b"\x05READY") || ready.len() < 14 {
            return Err(invalid("no READY"));
        }
        let ready_nonce = u64::from_be_bytes(ready[6..14].try_into().expect("8 bytes"));
        let n = nonce(b"CurveZMQREADY---", &ready[6..14]);
        open(&shared, &n, &mut ready[14..], "READY")?;
        Ok((
            s,
            Sealer {
                boxed: short_box(&server_short),
                next: 3,
                prefix: CLIENT_MESSAGES,
            },
            Opener {
                boxed: shared,
                last: ready_nonce,
                prefix: SERVER_MESSAGES,
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn z85_matches_the_specs_example_and_round_trips() {
        // rfc.zeromq.org/spec/32's test vector.
        let bytes = [0x86, 0x4F, 0xD2, 0x6F, 0xB5, 0x59, 0xF7, 0x5B];
        assert_eq!(z85_encode(&bytes), "HelloWorld");
        assert_eq!(z85_decode("HelloWorld").unwrap(), bytes);
        assert!(z85_decode("Hello").is_ok());
        assert!(z85_decode("Hell").is_err());
        assert!(z85_decode("Hell~").is_err());
        assert!(z85_decode("%%%%%").is_err());
        let key: Vec<u8> = (0..32).collect();
        assert_eq!(z85_decode(&z85_encode(&key)).unwrap(), key);
    }
}
