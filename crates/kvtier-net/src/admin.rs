//! Admin HTTP: `GET /metrics` (Prometheus text), `/health`, `/stats`
//! (JSON). Each connection is answered on its own thread, under a cap
//! (`Limits::max_admin_connections`) and one deadline for the whole
//! exchange (`Limits::admin_timeout`), so a slow or silent client cannot
//! keep `/health` from answering others. Off loopback, requests need the
//! token as `Authorization: Bearer <token>`.

use crate::server::Shared;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Longest request head read; the rest is ignored.
const MAX_REQUEST_HEAD: usize = 8192;

pub(crate) fn serve(listener: TcpListener, shared: &Arc<Shared>) {
    let needs_token = listener
        .local_addr()
        .map(|a| !a.ip().is_loopback())
        .unwrap_or(true);
    let mut workers = Vec::new();
    while !shared.stopping.load(Ordering::Acquire) {
        match listener.accept() {
            Ok((stream, _)) => {
                let cap = shared.config.limits.max_admin_connections;
                if !shared.admin_threads.try_enter(cap) {
                    // Over the cap: answer at once without reading.
                    let _ = stream.set_write_timeout(Some(Duration::from_millis(10)));
                    let _ = respond(stream, "503 Service Unavailable", "text/plain", "busy\n");
                    continue;
                }
                let worker = Arc::clone(shared);
                let spawned = std::thread::Builder::new()
                    .name("kvtier-admin-conn".into())
                    .spawn(move || {
                        if let Err(e) = answer(stream, &worker, needs_token) {
                            tracing::debug!(error = %e, "admin request failed");
                        }
                        worker.admin_threads.leave();
                    });
                match spawned {
                    Ok(handle) => workers.push(handle),
                    Err(e) => {
                        shared.admin_threads.leave();
                        tracing::warn!(error = %e, "could not start an admin thread");
                    }
                }
                workers.retain(|h: &std::thread::JoinHandle<()>| !h.is_finished());
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(e) => {
                tracing::warn!(error = %e, "admin accept failed");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
    for handle in workers {
        let _ = handle.join();
    }
}

/// Reads the request head within the deadline, however slowly it trickles.
fn read_head(stream: &mut TcpStream, deadline: Instant) -> std::io::Result<Vec<u8>> {
    let mut request = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    while !request.windows(4).any(|w| w == b"\r\n\r\n") && request.len() < MAX_REQUEST_HEAD {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "admin request head not complete within the admin timeout",
            ));
        }
        stream.set_read_timeout(Some(left))?;
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        request.extend_from_slice(&chunk[..n]);
    }
    Ok(request)
}

fn answer(mut stream: TcpStream, shared: &Shared, needs_token: bool) -> std::io::Result<()> {
    let timeout = shared.config.limits.admin_timeout;
    let deadline = Instant::now() + timeout;
    stream.set_nonblocking(false)?;
    stream.set_write_timeout(Some(timeout))?;
    let request = read_head(&mut stream, deadline)?;
    let head = String::from_utf8_lossy(&request);
    let mut lines = head.split("\r\n");
    let mut parts = lines.next().unwrap_or("").split_whitespace();
    let method = parts.next().unwrap_or("");
    let path = parts.next().unwrap_or("").split('?').next().unwrap_or("");
    let authorization = lines.find_map(|line| {
        let (name, value) = line.split_once(':')?;
        name.trim()
            .eq_ignore_ascii_case("authorization")
            .then_some(value)
    });
    if needs_token && !shared.auth.bearer_matches(authorization) {
        shared.metrics.auth_failures.fetch_add(1, Ordering::Relaxed);
        return respond(
            stream,
            "401 Unauthorized",
            "text/plain",
            "this admin endpoint is off loopback: send Authorization: Bearer <token>\n",
        );
    }
    let store = &shared.store;
    let metrics = &shared.metrics;
    let (status, content_type, body) = match (method, path) {
        ("GET", "/metrics") => (
            "200 OK",
            "text/plain; version=0.0.4",
            metrics.prometheus(&store.stats()),
        ),
        ("GET", "/health") => ("200 OK", "text/plain", "ok\n".to_string()),
        ("GET", "/stats") => (
            "200 OK",
            "application/json",
            metrics.json(&store.stats()).to_string(),
        ),
        ("GET", _) => (
            "404 Not Found",
            "text/plain",
            "not found: try /metrics, /health or /stats\n".to_string(),
        ),
        _ => (
            "405 Method Not Allowed",
            "text/plain",
            "only GET is served\n".to_string(),
        ),
    };
    respond(stream, status, content_type, &body)
}

fn respond(
    mut stream: TcpStream,
    status: &str,
    content_type: &str,
    body: &str,
) -> std::io::Result<()> {
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes())
}
