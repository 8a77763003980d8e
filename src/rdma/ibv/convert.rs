//! Conversions between the verbs layer's values and libibverbs' (MTU codes, GIDs,
//! opcodes).

use std::net::{IpAddr, Ipv6Addr};

use rdma_sys as ffi;

use crate::rdma::verbs::{WcOpcode, WrOpcode};

/// The name of a port state (`enum ibv_port_state`), as sysfs and `ibv_devinfo` write it.
pub fn port_state_name(state: u32) -> &'static str {
    match state {
        ffi::ibv_port_state::IBV_PORT_NOP => "NOP",
        ffi::ibv_port_state::IBV_PORT_DOWN => "DOWN",
        ffi::ibv_port_state::IBV_PORT_INIT => "INIT",
        ffi::ibv_port_state::IBV_PORT_ARMED => "ARMED",
        ffi::ibv_port_state::IBV_PORT_ACTIVE => "ACTIVE",
        ffi::ibv_port_state::IBV_PORT_ACTIVE_DEFER => "ACTIVE_DEFER",
        _ => "of an unknown state",
    }
}

/// IB MTU code of a size in bytes (the largest that fits).
pub fn mtu_code(bytes: u32) -> u32 {
    match bytes {
        b if b >= 4096 => ffi::ibv_mtu::IBV_MTU_4096,
        b if b >= 2048 => ffi::ibv_mtu::IBV_MTU_2048,
        b if b >= 1024 => ffi::ibv_mtu::IBV_MTU_1024,
        b if b >= 512 => ffi::ibv_mtu::IBV_MTU_512,
        _ => ffi::ibv_mtu::IBV_MTU_256,
    }
}

/// Bytes of an IB MTU code.
pub fn mtu_bytes(code: u32) -> u32 {
    match code {
        ffi::ibv_mtu::IBV_MTU_256 => 256,
        ffi::ibv_mtu::IBV_MTU_512 => 512,
        ffi::ibv_mtu::IBV_MTU_1024 => 1024,
        ffi::ibv_mtu::IBV_MTU_2048 => 2048,
        _ => 4096,
    }
}

/// The GID (16 bytes) of an address: IPv4 as IPv4-mapped IPv6, as RoCE v2 GIDs are.
pub fn gid_of(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
        IpAddr::V6(a) => a.octets(),
    }
}

/// The address of a GID (IPv4-mapped GIDs as IPv4).
pub fn ip_of(gid: [u8; 16]) -> IpAddr {
    Ipv6Addr::from(gid).to_canonical()
}

/// `ibv_wr_opcode` of an opcode.
pub fn wr_opcode(op: WrOpcode) -> u32 {
    match op {
        WrOpcode::Send => ffi::ibv_wr_opcode::IBV_WR_SEND,
        WrOpcode::SendImm => ffi::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM,
        WrOpcode::Write => ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE,
        WrOpcode::WriteImm => ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
        WrOpcode::Read => ffi::ibv_wr_opcode::IBV_WR_RDMA_READ,
    }
}

/// Our opcode of an `ibv_wc_opcode` (`None`: one roccl never posts).
pub fn wc_opcode(op: u32) -> Option<WcOpcode> {
    match op {
        ffi::ibv_wc_opcode::IBV_WC_SEND => Some(WcOpcode::Send),
        ffi::ibv_wc_opcode::IBV_WC_RDMA_WRITE => Some(WcOpcode::RdmaWrite),
        ffi::ibv_wc_opcode::IBV_WC_RDMA_READ => Some(WcOpcode::RdmaRead),
        ffi::ibv_wc_opcode::IBV_WC_RECV => Some(WcOpcode::Recv),
        ffi::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM => Some(WcOpcode::RecvRdmaWithImm),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdma::verbs::{Access, WcStatus};

    #[test]
    fn port_states_are_named_as_sysfs_names_them() {
        let names: Vec<_> = (0..7).map(port_state_name).collect();
        assert_eq!(
            names,
            [
                "NOP",
                "DOWN",
                "INIT",
                "ARMED",
                "ACTIVE",
                "ACTIVE_DEFER",
                "of an unknown state"
            ]
        );
    }

    #[test]
    fn conversions_match_libibverbs() {
        for (b, c) in [(256, 1), (512, 2), (1024, 3), (2048, 4), (4096, 5)] {
            assert_eq!(mtu_code(b), c);
            assert_eq!(mtu_bytes(c), b);
        }
        assert_eq!(mtu_code(9000), ffi::ibv_mtu::IBV_MTU_4096);
        assert_eq!(mtu_code(1500), ffi::ibv_mtu::IBV_MTU_1024);
        let v4: IpAddr = "192.168.7.9".parse().unwrap();
        let g = gid_of(v4);
        assert_eq!(&g[..12], &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff]);
        assert_eq!(ip_of(g), v4);
        let v6: IpAddr = "fd00::7".parse().unwrap();
        assert_eq!(ip_of(gid_of(v6)), v6);
        assert_eq!(wr_opcode(WrOpcode::WriteImm), 1);
        assert_eq!(wr_opcode(WrOpcode::SendImm), 3);
        assert_eq!(wr_opcode(WrOpcode::Read), 4);
        assert_eq!(wc_opcode(129), Some(WcOpcode::RecvRdmaWithImm));
        assert_eq!(wc_opcode(128), Some(WcOpcode::Recv));
        assert_eq!(wc_opcode(3), None);
        // Our access bits are libibverbs' own.
        assert_eq!(
            Access::LOCAL_WRITE.0,
            ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0
        );
        assert_eq!(
            Access::REMOTE_WRITE.0,
            ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
        );
        assert_eq!(
            Access::REMOTE_READ.0,
            ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0
        );
        for s in 0..=22u32 {
            let w = WcStatus::from_ibv(s);
            if w != WcStatus::GeneralErr {
                assert_eq!(w as u32, s);
            }
        }
    }
}
