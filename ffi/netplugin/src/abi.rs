//! The exported tables, one per NCCL plugin version, with the layouts of NCCL's `net_v8.h` to
//! `net_v12.h`. Each entry is a thin `extern "C"` shim over the shared implementation.
#![allow(non_upper_case_globals)] // the exported names are NCCL's

use std::ffi::{c_char, c_int, c_void};

use super::*;

/// `ncclNetVDeviceProps_vN_t` (N devices: 4 up to v11, 8 from v12).
#[repr(C)]
pub struct VProps<const N: usize> {
    /// Devices merged into this virtual device.
    pub ndevs: c_int,
    /// Their indices.
    pub devs: [c_int; N],
}

/// `ncclNetProperties_v8_t`.
#[repr(C)]
pub struct PropsV8 {
    /// Device name.
    pub name: *mut c_char,
    /// PCI path in sysfs, NULL for a virtual device.
    pub pci_path: *mut c_char,
    /// Unique id of the NIC.
    pub guid: u64,
    /// NCCL_PTR_HOST | NCCL_PTR_DMABUF.
    pub ptr_support: c_int,
    /// regMr not tied to a comm.
    pub reg_is_global: c_int,
    /// Mbit/s.
    pub speed: c_int,
    /// Port number.
    pub port: c_int,
    /// µs.
    pub latency: f32,
    /// Comms per device.
    pub max_comms: c_int,
    /// Buffers per grouped receive.
    pub max_recvs: c_int,
    /// ncclNetDeviceType (0: host).
    pub net_device_type: c_int,
    /// Offload version.
    pub net_device_version: c_int,
}

/// `ncclNetProperties_v9_t` and `_v10_t` (same layout).
#[repr(C)]
pub struct PropsV9 {
    /// Device name.
    pub name: *mut c_char,
    /// PCI path in sysfs, NULL for a virtual device.
    pub pci_path: *mut c_char,
    /// Unique id of the NIC.
    pub guid: u64,
    /// NCCL_PTR_HOST | NCCL_PTR_DMABUF.
    pub ptr_support: c_int,
    /// regMr not tied to a comm.
    pub reg_is_global: c_int,
    /// Force a flush on receives.
    pub force_flush: c_int,
    /// Mbit/s.
    pub speed: c_int,
    /// Port number.
    pub port: c_int,
    /// µs.
    pub latency: f32,
    /// Comms per device.
    pub max_comms: c_int,
    /// Buffers per grouped receive.
    pub max_recvs: c_int,
    /// ncclNetDeviceType (0: host).
    pub net_device_type: c_int,
    /// Offload version.
    pub net_device_version: c_int,
    /// Virtual device.
    pub v_props: VProps<4>,
    /// Largest point-to-point transfer.
    pub max_p2p_bytes: usize,
    /// Largest collective transfer.
    pub max_coll_bytes: usize,
}

/// `ncclNetProperties_v11_t`.
#[repr(C)]
pub struct PropsV11 {
    /// The v9/v10 fields.
    pub base: PropsV9,
    /// Requests in one multi-request.
    pub max_multi_request_size: c_int,
}

/// `ncclNetProperties_v12_t`.
#[repr(C)]
pub struct PropsV12 {
    /// Device name.
    pub name: *mut c_char,
    /// PCI path in sysfs, NULL for a virtual device.
    pub pci_path: *mut c_char,
    /// Unique id of the NIC.
    pub guid: u64,
    /// NCCL_PTR_HOST | NCCL_PTR_DMABUF.
    pub ptr_support: c_int,
    /// regMr not tied to a comm.
    pub reg_is_global: c_int,
    /// Force a flush on receives.
    pub force_flush: c_int,
    /// Mbit/s.
    pub speed: c_int,
    /// Port number.
    pub port: c_int,
    /// µs.
    pub latency: f32,
    /// Comms per device.
    pub max_comms: c_int,
    /// Buffers per grouped receive.
    pub max_recvs: c_int,
    /// ncclNetDeviceType (0: host).
    pub net_device_type: c_int,
    /// Offload version.
    pub net_device_version: c_int,
    /// Virtual device.
    pub v_props: VProps<8>,
    /// Largest point-to-point transfer.
    pub max_p2p_bytes: usize,
    /// Largest collective transfer.
    pub max_coll_bytes: usize,
    /// Requests in one multi-request.
    pub max_multi_request_size: c_int,
    /// Rail of the netdev (NCCL_NET_ID_UNDEF: -1).
    pub rail_id: i16,
    /// Plane of the netdev (-1).
    pub plane_id: i16,
}

impl PropsOut for PropsV8 {
    fn fill(&mut self, c: &CommonProps) {
        self.name = c.name;
        self.pci_path = c.pci;
        self.guid = c.guid;
        self.ptr_support = c.ptr_support;
        self.speed = c.speed;
        self.port = c.port;
        self.latency = c.latency;
        self.max_comms = c.max_comms;
        self.max_recvs = c.max_recvs;
    }
}

impl PropsOut for PropsV9 {
    fn fill(&mut self, c: &CommonProps) {
        self.name = c.name;
        self.pci_path = c.pci;
        self.guid = c.guid;
        self.ptr_support = c.ptr_support;
        self.speed = c.speed;
        self.port = c.port;
        self.latency = c.latency;
        self.max_comms = c.max_comms;
        self.max_recvs = c.max_recvs;
        self.v_props.ndevs = 1;
        self.v_props.devs[0] = c.dev;
        self.max_p2p_bytes = c.max_bytes;
        self.max_coll_bytes = c.max_bytes;
    }
}

impl PropsOut for PropsV11 {
    fn fill(&mut self, c: &CommonProps) {
        self.base.fill(c);
        self.max_multi_request_size = 1;
    }
}

impl PropsOut for PropsV12 {
    fn fill(&mut self, c: &CommonProps) {
        self.name = c.name;
        self.pci_path = c.pci;
        self.guid = c.guid;
        self.ptr_support = c.ptr_support;
        self.speed = c.speed;
        self.port = c.port;
        self.latency = c.latency;
        self.max_comms = c.max_comms;
        self.max_recvs = c.max_recvs;
        self.v_props.ndevs = 1;
        self.v_props.devs[0] = c.dev;
        self.max_p2p_bytes = c.max_bytes;
        self.max_coll_bytes = c.max_bytes;
        self.max_multi_request_size = 1;
        self.rail_id = -1;
        self.plane_id = -1;
    }
}

/// `ncclNetCommConfig_vN_t`.
#[repr(C)]
pub struct CommConfig {
    /// Traffic class NCCL asks for (NCCL_NET_TRAFFIC_CLASS_UNDEF: -1).
    pub traffic_class: c_int,
}

/// `ncclProfilerCallback_t` (unused).
pub type ProfCb =
    Option<unsafe extern "C" fn(*mut *mut c_void, c_int, *mut c_void, i64, *mut c_void) -> c_int>;

type P = *mut c_void;
type PP = *mut *mut c_void;
type Res = NcclResult;

// ---- shims shared by several versions -------------------------------------------------

unsafe extern "C" fn devices(n: *mut c_int) -> Res {
    guard("devices", || {
        if n.is_null() {
            return Err(bad("devices: ndev is NULL"));
        }
        let p = plugin()?;
        // SAFETY: checked non-null.
        unsafe { *n = p.names.len() as c_int };
        Ok(())
    })
}

unsafe extern "C" fn accept(l: P, r: PP, dev: PP) -> Res {
    guard("accept", || {
        if !dev.is_null() {
            set_out(dev, std::ptr::null_mut());
        }
        accept_impl(l, r)
    })
}

unsafe extern "C" fn reg_mr(c: P, data: P, size: usize, typ: c_int, mh: PP) -> Res {
    guard("regMr", || reg_mr_impl(c, data, size, typ, mh))
}

unsafe extern "C" fn dereg_mr(c: P, mh: P) -> Res {
    guard("deregMr", || dereg_mr_impl(c, mh))
}

unsafe extern "C" fn reg_mr_dmabuf(
    c: P,
    data: P,
    size: usize,
    typ: c_int,
    offset: u64,
    fd: c_int,
    mh: PP,
) -> Res {
    guard("regMrDmaBuf", || {
        reg_mr_dmabuf_impl(c, data, size, typ, offset, fd, mh)
    })
}

unsafe extern "C" fn iflush(c: P, n: c_int, d: PP, s: *mut c_int, _m: PP, req: PP) -> Res {
    guard("iflush", || iflush_impl(c, n, d, s, req))
}

unsafe extern "C" fn test(req: P, done: *mut c_int, sizes: *mut c_int) -> Res {
    guard("test", || test_impl(req, done, sizes))
}

unsafe extern "C" fn close_send(c: P) -> Res {
    guard("closeSend", || {
        close_impl(c, "sendComm", |o| matches!(o, Obj::Send(_)))
    })
}

unsafe extern "C" fn close_recv(c: P) -> Res {
    guard("closeRecv", || {
        close_impl(c, "recvComm", |o| matches!(o, Obj::Recv(_)))
    })
}

unsafe extern "C" fn close_listen(c: P) -> Res {
    guard("closeListen", || {
        close_impl(c, "listenComm", |o| matches!(o, Obj::Listen(_)))
    })
}

unsafe extern "C" fn irecv_consumed(c: P, _n: c_int, _req: P) -> Res {
    guard("irecvConsumed", || lookup(c, "recvComm").map(|_| ()))
}

unsafe extern "C" fn connect_plain(dev: c_int, h: P, s: PP, d: PP) -> Res {
    guard("connect", || {
        if !d.is_null() {
            set_out(d, std::ptr::null_mut());
        }
        connect_impl(dev, h, s)
    })
}

unsafe extern "C" fn listen_plain(dev: c_int, h: P, l: PP) -> Res {
    guard("listen", || listen_impl(dev, h, l))
}

fn sizes_int(s: *mut c_int) -> impl Fn(usize) -> usize {
    // SAFETY (in the closure): NCCL passes `n` sizes; irecv_impl reads indices below n.
    move |i| {
        if s.is_null() {
            0
        } else {
            unsafe { *s.add(i) }.max(0) as usize
        }
    }
}

fn sizes_usize(s: *mut usize) -> impl Fn(usize) -> usize {
    // SAFETY (in the closure): as above.
    move |i| if s.is_null() { 0 } else { unsafe { *s.add(i) } }
}

// ---- v8 -------------------------------------------------------------------------------

unsafe extern "C" fn init_v8(log: Logger) -> Res {
    guard("init", || init_impl(log))
}
unsafe extern "C" fn props_v8(dev: c_int, p: *mut PropsV8) -> Res {
    guard("getProperties", || properties_impl(dev, p))
}
unsafe extern "C" fn isend_v8(c: P, d: P, size: c_int, tag: c_int, mh: P, req: PP) -> Res {
    guard("isend", || {
        isend_impl(c, d, size.max(0) as usize, tag, mh, req)
    })
}
unsafe extern "C" fn irecv_v8(
    c: P,
    n: c_int,
    d: PP,
    s: *mut c_int,
    t: *mut c_int,
    m: PP,
    req: PP,
) -> Res {
    guard("irecv", || irecv_impl(c, n, d, sizes_int(s), t, m, req))
}

/// `ncclNet_v8_t`.
#[repr(C)]
pub struct NetV8 {
    name: *const c_char,
    init: Option<unsafe extern "C" fn(Logger) -> Res>,
    devices: Option<unsafe extern "C" fn(*mut c_int) -> Res>,
    get_properties: Option<unsafe extern "C" fn(c_int, *mut PropsV8) -> Res>,
    listen: Option<unsafe extern "C" fn(c_int, P, PP) -> Res>,
    connect: Option<unsafe extern "C" fn(c_int, P, PP, PP) -> Res>,
    accept: Option<unsafe extern "C" fn(P, PP, PP) -> Res>,
    reg_mr: Option<unsafe extern "C" fn(P, P, usize, c_int, PP) -> Res>,
    reg_mr_dmabuf: Option<unsafe extern "C" fn(P, P, usize, c_int, u64, c_int, PP) -> Res>,
    dereg_mr: Option<unsafe extern "C" fn(P, P) -> Res>,
    isend: Option<unsafe extern "C" fn(P, P, c_int, c_int, P, PP) -> Res>,
    irecv: Option<unsafe extern "C" fn(P, c_int, PP, *mut c_int, *mut c_int, PP, PP) -> Res>,
    iflush: Option<unsafe extern "C" fn(P, c_int, PP, *mut c_int, PP, PP) -> Res>,
    test: Option<unsafe extern "C" fn(P, *mut c_int, *mut c_int) -> Res>,
    close_send: Option<unsafe extern "C" fn(P) -> Res>,
    close_recv: Option<unsafe extern "C" fn(P) -> Res>,
    close_listen: Option<unsafe extern "C" fn(P) -> Res>,
    get_device_mr: Option<unsafe extern "C" fn(P, P, PP) -> Res>,
    irecv_consumed: Option<unsafe extern "C" fn(P, c_int, P) -> Res>,
}

// SAFETY: the tables are immutable; `name` points to a static C string.
unsafe impl Sync for NetV8 {}

/// The v8 plugin table.
#[no_mangle]
pub static ncclNetPlugin_v8: NetV8 = NetV8 {
    name: c"roccl".as_ptr(),
    init: Some(init_v8),
    devices: Some(devices),
    get_properties: Some(props_v8),
    listen: Some(listen_plain),
    connect: Some(connect_plain),
    accept: Some(accept),
    reg_mr: Some(reg_mr),
    reg_mr_dmabuf: Some(reg_mr_dmabuf),
    dereg_mr: Some(dereg_mr),
    isend: Some(isend_v8),
    irecv: Some(irecv_v8),
    iflush: Some(iflush),
    test: Some(test),
    close_send: Some(close_send),
    close_recv: Some(close_recv),
    close_listen: Some(close_listen),
    get_device_mr: None,
    irecv_consumed: Some(irecv_consumed),
};

// ---- v9 -------------------------------------------------------------------------------

unsafe extern "C" fn props_v9(dev: c_int, p: *mut PropsV9) -> Res {
    guard("getProperties", || properties_impl(dev, p))
}
unsafe extern "C" fn isend_v9(c: P, d: P, size: usize, tag: c_int, mh: P, req: PP) -> Res {
    guard("isend", || isend_impl(c, d, size, tag, mh, req))
}
unsafe extern "C" fn irecv_v9(
    c: P,
    n: c_int,
    d: PP,
    s: *mut usize,
    t: *mut c_int,
    m: PP,
    req: PP,
) -> Res {
    guard("irecv", || irecv_impl(c, n, d, sizes_usize(s), t, m, req))
}

/// `ncclNet_v9_t`.
#[repr(C)]
pub struct NetV9 {
    name: *const c_char,
    init: Option<unsafe extern "C" fn(Logger) -> Res>,
    devices: Option<unsafe extern "C" fn(*mut c_int) -> Res>,
    get_properties: Option<unsafe extern "C" fn(c_int, *mut PropsV9) -> Res>,
    listen: Option<unsafe extern "C" fn(c_int, P, PP) -> Res>,
    connect: Option<unsafe extern "C" fn(c_int, P, PP, PP) -> Res>,
    accept: Option<unsafe extern "C" fn(P, PP, PP) -> Res>,
    reg_mr: Option<unsafe extern "C" fn(P, P, usize, c_int, PP) -> Res>,
    reg_mr_dmabuf: Option<unsafe extern "C" fn(P, P, usize, c_int, u64, c_int, PP) -> Res>,
    dereg_mr: Option<unsafe extern "C" fn(P, P) -> Res>,
    isend: Option<unsafe extern "C" fn(P, P, usize, c_int, P, PP) -> Res>,
    irecv: Option<unsafe extern "C" fn(P, c_int, PP, *mut usize, *mut c_int, PP, PP) -> Res>,
    iflush: Option<unsafe extern "C" fn(P, c_int, PP, *mut c_int, PP, PP) -> Res>,
    test: Option<unsafe extern "C" fn(P, *mut c_int, *mut c_int) -> Res>,
    close_send: Option<unsafe extern "C" fn(P) -> Res>,
    close_recv: Option<unsafe extern "C" fn(P) -> Res>,
    close_listen: Option<unsafe extern "C" fn(P) -> Res>,
    get_device_mr: Option<unsafe extern "C" fn(P, P, PP) -> Res>,
    irecv_consumed: Option<unsafe extern "C" fn(P, c_int, P) -> Res>,
    make_vdevice: Option<unsafe extern "C" fn(*mut c_int, *mut VProps<4>) -> Res>,
}

// SAFETY: as for NetV8.
unsafe impl Sync for NetV9 {}

/// The v9 plugin table (makeVDevice NULL: one device per NIC, nothing to merge).
#[no_mangle]
pub static ncclNetPlugin_v9: NetV9 = NetV9 {
    name: c"roccl".as_ptr(),
    init: Some(init_v8),
    devices: Some(devices),
    get_properties: Some(props_v9),
    listen: Some(listen_plain),
    connect: Some(connect_plain),
    accept: Some(accept),
    reg_mr: Some(reg_mr),
    reg_mr_dmabuf: Some(reg_mr_dmabuf),
    dereg_mr: Some(dereg_mr),
    isend: Some(isend_v9),
    irecv: Some(irecv_v9),
    iflush: Some(iflush),
    test: Some(test),
    close_send: Some(close_send),
    close_recv: Some(close_recv),
    close_listen: Some(close_listen),
    get_device_mr: None,
    irecv_consumed: Some(irecv_consumed),
    make_vdevice: None,
};

// ---- v10 ------------------------------------------------------------------------------

unsafe extern "C" fn init_v10(log: Logger, _prof: ProfCb) -> Res {
    guard("init", || init_impl(log))
}
unsafe extern "C" fn connect_v10(dev: c_int, _cfg: *mut CommConfig, h: P, s: PP, d: PP) -> Res {
    // SAFETY: forwarded arguments.
    unsafe { connect_plain(dev, h, s, d) }
}
unsafe extern "C" fn isend_v10(c: P, d: P, size: usize, tag: c_int, mh: P, _ph: P, req: PP) -> Res {
    guard("isend", || isend_impl(c, d, size, tag, mh, req))
}
unsafe extern "C" fn irecv_v10(
    c: P,
    n: c_int,
    d: PP,
    s: *mut usize,
    t: *mut c_int,
    m: PP,
    _ph: PP,
    req: PP,
) -> Res {
    guard("irecv", || irecv_impl(c, n, d, sizes_usize(s), t, m, req))
}

/// `ncclNet_v10_t`.
#[repr(C)]
pub struct NetV10 {
    name: *const c_char,
    init: Option<unsafe extern "C" fn(Logger, ProfCb) -> Res>,
    devices: Option<unsafe extern "C" fn(*mut c_int) -> Res>,
    get_properties: Option<unsafe extern "C" fn(c_int, *mut PropsV9) -> Res>,
    listen: Option<unsafe extern "C" fn(c_int, P, PP) -> Res>,
    connect: Option<unsafe extern "C" fn(c_int, *mut CommConfig, P, PP, PP) -> Res>,
    accept: Option<unsafe extern "C" fn(P, PP, PP) -> Res>,
    reg_mr: Option<unsafe extern "C" fn(P, P, usize, c_int, PP) -> Res>,
    reg_mr_dmabuf: Option<unsafe extern "C" fn(P, P, usize, c_int, u64, c_int, PP) -> Res>,
    dereg_mr: Option<unsafe extern "C" fn(P, P) -> Res>,
    isend: Option<unsafe extern "C" fn(P, P, usize, c_int, P, P, PP) -> Res>,
    irecv: Option<unsafe extern "C" fn(P, c_int, PP, *mut usize, *mut c_int, PP, PP, PP) -> Res>,
    iflush: Option<unsafe extern "C" fn(P, c_int, PP, *mut c_int, PP, PP) -> Res>,
    test: Option<unsafe extern "C" fn(P, *mut c_int, *mut c_int) -> Res>,
    close_send: Option<unsafe extern "C" fn(P) -> Res>,
    close_recv: Option<unsafe extern "C" fn(P) -> Res>,
    close_listen: Option<unsafe extern "C" fn(P) -> Res>,
    get_device_mr: Option<unsafe extern "C" fn(P, P, PP) -> Res>,
    irecv_consumed: Option<unsafe extern "C" fn(P, c_int, P) -> Res>,
    make_vdevice: Option<unsafe extern "C" fn(*mut c_int, *mut VProps<4>) -> Res>,
}

// SAFETY: as for NetV8.
unsafe impl Sync for NetV10 {}

/// The v10 plugin table.
#[no_mangle]
pub static ncclNetPlugin_v10: NetV10 = NetV10 {
    name: c"roccl".as_ptr(),
    init: Some(init_v10),
    devices: Some(devices),
    get_properties: Some(props_v9),
    listen: Some(listen_plain),
    connect: Some(connect_v10),
    accept: Some(accept),
    reg_mr: Some(reg_mr),
    reg_mr_dmabuf: Some(reg_mr_dmabuf),
    dereg_mr: Some(dereg_mr),
    isend: Some(isend_v10),
    irecv: Some(irecv_v10),
    iflush: Some(iflush),
    test: Some(test),
    close_send: Some(close_send),
    close_recv: Some(close_recv),
    close_listen: Some(close_listen),
    get_device_mr: None,
    irecv_consumed: Some(irecv_consumed),
    make_vdevice: None,
};

// ---- v11 and v12: per-communicator contexts ---------------------------------------------

unsafe extern "C" fn init_v11(
    ctx: PP,
    _comm: u64,
    _cfg: *mut CommConfig,
    log: Logger,
    _prof: ProfCb,
) -> Res {
    guard("init", || init_ctx_impl(ctx, log))
}
unsafe extern "C" fn listen_v11(ctx: P, dev: c_int, h: P, l: PP) -> Res {
    guard("listen", || {
        check_ctx(ctx)?;
        listen_impl(dev, h, l)
    })
}
unsafe extern "C" fn connect_v11(ctx: P, dev: c_int, h: P, s: PP, d: PP) -> Res {
    guard("connect", || {
        check_ctx(ctx)?;
        if !d.is_null() {
            set_out(d, std::ptr::null_mut());
        }
        connect_impl(dev, h, s)
    })
}
unsafe extern "C" fn finalize(ctx: P) -> Res {
    guard("finalize", || finalize_impl(ctx))
}
unsafe extern "C" fn set_net_attr(ctx: P, _attr: P) -> Res {
    // Hints about the traffic to come; roccl has nothing to tune from them yet.
    guard("setNetAttr", || check_ctx(ctx))
}
unsafe extern "C" fn props_v11(dev: c_int, p: *mut PropsV11) -> Res {
    guard("getProperties", || properties_impl(dev, p))
}
unsafe extern "C" fn props_v12(dev: c_int, p: *mut PropsV12) -> Res {
    guard("getProperties", || properties_impl(dev, p))
}

macro_rules! net_v11_like {
    ($ty:ident, $props:ty, $vn:literal) => {
        /// `ncclNet_v11_t` / `ncclNet_v12_t`.
        #[repr(C)]
        pub struct $ty {
            name: *const c_char,
            init: Option<unsafe extern "C" fn(PP, u64, *mut CommConfig, Logger, ProfCb) -> Res>,
            devices: Option<unsafe extern "C" fn(*mut c_int) -> Res>,
            get_properties: Option<unsafe extern "C" fn(c_int, *mut $props) -> Res>,
            listen: Option<unsafe extern "C" fn(P, c_int, P, PP) -> Res>,
            connect: Option<unsafe extern "C" fn(P, c_int, P, PP, PP) -> Res>,
            accept: Option<unsafe extern "C" fn(P, PP, PP) -> Res>,
            reg_mr: Option<unsafe extern "C" fn(P, P, usize, c_int, PP) -> Res>,
            reg_mr_dmabuf: Option<unsafe extern "C" fn(P, P, usize, c_int, u64, c_int, PP) -> Res>,
            dereg_mr: Option<unsafe extern "C" fn(P, P) -> Res>,
            isend: Option<unsafe extern "C" fn(P, P, usize, c_int, P, P, PP) -> Res>,
            irecv: Option<
                unsafe extern "C" fn(P, c_int, PP, *mut usize, *mut c_int, PP, PP, PP) -> Res,
            >,
            iflush: Option<unsafe extern "C" fn(P, c_int, PP, *mut c_int, PP, PP) -> Res>,
            test: Option<unsafe extern "C" fn(P, *mut c_int, *mut c_int) -> Res>,
            close_send: Option<unsafe extern "C" fn(P) -> Res>,
            close_recv: Option<unsafe extern "C" fn(P) -> Res>,
            close_listen: Option<unsafe extern "C" fn(P) -> Res>,
            get_device_mr: Option<unsafe extern "C" fn(P, P, PP) -> Res>,
            irecv_consumed: Option<unsafe extern "C" fn(P, c_int, P) -> Res>,
            make_vdevice: Option<unsafe extern "C" fn(*mut c_int, *mut VProps<$vn>) -> Res>,
            finalize: Option<unsafe extern "C" fn(P) -> Res>,
            set_net_attr: Option<unsafe extern "C" fn(P, P) -> Res>,
        }
        // SAFETY: as for NetV8.
        unsafe impl Sync for $ty {}
    };
}

net_v11_like!(NetV11, PropsV11, 4);
net_v11_like!(NetV12, PropsV12, 8);

macro_rules! table_v11_like {
    ($ty:ident, $props:ident) => {
        $ty {
            name: c"roccl".as_ptr(),
            init: Some(init_v11),
            devices: Some(devices),
            get_properties: Some($props),
            listen: Some(listen_v11),
            connect: Some(connect_v11),
            accept: Some(accept),
            reg_mr: Some(reg_mr),
            reg_mr_dmabuf: Some(reg_mr_dmabuf),
            dereg_mr: Some(dereg_mr),
            isend: Some(isend_v10),
            irecv: Some(irecv_v10),
            iflush: Some(iflush),
            test: Some(test),
            close_send: Some(close_send),
            close_recv: Some(close_recv),
            close_listen: Some(close_listen),
            get_device_mr: None,
            irecv_consumed: Some(irecv_consumed),
            make_vdevice: None,
            finalize: Some(finalize),
            set_net_attr: Some(set_net_attr),
        }
    };
}

/// The v11 plugin table.
#[no_mangle]
pub static ncclNetPlugin_v11: NetV11 = table_v11_like!(NetV11, props_v11);

/// The v12 plugin table.
#[no_mangle]
pub static ncclNetPlugin_v12: NetV12 = table_v11_like!(NetV12, props_v12);

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    /// Sizes and offsets as the C compiler lays out NCCL's structs on x86-64 / aarch64.
    #[test]
    fn layouts_match_nccl_headers() {
        assert_eq!(size_of::<PropsV8>(), 64);
        assert_eq!(offset_of!(PropsV8, latency), 40);
        assert_eq!(offset_of!(PropsV8, net_device_version), 56);
        assert_eq!(size_of::<PropsV9>(), 104);
        assert_eq!(offset_of!(PropsV9, v_props), 64);
        assert_eq!(offset_of!(PropsV9, max_p2p_bytes), 88);
        assert_eq!(size_of::<PropsV11>(), 112);
        assert_eq!(offset_of!(PropsV11, max_multi_request_size), 104);
        assert_eq!(offset_of!(PropsV12, v_props), 64);
        assert_eq!(offset_of!(PropsV12, max_p2p_bytes), 104);
        assert_eq!(offset_of!(PropsV12, max_multi_request_size), 120);
        assert_eq!(offset_of!(PropsV12, rail_id), 124);
        assert_eq!(size_of::<PropsV12>(), 128);
        let fp = size_of::<usize>();
        assert_eq!(size_of::<NetV8>(), 19 * fp);
        assert_eq!(size_of::<NetV9>(), 20 * fp);
        assert_eq!(size_of::<NetV10>(), 20 * fp);
        assert_eq!(size_of::<NetV11>(), 22 * fp);
        assert_eq!(size_of::<NetV12>(), 22 * fp);
    }
}
