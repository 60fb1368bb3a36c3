//! The proxy service: one host thread per GPU that drains the device-to-host trigger FIFO
//! (`cuda/include/doorbell/fifo.cuh`) and performs the triggers on the GPU's behalf.
//!
//! For CUDA IPC peers a `put` is a copy-engine copy (`cuMemcpyDtoDAsync`) on the connection's own
//! stream, a `signal` is a `cuStreamWriteValue64` of the semaphore's running count into the peer's
//! inbound token, queued on the same stream so it lands after the data, and a `flush` records an
//! event and reports the trigger's position as done once the event completes. Flushes progress
//! asynchronously per connection, so a slow one never blocks triggers of other channels.
//!
//! Stopping the service (or dropping it) sets the FIFO's `stopped` word: every kernel spinning on
//! this proxy (a full ring, a flush, a PortChannel wait) gives up with a reported
//! [`crate::WaitKind::ProxyStopped`] instead of hanging.
//!
//! This module never decides which peers get channels (the communicator does) and never blocks
//! on one connection while others have work.

use crate::device_api::{trigger, FifoHandle, ProxyTrigger, WaitSite};
use crate::error::{Error, Result};
use crate::gpu::cuda::{check, cuda_err, Gpu, HostArray};
use crate::transport::ethernet::{FailureSink, NetOp, NetSender};
use cudarc::driver::{sys, CudaEvent, CudaSlice, CudaStream, DevicePtr};
use std::collections::VecDeque;
use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// Index of a registered memory in a proxy's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryId(pub u32);

/// Index of a semaphore (a peer's inbound token this proxy signals) in a proxy's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SemaphoreId(pub u32);

/// Index of a connection (a copy stream and its flush word) in a proxy's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionId(pub u32);

struct Memory {
    ptr: u64,
    bytes: u64,
    /// Its key with the (emulated) RDMA NIC, for memories an Ib connection reads or writes.
    key: Option<u32>,
}

struct Semaphore {
    remote_token: u64,
    connection: usize,
    outbound: u64,
    /// The rkey of the peer's token memory (Ib connections).
    key: Option<u32>,
}

/// An Ib connection: the proxy posts each trigger as RDMA work requests on a connected queue
/// pair, as mlx5 WQEs it writes itself or through `ibv_post_send` (the host posting modes): a put as RDMA WRITEs, a signal as an 8-byte
/// READ of the peer's token (the flush that makes the writes before it visible) then a
/// fetch-add of 1 on it, a flush as the position reported once every WQE before it completed.
///
/// With several queue pairs (`DOORBELL_IB_QPS_PER_PEER`), a put of 1 MiB or more is cut into one
/// contiguous part (4 KiB multiples) per QP; a signal goes on the first QP once every other QP has
/// completed what it was given before the signal (RC QPs order only their own work): until then
/// it waits in `deferred`, and the proxy goes on with other triggers.
struct IbConn {
    qps: Vec<crate::transport::ib::poster::HostPoster>,
    /// 16 bytes of device memory the NIC may write (READ and fetch-add results), and its key.
    scratch: u64,
    scratch_key: u32,
    _scratch: CudaSlice<u8>,
    /// Flushes waiting for the QPs: (position, what each QP must complete; `None` while signals
    /// before it are still deferred).
    pending: VecDeque<(u64, Option<Vec<u64>>)>,
    /// Signals waiting for the other QPs: (semaphore, what each QP must complete first).
    deferred: VecDeque<(usize, Vec<u64>)>,
}

struct Connection {
    stream: Arc<CudaStream>,
    flush_done: Arc<HostArray<u64>>,
    /// Set for an Ethernet connection: its operations go to the sender thread instead.
    net: Option<NetSender>,
    /// Set for an Ib connection: its operations become work requests on its queue pair.
    ib: Option<IbConn>,
    /// Data or signals queued since the last flush request.
    dirty: bool,
    /// Flushes waiting for their event: (position, event).
    pending: VecDeque<(u64, CudaEvent)>,
    spare_events: Vec<CudaEvent>,
}

/// Everything the proxy thread works on. Built before the thread starts; the thread owns it.
struct Tables {
    memories: Vec<Memory>,
    semaphores: Vec<Semaphore>,
    connections: Vec<Connection>,
}

/// A proxy being set up: register memories, connections and semaphores, hand out the FIFO's
/// device handle, then [`ProxyBuilder::start`] it.
pub struct ProxyBuilder {
    gpu: Arc<Gpu>,
    triggers: HostArray<ProxyTrigger>,
    tail: HostArray<u64>,
    stopped: Arc<HostArray<u32>>,
    device_words: CudaSlice<u64>,
    size_log2: u32,
    tables: Tables,
    site: WaitSite,
    failure: Arc<Mutex<Option<Error>>>,
    /// Where the proxy thread runs; None: `DOORBELL_PROXY_CPU`, read when it starts.
    placement: Option<crate::job::config::ProxyCpu>,
}

/// Default FIFO depth (triggers in flight).
pub const DEFAULT_FIFO_SIZE: usize = 512;

impl ProxyBuilder {
    /// A proxy for `gpu` with a FIFO of `fifo_size` triggers (a power of two). `site` names the
    /// waiter in reports (rank; peer -1).
    pub fn new(gpu: &Arc<Gpu>, fifo_size: usize, site: WaitSite) -> Result<ProxyBuilder> {
        if !fifo_size.is_power_of_two() || fifo_size < 2 {
            return Err(Error::invalid(
                "fifo_size",
                format!("{fifo_size}: must be a power of two of at least 2"),
            ));
        }
        let stream = gpu.new_stream()?;
        // [head, tail_cache] in device memory.
        let device_words = stream
            .alloc_zeros::<u64>(2)
            .map_err(cuda_err("cuMemAlloc"))?;
        stream
            .synchronize()
            .map_err(cuda_err("cuStreamSynchronize"))?;
        Ok(ProxyBuilder {
            gpu: gpu.clone(),
            triggers: HostArray::new(gpu, fifo_size)?,
            tail: HostArray::new(gpu, 1)?,
            stopped: Arc::new(HostArray::new(gpu, 1)?),
            device_words,
            size_log2: fifo_size.trailing_zeros(),
            tables: Tables {
                memories: Vec::new(),
                semaphores: Vec::new(),
                connections: Vec::new(),
            },
            site,
            failure: Arc::new(Mutex::new(None)),
            placement: None,
        })
    }

    /// Where the proxy thread will run (`DOORBELL_PROXY_CPU`'s choices), as the caller's settings
    /// say (a communicator passes its own); without it the setting is read when the proxy starts.
    pub fn placement(mut self, cpu: crate::job::config::ProxyCpu) -> ProxyBuilder {
        self.placement = Some(cpu);
        self
    }

    /// Registers `bytes` of device memory at `ptr` (local, or a peer's mapped into this process).
    pub fn add_memory(&mut self, ptr: u64, bytes: u64) -> Result<MemoryId> {
        let id = self.tables.memories.len() as u32;
        if id > ProxyTrigger::MAX_MEMORY {
            return Err(Error::invalid(
                "memories",
                format!(
                    "a proxy holds at most {} memories",
                    ProxyTrigger::MAX_MEMORY + 1
                ),
            ));
        }
        self.tables.memories.push(Memory {
            ptr,
            bytes,
            key: None,
        });
        Ok(MemoryId(id))
    }

    /// Registers `bytes` at `ptr` that Ib connections reach with `key`: local memory registered
    /// with this rank's NIC, or a peer's memory by its own address and key.
    pub(crate) fn add_ib_memory(&mut self, ptr: u64, bytes: u64, key: u32) -> Result<MemoryId> {
        let id = self.add_memory(ptr, bytes)?;
        self.tables.memories[id.0 as usize].key = Some(key);
        Ok(id)
    }

    /// A memory whose offsets are device addresses of this process (base 0, no bound): lets a
    /// collective's kernel name the caller's buffers, which were never registered, as copy
    /// sources. The proxy cannot check these ranges; the collective vouches for them (a wrong
    /// address fails the copy, and the proxy stops with the error).
    pub fn add_address_space(&mut self) -> Result<MemoryId> {
        self.add_memory(0, u64::MAX)
    }

    /// A connection: its own copy stream and flush word. Returns its id and the flush word's
    /// device address.
    pub fn add_connection(&mut self) -> Result<(ConnectionId, u64)> {
        let stream = self.gpu.new_stream()?;
        let flush_done = Arc::new(HostArray::new(&self.gpu, 1)?);
        let ptr = flush_done.device_ptr();
        self.tables.connections.push(Connection {
            stream,
            flush_done,
            net: None,
            ib: None,
            dirty: false,
            pending: VecDeque::new(),
            spare_events: Vec::new(),
        });
        Ok((ConnectionId(self.tables.connections.len() as u32 - 1), ptr))
    }

    /// An Ethernet connection to `peer` over `socket` (see [`crate::transport::ethernet`]): puts,
    /// signals and flushes of its semaphores go to a sender thread. Destination memories of such
    /// a connection are registered with base 0 (offsets into the peer's buffer). Returns its id
    /// and the flush word's device address.
    pub(crate) fn add_net_connection(
        &mut self,
        socket: std::net::TcpStream,
        peer: usize,
    ) -> Result<(ConnectionId, u64)> {
        let stream = self.gpu.new_stream()?;
        let flush_done = Arc::new(HostArray::new(&self.gpu, 1)?);
        let ptr = flush_done.device_ptr();
        let sender = NetSender::spawn(
            &self.gpu,
            socket,
            flush_done.clone(),
            self.failure_sink(),
            peer,
        )?;
        self.tables.connections.push(Connection {
            stream,
            flush_done,
            net: Some(sender),
            ib: None,
            dirty: false,
            pending: VecDeque::new(),
            spare_events: Vec::new(),
        });
        Ok((ConnectionId(self.tables.connections.len() as u32 - 1), ptr))
    }

    /// An Ib connection over `qp` (see [`IbConn`]); `scratch` is 16 bytes of device memory
    /// registered with the QP's NIC under `scratch_key`. Returns its id and the flush word's
    /// device address.
    pub(crate) fn add_ib_connection(
        &mut self,
        qps: Vec<crate::transport::ib::poster::HostPoster>,
        scratch: CudaSlice<u8>,
        scratch_key: u32,
    ) -> Result<(ConnectionId, u64)> {
        let stream = self.gpu.new_stream()?;
        let flush_done = Arc::new(HostArray::new(&self.gpu, 1)?);
        let ptr = flush_done.device_ptr();
        let addr = scratch.device_ptr(&stream).0;
        self.tables.connections.push(Connection {
            stream,
            flush_done,
            net: None,
            ib: Some(IbConn {
                qps,
                scratch: addr,
                scratch_key,
                _scratch: scratch,
                pending: VecDeque::new(),
                deferred: VecDeque::new(),
            }),
            dirty: false,
            pending: VecDeque::new(),
            spare_events: Vec::new(),
        });
        Ok((ConnectionId(self.tables.connections.len() as u32 - 1), ptr))
    }

    /// A semaphore of an Ib connection: `remote_token` is the peer's inbound token at the
    /// peer's own address, in memory the peer registered with its NIC under `key`.
    pub(crate) fn add_ib_semaphore(
        &mut self,
        connection: ConnectionId,
        remote_token: u64,
        key: u32,
    ) -> Result<SemaphoreId> {
        let id = self.add_semaphore(connection, remote_token)?;
        self.tables.semaphores[id.0 as usize].key = Some(key);
        Ok(id)
    }

    /// Where transport threads report failures: this proxy's failure slot and stop word.
    pub(crate) fn failure_sink(&self) -> FailureSink {
        FailureSink {
            failure: self.failure.clone(),
            stopped: self.stopped.clone(),
        }
    }

    /// A semaphore this proxy signals: `remote_token` is the peer's inbound token (device
    /// address in this process), written in order with `connection`'s data.
    pub fn add_semaphore(
        &mut self,
        connection: ConnectionId,
        remote_token: u64,
    ) -> Result<SemaphoreId> {
        let id = self.tables.semaphores.len() as u32;
        if id > ProxyTrigger::MAX_SEMAPHORE {
            return Err(Error::invalid(
                "semaphores",
                format!(
                    "a proxy holds at most {} semaphores",
                    ProxyTrigger::MAX_SEMAPHORE + 1
                ),
            ));
        }
        if connection.0 as usize >= self.tables.connections.len() {
            return Err(Error::invalid(
                "connection",
                "not a connection of this proxy",
            ));
        }
        self.tables.semaphores.push(Semaphore {
            remote_token,
            connection: connection.0 as usize,
            outbound: 0,
            key: None,
        });
        Ok(SemaphoreId(id))
    }

    /// The FIFO's device handle (copied into every PortChannel handle).
    pub fn fifo_handle(&self) -> FifoHandle {
        let s = self.gpu.context().default_stream();
        let base = self.device_words.device_ptr(&s).0;
        FifoHandle {
            triggers: self.triggers.device_ptr(),
            head: base,
            tail: self.tail.device_ptr(),
            tail_cache: base + 8,
            stopped: self.stopped.device_ptr(),
            size_log2: self.size_log2,
            reserved: 0,
            site: self.site,
        }
    }

    /// Starts the proxy thread.
    pub fn start(self) -> Result<ProxyService> {
        if self
            .tables
            .connections
            .iter()
            .any(|c| c.net.is_none() && c.ib.is_none())
        {
            crate::gpu::cuda::note_host_cuda_calls(
                "the proxy's copy-engine transfers between GPUs of one host",
            );
        }
        let stop = Arc::new(AtomicBool::new(false));
        let failure = self.failure.clone();
        let mut worker = Worker {
            gpu: self.gpu.clone(),
            triggers: self.triggers,
            tail: self.tail,
            size_log2: self.size_log2,
            tables: self.tables,
        };
        let (stop2, failure2, stopped2) = (stop.clone(), failure.clone(), self.stopped.clone());
        let cpu = proxy_cpu(&self.gpu, self.placement)?;
        let thread = std::thread::Builder::new()
            .name(format!("doorbell-proxy-gpu{}", self.gpu.ordinal()))
            .spawn(move || {
                if let Some(cpu) = cpu {
                    pin_to(cpu);
                }
                if let Err(e) = worker.run(&stop2) {
                    tracing::error!("proxy stopped on error: {e}");
                    *failure2.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                    // Kernels waiting on this proxy must not hang.
                    stopped2.write(0, 1);
                }
                worker
            })
            .map_err(|e| Error::io("starting the proxy thread", e))?;
        Ok(ProxyService {
            stopped: self.stopped,
            stop,
            failure,
            thread: Some(thread),
            _device_words: self.device_words,
        })
    }
}

/// Proxies started by this process so far (spreads `auto` placement over cores).
static PROXIES_STARTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The CPU a new proxy of `gpu` should run on (`DOORBELL_PROXY_CPU`): for `auto`, a core of the
/// GPU's NUMA node, counted from the end of its list (away from core 0, where the OS and the
/// ranks' main threads tend to run), offset by the GPU's ordinal and this process's proxy count
/// so proxies of different GPUs and of one GPU do not spin on one core. `None` when unknown.
/// `placement`: the builder's choice, else the setting read now.
fn proxy_cpu(gpu: &Gpu, placement: Option<crate::job::config::ProxyCpu>) -> Result<Option<usize>> {
    use crate::job::config::{ProxyCpu, Settings};
    let nth = PROXIES_STARTED.fetch_add(1, Ordering::Relaxed);
    let placement = match placement {
        Some(p) => p,
        None => Settings::from_env()?.proxy_cpu,
    };
    match placement {
        ProxyCpu::Off => Ok(None),
        ProxyCpu::Cpu(c) => Ok(Some(c)),
        ProxyCpu::Auto => {
            let cpus = gpu
                .pci_bus_id()
                .ok()
                .and_then(|id| {
                    std::fs::read_to_string(format!("/sys/bus/pci/devices/{id}/local_cpulist")).ok()
                })
                .and_then(|list| parse_cpu_list(&list));
            Ok(cpus.filter(|c| !c.is_empty()).map(|c| {
                let k = (gpu.ordinal() * 4 + nth) % c.len();
                c[c.len() - 1 - k]
            }))
        }
    }
}

/// Parses a kernel CPU list (`0-63,128-191`).
pub(crate) fn parse_cpu_list(s: &str) -> Option<Vec<usize>> {
    let mut v = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (
                    a.trim().parse::<usize>().ok()?,
                    b.trim().parse::<usize>().ok()?,
                );
                if b < a {
                    return None;
                }
                v.extend(a..=b);
            }
            None => v.push(part.trim().parse().ok()?),
        }
    }
    Some(v)
}

/// Pins the calling thread to `cpu`; a refusal (the CPU is outside the process's cpuset) only
/// costs placement, so it is logged and ignored.
fn pin_to(cpu: usize) {
    // SAFETY: cpu_set_t is plain data; CPU_SET stays inside it for cpu < CPU_SETSIZE (checked);
    // sched_setaffinity(0, ...) affects only this thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if cpu >= libc::CPU_SETSIZE as usize {
            tracing::debug!("proxy CPU {cpu} is beyond CPU_SETSIZE; not pinned");
            return;
        }
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            tracing::debug!(
                "proxy not pinned to CPU {cpu}: {}",
                std::io::Error::last_os_error()
            );
        } else {
            tracing::debug!("proxy pinned to CPU {cpu}");
        }
    }
}

/// The consumer side of the FIFO ring, over any memory laid out as `fifo.cuh` describes (pinned
/// host memory in service, plain memory in the CPU model test).
pub(crate) struct RingReader {
    size_log2: u32,
}

impl RingReader {
    /// The trigger at position `tail`, if its pusher committed it. `word(slot, i)` reads the
    /// i-th u64 of a slot with a volatile load.
    pub(crate) fn poll(
        &self,
        tail: u64,
        word: impl Fn(usize, usize) -> u64,
    ) -> Option<ProxyTrigger> {
        let slot = (tail & ((1u64 << self.size_log2) - 1)) as usize;
        let want = ((tail >> self.size_log2) & 1) ^ 1;
        // Each 16-byte half lands whole and carries the commit parity in bit 63 of its second
        // word; the slot is committed once both do.
        let meta = word(slot, 3);
        if meta >> 63 != want {
            return None;
        }
        let dst = word(slot, 1);
        if dst >> 63 != want {
            return None;
        }
        fence(Ordering::Acquire);
        Some(ProxyTrigger {
            src_offset: word(slot, 0),
            dst_offset: dst & !(1 << 63),
            size: word(slot, 2),
            meta,
        })
    }
}

struct Worker {
    gpu: Arc<Gpu>,
    triggers: HostArray<ProxyTrigger>,
    tail: HostArray<u64>,
    size_log2: u32,
    tables: Tables,
}

impl Worker {
    fn run(&mut self, stop: &AtomicBool) -> Result<()> {
        self.gpu.bind()?;
        let ring = RingReader {
            size_log2: self.size_log2,
        };
        let mut tail = 0u64;
        let mut idle = 0u32;
        loop {
            let mut worked = false;
            // Drain what is committed.
            for _ in 0..64 {
                let Some(t) = ring.poll(tail, |slot, w| self.triggers.read_field(slot, w)) else {
                    break;
                };
                self.perform(tail, &t)?;
                tail += 1;
                fence(Ordering::Release);
                self.tail.write(0, tail);
                worked = true;
            }
            worked |= self.progress_flushes()?;
            // Checked on every pass, busy or not: a kernel that keeps pushing must not keep the
            // proxy from stopping (its pushes then fail with a report, see FifoHandle::push).
            if stop.load(Ordering::Relaxed) {
                return Ok(());
            }
            if worked {
                idle = 0;
                continue;
            }
            // A proxy is a dedicated thread: spin while work is likely (a few milliseconds), then
            // yield so an idle proxy does not starve the host.
            idle = idle.saturating_add(1);
            if idle < (1 << 20) {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    fn perform(&mut self, pos: u64, t: &ProxyTrigger) -> Result<()> {
        let m = ProxyTrigger::unpack(t.meta);
        let sem = if m.kind != 0 {
            Some(m.semaphore as usize)
                .filter(|&s| s < self.tables.semaphores.len())
                .ok_or_else(|| {
                    Error::invalid(
                        "trigger",
                        format!(
                            "position {pos}: semaphore {} is not registered",
                            m.semaphore
                        ),
                    )
                })?
        } else {
            return Ok(()); // a no-op trigger (FIFO round-trip probes)
        };
        let conn = self.tables.semaphores[sem].connection;
        if self.tables.connections[conn].net.is_some() {
            return self.perform_net(pos, t, conn);
        }
        if self.tables.connections[conn].ib.is_some() {
            return self.perform_ib(pos, t, conn, sem);
        }
        if m.kind & trigger::DATA != 0 && t.size > 0 {
            let (src, dst) = (
                self.range(m.src_mem, t.src_offset, t.size, pos)?,
                self.range(m.dst_mem, t.dst_offset, t.size, pos)?,
            );
            let c = &mut self.tables.connections[conn];
            // SAFETY: both ranges were checked against registered memory of this context.
            unsafe { crate::gpu::cuda::copy_async(&c.stream, dst, src, t.size as usize) }?;
            c.dirty = true;
        }
        if m.kind & trigger::FLAG != 0 {
            let s = &mut self.tables.semaphores[sem];
            s.outbound += 1;
            let c = &mut self.tables.connections[conn];
            // With the default memory barrier: the write lands after this connection's earlier
            // copies. (Measured on H200: under heavy load from other kernels a barriered write
            // can take about a millisecond; the NO_MEMORY_BARRIER flag was refused at run time.)
            // SAFETY: the token address is the peer's inbound token mapped in this context; the
            // write is queued after this connection's copies.
            check("cuStreamWriteValue64", unsafe {
                sys::cuStreamWriteValue64_v2(
                    c.stream.cu_stream(),
                    s.remote_token,
                    s.outbound,
                    sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
                )
            })?;
            c.dirty = true;
        }
        if m.kind & trigger::FLUSH != 0 {
            let c = &mut self.tables.connections[conn];
            if !c.dirty && c.pending.is_empty() {
                c.flush_done.write(0, pos + 1);
            } else {
                let ev = match c.spare_events.pop() {
                    Some(e) => e,
                    None => self
                        .gpu
                        .context()
                        .new_event(None)
                        .map_err(cuda_err("cuEventCreate"))?,
                };
                ev.record(&c.stream).map_err(cuda_err("cuEventRecord"))?;
                c.pending.push_back((pos, ev));
                c.dirty = false;
            }
        }
        Ok(())
    }

    /// A trigger of an Ethernet connection: queued to its sender thread, in order.
    fn perform_net(&mut self, pos: u64, t: &ProxyTrigger, conn: usize) -> Result<()> {
        let m = ProxyTrigger::unpack(t.meta);
        let data = if m.kind & trigger::DATA != 0 && t.size > 0 {
            Some(NetOp::Data {
                src: self.range(m.src_mem, t.src_offset, t.size, pos)?,
                offset: self.range(m.dst_mem, t.dst_offset, t.size, pos)?,
                size: t.size,
            })
        } else {
            None
        };
        let Some(net) = &self.tables.connections[conn].net else {
            return Ok(());
        };
        if let Some(op) = data {
            net.push(op)?;
        }
        if m.kind & trigger::FLAG != 0 {
            net.push(NetOp::Signal)?;
        }
        if m.kind & trigger::FLUSH != 0 {
            net.push(NetOp::Flush { pos })?;
        }
        Ok(())
    }

    /// A trigger of an Ib connection, as work requests on its queue pair (see [`IbConn`]).
    fn perform_ib(&mut self, pos: u64, t: &ProxyTrigger, conn: usize, sem: usize) -> Result<()> {
        use crate::transport::ib::wqe::Op;
        let m = ProxyTrigger::unpack(t.meta);
        let patience = std::time::Duration::from_secs(30);
        let key_of = |mem: u32| -> Result<u32> {
            self.tables.memories[mem as usize].key.ok_or_else(|| {
                Error::invalid(
                    "trigger",
                    format!("position {pos}: memory {mem} is not registered with the RDMA NIC"),
                )
            })
        };
        let stripes = self.tables.connections[conn]
            .ib
            .as_ref()
            .map_or(1, |ib| ib.qps.len().max(1)) as u64;
        // (queue pair, operation): data first, each part on its stripe.
        let mut ops: Vec<(usize, Op)> = Vec::new();
        if m.kind & trigger::DATA != 0 && t.size > 0 {
            let (src, dst) = (
                self.range(m.src_mem, t.src_offset, t.size, pos)?,
                self.range(m.dst_mem, t.dst_offset, t.size, pos)?,
            );
            let (lkey, rkey) = (key_of(m.src_mem)?, key_of(m.dst_mem)?);
            // Puts of 1 MiB or more: one contiguous part per QP (4 KiB multiples).
            let parts = if t.size >= 1 << 20 { stripes } else { 1 };
            let part = t.size.div_ceil(parts).next_multiple_of(4096);
            // A data segment carries less than 2 GiB: larger parts go as 1 GiB writes.
            const PIECE: u64 = 1 << 30;
            for q in 0..parts {
                let (start, end) = ((q * part).min(t.size), ((q + 1) * part).min(t.size));
                let mut off = start;
                while off < end {
                    let len = (end - off).min(PIECE);
                    ops.push((
                        q as usize,
                        Op::Write {
                            raddr: dst + off,
                            rkey,
                            laddr: src + off,
                            lkey,
                            len: len as u32,
                        },
                    ));
                    off += len;
                }
            }
        }
        let ib = self.tables.connections[conn]
            .ib
            .as_mut()
            .expect("an Ib connection");
        for (q, op) in &ops {
            ib.qps[*q].post(op, true, patience)?;
        }
        for qp in ib.qps.iter_mut() {
            qp.ring()?;
        }
        if m.kind & trigger::FLAG != 0 {
            let s = &mut self.tables.semaphores[sem];
            s.outbound += 1;
            let ends: Vec<u64> = ib.qps.iter().map(|q| q.posted()).collect();
            ib.deferred.push_back((sem, ends));
        }
        if m.kind & trigger::FLUSH != 0 {
            ib.pending.push_back((pos, None));
        }
        self.progress_ib(conn)?;
        Ok(())
    }

    /// Posts the deferred signals of Ib connection `conn` whose earlier writes completed on
    /// every other QP (each as a READ of the peer's token on QP 0, the flush of QP 0's writes,
    /// then a fetch-add of 1), in order; fixes what the flushes behind them wait for; reports
    /// completed flushes. True if anything moved.
    fn progress_ib(&mut self, conn: usize) -> Result<bool> {
        use crate::transport::ib::wqe::Op;
        let patience = std::time::Duration::from_secs(30);
        let (tables, mut any) = (&mut self.tables, false);
        let c = &mut tables.connections[conn];
        let Some(ib) = c.ib.as_mut() else {
            return Ok(false);
        };
        for qp in ib.qps.iter_mut() {
            if qp.completed() < qp.posted() {
                let before = qp.completed();
                any |= qp.poll()? != before;
            }
        }
        while let Some((sem, ends)) = ib.deferred.front() {
            let ready = ib
                .qps
                .iter()
                .zip(ends)
                .skip(1)
                .all(|(q, &end)| q.completed() >= end);
            if !ready {
                break;
            }
            let s = &tables.semaphores[*sem];
            let rkey = s
                .key
                .ok_or_else(|| Error::invalid("semaphore", "not an Ib semaphore"))?;
            let qp = &mut ib.qps[0];
            qp.post(
                &Op::Read {
                    raddr: s.remote_token,
                    rkey,
                    laddr: ib.scratch,
                    lkey: ib.scratch_key,
                    len: 8,
                },
                true,
                patience,
            )?;
            qp.post(
                &Op::FetchAdd {
                    raddr: s.remote_token,
                    rkey,
                    add: 1,
                    result: ib.scratch + 8,
                    lkey: ib.scratch_key,
                },
                true,
                patience,
            )?;
            qp.ring()?;
            ib.deferred.pop_front();
            any = true;
        }
        // A flush covers what was posted when it arrived, deferred signals included: it gets its
        // marks once the signals before it are posted.
        let deferred = ib.deferred.len();
        for (_, ends) in ib.pending.iter_mut() {
            if ends.is_none() && deferred == 0 {
                *ends = Some(ib.qps.iter().map(|q| q.posted()).collect());
            }
        }
        while let Some((pos, Some(ends))) = ib.pending.front() {
            if ib.qps.iter().zip(ends).any(|(q, &end)| q.completed() < end) {
                break;
            }
            c.flush_done.write(0, pos + 1);
            ib.pending.pop_front();
            any = true;
        }
        Ok(any)
    }

    /// Reports completed flushes; true if any progressed.
    fn progress_flushes(&mut self) -> Result<bool> {
        let mut any = false;
        for c in &mut self.tables.connections {
            if c.ib.is_some() {
                continue; // below
            }
            while let Some((pos, ev)) = c.pending.front() {
                if !ev.try_is_complete().map_err(cuda_err("cuEventQuery"))? {
                    break;
                }
                let pos = *pos;
                c.flush_done.write(0, pos + 1);
                if let Some((_, ev)) = c.pending.pop_front() {
                    c.spare_events.push(ev);
                }
                any = true;
            }
        }
        for conn in 0..self.tables.connections.len() {
            if self.tables.connections[conn].ib.is_some() {
                any |= self.progress_ib(conn)?;
            }
        }
        Ok(any)
    }

    fn range(&self, mem: u32, offset: u64, size: u64, pos: u64) -> Result<u64> {
        let m = self.tables.memories.get(mem as usize).ok_or_else(|| {
            Error::invalid(
                "trigger",
                format!("position {pos}: memory {mem} is not registered"),
            )
        })?;
        match offset.checked_add(size) {
            Some(end) if end <= m.bytes => Ok(m.ptr + offset),
            _ => Err(Error::invalid(
                "trigger",
                format!(
                    "position {pos}: [{offset}, +{size}) is outside memory {mem} of {} bytes",
                    m.bytes
                ),
            )),
        }
    }
}

/// A running proxy. [`ProxyService::stop`] (or dropping it) ends the thread and releases any
/// kernel still waiting on it with a reported error.
pub struct ProxyService {
    stopped: Arc<HostArray<u32>>,
    stop: Arc<AtomicBool>,
    failure: Arc<Mutex<Option<Error>>>,
    thread: Option<JoinHandle<Worker>>,
    _device_words: CudaSlice<u64>,
}

impl ProxyService {
    /// An error the proxy thread stopped on, if any (a bad trigger, a failed copy).
    pub fn failure(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|e| e.to_string())
    }

    /// Stops the thread; kernels still spinning on this proxy give up with a report. Returns the
    /// error the thread stopped on, if it stopped on one.
    pub fn stop(mut self) -> Result<()> {
        self.shutdown();
        match self
            .failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn shutdown(&mut self) {
        self.stopped.write(0, 1);
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for ProxyService {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device_api::TriggerMeta;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn cpu_lists_parse() {
        assert_eq!(parse_cpu_list("0-3,8\n"), Some(vec![0, 1, 2, 3, 8]));
        assert_eq!(parse_cpu_list("5"), Some(vec![5]));
        assert_eq!(parse_cpu_list("4-2"), None);
        assert_eq!(parse_cpu_list("x"), None);
    }

    /// The FIFO protocol on plain memory: host threads push exactly as `FifoHandle::push` does
    /// (claim a position, wait for room, write three words, publish the commit word with a
    /// release store carrying the lap parity), the proxy's own `RingReader` drains. A tiny ring
    /// and many pushers make every slot go through hundreds of laps; every trigger must arrive
    /// exactly once, with its fields intact (zeros included).
    #[test]
    fn many_pushers_many_laps_every_trigger_exactly_once() {
        const LOG2: u32 = 3; // 8 slots
        const PUSHERS: u64 = 4;
        const EACH: u64 = 5_000; // 20 000 triggers through 8 slots: 2 500 laps
        let slots: Arc<Vec<AtomicU64>> =
            Arc::new((0..(4 << LOG2)).map(|_| AtomicU64::new(0)).collect());
        let head = Arc::new(AtomicU64::new(0));
        let tail = Arc::new(AtomicU64::new(0));
        let capacity = 1u64 << LOG2;
        let pushers: Vec<_> = (0..PUSHERS)
            .map(|p| {
                let (slots, head, tail) = (slots.clone(), head.clone(), tail.clone());
                std::thread::spawn(move || {
                    for i in 0..EACH {
                        let pos = head.fetch_add(1, Ordering::Relaxed);
                        let deadline =
                            std::time::Instant::now() + std::time::Duration::from_secs(30);
                        while pos >= tail.load(Ordering::Acquire) + capacity {
                            assert!(std::time::Instant::now() < deadline, "ring never drained");
                            // More threads than cores here: let the consumer run.
                            std::thread::yield_now();
                        }
                        let base = ((pos & (capacity - 1)) * 4) as usize;
                        // Zeros are legal values: every third trigger is all zeros but the meta.
                        let payload = if i % 3 == 0 { 0 } else { p << 32 | i };
                        let parity = ((pos >> LOG2) & 1) ^ 1;
                        // As the device: both halves carry the parity; no order between them.
                        fence(Ordering::Release);
                        slots[base + 2].store(i, Ordering::Relaxed);
                        let meta = ProxyTrigger::pack(TriggerMeta {
                            kind: trigger::DATA,
                            semaphore: p as u32,
                            src_mem: 0,
                            dst_mem: (i % 7) as u32,
                            parity: parity as u32,
                        });
                        slots[base + 3].store(meta, Ordering::Relaxed);
                        slots[base].store(payload, Ordering::Relaxed);
                        slots[base + 1].store((payload ^ 0xABCD) | parity << 63, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        let ring = RingReader { size_log2: LOG2 };
        let mut seen = vec![vec![false; EACH as usize]; PUSHERS as usize];
        let mut t = 0u64;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while t < PUSHERS * EACH {
            assert!(
                std::time::Instant::now() < deadline,
                "consumer stalled at {t}"
            );
            let Some(trig) = ring.poll(t, |slot, w| slots[slot * 4 + w].load(Ordering::Relaxed))
            else {
                std::thread::yield_now();
                continue;
            };
            let m = ProxyTrigger::unpack(trig.meta);
            let (p, i) = (m.semaphore as u64, trig.size);
            assert_eq!(m.kind, trigger::DATA);
            assert_eq!(m.dst_mem as u64, i % 7);
            let payload = if i % 3 == 0 { 0 } else { p << 32 | i };
            assert_eq!(
                (trig.src_offset, trig.dst_offset),
                (payload, payload ^ 0xABCD),
                "pusher {p} #{i}"
            );
            assert!(
                !seen[p as usize][i as usize],
                "pusher {p} #{i} delivered twice"
            );
            seen[p as usize][i as usize] = true;
            t += 1;
            tail.store(t, Ordering::Release);
        }
        for h in pushers {
            h.join().expect("pusher");
        }
        assert!(
            seen.iter().all(|v| v.iter().all(|&b| b)),
            "a trigger was lost"
        );
        assert_eq!(t, PUSHERS * EACH);
    }
}
