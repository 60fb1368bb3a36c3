//! How bytes reach a peer, one module per transport: CUDA IPC between processes of one host
//! ([`ipc`]: the peer's VMM allocation or `cudaMalloc` memory mapped here), Ethernet between
//! proxies over TCP ([`ethernet`]), and InfiniBand/RoCE ([`ib`]: verbs loaded at run time, queue
//! pairs, mlx5 WQE and CQE encoding, the emulated NIC, the choice of NIC and posting mode).
//! Channels sit above and pick one per peer; nothing here knows about channels.

pub mod ethernet;
pub mod ib;
pub mod ipc;
