//! Work requests and completions: what the application posts to a queue pair and what its
//! completion queues return (the libibverbs shapes).

use super::Qpn;

/// libibverbs queue-pair states.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QpState {
    /// Created, not usable.
    Reset,
    /// Receives may be posted.
    Init,
    /// Ready to receive.
    Rtr,
    /// Ready to send.
    Rts,
    /// Failed: outstanding and new work requests complete with WR_FLUSH_ERR.
    Error,
}

/// Work request opcodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WrOpcode {
    /// SEND (consumes a receive at the peer).
    Send,
    /// SEND with immediate data.
    SendImm,
    /// RDMA WRITE.
    Write,
    /// RDMA WRITE with immediate (consumes a receive at the peer).
    WriteImm,
    /// RDMA READ.
    Read,
}

/// One scatter/gather element.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sge {
    /// Address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u32,
    /// Key of the region holding it.
    pub lkey: u32,
}

/// A send-queue work request.
#[derive(Clone, Copy, Debug)]
pub struct SendWr {
    /// Returned in the completion.
    pub wr_id: u64,
    /// What to do.
    pub opcode: WrOpcode,
    /// Local data (`None`: zero length).
    pub sge: Option<Sge>,
    /// Copy the data at post time (at most [`super::MAX_INLINE`] bytes; `lkey` is not checked).
    pub inline: bool,
    /// Immediate data for the `*Imm` opcodes.
    pub imm: u32,
    /// Remote address for RDMA.
    pub remote_addr: u64,
    /// Remote key for RDMA.
    pub rkey: u32,
    /// Produce a completion on success (errors always complete).
    pub signaled: bool,
}

/// A receive-queue work request.
#[derive(Clone, Copy, Debug)]
pub struct RecvWr {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Where an incoming SEND lands (`None`: zero length).
    pub sge: Option<Sge>,
}

/// Completion status, numbered as `ibv_wc_status`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WcStatus {
    /// IBV_WC_SUCCESS.
    Success = 0,
    /// IBV_WC_LOC_LEN_ERR: an incoming message was longer than the receive buffer.
    LocLenErr = 1,
    /// IBV_WC_LOC_QP_OP_ERR.
    LocQpOpErr = 2,
    /// IBV_WC_LOC_PROT_ERR: a local buffer is outside its region or lacks the right.
    LocProtErr = 4,
    /// IBV_WC_WR_FLUSH_ERR: the QP entered ERROR before this request ran.
    WrFlushErr = 5,
    /// IBV_WC_REM_INV_REQ_ERR.
    RemInvReqErr = 9,
    /// IBV_WC_REM_ACCESS_ERR: the peer refused the rkey, bounds or rights.
    RemAccessErr = 10,
    /// IBV_WC_REM_OP_ERR.
    RemOpErr = 11,
    /// IBV_WC_RETRY_EXC_ERR: no acknowledgement after all retries.
    RetryExcErr = 12,
    /// IBV_WC_RNR_RETRY_EXC_ERR: the peer had no receive posted after all RNR retries.
    RnrRetryExcErr = 13,
    /// IBV_WC_BAD_RESP_ERR (a NIC only).
    BadRespErr = 7,
    /// IBV_WC_LOC_ACCESS_ERR (a NIC only).
    LocAccessErr = 8,
    /// IBV_WC_REM_ABORT_ERR (a NIC only).
    RemAbortErr = 17,
    /// IBV_WC_FATAL_ERR (a NIC only).
    FatalErr = 19,
    /// IBV_WC_GENERAL_ERR, and any status this enum does not name (a NIC only).
    GeneralErr = 21,
}

impl WcStatus {
    /// From `ibv_wc_status` (unknown values: [`WcStatus::GeneralErr`]).
    pub fn from_ibv(v: u32) -> WcStatus {
        match v {
            0 => WcStatus::Success,
            1 => WcStatus::LocLenErr,
            2 => WcStatus::LocQpOpErr,
            4 => WcStatus::LocProtErr,
            5 => WcStatus::WrFlushErr,
            7 => WcStatus::BadRespErr,
            8 => WcStatus::LocAccessErr,
            9 => WcStatus::RemInvReqErr,
            10 => WcStatus::RemAccessErr,
            11 => WcStatus::RemOpErr,
            12 => WcStatus::RetryExcErr,
            13 => WcStatus::RnrRetryExcErr,
            17 => WcStatus::RemAbortErr,
            19 => WcStatus::FatalErr,
            _ => WcStatus::GeneralErr,
        }
    }
}

/// Completion opcode, numbered as `ibv_wc_opcode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WcOpcode {
    /// IBV_WC_SEND.
    Send = 0,
    /// IBV_WC_RDMA_WRITE.
    RdmaWrite = 1,
    /// IBV_WC_RDMA_READ.
    RdmaRead = 2,
    /// IBV_WC_RECV.
    Recv = 128,
    /// IBV_WC_RECV_RDMA_WITH_IMM.
    RecvRdmaWithImm = 129,
}

/// A work completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Wc {
    /// The work request's id.
    pub wr_id: u64,
    /// Outcome.
    pub status: WcStatus,
    /// What completed.
    pub opcode: WcOpcode,
    /// Bytes received (receives) or transferred.
    pub byte_len: u32,
    /// Immediate data, if the message carried some.
    pub imm: Option<u32>,
    /// The local QP.
    pub qpn: Qpn,
}

impl Wc {
    /// A placeholder to fill arrays that `poll_cq` writes into.
    pub const EMPTY: Wc = Wc {
        wr_id: 0,
        status: WcStatus::Success,
        opcode: WcOpcode::Send,
        byte_len: 0,
        imm: None,
        qpn: 0,
    };
}
