//! The metrics endpoint (`ROCCL_METRICS_ADDR=host:port`): one per process, started by the
//! first communicator that finds the variable set, serving `GET /metrics` (Prometheus text
//! format) and `GET /status` (JSON) from a thread of its own, with the `tiny_http` crate.
//! Port 0 picks a free port; the address is logged (INFO) and returned by [`address`].
//! Where several processes of one host share a fixed port, the ones that find it taken
//! take a free port instead and log it (`roccl-info --status` takes every address).

use std::net::SocketAddr;
use std::sync::OnceLock;

/// The endpoint's address once it serves, or why it could not start.
static SERVING: OnceLock<Result<SocketAddr, String>> = OnceLock::new();

/// The address `ROCCL_METRICS_ADDR` asks for (`host:port`; a bare port means all
/// interfaces), or `None` when it is unset.
pub fn requested() -> Option<String> {
    std::env::var("ROCCL_METRICS_ADDR")
        .ok()
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

/// Start the endpoint once per process at `ROCCL_METRICS_ADDR` (when set); later calls
/// return what the first did.
pub fn start_from_env() -> Option<Result<SocketAddr, String>> {
    let want = requested()?;
    Some(SERVING.get_or_init(|| start(&want)).clone())
}

/// The endpoint's address, when it serves.
pub fn address() -> Option<SocketAddr> {
    SERVING.get().and_then(|r| r.as_ref().ok()).copied()
}

fn start(want: &str) -> Result<SocketAddr, String> {
    let want = if want.parse::<u16>().is_ok() {
        format!("0.0.0.0:{want}")
    } else {
        want.to_string()
    };
    let server = match tiny_http::Server::http(&want) {
        Ok(s) => s,
        Err(e) => {
            // Another process of this host has the port: take a free one.
            let host = want.rsplit_once(':').map_or("0.0.0.0", |(h, _)| h);
            let any = format!("{host}:0");
            let s = tiny_http::Server::http(&any).map_err(|e2| {
                format!("ROCCL_METRICS_ADDR={want}: cannot listen ({e}), nor on {any} ({e2})")
            })?;
            crate::warn!(
                "ROCCL_METRICS_ADDR={want} is taken ({e}): metrics on a free port instead"
            );
            s
        }
    };
    let addr = server
        .server_addr()
        .to_ip()
        .ok_or_else(|| "the metrics endpoint has no IP address".to_string())?;
    std::thread::Builder::new()
        .name("roccl-metrics".into())
        .spawn(move || serve(server))
        .map_err(|e| format!("starting the metrics thread: {e}"))?;
    crate::info!("metrics: http://{addr}/metrics and http://{addr}/status (ROCCL_METRICS_ADDR)");
    Ok(addr)
}

fn serve(server: tiny_http::Server) {
    for req in server.incoming_requests() {
        let (body, kind, code) = match (req.method(), req.url()) {
            (tiny_http::Method::Get, "/metrics") => (
                super::prometheus(),
                "text/plain; version=0.0.4; charset=utf-8",
                200,
            ),
            (tiny_http::Method::Get, "/status") => (
                serde_json::to_string_pretty(&super::status()).unwrap_or_default(),
                "application/json",
                200,
            ),
            _ => (
                "roccl serves GET /metrics and GET /status\n".to_string(),
                "text/plain; charset=utf-8",
                404,
            ),
        };
        let mut resp = tiny_http::Response::from_string(body).with_status_code(code);
        if let Ok(h) = tiny_http::Header::from_bytes(&b"Content-Type"[..], kind.as_bytes()) {
            resp = resp.with_header(h);
        }
        let _ = req.respond(resp);
    }
}
