//! PortChannels over InfiniBand/RoCE: my source and destination registered with this rank's NIC,
//! every peer's destination known by its own address and key, connected queue pairs to each
//! peer; the proxy posts over them ([`IbConnection`]), or, with `DOORBELL_IB_POSTING=ibgda|cpu`,
//! the kernels post their own work requests on queue pairs mapped into the GPU ([`MappedQp`])
//! and the proxy keeps one of its own.

use super::{GpuLink, Link};
use crate::channel::proxy::{MemoryId, ProxyBuilder};
use crate::channel::registered::RegisteredMemory;
use crate::channel::wiring::Wiring;
use crate::device_api::{IbPortLink, IbQpHandle};
use crate::error::{Error, Result};
use crate::gpu::cuda::cuda_err;
use crate::transport::ib::boundary::provider::{access, Memory};
use crate::transport::ib::posting::conn::{
    connect_peers, exchange_regions, ConnectedQp, Registration,
};
use crate::transport::ib::posting::gpu_qp::{MappedQp, Posting};
use crate::transport::ib::posting::poster::{HostPoster, IbConnection};
use crate::transport::ib::posting::select::PostingMode;
use crate::transport::ipc::RemoteMemory;
use cudarc::driver::DevicePtr;
use std::sync::Arc;

/// How this rank reaches one peer's destination: its address, key and length, and, on the
/// emulated NIC, its CUDA IPC mapping here that the emulated wire goes through.
type PeerRegion = (u64, u32, u64, Option<Arc<RemoteMemory>>);

/// The NIC's part of one channel set: my registrations, the peers' regions, the queue pairs.
pub(super) struct IbSetup {
    src_mr: Arc<Registration>,
    dst_mr: Arc<Registration>,
    peers: Vec<Option<PeerRegion>>,
    qps: Vec<Vec<ConnectedQp>>,
}

impl IbSetup {
    /// Registers `src` and `dst` with this rank's NIC, trades the destinations' addresses and
    /// keys, and connects queue pairs to `peers` (collective among the ranks with a NIC; `None`
    /// without one).
    pub(super) fn prepare(
        w: &Wiring,
        src: &Arc<RegisteredMemory>,
        dst: &Arc<RegisteredMemory>,
        peers: &[usize],
    ) -> Result<Option<IbSetup>> {
        let Some(ib) = &w.ib else {
            return Ok(None);
        };
        let (rank, world) = (w.rank(), w.world());
        // SAFETY: `dst` and `src` are kept alive by the channels, which keep these
        // registrations and drop them first.
        let (dst_mr, src_mr) = unsafe {
            (
                ib.dev.register(
                    dst.device_ptr(),
                    dst.len(),
                    access::ALL | access::RELAXED_ORDERING,
                    Memory::Gpu(w.gpu),
                )?,
                ib.dev.register(
                    src.device_ptr(),
                    src.len(),
                    access::LOCAL_WRITE,
                    Memory::Gpu(w.gpu),
                )?,
            )
        };
        // Every rank tells the others its destination's address and key; peers on this machine
        // but another (emulated) node map it for their NIC.
        let regions = exchange_regions(w.bootstrap, Some(&dst_mr))?;
        let descs = w.bootstrap.all_gather(&dst.descriptor.to_bytes())?;
        let mut reached: Vec<Option<PeerRegion>> = vec![None; world];
        for &r in peers {
            let region = regions[r].ok_or_else(|| Error::Bootstrap {
                me: rank,
                rank: Some(r),
                why: "registered no destination with its NIC".into(),
            })?;
            // The emulated wire reaches the peer's memory through its mapping here; a NIC
            // reaches it over the network.
            let mapped = if ib.dev.provider().is_emulated() {
                let m = Arc::new(w.peers.import(r, &descs[r])?);
                ib.dev.provider().attach_remote(
                    region.rkey,
                    region.addr,
                    region.len,
                    m.device_ptr(),
                )?;
                Some(m)
            } else {
                None
            };
            reached[r] = Some((region.addr, region.rkey, region.len, mapped));
        }
        // Queue pairs to every peer: the stripes (DOORBELL_IB_QPS_PER_PEER) for whoever posts,
        // the proxy or the kernels (then the proxy keeps one QP of its own). Collective.
        let per_peer = match gpu_posting(ib.posting) {
            Some(_) => 1 + ib.qps_per_peer,
            None => ib.qps_per_peer,
        };
        let connected = connect_peers(w.bootstrap, ib.dev, peers, per_peer, 256)?;
        let mut qps: Vec<Vec<ConnectedQp>> = (0..world).map(|_| Vec::new()).collect();
        for (p, q) in peers.iter().zip(connected) {
            qps[*p] = q;
        }
        w.bootstrap.barrier()?;
        Ok(Some(IbSetup {
            src_mr: Arc::new(src_mr),
            dst_mr: Arc::new(dst_mr),
            peers: reached,
            qps,
        }))
    }

    /// My source in the proxy's table, with its key (every channel of the set shares it).
    pub(super) fn register_source(
        &self,
        proxy: &mut ProxyBuilder,
        src: &Arc<RegisteredMemory>,
    ) -> Result<MemoryId> {
        proxy.add_keyed_memory(src.device_ptr(), src.len() as u64, self.src_mr.lkey())
    }

    /// The channel to `peer`: its destination by address and key, a connection posting on the
    /// proxy's queue pairs, its token in its pool by address and key, and with GPU posting the
    /// link kernels post through.
    pub(super) fn link(
        &mut self,
        w: &Wiring,
        proxy: &mut ProxyBuilder,
        src: &Arc<RegisteredMemory>,
        dst: &Arc<RegisteredMemory>,
        peer: usize,
    ) -> Result<Link> {
        let ib =
            w.ib.as_ref()
                .ok_or_else(|| Error::invalid("ib", "no NIC for PortChannels"))?;
        let (addr, rkey, len, mapped) =
            self.peers[peer]
                .clone()
                .ok_or_else(|| Error::TransportUnavailable {
                    transport: "ib",
                    why: format!("the NIC does not reach rank {peer}"),
                })?;
        let (pool_addr, pool_key) =
            ib.peer_pools.get(peer).copied().flatten().ok_or_else(|| {
                Error::invalid("ib", format!("rank {peer}'s token pool is not reachable"))
            })?;
        let gpu_posting = gpu_posting(ib.posting);
        let mut qps = std::mem::take(&mut self.qps[peer]).into_iter();
        let proxy_stripes = if gpu_posting.is_some() {
            1
        } else {
            ib.qps_per_peer
        };
        let posters = qps
            .by_ref()
            .take(proxy_stripes)
            .map(|q| match ib.posting {
                PostingMode::VerbsProxy => Ok(HostPoster::verbs(q, 256)),
                _ => HostPoster::mlx5(q),
            })
            .collect::<Result<Vec<_>>>()?;
        if posters.len() != proxy_stripes {
            return Err(Error::invalid(
                "ib",
                format!("{} queue pairs to rank {peer}", posters.len()),
            ));
        }
        let stream = w.gpu.new_stream()?;
        let scratch = stream
            .alloc_zeros::<u8>(16)
            .map_err(cuda_err("cuMemAlloc"))?;
        let mut registrations = vec![self.src_mr.clone(), self.dst_mr.clone()];
        // SAFETY: the scratch words live in the proxy's connection, which outlives the work
        // requests naming them; the channel keeps the registration.
        let scratch_mr = Arc::new(unsafe {
            ib.dev.register(
                scratch.device_ptr(&stream).0,
                16,
                access::LOCAL_WRITE,
                Memory::Gpu(w.gpu),
            )
        }?);
        registrations.push(scratch_mr.clone());
        let dst_mem = proxy.add_keyed_memory(addr, len, rkey)?;
        let (conn, flush_done) = proxy.add_transport_connection(Box::new(IbConnection::new(
            w.gpu,
            posters,
            scratch,
            scratch_mr.lkey(),
        )?))?;
        // The peer's inbound token for me, at the peer's own address.
        let token = pool_addr + ((w.base + w.rank()) * 8) as u64;
        let semaphore = proxy.add_keyed_semaphore(conn, token, pool_key)?;
        // Kernels posting their own work requests: the stripes' queue pairs mapped into the GPU.
        let gpu_link = match gpu_posting {
            Some(posting) => {
                let site = w.diagnostics.site(peer as i32, w.channel);
                let mapped_qps: Vec<MappedQp> = qps
                    .map(|q| MappedQp::new(w.gpu, q, posting, site))
                    .collect::<Result<_>>()?;
                if mapped_qps.is_empty() {
                    return Err(Error::invalid("ib", "no queue pair for the kernels"));
                }
                let mut more = [IbQpHandle::default(); 3];
                for (m, q) in more.iter_mut().zip(&mapped_qps[1..]) {
                    *m = q.handle();
                }
                let scratch = stream
                    .alloc_zeros::<u8>(16)
                    .map_err(cuda_err("cuMemAlloc"))?;
                let scratch_addr = scratch.device_ptr(&stream).0;
                // SAFETY: kept by the GpuLink below, dropped after the registration.
                let kernel_scratch = Arc::new(unsafe {
                    ib.dev
                        .register(scratch_addr, 16, access::LOCAL_WRITE, Memory::Gpu(w.gpu))
                }?);
                registrations.push(kernel_scratch.clone());
                let l = IbPortLink {
                    qp: mapped_qps[0].handle(),
                    stripes: mapped_qps.len() as u32,
                    reserved: 0,
                    more,
                    src: src.device_ptr(),
                    dst: addr,
                    token,
                    scratch: scratch_addr,
                    src_key: self.src_mr.lkey(),
                    dst_key: rkey,
                    token_key: pool_key,
                    scratch_key: kernel_scratch.lkey(),
                };
                let on_device = stream
                    .clone_htod(bytemuck::bytes_of(&l))
                    .map_err(cuda_err("cuMemcpyHtoD"))?;
                stream
                    .synchronize()
                    .map_err(cuda_err("cuStreamSynchronize"))?;
                let ptr = on_device.device_ptr(&stream).0;
                Some((
                    ptr,
                    GpuLink {
                        _qps: mapped_qps,
                        _link: on_device,
                        _scratch: scratch,
                    },
                ))
            }
            None => None,
        };
        Ok(Link {
            dst_mem,
            flush_done,
            semaphore,
            gpu_link,
            registrations,
            receiver: None,
            dst: mapped.map_or_else(|| Err(dst.clone()), Ok),
        })
    }
}

/// Who posts for kernels in `mode`: the GPU itself (IBGDA), the GPU with a host thread ringing,
/// or nobody (the proxy posts).
fn gpu_posting(mode: PostingMode) -> Option<Posting> {
    match mode {
        PostingMode::Ibgda => Some(Posting::Ibgda),
        PostingMode::CpuAssisted => Some(Posting::CpuAssisted),
        _ => None,
    }
}
