//! roccl: collective communications for RoCE v2 and Ethernet clusters.
//!
//! Layers (see docs/ARCHITECTURE.md):
//! - [`types`], [`reduce`]: data types and vectorized reduction kernels;
//! - [`net`]: networks behind one ncclNet-shaped trait (TCP today);
//! - [`bootstrap`]: unique ids, rendezvous, launcher environments, interface choice;
//! - `algo`: collective algorithms (ring, double binary tree, ...) over peer links;
//! - [`Communicator`]: the user-facing object.
#![deny(missing_docs)]

pub mod algo;
pub mod bootstrap;
pub mod comm;
pub mod device;
pub mod envvar;
pub mod error;
pub mod exec;
pub mod log;
pub mod net;
pub mod os;
pub mod rdma;
pub mod reduce;
pub mod tool;
pub mod types;

pub use algo::Algo;
pub use bootstrap::UniqueId;
pub use comm::{CallInfo, CallOpts, Collective, Communicator, Config, Handle, P2p, Turn};
pub use error::{Error, Result};
pub use types::{DataType, Element, RedOp, F8E4M3, F8E5M2};
