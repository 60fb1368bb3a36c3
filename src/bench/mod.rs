//! Benchmark support shared by the examples: NCCL loaded at run time as the baseline, and PNG
//! plots of latency and bus bandwidth. Not needed by library users.

pub mod nccl;
pub mod plot;
