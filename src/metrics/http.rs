//! The metrics endpoint (`ROCCL_METRICS_ADDR=host:port`): one per process, started by the
//! first communicator that finds the variable set, serving `GET /metrics` (Prometheus text
//! format) and `GET /status` (JSON) from one thread of its own (requests parsed by the
//! `httparse` crate), with bounded connections and deadlines. A bare port serves this host
//! only (127.0.0.1); `0.0.0.0:PORT` serves every interface. Port 0 picks a free port; the
//! address is logged (INFO) and returned by [`address`].
//! Where several processes of one host share a fixed port, the ones that find it taken
//! take a free port instead and log it (`roccl-info --status` takes every address).

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The endpoint's address once it serves, or why it could not start.
static SERVING: OnceLock<Result<SocketAddr, String>> = OnceLock::new();

/// Start the endpoint once per process at `want` (`Config::metrics_addr`, from
/// `ROCCL_METRICS_ADDR`: `host:port`, a bare port for this host only), when there is one;
/// later calls return what the first did.
pub fn start_at(want: Option<&str>) -> Option<Result<SocketAddr, String>> {
    let want = want?;
    Some(SERVING.get_or_init(|| start(want)).clone())
}

/// The endpoint's address, when it serves.
pub fn address() -> Option<SocketAddr> {
    SERVING.get().and_then(|r| r.as_ref().ok()).copied()
}

/// Most connections the endpoint serves at once; a new one past it replaces the oldest.
const MAX_CLIENTS: usize = 16;
/// How long a connection may take to send its request.
const CLIENT_DEADLINE: Duration = Duration::from_secs(2);
/// Longest request (line and headers) read.
const MAX_REQUEST: usize = 8 << 10;

fn start(want: &str) -> Result<SocketAddr, String> {
    // A bare port serves this host only: `/status` names pids, ranks and peers.
    let want = if want.parse::<u16>().is_ok() {
        format!("127.0.0.1:{want}")
    } else {
        want.to_string()
    };
    let listener = match TcpListener::bind(&want) {
        Ok(l) => l,
        Err(e) => {
            // Another process of this host has the port: take a free one.
            let host = want.rsplit_once(':').map_or("127.0.0.1", |(h, _)| h);
            let any = format!("{host}:0");
            let l = TcpListener::bind(&any).map_err(|e2| {
                format!("ROCCL_METRICS_ADDR={want}: cannot listen ({e}), nor on {any} ({e2})")
            })?;
            crate::warn!(
                "ROCCL_METRICS_ADDR={want} is taken ({e}): metrics on a free port instead"
            );
            l
        }
    };
    let addr = listener
        .local_addr()
        .map_err(|e| format!("getsockname of the metrics endpoint: {e}"))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("fcntl on the metrics endpoint: {e}"))?;
    std::thread::Builder::new()
        .name("roccl-metrics".into())
        .spawn(move || serve(listener))
        .map_err(|e| format!("starting the metrics thread: {e}"))?;
    crate::info!("metrics: http://{addr}/metrics and http://{addr}/status (ROCCL_METRICS_ADDR)");
    Ok(addr)
}

/// A connection whose request has not all arrived.
struct Client {
    s: TcpStream,
    got: Vec<u8>,
    deadline: Instant,
}

/// Serve on one thread: at most [`MAX_CLIENTS`] connections (the oldest gives way), each
/// with [`CLIENT_DEADLINE`] to send a request of at most [`MAX_REQUEST`] bytes; so idle or
/// slow connections by the hundred cost the process no thread and no memory beyond these.
fn serve(l: TcpListener) {
    let mut clients: VecDeque<Client> = VecDeque::new();
    loop {
        while let Ok((s, _)) = l.accept() {
            if clients.len() >= MAX_CLIENTS {
                clients.pop_front();
            }
            let _ = s.set_nonblocking(true);
            clients.push_back(Client {
                s,
                got: Vec::new(),
                deadline: Instant::now() + CLIENT_DEADLINE,
            });
        }
        clients.retain_mut(|c| !step(c));
        let mut fds = vec![libc::pollfd {
            fd: l.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        fds.extend(clients.iter().map(|c| libc::pollfd {
            fd: c.s.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }));
        // SAFETY: `fds` is a valid array of pollfd for the duration of the call.
        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 100) };
    }
}

/// Read what `c` sent; answer once its request is whole. True when the connection is done
/// (answered, closed, too slow or too long).
fn step(c: &mut Client) -> bool {
    let mut buf = [0u8; 2048];
    loop {
        match c.s.read(&mut buf) {
            Ok(0) => return true,
            Ok(n) => c.got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return true,
        }
        if c.got.len() > MAX_REQUEST {
            return true;
        }
    }
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(&c.got) {
        Ok(httparse::Status::Complete(_)) => {
            let (body, kind, code) = answer(req.method, req.path);
            let _ = c.s.set_nonblocking(false);
            let _ = c.s.set_write_timeout(Some(CLIENT_DEADLINE));
            let reason = if code == 200 { "OK" } else { "Not Found" };
            let head = format!(
                "HTTP/1.1 {code} {reason}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = c.s.write_all(head.as_bytes());
            let _ = c.s.write_all(body.as_bytes());
            true
        }
        Ok(httparse::Status::Partial) => Instant::now() > c.deadline,
        Err(_) => true,
    }
}

/// The body, content type and status of a request.
fn answer(method: Option<&str>, path: Option<&str>) -> (String, &'static str, u16) {
    match (method, path) {
        (Some("GET"), Some("/metrics")) => (
            super::prometheus(),
            "text/plain; version=0.0.4; charset=utf-8",
            200,
        ),
        (Some("GET"), Some("/status")) => (
            serde_json::to_string_pretty(&super::status()).unwrap_or_default(),
            "application/json",
            200,
        ),
        _ => (
            "roccl serves GET /metrics and GET /status\n".to_string(),
            "text/plain; charset=utf-8",
            404,
        ),
    }
}
