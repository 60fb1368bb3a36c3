//! MoE expert dispatch and combine, in DeepEP's two modes:
//!
//! - [`MoeHighThroughput`] (`high_throughput.rs`): training and prefill. Each token goes to every
//!   destination rank once; rows arrive packed in source-rank order with counts on the device.
//! - [`MoeLowLatency`] (`low_latency.rs`): decode. Fixed worst-case buffers, a per-expert layout,
//!   no count exchange before rows move, separate send and receive halves.
//!
//! Each is built on one of two paths, chosen once from the communicator: over NVLink when every
//! rank shares a node (`ht_nvlink.rs`, `ll_nvlink.rs`; kernels `moe.cu`, `moe_ll.cu`), or
//! node-spanning (`ht_net.rs`, `ll_net.rs`; kernels `moe_net.cu`) over the receive area both
//! share (`net_area.rs`). Each mode's paths implement one trait (`path.rs`); what every path
//! shares (the shape and its agreement, the results, launching) is in `shared.rs`. [`plan`] is the
//! node-spanning routing modelled on the CPU, for tests.

mod high_throughput;
mod ht_net;
mod ht_nvlink;
mod ll_net;
mod ll_nvlink;
mod low_latency;
mod net_area;
mod packed;
mod path;
pub mod plan;
mod shared;

pub use high_throughput::MoeHighThroughput;
pub use low_latency::MoeLowLatency;
pub use packed::{PackedBuffers, PackedCombineOptions, PackedFormat, PackedHandle, PackedOutputs};
pub use shared::{reference_layout, DispatchResults, FusedSend, LowLatencyResults, MoeConfig};

/// The high-throughput mode's former name.
#[deprecated(note = "renamed `MoeHighThroughput`, paired with `MoeLowLatency`")]
pub type MoeDispatcher = MoeHighThroughput;
