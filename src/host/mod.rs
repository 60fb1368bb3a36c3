//! Host-side setup: bootstrap, launching, CUDA, memory, semaphores and channels.

pub mod bootstrap;
pub mod fd_passing;
pub mod launch;
