//! InfiniBand/RoCE (issue 6, in progress; `docs/rdma.md` says what ran where). mlx5 send-queue
//! work requests ([`wqe`], checked byte for byte against rdma-core's `mlx5dv.h` helpers in
//! `tests/wqe_golden.rs`) and completion queue entries ([`cq`]); an emulated mlx5 NIC
//! ([`emulator`]) that executes WQEs from a send queue between registered memory regions and
//! writes real CQEs, so the posting code is tested where no NIC exists; queue pairs kernels post
//! to ([`gpu_qp`], device side in `cuda/include/doorbell/ibgda.cuh`), served by that emulator;
//! libibverbs loaded at run time for device discovery ([`verbs`]); and the choice of posting mode
//! with its reason ([`select`]); verbs resources on a real NIC with an RC queue-pair typestate
//! ([`rc`], never run on one); queue pairs of a real mlx5 NIC whose rings the same posters drive
//! ([`hw`], never run on one). Nothing here has run on a NIC.

pub mod conn;
pub mod cq;
pub mod emulated;
pub mod emulator;
pub mod gpu_qp;
pub mod host_qp;
pub mod hw;
pub mod poster;
pub mod provider;
pub mod rc;
pub mod rdma_core;
pub mod select;
pub mod topology;
pub mod verbs;
pub mod wqe;
