//! Host-side setup: bootstrap, launching, CUDA, memory, semaphores and channels.

mod auth;
pub mod bootstrap;
pub mod communicator;
pub mod cuda;
pub mod ethernet;
pub mod fd_passing;
pub mod launch;
pub mod memory;
mod net;
pub mod proxy;
pub mod signature;
pub mod wait;
pub mod watchdog;
