//! The verbs boundary: the one interface doorbell asks an RDMA NIC through ([`provider`]), its
//! rdma-core implementation ([`rdma_core`]), the verbs types and device discovery ([`verbs`]), and
//! a real mlx5 NIC's queue-pair rings ([`mlx5dv`]). The emulated NIC's provider implements the same
//! interface in `super::emulated`.

pub mod mlx5dv;
pub mod provider;
pub mod rdma_core;
pub mod verbs;
