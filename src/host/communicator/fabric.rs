//! The RDMA NIC a communicator's PortChannels to other nodes use: the emulated mlx5 NIC
//! (`DOORBELL_IB_EMULATE=1`), or the NIC nearest this GPU where every rank of a job spanning hosts
//! has one; its registration of the token pool, and each peer's pool by address and key.

use crate::channel::semaphore::TOKEN_SLOTS;
use crate::error::{Error, Result};
use crate::gpu::cuda::Gpu;
use crate::gpu::memory::Buffer;
use crate::job::bootstrap::Bootstrap;
use crate::job::config::Settings;
use crate::job::topology::Topology;
use crate::transport::ib::boundary::provider::{access, Memory, Provider};
use crate::transport::ib::boundary::rdma_core::RdmaCore;
use crate::transport::ib::emulated::nic::{Delivery, EmulatedNic};
use crate::transport::ib::emulated::{Emulated, Fabric, PortConfig};
use crate::transport::ib::posting::conn::{exchange_regions, IbDevice, Registration};
use crate::transport::ib::posting::gpu_qp::CudaDma;
use crate::transport::ib::posting::select::{posting_for, Platform, PostingMode};
use crate::transport::ipc::RemoteMemory;
use std::sync::Arc;

/// The RDMA NIC this rank's PortChannels to other nodes use, reached only through the verbs
/// boundary (`DOORBELL_IB_EMULATE=1`: the emulated provider), its token pool's registration, and
/// how to reach each peer's token pool (its address and rkey).
pub(super) struct IbFabric {
    pub(super) dev: Arc<IbDevice>,
    pub(super) posting: PostingMode,
    _pool: Registration,
    /// Peers on another node the NIC reaches: (their pool's address, its rkey).
    pub(super) peer_pools: Vec<Option<(u64, u32)>>,
    /// The emulated wire: peers' pools mapped here (kept alive for the NIC).
    _mapped: Vec<RemoteMemory>,
    /// The emulated NIC behind the provider (`DOORBELL_IB_EMULATE=1`), for its traffic counts.
    pub(super) emulated: Option<Arc<EmulatedNic>>,
}

impl IbFabric {
    /// The NIC for this rank's PortChannels to other nodes, if any (collective: every rank runs
    /// it with the job's node ids): the emulated NIC with `DOORBELL_IB_EMULATE=1` (reaching the
    /// ranks of this machine on other emulated nodes through `emulated_peers`, their token pools
    /// mapped here), else, in a job spanning hosts, the NIC nearest this GPU when every rank has
    /// one; `None` sends PortChannels to other nodes over Ethernet.
    pub(super) fn for_job(
        settings: &Settings,
        bootstrap: &Bootstrap,
        gpu: &Arc<Gpu>,
        pool: &Buffer,
        topology: &Topology,
        emulated_peers: Vec<(usize, RemoteMemory)>,
    ) -> Result<Option<IbFabric>> {
        let (rank, world) = (bootstrap.rank(), bootstrap.world_size());
        if settings.ib_emulate {
            let nic = Arc::new(EmulatedNic::start_for_rank(
                Box::new(CudaDma::new(gpu)),
                match settings.ib_emulate_relaxed {
                    Some(max_delay) => Delivery::Relaxed {
                        max_delay,
                        seed: rank as u64 + 1,
                    },
                    None => Delivery::Strict,
                },
                rank,
            )?);
            let fabric = Fabric::for_job(&job_tag(bootstrap.secret()))?;
            let provider: Arc<dyn Provider> = Arc::new(Emulated::new(
                nic.clone(),
                rank as u32 + 1,
                fabric,
                PortConfig::default(),
            )?);
            let dev = IbDevice::open(provider.clone(), 1, settings.ib_gid_index)?;
            let what = format!(
                "the Ib transport on {} (DOORBELL_IB_EMULATE=1)",
                provider.device_name()
            );
            let peers = emulated_peers
                .into_iter()
                .map(|(r, m)| (r, Some(m)))
                .collect();
            let mut fabric =
                IbFabric::open(dev, bootstrap, gpu, pool, peers, settings.ib_posting, &what)?;
            fabric.emulated = Some(nic);
            Ok(Some(fabric))
        } else if topology.spans_nodes() {
            // Ranks on other hosts: the NIC nearest this GPU, where every rank has one.
            let mine = if settings.ib_disable {
                Err("DOORBELL_IB_DISABLE=1".to_string())
            } else {
                gpu.pci_bus_id()
                    .and_then(|bus| RdmaCore::open_nearest(&bus, settings.ib_hca.as_deref()))
                    .map_err(|e| e.to_string())
            };
            let flags = bootstrap.all_gather(&[u8::from(mine.is_ok())])?;
            let without: Vec<usize> = (0..world)
                .filter(|&r| flags[r].first() != Some(&1))
                .collect();
            match mine {
                Ok((nic, choice)) if without.is_empty() => {
                    let dev = IbDevice::open(Arc::new(nic), choice.port, settings.ib_gid_index)?;
                    let what = format!("{} port {} ({})", choice.name, choice.port, choice.why);
                    let peers = (0..world)
                        .filter(|&r| !topology.same_node(r))
                        .map(|r| (r, None))
                        .collect();
                    Ok(Some(IbFabric::open(
                        dev,
                        bootstrap,
                        gpu,
                        pool,
                        peers,
                        settings.ib_posting,
                        &what,
                    )?))
                }
                Ok(_) => {
                    tracing::info!(
                        "rank {rank}: PortChannels to other hosts go over Ethernet: ranks \
                         {without:?} have no RDMA NIC"
                    );
                    Ok(None)
                }
                Err(why) => {
                    tracing::info!(
                        "rank {rank}: PortChannels to other hosts go over Ethernet: {why}"
                    );
                    Ok(None)
                }
            }
        } else {
            Ok(None)
        }
    }

    /// Registers the token pool `pool` with `dev`'s NIC, trades its (address, rkey) with every
    /// rank (collective), and keeps how to reach the pools of `peers`: for each, its rank and,
    /// where the NIC is emulated, the pool's CUDA IPC mapping the emulated wire goes through.
    fn open(
        dev: Arc<IbDevice>,
        bootstrap: &Bootstrap,
        gpu: &Gpu,
        pool: &Buffer,
        peers: Vec<(usize, Option<RemoteMemory>)>,
        forced: crate::job::config::IbPosting,
        what: &str,
    ) -> Result<IbFabric> {
        let rank = bootstrap.rank();
        // SAFETY: the pool is the token pool's buffer, which outlives the registration
        // (IbFabric drops before the token pool).
        let pool_mr = unsafe {
            dev.register(
                pool.device_ptr(),
                TOKEN_SLOTS * 8,
                access::ALL,
                Memory::Gpu(gpu),
            )
        }?;
        let regions = exchange_regions(bootstrap, Some(&pool_mr))?;
        let mut peer_pools = vec![None; bootstrap.world_size()];
        let mut mapped = Vec::new();
        for (r, local) in peers {
            let region = regions[r].ok_or_else(|| Error::Bootstrap {
                me: rank,
                rank: Some(r),
                why: "registered no token pool with its NIC".into(),
            })?;
            if let Some(m) = local {
                dev.provider().attach_remote(
                    region.rkey,
                    region.addr,
                    region.len,
                    m.device_ptr(),
                )?;
                mapped.push(m);
            }
            peer_pools[r] = Some((region.addr, region.rkey));
        }
        let provider = dev.provider().as_ref();
        let (posting, why) =
            posting_for(provider, &Platform::probe(!provider.is_emulated()), forced);
        tracing::info!(
            "rank {rank}: PortChannels to other nodes take {what}, posting {posting:?}: {why}"
        );
        Ok(IbFabric {
            dev,
            posting,
            _pool: pool_mr,
            peer_pools,
            _mapped: mapped,
            emulated: None,
        })
    }
}

/// The emulated fabric's name for this job: the same on every rank, different across jobs.
fn job_tag(secret: &[u8]) -> String {
    use sha2::Digest;
    let d = sha2::Sha256::digest([b"doorbell-emulated-fabric".as_slice(), secret].concat());
    d[..8].iter().map(|b| format!("{b:02x}")).collect()
}
