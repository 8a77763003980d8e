use super::*;

fn net(rank: usize, spec: &str, job: &[u8]) -> SimNet {
    let n = SimNet::new(rank, spec.parse().unwrap()).unwrap();
    n.set_job_key(&JobKey::from_secret(job, b"sim test"));
    n
}

/// Send `len` bytes from `s` to `r` (posted in that order) and complete both.
fn exchange(s: &mut dyn SendComm, r: &mut dyn RecvComm, len: usize, seed: u8) {
    let src: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(seed)).collect();
    let mut dst = vec![0u8; len];
    // SAFETY: both buffers outlive the loop that completes both requests.
    let (sr, rr) = unsafe {
        let sr = s.isend(src.as_ptr(), len, 7, None).unwrap().unwrap();
        let b = RecvBuf {
            ptr: dst.as_mut_ptr(),
            len,
            tag: 7,
        };
        (sr, r.irecv(&[b]).unwrap().unwrap())
    };
    let (mut sent, mut got) = (false, false);
    let mut sizes = [0usize];
    while !(sent && got) {
        sent = sent || s.test(sr).unwrap().is_some();
        got = got || r.test(rr, &mut sizes).unwrap();
    }
    assert_eq!(sizes[0], len);
    assert!(dst == src, "{len} bytes arrived changed");
}

#[test]
fn messages_of_every_size_arrive_eager_and_direct() {
    let (a, b) = (net(0, "", b"sizes"), net(1, "", b"sizes"));
    let (h, mut l) = b.listen(0).unwrap();
    let mut s = a.connect(0, &h).unwrap().poll().unwrap().unwrap();
    let mut r = l.accept().unwrap().unwrap();
    for (k, len) in [0, 1, 16, 4095, EAGER_MAX, EAGER_MAX + 1, 3 << 20]
        .into_iter()
        .enumerate()
    {
        exchange(&mut *s, &mut *r, len, k as u8 + 3);
    }
    // Many eager messages in flight beyond the budget: the later ones go direct.
    let src = vec![5u8; EAGER_MAX];
    let mut dst = vec![vec![0u8; EAGER_MAX]; 8];
    let mut reqs = Vec::new();
    for d in dst.iter_mut() {
        // SAFETY: the buffers outlive the loop below, which completes every request.
        unsafe {
            let sr = s.isend(src.as_ptr(), src.len(), 1, None).unwrap().unwrap();
            let b = RecvBuf {
                ptr: d.as_mut_ptr(),
                len: d.len(),
                tag: 1,
            };
            reqs.push((sr, r.irecv(&[b]).unwrap().unwrap(), false, false));
        }
    }
    while reqs.iter().any(|q| !(q.2 && q.3)) {
        for q in reqs.iter_mut() {
            q.2 = q.2 || s.test(q.0).unwrap().is_some();
            q.3 = q.3 || r.test(q.1, &mut [0]).unwrap();
        }
    }
    assert!(dst.iter().all(|d| d.iter().all(|&x| x == 5)));
}

/// Two ranks on different hosts: a message arrives after the software overhead, the NIC's
/// latency and its serialisation; the receiver's clock moves there when the receive is
/// done; ranks of one host use the faster local link.
#[test]
fn the_clock_follows_the_link_model() {
    let spec = "ranks_per_host=2,nic_gbps=8,nic_us=3,local_gbps=80,local_us=1,msg_us=0.5";
    let nets: Vec<SimNet> = (0..3).map(|r| net(r, spec, b"clock")).collect();
    let (h2, mut l2) = nets[2].listen(0).unwrap();
    let (h1, mut l1) = nets[1].listen(0).unwrap();
    // Rank 0 → rank 2 (host 1): 0.5 µs + 3 µs + 1000 B at 1 GB/s (1 µs), then 0.5 µs.
    let mut s = nets[0].connect(0, &h2).unwrap().poll().unwrap().unwrap();
    let mut r = l2.accept().unwrap().unwrap();
    exchange(&mut *s, &mut *r, 1000, 1);
    // The clock moves when the rank uses the message (the executor calls `received`).
    assert_eq!(nets[2].clock().now(), Duration::ZERO);
    nets[2].clock().received(r.virtual_arrival().unwrap());
    assert_eq!(nets[0].clock().now(), Duration::from_nanos(500));
    assert_eq!(nets[2].clock().now(), Duration::from_nanos(5000));
    // Rank 0 → rank 1 (host 0): 0.5 µs more on rank 0, 1 µs, 1000 B at 10 GB/s (0.1 µs).
    let mut s = nets[0].connect(0, &h1).unwrap().poll().unwrap().unwrap();
    let mut r = l1.accept().unwrap().unwrap();
    exchange(&mut *s, &mut *r, 1000, 2);
    nets[1].clock().received(r.virtual_arrival().unwrap());
    assert_eq!(nets[0].clock().now(), Duration::from_nanos(1000));
    assert_eq!(nets[1].clock().now(), Duration::from_nanos(2600));
    // A call's time: from its start to its end on this rank.
    let c = nets[1].clock();
    c.call_started();
    c.set(Duration::from_micros(10));
    c.call_done();
    assert_eq!(c.last_call(), Duration::from_nanos(10000 - 2600));
}

use std::time::Duration;

#[test]
fn a_peer_of_another_process_or_gone_is_named() {
    let (a, b) = (net(0, "", b"gone"), net(3, "", b"gone"));
    let (h, l) = b.listen(0).unwrap();
    let mut other = *h.as_bytes();
    other[4..8].copy_from_slice(&(std::process::id() + 1).to_le_bytes());
    let e = a
        .connect(0, &NetHandle::from_bytes(&other).unwrap())
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("rank 3 is in process") && e.contains("threads of one process"),
        "{e}"
    );
    drop(l);
    let e = a.connect(0, &h).err().unwrap().to_string();
    assert!(e.contains("rank 3's endpoint is gone"), "{e}");
    // A receiver waiting on a sender that went is an error naming it.
    let (h, mut l) = b.listen(0).unwrap();
    let s = a.connect(0, &h).unwrap().poll().unwrap().unwrap();
    let mut r = l.accept().unwrap().unwrap();
    let mut buf = [0u8; 4];
    let rb = RecvBuf {
        ptr: buf.as_mut_ptr(),
        len: 4,
        tag: 0,
    };
    // SAFETY: `buf` outlives the receive comm's use of it (the test below fails it).
    let req = unsafe { r.irecv(&[rb]) }.unwrap().unwrap();
    drop(s);
    let e = r.test(req, &mut [0]).unwrap_err().to_string();
    assert!(e.contains("receive from rank 0: the peer closed"), "{e}");
}

#[test]
fn ranks_of_one_job_must_simulate_the_same_cluster() {
    let a = net(0, "nic_gbps=100", b"same");
    let b = net(1, "nic_gbps=200", b"same");
    let _keep = a.listen(0).unwrap();
    let e = b.listen(0).err().unwrap().to_string();
    assert!(e.contains("differs from the job's"), "{e}");
}

#[test]
fn a_sleeping_receiver_is_woken_by_its_eventfd() {
    let (a, b) = (net(0, "", b"wake"), net(1, "", b"wake"));
    let (mut s, mut r) = {
        let (h, mut l) = b.listen(0).unwrap();
        let s = a.connect(0, &h).unwrap().poll().unwrap().unwrap();
        (s, l.accept().unwrap().unwrap())
    };
    let mut buf = [0u8; 8];
    let rb = RecvBuf {
        ptr: buf.as_mut_ptr(),
        len: 8,
        tag: 0,
    };
    // SAFETY: `buf` outlives the receive, completed below.
    let req = unsafe { r.irecv(&[rb]) }.unwrap().unwrap();
    assert!(!r.test(req, &mut [0]).unwrap());
    let mut fds = Vec::new();
    r.poll_fds(&mut fds);
    let fd = fds[0].fd;
    assert!(
        !crate::net::poll_one(fd, libc::POLLIN),
        "nothing to wake for yet"
    );
    let t = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(50));
        let data = [9u8; 8];
        // SAFETY: `data` lives until the send completes below (eager: at once).
        let id = unsafe { s.isend(data.as_ptr(), 8, 0, None) }
            .unwrap()
            .unwrap();
        assert!(
            s.test(id).unwrap().is_some(),
            "an eager send is done at once"
        );
    });
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the call.
    let n = unsafe { libc::poll(&mut p, 1, 5000) };
    assert_eq!(n, 1, "the send woke the sleeping receiver");
    t.join().unwrap();
    assert!(r.test(req, &mut [0]).unwrap());
    assert_eq!(buf, [9u8; 8]);
    assert!(!crate::net::poll_one(fd, libc::POLLIN), "drained");
}
