//! RDMA: the RoCE v2 wire format, the userspace RC engine, the verbs layer.
pub mod engine;
#[cfg(feature = "verbs")]
pub mod ibv;
pub mod mem;
pub mod reorder;
pub mod select;
pub mod udp;
pub mod verb_errors;
pub mod verbs;
pub mod wire;

#[cfg(test)]
mod engine_pair;
