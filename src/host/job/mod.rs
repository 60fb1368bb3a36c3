//! The job, below everything else: settings from the environment ([`config`]), the bootstrap
//! that joins ranks over TCP and carries every exchange ([`bootstrap`]), the launcher that
//! spawns ranks when a program is started by hand ([`launch`]), the job's shape once the ranks
//! have traded their node ids ([`topology`]), and the job secret's authentication (`auth`).
//! Nothing here touches a GPU.

pub(crate) mod auth;
pub mod bootstrap;
pub mod config;
pub mod launch;
pub(crate) mod socket;
pub mod topology;
