//! The engine's sockets: opening them, their options, and the MTU of the path they send on.

use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsRawFd;

use socket2::{Domain, Protocol, Socket, Type};

use crate::error::{Error, Result};

pub(super) fn udp_socket(addr: SocketAddr) -> std::io::Result<Socket> {
    let s = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    s.set_nonblocking(true)?;
    let _ = s.set_recv_buffer_size(8 << 20);
    let _ = s.set_send_buffer_size(8 << 20);
    s.bind(&addr.into())?;
    Ok(s)
}

pub(super) fn set_int_opt(fd: i32, level: i32, opt: i32, val: libc::c_int) -> bool {
    // SAFETY: `val` is a live c_int and we pass its size; a bad fd only makes the call fail.
    unsafe {
        libc::setsockopt(
            fd,
            level,
            opt,
            (&val as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as u32,
        ) == 0
    }
}

/// Whether the kernel knows UDP GSO (`UDP_SEGMENT`, Linux 4.18+).
pub(super) fn udp_gso_supported(fd: i32) -> bool {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `v` and `len` are live and describe a c_int buffer.
    unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_UDP,
            libc::UDP_SEGMENT,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        ) == 0
    }
}

/// Make the kernel send IPv4 id 0 with DF (see the module docs).
pub(super) fn no_fragment(s: &Socket, v6: bool) -> Result<()> {
    let (level, opt, val) = if v6 {
        (
            libc::IPPROTO_IPV6,
            libc::IPV6_MTU_DISCOVER,
            libc::IPV6_PMTUDISC_DO,
        )
    } else {
        (
            libc::IPPROTO_IP,
            libc::IP_MTU_DISCOVER,
            libc::IP_PMTUDISC_DO,
        )
    };
    // SAFETY: `val` is a live c_int and we pass its size; the fd is a valid socket.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            level,
            opt,
            (&val as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as u32,
        )
    };
    if r != 0 {
        return Err(Error::last_os(
            "setsockopt(IP_MTU_DISCOVER, IP_PMTUDISC_DO) on a RoCE v2 send socket",
        ));
    }
    Ok(())
}

/// The largest IB MTU whose packets fit the interface MTU of `ip`.
pub(super) fn path_mtu(ip: IpAddr) -> u32 {
    let ifmtu = crate::bootstrap::ifaces::list()
        .ok()
        .and_then(|l| l.into_iter().find(|i| i.addr == ip))
        .and_then(|i| std::fs::read_to_string(format!("/sys/class/net/{}/mtu", i.name)).ok())
        .and_then(|s| s.trim().parse::<u32>().ok())
        .unwrap_or(1500);
    ib_mtu_for(ifmtu)
}

/// The largest IB MTU whose packets fit in IP packets of `ip_mtu` bytes.
pub(super) fn ib_mtu_for(ip_mtu: u32) -> u32 {
    // IPv6 40 + UDP 8 + BTH 12 + RETH 16 + ImmDt 4 + ICRC 4
    let room = ip_mtu.saturating_sub(84);
    [4096, 2048, 1024, 512, 256]
        .into_iter()
        .find(|m| *m <= room)
        .unwrap_or(256)
}

/// The IP MTU of the kernel's route from `local` to `remote` (`IP_MTU` of a connected
/// socket: the outgoing interface's, the route's own, or a smaller one learnt by path MTU
/// discovery), or `None` where it cannot be asked. An address of this host's own (a `/32`
/// on `lo`, as on a switchless USB4 mesh) routed over a link has that link's MTU, not `lo`'s.
pub(super) fn route_mtu(local: IpAddr, remote: SocketAddr) -> Option<u32> {
    let s = Socket::new(
        Domain::for_address(remote),
        Type::DGRAM,
        Some(Protocol::UDP),
    )
    .ok()?;
    s.bind(&SocketAddr::new(local, 0).into()).ok()?;
    s.connect(&remote.into()).ok()?;
    let (level, opt) = if remote.is_ipv6() {
        (libc::IPPROTO_IPV6, libc::IPV6_MTU)
    } else {
        (libc::IPPROTO_IP, libc::IP_MTU)
    };
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `v` and `len` are live locals and `len` holds the size of `v`; the socket is
    // open for the whole call (a bad option only makes the call fail).
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            level,
            opt,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    (r == 0 && v > 0).then_some(v as u32)
}

/// Room for one control message carrying an int (UDP_GRO) or a u16 (UDP_SEGMENT).
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct Cmsg {
    pub(super) hdr: libc::cmsghdr,
    pub(super) data: [u8; 8],
}

impl Default for Cmsg {
    fn default() -> Cmsg {
        // SAFETY: cmsghdr is plain data; all-zero is a valid value.
        unsafe { std::mem::zeroed() }
    }
}

impl Cmsg {
    /// `UDP_SEGMENT`: cut the datagram into segments of `size` bytes.
    pub(super) fn segment(size: u16) -> Cmsg {
        let mut c = Cmsg::default();
        c.hdr.cmsg_level = libc::SOL_UDP;
        c.hdr.cmsg_type = libc::UDP_SEGMENT;
        // SAFETY: CMSG_LEN only computes a length.
        c.hdr.cmsg_len = unsafe { libc::CMSG_LEN(2) } as _;
        c.data[..2].copy_from_slice(&size.to_ne_bytes());
        c
    }
}

/// The segment size of a GRO datagram (`UDP_GRO` control message), if the kernel merged one.
pub(super) fn gro_segment_size(h: &libc::msghdr) -> Option<usize> {
    // SAFETY: `h` is a message header the kernel filled, its control buffer (if any) is ours
    // and valid; CMSG_FIRSTHDR/CMSG_NXTHDR stay inside `msg_controllen`.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(h);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_UDP && (*c).cmsg_type == libc::UDP_GRO {
                let v = std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const libc::c_int);
                return usize::try_from(v).ok().filter(|&v| v > 0);
            }
            c = libc::CMSG_NXTHDR(h, c);
        }
    }
    None
}
