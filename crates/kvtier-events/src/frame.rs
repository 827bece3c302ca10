//! ZMTP 3's wire primitives (rfc.zeromq.org/spec/23): the greeting's
//! length, frames (the flags byte, the short or long length and the body,
//! read with the length checked against a limit before anything is
//! allocated for it) and the metadata property list. Below both the
//! mechanisms (`zmtp`) and CURVE's boxes (`curve`), which frame through it.

use std::io::{self, Read};

pub const GREETING_LEN: usize = 64;
const FLAG_MORE: u8 = 0x01;
pub(crate) const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;

fn invalid(why: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why.into())
}

/// One frame as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    Command(Vec<u8>),
    Message { more: bool, body: Vec<u8> },
}

/// Reads one frame whose body is at most `max_len` bytes.
pub fn read_frame(r: &mut impl Read, max_len: usize) -> io::Result<Frame> {
    let mut flags = [0u8; 1];
    r.read_exact(&mut flags)?;
    let flags = flags[0];
    if flags & !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND) != 0 {
        return Err(invalid(format!(
            "reserved frame flag bits set: {flags:#04x}"
        )));
    }
    let len = if flags & FLAG_LONG != 0 {
        let mut n = [0u8; 8];
        r.read_exact(&mut n)?;
        u64::from_be_bytes(n)
    } else {
        let mut n = [0u8; 1];
        r.read_exact(&mut n)?;
        u64::from(n[0])
    };
    if len > max_len as u64 {
        return Err(invalid(format!(
            "a {len}-byte frame (at most {max_len} accepted)"
        )));
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body)?;
    if flags & FLAG_COMMAND != 0 {
        if flags & FLAG_MORE != 0 {
            return Err(invalid("a command frame with MORE set"));
        }
        return Ok(Frame::Command(body));
    }
    Ok(Frame::Message {
        more: flags & FLAG_MORE != 0,
        body,
    })
}

/// Appends one frame to `out`.
pub fn put_frame(out: &mut Vec<u8>, body: &[u8], more: bool, command: bool) {
    let mut flags = 0;
    if more {
        flags |= FLAG_MORE;
    }
    if command {
        flags |= FLAG_COMMAND;
    }
    if body.len() > 255 {
        out.push(flags | FLAG_LONG);
        out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    } else {
        out.push(flags);
        out.push(body.len() as u8);
    }
    out.extend_from_slice(body);
}

/// The properties this side announces: its socket type.
pub(crate) fn properties(socket_type: &str) -> Vec<u8> {
    let mut props = Vec::new();
    props.push(11);
    props.extend_from_slice(b"Socket-Type");
    props.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    props.extend_from_slice(socket_type.as_bytes());
    props
}
