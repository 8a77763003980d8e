use super::*;

fn pair(ring: usize, cma: usize) -> (Box<dyn SendComm>, Box<dyn RecvComm>) {
    let net = ShmNet {
        stats: Arc::default(),
        host: host_id(),
        ring,
        cma,
        key: crate::net::NetKey::new(),
    };
    super::super::connect_pair(&net)
}

/// Where the host cannot tell the peer's user (no `NETLINK_SOCK_DIAG`), the check used to
/// pass every peer whatever the job; now an encrypted job refuses such peers, and the
/// others are let through to the tag check (said once).
#[test]
fn a_peer_whose_user_cannot_be_told_is_refused_in_an_encrypted_job() {
    assert!(peer_user_check(Some(7), 7, true).is_ok());
    assert!(peer_user_check(Some(8), 7, false)
        .unwrap_err()
        .contains("user 8"));
    assert!(peer_user_check(None, 7, false).is_ok());
    let e = peer_user_check(None, 7, true).unwrap_err();
    assert!(
        e.contains("NETLINK_SOCK_DIAG") && e.contains("encrypts"),
        "{e}"
    );
    // An encrypted job's listeners are strict: the network keeps the job's setting.
    let net = ShmNet {
        stats: Arc::default(),
        host: host_id(),
        ring: 4096,
        cma: 0,
        key: crate::net::NetKey::new(),
    };
    assert!(!net.key.encrypting());
    net.set_encryption(true);
    assert!(net.key.encrypting());
}

/// A peer that knows the job's key but names a segment shorter than the ring it claims
/// (before the size check: SIGBUS at the first touch), a name roccl does not make, or
/// garbage, is dropped: no fault, no error of the listener, which then connects a real
/// peer. Without the key, a well-formed message is dropped as well.
/// Found by the fuzz target `net_setup` (corpus entry `crash-shm-handle-ring-0`): a
/// handle whose ring size is 0 (or so large that the segment's size overflows) made the
/// connector create a segment without a ring.
#[test]
fn a_handle_with_a_bad_ring_size_is_refused() {
    let net = ShmNet::new(&ShmSettings::default()).unwrap();
    let (h, _l) = net.listen(0).unwrap();
    assert!(decode_handle(&h, &net.host).is_ok());
    for ring in [
        0u64,
        1,
        4096,
        (1 << 20) + 1,
        1 << 31,
        u64::MAX,
        u64::MAX - 100,
    ] {
        let mut b = *h.as_bytes();
        b[8..16].copy_from_slice(&ring.to_le_bytes());
        let bad = NetHandle::from_bytes(&b).unwrap();
        let e = decode_handle(&bad, &net.host).unwrap_err();
        assert!(e.to_string().contains("ring of"), "{ring}: {e}");
        assert!(net.connect(0, &bad).is_err(), "{ring}");
    }
}

#[test]
fn bad_setup_messages_are_dropped_and_the_listener_goes_on() {
    use std::time::{Duration, Instant};
    let net = ShmNet::new(&ShmSettings::default()).unwrap();
    net.set_job_key(&crate::bootstrap::auth::JobKey::from_secret(
        &[3; 16], b"test",
    ));
    let (h, mut l) = net.listen(0).unwrap();
    let b = *h.as_bytes();
    let port = u16::from_le_bytes([b[4], b[5]]);
    let token = &b[HANDLE_TOKEN..HANDLE_TOKEN + crate::net::TOKEN_BYTES];
    let key = net.key.for_token("shm", token);
    let wrong = crate::net::NetKey::new().for_token("shm", token);
    let tiny = format!("/roccl-{}-9999-abc", std::process::id());
    let ctiny = CString::new(tiny.clone()).unwrap();
    let _seg = Segment::create(&ctiny, 4096).unwrap();
    let send = |name: &str, ring: u64, key: &crate::bootstrap::auth::JobKey| {
        let mut s = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).unwrap();
        let mut msg = [0u8; NAME_MSG];
        msg[0] = name.len() as u8;
        msg[1..1 + name.len()].copy_from_slice(name.as_bytes());
        msg[NAME_MSG - 8..].copy_from_slice(&ring.to_le_bytes());
        s.write_all(&msg).unwrap();
        s.write_all(&key.tag(&[&msg])).unwrap();
        s
    };
    let before = crate::bootstrap::auth::refused();
    let _held = [
        send(&tiny, 1 << 20, &key),
        send("/../../etc/passwd", 1 << 20, &key),
        send(&tiny, 3, &key),
        send(&tiny, 1 << 16, &wrong),
    ];
    let mut garbage = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).unwrap();
    garbage.write_all(&[0xa5; NAME_MSG + TAG]).unwrap();
    let t = Instant::now();
    while crate::bootstrap::auth::refused() < before + 5 {
        assert!(l.accept().unwrap().is_none());
        assert!(t.elapsed() < Duration::from_secs(5), "not all refused");
        std::thread::sleep(Duration::from_millis(5));
    }
    // SAFETY: unlinking the name this test created.
    unsafe { libc::shm_unlink(ctiny.as_ptr()) };
    let mut c = net.connect(0, &h).unwrap();
    let (mut sent, mut got) = (None, None);
    while sent.is_none() || got.is_none() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the listener no longer connects"
        );
        if sent.is_none() {
            sent = c.poll().unwrap();
        }
        if got.is_none() {
            got = l.accept().unwrap();
        }
    }
}

/// The consumer position the sender reads from shared memory is the peer's word: one
/// past the producer or a whole ring behind it is an error naming the peer's corruption,
/// not an overwrite of unread bytes (nor, on the receiving side, a read of unwritten ones).
#[test]
fn a_corrupt_ring_position_is_an_error() {
    assert_eq!(ring_used(1 << 16, 100, 40, "consumer").unwrap(), 60);
    assert_eq!(ring_used(1 << 16, 1 << 16, 0, "consumer").unwrap(), 1 << 16);
    for (head, tail) in [(100u64, 101u64), ((1 << 16) + 1, 0), (0, u64::MAX)] {
        let e = ring_used(1 << 16, head, tail, "consumer")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("the peer's consumer position is out of the ring"),
            "{e}"
        );
    }
    let name = CString::new(format!("/roccl-test-tail-{}", std::process::id())).unwrap();
    let seg = Segment::create(&name, SEG_HDR + (1 << 16)).unwrap();
    // SAFETY: unlinking the name we just created; the mapping stays.
    unsafe { libc::shm_unlink(name.as_ptr()) };
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let side = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let _other = l.accept().unwrap();
    let mut s = ShmSend {
        stats: Arc::default(),
        seg,
        direct_from: usize::MAX,
        direct_sent: 0,
        live: Liveness::new(side, "shared memory"),
        reqs: VecDeque::new(),
        base: 0,
        head: 0,
        polls: 0,
        failed: None,
    };
    // The "consumer" claims to be a ring and a byte ahead of a producer that wrote
    // nothing: taken at its word, the ring would seem to have 2^64 - 1 bytes free.
    s.seg.header().tail.store((1 << 16) + 1, Ordering::Release);
    let data = [7u8; 100];
    // SAFETY: `data` outlives the comm.
    let e = unsafe { s.isend(data.as_ptr(), data.len(), 1, None) }
        .expect_err("a corrupt consumer position must fail the send")
        .to_string();
    assert!(e.contains("consumer position is out of the ring"), "{e}");
}

#[test]
fn messages_of_every_size_through_a_small_ring() {
    every_size(pair(65536, usize::MAX));
}

/// Direct messages (from 4 KiB on here) copied by the receiver out of the sender's memory,
/// interleaved with ring messages.
#[test]
fn messages_of_every_size_with_direct_copies() {
    every_size(pair(65536, 4096));
}

fn every_size((mut s, mut r): (Box<dyn SendComm>, Box<dyn RecvComm>)) {
    for len in [
        0usize,
        1,
        15,
        16,
        17,
        4096,
        65535,
        65536,
        65537,
        300_001,
        1 << 21,
    ] {
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + len) as u8).collect();
        let mut buf = vec![0xEEu8; len + 5];
        // SAFETY: both buffers outlive the loop below, which completes both requests.
        let (rq, sq) = unsafe {
            let rq = r
                .irecv(&[RecvBuf {
                    ptr: buf.as_mut_ptr(),
                    len: len + 5,
                    tag: 3,
                }])
                .unwrap()
                .unwrap();
            (rq, s.isend(data.as_ptr(), len, 3, None).unwrap().unwrap())
        };
        let (mut sd, mut rd, mut size) = (false, false, [0usize]);
        let t = std::time::Instant::now();
        while !(sd && rd) {
            assert!(t.elapsed().as_secs() < 20, "{len} bytes stalled");
            sd = sd || s.test(sq).unwrap().is_some();
            rd = rd || r.test(rq, &mut size).unwrap();
        }
        assert_eq!(size[0], len);
        assert!(buf[..len] == data[..], "{len} bytes corrupted");
        assert_eq!(buf[len], 0xEE, "{len}: written past the message");
    }
    // Too large for the buffer: an error, not an overflow.
    let data = [1u8; 100];
    let mut buf = [0u8; 10];
    // SAFETY: as above.
    unsafe {
        r.irecv(&[RecvBuf {
            ptr: buf.as_mut_ptr(),
            len: 10,
            tag: 1,
        }])
        .unwrap();
        s.isend(data.as_ptr(), 100, 1, None).unwrap();
    }
    let t = std::time::Instant::now();
    let e = loop {
        assert!(t.elapsed().as_secs() < 10);
        if let Err(e) = r.test(ReqId(11), &mut [0]) {
            break e.to_string();
        }
    };
    assert!(e.contains("holds only 10"), "{e}");
}
