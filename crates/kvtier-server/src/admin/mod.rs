//! The admin HTTP endpoint: the status page (`GET /`), `/metrics`
//! (Prometheus), `/health`, `/stats` and `/stats/history` (JSON).
//!
//! Served by hyper on a one-thread tokio runtime: every connection is a
//! task, so slow or silent clients cost a little memory each and never
//! hold up `/health`. Limits: at most `Limits::max_admin_connections`
//! connections (past it, a 503 without reading), the request head must
//! arrive within `Limits::admin_timeout` and the whole exchange end within
//! it, one request per connection. Off loopback, everything but the
//! page's own static files needs `Authorization: Bearer <token>`.

mod history;
mod page;

use crate::context::{Shared, POLL};
use crate::limits::Budget;
use crate::metrics;
use bytes::Bytes;
use history::History;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, ACCEPT, AUTHORIZATION, CACHE_CONTROL, CONTENT_TYPE, HOST};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::registry::Registry;
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Sent to a connection over the cap, without reading its request.
const BUSY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 5\r\nConnection: close\r\n\r\nbusy\n";

struct Admin {
    shared: Arc<Shared>,
    registry: Registry,
    history: Mutex<History>,
    connections: Arc<Budget>,
    /// Connections past the cap being answered (`/health`, or 503).
    overflow: Arc<Budget>,
    needs_token: bool,
}

pub(crate) fn serve(listener: std::net::TcpListener, shared: &Arc<Shared>) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            tracing::error!(error = %e, "could not start the admin endpoint's runtime; admin HTTP is off");
            return;
        }
    };
    // With tenants, the admin views (every tenant's traffic) need the
    // server's token on loopback too.
    let needs_token = crate::trust::Auth::admin_needs_token(listener.local_addr().ok())
        || shared.auth.has_tenants();
    let admin = Arc::new(Admin {
        registry: metrics::registry(
            Arc::clone(&shared.metrics),
            Arc::clone(&shared.store),
            shared.peers.clone(),
        ),
        history: Mutex::new(History::default()),
        connections: Budget::new(shared.config.limits.max_admin_connections as u64),
        overflow: Budget::new(OVERFLOW_SLOTS),
        needs_token,
        shared: Arc::clone(shared),
    });
    runtime.block_on(accept_loop(listener, admin));
}

async fn accept_loop(listener: std::net::TcpListener, admin: Arc<Admin>) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(listener) => listener,
        Err(e) => {
            tracing::error!(error = %e, "admin listener unusable; admin HTTP is off");
            return;
        }
    };
    let mut stop_check = tokio::time::interval(POLL);
    let mut sample = tokio::time::interval(history::INTERVAL);
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => Arc::clone(&admin).start(stream),
                Err(e) => {
                    tracing::warn!(error = %e, "admin accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            _ = sample.tick() => admin.sample(),
            _ = stop_check.tick() => {
                if admin.shared.stopping.load(Ordering::Acquire) {
                    break;
                }
            }
        }
    }
}

impl Admin {
    fn sample(&self) {
        let stats = self.shared.store.stats();
        self.history
            .lock()
            .unwrap()
            .sample(&self.shared.metrics, &stats);
    }

    fn start(self: Arc<Self>, stream: tokio::net::TcpStream) {
        let Some(permit) = self.connections.try_take(1) else {
            // Over the cap: /health is still answered (a liveness probe
            // must not restart a healthy server because idle sockets hold
            // the admin slots), on a few slots of its own.
            match self.overflow.try_take(1) {
                Some(permit) => {
                    tokio::spawn(async move {
                        let _permit = permit;
                        overflow(stream).await;
                    });
                }
                None => drop(stream),
            }
            return;
        };
        let _ = stream.set_nodelay(true);
        let timeout = self.shared.config.limits.admin_timeout;
        tokio::spawn(async move {
            let _permit = permit;
            let admin = Arc::clone(&self);
            let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                let response = admin.answer(&request);
                // A refused bearer token is a guess like any other login's:
                // answered after a turn of the one guess budget and the
                // pause (without a turn in time, not at all: the
                // connection ends at the admin timeout).
                let wait = (response.status() == StatusCode::UNAUTHORIZED).then(|| {
                    admin
                        .shared
                        .governor
                        .guesses()
                        .reserve_turn(std::time::Instant::now() + timeout)
                        .unwrap_or(timeout)
                });
                async move {
                    if let Some(wait) = wait {
                        tokio::time::sleep(wait).await;
                    }
                    Ok::<_, Infallible>(response)
                }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(timeout)
                .keep_alive(false)
                .serve_connection(TokioIo::new(stream), service);
            match tokio::time::timeout(timeout, connection).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::debug!(error = %e, "admin connection failed"),
                Err(_) => tracing::debug!("admin connection dropped at the admin timeout"),
            }
        });
    }

    fn answer(&self, request: &Request<Incoming>) -> Response<Full<Bytes>> {
        let path = request.uri().path();
        if request.method() != Method::GET && request.method() != Method::HEAD {
            return text(StatusCode::METHOD_NOT_ALLOWED, "only GET is served\n");
        }
        let host = request
            .headers()
            .get(HOST)
            .map(|v| v.to_str().unwrap_or(""));
        if !crate::trust::Auth::admin_host_allowed(
            self.needs_token,
            host,
            &self.shared.config.admin_allowed_hosts,
        ) {
            return text(
                StatusCode::MISDIRECTED_REQUEST,
                "this admin endpoint answers loopback host names only (admin_allowed_hosts \
                 adds others)\n",
            );
        }
        if let Some(asset) = page::asset(path) {
            return page_headers(reply(
                StatusCode::OK,
                asset.content_type,
                Bytes::from_static(asset.body),
            ));
        }
        // Liveness reveals nothing: answered without the token.
        if path == "/health" {
            return text(StatusCode::OK, "ok\n");
        }
        let authorization = request
            .headers()
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        if !self
            .shared
            .auth
            .admits_admin_request(self.needs_token, authorization)
        {
            self.shared.governor.guesses().count_refusal();
            return text(
                StatusCode::UNAUTHORIZED,
                "this admin endpoint is off loopback: send Authorization: Bearer <token>\n",
            );
        }
        let shared = &self.shared;
        match path {
            "/health" => text(StatusCode::OK, "ok\n"),
            "/metrics" => {
                let openmetrics = request
                    .headers()
                    .get(ACCEPT)
                    .and_then(|v| v.to_str().ok())
                    .is_some_and(|v| v.contains("application/openmetrics-text"));
                let (body, content_type) = metrics::render(&self.registry, openmetrics);
                reply(StatusCode::OK, content_type, body.into())
            }
            "/stats" => {
                let mut json = shared.metrics.json(&shared.store.stats());
                // Namespace names are model identities: shown to holders of
                // the server's token only (without tenants a loopback admin
                // port asks for no token, and every local user reaches it,
                // while the data port admits only the owner's uid or the
                // token); the others see counts.
                let named = shared.auth.admits_admin_request(true, authorization);
                json["namespaces"] = shared.namespace_use.stats_json(named);
                json["hit_rate_last_minute"] = self
                    .history
                    .lock()
                    .unwrap()
                    .hit_rates_over(Duration::from_secs(60));
                json["cluster"] = match &shared.peers {
                    Some(peers) => {
                        let mut cluster = peers.view.json();
                        cluster["peers"] = peers.json();
                        cluster
                    }
                    None => serde_json::json!({ "enabled": false, "members": [] }),
                };
                json["shared_storage"] = shared_storage_json(&shared.store);
                json["budgets"] = budgets_json(shared);
                for section in &shared.config.status_sections {
                    json[section.name()] = section.json();
                }
                json_reply(&json)
            }
            "/stats/history" => json_reply(&self.history.lock().unwrap().json()),
            _ => text(
                StatusCode::NOT_FOUND,
                "not found: try /, /metrics, /health, /stats or /stats/history\n",
            ),
        }
    }
}

/// The shared directory and each other writer's log as this node follows
/// it (docs/design.md, "Shared directory").
fn shared_storage_json(store: &kvtier::Store) -> serde_json::Value {
    let Some(dir) = store.config().configured_shared_dir() else {
        return serde_json::json!({ "enabled": false, "writers": [] });
    };
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let writers: Vec<serde_json::Value> = store
        .shared_writers()
        .into_iter()
        .map(|w| {
            serde_json::json!({
                "node": w.node,
                "regions": w.regions,
                "bytes": w.bytes,
                "newest_seq": w.newest_seq,
                "last_change_unix_ms": w.last_change_unix_ms,
                "last_change_age_ms": (w.last_change_unix_ms > 0)
                    .then(|| now_ms.saturating_sub(w.last_change_unix_ms)),
            })
        })
        .collect();
    serde_json::json!({
        "enabled": true,
        "dir": dir.display().to_string(),
        "node": store.node_id(),
        "writers": writers,
    })
}

/// Connections past the admin cap answered at once (each for at most
/// `OVERFLOW_DEADLINE`); past these, new connections are closed unanswered.
const OVERFLOW_SLOTS: u64 = crate::limits::ADMIN_OVERFLOW;
/// How long a connection past the cap has to send its request line.
const OVERFLOW_DEADLINE: Duration = Duration::from_secs(1);

/// Answers a connection past the cap: `GET /health` (or `HEAD`) with 200,
/// anything else with a 503, reading at most one request head within
/// `OVERFLOW_DEADLINE`; then reads what the client sent for a moment
/// before closing, so the answer is not lost to a reset.
async fn overflow(mut stream: tokio::net::TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const HEALTHY: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 3\r\nConnection: close\r\n\r\nok\n";
    let _ = tokio::time::timeout(OVERFLOW_DEADLINE, async {
        let mut head = [0u8; 1024];
        let mut len = 0;
        while len < head.len() && !head[..len].windows(2).any(|w| w == b"\r\n") {
            let n = stream.read(&mut head[len..]).await?;
            if n == 0 {
                break;
            }
            len += n;
        }
        let line = &head[..len];
        let health = line.starts_with(b"GET /health ") || line.starts_with(b"HEAD /health ");
        stream
            .write_all(if health { HEALTHY } else { BUSY })
            .await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 1024];
        while stream.read(&mut sink).await? > 0 {}
        Ok::<_, std::io::Error>(())
    })
    .await;
}

fn reply(status: StatusCode, content_type: &'static str, body: Bytes) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

fn text(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    reply(
        status,
        "text/plain; charset=utf-8",
        Bytes::from_static(body.as_bytes()),
    )
}

/// What the buffer and receiving budgets hold now, server-wide and by
/// tenant (docs/server.md, "Limits").
fn budgets_json(shared: &Shared) -> serde_json::Value {
    let tenants: serde_json::Map<String, serde_json::Value> = shared
        .config
        .tenants
        .iter()
        .enumerate()
        .map(|(i, tenant)| {
            let who = kvtier_governor::Principal::Tenant(i);
            (
                tenant.name.clone(),
                serde_json::json!({
                    "buffer_bytes": shared.buffers.held_by(who),
                    "receiving_bytes": shared.receiving.held_by(who),
                }),
            )
        })
        .collect();
    serde_json::json!({
        "buffer_bytes": shared.buffers.used(),
        "buffer_limit": shared.buffers.limit(),
        "receiving_bytes": shared.receiving.used(),
        "receiving_limit": shared.receiving.limit(),
        "tenants": tenants,
    })
}

fn json_reply(json: &serde_json::Value) -> Response<Full<Bytes>> {
    reply(StatusCode::OK, "application/json", json.to_string().into())
}

/// The page loads nothing from elsewhere and runs only its own script.
fn page_headers(mut response: Response<Full<Bytes>>) -> Response<Full<Bytes>> {
    let headers = response.headers_mut();
    headers.insert(
        "content-security-policy",
        HeaderValue::from_static(
            "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    headers.insert(
        "x-content-type-options",
        HeaderValue::from_static("nosniff"),
    );
    response
}
