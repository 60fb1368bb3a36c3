//! InfiniBand/RoCE (issue 6, in progress). So far: the mlx5 send-queue work-request encoding
//! ([`wqe`]), checked byte for byte against rdma-core's `mlx5dv.h` helpers and struct layouts in
//! `tests/wqe_golden.rs`. No queue pairs, no device access and no GPU posting yet; nothing here has
//! run on a NIC.

pub mod wqe;
