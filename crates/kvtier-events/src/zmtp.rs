//! The part of ZMTP 3 (ZeroMQ's wire protocol, rfc.zeromq.org/spec/23 and
//! /37) a PUB socket and a ROUTER socket need, with the NULL mechanism or
//! PLAIN's server side (/24: HELLO with a user name and password,
//! WELCOME, INITIATE, READY): the 64-byte greeting, READY with the socket
//! type, frames, SUB's subscriptions, PING/PONG. Written here rather than linking libzmq: the
//! two sockets are small, and every length a peer sends is checked
//! against a limit before anything is allocated for it.

use crate::curve;
pub(crate) use crate::frame::properties;
pub use crate::frame::{put_frame, read_frame, Frame, GREETING_LEN};
use std::io::{self, Read, Write};

/// The security mechanism a socket speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mechanism {
    Null,
    /// PLAIN, this side the server (it checks the credentials).
    PlainServer,
    /// CURVE, this side the server (`curve`).
    CurveServer,
}

impl Mechanism {
    fn name(self) -> &'static [u8] {
        match self {
            Mechanism::Null => b"NULL",
            Mechanism::PlainServer => b"PLAIN",
            Mechanism::CurveServer => b"CURVE",
        }
    }
}

/// Our greeting: version 3.0 (so peers subscribe with messages, the form
/// every ZMTP 3 peer accepts), NULL mechanism, not as-server.
#[cfg(test)]
pub fn greeting() -> [u8; GREETING_LEN] {
    greeting_for(Mechanism::Null)
}

/// Our greeting for `mechanism` (as-server for PLAIN's and CURVE's
/// server sides).
pub fn greeting_for(mechanism: Mechanism) -> [u8; GREETING_LEN] {
    let mut g = [0u8; GREETING_LEN];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[11] = 0;
    let name = mechanism.name();
    g[12..12 + name.len()].copy_from_slice(name);
    g[32] = u8::from(mechanism != Mechanism::Null);
    g
}

fn invalid(why: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why.into())
}

/// Checks a peer's greeting: ZMTP 3.x with the NULL mechanism.
#[cfg(test)]
pub fn check_greeting(g: &[u8; GREETING_LEN]) -> io::Result<()> {
    check_greeting_for(g, Mechanism::Null)
}

/// Checks a peer's greeting: ZMTP 3.x with `ours`' mechanism (a PLAIN or
/// CURVE peer must not claim to be the server too).
pub fn check_greeting_for(g: &[u8; GREETING_LEN], ours: Mechanism) -> io::Result<()> {
    if g[0] != 0xff || g[9] & 1 != 1 {
        return Err(invalid("not a ZMTP 3 greeting"));
    }
    if g[10] < 3 {
        return Err(invalid(format!(
            "ZMTP {}.{} is too old (3 needed)",
            g[10], g[11]
        )));
    }
    let mechanism = &g[12..32];
    let name = ours.name();
    if &mechanism[..name.len()] != name || mechanism[name.len()..].iter().any(|&b| b != 0) {
        return Err(invalid(match ours {
            Mechanism::Null => "only the NULL security mechanism is offered",
            Mechanism::PlainServer => {
                "only the PLAIN security mechanism is offered (user name any, password a \
                 kvtier token)"
            }
            Mechanism::CurveServer => {
                "only the CURVE security mechanism is offered (keys derived from a kvtier \
                 token, docs/integrations.md)"
            }
        }));
    }
    if ours != Mechanism::Null && g[32] != 0 {
        return Err(invalid("the peer greeted as a server too"));
    }
    Ok(())
}

/// Appends a multipart message in the clear (what tests send as a peer).
#[cfg(test)]
pub fn put_message(out: &mut Vec<u8>, parts: &[&[u8]]) {
    for (i, part) in parts.iter().enumerate() {
        put_frame(out, part, i + 1 < parts.len(), false);
    }
}

/// A command's name and data, checked.
pub fn split_command(body: &[u8]) -> io::Result<(&[u8], &[u8])> {
    let (&n, rest) = body
        .split_first()
        .ok_or_else(|| invalid("an empty command"))?;
    if rest.len() < usize::from(n) {
        return Err(invalid("a command name longer than its frame"));
    }
    Ok(rest.split_at(usize::from(n)))
}

fn ready(socket_type: &str) -> Vec<u8> {
    let mut body = Vec::new();
    body.push(5);
    body.extend_from_slice(b"READY");
    body.extend_from_slice(&properties(socket_type));
    let mut out = Vec::new();
    put_frame(&mut out, &body, false, true);
    out
}

/// The socket type a READY command's properties name.
pub fn ready_socket_type(body: &[u8]) -> io::Result<String> {
    command_socket_type(body, b"READY")
}

/// The socket type the properties of command `expected` (READY, or
/// PLAIN's INITIATE) name.
fn command_socket_type(body: &[u8], expected: &[u8]) -> io::Result<String> {
    let (name, props) = split_command(body)?;
    if name != expected {
        return Err(invalid(format!(
            "expected {}, got {}",
            String::from_utf8_lossy(expected),
            String::from_utf8_lossy(name)
        )));
    }
    properties_socket_type(props)
}

/// The socket type named in a property list (READY's, INITIATE's).
fn properties_socket_type(mut props: &[u8]) -> io::Result<String> {
    let mut socket_type = None;
    while !props.is_empty() {
        let (&n, rest) = props.split_first().expect("not empty");
        let n = usize::from(n);
        if rest.len() < n + 4 {
            return Err(invalid("a READY property runs past its frame"));
        }
        let (prop, rest) = rest.split_at(n);
        let (len, rest) = rest.split_at(4);
        let len = u32::from_be_bytes(len.try_into().expect("4 bytes")) as usize;
        if rest.len() < len {
            return Err(invalid("a READY property value runs past its frame"));
        }
        let (value, rest) = rest.split_at(len);
        if prop.eq_ignore_ascii_case(b"Socket-Type") {
            socket_type = Some(String::from_utf8_lossy(value).into_owned());
        }
        props = rest;
    }
    socket_type.ok_or_else(|| invalid("READY without a Socket-Type"))
}

/// Most bytes of a handshake command (READY with a few properties).
const MAX_COMMAND: usize = 4096;

/// Greets a peer and exchanges READY as `ours`; the peer must be one of
/// `accepted` (ZMTP's socket-type compatibility). Returns its type.
pub fn handshake<S: Read + Write>(s: &mut S, ours: &str, accepted: &[&str]) -> io::Result<String> {
    let (peer, ()) = handshake_with(s, ours, accepted, Mechanism::Null, |_| Ok(()))?;
    Ok(peer)
}

/// `handshake` with `mechanism`. Under PLAIN, `admit` is given the
/// password of the peer's HELLO and says what it opens, or refuses it:
/// `Err(true)` is answered ERROR, `Err(false)` closed without an answer
/// (the caller had no turn to answer in), before anything else is read.
/// `admit` returns only once the refusal may be answered (the guess
/// budget's turn and pause are its to wait). Returns the peer's socket
/// type and what `admit` gave (NULL: `admit(b"")`'s).
pub fn handshake_with<S: Read + Write, T>(
    s: &mut S,
    ours: &str,
    accepted: &[&str],
    mechanism: Mechanism,
    admit: impl FnOnce(&[u8]) -> Result<T, bool>,
) -> io::Result<(String, T)> {
    s.write_all(&greeting_for(mechanism))?;
    let mut theirs = [0u8; GREETING_LEN];
    s.read_exact(&mut theirs)?;
    check_greeting_for(&theirs, mechanism)?;
    let admitted = match mechanism {
        Mechanism::Null => {
            s.write_all(&ready(ours))?;
            admit(b"").ok()
        }
        Mechanism::CurveServer => {
            return Err(invalid("CURVE handshakes go through handshake_curve"));
        }
        Mechanism::PlainServer => {
            let Frame::Command(hello) = read_frame(s, MAX_COMMAND)? else {
                return Err(invalid("the peer sent a message before HELLO"));
            };
            let password = plain_hello_password(&hello)?;
            let admitted = match admit(password) {
                Ok(admitted) => admitted,
                Err(answer) => {
                    if answer {
                        let _ = s.write_all(&error_command("invalid credentials"));
                    }
                    return Err(io::Error::new(
                        io::ErrorKind::PermissionDenied,
                        "a PLAIN HELLO with a password that is no token of this server",
                    ));
                }
            };
            let mut welcome = Vec::new();
            put_frame(&mut welcome, b"\x07WELCOME", false, true);
            s.write_all(&welcome)?;
            let Frame::Command(initiate) = read_frame(s, MAX_COMMAND)? else {
                return Err(invalid("the peer sent a message before INITIATE"));
            };
            let peer = command_socket_type(&initiate, b"INITIATE")?;
            check_peer_type(s, ours, accepted, &peer)?;
            s.write_all(&ready(ours))?;
            return Ok((peer, admitted));
        }
    };
    let Some(admitted) = admitted else {
        return Err(io::Error::new(io::ErrorKind::PermissionDenied, "refused"));
    };
    let Frame::Command(body) = read_frame(s, MAX_COMMAND)? else {
        return Err(invalid("the peer sent a message before READY"));
    };
    let peer = ready_socket_type(&body)?;
    check_peer_type(s, ours, accepted, &peer)?;
    Ok((peer, admitted))
}

/// `handshake` with CURVE, this side the server holding `keys`: returns
/// the peer's socket type, what its key opens, and the channel every
/// later frame goes through (boxed both ways). A client key that is none
/// of `keys`' is refused after `refused` (see `curve::server_handshake`);
/// INITIATE's properties are checked (a socket type `ours` talks to)
/// before READY is sent.
pub fn handshake_curve<S: Read + Write, T: Clone>(
    s: &mut S,
    ours: &str,
    accepted: &[&str],
    keys: &curve::ServerKeys<T>,
    refused: &mut dyn FnMut() -> bool,
) -> io::Result<(String, T, FrameWriter, FrameReader)> {
    s.write_all(&greeting_for(Mechanism::CurveServer))?;
    let mut theirs = [0u8; GREETING_LEN];
    s.read_exact(&mut theirs)?;
    check_greeting_for(&theirs, Mechanism::CurveServer)?;
    let mut peer = String::new();
    let (admitted, sealer, opener) =
        curve::server_handshake(s, keys, &properties(ours), refused, &mut |props| {
            let kind = properties_socket_type(props).map_err(|e| e.to_string())?;
            if !accepted.iter().any(|a| a.eq_ignore_ascii_case(&kind)) {
                return Err(format!("a {ours} socket does not talk to {kind}"));
            }
            peer = kind;
            Ok(())
        })?;
    Ok((
        peer,
        admitted,
        FrameWriter::Curve(sealer),
        FrameReader::Curve(opener),
    ))
}

/// How frames go out after the handshake: as they are (NULL, PLAIN), or
/// each boxed in a CURVE MESSAGE.
pub enum FrameWriter {
    Clear,
    Curve(curve::Sealer),
}

impl FrameWriter {
    /// Appends one frame.
    pub fn put_frame(
        &mut self,
        out: &mut Vec<u8>,
        body: &[u8],
        more: bool,
        command: bool,
    ) -> io::Result<()> {
        match self {
            FrameWriter::Clear => {
                put_frame(out, body, more, command);
                Ok(())
            }
            FrameWriter::Curve(sealer) => sealer.put_frame(out, body, more, command),
        }
    }

    /// Appends a multipart message.
    pub fn put_message(&mut self, out: &mut Vec<u8>, parts: &[&[u8]]) -> io::Result<()> {
        for (i, part) in parts.iter().enumerate() {
            self.put_frame(out, part, i + 1 < parts.len(), false)?;
        }
        Ok(())
    }
}

/// How frames come in after the handshake (see `FrameWriter`).
pub enum FrameReader {
    Clear,
    Curve(curve::Opener),
}

impl FrameReader {
    /// Reads one frame whose body is at most `max_len` bytes.
    pub fn read_frame(&mut self, r: &mut impl Read, max_len: usize) -> io::Result<Frame> {
        match self {
            FrameReader::Clear => read_frame(r, max_len),
            FrameReader::Curve(opener) => opener.read_frame(r, max_len),
        }
    }
}

fn error_command(reason: &str) -> Vec<u8> {
    let mut out = Vec::new();
    let mut body = vec![5];
    body.extend_from_slice(b"ERROR");
    body.push(reason.len().min(255) as u8);
    body.extend_from_slice(&reason.as_bytes()[..reason.len().min(255)]);
    put_frame(&mut out, &body, false, true);
    out
}

/// Refuses (with an ERROR command) a peer whose type `ours` does not talk to.
fn check_peer_type(
    s: &mut impl Write,
    ours: &str,
    accepted: &[&str],
    peer: &str,
) -> io::Result<()> {
    if accepted.iter().any(|a| a.eq_ignore_ascii_case(peer)) {
        return Ok(());
    }
    let reason = format!("a {ours} socket does not talk to {peer}");
    let _ = s.write_all(&error_command(&reason));
    Err(invalid(reason))
}

/// The password of a PLAIN HELLO command: `HELLO`, then the user name and
/// the password, each a length byte and its bytes.
pub fn plain_hello_password(body: &[u8]) -> io::Result<&[u8]> {
    let (name, data) = split_command(body)?;
    if name != b"HELLO" {
        return Err(invalid(format!(
            "expected HELLO, got {}",
            String::from_utf8_lossy(name)
        )));
    }
    let (&user_len, rest) = data
        .split_first()
        .ok_or_else(|| invalid("a HELLO without a user name"))?;
    let rest = rest
        .get(usize::from(user_len)..)
        .ok_or_else(|| invalid("a HELLO user name past its frame"))?;
    let (&pass_len, rest) = rest
        .split_first()
        .ok_or_else(|| invalid("a HELLO without a password"))?;
    if rest.len() != usize::from(pass_len) {
        return Err(invalid("a HELLO password that is not its frame's rest"));
    }
    Ok(rest)
}

/// The reply to a PING command, if `body` is one (ZMTP 3.1 heartbeats):
/// the PONG command's body, for the connection's `FrameWriter` to frame.
pub fn pong_for(body: &[u8]) -> io::Result<Option<Vec<u8>>> {
    let (name, data) = split_command(body)?;
    if name != b"PING" {
        return Ok(None);
    }
    // TTL (2 bytes), then up to 16 bytes of context the PONG echoes.
    let context = data.get(2..).unwrap_or(&[]);
    let context = &context[..context.len().min(16)];
    let mut pong = vec![4];
    pong.extend_from_slice(b"PONG");
    pong.extend_from_slice(context);
    Ok(Some(pong))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_short_and_long() {
        let mut out = Vec::new();
        put_message(&mut out, &[b"topic", &[9u8; 300], b""]);
        let mut r = &out[..];
        assert_eq!(
            read_frame(&mut r, 1024).unwrap(),
            Frame::Message {
                more: true,
                body: b"topic".to_vec()
            }
        );
        assert_eq!(
            read_frame(&mut r, 1024).unwrap(),
            Frame::Message {
                more: true,
                body: vec![9u8; 300]
            }
        );
        assert_eq!(
            read_frame(&mut r, 1024).unwrap(),
            Frame::Message {
                more: false,
                body: vec![]
            }
        );
        assert!(r.is_empty());
    }

    #[test]
    fn a_frame_over_the_limit_is_refused_before_allocating() {
        let mut bytes = vec![crate::frame::FLAG_LONG];
        bytes.extend_from_slice(&u64::MAX.to_be_bytes());
        let err = read_frame(&mut &bytes[..], 1 << 20).unwrap_err();
        assert!(err.to_string().contains("at most"), "{err}");
        let err = read_frame(&mut &[0x40u8, 0][..], 16).unwrap_err();
        assert!(err.to_string().contains("reserved"), "{err}");
    }

    #[test]
    fn ready_properties_are_bounds_checked() {
        let frame = ready("SUB");
        let mut r = &frame[..];
        let Frame::Command(body) = read_frame(&mut r, 4096).unwrap() else {
            panic!("not a command")
        };
        assert_eq!(ready_socket_type(&body).unwrap(), "SUB");
        for cut in 0..body.len() {
            // Every truncation is an error, never a panic.
            assert!(ready_socket_type(&body[..cut]).is_err());
        }
        let mut lying = body.clone();
        let at = 1 + 5 + 1 + 11;
        lying[at..at + 4].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(ready_socket_type(&lying).is_err());
    }

    #[test]
    fn greetings_other_than_zmtp3_null_are_refused() {
        assert!(check_greeting(&greeting()).is_ok());
        let mut old = greeting();
        old[10] = 2;
        assert!(check_greeting(&old).is_err());
        let mut plain = greeting();
        plain[12..17].copy_from_slice(b"PLAIN");
        assert!(check_greeting(&plain).is_err());
    }

    #[test]
    fn a_ping_gets_a_pong_with_its_context() {
        let mut ping = vec![4];
        ping.extend_from_slice(b"PING");
        ping.extend_from_slice(&[0, 10]);
        ping.extend_from_slice(b"ctx");
        let pong = pong_for(&ping).unwrap().unwrap();
        assert_eq!(pong, b"\x04PONGctx");
        assert!(pong_for(b"\x05READY").unwrap().is_none());
    }

    /// A peer that sends fixed bytes and swallows what it is sent.
    struct Peer {
        sends: io::Cursor<Vec<u8>>,
        received: Vec<u8>,
    }

    impl Read for Peer {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.sends.read(buf)
        }
    }

    impl Write for Peer {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.received.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// What a peer may send: anything, or a good greeting then anything,
    /// or a good greeting and a READY naming any socket type, then
    /// anything (the parser sees every layer's bytes mutated).
    fn peer_bytes() -> impl proptest::strategy::Strategy<Value = Vec<u8>> {
        use proptest::prelude::*;
        let tail = proptest::collection::vec(any::<u8>(), 0..300);
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..400),
            tail.clone().prop_map(|t| [&greeting()[..], &t].concat()),
            (
                prop_oneof![
                    Just("DEALER".to_string()),
                    Just("SUB".to_string()),
                    "[A-Za-z]{0,12}"
                ],
                tail,
                any::<usize>(),
                any::<u8>()
            )
                .prop_map(|(kind, t, at, flip)| {
                    let mut b = [&greeting()[..], &ready(&kind), &t].concat();
                    // One byte somewhere changed (often to itself).
                    let at = at % b.len();
                    b[at] ^= flip & 1;
                    b
                }),
        ]
    }

    proptest::proptest! {
        /// Any bytes read as frames: never a panic, never a body past the
        /// limit, and every frame read encodes back to one that reads the
        /// same.
        #[test]
        fn any_bytes_read_as_frames_stay_in_their_limits(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..700),
            max_len in 0usize..300,
        ) {
            let mut r = &bytes[..];
            while let Ok(frame) = read_frame(&mut r, max_len) {
                let mut again = Vec::new();
                match &frame {
                    Frame::Command(body) => {
                        proptest::prop_assert!(body.len() <= max_len);
                        put_frame(&mut again, body, false, true);
                    }
                    Frame::Message { more, body } => {
                        proptest::prop_assert!(body.len() <= max_len);
                        put_frame(&mut again, body, *more, false);
                    }
                }
                proptest::prop_assert_eq!(read_frame(&mut &again[..], max_len).unwrap(), frame);
            }
        }

        /// CURVE: no bytes made without the keys get through, whatever
        /// their shape (a HELLO of the right size included), and nothing
        /// panics or answers more than a WELCOME.
        #[test]
        fn a_curve_handshake_with_bytes_made_without_keys_never_succeeds(
            hello_body in proptest::collection::vec(proptest::prelude::any::<u8>(), 194),
            tail in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400),
            shaped in proptest::prelude::any::<bool>(),
        ) {
            let mut client_greeting = greeting_for(Mechanism::CurveServer);
            client_greeting[32] = 0;
            let mut bytes = client_greeting.to_vec();
            if shaped {
                let mut hello = b"\x05HELLO".to_vec();
                hello.extend_from_slice(&hello_body);
                put_frame(&mut bytes, &hello, false, true);
            }
            bytes.extend_from_slice(&tail);
            let keys = curve::ServerKeys::new([7; 32], vec![([9; 32], ())]);
            let mut peer = Peer { sends: io::Cursor::new(bytes), received: Vec::new() };
            let result = handshake_curve(&mut peer, "PUB", &["SUB"], &keys, &mut || true);
            proptest::prop_assert!(result.is_err());
            proptest::prop_assert!(peer.received.len() <= GREETING_LEN + 2 + 168);
        }

        /// A handshake with any peer: never a panic; it succeeds exactly
        /// when the peer greeted as ZMTP 3 NULL and said READY as an
        /// accepted type, and we never send more than greeting, READY and
        /// one ERROR.
        #[test]
        fn a_handshake_with_any_peer_succeeds_only_with_an_accepted_one(bytes in peer_bytes()) {
            let mut peer = Peer { sends: io::Cursor::new(bytes.clone()), received: Vec::new() };
            let result = handshake(&mut peer, "PUB", &["SUB", "XSUB"]);
            proptest::prop_assert!(peer.received.len() <= GREETING_LEN + ready("PUB").len() + 2 + 1 + 5 + 1 + 255);
            if let Ok(kind) = result {
                proptest::prop_assert!(kind.eq_ignore_ascii_case("SUB") || kind.eq_ignore_ascii_case("XSUB"));
                let greeting: [u8; GREETING_LEN] = bytes[..GREETING_LEN].try_into().unwrap();
                proptest::prop_assert!(check_greeting(&greeting).is_ok());
            }
        }

        /// Commands of any bytes: names and properties are bounds-checked,
        /// and a PONG echoes at most 16 bytes of context.
        #[test]
        fn commands_of_any_bytes_are_bounds_checked(
            body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
        ) {
            if let Ok((name, data)) = split_command(&body) {
                proptest::prop_assert_eq!(1 + name.len() + data.len(), body.len());
                proptest::prop_assert_eq!(usize::from(body[0]), name.len());
            }
            if let Ok(kind) = ready_socket_type(&body) {
                proptest::prop_assert!(kind.len() <= body.len());
            }
            if let Ok(Some(pong)) = pong_for(&body) {
                proptest::prop_assert!(pong.len() <= 2 + 5 + 16);
            }
        }
    }
}
