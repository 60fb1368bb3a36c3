//! InfiniBand/RoCE (issue 6, in progress): the mlx5 send-queue work-request encoding ([`wqe`]),
//! checked byte for byte against rdma-core's `mlx5dv.h` helpers and struct layouts in
//! `tests/wqe_golden.rs`; completion queue entries ([`cq`]); and an emulated mlx5 NIC
//! ([`emulator`]) that executes WQEs from a send queue between registered memory regions and
//! writes real CQEs, so the posting code can be tested where no NIC exists. No verbs device
//! access and no GPU posting yet; nothing here has run on a NIC.

pub mod cq;
pub mod emulator;
pub mod gpu_qp;
pub mod select;
pub mod verbs;
pub mod wqe;
