//! Two RoCE v2 queue pairs, one per process, driven through the verbs layer: each side is the
//! userspace engine (`ROCCL_NET=rocev2`) or a NIC through libibverbs (`ROCCL_NET=verbs`,
//! built with `--features verbs`), so the engine meets a kernel RDMA stack (Linux rxe) verb
//! by verb. Each side in turn is the requester and checks, against the other as responder:
//! SENDs with immediate of 1 B to 64 KiB (one packet to many, across the path MTU), RDMA
//! WRITEs with immediate, RDMA READs (multi-packet read responses), and a SEND that finds
//! no receive posted (RNR NAKs, then the retry succeeds).
//!
//! `ROCCL_RANK` 0 listens on `ROCCL_ROOT`'s port, rank 1 connects to it; the QP runs on the
//! address `ROCCL_IB_HCA` gives (the engine) or the device it names (`=rxe0`). Prints each
//! check and `# wrong results: N`; exits non-zero when a check failed.
//!
//! `tests/rxe/cross.sh` runs it between the host's engine and rxe in a VM, both ways.

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use roccl::rdma::verbs::{
    Access, Mr, QpEndpoint, QpId, RecvWr, SendWr, Sge, Verbs, Wc, WcStatus, WrOpcode,
};

const REGION: usize = 1 << 20;
const SEND_SIZES: [usize; 6] = [1, 1000, 1024, 1025, 5000, 65536];
const WRITE_SIZES: [usize; 3] = [8, 3000, 262_144];
const READ_SIZES: [usize; 3] = [8, 5000, 262_144];

type Res<T> = Result<T, String>;

/// One side: its provider, QP, and two registered buffers: `region` (the peer reads and
/// writes it) and `local` (sends, receives, read targets).
struct Side {
    v: Box<dyn Verbs>,
    qp: QpId,
    ep: QpEndpoint,
    /// Completions polled while waiting for another.
    pending: Vec<Wc>,
    region: &'static mut [u8],
    local: &'static mut [u8],
    rmr: Mr,
    lmr: Mr,
}

fn pattern(seed: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 31 + seed * 7 + 1) as u8).collect()
}

fn env(k: &str) -> Res<String> {
    std::env::var(k).map_err(|_| format!("{k} is not set"))
}

fn open_provider() -> Res<Box<dyn Verbs>> {
    let net = env("ROCCL_NET").unwrap_or_else(|_| "rocev2".into());
    match net.as_str() {
        "rocev2" => {
            let ip: IpAddr = env("ROCCL_IB_HCA")?
                .parse()
                .map_err(|e| format!("ROCCL_IB_HCA: an address for the engine: {e}"))?;
            let settings =
                roccl::rdma::udp::EngineSettings::from_lookup(&roccl::envvar::from_process)
                    .map_err(|e| e.to_string())?;
            let v = roccl::rdma::udp::UserVerbs::open(ip, &settings).map_err(|e| e.to_string())?;
            Ok(Box::new(v))
        }
        #[cfg(feature = "verbs")]
        "verbs" => {
            use roccl::rdma::select;
            let ports = select::scan(std::path::Path::new(select::SYSFS_ROOT))
                .map_err(|e| e.to_string())?;
            let crit = select::Criteria::from_lookup(&roccl::envvar::from_process)
                .map_err(|e| e.to_string())?;
            let choice = select::choose_each(&ports, &crit).map_err(|e| e.to_string())?;
            let settings = roccl::rdma::ibv::IbSettings::from_lookup(&roccl::envvar::from_process)
                .map_err(|e| e.to_string())?;
            let v = roccl::rdma::ibv::IbvVerbs::open(&choice[0], settings)
                .map_err(|e| e.to_string())?;
            Ok(Box::new(v))
        }
        other => Err(format!(
            "ROCCL_NET={other}: rocev2, or verbs (built with --features verbs)"
        )),
    }
}

fn side() -> Res<Side> {
    let v = open_provider()?;
    let (qp, ep) = v.create_qp().map_err(|e| e.to_string())?;
    let region: &'static mut [u8] = Box::leak(vec![0u8; REGION].into_boxed_slice());
    let local: &'static mut [u8] = Box::leak(vec![0u8; REGION].into_boxed_slice());
    // SAFETY: both buffers are leaked: they live, unmoved, until the process ends.
    let (rmr, lmr) = unsafe {
        (
            v.reg_mr(region.as_mut_ptr() as u64, REGION, Access::ALL),
            v.reg_mr(local.as_mut_ptr() as u64, REGION, Access::ALL),
        )
    };
    Ok(Side {
        qp,
        ep,
        pending: Vec::new(),
        rmr: rmr.map_err(|e| e.to_string())?,
        lmr: lmr.map_err(|e| e.to_string())?,
        v,
        region,
        local,
    })
}

/// The control channel: lines over TCP.
struct Ctl {
    r: BufReader<TcpStream>,
    w: TcpStream,
}

impl Ctl {
    fn say(&mut self, s: &str) -> Res<()> {
        writeln!(self.w, "{s}").map_err(|e| format!("control channel: {e}"))
    }

    fn hear(&mut self) -> Res<String> {
        let mut l = String::new();
        match self.r.read_line(&mut l) {
            Ok(0) | Err(_) => Err("control channel: the peer is gone".into()),
            Ok(_) => Ok(l.trim().to_string()),
        }
    }
}

fn control(rank: usize, root: SocketAddr) -> Res<Ctl> {
    let s = if rank == 0 {
        let l = TcpListener::bind(SocketAddr::new(root.ip(), root.port()))
            .or_else(|_| TcpListener::bind(SocketAddr::from(([0, 0, 0, 0], root.port()))))
            .map_err(|e| format!("listening on {root}: {e}"))?;
        l.accept().map_err(|e| e.to_string())?.0
    } else {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match TcpStream::connect(root) {
                Ok(s) => break s,
                Err(e) if Instant::now() > deadline => return Err(format!("{root}: {e}")),
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    };
    Ok(Ctl {
        r: BufReader::new(s.try_clone().map_err(|e| e.to_string())?),
        w: s,
    })
}

/// Exchange endpoints and regions, connect the QP; the peer's region (address, rkey).
fn connect(s: &Side, c: &mut Ctl) -> Res<(u64, u32)> {
    let ep = s.ep;
    c.say(&format!(
        "{} {} {} {} {} {} {}",
        ep.addr,
        ep.qpn,
        ep.psn,
        ep.mtu,
        u8::from(ep.engine),
        s.rmr.addr,
        s.rmr.rkey
    ))?;
    let line = c.hear()?;
    let f: Vec<&str> = line.split_whitespace().collect();
    let num = |i: usize| -> Res<u64> {
        f.get(i)
            .and_then(|x| x.parse().ok())
            .ok_or(format!("bad endpoint line {line:?}"))
    };
    let peer = QpEndpoint {
        addr: f
            .first()
            .and_then(|a| a.parse().ok())
            .ok_or(format!("bad endpoint line {line:?}"))?,
        qpn: num(1)? as u32,
        psn: num(2)? as u32,
        mtu: num(3)? as u32,
        engine: num(4)? == 1,
    };
    s.v.connect_qp(s.qp, &peer).map_err(|e| e.to_string())?;
    println!(
        "# {} QP {:#x} connected to {} QP {:#x} ({}), path MTU {}",
        s.v.name(),
        ep.qpn,
        peer.addr.ip(),
        peer.qpn,
        if peer.engine {
            "the userspace engine"
        } else {
            "a NIC"
        },
        ep.mtu.min(peer.mtu)
    );
    Ok((num(5)?, num(6)? as u32))
}

/// Wait for the completion of `want` (by wr_id) within 20 s; others are kept for later.
fn wait(s: &mut Side, want: u64) -> Res<Wc> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut wc = [Wc::EMPTY; 8];
    loop {
        if let Some(i) = s.pending.iter().position(|w| w.wr_id == want) {
            return Ok(s.pending.swap_remove(i));
        }
        let n = s.v.poll_cq(s.qp, &mut wc).map_err(|e| e.to_string())?;
        s.pending.extend_from_slice(&wc[..n]);
        if n == 0 && Instant::now() > deadline {
            return Err(format!("no completion of work request {want} within 20 s"));
        }
        if n == 0 {
            std::thread::yield_now();
        }
    }
}

fn post_send(
    s: &Side,
    id: u64,
    op: WrOpcode,
    at: usize,
    len: usize,
    remote: (u64, u32),
    imm: u32,
) -> Res<()> {
    let wr = SendWr {
        wr_id: id,
        opcode: op,
        sge: (len > 0).then_some(Sge {
            addr: s.lmr.addr + at as u64,
            len: len as u32,
            lkey: s.lmr.lkey,
        }),
        inline: false,
        imm,
        remote_addr: remote.0,
        rkey: remote.1,
        signaled: true,
    };
    s.v.post_send(s.qp, &wr).map_err(|e| e.to_string())
}

fn post_recv(s: &Side, id: u64, at: usize, len: usize) -> Res<()> {
    let wr = RecvWr {
        wr_id: id,
        sge: (len > 0).then_some(Sge {
            addr: s.lmr.addr + at as u64,
            len: len as u32,
            lkey: s.lmr.lkey,
        }),
    };
    s.v.post_recv(s.qp, &wr).map_err(|e| e.to_string())
}

/// Check `what`, print it, count it when wrong.
fn check(wrong: &mut usize, what: &str, r: Res<()>) {
    match r {
        Ok(()) => println!("ok: {what}"),
        Err(e) => {
            *wrong += 1;
            println!("WRONG: {what}: {e}");
        }
    }
}

fn requester(s: &mut Side, c: &mut Ctl, remote: (u64, u32), wrong: &mut usize) -> Res<()> {
    // SENDs with immediate: the responder posted its receives and said "ready".
    c.hear()?;
    for (k, &len) in SEND_SIZES.iter().enumerate() {
        s.local[..len].copy_from_slice(&pattern(k, len));
        post_send(
            s,
            100 + k as u64,
            WrOpcode::SendImm,
            0,
            len,
            (0, 0),
            len as u32,
        )?;
        let w = wait(&mut *s, 100 + k as u64)?;
        check(wrong, &format!("SEND {len} B completes"), status(&w));
    }
    c.say("sent")?;
    // RDMA WRITEs with immediate into the responder's region, one after another.
    let mut at = 0;
    for (k, &len) in WRITE_SIZES.iter().enumerate() {
        s.local[..len].copy_from_slice(&pattern(50 + k, len));
        post_send(
            s,
            200 + k as u64,
            WrOpcode::WriteImm,
            0,
            len,
            (remote.0 + at as u64, remote.1),
            k as u32,
        )?;
        let w = wait(&mut *s, 200 + k as u64)?;
        check(
            wrong,
            &format!("RDMA WRITE WITH IMM {len} B completes"),
            status(&w),
        );
        at += len;
    }
    c.say("written")?;
    // RDMA READs of what the responder wrote into its region for us.
    c.hear()?;
    let mut from = 0;
    for (k, &len) in READ_SIZES.iter().enumerate() {
        s.local[..len].fill(0);
        post_send(
            s,
            300 + k as u64,
            WrOpcode::Read,
            0,
            len,
            (remote.0 + from as u64, remote.1),
            0,
        )?;
        let w = wait(&mut *s, 300 + k as u64)?;
        let got = status(&w).and_then(|()| same(&s.local[..len], &pattern(80 + k, len)));
        check(
            wrong,
            &format!("RDMA READ {len} B returns the peer's bytes"),
            got,
        );
        from += len;
    }
    // A SEND before the responder posts its receive: RNR NAKs, then it lands.
    c.say("rnr")?;
    let rnr_before = counter(s, "rnr_naks_received");
    s.local[..100].copy_from_slice(&pattern(99, 100));
    post_send(s, 400, WrOpcode::SendImm, 0, 100, (0, 0), 99)?;
    let w = wait(&mut *s, 400)?;
    let what = "a SEND that met no receive completes after RNR retries";
    check(wrong, what, status(&w));
    // The engine counts the RNR NAKs it receives (a NIC's provider does not say).
    if let (Some(a), Some(b)) = (rnr_before, counter(s, "rnr_naks_received")) {
        let seen = expect(b > a, "no RNR NAK came: RNR was not exercised".into());
        check(
            wrong,
            &format!("the responder sent RNR NAKs ({})", b - a),
            seen,
        );
    }
    c.hear()?;
    Ok(())
}

fn responder(s: &mut Side, c: &mut Ctl, wrong: &mut usize) -> Res<()> {
    let mut slot = 0;
    for (k, &len) in SEND_SIZES.iter().enumerate() {
        post_recv(s, 500 + k as u64, slot, len)?;
        slot += len;
    }
    c.say("ready")?;
    let mut slot = 0;
    for (k, &len) in SEND_SIZES.iter().enumerate() {
        let w = wait(&mut *s, 500 + k as u64)?;
        let got = status(&w)
            .and_then(|()| expect(w.byte_len as usize == len, format!("{} bytes", w.byte_len)))
            .and_then(|()| expect(w.imm == Some(len as u32), format!("immediate {:?}", w.imm)))
            .and_then(|()| same(&s.local[slot..slot + len], &pattern(k, len)));
        check(
            wrong,
            &format!("SEND {len} B received whole, with its immediate"),
            got,
        );
        slot += len;
    }
    c.hear()?;
    for k in 0..WRITE_SIZES.len() {
        post_recv(s, 600 + k as u64, 0, 0)?;
    }
    c.hear()?;
    let mut at = 0;
    for (k, &len) in WRITE_SIZES.iter().enumerate() {
        let w = wait(&mut *s, 600 + k as u64)?;
        let got = status(&w)
            .and_then(|()| expect(w.imm == Some(k as u32), format!("immediate {:?}", w.imm)))
            .and_then(|()| same(&s.region[at..at + len], &pattern(50 + k, len)));
        check(
            wrong,
            &format!("RDMA WRITE WITH IMM {len} B lands, with its immediate"),
            got,
        );
        at += len;
    }
    let mut from = 0;
    for (k, &len) in READ_SIZES.iter().enumerate() {
        s.region[from..from + len].copy_from_slice(&pattern(80 + k, len));
        from += len;
    }
    c.say("readable")?;
    c.hear()?;
    std::thread::sleep(Duration::from_millis(200));
    post_recv(s, 700, 0, 100)?;
    let w = wait(&mut *s, 700)?;
    let got = status(&w).and_then(|()| same(&s.local[..100], &pattern(99, 100)));
    check(
        wrong,
        "the SEND that met no receive lands once one is posted",
        got,
    );
    c.say("done")?;
    Ok(())
}

/// The provider's counter `name`, if it keeps one.
fn counter(s: &Side, name: &str) -> Option<u64> {
    let mut out = Vec::new();
    s.v.counters(&mut out);
    out.iter().find(|(k, _)| *k == name).map(|&(_, v)| v)
}

fn status(w: &Wc) -> Res<()> {
    expect(
        w.status == WcStatus::Success,
        format!("completion {:?}", w.status),
    )
}

fn expect(ok: bool, what: String) -> Res<()> {
    if ok {
        Ok(())
    } else {
        Err(what)
    }
}

fn same(got: &[u8], want: &[u8]) -> Res<()> {
    match got.iter().zip(want).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(i) => Err(format!("byte {i} of {} differs", want.len())),
    }
}

fn run() -> Res<usize> {
    let rank: usize = env("ROCCL_RANK")?
        .parse()
        .map_err(|_| "ROCCL_RANK: 0 or 1")?;
    let root: SocketAddr = env("ROCCL_ROOT")?
        .parse()
        .map_err(|e| format!("ROCCL_ROOT: host:port: {e}"))?;
    let mut s = side()?;
    let mut c = control(rank, root)?;
    let remote = connect(&s, &mut c)?;
    let mut wrong = 0;
    for turn in 0..2 {
        if turn == rank {
            println!("# requester");
            requester(&mut s, &mut c, remote, &mut wrong)?;
        } else {
            println!("# responder");
            responder(&mut s, &mut c, &mut wrong)?;
        }
    }
    Ok(wrong)
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(wrong) => {
            println!("# wrong results: {wrong}");
            if wrong == 0 {
                std::process::ExitCode::SUCCESS
            } else {
                std::process::ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("rdma_pair: error: {e}");
            std::process::ExitCode::from(2)
        }
    }
}
