//! InfiniBand/RoCE (`docs/rdma.md` says what ran where). The verbs boundary ([`provider`]): one
//! interface for everything doorbell asks of a NIC, with two providers, rdma-core loaded at run
//! time ([`rdma_core`], its mlx5 rings found with `mlx5dv_init_obj` in [`hw`]) and the emulated
//! mlx5 NIC ([`emulated`] over the NIC engine in [`emulator`]); connected RC queue pairs between
//! ranks made only through it ([`conn`]); the host posters the proxy drives them with ([`poster`]:
//! mlx5 WQEs it writes, [`host_qp`], or `ibv_post_send`) and queue pairs kernels post to
//! ([`gpu_qp`], device side in `cuda/include/doorbell/ibgda.cuh`); mlx5 work requests ([`wqe`],
//! checked byte for byte against rdma-core's `mlx5dv.h` helpers in `tests/wqe_golden.rs`) and
//! completion queue entries ([`cq`]); device discovery ([`verbs`]); the NIC nearest each GPU
//! ([`topology`]) and the posting mode with its reason ([`select`]). Nothing here has run on a
//! NIC.

pub mod conn;
pub mod cq;
pub mod emulated;
pub mod emulator;
pub mod gpu_qp;
pub mod host_qp;
pub mod hw;
pub mod poster;
pub mod provider;
pub mod rdma_core;
pub mod select;
pub mod topology;
pub mod verbs;
pub mod wqe;
