//! roccl-info: what roccl sees on this machine and what it would choose — RDMA devices,
//! ports, GID tables and the GID roccl picks (and why), the locked-memory limit, access to
//! /dev/infiniband, the rdma-core version, network interfaces, and the network roccl will use.
//! Run it first on a new cluster node.

use std::path::Path;
use std::process::ExitCode;

use roccl::bootstrap::ifaces;
use roccl::rdma::select::{self, Criteria};

fn rdma_core_version() -> String {
    let out = std::process::Command::new("dpkg-query")
        .args(["-W", "-f", "${Version}", "rdma-core"])
        .output();
    match out {
        Ok(o) if o.status.success() && !o.stdout.is_empty() => {
            String::from_utf8_lossy(&o.stdout).into_owned()
        }
        _ => {
            let lib = [
                "/usr/lib/x86_64-linux-gnu/libibverbs.so.1",
                "/usr/lib64/libibverbs.so.1",
                "/usr/lib/libibverbs.so.1",
            ]
            .into_iter()
            .find(|p| Path::new(p).exists());
            match lib {
                Some(p) => format!("unknown version (libibverbs at {p})"),
                None => {
                    "not installed (libibverbs not found: apt-get install rdma-core libibverbs1)"
                        .into()
                }
            }
        }
    }
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

fn main() -> ExitCode {
    let mut out = String::new();
    macro_rules! outln {
        ($($t:tt)*) => {{
            use std::fmt::Write as _;
            let _ = writeln!(out, $($t)*);
        }};
    }
    let root = std::env::var("ROCCL_SYSFS_ROOT").unwrap_or_else(|_| select::SYSFS_ROOT.to_string());
    outln!("roccl-info {}", env!("CARGO_PKG_VERSION"));
    outln!("\n== RDMA devices ({root})");
    let ports = match select::scan(Path::new(&root)) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("roccl-info: error: {e}");
            return ExitCode::from(2);
        }
    };
    let net_hint = std::env::var("ROCCL_NET").unwrap_or_else(|_| "auto".into());
    if ports.is_empty() {
        outln!("no RDMA device: roccl will use tcp (ROCCL_NET={net_hint}); ROCCL_NET=rocev2 runs RoCE v2 through the userspace engine over UDP");
    } else {
        let choice = Criteria::from_env().and_then(|c| select::choose(&ports, &c));
        match &choice {
            Ok(c) => outln!("{}", select::describe(&ports, Some(c))),
            Err(e) => {
                outln!("{}", select::describe(&ports, None));
                outln!("no usable RoCE v2 GID: {e}");
            }
        }
    }
    outln!("\n== locked memory (ulimit -l)");
    match roccl::sys::memlock_limit() {
        Ok((soft, hard)) => {
            outln!("soft {}, hard {}", human(soft), human(hard));
            if soft.is_some_and(|s| s < (64 << 20)) && !ports.is_empty() {
                outln!("WARNING: RDMA registration pins memory against this limit: raise it (ulimit -l unlimited, /etc/security/limits.conf memlock, or --ulimit memlock=-1 for containers)");
            }
        }
        Err(e) => outln!("unknown: {e}"),
    }
    outln!("\n== /dev/infiniband");
    outln!("{}", dev_access());
    outln!("\n== rdma-core");
    outln!("{}", rdma_core_version());
    outln!(
        "\n== network interfaces (ROCCL_SOCKET_IFNAME={})",
        std::env::var("ROCCL_SOCKET_IFNAME").unwrap_or_default()
    );
    match ifaces::list() {
        Ok(l) => {
            for i in &l {
                outln!("{:<12} {}", i.name, i.addr);
            }
            match ifaces::local_addr(None) {
                Ok(a) => outln!("roccl would listen on {a}"),
                Err(e) => outln!("no usable interface: {e}"),
            }
        }
        Err(e) => outln!("cannot list interfaces: {e}"),
    }
    // One write, ignoring a closed pipe (`roccl-info | head`).
    let _ = std::io::Write::write_all(&mut std::io::stdout(), out.as_bytes());
    ExitCode::SUCCESS
}
