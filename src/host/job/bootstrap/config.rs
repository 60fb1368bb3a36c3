//! Where a rank sits in the job and how it reaches rank 0 ([`BootstrapConfig`]), read from the
//! launcher's variables and doorbell's settings.

use crate::error::{Error, Result};
use crate::job::config::{LaunchEnv, Settings, MAX_TIMEOUT};
use std::fmt;
use std::time::Duration;

/// Where this rank sits in the job and how to reach rank 0.
#[derive(Clone, PartialEq, Eq)]
pub struct BootstrapConfig {
    /// Global rank of this process.
    pub rank: usize,
    /// Number of ranks in the job.
    pub world_size: usize,
    /// Rank among the processes on this host.
    pub local_rank: usize,
    /// Number of processes on this host.
    pub local_world_size: usize,
    /// Host name or IP where rank 0 listens.
    pub master_addr: String,
    /// Port where rank 0 listens.
    pub master_port: u16,
    /// Per-job secret every rank shares; connections that cannot prove it are dropped.
    pub secret: Vec<u8>,
    /// Deadline of every bootstrap wait.
    pub timeout: Duration,
    /// A peer silent this long counts as failed ([`super::Bootstrap::health`]); heartbeats go out at a
    /// tenth of it. Zero: no heartbeats.
    pub heartbeat: Duration,
}

impl fmt::Debug for BootstrapConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BootstrapConfig")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("local_rank", &self.local_rank)
            .field("local_world_size", &self.local_world_size)
            .field("master_addr", &self.master_addr)
            .field("master_port", &self.master_port)
            .field("secret", &format_args!("<{} bytes>", self.secret.len()))
            .field("timeout", &self.timeout)
            .field("heartbeat", &self.heartbeat)
            .finish()
    }
}

impl BootstrapConfig {
    /// Reads the launcher's variables ([`LaunchEnv::from_env`]) and the bootstrap timeout
    /// ([`Settings::from_env`]). Fails when no launcher variables are set.
    pub fn from_env() -> Result<Self> {
        let env = LaunchEnv::from_env()?.ok_or_else(|| {
            Error::invalid(
                "RANK/WORLD_SIZE",
                "no launcher variables are set: start the program with torchrun, srun, mpirun, \
                 or doorbell's launch::rank_or_spawn",
            )
        })?;
        let settings = Settings::from_env()?;
        Ok(Self::from_launch(&env, &settings))
    }

    /// Builds the configuration from already parsed launcher variables and settings. Warns when
    /// the job secret is derived rather than given (see [`LaunchEnv::secret`]).
    pub fn from_launch(env: &LaunchEnv, settings: &Settings) -> Self {
        if !env.secret_is_explicit && env.world_size > 1 {
            tracing::warn!(
                rank = env.rank,
                "DOORBELL_JOB_SECRET is not set: the job secret is derived from the launcher's \
                 job id, MASTER_ADDR, MASTER_PORT and the world size, which anyone who can see \
                 this job's processes or guess its id can rebuild and then join or impersonate \
                 a rank; set DOORBELL_JOB_SECRET to the same random value on every rank"
            );
        }
        BootstrapConfig {
            rank: env.rank,
            world_size: env.world_size,
            local_rank: env.local_rank,
            local_world_size: env.local_world_size,
            master_addr: env.master_addr.clone(),
            master_port: env.master_port,
            secret: env.secret.clone(),
            timeout: settings.bootstrap_timeout,
            heartbeat: settings.heartbeat_timeout,
        }
    }

    /// Refuses a rank outside the job (or the host), an empty secret, a zero timeout and
    /// timeouts past a year.
    pub(super) fn validate(&self) -> Result<()> {
        if self.world_size == 0 || self.rank >= self.world_size {
            return Err(Error::invalid(
                "rank",
                format!(
                    "rank {} is not below world size {}",
                    self.rank, self.world_size
                ),
            ));
        }
        if self.local_world_size == 0 || self.local_rank >= self.local_world_size {
            return Err(Error::invalid(
                "local_rank",
                format!(
                    "local rank {} is not below local world size {}",
                    self.local_rank, self.local_world_size
                ),
            ));
        }
        if self.secret.is_empty() {
            return Err(Error::invalid(
                "secret",
                "the job secret is empty; set DOORBELL_JOB_SECRET",
            ));
        }
        if self.timeout.is_zero() {
            return Err(Error::invalid(
                "timeout",
                "a zero bootstrap timeout fails every wait; set DOORBELL_BOOTSTRAP_TIMEOUT_S",
            ));
        }
        for (what, d) in [("timeout", self.timeout), ("heartbeat", self.heartbeat)] {
            if d > MAX_TIMEOUT {
                return Err(Error::invalid(
                    what,
                    format!("{d:?} is longer than a year (config::MAX_TIMEOUT)"),
                ));
            }
        }
        Ok(())
    }
}
