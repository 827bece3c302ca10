//! The remote memory cases' baseline over TCP.

use crate::measure::Measurement;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

/// TCP loopback streams in this process, in either direction: a get's
/// (the receiver asks for its share of `n` bytes and the sender writes
/// them, as a batch get reply comes) and a put's (the sender writes its
/// share and the receiver, reading it in 64 KiB pieces as the server reads
/// put values into the pool, answers with one byte). One stream for a
/// client that talks to one server; with `--route` one per cluster member,
/// all at once, as the routing client's calls go (a single stream would be
/// a baseline shaped to lose).
pub struct TcpStreamBaseline {
    streams: Vec<(TcpStream, Vec<u8>)>,
}

/// The top bit of a request's length: the put direction.
const PUT_DIRECTION: u64 = 1 << 63;
/// The piece a put's receiver reads at a time.
const PUT_PIECE: usize = 64 << 10;

impl TcpStreamBaseline {
    pub fn start(max_bytes: usize, streams: usize) -> std::io::Result<TcpStreamBaseline> {
        let share = max_bytes.div_ceil(streams);
        let streams = (0..streams)
            .map(|_| -> std::io::Result<(TcpStream, Vec<u8>)> {
                let listener = TcpListener::bind("127.0.0.1:0")?;
                let addr = listener.local_addr()?;
                std::thread::spawn(move || {
                    let Ok((mut peer, _)) = listener.accept() else {
                        return;
                    };
                    let _ = peer.set_nodelay(true);
                    let mut buffer = vec![0x5Au8; share];
                    let mut ask = [0u8; 8];
                    while peer.read_exact(&mut ask).is_ok() {
                        let ask = u64::from_le_bytes(ask);
                        let n = ((ask & !PUT_DIRECTION) as usize).min(buffer.len());
                        let done = if ask & PUT_DIRECTION != 0 {
                            buffer[..n]
                                .chunks_mut(PUT_PIECE)
                                .try_for_each(|piece| peer.read_exact(piece))
                                .and_then(|()| peer.write_all(&[1]))
                        } else {
                            peer.write_all(&buffer[..n])
                        };
                        if done.is_err() {
                            return;
                        }
                    }
                });
                let stream = TcpStream::connect(addr)?;
                stream.set_nodelay(true)?;
                Ok((stream, vec![0u8; share]))
            })
            .collect::<std::io::Result<_>>()?;
        Ok(TcpStreamBaseline { streams })
    }

    pub fn describe(&self) -> String {
        match self.streams.len() {
            1 => "raw TCP loopback stream".to_string(),
            n => format!("{n} raw TCP loopback streams at once"),
        }
    }

    /// `calls` calls moving `bytes` each, in the put direction or the get's.
    pub fn run(
        &mut self,
        bytes: usize,
        put: bool,
        calls: std::ops::Range<u64>,
        m: &mut Measurement,
    ) -> std::io::Result<()> {
        let share = bytes.div_ceil(self.streams.len());
        let exchange = |(stream, buffer): &mut (TcpStream, Vec<u8>)| -> std::io::Result<()> {
            if put {
                stream.write_all(&(share as u64 | PUT_DIRECTION).to_le_bytes())?;
                stream.write_all(&buffer[..share])?;
                stream.read_exact(&mut [0u8; 1])
            } else {
                stream.write_all(&(share as u64).to_le_bytes())?;
                stream.read_exact(&mut buffer[..share])
            }
        };
        for _ in calls {
            let call = Instant::now();
            if let [one] = &mut self.streams[..] {
                exchange(one)?;
            } else {
                std::thread::scope(|scope| {
                    let handles: Vec<_> = self
                        .streams
                        .iter_mut()
                        .map(|s| scope.spawn(|| exchange(s)))
                        .collect();
                    handles
                        .into_iter()
                        .try_for_each(|h| h.join().expect("a baseline stream panicked"))
                })?;
            }
            let elapsed = call.elapsed();
            m.record_call(elapsed);
            m.add_span(elapsed, (share * self.streams.len()) as u64);
        }
        Ok(())
    }
}
