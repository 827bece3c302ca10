//! A connection's start on either socket: the ZMTP handshake with the
//! feed's mechanism (NULL, PLAIN or CURVE), within one deadline for all of
//! it (`Deadlined`, which also bounds a subscriber's frames).

use crate::config::KvEventsConfig;
use crate::zmtp;
use std::io;
use std::net::TcpStream;
use std::time::Duration;

/// The ZMTP handshake of either socket, with the feed's mechanism;
/// returns what the peer's credential opens (`None`: everything, no
/// credentials asked) and how frames go out and come in from then on.
///
/// One deadline (`peer_timeout`) bounds the whole handshake, greeting and
/// commands, however the peer spreads its bytes. A refused credential
/// (PLAIN's password, CURVE's client key) is a guess: it is counted on
/// the server's guess budget (`auth_failures`) and answered only once it
/// had a turn of that budget and the pause after it, as a refused hello of
/// the data port is; without a turn before the deadline it is closed
/// unanswered after the pause, and once `cancelled` says the connection
/// was closed for a newcomer, at once.
pub(crate) fn greet(
    stream: &TcpStream,
    config: &KvEventsConfig,
    ours: &str,
    accepted: &[&str],
    cancelled: &dyn Fn() -> bool,
) -> io::Result<(
    Option<kvtier_server::Scope>,
    zmtp::FrameWriter,
    zmtp::FrameReader,
)> {
    let deadline = std::time::Instant::now() + config.peer_timeout;
    let mut within = Deadlined { stream, deadline };
    let guesses = config.governor.guesses();
    let mut refused = || {
        guesses.count_refusal();
        let turn = guesses.take_turn(deadline, cancelled);
        // Without a turn too: no refusal shows sooner than the pause.
        guesses.refusal_pause(cancelled) && turn
    };
    if let Some(keys) = &config.curve {
        zmtp::handshake_curve(&mut within, ours, accepted, &**keys, &mut refused)
            .map(|(_, scope, w, r)| (Some(scope), w, r))
    } else if let Some(auth) = &config.credentials {
        zmtp::handshake_with(
            &mut within,
            ours,
            accepted,
            zmtp::Mechanism::PlainServer,
            |password| auth.scope_of_token(password).ok_or_else(&mut refused),
        )
        .map(|(_, scope)| {
            (
                Some(scope),
                zmtp::FrameWriter::Clear,
                zmtp::FrameReader::Clear,
            )
        })
    } else {
        zmtp::handshake(&mut within, ours, accepted)
            .map(|_| (None, zmtp::FrameWriter::Clear, zmtp::FrameReader::Clear))
    }
}

/// Reads and writes of `stream` bounded by one `deadline` for all of
/// them together (a peer trickling a byte at a time gets no more).
pub(crate) struct Deadlined<'a> {
    pub(crate) stream: &'a TcpStream,
    pub(crate) deadline: std::time::Instant,
}

impl Deadlined<'_> {
    fn left(&self) -> io::Result<Duration> {
        let left = self
            .deadline
            .saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "past the handshake deadline",
            ));
        }
        Ok(left)
    }
}

impl io::Read for Deadlined<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.stream.set_read_timeout(Some(self.left()?))?;
        self.stream.read(buf)
    }
}

impl io::Write for Deadlined<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.stream.set_write_timeout(Some(self.left()?))?;
        self.stream.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.stream.flush()
    }
}
