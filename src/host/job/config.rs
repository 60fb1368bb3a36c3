//! Every environment setting doorbell reads, in one place, each documented once with its typed
//! default. Nothing else in the crate calls `std::env::var`; code asks this module.
//!
//! Parsing takes a lookup function so tests can feed settings without touching the process
//! environment.
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `DOORBELL_LOG` | log filter, `tracing` `EnvFilter` syntax (`info`, `doorbell=debug`) | `warn` |
//! | `DOORBELL_BOOTSTRAP_TIMEOUT_S` | deadline of every bootstrap wait, seconds (at most a year, [`MAX_TIMEOUT`], as every timeout here) | `60` |
//! | `DOORBELL_JOB_SECRET` | per-job secret every rank must share; connections that cannot prove it are dropped | derived from the launcher's job id, see [`LaunchEnv::secret`] |
//! | `DOORBELL_WAIT_TIMEOUT_MS` | budget of every device-side spin loop, milliseconds | `30000` |
//! | `DOORBELL_HEARTBEAT_TIMEOUT_MS` | a peer that sends nothing on its bootstrap link for this long (heartbeats go out at a tenth of it) is declared failed and every communicator of the job aborts; `0` turns heartbeats off (a peer that dies is still noticed at once, by its closed connection) | `5000` |
//! | `DOORBELL_CALL_CHECK` | `0`: collective kernels skip the call check (every call's word compared with the peers' on the device, naming ranks that make different calls as `Error::ArgumentMismatch`); for measuring what the check costs, nothing else | `1` |
//! | `DOORBELL_HOST_CALL_CHECK` | `1`: `AllReduce` (only) also verifies on the host, before launching, that every rank called with the same count and type, and fails naming the odd rank (one bootstrap exchange per call; `AllReduceOptions::check_args` per object); every collective's call is checked on the device anyway (`DOORBELL_CALL_CHECK`). The name before it, `DOORBELL_CHECK`, is still read where this one is unset | `0` |
//! | `DOORBELL_PDL` | `0`: allreduce kernels are launched in plain stream order; by default, on sm_90 and later, each is launched with programmatic dependent launch (it may be scheduled while the kernel before it finishes, and waits for it before touching memory), as NCCL launches its symmetric kernels; for A/B measurements | `1` |
//! | `DOORBELL_ALLREDUCE_ALGO` | force an allreduce algorithm: `oneshot-ll8`, `oneshot-ll16`, `twoshot-ll8`, `twoshot-ll16`, `twoshot-sentinel`, `pipelined` | chosen by size and rank count |
//! | `DOORBELL_PROXY_CPU` | where proxy threads run: `auto` pins each to a core of its GPU's NUMA node (from `/sys/bus/pci/devices/*/local_cpulist`, spread by GPU and proxy), `off` leaves them to the scheduler, a number pins every proxy of the process to that CPU. Pinning did not shorten the FIFO round trip on 4 x H200 (4.71 us pinned, 4.18 us not), hence the default | `off` |
//! | `DOORBELL_BOOTSTRAP_LISTEN_ALL` | `1`: bootstrap listeners bind every interface (`0.0.0.0` or `[::]`), for a rank 0 reached through an address that is not its own (NAT, a proxy); otherwise rank 0 listens on `MASTER_ADDR`'s address when it is one of this host's, and every other rank on the address of its route to rank 0 | `0` |
//! | `DOORBELL_SEPARATE_NODES` | `1`: ranks on one host count as different nodes, so PortChannels take the network transport (Ethernet) instead of CUDA IPC; for testing that path on one machine | `0` |
//! | `DOORBELL_NODE_SIZE` | with `DOORBELL_SEPARATE_NODES=1`: ranks form emulated nodes of this many consecutive ranks (ranks `0..k` one node, `k..2k` the next), PortChannels inside a node taking CUDA IPC and between nodes the network; for testing collectives that span nodes of several GPUs on one machine | `1` |
//! | `DOORBELL_IB_DISABLE` | `1`: PortChannels to ranks on other hosts never take an RDMA NIC (Ethernet instead); by default they take the NIC nearest the GPU when every rank has one (`doorbell-info` shows which) | `0` |
//! | `DOORBELL_IB_EMULATE` | `1`: PortChannels between ranks of different nodes take the Ib transport over doorbell's emulated mlx5 NIC (`transport::ib::emulated`, the same verbs calls a real NIC gets); only for ranks that share one physical host (with `DOORBELL_SEPARATE_NODES=1`), to test the RDMA path where there is no NIC | `0` |
//! | `DOORBELL_IB_EMULATE_RELAXED` | with `DOORBELL_IB_EMULATE=1`: the emulated NIC delivers each RDMA WRITE into data memory (registered with relaxed ordering) after up to this many later operations of its queue pair, as PCIe relaxed ordering may, so a protocol that reads data before a flush (a READ, or a completion) fails its tests; `0`: every write lands in order | `0` |
//! | `DOORBELL_MOE_NET` | `1`: `MoeLowLatency` takes its node-spanning path (NVLink stores to same-node ranks, PortChannel puts to others) even when every rank shares one node; it takes it anyway when the communicator spans nodes | `0` |
//! | `DOORBELL_IB_POSTING` | who posts RDMA work: `auto` (on a real NIC: IBGDA where the GPU may ring the NIC's doorbell, else CPU-assisted for mlx5 NICs, else the verbs proxy, as `doorbell-info` reports; on the emulated NIC: the proxy writing mlx5 WQEs), `ibgda` (kernels write WQEs and ring), `cpu` (kernels write WQEs, a host thread rings), `proxy` (the proxy writes mlx5 WQEs for PortChannel triggers), `verbs` (the proxy posts them with `ibv_post_send` and reaps `ibv_poll_cq`: any NIC, the automatic choice for NICs that are not mlx5) | `auto` |
//! | `DOORBELL_IB_QPS_PER_PEER` | queue pairs per PortChannel for whoever posts its RDMA work (kernels with `DOORBELL_IB_POSTING=ibgda` or `cpu`, else the proxy): puts of 1 MiB or more are striped over them, 1 to 4 | `1` |
//! | `DOORBELL_IB_GID_INDEX` | the GID table index RDMA connections use, instead of the automatic choice (InfiniBand: 0; RoCE: the first RoCE v2 GID with an IPv4 address) | automatic |
//! | `DOORBELL_IB_HCA` | which RDMA NIC ports may be used, NCCL_IB_HCA's syntax: a comma-separated list of `name[:port]`, each name a prefix (`mlx5` matches `mlx5_0`..`mlx5_11`), or exact after a leading `=`; a leading `^` excludes the listed ones. Each GPU takes the nearest allowed active port in the PCIe tree, GPUs spread over equally near ones (`transport::ib::topology`, as `doorbell-info` reports) | every active port |
//! | `DOORBELL_KERNEL_DIR` | for kernel developers: a folder of fatbins (`<module>.fatbin`, as `nvcc --fatbin` makes them from `cuda/kernels/<module>.cu`) loaded instead of the kernels built into the library, module by module where a file exists (a warning is logged for each); for comparing kernel variants without rebuilding the host code (allreduce fatbins built before 386a77a lack the wait that programmatic dependent launch needs: load them with `DOORBELL_PDL=0`) | unset: the built-in kernels |
//! | `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE` | this process's place in the job (torchrun's names) | from Slurm or MPI variables when absent |
//! | `MASTER_ADDR`, `MASTER_PORT` | where rank 0's bootstrap listens | required with more than one rank |
//! | `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_NTASKS_PER_NODE` | srun's rank variables | |
//! | `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK`, `OMPI_COMM_WORLD_LOCAL_SIZE` | Open MPI's | |
//! | `PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID`, `MPI_LOCALNRANKS` | MPICH / Intel MPI (hydra) | |

use crate::error::{Error, Result};
use std::time::Duration;

/// Default deadline for bootstrap waits.
pub const DEFAULT_BOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(60);
/// Default silence after which a peer counts as failed.
pub const DEFAULT_HEARTBEAT_TIMEOUT: Duration = Duration::from_millis(5_000);
/// Default budget for device-side spin loops.
pub const DEFAULT_WAIT_TIMEOUT: Duration = Duration::from_millis(30_000);
/// The longest timeout any setting or argument may ask for: a year. Deadlines are `now +
/// timeout`, which a larger one could overflow (a panic, not an error).
pub const MAX_TIMEOUT: Duration = Duration::from_secs(365 * 24 * 3600);

/// `seconds` as a timeout: finite, positive and at most [`MAX_TIMEOUT`]; `what` names the
/// setting or argument in the error.
pub fn timeout_from_secs(what: &str, seconds: f64) -> Result<Duration> {
    if !(seconds.is_finite() && seconds > 0.0 && seconds <= MAX_TIMEOUT.as_secs_f64()) {
        return Err(Error::invalid(
            what,
            format!(
                "{seconds} is not a number of seconds in (0, {}]",
                MAX_TIMEOUT.as_secs()
            ),
        ));
    }
    Ok(Duration::from_secs_f64(seconds))
}

/// A timeout of `ms` milliseconds, at most [`MAX_TIMEOUT`]; zero only where `zero_means_off`
/// (elsewhere it would fail every wait at once).
fn timeout_from_millis(what: &str, ms: u64, zero_means_off: bool) -> Result<Duration> {
    if ms == 0 && !zero_means_off {
        return Err(Error::invalid(
            what,
            "0 would make every wait fail at once; use a positive budget",
        ));
    }
    if ms > MAX_TIMEOUT.as_millis() as u64 {
        return Err(Error::invalid(
            what,
            format!(
                "{ms} ms is longer than a year ({} ms)",
                MAX_TIMEOUT.as_millis()
            ),
        ));
    }
    Ok(Duration::from_millis(ms))
}

/// A source of settings: the process environment, or a map in tests.
pub trait Lookup {
    /// The value of `name`, if set.
    fn get(&self, name: &str) -> Option<String>;
}

/// The process environment.
pub struct ProcessEnv;

impl Lookup for ProcessEnv {
    fn get(&self, name: &str) -> Option<String> {
        std::env::var(name).ok()
    }
}

impl<F: Fn(&str) -> Option<String>> Lookup for F {
    fn get(&self, name: &str) -> Option<String> {
        self(name)
    }
}

fn parse<T: std::str::FromStr>(env: &dyn Lookup, name: &str) -> Result<Option<T>> {
    match env.get(name) {
        None => Ok(None),
        Some(s) if s.trim().is_empty() => Ok(None),
        Some(s) => s.trim().parse::<T>().map(Some).map_err(|_| {
            Error::invalid(
                name,
                format!("cannot parse {s:?} as {}", std::any::type_name::<T>()),
            )
        }),
    }
}

/// Library-wide settings (everything except the launcher's rank variables).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Settings {
    /// `DOORBELL_LOG`.
    pub log_filter: String,
    /// `DOORBELL_BOOTSTRAP_TIMEOUT_S`.
    pub bootstrap_timeout: Duration,
    /// `DOORBELL_WAIT_TIMEOUT_MS`.
    pub wait_timeout: Duration,
    /// `DOORBELL_HEARTBEAT_TIMEOUT_MS` (zero: heartbeats off).
    pub heartbeat_timeout: Duration,
    /// `DOORBELL_HOST_CALL_CHECK` (or the name before it, `DOORBELL_CHECK`).
    pub check_args: bool,
    /// `DOORBELL_CALL_CHECK`.
    pub call_check: bool,
    /// `DOORBELL_ALLREDUCE_ALGO`, as given (parsed by the allreduce).
    pub allreduce_algo: Option<String>,
    /// `DOORBELL_PROXY_CPU`.
    pub proxy_cpu: ProxyCpu,
    /// `DOORBELL_BOOTSTRAP_LISTEN_ALL`.
    pub bootstrap_listen_all: bool,
    /// `DOORBELL_SEPARATE_NODES`.
    pub separate_nodes: bool,
    /// `DOORBELL_NODE_SIZE` (at least 1).
    pub node_size: usize,
    /// `DOORBELL_IB_EMULATE`.
    pub ib_emulate: bool,
    /// `DOORBELL_IB_EMULATE_RELAXED`: the emulated NIC's relaxed delivery (most later operations
    /// a data write may wait for), or `None` for strict delivery.
    pub ib_emulate_relaxed: Option<u32>,
    /// `DOORBELL_MOE_NET`: the node-spanning MoE path even when every rank shares one node.
    pub moe_net: bool,
    /// `DOORBELL_IB_DISABLE`.
    pub ib_disable: bool,
    /// `DOORBELL_IB_POSTING`.
    pub ib_posting: IbPosting,
    /// `DOORBELL_IB_GID_INDEX`.
    pub ib_gid_index: Option<u32>,
    /// `DOORBELL_IB_HCA`, as given (parsed by `transport::ib::topology::HcaFilter`).
    pub ib_hca: Option<String>,
    /// `DOORBELL_IB_QPS_PER_PEER` (1..=4).
    pub ib_qps_per_peer: u32,
    /// `DOORBELL_KERNEL_DIR`.
    pub kernel_dir: Option<std::path::PathBuf>,
    /// `DOORBELL_PDL`.
    pub pdl: bool,
}

/// Who posts RDMA work (`DOORBELL_IB_POSTING`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IbPosting {
    /// Chosen from the NIC and the platform (see `transport::ib::posting::select::choose_posting`).
    Auto,
    /// The GPU writes WQEs and rings the doorbell.
    Ibgda,
    /// The GPU writes WQEs, a host thread rings.
    CpuAssisted,
    /// A host proxy writes mlx5 WQEs itself.
    Proxy,
    /// A host proxy posts with `ibv_post_send` (any NIC).
    Verbs,
}

/// Where proxy threads run (`DOORBELL_PROXY_CPU`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyCpu {
    /// A core of the GPU's NUMA node, spread over GPUs and proxies.
    Auto,
    /// Wherever the scheduler puts them.
    Off,
    /// This CPU.
    Cpu(usize),
}

fn flag(env: &dyn Lookup, name: &str) -> Result<bool> {
    match env.get(name).as_deref().map(str::trim) {
        None | Some("") | Some("0") | Some("false") | Some("off") => Ok(false),
        Some("1") | Some("true") | Some("on") => Ok(true),
        Some(other) => Err(Error::invalid(name, format!("{other:?}: expected 0 or 1"))),
    }
}

impl Settings {
    /// Reads the settings from the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(&ProcessEnv)
    }

    /// Reads the settings from `env`.
    pub fn from_lookup(env: &dyn Lookup) -> Result<Self> {
        let bootstrap_timeout = match parse::<f64>(env, "DOORBELL_BOOTSTRAP_TIMEOUT_S")? {
            None => DEFAULT_BOOTSTRAP_TIMEOUT,
            Some(s) => timeout_from_secs("DOORBELL_BOOTSTRAP_TIMEOUT_S", s)?,
        };
        let wait_timeout = match parse::<u64>(env, "DOORBELL_WAIT_TIMEOUT_MS")? {
            None => DEFAULT_WAIT_TIMEOUT,
            Some(ms) => timeout_from_millis("DOORBELL_WAIT_TIMEOUT_MS", ms, false)?,
        };
        let heartbeat_timeout = match parse::<u64>(env, "DOORBELL_HEARTBEAT_TIMEOUT_MS")? {
            None => DEFAULT_HEARTBEAT_TIMEOUT,
            Some(ms) => timeout_from_millis("DOORBELL_HEARTBEAT_TIMEOUT_MS", ms, true)?,
        };
        let check_args = match env.get("DOORBELL_HOST_CALL_CHECK") {
            Some(_) => flag(env, "DOORBELL_HOST_CALL_CHECK")?,
            None => flag(env, "DOORBELL_CHECK")?,
        };
        let proxy_cpu = match env.get("DOORBELL_PROXY_CPU").as_deref().map(str::trim) {
            Some("auto") => ProxyCpu::Auto,
            None | Some("") | Some("off") | Some("none") => ProxyCpu::Off,
            Some(n) => ProxyCpu::Cpu(n.parse().map_err(|_| {
                Error::invalid(
                    "DOORBELL_PROXY_CPU",
                    format!("{n:?}: expected auto, off or a CPU number"),
                )
            })?),
        };
        Ok(Settings {
            log_filter: env.get("DOORBELL_LOG").unwrap_or_else(|| "warn".into()),
            bootstrap_timeout,
            wait_timeout,
            heartbeat_timeout,
            check_args,
            call_check: env.get("DOORBELL_CALL_CHECK").is_none()
                || flag(env, "DOORBELL_CALL_CHECK")?,
            allreduce_algo: env
                .get("DOORBELL_ALLREDUCE_ALGO")
                .filter(|s| !s.trim().is_empty()),
            proxy_cpu,
            bootstrap_listen_all: flag(env, "DOORBELL_BOOTSTRAP_LISTEN_ALL")?,
            separate_nodes: flag(env, "DOORBELL_SEPARATE_NODES")?,
            node_size: match parse::<usize>(env, "DOORBELL_NODE_SIZE")? {
                None => 1,
                Some(0) => {
                    return Err(Error::invalid(
                        "DOORBELL_NODE_SIZE",
                        "0: a node holds at least one rank",
                    ))
                }
                Some(k) => k,
            },
            ib_posting: match env.get("DOORBELL_IB_POSTING").as_deref().map(str::trim) {
                None | Some("") | Some("auto") => IbPosting::Auto,
                Some("ibgda") => IbPosting::Ibgda,
                Some("cpu") => IbPosting::CpuAssisted,
                Some("proxy") => IbPosting::Proxy,
                Some("verbs") => IbPosting::Verbs,
                Some(other) => {
                    return Err(Error::invalid(
                        "DOORBELL_IB_POSTING",
                        format!("{other:?}: expected auto, ibgda, cpu, proxy or verbs"),
                    ))
                }
            },
            ib_gid_index: parse::<u32>(env, "DOORBELL_IB_GID_INDEX")?,
            ib_hca: env
                .get("DOORBELL_IB_HCA")
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty()),
            ib_qps_per_peer: match parse::<u32>(env, "DOORBELL_IB_QPS_PER_PEER")? {
                None => 1,
                Some(n @ 1..=4) => n,
                Some(n) => {
                    return Err(Error::invalid(
                        "DOORBELL_IB_QPS_PER_PEER",
                        format!("{n}: expected 1 to 4"),
                    ))
                }
            },
            ib_emulate: flag(env, "DOORBELL_IB_EMULATE")?,
            ib_emulate_relaxed: parse::<u32>(env, "DOORBELL_IB_EMULATE_RELAXED")?
                .filter(|&n| n > 0),
            moe_net: flag(env, "DOORBELL_MOE_NET")?,
            ib_disable: flag(env, "DOORBELL_IB_DISABLE")?,
            kernel_dir: env
                .get("DOORBELL_KERNEL_DIR")
                .filter(|s| !s.trim().is_empty())
                .map(std::path::PathBuf::from),
            pdl: env.get("DOORBELL_PDL").is_none() || flag(env, "DOORBELL_PDL")?,
        })
    }
}

/// Which launcher convention the rank variables came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// `RANK`/`WORLD_SIZE` (torchrun, doorbell's own spawner, most wrappers).
    Torchrun,
    /// `SLURM_PROCID`/`SLURM_NTASKS` (srun).
    Slurm,
    /// `OMPI_COMM_WORLD_*` (Open MPI's mpirun).
    OpenMpi,
    /// `PMI_RANK`/`PMI_SIZE` (MPICH/Intel MPI hydra).
    Pmi,
}

/// This process's place in the job, as the launcher described it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Which convention supplied the values.
    pub launcher: Launcher,
    /// Global rank.
    pub rank: usize,
    /// Number of ranks in the job.
    pub world_size: usize,
    /// Rank among the processes of this host.
    pub local_rank: usize,
    /// Number of processes on this host.
    pub local_world_size: usize,
    /// Where rank 0's bootstrap listens.
    pub master_addr: String,
    /// Rank 0's bootstrap port.
    pub master_port: u16,
    /// The per-job secret (see [`LaunchEnv::secret`]).
    pub secret: Vec<u8>,
    /// True when the secret came from `DOORBELL_JOB_SECRET` rather than being derived.
    pub secret_is_explicit: bool,
}

impl LaunchEnv {
    /// Reads the launcher's variables from the process environment. `Ok(None)` means no launcher
    /// variables are set at all: the process was started by hand.
    pub fn from_env() -> Result<Option<Self>> {
        Self::from_lookup(&ProcessEnv)
    }

    /// Reads the launcher's variables from `env`.
    pub fn from_lookup(env: &dyn Lookup) -> Result<Option<Self>> {
        let pick = |names: [&str; 4]| -> Result<Option<[Option<usize>; 4]>> {
            let rank = parse::<usize>(env, names[0])?;
            let size = parse::<usize>(env, names[1])?;
            if rank.is_none() && size.is_none() {
                return Ok(None);
            }
            Ok(Some([
                rank,
                size,
                parse::<usize>(env, names[2])?,
                parse::<usize>(env, names[3])?,
            ]))
        };
        let conventions: [(Launcher, [&str; 4]); 4] = [
            (
                Launcher::Torchrun,
                ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"],
            ),
            (
                Launcher::OpenMpi,
                [
                    "OMPI_COMM_WORLD_RANK",
                    "OMPI_COMM_WORLD_SIZE",
                    "OMPI_COMM_WORLD_LOCAL_RANK",
                    "OMPI_COMM_WORLD_LOCAL_SIZE",
                ],
            ),
            (
                Launcher::Slurm,
                [
                    "SLURM_PROCID",
                    "SLURM_NTASKS",
                    "SLURM_LOCALID",
                    "SLURM_NTASKS_PER_NODE",
                ],
            ),
            (
                Launcher::Pmi,
                ["PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"],
            ),
        ];
        let mut found = None;
        for (launcher, names) in conventions {
            // SLURM_NTASKS_PER_NODE may be "4(x2)"; parse the leading number only.
            let values = if launcher == Launcher::Slurm {
                let rank = parse::<usize>(env, names[0])?;
                let size = parse::<usize>(env, names[1])?;
                if rank.is_none() && size.is_none() {
                    None
                } else {
                    let per_node = env.get(names[3]).and_then(|s| {
                        s.split(|c: char| !c.is_ascii_digit())
                            .next()
                            .and_then(|d| d.parse::<usize>().ok())
                    });
                    Some([rank, size, parse::<usize>(env, names[2])?, per_node])
                }
            } else {
                pick(names)?
            };
            if let Some(v) = values {
                found = Some((launcher, names, v));
                break;
            }
        }
        let Some((launcher, names, [rank, size, local_rank, local_size])) = found else {
            return Ok(None);
        };
        let rank = rank.ok_or_else(|| {
            Error::invalid(
                names[0],
                format!("{} is set but {} is not", names[1], names[0]),
            )
        })?;
        let world_size = size.ok_or_else(|| {
            Error::invalid(
                names[1],
                format!("{} is set but {} is not", names[0], names[1]),
            )
        })?;
        if world_size == 0 || rank >= world_size {
            return Err(Error::invalid(
                names[0],
                format!("rank {rank} is not below world size {world_size}"),
            ));
        }
        // Without local variables, assume one host (a single-node launch).
        let local_world_size = local_size.unwrap_or(world_size);
        let local_rank = local_rank.unwrap_or(rank % local_world_size.max(1));
        if local_world_size == 0 || local_rank >= local_world_size {
            return Err(Error::invalid(
                names[2],
                format!("local rank {local_rank} is not below local world size {local_world_size}"),
            ));
        }
        let master_addr = env.get("MASTER_ADDR").filter(|s| !s.is_empty());
        let master_port = parse::<u16>(env, "MASTER_PORT")?;
        let (master_addr, master_port) = match (master_addr, master_port) {
            (Some(a), Some(p)) => (a, p),
            _ if world_size == 1 => ("127.0.0.1".to_string(), 0),
            _ => {
                return Err(Error::invalid(
                    "MASTER_ADDR/MASTER_PORT",
                    format!(
                        "{launcher:?} launch of {world_size} ranks: set MASTER_ADDR to rank 0's host and MASTER_PORT to a free port (torchrun sets both)"
                    ),
                ))
            }
        };
        let (secret, secret_is_explicit) = Self::secret(env, &master_addr, master_port, world_size);
        Ok(Some(LaunchEnv {
            launcher,
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            secret,
            secret_is_explicit,
        }))
    }

    /// The per-job secret: `DOORBELL_JOB_SECRET` when set (doorbell's own spawner always sets a
    /// random one). Otherwise it is derived from what every rank of one job, and no other job,
    /// sees: the launcher's job id (torchrun's `TORCHELASTIC_RUN_ID`, Slurm's job and step ids,
    /// Open MPI's job id, PMIx's namespace) plus the rendezvous address and world size. A derived
    /// secret keeps out strangers and stale jobs, not a local attacker who can read this job's
    /// environment; set `DOORBELL_JOB_SECRET` for that.
    pub fn secret(env: &dyn Lookup, addr: &str, port: u16, world_size: usize) -> (Vec<u8>, bool) {
        if let Some(s) = env.get("DOORBELL_JOB_SECRET").filter(|s| !s.is_empty()) {
            return (s.into_bytes(), true);
        }
        let mut material = format!("doorbell-job|{addr}|{port}|{world_size}");
        for name in [
            "TORCHELASTIC_RUN_ID",
            "SLURM_JOB_ID",
            "SLURM_STEP_ID",
            "OMPI_MCA_ess_base_jobid",
            "PMIX_NAMESPACE",
        ] {
            if let Some(v) = env.get(name) {
                material.push('|');
                material.push_str(&v);
            }
        }
        (material.into_bytes(), false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k: &str| map.get(k).cloned()
    }

    #[test]
    fn defaults_when_nothing_is_set() {
        let s = Settings::from_lookup(&env(&[])).unwrap();
        assert_eq!(s.bootstrap_timeout, DEFAULT_BOOTSTRAP_TIMEOUT);
        assert_eq!(s.wait_timeout, DEFAULT_WAIT_TIMEOUT);
        assert_eq!(s.heartbeat_timeout, DEFAULT_HEARTBEAT_TIMEOUT);
        assert!(s.call_check);
        assert_eq!(s.log_filter, "warn");
        assert!(!s.check_args);
        assert_eq!(s.allreduce_algo, None);
        assert_eq!(s.proxy_cpu, ProxyCpu::Off);
        assert!(!s.separate_nodes);
        assert_eq!(
            (s.ib_posting, s.ib_gid_index, s.ib_emulate),
            (IbPosting::Auto, None, false)
        );
        assert_eq!(LaunchEnv::from_lookup(&env(&[])).unwrap(), None);
    }

    #[test]
    fn settings_parse_and_reject() {
        let s = Settings::from_lookup(&env(&[
            ("DOORBELL_BOOTSTRAP_TIMEOUT_S", "2.5"),
            ("DOORBELL_WAIT_TIMEOUT_MS", "7"),
        ]))
        .unwrap();
        assert_eq!(s.bootstrap_timeout, Duration::from_millis(2500));
        assert_eq!(s.wait_timeout, Duration::from_millis(7));
        let s = Settings::from_lookup(&env(&[
            ("DOORBELL_HOST_CALL_CHECK", "1"),
            ("DOORBELL_PROXY_CPU", "5"),
            ("DOORBELL_SEPARATE_NODES", "1"),
            ("DOORBELL_NODE_SIZE", "2"),
        ]))
        .unwrap();
        assert!(s.check_args && s.separate_nodes);
        assert_eq!(s.node_size, 2);
        assert_eq!(s.proxy_cpu, ProxyCpu::Cpu(5));
        // The name before DOORBELL_HOST_CALL_CHECK still works; the new one wins where both are set.
        let s = Settings::from_lookup(&env(&[("DOORBELL_CHECK", "1")])).unwrap();
        assert!(s.check_args);
        let s = Settings::from_lookup(&env(&[
            ("DOORBELL_CHECK", "1"),
            ("DOORBELL_HOST_CALL_CHECK", "0"),
        ]))
        .unwrap();
        assert!(!s.check_args);
        let s = Settings::from_lookup(&env(&[("DOORBELL_PROXY_CPU", "auto")])).unwrap();
        assert_eq!(s.proxy_cpu, ProxyCpu::Auto);
        let s = Settings::from_lookup(&env(&[
            ("DOORBELL_IB_POSTING", "cpu"),
            ("DOORBELL_IB_GID_INDEX", "3"),
        ]))
        .unwrap();
        assert_eq!(
            (s.ib_posting, s.ib_gid_index),
            (IbPosting::CpuAssisted, Some(3))
        );
        let s = Settings::from_lookup(&env(&[
            ("DOORBELL_IB_POSTING", "verbs"),
            ("DOORBELL_IB_DISABLE", "1"),
        ]))
        .unwrap();
        assert_eq!((s.ib_posting, s.ib_disable), (IbPosting::Verbs, true));
        for (k, v) in [
            ("DOORBELL_BOOTSTRAP_TIMEOUT_S", "-1"),
            ("DOORBELL_BOOTSTRAP_TIMEOUT_S", "soon"),
            ("DOORBELL_WAIT_TIMEOUT_MS", "0"),
            ("DOORBELL_WAIT_TIMEOUT_MS", "1.5"),
            // Past a year: refused, not a panic when a deadline overflows.
            ("DOORBELL_BOOTSTRAP_TIMEOUT_S", "1e300"),
            ("DOORBELL_BOOTSTRAP_TIMEOUT_S", "inf"),
            ("DOORBELL_WAIT_TIMEOUT_MS", "18446744073709551615"),
            ("DOORBELL_HEARTBEAT_TIMEOUT_MS", "18446744073709551615"),
            ("DOORBELL_HOST_CALL_CHECK", "maybe"),
            ("DOORBELL_CHECK", "maybe"),
            ("DOORBELL_PROXY_CPU", "near"),
            ("DOORBELL_SEPARATE_NODES", "yes please"),
            ("DOORBELL_IB_POSTING", "gpu"),
            ("DOORBELL_IB_GID_INDEX", "-1"),
            ("DOORBELL_NODE_SIZE", "0"),
            ("DOORBELL_IB_QPS_PER_PEER", "5"),
        ] {
            let e = Settings::from_lookup(&env(&[(k, v)])).unwrap_err();
            assert!(e.to_string().contains(k), "{e}");
        }
    }

    #[test]
    fn timeouts_are_bounded_and_positive() {
        assert_eq!(
            timeout_from_secs("t", 2.5).unwrap(),
            Duration::from_millis(2500)
        );
        assert_eq!(
            timeout_from_secs("t", MAX_TIMEOUT.as_secs_f64()).unwrap(),
            MAX_TIMEOUT
        );
        for bad in [
            0.0,
            -1.0,
            f64::NAN,
            f64::INFINITY,
            1e300,
            MAX_TIMEOUT.as_secs_f64() * 1.01,
        ] {
            let e = timeout_from_secs("timeout_s", bad).unwrap_err().to_string();
            assert!(e.contains("timeout_s"), "{e}");
        }
        let off = Settings::from_lookup(&env(&[("DOORBELL_HEARTBEAT_TIMEOUT_MS", "0")])).unwrap();
        assert!(off.heartbeat_timeout.is_zero());
    }

    #[test]
    fn ib_hca_is_kept_as_given() {
        let get = |v: &str| {
            Settings::from_lookup(&env(&[("DOORBELL_IB_HCA", v)]))
                .unwrap()
                .ib_hca
        };
        assert_eq!(
            get(" ^mlx5_0,mlx5_1:1 ").as_deref(),
            Some("^mlx5_0,mlx5_1:1")
        );
        assert_eq!(get("  "), None);
        assert_eq!(Settings::from_lookup(&env(&[])).unwrap().ib_hca, None);
    }

    #[test]
    fn torchrun_variables() {
        let l = LaunchEnv::from_lookup(&env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_RUN_ID", "abc"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(l.launcher, Launcher::Torchrun);
        assert_eq!(
            (l.rank, l.world_size, l.local_rank, l.local_world_size),
            (3, 8, 1, 2)
        );
        assert_eq!((l.master_addr.as_str(), l.master_port), ("10.0.0.1", 29500));
        assert!(!l.secret_is_explicit);
        assert!(String::from_utf8(l.secret).unwrap().contains("abc"));
    }

    #[test]
    fn slurm_openmpi_pmi_variables() {
        let base = [("MASTER_ADDR", "h"), ("MASTER_PORT", "1")];
        let slurm = LaunchEnv::from_lookup(&env(&[
            base[0],
            base[1],
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_LOCALID", "5"),
            ("SLURM_NTASKS_PER_NODE", "8(x2)"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(slurm.launcher, Launcher::Slurm);
        assert_eq!(
            (slurm.rank, slurm.world_size, slurm.local_world_size),
            (5, 16, 8)
        );
        let ompi = LaunchEnv::from_lookup(&env(&[
            base[0],
            base[1],
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(ompi.launcher, Launcher::OpenMpi);
        let pmi = LaunchEnv::from_lookup(&env(&[
            base[0],
            base[1],
            ("PMI_RANK", "0"),
            ("PMI_SIZE", "4"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (pmi.launcher, pmi.local_rank, pmi.local_world_size),
            (Launcher::Pmi, 0, 4)
        );
    }

    #[test]
    fn launcher_errors_name_the_variable() {
        let e = LaunchEnv::from_lookup(&env(&[("RANK", "4"), ("WORLD_SIZE", "4")])).unwrap_err();
        assert!(e.to_string().contains("RANK"), "{e}");
        let e = LaunchEnv::from_lookup(&env(&[("RANK", "0"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert!(e.to_string().contains("MASTER_ADDR"), "{e}");
        let e = LaunchEnv::from_lookup(&env(&[("WORLD_SIZE", "2")])).unwrap_err();
        assert!(e.to_string().contains("RANK"), "{e}");
        let e = LaunchEnv::from_lookup(&env(&[("RANK", "x"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert!(e.to_string().contains("RANK"), "{e}");
        // A single rank needs no rendezvous address.
        let one = LaunchEnv::from_lookup(&env(&[("RANK", "0"), ("WORLD_SIZE", "1")]))
            .unwrap()
            .unwrap();
        assert_eq!(one.world_size, 1);
    }

    #[test]
    fn explicit_secret_wins() {
        let l = LaunchEnv::from_lookup(&env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("DOORBELL_JOB_SECRET", "s3cret"),
        ]))
        .unwrap()
        .unwrap();
        assert!(l.secret_is_explicit);
        assert_eq!(l.secret, b"s3cret");
    }
}
