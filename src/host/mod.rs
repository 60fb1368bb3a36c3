//! The host side of doorbell, one folder per layer, bottom to top: `error`, `job` (launch,
//! bootstrap, settings, topology), `gpu` (the CUDA context, memory, waits), `transport` (one
//! folder per way to reach a peer), `channel` (MemoryChannel, PortChannel and the proxy),
//! `communicator` (wiring a job's channels), `collectives` (allreduce, all-to-all, MoE). The
//! crate root re-exports each (`doorbell::channel`, ...); a module imports only from its own layer
//! and those below it (`tests/layers.rs`). The device side's mirrors are `crate::device_api`.

pub mod channel;
pub mod collectives;
pub mod communicator;
pub mod error;
pub mod gpu;
pub mod job;
pub mod transport;
