//! doorbell: GPU-initiated communication for CUDA kernels.
//!
//! Host code sets up bootstrap, shareable GPU memory, semaphores and channels; CUDA kernels then
//! move data and signal peers themselves through the header-only device API in
//! `cuda/include/doorbell/`. See `ARCHITECTURE.md` for the layers.

pub mod bench;
pub mod collectives;
pub mod config;
pub mod device_api;
pub mod error;
pub mod host;

pub use error::{Error, Result, WaitKind};
