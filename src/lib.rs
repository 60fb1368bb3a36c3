//! doorbell: GPU-initiated communication for CUDA kernels.
//!
//! Host code sets up bootstrap, shareable GPU memory, semaphores and channels; CUDA kernels then
//! move data and signal peers themselves through the header-only device API in
//! `cuda/include/doorbell/`. See `ARCHITECTURE.md` for the layers.

#![warn(missing_docs)]

// Layers, bottom to top; a module imports only from layers below it (tests/layers.rs checks).
// The host layers live in src/host/ and keep their paths here (`doorbell::channel`, ...).
pub mod device_api;
mod host;
pub use host::{channel, collectives, communicator, error, gpu, job, transport};

pub use error::{Error, Result, WaitKind};

/// Installs a `tracing` subscriber that prints doorbell's logs to stderr, filtered by
/// `DOORBELL_LOG` (`EnvFilter` syntax; default `warn`). For programs that have no subscriber of
/// their own (the examples call it); a second call, or one after another subscriber was set, does
/// nothing.
pub fn init_logging() {
    let filter = job::config::Settings::from_env()
        .map(|s| s.log_filter)
        .unwrap_or_else(|_| "warn".into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .try_init();
}
