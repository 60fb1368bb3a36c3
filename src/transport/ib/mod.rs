//! InfiniBand/RoCE (`docs/rdma.md` says what ran where), in four rooms:
//! - [`boundary`]: the verbs boundary, everything doorbell asks of a NIC as one interface
//!   ([`boundary::provider`]) with the rdma-core provider ([`boundary::rdma_core`], loaded at run
//!   time; device discovery and the verbs mirrors in [`boundary::verbs`], a real mlx5 NIC's rings
//!   found with `mlx5dv_init_obj` in [`boundary::mlx5dv`]).
//! - [`emulated`]: the emulated mlx5 NIC ([`emulated::nic`], the engine) and the provider that
//!   answers the verbs calls with it, refusing what a ConnectX refuses.
//! - [`posting`]: connected RC queue pairs between ranks, made only through the boundary
//!   ([`posting::conn`]); mlx5 work requests ([`posting::wqe`], checked byte for byte against
//!   rdma-core's `mlx5dv.h` helpers in `tests/wqe_golden.rs`) and completion queue entries
//!   ([`posting::cq`]); the host posters the proxy drives ([`posting::poster`], mlx5 WQEs it
//!   writes in [`posting::host_qp`] or `ibv_post_send`) with the proxy's connection; queue pairs
//!   kernels post to ([`posting::gpu_qp`], device side in `cuda/include/doorbell/ibgda.cuh`); the
//!   posting mode with its reason ([`posting::select`]).
//! - [`topology`]: the NIC nearest each GPU.
//!
//! Nothing here has run on a NIC.

pub mod boundary;
pub mod emulated;
pub mod posting;
pub mod topology;
