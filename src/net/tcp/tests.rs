//! Tests of the TCP network through its `Net` trait.

use super::*;
use crate::net::{Net, RecvBuf, RecvComm, ReqId, SendComm, MAX_REQUESTS};
use std::net::Ipv4Addr;

fn pair(net: &TcpNet) -> (Box<dyn SendComm>, Box<dyn RecvComm>) {
    crate::net::connect_pair(net)
}

fn net(nsocks: usize) -> TcpNet {
    TcpNet {
        addr: Ipv4Addr::LOCALHOST.into(),
        ifname: "lo".into(),
        nsocks,
        split: 64 * 1024,
        local_sndbuf: Some(LOCAL_SNDBUF),
        duplex: true,
        key: crate::net::NetKey::new(),
    }
}

/// Post `sizes` as messages from `s` to `r` (tag 4) into buffers `slack` bytes larger,
/// and check what arrives.
fn exchange(
    s: &mut dyn SendComm,
    r: &mut dyn RecvComm,
    sizes: &[usize],
    seed: usize,
    slack: usize,
) {
    let data: Vec<Vec<u8>> = sizes
        .iter()
        .map(|&l| (0..l).map(|i| (i * 7 + l + seed) as u8).collect())
        .collect();
    let mut bufs: Vec<Vec<u8>> = sizes.iter().map(|&l| vec![0u8; l + slack]).collect();
    let (mut sends, mut recvs) = (Vec::new(), Vec::new());
    for (d, b) in data.iter().zip(bufs.iter_mut()) {
        let rb = RecvBuf {
            ptr: b.as_mut_ptr(),
            len: b.len(),
            tag: 4,
        };
        // SAFETY: `bufs` and `data` outlive `settle`, which completes every request.
        unsafe {
            recvs.push((r.irecv(&[rb]).unwrap().unwrap(), 1));
            sends.push(s.isend(d.as_ptr(), d.len(), 4, None).unwrap().unwrap());
        }
    }
    let got = settle(s, r, &sends, &recvs);
    for (i, l) in sizes.iter().enumerate() {
        assert_eq!(got[i], vec![*l], "size reported");
        assert!(bufs[i][..*l] == data[i][..], "{l}-byte payload");
    }
}

#[test]
fn a_duplex_connection_carries_messages_both_ways() {
    let on = net(2);
    let off = TcpNet {
        duplex: false,
        ..net(2)
    };
    let (h_on, _l1) = on.listen(0).unwrap();
    let (h_off, _l2) = off.listen(0).unwrap();
    assert!(on.duplex(&h_on, &h_on));
    assert!(!on.duplex(&h_on, &h_off) && !off.duplex(&h_off, &h_on));

    // A plain connection goes one way.
    let (mut s, mut r) = pair(&on);
    assert!(
        r.reverse().is_none() && s.reverse().is_none(),
        "one-way connection"
    );
    let (h, mut l) = on.listen(0).unwrap();
    let mut c = on.connect_duplex(0, &h).unwrap();
    let (mut s, mut r) = loop {
        if let Some(s) = c.poll().unwrap() {
            break loop {
                if let Some(r) = l.accept().unwrap() {
                    break (s, r);
                }
            };
        }
        assert!(l.accept().unwrap().is_none());
    };
    let mut back_s = r.reverse().expect("a sending side back");
    let mut back_r = s.reverse().expect("a receiving side back");
    assert!(
        r.reverse().is_none() && s.reverse().is_none(),
        "each side once"
    );
    // Both ways at once; small payloads share socket 0, larger ones come with their
    // header on the direction's first own socket (split over both from 64 KiB), in
    // any interleaving.
    let inline = duplex_inline();
    let sizes = [
        1usize,
        4096,
        300_001,
        0,
        70_000,
        inline,
        inline + 1,
        5,
        200_000,
        3,
    ];
    exchange(&mut *s, &mut *r, &sizes, 1, 0);
    exchange(&mut *back_s, &mut *back_r, &sizes, 2, 0);

    // Messages sent just before the first side goes, the last ones on its own socket:
    // all arrive although the shared socket ends first.
    let last: Vec<Vec<u8>> = [7usize, 100_000, 90_000]
        .iter()
        .map(|&l| (0..l).map(|i| (i % 251) as u8).collect())
        .collect();
    // SAFETY: `last` outlives the sends, which complete before `s` goes.
    let reqs: Vec<ReqId> = last
        .iter()
        .map(|d| {
            unsafe { s.isend(d.as_ptr(), d.len(), 4, None) }
                .unwrap()
                .unwrap()
        })
        .collect();
    for q in reqs {
        while s.test(q).unwrap().is_none() {}
    }
    drop(s);
    for d in &last {
        let mut b = vec![0u8; d.len()];
        let rb = RecvBuf {
            ptr: b.as_mut_ptr(),
            len: b.len(),
            tag: 4,
        };
        // SAFETY: `b` outlives the request, completed below.
        let q = unsafe { r.irecv(&[rb]) }.unwrap().unwrap();
        while !r.test(q, &mut [0]).unwrap() {}
        assert!(
            &b == d,
            "{}-byte message sent before the side went",
            d.len()
        );
    }
    // The way back still works, and the first side's peer reads the end.
    exchange(&mut *back_s, &mut *back_r, &[5, 200_000], 3, 0);
    let mut b = [0u8; 8];
    let rb = RecvBuf {
        ptr: b.as_mut_ptr(),
        len: 8,
        tag: 4,
    };
    // SAFETY: `b` outlives the request, which fails below.
    let q = unsafe { r.irecv(&[rb]) }.unwrap().unwrap();
    let t0 = std::time::Instant::now();
    let err = loop {
        match r.test(q, &mut [0]) {
            Err(e) => break e.to_string(),
            Ok(done) => assert!(!done, "nothing was sent"),
        }
        assert!(
            t0.elapsed().as_secs() < 10,
            "the end of the stream never came"
        );
    };
    assert!(err.contains("closed by the peer"), "{err}");
}

#[test]
fn send_buffers_are_capped_for_peers_on_this_host_only() {
    let n = net(1);
    assert_eq!(n.sndbuf_for(Ipv4Addr::LOCALHOST.into()), Some(LOCAL_SNDBUF));
    // An address of no interface here (TEST-NET-3): another host keeps autotuning.
    assert_eq!(n.sndbuf_for(Ipv4Addr::new(203, 0, 113, 7).into()), None);
    let auto = TcpNet {
        local_sndbuf: None,
        ..net(1)
    };
    assert_eq!(auto.sndbuf_for(Ipv4Addr::LOCALHOST.into()), None);
}

/// Drive sends and receives until all are done.
fn settle(
    s: &mut dyn SendComm,
    r: &mut dyn RecvComm,
    sends: &[ReqId],
    recvs: &[(ReqId, usize)],
) -> Vec<Vec<usize>> {
    let mut out = vec![Vec::new(); recvs.len()];
    let mut sdone = vec![false; sends.len()];
    let mut rdone = vec![false; recvs.len()];
    while !(sdone.iter().all(|d| *d) && rdone.iter().all(|d| *d)) {
        for (i, q) in sends.iter().enumerate() {
            if !sdone[i] {
                sdone[i] = s.test(*q).unwrap().is_some();
            }
        }
        for (i, (q, n)) in recvs.iter().enumerate() {
            if !rdone[i] {
                let mut sizes = vec![0; *n];
                if r.test(*q, &mut sizes).unwrap() {
                    rdone[i] = true;
                    out[i] = sizes;
                }
            }
        }
    }
    out
}

#[test]
fn messages_of_every_size_over_several_sockets() {
    for nsocks in [1, 3] {
        let n = net(nsocks);
        let (mut s, mut r) = pair(&n);
        let sizes = [0usize, 1, 7, 4096, 65535, 65536, 300_001, 4 << 20];
        exchange(&mut *s, &mut *r, &sizes, nsocks, 5);
    }
}

#[test]
fn grouped_receive_matches_tags_in_any_order() {
    let n = net(2);
    let (mut s, mut r) = pair(&n);
    let a = vec![1u8; 100];
    let b = vec![2u8; 200_000];
    let c = [3u8; 3];
    let mut ba = vec![0u8; 100];
    let mut bb = vec![0u8; 200_000];
    let mut bc = vec![0u8; 10];
    let group = [
        RecvBuf {
            ptr: bc.as_mut_ptr(),
            len: bc.len(),
            tag: 30,
        },
        RecvBuf {
            ptr: ba.as_mut_ptr(),
            len: ba.len(),
            tag: 10,
        },
        RecvBuf {
            ptr: bb.as_mut_ptr(),
            len: bb.len(),
            tag: 20,
        },
    ];
    // SAFETY: all buffers outlive `settle`, which completes every request.
    let (rq, sq) = unsafe {
        let rq = r.irecv(&group).unwrap().unwrap();
        let sq = [
            s.isend(b.as_ptr(), b.len(), 20, None).unwrap().unwrap(),
            s.isend(a.as_ptr(), a.len(), 10, None).unwrap().unwrap(),
            s.isend(c.as_ptr(), c.len(), 30, None).unwrap().unwrap(),
        ];
        (rq, sq)
    };
    let got = settle(&mut *s, &mut *r, &sq, &[(rq, 3)]);
    assert_eq!(got[0], vec![3, 100, 200_000]);
    assert_eq!(ba, a);
    assert_eq!(bb, b);
    assert_eq!(&bc[..3], &c[..]);
}

#[test]
fn oversized_message_and_unknown_tag_are_errors() {
    let n = net(1);
    for (len, tag) in [(64usize, 5u32), (8, 6)] {
        let (mut s, mut r) = pair(&n);
        let data = vec![0u8; len];
        let mut buf = vec![0u8; 16];
        // SAFETY: buffers outlive the loop below, which ends with the receive failing.
        unsafe {
            let q = r
                .irecv(&[RecvBuf {
                    ptr: buf.as_mut_ptr(),
                    len: 16,
                    tag: 5,
                }])
                .unwrap()
                .unwrap();
            let sq = s.isend(data.as_ptr(), len, tag, None).unwrap().unwrap();
            while s.test(sq).unwrap().is_none() {}
            let e = loop {
                match r.test(q, &mut [0]) {
                    Ok(false) => continue,
                    Ok(true) => panic!("a bad message was accepted"),
                    Err(e) => break e.to_string(),
                }
            };
            if tag == 5 {
                assert!(e.contains("holds only 16 bytes"), "{e}");
            } else {
                assert_eq!(crate::net::unexpected_tag_of(&e), Some(6), "{e}");
            }
        }
    }
}

#[test]
fn request_slots_are_bounded_and_closed_peer_is_reported() {
    let n = net(1);
    let (mut s, mut r) = pair(&n);
    let mut bufs = vec![[0u8; 4]; MAX_REQUESTS + 1];
    let mut got_none = false;
    for b in bufs.iter_mut() {
        // SAFETY: the receive comm is dropped before `bufs`.
        if unsafe {
            r.irecv(&[RecvBuf {
                ptr: b.as_mut_ptr(),
                len: 4,
                tag: 0,
            }])
        }
        .unwrap()
        .is_none()
        {
            got_none = true;
        }
    }
    assert!(got_none, "more than MAX_REQUESTS receives were accepted");
    drop(s);
    let e = loop {
        match r.test(ReqId(0), &mut [0]) {
            Ok(false) => continue,
            Ok(true) => panic!("nothing was sent"),
            Err(e) => break e.to_string(),
        }
    };
    assert!(e.contains("closed by the peer"), "{e}");
    s = pair(&n).0;
    drop(r);
    drop(s);
    drop(bufs);
}

#[test]
fn handles_are_checked() {
    let n = net(2);
    let bad = NetHandle::from_bytes(&[1, 2, 3]).unwrap();
    let e = n
        .connect(0, &bad)
        .err()
        .expect("a foreign handle must be refused")
        .to_string();
    assert!(e.contains("not a roccl TCP connection handle"), "{e}");
    assert!(NetHandle::from_bytes(&[0u8; 129]).is_err());
    assert_eq!(n.properties(0).unwrap().max_recvs, MAX_RECVS as u32);
    assert!(n.properties(1).is_err());
}
