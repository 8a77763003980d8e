//! Pre-multiplied sums as NCCL's custom reduction operations (`ncclRedOpCreatePreMulSum`,
//! `ncclRedOpDestroy`): an op number from `ncclNumOps` (5) up names a communicator, a data
//! type and a scalar; a reducing call with it runs as a sum with the scalar as
//! [`CallOpts::premul`](roccl_core::CallOpts). Numbers are never reused, so a destroyed op
//! is refused, never taken for a later one.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicI32, Ordering};

use parking_lot::Mutex;
use roccl_core::comm::stream::ops::Premul;
use roccl_core::{DataType, RedOp};

use super::{arg, dtype, guard, out_ptr, ready, rocclComm_t, rocclResult_t, R};

/// `ncclNumOps`: the first number of a custom operation.
const NUM_OPS: c_int = 5;
/// `ncclScalarDevice`, `ncclScalarHostImmediate`.
const SCALAR_DEVICE: c_int = 0;
const SCALAR_HOST_IMMEDIATE: c_int = 1;

struct Custom {
    comm: usize,
    dt: DataType,
    scalar: Premul,
}

static OPS: Mutex<Option<HashMap<c_int, Custom>>> = Mutex::new(None);
static NEXT: AtomicI32 = AtomicI32::new(NUM_OPS);

/// `ncclRedOpCreatePreMulSum`: a new op of `comm` that sums each rank's input times
/// `scalar` (one element of `datatype`: read now with `ncclScalarHostImmediate`, read when
/// each call runs with `ncclScalarDevice`).
///
/// # Safety
/// `op` points at storage for one int; `scalar` at one element of `datatype` (host memory,
/// or with `ncclScalarDevice` memory of the GPU runtime), valid as long as the op with
/// `ncclScalarDevice`.
pub unsafe fn create(
    op: *mut c_int,
    scalar: *mut c_void,
    datatype: c_int,
    residence: c_int,
    comm: rocclComm_t,
) -> rocclResult_t {
    guard("ncclRedOpCreatePreMulSum", || {
        // SAFETY: storage for one int (NULL refused).
        let out = unsafe { out_ptr(op, "op") }?;
        let dt = dtype(datatype)?;
        if scalar.is_null() {
            return Err(arg("scalar is NULL"));
        }
        ready(comm)?;
        let scalar = match residence {
            SCALAR_HOST_IMMEDIATE => {
                let mut v = [0u8; 8];
                // SAFETY: one element of `dt` in host memory, per the contract.
                unsafe {
                    std::ptr::copy_nonoverlapping(scalar as *const u8, v.as_mut_ptr(), dt.size())
                };
                Premul::Value(v)
            }
            SCALAR_DEVICE => Premul::At(scalar as usize),
            r => {
                return Err(arg(format!(
                    "residence {r} is neither ncclScalarDevice (0) nor ncclScalarHostImmediate (1)"
                )))
            }
        };
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        if id < NUM_OPS {
            return Err(arg("no op numbers left in this process"));
        }
        OPS.lock().get_or_insert_with(HashMap::new).insert(
            id,
            Custom {
                comm: comm as usize,
                dt,
                scalar,
            },
        );
        *out = id;
        Ok(())
    })
}

/// `ncclRedOpDestroy`: forget an op of `comm` made by [`create`].
pub fn destroy(op: c_int, comm: rocclComm_t) -> rocclResult_t {
    guard("ncclRedOpDestroy", || {
        if RedOp::from_nccl(op).is_some() {
            return Err(arg(format!(
                "op {op} is a built-in reduction: nothing to destroy"
            )));
        }
        let mut ops = OPS.lock();
        let map = ops.get_or_insert_with(HashMap::new);
        match map.get(&op) {
            None => Err(arg(format!(
                "op {op} is not a live op of ncclRedOpCreatePreMulSum (destroyed already?)"
            ))),
            Some(c) if c.comm != comm as usize => {
                Err(arg(format!("op {op} belongs to another communicator")))
            }
            Some(_) => {
                map.remove(&op);
                Ok(())
            }
        }
    })
}

/// Forget every op of the communicator `comm` (it is being destroyed).
pub(crate) fn forget(comm: rocclComm_t) {
    if let Some(map) = OPS.lock().as_mut() {
        map.retain(|_, c| c.comm != comm as usize);
    }
}

/// The reduction of op number `op` on `comm` for a call on `dt`, and its scalar if it is a
/// pre-multiplied sum.
pub(crate) fn resolve(op: c_int, comm: rocclComm_t, dt: DataType) -> R<(RedOp, Option<Premul>)> {
    if let Some(r) = RedOp::from_nccl(op) {
        return Ok((r, None));
    }
    let ops = OPS.lock();
    let Some(c) = ops.as_ref().and_then(|m| m.get(&op)) else {
        return Err(arg(format!(
            "op {op} is neither a reduction (rocclSum 0 … rocclAvg 4) nor a live op of ncclRedOpCreatePreMulSum"
        )));
    };
    if c.comm != comm as usize {
        return Err(arg(format!(
            "op {op} was made for another communicator (ncclRedOpCreatePreMulSum is per communicator)"
        )));
    }
    if c.dt != dt {
        return Err(arg(format!(
            "op {op} was made for {} but the call is on {dt}: make one per data type",
            c.dt
        )));
    }
    Ok((RedOp::Sum, Some(c.scalar)))
}
