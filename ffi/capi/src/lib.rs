//! `libroccl.so` / `libroccl.a`: the C ABI of roccl (`include/roccl.h`). The functions live
//! in `ffi/capi-core` (shared with the NCCL-named library, `ffi/nccl`); this crate only
//! links them into the libraries, with the soname set in `build.rs`.

pub use roccl_capi_core::*;
