//! roccl-info: what roccl sees on this machine and what it would choose — RDMA devices,
//! ports, GID tables and the GID roccl picks (and why), the locked-memory limit, access to
//! /dev/infiniband, the rdma-core version, network interfaces, and the network roccl will use.
//! Run it first on a new cluster node.

use std::path::Path;
use std::process::ExitCode;

use roccl::bootstrap::ifaces;
use roccl::rdma::select::{self, Criteria};

/// A line on standard output; a closed standard output ends the program quietly.
macro_rules! say {
    ($($t:tt)*) => {
        roccl::tool::print_line(format_args!($($t)*))
    };
}

/// A line on standard error, in one write.
macro_rules! errln {
    ($($t:tt)*) => {
        roccl::tool::print_error(format_args!($($t)*))
    };
}

/// A line of the node report, added to the text that is printed at its end.
macro_rules! outln {
    ($out:expr, $($t:tt)*) => {{
        use std::fmt::Write as _;
        let _ = writeln!($out, $($t)*);
    }};
}

fn rdma_core_version() -> String {
    // Debian/Ubuntu package names, then RPM.
    let queries: [(&str, &[&str]); 3] = [
        (
            "dpkg-query",
            &["-W", "-f", "${Version} (rdma-core)", "rdma-core"],
        ),
        (
            "dpkg-query",
            &["-W", "-f", "${Version} (libibverbs1)", "libibverbs1"],
        ),
        (
            "rpm",
            &["-q", "--qf", "%{VERSION} (rdma-core)", "rdma-core"],
        ),
    ];
    let found = queries.iter().find_map(|(cmd, args)| {
        let o = std::process::Command::new(cmd).args(*args).output().ok()?;
        (o.status.success() && !o.stdout.is_empty())
            .then(|| String::from_utf8_lossy(&o.stdout).into_owned())
    });
    match found {
        Some(v) => v,
        None => {
            let lib = [
                "/usr/lib/x86_64-linux-gnu/libibverbs.so.1",
                "/usr/lib64/libibverbs.so.1",
                "/usr/lib/libibverbs.so.1",
            ]
            .into_iter()
            .find(|p| Path::new(p).exists());
            match lib {
                Some(p) => match soname_version(Path::new(p)) {
                    Some(v) => format!("{v} (from {p}'s file name)"),
                    None => format!("unknown version (libibverbs at {p})"),
                },
                None => {
                    "not installed (libibverbs not found: apt-get install rdma-core libibverbs1)"
                        .into()
                }
            }
        }
    }
}

/// rdma-core's version from the file libibverbs' soname link points to: rdma-core names
/// it `libibverbs.so.1.<ABI>.<rdma-core version>` (44.0 in `libibverbs.so.1.14.44.0`), so
/// a host or image without a package database still says which it has.
fn soname_version(lib: &Path) -> Option<String> {
    let real = std::fs::canonicalize(lib).ok()?;
    let name = real.file_name()?.to_str()?;
    let parts: Vec<&str> = name.strip_prefix("libibverbs.so.1.")?.split('.').collect();
    (parts.len() >= 3 && parts.iter().all(|p| p.parse::<u32>().is_ok()))
        .then(|| parts[1..].join("."))
}

fn dev_access() -> String {
    let dir = Path::new("/dev/infiniband");
    let Ok(entries) = std::fs::read_dir(dir) else {
        return "/dev/infiniband: absent (no RDMA driver loaded; in a container, pass --device=/dev/infiniband)".into();
    };
    let mut lines = Vec::new();
    for e in entries.flatten() {
        let p = e.path();
        let ok = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&p)
            .is_ok();
        lines.push(format!(
            "{}: {}",
            p.display(),
            if ok { "read/write ok".to_string() } else { "NO ACCESS (run as a user with access, or in a container add --device=/dev/infiniband --cap-add=IPC_LOCK)".to_string() }
        ));
    }
    if lines.is_empty() {
        "/dev/infiniband: empty".into()
    } else {
        lines.join("\n")
    }
}

fn human(b: Option<u64>) -> String {
    match b {
        None => "unlimited".into(),
        Some(b) if b >= 1 << 30 => format!("{} GiB", b >> 30),
        Some(b) if b >= 1 << 20 => format!("{} MiB", b >> 20),
        Some(b) => format!("{} KiB", b >> 10),
    }
}

/// `--listen ADDR:PORT` / `--peer ADDR:PORT`: measure TCP and RoCE v2 between two hosts.
fn link_test(listen: bool, addr: &str) -> Result<(), String> {
    use roccl::net::NetKind;
    use roccl::{Communicator, Config, UniqueId};
    use std::net::ToSocketAddrs;
    use std::time::Instant;
    let base = addr
        .to_socket_addrs()
        .map_err(|e| format!("resolving {addr}: {e}"))?
        .next()
        .ok_or_else(|| format!("{addr} has no address"))?;
    let rank = usize::from(!listen);
    if !listen {
        probe(base)?;
    }
    say!(
        "{:<8} {:>14} {:>16} {:>16}",
        "net",
        "8 B RTT (us)",
        "1 MiB (Gb/s)",
        "16 MiB (Gb/s)"
    );
    let mut kinds = vec![(NetKind::Tcp, "tcp"), (NetKind::RoceV2, "rocev2")];
    if cfg!(feature = "verbs") && nic_present() {
        kinds.push((NetKind::Verbs, "verbs"));
    }
    for (kind, name) in kinds {
        // One port for both phases: each root serves one rendezvous and closes.
        let at = base;
        // The job secret, if the launcher gave one (ROCCL_JOB_SECRET).
        let secret = roccl::bootstrap::env::job_secret(at).map_err(|e| e.to_string())?;
        let id = if listen {
            roccl::bootstrap::serve_root_with(at, secret).map_err(|e| e.to_string())?
        } else {
            UniqueId::for_address_with(at, secret)
        };
        let mut cfg = Config::from_env().map_err(|e| e.to_string())?;
        cfg.net = kind;
        let c = Communicator::init_with(&id, 2, rank, cfg).map_err(|e| format!("{name}: {e}"))?;
        let peer = 1 - rank;
        let mut small = [0u8; 8];
        let iters = 1000;
        let t = Instant::now();
        for _ in 0..iters {
            if rank == 0 {
                c.send(&small, peer).map_err(|e| e.to_string())?;
                c.recv(&mut small, peer).map_err(|e| e.to_string())?;
            } else {
                c.recv(&mut small, peer).map_err(|e| e.to_string())?;
                c.send(&small, peer).map_err(|e| e.to_string())?;
            }
        }
        let rtt = t.elapsed().as_secs_f64() * 1e6 / iters as f64;
        let mut bw = Vec::new();
        for size in [1usize << 20, 16 << 20] {
            let send = vec![1u8; size];
            let mut recv = vec![0u8; size];
            let reps = 20;
            c.barrier().map_err(|e| e.to_string())?;
            let t = Instant::now();
            for _ in 0..reps {
                c.sendrecv(&send, peer, &mut recv, peer)
                    .map_err(|e| e.to_string())?;
            }
            bw.push((size * reps) as f64 * 8.0 / t.elapsed().as_secs_f64() / 1e9);
        }
        say!("{name:<8} {rtt:>14.1} {:>16.2} {:>16.2}", bw[0], bw[1]);
    }
    say!("(bandwidth: both directions at once, Gb/s per direction; rocev2 = RoCE v2 in userspace over UDP, verbs = the RDMA NIC)");
    Ok(())
}

/// `--peer`: wait (up to 10 s, or ROCCL_TIMEOUT if shorter) for something to accept a TCP
/// connection at `addr`, and say plainly when nothing does.
fn probe(addr: std::net::SocketAddr) -> Result<(), String> {
    use std::time::{Duration, Instant};
    let limit = roccl::envvar::timeout().min(Duration::from_secs(10));
    let start = Instant::now();
    loop {
        match std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
            Ok(_) => return Ok(()),
            Err(e) if start.elapsed() >= limit => {
                return Err(format!(
                    "nothing answers at {addr} ({e}, for {limit:.0?}): start `roccl-info --listen {addr}` on that host first, and check the address, the port and any firewall between the hosts"
                ))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

/// Whether sysfs shows an RDMA device (both hosts must agree for the verbs row of the link
/// test: run it on nodes of the same kind).
fn nic_present() -> bool {
    select::scan(Path::new(select::SYSFS_ROOT)).is_ok_and(|p| !p.is_empty())
}

/// Open the chosen device through libibverbs and report what it offers, or why it fails;
/// and whether roccl can use it.
#[cfg(feature = "verbs")]
fn verbs_check(choice: &select::Choice) -> (String, bool) {
    use roccl::rdma::ibv::{IbSettings, IbvVerbs};
    use roccl::rdma::verbs::Verbs;
    let settings = match IbSettings::from_lookup(&roccl::envvar::from_process) {
        Ok(s) => s,
        Err(e) => return (format!("settings: {e}"), false),
    };
    match IbvVerbs::open(choice, settings) {
        Ok(v) => {
            let qp = v.create_qp().map(|(q, ep)| {
                v.destroy_qp(q);
                ep
            });
            let ok = qp.is_ok();
            let dmabuf = if v.dmabuf() {
                "supported"
            } else {
                "not supported"
            };
            let qp = match qp {
                Ok(ep) => format!("was created (QPN {:#x})", ep.qpn),
                Err(e) => format!("could NOT be created: {e}"),
            };
            let text = format!(
                "libibverbs opened {}: active MTU {}, dmabuf registration {dmabuf}, a test QP {qp}",
                v.name(),
                v.mtu()
            );
            (text, ok)
        }
        Err(e) => (format!("libibverbs could NOT open it: {e}"), false),
    }
}

/// What libibverbs itself lists.
#[cfg(feature = "verbs")]
fn libibverbs_view() -> Option<String> {
    Some(match roccl::rdma::ibv::device_names() {
        Ok(n) if n.is_empty() => "lists no device either".into(),
        Ok(n) => format!("lists {}", n.join(", ")),
        Err(e) => e.to_string(),
    })
}

#[cfg(not(feature = "verbs"))]
fn libibverbs_view() -> Option<String> {
    None
}

#[cfg(not(feature = "verbs"))]
fn verbs_check(_choice: &select::Choice) -> (String, bool) {
    ("this roccl-info was built without the `verbs` feature: rebuild with `cargo build --release --features verbs` to check the device through libibverbs and to run RoCE v2 on it".into(), false)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        [] => node_report(),
        ["--status", addrs @ ..] if !addrs.is_empty() => {
            let addrs: Vec<String> = addrs.iter().map(|a| a.to_string()).collect();
            let r = roccl::tool::status::report(&addrs);
            roccl::tool::print_line(format_args!("{}", r.trim_end()));
            ExitCode::SUCCESS
        }
        ["--watch", rest @ ..] if !rest.is_empty() => watch(rest),
        ["--listen", a] | ["--peer", a] => match link_test(args[0] == "--listen", a) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                errln!("roccl-info: error: {e}");
                ExitCode::from(2)
            }
        },
        _ => {
            errln!("usage: roccl-info                 what roccl sees on this node\n       roccl-info --listen ADDR:PORT  (on host A) and\n       roccl-info --peer ADDR:PORT    (on host B, ADDR = host A): TCP vs RoCE v2 latency and bandwidth\n(one TCP port for the rendezvous)\n       roccl-info --status ADDR...    which rank the others wait for, from the ranks' ROCCL_METRICS_ADDR endpoints\n       roccl-info --watch ADDR... [--interval S] [--count N]   per-peer round-trip time, throughput and rates, refreshed");
            ExitCode::from(2)
        }
    }
}

/// `--watch ADDR... [--interval S] [--count N]`: read the endpoints and the refresh
/// settings from the arguments after `--watch`, then show the ranks' per-peer figures
/// until the count runs out (or for ever). A bad number or no endpoint is a usage error.
fn watch(rest: &[&str]) -> ExitCode {
    let mut addrs = Vec::new();
    let (mut interval, mut count) = (std::time::Duration::from_secs(1), None);
    let mut it = rest.iter();
    while let Some(&a) = it.next() {
        match a {
            "--interval" | "--count" => {
                let v = it.next().and_then(|v| v.parse::<f64>().ok());
                match (a, v) {
                    ("--interval", Some(s)) if s > 0.0 && s < 86400.0 => {
                        interval = std::time::Duration::from_secs_f64(s)
                    }
                    ("--count", Some(c)) if c >= 1.0 => count = Some(c as u64),
                    _ => {
                        errln!("roccl-info: {a} needs a positive number (--interval seconds, --count refreshes)");
                        return ExitCode::from(2);
                    }
                }
            }
            _ => addrs.push(a.to_string()),
        }
    }
    if addrs.is_empty() {
        errln!("roccl-info --watch: give the ranks' ROCCL_METRICS_ADDR endpoints");
        return ExitCode::from(2);
    }
    roccl::tool::watch::run(&addrs, interval, count);
    ExitCode::SUCCESS
}

/// Without arguments: what roccl sees on this node, a section at a time, gathered into one
/// text that is printed at the end (so that a failure to read the RDMA devices prints
/// nothing but the error).
fn node_report() -> ExitCode {
    let mut out = String::new();
    let root = std::env::var("ROCCL_SYSFS_ROOT").unwrap_or_else(|_| select::SYSFS_ROOT.to_string());
    outln!(out, "roccl-info {}", env!("CARGO_PKG_VERSION"));
    outln!(out, "\n== RDMA devices ({root})");
    let ports = match select::scan(Path::new(&root)) {
        Ok(p) => p,
        Err(e) => {
            errln!("roccl-info: error: {e}");
            return ExitCode::from(2);
        }
    };
    report_devices(&mut out, &ports);
    report_locked_memory(&mut out, &ports);
    outln!(out, "\n== /dev/infiniband");
    outln!(out, "{}", dev_access());
    outln!(out, "\n== rdma-core");
    outln!(out, "{}", rdma_core_version());
    report_interfaces(&mut out);
    report_host_speeds(&mut out);
    report_gpu_runtimes(&mut out);
    // A closed pipe (`roccl-info | head`) ends it quietly.
    roccl::tool::print_line(format_args!("{}", out.trim_end()));
    ExitCode::SUCCESS
}

/// The body of the RDMA devices section: the ports sysfs shows, the GID roccl would pick
/// and why (or why none fits), whether libibverbs can open the chosen device, and the
/// network roccl would end up using.
fn report_devices(out: &mut String, ports: &[select::PortInfo]) {
    let net_hint = std::env::var("ROCCL_NET").unwrap_or_else(|_| "auto".into());
    if ports.is_empty() {
        outln!(out, "no RDMA device: {}; ROCCL_NET=rocev2 runs RoCE v2 through the userspace engine over UDP", will_use(&net_hint, "tcp"));
        if let Some(v) = libibverbs_view() {
            outln!(out, "libibverbs: {v}");
        }
    } else {
        let choice = Criteria::from_lookup(&roccl::envvar::from_process)
            .and_then(|c| select::choose(ports, &c));
        match &choice {
            Ok(c) => {
                outln!(out, "{}", select::describe(ports, Some(c)));
                let (text, usable) = verbs_check(c);
                outln!(out, "{text}");
                let net = if usable {
                    "verbs (RoCE v2 on this NIC)"
                } else if cfg!(feature = "verbs") {
                    "tcp (the NIC is not usable, see above)"
                } else {
                    "tcp (built without the verbs feature)"
                };
                outln!(out, "{}", will_use(&net_hint, net));
            }
            Err(e) => {
                outln!(out, "{}", select::describe(ports, None));
                outln!(out, "no usable RoCE v2 GID: {e}");
            }
        }
    }
}

/// The sentence that says which network roccl will use, given ROCCL_NET (`net_hint`) and
/// the network it would use to other hosts (`remote`): with ROCCL_NET=auto that is shared
/// memory between ranks of one host unless ROCCL_SHM=0, and `remote` to other hosts.
fn will_use(net_hint: &str, remote: &str) -> String {
    if let Some(nets) = roccl::envvar::raw("ROCCL_NETS").filter(|v| !v.trim().is_empty()) {
        return format!(
            "roccl will use shared memory between ranks of this host and, to other hosts, the networks of ROCCL_NETS={nets} (the first for point-to-point calls): per peer and call size the one measured fastest at init among those both ranks offer (roccl-info --status shows the choice of a running job)"
        );
    }
    match net_hint.trim().to_ascii_lowercase().as_str() {
        "" | "auto" => {
            let shm = roccl::envvar::raw("ROCCL_SHM").and_then(|v| roccl::envvar::parse_switch(&v))
                != Some(false);
            if shm {
                format!("roccl will use shared memory between ranks of this host and {remote} to other hosts (ROCCL_NET=auto; ROCCL_SHM=0 turns shared memory off)")
            } else {
                format!("roccl will use {remote} (ROCCL_NET=auto, ROCCL_SHM=0)")
            }
        }
        other => format!("roccl will use {other} (ROCCL_NET={other})"),
    }
}

/// The locked-memory section: the soft and hard `ulimit -l`, with a warning when RDMA
/// devices are present and the limit is too low for them to register buffers.
fn report_locked_memory(out: &mut String, ports: &[select::PortInfo]) {
    outln!(out, "\n== locked memory (ulimit -l)");
    match roccl::os::memlock_limit() {
        Ok((soft, hard)) => {
            outln!(out, "soft {}, hard {}", human(soft), human(hard));
            if soft.is_some_and(|s| s < (64 << 20)) && !ports.is_empty() {
                outln!(out, "WARNING: RDMA registration pins memory against this limit: raise it (ulimit -l unlimited, /etc/security/limits.conf memlock, or --ulimit memlock=-1 for containers)");
            }
        }
        Err(e) => outln!(out, "unknown: {e}"),
    }
}

/// The network interfaces section: every interface with its address, and the one roccl
/// would listen on for the rendezvous.
fn report_interfaces(out: &mut String) {
    outln!(
        out,
        "\n== network interfaces (ROCCL_SOCKET_IFNAME={})",
        std::env::var("ROCCL_SOCKET_IFNAME").unwrap_or_default()
    );
    match ifaces::list() {
        Ok(l) => {
            for i in &l {
                outln!(out, "{:<12} {}", i.name, i.addr);
            }
            match ifaces::local_addr(None) {
                Ok(a) => outln!(out, "roccl would listen on {a}"),
                Err(e) => outln!(out, "no usable interface: {e}"),
            }
        }
        Err(e) => outln!(out, "cannot list interfaces: {e}"),
    }
}

/// The host speeds section: the reduction and copy speeds measured here, and the figures
/// the cost model is given from them, since they decide which algorithm roccl picks.
fn report_host_speeds(out: &mut String) {
    outln!(
        out,
        "\n== host speeds (what the cost model is fed; docs/ARCHITECTURE.md)"
    );
    let m = roccl::algo::calibrate::host_speeds(true);
    let f = roccl::algo::calibrate::for_model(m);
    outln!(
        out,
        "measured: reduce (f32 sum) {:.1} GB/s, copy {:.1} GB/s; model: {:.1} / {:.1} GB/s ({}), {} CPU(s) usable",
        m.reduce_gbs,
        m.copy_gbs,
        f.reduce_gbs,
        f.copy_gbs,
        if f == roccl::algo::calibrate::DEFAULT {
            "within the band of the machine the model was fitted on"
        } else {
            "scaled from the fitted figures"
        },
        roccl::os::host_cores()
    );
}

/// The GPU runtimes section: each runtime built in and whether its device is present and
/// takes stream memory operations, then when GPU buffers go straight through the NIC.
fn report_gpu_runtimes(out: &mut String) {
    outln!(
        out,
        "\n== GPU runtimes (ROCCL_DEVICE={})",
        std::env::var("ROCCL_DEVICE").unwrap_or_default()
    );
    let built = roccl::device::runtimes_built();
    if built.is_empty() {
        outln!(
            out,
            "none built in (rebuild with --features hip or cuda for device buffers; docs/GPU.md)"
        );
    }
    for rt in built {
        match roccl::device::open_runtime(rt) {
            Ok(d) => outln!(
                out,
                "{rt}: device present; stream memory operations: {}",
                if d.stream_waits() {
                    "yes"
                } else {
                    "no (calls on streams wait on the host)"
                }
            ),
            Err(e) => outln!(out, "{rt}: {e}"),
        }
    }
    let gd = std::env::var("ROCCL_GPU_DIRECT").unwrap_or_else(|_| "auto".into());
    outln!(
        out,
        "GPU-direct (ROCCL_GPU_DIRECT={gd}): broadcast, all-gather, all-to-all and send/receive of at least ROCCL_GPU_DIRECT_MIN (64K) on a discrete GPU's memory go through the NIC without staging when the RDMA network takes GPU memory: dmabuf registration (ibv_reg_dmabuf_mr: Linux >= 5.12 and a NIC driver with dmabuf support) or peer memory (loaded here: {}); otherwise, and for reductions, staged through pinned host buffers",
        if roccl::net::rocev2::peer_memory() {
            "yes"
        } else {
            "no: nvidia_peermem / amdkfd peer-memory client absent"
        }
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rdma_core_version_is_read_from_the_library_file_name() {
        let dir = std::env::temp_dir().join(format!("roccl-info-soname-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let real = dir.join("libibverbs.so.1.14.44.0");
        std::fs::write(&real, b"").unwrap();
        let link = dir.join("libibverbs.so.1");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink("libibverbs.so.1.14.44.0", &link).unwrap();
        assert_eq!(soname_version(&link).as_deref(), Some("44.0"));
        // A file name without the version says nothing rather than something wrong.
        let bare = dir.join("libibverbs.so.1.x");
        std::fs::write(&bare, b"").unwrap();
        assert_eq!(soname_version(&bare), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
