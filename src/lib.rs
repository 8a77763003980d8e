//! roccl: collective communications for RoCE v2 and Ethernet clusters.
//!
//! The API: [`Communicator`] (with [`Config`], [`UniqueId`] and the calls' types), the data
//! types ([`types`]), errors ([`error`]), the [`net::Net`] trait that network plugins
//! implement, the [`device::Device`] trait for GPU runtimes, and stream-ordered calls
//! ([`comm::stream`]).
//!
//! Layers, top to bottom (docs/ARCHITECTURE.md; `tests/layers.rs` checks that names point
//! only down):
//! - [`comm`]: the communicator, its configuration, call queue and dispatch, and the
//!   stream-ordered scheduling;
//! - [`algo`]: collective algorithms (ring, double binary tree, ...) and the cost model;
//! - `exec`: the executor algorithms run on (regions, buffers, links to peers);
//! - [`net`]: networks behind one ncclNet-shaped trait (TCP, shared memory, RoCE v2);
//! - `rdma`, [`device`], [`bootstrap`]: verbs providers, GPU runtimes, the rendezvous;
//! - `os`, [`types`], [`error`], `log`, `envvar`, `reduce`: OS primitives and foundations.
//!
//! Modules hidden from these docs (`os`, `rdma`, `envvar`, `log`, `reduce`, `tool`) are
//! public only for roccl's own C ABI, plugin and tools: they are not a stable API.
#![deny(missing_docs)]

pub mod algo;
pub mod bootstrap;
pub mod comm;
pub mod device;
#[doc(hidden)]
pub mod envvar;
pub mod error;
pub(crate) mod exec;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
#[doc(hidden)]
pub mod log;
pub mod metrics;
pub mod net;
#[doc(hidden)]
pub mod os;
#[doc(hidden)]
pub mod rdma;
#[doc(hidden)]
pub mod reduce;
#[doc(hidden)]
pub mod tool;
pub mod types;

pub use algo::Algo;
pub use bootstrap::UniqueId;
pub use comm::{CallInfo, CallOpts, Collective, Communicator, Config, Handle, P2p, Turn};
pub use error::{AsyncError, Error, PeerCause, Result};
pub use types::{DataType, Element, RedOp, F8E4M3, F8E5M2};
