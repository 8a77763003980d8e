//! Tests of the RoCE v2 network through its `Net` trait: connections over the userspace
//! engine and over wrapped providers, eager and rendezvous messages, GPU memory, flushes.

use super::eager::{EagerCfg, EAGER_DEFAULT};
use super::flush::FLUSH_READS;
use super::recv::written;
use super::setup::{
    conn_key, decode_info, encode_info, handle_with_port, pick_device_among, reply_tag, INFO, TAG,
};
use super::*;
use crate::net::{PollFd, RecvBuf, RecvComm, RecvGroup, ReqId, SendComm};
use crate::rdma::verbs::{Mr, QpEndpoint, QpId, RecvWr, SendWr, Sge, WrOpcode, PROVIDER_WR_ID_BIT};
use std::collections::VecDeque;
use std::net::{Ipv4Addr, TcpListener};
use std::time::Duration;

fn pair(net: &RoceNet) -> (Box<dyn SendComm>, Box<dyn RecvComm>) {
    crate::net::connect_pair(net)
}

/// Post the receive `rb` and a send of `len` bytes at `src` (registered as `mh`, if
/// given), and drive both to completion; the size received.
///
/// # Safety
/// `src` is readable for `len` bytes and `rb`'s buffer writable until this returns.
unsafe fn transfer(
    s: &mut dyn SendComm,
    r: &mut dyn RecvComm,
    src: *const u8,
    len: usize,
    tag: u32,
    mh: Option<&MemHandle>,
    rb: &RecvBuf,
) -> Result<usize> {
    // SAFETY: the caller's contract; both requests complete before this returns.
    let (rq, sq) = unsafe {
        let rq = r.irecv(std::slice::from_ref(rb))?.unwrap();
        (rq, s.isend(src, len, tag, mh)?.unwrap())
    };
    let (mut sd, mut rd, mut size) = (false, false, [0usize]);
    let t0 = std::time::Instant::now();
    while !(sd && rd) {
        assert!(t0.elapsed().as_secs() < 10, "exchange stalled");
        sd = sd || s.test(sq)?.is_some();
        rd = rd || r.test(rq, &mut size)?;
    }
    Ok(size[0])
}

fn exchange(
    s: &mut dyn SendComm,
    r: &mut dyn RecvComm,
    data: &[u8],
    cap: usize,
    tag: u32,
) -> Result<(Vec<u8>, usize)> {
    let mut buf = vec![0u8; cap];
    let rb = RecvBuf {
        ptr: buf.as_mut_ptr(),
        len: cap,
        tag: 1,
    };
    // SAFETY: `buf` and `data` outlive the call.
    let n = unsafe { transfer(s, r, data.as_ptr(), data.len(), tag, None, &rb)? };
    Ok((buf, n))
}

/// An eager send is done for the caller once posted; a send comm
/// destroyed right after must still deliver it, here through a link that loses
/// everything until after the destroy began.
#[test]
fn an_eager_send_survives_the_destroy_that_follows_it() {
    use crate::rdma::udp::Faults;
    let lo = Ipv4Addr::LOCALHOST.into();
    let verbs = Arc::new(UserVerbs::with(lo, 0, None).unwrap());
    let net = RoceNet::over(verbs.clone(), lo);
    let (mut s, mut r) = pair(&net);
    // Eager (at most 16 KiB) and not inline (over 256 B): sent from the comm's staging.
    let data = vec![7u8; 1000];
    let mut buf = vec![0u8; 1000];
    let rb = RecvBuf {
        ptr: buf.as_mut_ptr(),
        len: buf.len(),
        tag: 1,
    };
    // SAFETY: `buf` outlives the receive (tested to completion below).
    let rq = unsafe { r.irecv(std::slice::from_ref(&rb)) }
        .unwrap()
        .unwrap();
    verbs.set_faults(Some(Faults {
        drop: 1.0,
        seed: 1,
        ..Faults::default()
    }));
    // SAFETY: `data` outlives the send.
    let sq = unsafe { s.isend(data.as_ptr(), data.len(), 1, None) }
        .unwrap()
        .unwrap();
    assert!(
        s.test(sq).unwrap().is_some(),
        "an eager send is done at once"
    );
    let healer = {
        let v = verbs.clone();
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(100));
            v.set_faults(None);
        })
    };
    drop(s);
    healer.join().unwrap();
    let mut size = [0usize];
    let t0 = std::time::Instant::now();
    loop {
        match r.test(rq, &mut size) {
            Ok(true) => break,
            Ok(false) => {}
            Err(e) => panic!("the message sent before the destroy was lost: {e}"),
        }
        assert!(
            t0.elapsed().as_secs() < 10,
            "the message sent before the destroy never arrived"
        );
    }
    assert_eq!((size[0], &buf), (1000, &data));
}

#[test]
fn messages_of_every_size() {
    let net = RoceNet::over(
        Arc::new(UserVerbs::with(Ipv4Addr::LOCALHOST.into(), 0, None).unwrap()),
        Ipv4Addr::LOCALHOST.into(),
    );
    let (mut s, mut r) = pair(&net);
    for len in [0usize, 1, 4, 4095, 4096, 4097, 100_000, 1 << 20] {
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + len) as u8).collect();
        let (buf, got) = exchange(&mut *s, &mut *r, &data, len + 3, 1)
            .unwrap_or_else(|e| panic!("{len} bytes: {e}"));
        assert_eq!(got, len);
        assert_eq!(&buf[..len], &data[..]);
    }
    // A grouped receive: three buffers matched by tag, sent in another order.
    let (a, b, c) = (vec![1u8; 10], vec![2u8; 70_000], vec![3u8; 0]);
    let (mut ba, mut bb, mut bc) = (vec![0u8; 10], vec![0u8; 70_000], vec![9u8; 4]);
    let group = [
        RecvBuf {
            ptr: bc.as_mut_ptr(),
            len: 4,
            tag: 30,
        },
        RecvBuf {
            ptr: ba.as_mut_ptr(),
            len: 10,
            tag: 10,
        },
        RecvBuf {
            ptr: bb.as_mut_ptr(),
            len: 70_000,
            tag: 20,
        },
    ];
    // SAFETY: every buffer outlives the loop below, which completes all requests.
    let (rq, sq) = unsafe {
        let rq = r.irecv(&group).unwrap().unwrap();
        let sq = [
            s.isend(b.as_ptr(), b.len(), 20, None).unwrap().unwrap(),
            s.isend(c.as_ptr(), 0, 30, None).unwrap().unwrap(),
            s.isend(a.as_ptr(), a.len(), 10, None).unwrap().unwrap(),
        ];
        (rq, sq)
    };
    let mut sizes = [0usize; 3];
    let mut done = [false; 3];
    while !done.iter().all(|d| *d) || !r.test(rq, &mut sizes).unwrap() {
        for (d, q) in done.iter_mut().zip(sq) {
            *d = *d || s.test(q).unwrap().is_some();
        }
    }
    assert_eq!(sizes, [0, 10, 70_000]);
    assert_eq!((ba, bb, bc), (a, b, vec![9u8; 4]));
    // Larger than the posted buffer, or an unknown tag: errors, not corruption.
    let e = exchange(&mut *s, &mut *r, &[1u8; 100], 10, 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("holds only 10"), "{e}");
}

/// Hundreds of messages, eager and rendezvous mixed, up to FIFO in flight, with the
/// receiver posting its receives late (eager messages wait in bounce buffers, and their
/// clear-to-send slots are reused before the sender reads them): every byte arrives in
/// order and nothing stalls.
#[test]
fn eager_and_rendezvous_mixed_with_a_late_receiver() {
    let net =
        RoceNet::userspace(IpAddr::V4(Ipv4Addr::LOCALHOST), &RoceSettings::default()).unwrap();
    let (mut s, mut r) = pair(&net);
    let sizes: Vec<usize> = (0..400)
        .map(|i| match i % 7 {
            0 => 0,
            1 => 8,
            2 => 4096,
            3 => 4097,
            4 => 300,
            5 => 70_000,
            _ => 1 + (i * 37) % 9000,
        })
        .collect();
    let data: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| (0..n).map(|k| (i * 131 + k * 7) as u8).collect())
        .collect();
    let mut bufs: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n]).collect();
    let (mut next_s, mut next_r) = (0usize, 0usize);
    let mut sq: VecDeque<(usize, ReqId)> = VecDeque::new();
    let mut rq: VecDeque<(usize, ReqId)> = VecDeque::new();
    let mut done = 0usize;
    let start = std::time::Instant::now();
    while done < sizes.len() || !sq.is_empty() {
        assert!(
            start.elapsed().as_secs() < 60,
            "stalled: sent {next_s}, received {done}"
        );
        // The sender runs ahead; the receiver posts only while it lags by 40+ messages,
        // the sender is blocked, or at the end, so eager messages arrive before their
        // receives.
        while next_s < sizes.len() && sq.len() < FIFO {
            // SAFETY: `data` outlives every request.
            match unsafe { s.isend(data[next_s].as_ptr(), sizes[next_s], 5, None) }.unwrap() {
                Some(q) => {
                    sq.push_back((next_s, q));
                    next_s += 1;
                }
                None => break,
            }
        }
        while let Some(&(_, q)) = sq.front() {
            if s.test(q).unwrap().is_none() {
                break;
            }
            sq.pop_front();
        }
        let blocked = sq.len() >= FIFO;
        let lagging = next_s >= next_r + 40 || next_s == sizes.len() || blocked;
        while lagging && next_r < sizes.len() && rq.len() < FIFO {
            let b = RecvBuf {
                ptr: bufs[next_r].as_mut_ptr(),
                len: sizes[next_r],
                tag: 5,
            };
            // SAFETY: `bufs` outlives every request and is not touched until it completes.
            match unsafe { r.irecv(&[b]) }.unwrap() {
                Some(q) => {
                    rq.push_back((next_r, q));
                    next_r += 1;
                }
                None => break,
            }
        }
        while let Some(&(i, q)) = rq.front() {
            let mut got = [0usize];
            if !r.test(q, &mut got).unwrap() {
                break;
            }
            assert_eq!(got[0], sizes[i], "message {i}");
            rq.pop_front();
            done += 1;
        }
    }
    for (i, (b, d)) in bufs.iter().zip(&data).enumerate() {
        assert!(b == d, "message {i} ({} bytes) arrived corrupted", d.len());
    }
}

/// What a peer says about sizes is checked, never trusted: an immediate's size beyond
/// the posted buffer or its index beyond the group, and a message of exactly 2^29 bytes
/// (whose size would spill into a grouped immediate's index bits).
#[test]
fn peer_supplied_sizes_are_bounds_checked() {
    let peer = SocketAddr::from(([10, 0, 0, 2], 4791));
    let (mut a, mut b) = ([0u8; 100], [0u8; 200]);
    let one = RecvGroup::new(&[RecvBuf {
        ptr: a.as_mut_ptr(),
        len: 100,
        tag: 1,
    }])
    .unwrap();
    assert_eq!(written(&one, 100, peer).unwrap(), (0, 100));
    let e = written(&one, 101, peer).unwrap_err().to_string();
    assert!(
        e.contains("101 bytes") && e.contains("holds only 100") && e.contains("10.0.0.2"),
        "{e}"
    );
    let two = RecvGroup::new(&[
        RecvBuf {
            ptr: a.as_mut_ptr(),
            len: 100,
            tag: 1,
        },
        RecvBuf {
            ptr: b.as_mut_ptr(),
            len: 200,
            tag: 2,
        },
    ])
    .unwrap();
    assert_eq!(written(&two, (1 << 29) | 200, peer).unwrap(), (1, 200));
    let e = written(&two, (1 << 29) | 201, peer)
        .unwrap_err()
        .to_string();
    assert!(e.contains("holds only 200"), "{e}");
    let e = written(&two, (2 << 29) | 5, peer).unwrap_err().to_string();
    assert!(e.contains("buffer 2 of a receive of 2"), "{e}");

    let net =
        RoceNet::userspace(IpAddr::V4(Ipv4Addr::LOCALHOST), &RoceSettings::default()).unwrap();
    let (mut s, _r) = pair(&net);
    // Zero pages until touched; nothing touches them (the send is refused).
    let big = vec![0u8; 1 << 29];
    // SAFETY: `big` outlives the comm's use of it (the send is refused at once).
    let e = unsafe { s.isend(big.as_ptr(), big.len(), 1, None) };
    let e = e
        .expect_err("a 2^29-byte message must be refused")
        .to_string();
    assert!(e.contains("512 MiB less one byte"), "{e}");
}

/// A peer whose setup message claims 2^32 - 1 receive buffers (the sender would allocate
/// its staging for that many) is refused with an error naming it, not an allocation
/// failure.
#[test]
fn a_peer_claiming_absurd_receive_buffers_is_refused() {
    use std::io::{Read, Write};
    let net =
        RoceNet::userspace(IpAddr::V4(Ipv4Addr::LOCALHOST), &RoceSettings::default()).unwrap();
    let fake = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = fake.local_addr().unwrap().port();
    let (h, _l) = net.listen(0).unwrap();
    let mut c = net.connect(0, &handle_with_port(&h, port)).unwrap();
    let key = conn_key(&net, &h);
    let peer = std::thread::spawn(move || {
        let (mut s, _) = fake.accept().unwrap();
        let mut req = [0u8; INFO + TAG];
        s.read_exact(&mut req).unwrap();
        // Answer with the connector's own endpoint (a QP connected to itself), as a peer of
        // the job would (it knows the key).
        let mut info = decode_info(req[..INFO].try_into().unwrap()).unwrap();
        info.eager = EagerCfg {
            size: EAGER_DEFAULT,
            slots: u32::MAX,
        };
        let answer = encode_info(&info);
        s.write_all(&answer).unwrap();
        s.write_all(&reply_tag(&key, &answer, &req[INFO..]))
            .unwrap();
        s
    });
    let start = std::time::Instant::now();
    let e = loop {
        assert!(start.elapsed().as_secs() < 10, "no answer within 10 s");
        match c.poll() {
            Err(e) => break e.to_string(),
            Ok(Some(_)) => panic!("connected to a peer claiming 2^32 - 1 receive buffers"),
            Ok(None) => std::thread::sleep(std::time::Duration::from_millis(1)),
        }
    };
    assert!(
        e.contains("4294967295 receive buffers") && e.contains("127.0.0.1"),
        "{e}"
    );
    drop(peer.join().unwrap());
}

/// A NIC and the userspace engine speak one protocol and may meet, but a NIC sends RoCE v2
/// only to UDP port 4791: an engine elsewhere (here an ephemeral port) is refused at setup by
/// both ends, naming the port and the fix. (They meet on 4791 in `tests/rxe`, against rxe.)
#[test]
fn a_nic_meets_the_userspace_engine_only_on_port_4791() {
    let lo: IpAddr = Ipv4Addr::LOCALHOST.into();
    let user = RoceNet::over(Arc::new(UserVerbs::with(lo, 0, None).unwrap()), lo);
    let nic = RoceNet::over(Arc::new(Wrapped::new(lo, true)), lo);
    assert_eq!((user.name(), nic.name()), ("rocev2", "verbs"));
    for nic_connects in [true, false] {
        let (from, to) = if nic_connects {
            (&nic, &user)
        } else {
            (&user, &nic)
        };
        let (h, mut l) = to.listen(0).unwrap();
        let mut c = from.connect(0, &h).unwrap();
        let start = std::time::Instant::now();
        let err = loop {
            assert!(start.elapsed().as_secs() < 10, "no error within 10 s");
            match c.poll() {
                Err(e) => break e.to_string(),
                Ok(Some(_)) => panic!("a NIC connected to an engine off port 4791"),
                Ok(None) => {}
            }
            if let Err(e) = l.accept() {
                break e.to_string();
            }
        };
        assert!(
            err.contains("4791") && err.contains("ROCCL_ROCEV2_PORT") && err.contains("NIC"),
            "{err}"
        );
    }
}

/// Grouped receives (up to 8 buffers, tags matched in shuffled send order), eager and
/// rendezvous sizes mixed in one group, sender and receiver on their own threads with up
/// to FIFO requests each: the NCCL proxy's pattern.
#[test]
fn grouped_receives_with_mixed_sizes_from_two_threads() {
    let net =
        RoceNet::userspace(IpAddr::V4(Ipv4Addr::LOCALHOST), &RoceSettings::default()).unwrap();
    grouped_mixed_sizes(&net, 150);
}

/// `groups` receives of 1 to 8 buffers of random sizes (empty, eager, just above the eager
/// size, rendezvous up to 300 kB) and tags, their buffers sent in random order from another
/// thread, up to [`FIFO`] in flight: every buffer gets its size and its data.
fn grouped_mixed_sizes(net: &RoceNet, groups: usize) {
    let (mut s, mut r) = pair(net);
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    // Per group: (size, tag) of each buffer, and the order the sender sends them in.
    type Group = (Vec<(usize, u32)>, Vec<usize>);
    let mut plan: Vec<Group> = Vec::new();
    for _ in 0..groups {
        let n = if next() % 3 == 0 {
            1 + (next() % 8) as usize
        } else {
            1
        };
        let bufs: Vec<(usize, u32)> = (0..n)
            .map(|i| {
                let size = match next() % 10 {
                    0 => 0,
                    1..=5 => (next() % 4097) as usize,
                    6..=7 => 16_000 + (next() % 800) as usize,
                    _ => (next() % 300_000) as usize,
                };
                (size, 100 + i as u32)
            })
            .collect();
        let mut order: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            order.swap(i, (next() % (i as u64 + 1)) as usize);
        }
        plan.push((bufs, order));
    }
    let groups = plan;
    let fill = |g: usize, b: usize, i: usize| (g * 31 + b * 7 + i * 13) as u8;
    let sent: Vec<Vec<Vec<u8>>> = groups
        .iter()
        .enumerate()
        .map(|(g, (bufs, _))| {
            bufs.iter()
                .enumerate()
                .map(|(b, &(n, _))| (0..n).map(|i| fill(g, b, i)).collect())
                .collect()
        })
        .collect();
    let plan = groups.clone();
    let data = sent.clone();
    let sender = std::thread::spawn(move || {
        let mut q: VecDeque<ReqId> = VecDeque::new();
        let start = std::time::Instant::now();
        for (g, (bufs, order)) in plan.iter().enumerate() {
            for &b in order {
                loop {
                    assert!(
                        start.elapsed().as_secs() < 60,
                        "sender stalled at group {g}"
                    );
                    // SAFETY: `data` outlives every request (joined below).
                    let d = &data[g][b];
                    if let Some(id) =
                        unsafe { s.isend(d.as_ptr(), d.len(), bufs[b].1, None) }.unwrap()
                    {
                        q.push_back(id);
                        break;
                    }
                    while let Some(&f) = q.front() {
                        if s.test(f).unwrap().is_none() {
                            break;
                        }
                        q.pop_front();
                    }
                }
            }
        }
        while let Some(f) = q.pop_front() {
            while s.test(f).unwrap().is_none() {
                assert!(start.elapsed().as_secs() < 60, "sender stalled at the end");
            }
        }
        s
    });
    let mut bufs: Vec<Vec<Vec<u8>>> = groups
        .iter()
        .map(|(b, _)| b.iter().map(|&(n, _)| vec![0xEEu8; n + 16]).collect())
        .collect();
    let mut q: VecDeque<(usize, ReqId)> = VecDeque::new();
    let mut g = 0;
    let start = std::time::Instant::now();
    while g < groups.len() || !q.is_empty() {
        assert!(
            start.elapsed().as_secs() < 60,
            "receiver stalled: posted {g}, waiting {}",
            q.len()
        );
        if g < groups.len() && q.len() < FIFO {
            let rb: Vec<RecvBuf> = bufs[g]
                .iter_mut()
                .zip(&groups[g].0)
                .map(|(b, &(_, tag))| RecvBuf {
                    ptr: b.as_mut_ptr(),
                    len: b.len(),
                    tag,
                })
                .collect();
            // SAFETY: `bufs` outlives the requests and is read only after completion.
            if let Some(id) = unsafe { r.irecv(&rb) }.unwrap() {
                q.push_back((g, id));
                g += 1;
            }
        }
        if let Some(&(k, id)) = q.front() {
            let mut sizes = [0usize; MAX_RECVS];
            if r.test(id, &mut sizes[..groups[k].0.len()]).unwrap() {
                for (b, &(n, _)) in groups[k].0.iter().enumerate() {
                    assert_eq!(sizes[b], n, "group {k} buffer {b}");
                    assert!(
                        bufs[k][b][..n] == sent[k][b][..],
                        "group {k} buffer {b} data"
                    );
                }
                q.pop_front();
            }
        }
    }
    drop(sender.join().unwrap());
}

/// The userspace engine, posing as a NIC when `nic` is set (to check that both ends
/// must agree), recording every send work request (opcode, inline, local address,
/// remote address, queue pair); with `Some(n)` in the fourth field every queue pair is granted `n`
/// bytes of inline data, as a NIC may grant less than its provider asked for. The last
/// field but one counts reads of registered memory, each one lock of the userspace engine:
/// [`Reads`]. With `Some(limit)` in the last field its completions are the NIC provider's:
/// successful ones whose id has [`PROVIDER_WR_ID_BIT`] are hidden (its own signals), and a
/// close drains for at most `limit`. Like a NIC, it never says sends were acknowledged.
struct Wrapped(
    UserVerbs,
    parking_lot::Mutex<Vec<Posted>>,
    bool,
    Option<usize>,
    Reads,
    Option<Duration>,
);

/// A send work request [`Wrapped`] saw: opcode, inline, local address, remote address,
/// queue pair, remote key.
type Posted = (WrOpcode, bool, u64, u64, QpId, u32);

/// Calls of `read_registered` and of `read_registered_in_order`, and the pieces the
/// latter copied.
#[derive(Default)]
struct Reads {
    single: std::sync::atomic::AtomicUsize,
    in_order: std::sync::atomic::AtomicUsize,
    pieces: std::sync::atomic::AtomicUsize,
}

impl Wrapped {
    fn new(ip: IpAddr, nic: bool) -> Wrapped {
        Wrapped(
            UserVerbs::with(ip, 0, None).unwrap(),
            parking_lot::Mutex::new(Vec::new()),
            nic,
            None,
            Reads::default(),
            None,
        )
    }
}

impl Verbs for Wrapped {
    fn name(&self) -> String {
        self.0.name()
    }
    fn dmabuf_supported(&self) -> bool {
        self.0.dmabuf_supported()
    }
    unsafe fn reg_dmabuf(
        &self,
        fd: i32,
        offset: u64,
        len: usize,
        iova: u64,
        access: Access,
    ) -> Result<Mr> {
        // SAFETY: forwarded contract.
        unsafe { self.0.reg_dmabuf(fd, offset, len, iova, access) }
    }
    fn hardware(&self) -> bool {
        self.2
    }
    fn max_inline(&self) -> usize {
        self.0.max_inline()
    }
    fn qp_max_inline(&self, qp: QpId) -> usize {
        self.3.unwrap_or_else(|| self.0.qp_max_inline(qp))
    }
    unsafe fn reg_mr(&self, addr: u64, len: usize, access: Access) -> Result<Mr> {
        // SAFETY: forwarded contract.
        unsafe { self.0.reg_mr(addr, len, access) }
    }
    fn dereg_mr(&self, mr: &Mr) -> Result<()> {
        self.0.dereg_mr(mr)
    }
    fn rekey_mr(&self, mr: &Mr, access: Access) -> Result<Mr> {
        self.0.rekey_mr(mr, access)
    }
    fn create_qp(&self) -> Result<(QpId, QpEndpoint)> {
        self.0.create_qp()
    }
    fn connect_qp(&self, qp: QpId, remote: &QpEndpoint) -> Result<()> {
        self.0.connect_qp(qp, remote)
    }
    fn destroy_qp(&self, qp: QpId) {
        self.0.destroy_qp(qp)
    }
    fn post_send(&self, qp: QpId, wr: &SendWr) -> Result<()> {
        let local = wr.sge.map_or(0, |g| g.addr);
        self.1
            .lock()
            .push((wr.opcode, wr.inline, local, wr.remote_addr, qp, wr.rkey));
        self.0.post_send(qp, wr)
    }
    fn post_recv(&self, qp: QpId, wr: &RecvWr) -> Result<()> {
        self.0.post_recv(qp, wr)
    }
    fn poll_cq(&self, qp: QpId, out: &mut [Wc]) -> Result<usize> {
        let n = self.0.poll_cq(qp, out)?;
        if self.5.is_none() {
            return Ok(n);
        }
        let mut k = 0;
        for i in 0..n {
            let w = out[i];
            if w.wr_id & PROVIDER_WR_ID_BIT != 0 && w.status == WcStatus::Success {
                continue;
            }
            out[k] = Wc {
                wr_id: w.wr_id & !PROVIDER_WR_ID_BIT,
                ..w
            };
            k += 1;
        }
        Ok(k)
    }
    // `sends_acknowledged`: the trait's `false`, as a NIC (a close always drains).
    fn drain_limit(&self) -> Duration {
        self.5.unwrap_or_else(crate::envvar::timeout)
    }
    fn poll_fds(&self, out: &mut Vec<PollFd>) {
        self.0.poll_fds(out)
    }
    fn qp_state(&self, qp: QpId) -> Result<crate::rdma::verbs::QpState> {
        self.0.qp_state(qp)
    }
    unsafe fn read_registered(&self, addr: u64, out: &mut [u8]) {
        self.4.single.fetch_add(1, Ordering::Relaxed);
        // SAFETY: this function's contract, passed on to the provider it wraps.
        unsafe { self.0.read_registered(addr, out) }
    }
    unsafe fn read_registered_in_order(&self, pieces: &mut [(u64, &mut [u8])]) {
        self.4.in_order.fetch_add(1, Ordering::Relaxed);
        self.4.pieces.fetch_add(pieces.len(), Ordering::Relaxed);
        // SAFETY: this function's contract, passed on to the provider it wraps.
        unsafe { self.0.read_registered_in_order(pieces) }
    }
}

/// On a NIC: a closing send comm drains once, through its own marker (a
/// signaled zero-length RDMA WRITE), and returns when that marker completes — not at the
/// drain limit because the provider took the marker's completion for one of its own
/// signals and hid it (a marker of `u64::MAX` has the provider's bit: 3 s, the limit here).
/// The NIC provider's `destroy_qp` drains no more (it cannot run here: no RDMA device).
#[test]
fn a_closing_send_comm_drains_once_and_sees_its_marker_on_a_nic() {
    let lo: IpAddr = Ipv4Addr::LOCALHOST.into();
    let mut w = Wrapped::new(lo, false);
    w.5 = Some(Duration::from_secs(3));
    let rec = Arc::new(w);
    let net = RoceNet::over(rec.clone(), lo);
    let (mut s, mut r) = pair(&net);
    for len in [100usize, 100_000] {
        let data = vec![5u8; len];
        let (buf, got) = exchange(&mut *s, &mut *r, &data, len, 1).unwrap();
        assert_eq!((got, &buf[..len]), (len, &data[..]));
    }
    rec.1.lock().clear();
    let t = std::time::Instant::now();
    drop(s);
    let took = t.elapsed();
    let markers = rec
        .1
        .lock()
        .iter()
        .filter(|w| (w.0, w.2, w.3) == (WrOpcode::Write, 0, 0))
        .count();
    assert_eq!(markers, 1, "drain markers posted by one close");
    assert!(
        took < Duration::from_secs(1),
        "the close took {took:?}: its drain marker's completion never came back"
    );
    drop(r);
}

/// The sender's seqlock read of a clear-to-send entry (end marker, body, start
/// marker) is one call of the provider, one lock of the userspace engine, not one per
/// piece; and the entries read so are right (rendezvous messages land whole).
#[test]
fn a_clear_to_send_entry_is_read_under_one_lock() {
    let lo: IpAddr = Ipv4Addr::LOCALHOST.into();
    let rec = Arc::new(Wrapped::new(lo, false));
    let net = RoceNet::over(rec.clone(), lo);
    let (mut s, mut r) = pair(&net);
    for len in [20_000usize, 100_000, 1 << 20] {
        let data: Vec<u8> = (0..len).map(|i| (i * 13 + len) as u8).collect();
        let (buf, got) = exchange(&mut *s, &mut *r, &data, len, 1).unwrap();
        assert_eq!((got, &buf[..len]), (len, &data[..]));
    }
    let (single, in_order, pieces) = (
        rec.4.single.load(Ordering::Relaxed),
        rec.4.in_order.load(Ordering::Relaxed),
        rec.4.pieces.load(Ordering::Relaxed),
    );
    assert_eq!(
        single, 0,
        "clear-to-send entries read piece by piece: {single} provider calls, one lock each"
    );
    assert!(in_order > 0, "no clear-to-send entry was read");
    assert_eq!(
        pieces,
        3 * in_order,
        "each read: end marker, body, start marker"
    );
}

/// Inline data is what each queue pair was granted, not one value for the provider: on
/// queue pairs granted none, no send (eager message, clear-to-send entry, small
/// rendezvous write) asks for inline, although the provider as a whole offers some.
#[test]
fn inline_sends_follow_the_queue_pairs_grant() {
    let lo: IpAddr = Ipv4Addr::LOCALHOST.into();
    let mut w = Wrapped::new(lo, false);
    w.3 = Some(0);
    assert!(w.max_inline() >= 64, "the provider offers inline data");
    let rec = Arc::new(w);
    let net = RoceNet::over(rec.clone(), lo);
    let (mut s, mut r) = pair(&net);
    for len in [8usize, 100, 20_000] {
        let data = vec![3u8; len];
        let (got, n) = exchange(&mut *s, &mut *r, &data, len, 1).unwrap();
        assert_eq!((n, got), (len, data));
    }
    let log = rec.1.lock().clone();
    assert!(log.len() >= 4, "{log:?}");
    assert!(
        log.iter().all(|w| !w.1),
        "inline on a queue pair granted none: {log:?}"
    );
}

/// Memory registered as GPU memory (`regMr` with `NCCL_PTR_CUDA`; the userspace engine
/// takes host memory for it): once the network expects GPU buffers, a small message
/// moves by RDMA write straight from the registered send buffer into the registered
/// receive buffer — no eager bounce buffer, no inline copy — and a flush reads the
/// received buffer back through a loopback QP. Without it, the same message goes eagerly.
#[test]
fn gpu_memory_moves_without_cpu_copies_and_is_flushed() {
    let lo: IpAddr = Ipv4Addr::LOCALHOST.into();
    for device in [true, false] {
        let rec = Arc::new(Wrapped::new(lo, false));
        let net = RoceNet::over(rec.clone(), lo);
        if device {
            net.expect_device_buffers();
        }
        let (mut s, mut r) = pair(&net);
        let data: Vec<u8> = (0..64u8).map(|i| i ^ 0x5a).collect();
        let mut buf = vec![0u8; 256];
        let (sa, ra) = (data.as_ptr() as usize, buf.as_mut_ptr() as usize);
        // SAFETY: `data` and `buf` stay allocated until both registrations are released
        // at the end of the iteration.
        let (sm, rm) = unsafe {
            if device {
                (
                    s.reg_mr_device(sa, data.len(), None).unwrap(),
                    r.reg_mr_device(ra, buf.len(), None).unwrap(),
                )
            } else {
                (
                    s.reg_mr(sa, data.len()).unwrap(),
                    r.reg_mr(ra, buf.len()).unwrap(),
                )
            }
        };
        let rb = [RecvBuf {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
            tag: 7,
        }];
        // SAFETY: `buf` and `data` outlive the call.
        let size = unsafe {
            transfer(
                &mut *s,
                &mut *r,
                data.as_ptr(),
                data.len(),
                7,
                Some(&sm),
                &rb[0],
            )
        }
        .unwrap();
        assert_eq!((size, &buf[..64]), (64, &data[..]));
        r.flush(&rb, crate::envvar::timeout()).unwrap();
        let log = rec.1.lock().clone();
        let data_wr = log.iter().find(|w| w.2 == sa as u64);
        if device {
            let w = data_wr.expect("the message was sent from the registered buffer");
            assert_eq!(
                (w.0, w.1, w.3),
                (WrOpcode::WriteImm, false, ra as u64),
                "{log:?}"
            );
            assert!(!log.iter().any(|w| w.0 == WrOpcode::SendImm), "{log:?}");
            let read = log
                .iter()
                .find(|w| w.0 == WrOpcode::Read)
                .expect("the flush read the received buffer");
            assert_eq!(read.3, ra as u64);
            let mut got = [0u8];
            // SAFETY: the flush read's local buffer is the receive comm's scratch,
            // registered with `rec` until `r` is dropped (below).
            unsafe { rec.read_registered(read.2, &mut got) };
            assert_eq!(got[0], buf[0], "the flush read the buffer's first byte");
        } else {
            assert!(data_wr.is_none(), "{log:?}");
            assert!(log.iter().any(|w| w.0 == WrOpcode::SendImm), "{log:?}");
            assert!(!log.iter().any(|w| w.0 == WrOpcode::Read), "{log:?}");
        }
        s.dereg_mr(sm).unwrap();
        let again = MemHandle { ..rm };
        r.dereg_mr(rm).unwrap();
        assert!(
            r.dereg_mr(again).is_err(),
            "a second deregistration is refused"
        );
    }
}

/// An explicitly registered receive buffer (`regMr`) is reachable from
/// the network only while a receive uses it. After the receive completed, a peer that
/// kept the key it was sent writes into the buffer with it and is refused; the buffer is
/// unchanged, and the registration (its handle the same while its keys change) serves the
/// next receive and deregisters cleanly. A send comm's registration never had remote rights.
#[test]
fn an_explicit_receive_registration_is_reachable_only_while_a_receive_uses_it() {
    let lo: IpAddr = Ipv4Addr::LOCALHOST.into();
    let rec = Arc::new(Wrapped::new(lo, false));
    let net = RoceNet::over(rec.clone(), lo);
    let (mut s, mut r) = pair(&net);
    let len = 64 * 1024; // past the eager size: written straight into the buffer
    let data: Vec<u8> = (0..len).map(|i| (i * 7) as u8).collect();
    let mut buf = vec![0u8; len];
    // SAFETY: `data` and `buf` outlive both registrations (released below).
    let (sm, rm) = unsafe {
        (
            s.reg_mr(data.as_ptr() as usize, len).unwrap(),
            r.reg_mr(buf.as_mut_ptr() as usize, len).unwrap(),
        )
    };
    let rb = RecvBuf {
        ptr: buf.as_mut_ptr(),
        len,
        tag: 3,
    };
    let mut keys = Vec::new();
    for round in 0..2 {
        rec.1.lock().clear();
        // SAFETY: `data` and `buf` outlive the call.
        let n = unsafe { transfer(&mut *s, &mut *r, data.as_ptr(), len, 3, Some(&sm), &rb) };
        assert_eq!((n.unwrap(), &buf[..]), (len, &data[..]), "round {round}");
        let w = *rec
            .1
            .lock()
            .iter()
            .find(|w| w.0 == WrOpcode::WriteImm && w.3 == buf.as_ptr() as u64)
            .expect("the message was written into the registered buffer");
        keys.push(w);
    }
    assert_ne!(keys[0].5, keys[1].5, "each receive sends a new key");
    // The peer writes with the key of the completed receive, through its own queue pair.
    let mut evil = vec![0xeeu8; 64];
    // SAFETY: `evil` outlives the registration, released below.
    let local = unsafe {
        rec.0
            .reg_mr(evil.as_mut_ptr() as u64, 64, Access::LOCAL_WRITE)
            .unwrap()
    };
    let (qp, target, rkey) = (keys[1].4, keys[1].3, keys[1].5);
    rec.0
        .post_send(
            qp,
            &SendWr {
                wr_id: 0x5eed,
                opcode: WrOpcode::Write,
                sge: Some(Sge {
                    addr: local.addr,
                    len: 64,
                    lkey: local.lkey,
                }),
                inline: false,
                imm: 0,
                remote_addr: target,
                rkey,
                signaled: true,
            },
        )
        .unwrap();
    let t0 = std::time::Instant::now();
    let status = loop {
        let mut wcs = [Wc::EMPTY; 8];
        let n = rec.0.poll_cq(qp, &mut wcs).unwrap();
        if let Some(w) = wcs[..n].iter().find(|w| w.wr_id == 0x5eed) {
            break w.status;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the write never completed"
        );
        std::thread::yield_now();
    };
    assert_eq!(
        status,
        WcStatus::RemAccessErr,
        "the old key reached the buffer"
    );
    assert_eq!(&buf[..], &data[..], "the buffer is unchanged");
    rec.0.dereg_mr(&local).unwrap();
    s.dereg_mr(sm).unwrap();
    r.dereg_mr(rm).unwrap();
}

/// "GPU memory" for the dmabuf test: device-only memory of the simulated device (its
/// address is PROT_NONE, its bytes a memfd), `len` bytes at `offset` of a buffer, with
/// the dmabuf (fd, offset) it exports.
fn fake_gpu(
    dev: &Arc<crate::device::fake_gpu::FakeGpu>,
    len: usize,
    offset: usize,
) -> (
    Arc<crate::device::fake_gpu::FakeGpuBuffer>,
    usize,
    (std::os::fd::OwnedFd, u64),
) {
    use crate::device::Device;
    let b = dev.alloc_device_only(offset + len);
    let iova = b.addr() + offset;
    let exported = dev.dmabuf_export(iova, len).unwrap();
    (b, iova, exported)
}

/// dmabufs registered through `reg_mr_device(.., Some((fd, offset)))` (what NCCL's
/// `regMrDmaBuf` does): the engine maps them itself, as a NIC maps GPU memory, and the
/// data moves between them while the addresses in the work requests are never touched
/// by the CPU (they are PROT_NONE: a touch would crash this test); small and large
/// messages, then a flush read through the registration. Refused without GPU support.
#[test]
fn dmabuf_registrations_move_memory_the_cpu_cannot_touch() {
    use std::os::fd::AsRawFd;
    let lo: IpAddr = Ipv4Addr::LOCALHOST.into();
    let rec = Arc::new(Wrapped::new(lo, false));
    let net = RoceNet::over(rec.clone(), lo);
    net.expect_device_buffers();
    let (mut s, mut r) = pair(&net);
    let dev = crate::device::fake_gpu::FakeGpu::new(std::time::Duration::ZERO);
    let dmabuf = |e: &(std::os::fd::OwnedFd, u64)| Some((e.0.as_raw_fd(), e.1));
    let (_probe, piova, pbuf) = fake_gpu(&dev, 4096, 0);
    // SAFETY: refused (nothing is registered), and `_probe` outlives the call.
    let refused = unsafe { s.reg_mr_device(piova, 4096, dmabuf(&pbuf)) };
    assert!(
        refused.is_err(),
        "a dmabuf taken without ROCCL_ROCEV2_SIM_GPU"
    );
    rec.0.set_sim_gpu(true);
    // A range past the end of the dmabuf is refused (mapped, it would fault on use).
    // SAFETY: as above.
    let e = unsafe { s.reg_mr_device(piova, 8192, dmabuf(&pbuf)) }.unwrap_err();
    assert!(e.to_string().contains("exceeds"), "{e}");
    for (len, offset) in [(64usize, 4096usize), ((1 << 20) + 3, 100)] {
        let (a, aiova, abuf) = fake_gpu(&dev, len, offset);
        let rlen = len + 61;
        let (b, biova, bbuf) = fake_gpu(&dev, rlen, 8192);
        let pattern: Vec<u8> = (0..len).map(|i| (i % 251) as u8 ^ 0x3c).collect();
        a.with(|x| x[offset..].copy_from_slice(&pattern));
        // SAFETY: `a` and `b` and their dmabufs live until the end of the iteration, after
        // both registrations are released.
        let (sm, rm) = unsafe {
            (
                s.reg_mr_device(aiova, len, dmabuf(&abuf)).unwrap(),
                r.reg_mr_device(biova, rlen, dmabuf(&bbuf)).unwrap(),
            )
        };
        let rb = RecvBuf {
            ptr: biova as *mut u8,
            len: rlen,
            tag: 3,
        };
        // SAFETY: the registered ranges outlive the call.
        let size =
            unsafe { transfer(&mut *s, &mut *r, aiova as *const u8, len, 3, Some(&sm), &rb) }
                .unwrap();
        assert_eq!(size, len);
        let got = b.with(|x| x[8192..].to_vec());
        assert!(got[..len] == pattern[..], "{len} bytes arrived intact");
        assert!(
            got[len..].iter().all(|x| *x == 0),
            "nothing past the message"
        );
        r.flush(std::slice::from_ref(&rb), crate::envvar::timeout())
            .unwrap();
        s.dereg_mr(sm).unwrap();
        r.dereg_mr(rm).unwrap();
    }
}

/// `iflush` returns at once with an id; flushes complete in order through `test_flush`
/// and their reads; more flushes than the loopback QP takes at once wait for older ones;
/// host memory needs none; an id never handed out is refused.
#[test]
fn flushes_are_asynchronous_and_complete_in_order() {
    let lo: IpAddr = Ipv4Addr::LOCALHOST.into();
    let rec = Arc::new(Wrapped::new(lo, false));
    let net = RoceNet::over(rec.clone(), lo);
    net.expect_device_buffers();
    let (_s, mut r) = pair(&net);
    let mut gpu = vec![0u8; 4096];
    let mut host = vec![0u8; 64];
    // SAFETY: `gpu` stays allocated until the registration is released at the end.
    let rm = unsafe { r.reg_mr_device(gpu.as_mut_ptr() as usize, gpu.len(), None) }.unwrap();
    let bufs: Vec<RecvBuf> = (0..MAX_RECVS)
        .map(|i| RecvBuf {
            // SAFETY: inside `gpu`.
            ptr: unsafe { gpu.as_mut_ptr().add(i * 512) },
            len: 512,
            tag: 0,
        })
        .collect();
    let hb = [RecvBuf {
        ptr: host.as_mut_ptr(),
        len: host.len(),
        tag: 0,
    }];
    assert_eq!(r.iflush(&hb).unwrap(), None, "host memory needs no flush");
    // Twice the reads the QP takes at once, MAX_RECVS buffers per flush.
    let ids: Vec<u64> = (0..2 * FLUSH_READS / MAX_RECVS)
        .map(|_| r.iflush(&bufs).unwrap().expect("GPU memory is flushed"))
        .collect();
    assert!(ids.windows(2).all(|w| w[1] > w[0]), "{ids:?}");
    let t0 = std::time::Instant::now();
    let mut done = vec![false; ids.len()];
    while !done.iter().all(|d| *d) {
        assert!(t0.elapsed().as_secs() < 10, "flushes stalled");
        for (i, &id) in ids.iter().enumerate() {
            if !done[i] && r.test_flush(id).unwrap() {
                assert!(
                    done[..i].iter().all(|d| *d),
                    "flush {id} finished before older ones"
                );
                done[i] = true;
            }
        }
    }
    let reads = rec
        .1
        .lock()
        .iter()
        .filter(|w| w.0 == WrOpcode::Read)
        .count();
    assert_eq!(reads, ids.len() * MAX_RECVS, "one read per buffer");
    let next = ids.last().unwrap() + 1;
    assert!(r.test_flush(next).is_err(), "an unknown flush is refused");
    assert!(r.test_flush(0).is_err());
    r.dereg_mr(rm).unwrap();
}

/// A completion that ran out of retries says the peer was silent (a timeout, not an exit);
/// other errors stay generic. (This host unable to send: tests/netns/run.sh's flap.)
#[test]
fn completion_errors_carry_their_cause() {
    let verbs = UserVerbs::with(IpAddr::from([127, 0, 0, 1]), 0, None).unwrap();
    let peer: SocketAddr = "127.0.0.1:4791".parse().unwrap();
    let wc = |status| Wc {
        status,
        ..Wc::EMPTY
    };
    let kind = |e: Error| match e {
        Error::System { source, .. } => source.kind(),
        other => panic!("{other}"),
    };
    use std::io::ErrorKind;
    assert_eq!(
        kind(super::wc_error(
            &wc(WcStatus::RetryExcErr),
            "send",
            &verbs,
            peer
        )),
        ErrorKind::TimedOut
    );
    assert_eq!(
        kind(super::wc_error(
            &wc(WcStatus::RemAccessErr),
            "send",
            &verbs,
            peer
        )),
        ErrorKind::Other
    );
    // Each is counted by status, for the metrics endpoint.
    let mut c = Vec::new();
    verbs.counters(&mut c);
    let get = |n: &str| c.iter().find(|(k, _)| *k == n).map(|(_, v)| *v);
    assert_eq!(get("completion_errors_retry_exc"), Some(1), "{c:?}");
    assert_eq!(get("completion_errors_rem_access"), Some(1), "{c:?}");
    assert_eq!(get("completion_errors_wr_flush"), Some(0), "{c:?}");
}

/// A host of several subnets (a switchless mesh): the engine takes packets on every
/// address, the handle names the others, and a connection uses the address on the way to
/// its peer — here loopback, the one a candidate shares with this host.
#[test]
fn an_engine_on_every_address_connects_at_the_peers_reachable_one() {
    let lo: IpAddr = Ipv4Addr::LOCALHOST.into();
    let any: IpAddr = Ipv4Addr::UNSPECIFIED.into();
    let other: Ipv4Addr = "198.51.100.77".parse().unwrap();
    let net = RoceNet {
        others: vec![other],
        ..RoceNet::over(Arc::new(UserVerbs::with(any, 0, None).unwrap()), lo)
    };
    let (h, _l) = net.listen(0).unwrap();
    let (main, others) = setup::decode_handle(&h).unwrap();
    assert_eq!((main.ip(), others), (lo, vec![other]));
    let (mut s, mut r) = pair(&net);
    for len in [8usize, 100_000] {
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
        let (got, n) = exchange(&mut *s, &mut *r, &data, len, 1).unwrap();
        assert_eq!((n, &got[..len]), (len, &data[..]));
    }
}

/// `ROCCL_IB_QPS_PER_CONNECTION`: a connection of 3 queue pairs sends message `m` on its
/// `m % 3`th, each queue pair from its own UDP socket (its own source port), and the
/// receiver hands messages over in the order they were sent.
#[test]
fn several_queue_pairs_take_messages_in_turn() {
    let lo: IpAddr = Ipv4Addr::LOCALHOST.into();
    let rec = Arc::new(Wrapped::new(lo, false));
    let net = RoceNet::over(rec.clone(), lo).with_qps(3);
    let (mut s, mut r) = pair(&net);
    // Both ends on one engine: 3 queue pairs each, each with its own send socket.
    assert_eq!(rec.0.open_qps(), (6, 6));
    rec.1.lock().clear();
    // Eager, inline, rendezvous and empty messages.
    let sizes = [1000usize, 8, 100_000, 0, 20_000, 3, 70_000];
    for (i, &len) in sizes.iter().enumerate() {
        let data: Vec<u8> = (0..len).map(|k| (k * 3 + i) as u8).collect();
        let (got, n) = exchange(&mut *s, &mut *r, &data, len.max(1), 1).unwrap();
        assert_eq!((n, &got[..len]), (len, &data[..]), "message {i}");
    }
    let data_qps: Vec<QpId> = rec
        .1
        .lock()
        .iter()
        .filter(|w| matches!(w.0, WrOpcode::SendImm | WrOpcode::WriteImm))
        .map(|w| w.4)
        .collect();
    assert_eq!(data_qps.len(), sizes.len(), "{data_qps:?}");
    let mut distinct = data_qps.clone();
    distinct.sort_by_key(|q| format!("{q:?}"));
    distinct.dedup();
    assert_eq!(distinct.len(), 3, "{data_qps:?}");
    for (m, q) in data_qps.iter().enumerate() {
        assert_eq!(*q, data_qps[m % 3], "message {m} on its queue pair");
    }
}

/// Messages on 3 queue pairs through a link that drops, duplicates and delays datagrams:
/// one queue pair's retransmission holds its message back while the others' arrive, and
/// the receiver still matches every message to the receive it was sent for.
#[test]
fn several_queue_pairs_keep_the_order_through_losses() {
    use crate::rdma::udp::Faults;
    let lo: IpAddr = Ipv4Addr::LOCALHOST.into();
    let faults = Faults {
        drop: 0.02,
        dup: 0.01,
        reorder: 0.02,
        seed: 11,
        ..Faults::default()
    };
    let verbs = Arc::new(UserVerbs::with(lo, 0, Some(faults)).unwrap());
    let net = RoceNet::over(verbs, lo).with_qps(3);
    grouped_mixed_sizes(&net, 60);
}

/// A queue pair count outside 1 to 8 is refused with the setting's name.
#[test]
fn queue_pairs_per_connection_are_checked() {
    assert_eq!(parse_qps("4").unwrap(), 4);
    for bad in ["0", "9", "two", "-1"] {
        let e = parse_qps(bad).unwrap_err().to_string();
        assert!(
            e.contains("ROCCL_IB_QPS_PER_CONNECTION") && e.contains("1 to 8"),
            "{e}"
        );
    }
}

/// Two NICs (two engines, on 127.0.0.1 and 127.0.0.2): a connection of device `d` runs on
/// the `d`th at both ends, each NIC carries its own connections' packets, and data arrives
/// whole over either.
#[test]
fn connections_spread_over_several_devices() {
    let lo: IpAddr = Ipv4Addr::LOCALHOST.into();
    let lo2: IpAddr = Ipv4Addr::new(127, 0, 0, 2).into();
    let nic0 = Arc::new(UserVerbs::with(lo, 0, None).unwrap());
    let nic1 = Arc::new(UserVerbs::with(lo2, 0, None).unwrap());
    let net = RoceNet::over_devices(
        vec![
            (nic0.clone() as Arc<dyn Verbs>, lo),
            (nic1.clone() as Arc<dyn Verbs>, lo2),
        ],
        lo,
    )
    .unwrap()
    .with_qps(2);
    assert_eq!(net.devices(), 2);
    assert_eq!(net.properties(1).unwrap().guid, 1);
    let (h, mut l) = net.listen(0).unwrap();
    let mut comms = Vec::new();
    for dev in 0..2 {
        let mut c = net.connect(dev, &h).unwrap();
        let (mut s, mut r) = (None, None);
        let t0 = std::time::Instant::now();
        while s.is_none() || r.is_none() {
            assert!(t0.elapsed().as_secs() < 10, "setup of device {dev} stalled");
            if s.is_none() {
                s = c.poll().unwrap();
            }
            if r.is_none() {
                r = l.accept().unwrap();
            }
        }
        comms.push((s.unwrap(), r.unwrap()));
    }
    // Each device holds its connection's queue pairs, both ends: 2 + 2.
    assert_eq!(nic0.open_qps().0, 4);
    assert_eq!(nic1.open_qps().0, 4);
    for (dev, (s, r)) in comms.iter_mut().enumerate() {
        let before = [nic0.udp_stats().packets, nic1.udp_stats().packets];
        let data: Vec<u8> = (0..300_000).map(|i| (i * 5 + dev) as u8).collect();
        let (got, n) = exchange(&mut **s, &mut **r, &data, data.len(), 1).unwrap();
        assert_eq!((n, &got[..]), (data.len(), &data[..]), "device {dev}");
        let sent = [
            nic0.udp_stats().packets - before[0],
            nic1.udp_stats().packets - before[1],
        ];
        // 300 kB is at least 73 packets of 4 KiB; the other NIC sends no data (a few
        // acknowledgements at most, of its own connection's earlier traffic).
        assert!(sent[dev] >= 73, "device {dev} sent {sent:?}");
        assert!(
            sent[1 - dev] < 10,
            "device {dev}: the other NIC sent {sent:?}"
        );
    }
    let mut counters = Vec::new();
    net.counters(&mut counters);
    let names: Vec<_> = counters.iter().map(|c| c.0).collect();
    let mut unique = names.clone();
    unique.dedup();
    assert_eq!(names, unique, "counters are summed over the devices");
}

/// The device that accepts a connection: the connector's index, unless that device is on
/// an interface whose subnet does not hold the peer and another's does (rails listed in
/// another order on this host).
#[test]
fn the_accepting_device_is_on_the_connectors_rail() {
    use crate::bootstrap::ifaces::Iface;
    let a = |s: &str| s.parse::<IpAddr>().unwrap();
    let iface = |name: &str, addr: &str| Iface {
        name: name.into(),
        addr: a(addr),
        prefix: 24,
    };
    let ifaces = [iface("r0", "10.0.0.1"), iface("r1", "10.0.1.1")];
    let devs = [a("10.0.0.1"), a("10.0.1.1")];
    assert_eq!(pick_device_among(&devs, 0, a("10.0.0.2"), &ifaces), 0);
    assert_eq!(pick_device_among(&devs, 1, a("10.0.1.2"), &ifaces), 1);
    // The peer lists its rails the other way round.
    assert_eq!(pick_device_among(&devs, 0, a("10.0.1.2"), &ifaces), 1);
    assert_eq!(pick_device_among(&devs, 1, a("10.0.0.2"), &ifaces), 0);
    // A peer on neither rail (routed): its index.
    assert_eq!(pick_device_among(&devs, 1, a("192.0.2.9"), &ifaces), 1);
    // A device on no listed interface (a second loopback address): its index.
    let lo = [a("127.0.0.1"), a("127.0.0.2")];
    let lo_if = [Iface {
        name: "lo".into(),
        addr: a("127.0.0.1"),
        prefix: 8,
    }];
    assert_eq!(pick_device_among(&lo, 1, a("127.0.0.2"), &lo_if), 1);
    assert_eq!(pick_device_among(&lo, 3, a("127.0.0.1"), &lo_if), 1);
}
