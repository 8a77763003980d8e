//! RDMA: the RoCE v2 wire format, the userspace RC engine, the verbs layer.
pub mod engine;
pub mod hints;
#[cfg(feature = "verbs")]
pub mod ibv;
pub mod mem;
pub mod select;
pub mod udp;
pub mod verbs;
pub mod wire;

#[cfg(test)]
mod sim;
