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
//!   kernels post to ([`posting::gpu_qp`], device side in `cuda/include/doorbell/ib/ibgda.cuh`); the
//!   posting mode with its reason ([`posting::select`]).
//! - [`topology`]: the NIC nearest each GPU.
//!
//! Nothing here has run on a NIC.

pub mod boundary;
pub mod emulated;
pub mod posting;
pub mod topology;

// The module paths before the rooms (2026-11-28), so code written against them still builds.
#[doc(hidden)]
pub use boundary::mlx5dv as hw;
#[doc(hidden)]
pub use boundary::{provider, rdma_core, verbs};
#[doc(hidden)]
pub use emulated::nic as emulator;
#[doc(hidden)]
pub use posting::{conn, cq, gpu_qp, host_qp, poster, select, wqe};

#[cfg(test)]
mod tests {
    /// Code written against the paths before the rooms still names the same items.
    #[test]
    fn the_paths_before_the_rooms_still_resolve() {
        use super::{conn, cq, emulator, gpu_qp, host_qp, hw, poster, provider, rdma_core};
        use super::{select, verbs, wqe};
        assert_eq!(wqe::WQEBB, super::posting::wqe::WQEBB);
        assert_eq!(cq::CQE_BYTES, super::posting::cq::CQE_BYTES);
        let _: Option<emulator::Traffic> = None;
        let _: Option<hw::DvQp> = None;
        let _: Option<&dyn provider::Provider> = None;
        let _: Option<rdma_core::RdmaCore> = None;
        let _: Option<conn::Registration> = None;
        let _: Option<gpu_qp::Posting> = None;
        let _: Option<host_qp::HostQp> = None;
        let _: Option<poster::HostPoster> = None;
        let _: Option<select::PostingMode> = None;
        let _: Option<verbs::Port> = None;
    }
}
