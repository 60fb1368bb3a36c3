//! Benchmark support for doorbell's examples: NCCL loaded at run time as the baseline
//! ([`nccl`]), eager and CUDA-graph timing over ranks ([`harness`]), PNG plots of latency and
//! bus bandwidth ([`plot`]), and a cuBLAS GEMM to run beside a collective ([`gemm`]).
//!
//! A workspace member of its own, so the library carries none of it: it uses only doorbell's
//! public API, and doorbell never depends on it (the examples do, as a dev-dependency).

#![warn(missing_docs)]

pub mod gemm;
pub mod harness;
pub mod nccl;
pub mod plot;
