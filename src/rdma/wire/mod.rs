//! The RoCE v2 wire format of the reliable-connected (RC) transport.
//!
//! A RoCE v2 packet is the payload of a UDP datagram (destination port
//! [`ROCEV2_PORT`]): the base transport header (BTH), the extension headers the
//! opcode calls for (RETH, ImmDt, AETH), the payload, 0–3 pad bytes that make
//! payload + pad a multiple of 4, and the 4-byte invariant CRC (ICRC).
//!
//! The ICRC also covers the IP and UDP headers that the kernel writes around
//! the datagram, so [`encode`], [`decode`] and [`icrc`] take an [`IpInfo`] from
//! which those headers are rebuilt (see [`icrc`] for the exact convention).
//!
//! The atomic extension headers (AtomicETH on COMPARE SWAP / FETCH ADD, AtomicAckETH
//! after the AETH of ATOMIC ACKNOWLEDGE) are not parsed here: they travel as the
//! first bytes of [`Packet::payload`].
//!
//! Nothing here allocates; the payload is borrowed from the datagram and hashed in place.

use std::fmt;
use std::net::{IpAddr, Ipv6Addr};

/// UDP destination port of RoCE v2.
pub const ROCEV2_PORT: u16 = 4791;

/// Default partition key.
pub const DEFAULT_PKEY: u16 = 0xffff;

const BTH_LEN: usize = 12;
const RETH_LEN: usize = 16;
const IMM_LEN: usize = 4;
const AETH_LEN: usize = 4;
const ICRC_LEN: usize = 4;
const UDP_HDR_LEN: usize = 8;
const IPV4_HDR_LEN: usize = 20;
const IPV6_HDR_LEN: usize = 40;
/// Largest UDP payload that fits an IPv4 datagram (also applied to IPv6).
const MAX_UDP_PAYLOAD: usize = u16::MAX as usize - IPV4_HDR_LEN - UDP_HDR_LEN;
const MASK24: u32 = 0x00ff_ffff;
/// IPv4 flags/fragment-offset word with only DF set.
const IPV4_DF: u16 = 0x4000;
const IPPROTO_UDP: u8 = 17;

/// RC opcodes (IBTA transport 000), values as in the fact sheet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    /// SEND FIRST.
    SendFirst = 0x00,
    /// SEND MIDDLE.
    SendMiddle = 0x01,
    /// SEND LAST.
    SendLast = 0x02,
    /// SEND LAST WITH IMMEDIATE.
    SendLastImm = 0x03,
    /// SEND ONLY.
    SendOnly = 0x04,
    /// SEND ONLY WITH IMMEDIATE.
    SendOnlyImm = 0x05,
    /// RDMA WRITE FIRST.
    WriteFirst = 0x06,
    /// RDMA WRITE MIDDLE.
    WriteMiddle = 0x07,
    /// RDMA WRITE LAST.
    WriteLast = 0x08,
    /// RDMA WRITE LAST WITH IMMEDIATE.
    WriteLastImm = 0x09,
    /// RDMA WRITE ONLY.
    WriteOnly = 0x0a,
    /// RDMA WRITE ONLY WITH IMMEDIATE.
    WriteOnlyImm = 0x0b,
    /// RDMA READ REQUEST.
    ReadRequest = 0x0c,
    /// RDMA READ RESPONSE FIRST.
    ReadRespFirst = 0x0d,
    /// RDMA READ RESPONSE MIDDLE.
    ReadRespMiddle = 0x0e,
    /// RDMA READ RESPONSE LAST.
    ReadRespLast = 0x0f,
    /// RDMA READ RESPONSE ONLY.
    ReadRespOnly = 0x10,
    /// ACKNOWLEDGE.
    Ack = 0x11,
    /// ATOMIC ACKNOWLEDGE.
    AtomicAck = 0x12,
    /// COMPARE SWAP.
    CompareSwap = 0x13,
    /// FETCH ADD.
    FetchAdd = 0x14,
    /// A roccl report: a userspace-engine extension in the opcode space IBTA leaves to
    /// manufacturers (0xC0–0xFF), sent only to a peer that said at setup it is a roccl
    /// engine, never to a NIC. It carries one AETH-shaped header whose syndrome says the
    /// kind (`rdma::engine::HOLE_SYNDROME`, `DUP_SYNDROME`) and whose MSN field holds the
    /// report; it acknowledges nothing.
    Report = 0xc0,
}

impl Opcode {
    /// Every opcode, indexed by its value.
    const ALL: [Opcode; 21] = {
        use Opcode::*;
        [
            SendFirst,
            SendMiddle,
            SendLast,
            SendLastImm,
            SendOnly,
            SendOnlyImm,
            WriteFirst,
            WriteMiddle,
            WriteLast,
            WriteLastImm,
            WriteOnly,
            WriteOnlyImm,
            ReadRequest,
            ReadRespFirst,
            ReadRespMiddle,
            ReadRespLast,
            ReadRespOnly,
            Ack,
            AtomicAck,
            CompareSwap,
            FetchAdd,
        ]
    };

    /// The opcode with wire value `v`, or `None` if it is not an RC opcode this crate knows.
    pub fn from_u8(v: u8) -> Option<Opcode> {
        match v {
            0xc0 => Some(Opcode::Report),
            _ => Self::ALL.get(usize::from(v)).copied(),
        }
    }

    /// Whether packets with this opcode carry a RETH.
    pub fn has_reth(self) -> bool {
        use Opcode::*;
        matches!(self, WriteFirst | WriteOnly | WriteOnlyImm | ReadRequest)
    }

    /// Whether packets with this opcode carry immediate data (ImmDt).
    pub fn has_imm(self) -> bool {
        use Opcode::*;
        matches!(
            self,
            SendLastImm | SendOnlyImm | WriteLastImm | WriteOnlyImm
        )
    }

    /// Whether packets with this opcode carry an AETH.
    pub fn has_aeth(self) -> bool {
        use Opcode::*;
        matches!(
            self,
            Ack | AtomicAck | ReadRespFirst | ReadRespLast | ReadRespOnly | Report
        )
    }

    /// Whether this is one of the SEND opcodes.
    pub fn is_send(self) -> bool {
        (self as u8) <= Opcode::SendOnlyImm as u8
    }

    /// Whether this is one of the RDMA WRITE opcodes.
    pub fn is_write(self) -> bool {
        (Opcode::WriteFirst as u8..=Opcode::WriteOnlyImm as u8).contains(&(self as u8))
    }

    /// Whether this is one of the RDMA READ RESPONSE opcodes.
    pub fn is_read_response(self) -> bool {
        (Opcode::ReadRespFirst as u8..=Opcode::ReadRespOnly as u8).contains(&(self as u8))
    }

    /// First packet of a multi-packet SEND, RDMA WRITE or READ RESPONSE message.
    pub fn is_first(self) -> bool {
        use Opcode::*;
        matches!(self, SendFirst | WriteFirst | ReadRespFirst)
    }

    /// Middle packet of a multi-packet SEND, RDMA WRITE or READ RESPONSE message.
    pub fn is_middle(self) -> bool {
        use Opcode::*;
        matches!(self, SendMiddle | WriteMiddle | ReadRespMiddle)
    }

    /// Last packet of a multi-packet SEND, RDMA WRITE or READ RESPONSE message.
    pub fn is_last(self) -> bool {
        use Opcode::*;
        matches!(
            self,
            SendLast | SendLastImm | WriteLast | WriteLastImm | ReadRespLast
        )
    }

    /// Sole packet of a single-packet SEND, RDMA WRITE or READ RESPONSE message.
    ///
    /// READ REQUEST, the acknowledgements and the atomics are single packets too,
    /// but are not data messages: none of `is_first`/`is_middle`/`is_last`/`is_only`
    /// holds for them.
    pub fn is_only(self) -> bool {
        use Opcode::*;
        matches!(
            self,
            SendOnly | SendOnlyImm | WriteOnly | WriteOnlyImm | ReadRespOnly
        )
    }

    /// The IBTA name, e.g. `"RDMA WRITE ONLY WITH IMMEDIATE"`.
    pub fn name(self) -> &'static str {
        use Opcode::*;
        match self {
            SendFirst => "SEND FIRST",
            SendMiddle => "SEND MIDDLE",
            SendLast => "SEND LAST",
            SendLastImm => "SEND LAST WITH IMMEDIATE",
            SendOnly => "SEND ONLY",
            SendOnlyImm => "SEND ONLY WITH IMMEDIATE",
            WriteFirst => "RDMA WRITE FIRST",
            WriteMiddle => "RDMA WRITE MIDDLE",
            WriteLast => "RDMA WRITE LAST",
            WriteLastImm => "RDMA WRITE LAST WITH IMMEDIATE",
            WriteOnly => "RDMA WRITE ONLY",
            WriteOnlyImm => "RDMA WRITE ONLY WITH IMMEDIATE",
            ReadRequest => "RDMA READ REQUEST",
            ReadRespFirst => "RDMA READ RESPONSE FIRST",
            ReadRespMiddle => "RDMA READ RESPONSE MIDDLE",
            ReadRespLast => "RDMA READ RESPONSE LAST",
            ReadRespOnly => "RDMA READ RESPONSE ONLY",
            Ack => "ACKNOWLEDGE",
            AtomicAck => "ATOMIC ACKNOWLEDGE",
            CompareSwap => "COMPARE SWAP",
            FetchAdd => "FETCH ADD",
            Report => "ROCCL REPORT (manufacturer-specific 0xC0)",
        }
    }
}

impl fmt::Display for Opcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Base transport header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bth {
    /// Operation code.
    pub opcode: Opcode,
    /// Solicited event (SE).
    pub solicited: bool,
    /// Migration request (M).
    pub mig_req: bool,
    /// Pad count, 0..=3 (set by [`encode`] from the payload length).
    pub pad: u8,
    /// Partition key.
    pub pkey: u16,
    /// Forward explicit congestion notification.
    pub fecn: bool,
    /// Backward explicit congestion notification.
    pub becn: bool,
    /// Destination queue pair number (24 bits).
    pub dest_qp: u32,
    /// Acknowledge request.
    pub ack_req: bool,
    /// Packet sequence number (24 bits).
    pub psn: u32,
}

/// RDMA extended transport header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reth {
    /// Remote virtual address.
    pub va: u64,
    /// Remote key.
    pub rkey: u32,
    /// Length of the whole RDMA operation in bytes.
    pub dma_len: u32,
}

/// NAK codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NakCode {
    /// PSN sequence error.
    PsnSequenceError = 0,
    /// Invalid request.
    InvalidRequest = 1,
    /// Remote access error.
    RemoteAccessError = 2,
    /// Remote operational error.
    RemoteOperationalError = 3,
}

/// Meaning of an AETH syndrome.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AckKind {
    /// Positive acknowledgement with an end-to-end credit count (0x1F = invalid/unlimited).
    Ack {
        /// Credit count code (5 bits).
        credits: u8,
    },
    /// Receiver not ready.
    RnrNak {
        /// RNR timer code (5 bits).
        timer: u8,
    },
    /// Negative acknowledgement.
    Nak(NakCode),
}

/// ACK extended transport header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Aeth {
    /// Syndrome: ACK, RNR NAK or NAK and its 5-bit argument.
    pub syndrome: u8,
    /// Message sequence number (24 bits).
    pub msn: u32,
}

impl Aeth {
    /// A positive ACK with credits 0x1F (invalid/unlimited); `msn` is taken modulo 2^24.
    pub fn ack(msn: u32) -> Aeth {
        Aeth {
            syndrome: 0x1f,
            msn: msn & MASK24,
        }
    }

    /// An RNR NAK with the 5-bit timer code `timer`; `msn` is taken modulo 2^24.
    pub fn rnr_nak(msn: u32, timer: u8) -> Aeth {
        Aeth {
            syndrome: 0x20 | (timer & 0x1f),
            msn: msn & MASK24,
        }
    }

    /// A NAK with `code`; `msn` is taken modulo 2^24.
    pub fn nak(msn: u32, code: NakCode) -> Aeth {
        Aeth {
            syndrome: 0x60 | code as u8,
            msn: msn & MASK24,
        }
    }

    /// What the syndrome means, or `None` for a reserved syndrome.
    pub fn kind(&self) -> Option<AckKind> {
        let arg = self.syndrome & 0x1f;
        match self.syndrome >> 5 {
            0b000 => Some(AckKind::Ack { credits: arg }),
            0b001 => Some(AckKind::RnrNak { timer: arg }),
            0b011 => Some(AckKind::Nak(match arg {
                0 => NakCode::PsnSequenceError,
                1 => NakCode::InvalidRequest,
                2 => NakCode::RemoteAccessError,
                3 => NakCode::RemoteOperationalError,
                _ => return None,
            })),
            _ => None,
        }
    }
}

/// A decoded packet (borrowing its payload from the datagram).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Packet<'a> {
    /// Base transport header.
    pub bth: Bth,
    /// RDMA extended transport header, present iff [`Opcode::has_reth`].
    pub reth: Option<Reth>,
    /// Immediate data, present iff [`Opcode::has_imm`].
    pub imm: Option<u32>,
    /// ACK extended transport header, present iff [`Opcode::has_aeth`].
    pub aeth: Option<Aeth>,
    /// Payload without pad (for atomics, starting with the atomic extension header).
    pub payload: &'a [u8],
}

/// Addresses the ICRC covers (the IP and UDP headers the kernel writes around our datagram).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpInfo {
    /// IP source address.
    pub src: IpAddr,
    /// IP destination address.
    pub dst: IpAddr,
    /// UDP source port.
    pub src_port: u16,
    /// UDP destination port (normally [`ROCEV2_PORT`]).
    pub dst_port: u16,
}

/// Why a datagram was rejected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// Shorter than a BTH plus an ICRC.
    TooShort,
    /// Transport header version (TVer) other than 0.
    BadVersion(u8),
    /// Opcode that is not an RC opcode known here.
    UnknownOpcode(u8),
    /// The opcode's extension headers, or the pad, are longer than what the datagram holds.
    MissingHeader,
    /// The ICRC on the wire (`got`) differs from the one computed (`want`).
    BadIcrc {
        /// ICRC found in the packet.
        got: u32,
        /// ICRC computed over the packet.
        want: u32,
    },
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            DecodeError::TooShort => write!(
                f,
                "RoCE v2 datagram shorter than BTH + ICRC ({} bytes)",
                BTH_LEN + ICRC_LEN
            ),
            DecodeError::BadVersion(v) => write!(f, "unsupported BTH transport version {v}"),
            DecodeError::UnknownOpcode(op) => write!(f, "unknown or non-RC BTH opcode {op:#04x}"),
            DecodeError::MissingHeader => {
                f.write_str("RoCE v2 datagram too short for its opcode's extension headers and pad")
            }
            DecodeError::BadIcrc { got, want } => {
                write!(
                    f,
                    "ICRC mismatch: packet has {got:#010x}, computed {want:#010x}"
                )
            }
        }
    }
}

impl std::error::Error for DecodeError {}

/// Header bytes before the payload for this opcode (BTH 12 + RETH 16 + ImmDt 4 + AETH 4 as applicable).
pub fn header_len(op: Opcode) -> usize {
    BTH_LEN
        + if op.has_reth() { RETH_LEN } else { 0 }
        + if op.has_imm() { IMM_LEN } else { 0 }
        + if op.has_aeth() { AETH_LEN } else { 0 }
}

/// Pad bytes after a payload of `payload_len` bytes.
fn pad_len(payload_len: usize) -> usize {
    payload_len.wrapping_neg() & 3
}

/// Bytes on the UDP payload for a packet with `payload_len` payload bytes: headers + payload + pad + 4 (ICRC).
pub fn wire_len(op: Opcode, payload_len: usize) -> usize {
    header_len(op) + payload_len + pad_len(payload_len) + ICRC_LEN
}

fn put24(out: &mut [u8], v: u32) {
    out.copy_from_slice(&v.to_be_bytes()[1..]);
}

fn get24(b: &[u8]) -> u32 {
    u32::from_be_bytes([0, b[0], b[1], b[2]])
}

fn get32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

/// Encode into `buf` (the UDP payload: BTH .. ICRC). Sets bth.pad from the payload length itself
/// (ignores `pkt.bth.pad`), checks that reth/imm/aeth presence matches the opcode (Err(&'static str)
/// otherwise), pads with zeros, appends the ICRC. Returns bytes written; Err if `buf` is too small.
///
/// Also rejects a destination QP, PSN or MSN wider than 24 bits and a packet that would not fit a
/// UDP datagram.
pub fn encode(pkt: &Packet, ip: &IpInfo, buf: &mut [u8]) -> Result<usize, &'static str> {
    encode_segment(pkt, ip, 0, buf)
}

/// Largest number of packets the userspace provider sends as one UDP GSO datagram: a
/// receiver recovers segment indexes below this from the ICRC (see [`encode_segment`]).
pub const MAX_SEGMENTS: usize = 64;

/// Like [`encode`], for a packet that leaves as segment `seg` (0..[`MAX_SEGMENTS`]) of a UDP
/// GSO send. The kernel (or the NIC) cuts such a send into datagrams whose IPv4
/// identifications count up from the send's own: 0 for roccl's unconnected DF sockets, so
/// segment `seg` carries identification `seg`, and its ICRC must cover that. Nothing else in
/// the packet says so (the BTH's reserved bits stay zero, as the specification asks): the
/// receiver, which cannot see the IP header, recovers the identification from the ICRC
/// itself ([`decode`]). A packet sent on its own is segment 0.
pub fn encode_segment(
    pkt: &Packet,
    ip: &IpInfo,
    seg: u8,
    buf: &mut [u8],
) -> Result<usize, &'static str> {
    let b = &pkt.bth;
    if usize::from(seg) >= MAX_SEGMENTS {
        return Err("GSO segment index beyond MAX_SEGMENTS");
    }
    let op = b.opcode;
    if pkt.reth.is_some() != op.has_reth() {
        return Err(if op.has_reth() {
            "opcode requires a RETH"
        } else {
            "opcode takes no RETH"
        });
    }
    if pkt.imm.is_some() != op.has_imm() {
        return Err(if op.has_imm() {
            "opcode requires immediate data"
        } else {
            "opcode takes no immediate data"
        });
    }
    if pkt.aeth.is_some() != op.has_aeth() {
        return Err(if op.has_aeth() {
            "opcode requires an AETH"
        } else {
            "opcode takes no AETH"
        });
    }
    if b.dest_qp > MASK24 {
        return Err("destination QP wider than 24 bits");
    }
    if b.psn > MASK24 {
        return Err("PSN wider than 24 bits");
    }
    if pkt.aeth.is_some_and(|a| a.msn > MASK24) {
        return Err("MSN wider than 24 bits");
    }
    let plen = pkt.payload.len();
    let len = wire_len(op, plen);
    if len > MAX_UDP_PAYLOAD {
        return Err("packet too large for a UDP datagram");
    }
    let out = buf
        .get_mut(..len)
        .ok_or("buffer too small for the packet")?;
    let pad = pad_len(plen);

    out[0] = op as u8;
    out[1] = u8::from(b.solicited) << 7 | u8::from(b.mig_req) << 6 | (pad as u8) << 4;
    out[2..4].copy_from_slice(&b.pkey.to_be_bytes());
    out[4] = u8::from(b.fecn) << 7 | u8::from(b.becn) << 6;
    put24(&mut out[5..8], b.dest_qp);
    out[8] = u8::from(b.ack_req) << 7;
    put24(&mut out[9..12], b.psn);
    let mut at = BTH_LEN;
    if let Some(r) = pkt.reth {
        out[at..at + 8].copy_from_slice(&r.va.to_be_bytes());
        out[at + 8..at + 12].copy_from_slice(&r.rkey.to_be_bytes());
        out[at + 12..at + 16].copy_from_slice(&r.dma_len.to_be_bytes());
        at += RETH_LEN;
    }
    if let Some(imm) = pkt.imm {
        out[at..at + IMM_LEN].copy_from_slice(&imm.to_be_bytes());
        at += IMM_LEN;
    }
    if let Some(a) = pkt.aeth {
        out[at] = a.syndrome;
        put24(&mut out[at + 1..at + 4], a.msn);
        at += AETH_LEN;
    }
    out[at..at + plen].copy_from_slice(pkt.payload);
    at += plen;
    out[at..at + pad].fill(0);
    at += pad;
    let crc = icrc_ipv4_id(ip, u16::from(seg), IPV4_DF, &out[..at]);
    out[at..].copy_from_slice(&crc.to_le_bytes());
    Ok(len)
}

/// Recompute the ICRC of an encoded packet (`datagram`: BTH .. ICRC) for GSO segment `seg`,
/// for a packet that was encoded for one position of a GSO send and leaves at another.
pub fn reseal(datagram: &mut [u8], ip: &IpInfo, seg: u8) -> Result<(), &'static str> {
    if datagram.len() < BTH_LEN + ICRC_LEN {
        return Err("datagram too short");
    }
    if usize::from(seg) >= MAX_SEGMENTS {
        return Err("GSO segment index beyond MAX_SEGMENTS");
    }
    let end = datagram.len() - ICRC_LEN;
    let crc = icrc_ipv4_id(ip, u16::from(seg), IPV4_DF, &datagram[..end]);
    datagram[end..].copy_from_slice(&crc.to_le_bytes());
    Ok(())
}

/// Decode and verify the ICRC (strip pad). With `check_icrc == false` the ICRC is not verified
/// (for captures whose IP header the receiver cannot know).
///
/// The ICRC is checked with the IPv4 convention of [`icrc`] (DF, and identification 0 — or a
/// GSO segment index below [`MAX_SEGMENTS`], found from the ICRC, see [`encode_segment`]);
/// packets from other senders can be checked with `check_icrc == false` and [`icrc_ipv4_id`].
/// Reserved BTH bits and pad contents are ignored, as the specification asks of receivers.
pub fn decode<'a>(
    udp_payload: &'a [u8],
    ip: &IpInfo,
    check_icrc: bool,
) -> Result<Packet<'a>, DecodeError> {
    let d = udp_payload;
    if d.len() < BTH_LEN + ICRC_LEN {
        return Err(DecodeError::TooShort);
    }
    let tver = d[1] & 0x0f;
    if tver != 0 {
        return Err(DecodeError::BadVersion(tver));
    }
    let opcode = Opcode::from_u8(d[0]).ok_or(DecodeError::UnknownOpcode(d[0]))?;
    let pad = (d[1] >> 4) & 3;
    let body_end = d.len() - ICRC_LEN;
    let hlen = header_len(opcode);
    if body_end < hlen + usize::from(pad) {
        return Err(DecodeError::MissingHeader);
    }
    if check_icrc {
        let got = u32::from_le_bytes([
            d[body_end],
            d[body_end + 1],
            d[body_end + 2],
            d[body_end + 3],
        ]);
        // The IPv4 identification is 0, or the packet's index in a GSO send: the ICRC
        // says which (see [`segment_of`]).
        let want = icrc_ipv4_id(ip, 0, IPV4_DF, &d[..body_end]);
        if got != want && segment_of(ip, body_end, got ^ want).is_none() {
            return Err(DecodeError::BadIcrc { got, want });
        }
    }

    let bth = Bth {
        opcode,
        solicited: d[1] & 0x80 != 0,
        mig_req: d[1] & 0x40 != 0,
        pad,
        pkey: u16::from_be_bytes([d[2], d[3]]),
        fecn: d[4] & 0x80 != 0,
        becn: d[4] & 0x40 != 0,
        dest_qp: get24(&d[5..8]),
        ack_req: d[8] & 0x80 != 0,
        psn: get24(&d[9..12]),
    };
    let mut at = BTH_LEN;
    let reth = opcode.has_reth().then(|| {
        let h = &d[at..at + RETH_LEN];
        at += RETH_LEN;
        Reth {
            va: u64::from(get32(&h[..4])) << 32 | u64::from(get32(&h[4..8])),
            rkey: get32(&h[8..12]),
            dma_len: get32(&h[12..16]),
        }
    });
    let imm = opcode.has_imm().then(|| {
        let v = get32(&d[at..at + IMM_LEN]);
        at += IMM_LEN;
        v
    });
    let aeth = opcode.has_aeth().then(|| {
        let h = &d[at..at + AETH_LEN];
        at += AETH_LEN;
        Aeth {
            syndrome: h[0],
            msn: get24(&h[1..4]),
        }
    });
    Ok(Packet {
        bth,
        reth,
        imm,
        aeth,
        payload: &d[at..body_end - usize::from(pad)],
    })
}

/// The IPv4 identification (1..[`MAX_SEGMENTS`]) whose ICRC differs from the ICRC with
/// identification 0 by `diff`, for a packet of `body` bytes before its ICRC; `None` when no
/// identification does (a corrupt packet, or IPv6, which has none).
///
/// The CRC is linear: two messages of one length that differ only in the identification
/// field have ICRCs that differ by the CRC (initial value and final XOR 0) of that difference
/// followed by the zeros of the rest of the message. That depends only on the length, so the
/// differences of the 63 identifications are computed once per packet length (a GSO send's
/// packets share one) and kept in a small per-thread cache; finding the identification of a
/// segment then costs no pass over the packet beyond the one for identification 0.
fn segment_of(ip: &IpInfo, body: usize, diff: u32) -> Option<u16> {
    use std::cell::RefCell;
    /// Lengths whose tables are kept (round robin).
    const KEPT: usize = 4;
    type Table = (usize, [u32; MAX_SEGMENTS]);
    thread_local! {
        static TABLES: RefCell<(usize, [Table; KEPT])> =
            const { RefCell::new((0, [(usize::MAX, [0; MAX_SEGMENTS]); KEPT])) };
    }
    if !matches!(
        (ip.src.to_canonical(), ip.dst.to_canonical()),
        (IpAddr::V4(_), IpAddr::V4(_))
    ) {
        return None;
    }
    // Bytes of the ICRC's input after the identification field: the rest of the IPv4 header,
    // the UDP header, and the packet up to its ICRC.
    let after = IPV4_HDR_LEN - 6 + UDP_HDR_LEN + body;
    TABLES.with(|t| {
        let mut t = t.borrow_mut();
        let (next, tables) = &mut *t;
        let k = match tables.iter().position(|(len, _)| *len == after) {
            Some(k) => k,
            None => {
                let k = *next;
                *next = (k + 1) % KEPT;
                tables[k] = (after, id_differences(after));
                k
            }
        };
        let table = &tables[k].1;
        (1..MAX_SEGMENTS)
            .find(|&id| table[id] == diff)
            .map(|id| id as u16)
    })
}

/// The difference identification `id` makes to an ICRC whose input has `after` bytes after
/// the identification field: the CRC with initial value and final XOR 0 (crc32fast continues
/// from a finished CRC, which it inverts first) of the identification's big-endian bytes and
/// `after` zeros.
fn id_difference(id: u16, after: usize) -> u32 {
    const ZEROS: [u8; 4096] = [0; 4096];
    let mut h = crc32fast::Hasher::new_with_initial(!0);
    h.update(&id.to_be_bytes());
    let mut left = after;
    while left > 0 {
        let n = left.min(ZEROS.len());
        h.update(&ZEROS[..n]);
        left -= n;
    }
    !h.finalize()
}

/// For each identification `id` below [`MAX_SEGMENTS`], the difference it makes to an ICRC
/// whose input has `after` bytes after the identification field.
fn id_differences(after: usize) -> [u32; MAX_SEGMENTS] {
    const BITS: usize = MAX_SEGMENTS.trailing_zeros() as usize;
    let bits: [u32; BITS] = std::array::from_fn(|b| id_difference(1 << b, after));
    let mut table = [0u32; MAX_SEGMENTS];
    for (id, d) in table.iter_mut().enumerate() {
        *d = bits
            .iter()
            .enumerate()
            .filter(|(b, _)| id >> b & 1 == 1)
            .fold(0, |acc, (_, x)| acc ^ x);
    }
    table
}

/// The IPv4 identification, any of the 65536, whose ICRC differs by `diff` from the ICRC
/// with identification 0, for a packet of `body` bytes before its ICRC; `None` when none
/// does (a corrupt packet, or IPv6).
///
/// A NIC (Linux rxe, ConnectX, E810) numbers its IPv4 packets as the kernel or its firmware
/// likes, and a UDP socket does not show the IP header, so the engine finds the
/// identification from the ICRC itself: the difference is linear in the identification's 16
/// bits, so it is solved by elimination over their 16 differences (kept per packet length).
/// The ICRC then still detects corruption, with 16 of its 32 bits (one corrupt packet in
/// 65536 would pass; the link's own FCS is in front of it).
pub fn any_ipv4_id(ip: &IpInfo, body: usize, diff: u32) -> Option<u16> {
    use std::cell::RefCell;
    const KEPT: usize = 8;
    thread_local! {
        static SOLVERS: RefCell<(usize, [(usize, IdSolver); KEPT])> =
            RefCell::new((0, [(usize::MAX, IdSolver::default()); KEPT]));
    }
    if !matches!(
        (ip.src.to_canonical(), ip.dst.to_canonical()),
        (IpAddr::V4(_), IpAddr::V4(_))
    ) {
        return None;
    }
    let after = IPV4_HDR_LEN - 6 + UDP_HDR_LEN + body;
    SOLVERS.with(|t| {
        let mut t = t.borrow_mut();
        let (next, solvers) = &mut *t;
        let k = match solvers.iter().position(|(len, _)| *len == after) {
            Some(k) => k,
            None => {
                let k = *next;
                *next = (k + 1) % KEPT;
                solvers[k] = (after, IdSolver::new(after));
                k
            }
        };
        solvers[k].1.solve(diff)
    })
}

/// The 16 identification bits' ICRC differences in echelon form: each row a difference with
/// its own highest bit (the pivot), and the identification bits that make it.
#[derive(Clone, Copy, Default)]
struct IdSolver {
    rows: [(u32, u16); 16],
    n: usize,
}

impl IdSolver {
    fn new(after: usize) -> IdSolver {
        let mut s = IdSolver::default();
        for b in 0..16 {
            let (v, m) = s.reduce(id_difference(1 << b, after), 1 << b);
            if v != 0 {
                s.rows[s.n] = (v, m);
                s.n += 1;
                // Highest pivot first, so that reducing never sets a pivot already passed.
                s.rows[..s.n].sort_unstable_by_key(|r| r.0.leading_zeros());
            }
        }
        s
    }

    /// `v` with every row whose pivot it has taken out, and the bits `m` then stands for.
    fn reduce(&self, mut v: u32, mut m: u16) -> (u32, u16) {
        for &(r, rm) in &self.rows[..self.n] {
            if v & (1u32 << (31 - r.leading_zeros())) != 0 {
                v ^= r;
                m ^= rm;
            }
        }
        (v, m)
    }

    fn solve(&self, diff: u32) -> Option<u16> {
        match self.reduce(diff, 0) {
            (0, id) => Some(id),
            _ => None,
        }
    }
}

/// The ICRC of a UDP payload (BTH .. end of pad, i.e. without the 4 ICRC bytes), per the fact
/// sheet, reconstructing the IP and UDP headers around it.
///
/// The CRC-32 (zlib) runs over 8 bytes of 0xFF, then:
/// - IPv4: version/IHL 0x45, TOS masked (0xFF), total length = 20 + 8 + UDP payload incl. ICRC,
///   identification 0, flags DF (0x4000) with fragment offset 0 — what an unconnected UDP socket
///   with `IP_MTU_DISCOVER = IP_PMTUDISC_DO` sends, the convention roccl's sender follows —,
///   TTL masked, protocol 17, checksum masked, source, destination;
/// - IPv6: version 6 kept, traffic class and flow label masked, payload length = 8 + UDP payload
///   incl. ICRC, next header 17, hop limit masked, source, destination;
/// - the UDP header: ports, length = 8 + UDP payload incl. ICRC, checksum masked (0xFFFF);
/// - the BTH with byte 4 (FECN, BECN, reserved) masked to 0xFF, then the rest as is.
///
/// The IPv4 header is used when both addresses are IPv4 or IPv4-mapped IPv6 (as a dual-stack
/// socket reports IPv4 peers); otherwise the IPv6 header, with any IPv4 address mapped.
/// The result is the u32 that is stored little-endian on the wire.
pub fn icrc(ip: &IpInfo, udp_payload_without_icrc: &[u8]) -> u32 {
    icrc_ipv4_id(ip, 0, IPV4_DF, udp_payload_without_icrc)
}

/// Like [`icrc`], but with the IPv4 identification `id` and flags/fragment-offset word
/// `flags_frag` (e.g. 0x4000 for DF) the sender actually used, so that packets from senders with
/// other conventions (such as hardware captures) can be verified. Both are ignored when the
/// header is IPv6.
pub fn icrc_ipv4_id(ip: &IpInfo, id: u16, flags_frag: u16, udp_payload_without_icrc: &[u8]) -> u32 {
    let p = udp_payload_without_icrc;
    // Lengths are 16-bit on the wire; oversize input wraps like the header field would.
    let udp_len = (UDP_HDR_LEN + p.len() + ICRC_LEN) as u16;
    // Pseudo-LRH + largest IP header + UDP header + BTH, pre-filled with the mask value.
    let mut hdr = [0xffu8; 8 + IPV6_HDR_LEN + UDP_HDR_LEN + BTH_LEN];
    let mut at = 8;
    match (ip.src.to_canonical(), ip.dst.to_canonical()) {
        (IpAddr::V4(src), IpAddr::V4(dst)) => {
            let h = &mut hdr[at..at + IPV4_HDR_LEN];
            h[0] = 0x45; // h[1], TOS: masked
            h[2..4].copy_from_slice(&(udp_len.wrapping_add(IPV4_HDR_LEN as u16)).to_be_bytes());
            h[4..6].copy_from_slice(&id.to_be_bytes());
            h[6..8].copy_from_slice(&flags_frag.to_be_bytes());
            h[9] = IPPROTO_UDP; // h[8], TTL, and h[10..12], checksum: masked
            h[12..16].copy_from_slice(&src.octets());
            h[16..20].copy_from_slice(&dst.octets());
            at += IPV4_HDR_LEN;
        }
        (src, dst) => {
            let v6 = |a: IpAddr| -> Ipv6Addr {
                match a {
                    IpAddr::V4(a) => a.to_ipv6_mapped(),
                    IpAddr::V6(a) => a,
                }
            };
            let h = &mut hdr[at..at + IPV6_HDR_LEN];
            h[0] = 0x6f; // version 6; traffic class and flow label (to h[3]): masked
            h[4..6].copy_from_slice(&udp_len.to_be_bytes());
            h[6] = IPPROTO_UDP; // h[7], hop limit: masked
            h[8..24].copy_from_slice(&v6(src).octets());
            h[24..40].copy_from_slice(&v6(dst).octets());
            at += IPV6_HDR_LEN;
        }
    }
    hdr[at..at + 2].copy_from_slice(&ip.src_port.to_be_bytes());
    hdr[at + 2..at + 4].copy_from_slice(&ip.dst_port.to_be_bytes());
    hdr[at + 4..at + 6].copy_from_slice(&udp_len.to_be_bytes());
    at += UDP_HDR_LEN; // checksum: masked
    let n = p.len().min(BTH_LEN);
    hdr[at..at + n].copy_from_slice(&p[..n]);
    if n > 4 {
        hdr[at + 4] = 0xff; // FECN, BECN, reserved: masked
    }
    at += n;
    let mut h = crc32fast::Hasher::new();
    h.update(&hdr[..at]);
    h.update(&p[n..]);
    h.finalize()
}

#[cfg(test)]
mod tests;
