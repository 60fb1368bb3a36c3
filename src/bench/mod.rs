//! Benchmark support shared by the examples: NCCL loaded at run time as the baseline, eager and
//! CUDA-graph timing over ranks, and PNG plots of latency and bus bandwidth. Not needed by
//! library users.

pub mod harness;
pub mod nccl;
pub mod plot;
