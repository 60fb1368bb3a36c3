//! This rank's GPU: the CUDA context and streams ([`cuda`]), VMM memory the job's other processes
//! can map and the descriptors that travel to them ([`memory`]), handing allocation fds to
//! same-host peers ([`fd_passing`]), the reports device waits write when they give up or see
//! the abort word ([`wait`]), and the call words of the device-side argument check
//! ([`signature`]). Depends on the job layer only.

pub mod cuda;
pub mod fd_passing;
pub mod memory;
pub mod signature;
pub mod wait;
