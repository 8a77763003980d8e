//! Operating-system primitives every layer may use; this layer names nothing above it.
//!
//! An FFI edge: each unsafe block says why it is sound.
//!
//! - [`wait`]: the waiting policy ([`wait::Waiter`]: spin, yield, block in `poll(2)`), the
//!   descriptors to block on ([`wait::PollFd`]) and the default deadline;
//! - [`shm`]: POSIX shared-memory segments;
//! - [`futex`]: sleeping on and waking a counter in shared memory;
//! - [`process`]: other processes of this host (liveness, cross-memory copies);
//! - [`cpu`]: CPU sets and binding; [`mem`]: the locked-memory limit, readable ranges.

pub mod cpu;
pub mod futex;
pub mod mem;
pub mod process;
pub mod shm;
pub mod wait;

pub use cpu::{allowed_cpus, bind_to_cpu, host_cores};
pub use mem::{cpu_readable, memlock_limit};
