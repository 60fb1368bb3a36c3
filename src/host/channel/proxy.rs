//! The proxy service: one host thread per GPU that drains the device-to-host trigger FIFO
//! ([`super::fifo`]) and performs the triggers on the GPU's behalf.
//!
//! The proxy keeps the tables triggers name by index (memories, semaphores, connections), checks
//! every range a trigger names against its memory, and hands the resolved addresses to the
//! trigger's [`Connection`]: how a put, a signal or a flush travels is the transport's business
//! (`crate::transport`), not this module's. Connections progress asynchronously, each on its
//! own, so a slow one never blocks triggers of other channels.
//!
//! Stopping the service (or dropping it) sets the FIFO's `stopped` word: every kernel spinning on
//! this proxy (a full ring, a flush, a PortChannel wait) gives up with a reported
//! [`crate::WaitKind::ProxyStopped`] instead of hanging.
//!
//! This module never decides which peers get channels or over which transport (the channel
//! layer does).

use super::fifo::RingReader;
use super::placement::{pin_to, proxy_cpu};
use crate::device_api::{trigger, FifoHandle, ProxyTrigger, WaitSite};
use crate::error::{Error, Result};
use crate::gpu::cuda::{cuda_err, Gpu, HostArray};
use crate::transport::{Address, Connection, FailureSink, Token};
use cudarc::driver::{CudaSlice, DevicePtr};
use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// Index of a registered memory in a proxy's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryId(pub u32);

/// Index of a semaphore (a peer's inbound token this proxy signals) in a proxy's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SemaphoreId(pub u32);

/// Index of a connection (one peer over one transport) in a proxy's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionId(pub u32);

struct Memory {
    ptr: u64,
    bytes: u64,
    /// Its key with the RDMA NIC, for memories a connection reaches by key.
    key: Option<u32>,
}

struct Semaphore {
    /// The peer's inbound token: mapped here, or at the peer's own address with the NIC's key.
    remote_token: Address,
    connection: usize,
    /// Signals so far.
    outbound: u64,
}

/// Everything the proxy thread works on. Built before the thread starts; the thread owns it.
struct Tables {
    memories: Vec<Memory>,
    semaphores: Vec<Semaphore>,
    connections: Vec<Box<dyn Connection>>,
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

    /// The GPU this proxy serves.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
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

    /// Registers `bytes` at `ptr` that connections reach with `key` (an RDMA NIC's): local memory
    /// registered with this rank's NIC, or a peer's memory by its own address and key.
    pub(crate) fn add_keyed_memory(&mut self, ptr: u64, bytes: u64, key: u32) -> Result<MemoryId> {
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

    /// A connection to one peer over any transport (a [`Connection`]). Returns its id and the
    /// device address of its flush word. (`add_connection`, the copy-engine connection to a peer
    /// of this host, is defined with the CUDA IPC wiring: this module names no transport.)
    pub fn add_transport_connection(
        &mut self,
        conn: Box<dyn Connection>,
    ) -> Result<(ConnectionId, u64)> {
        let flush_word = conn.flush_word();
        self.tables.connections.push(conn);
        Ok((
            ConnectionId(self.tables.connections.len() as u32 - 1),
            flush_word,
        ))
    }

    /// A semaphore whose token the connection reaches with `key` (an RDMA NIC's): `remote_token`
    /// is the peer's inbound token at the peer's own address, in memory the peer registered with
    /// its NIC under `key`.
    pub(crate) fn add_keyed_semaphore(
        &mut self,
        connection: ConnectionId,
        remote_token: u64,
        key: u32,
    ) -> Result<SemaphoreId> {
        let id = self.add_semaphore(connection, remote_token)?;
        self.tables.semaphores[id.0 as usize].remote_token.key = Some(key);
        Ok(id)
    }

    /// Where transport threads report failures: this proxy's failure slot and stop word.
    pub fn failure_sink(&self) -> FailureSink {
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
            remote_token: Address {
                addr: remote_token,
                key: None,
            },
            connection: connection.0 as usize,
            outbound: 0,
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
        let ring = RingReader::new(self.size_log2);
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
            worked |= self.progress()?;
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

    /// Performs the trigger at position `pos` on its semaphore's connection: the data, then the
    /// signal, then the flush, as the trigger asks.
    fn perform(&mut self, pos: u64, t: &ProxyTrigger) -> Result<()> {
        let m = ProxyTrigger::unpack(t.meta);
        if m.kind == 0 {
            return Ok(()); // a no-op trigger (FIFO round-trip probes)
        }
        let sem = Some(m.semaphore as usize)
            .filter(|&s| s < self.tables.semaphores.len())
            .ok_or_else(|| {
                Error::invalid(
                    "trigger",
                    format!(
                        "position {pos}: semaphore {} is not registered",
                        m.semaphore
                    ),
                )
            })?;
        let conn = self.tables.semaphores[sem].connection;
        if m.kind & trigger::DATA != 0 && t.size > 0 {
            let src = self.range(m.src_mem, t.src_offset, t.size, pos)?;
            let dst = self.range(m.dst_mem, t.dst_offset, t.size, pos)?;
            self.tables.connections[conn]
                .write(src, dst, t.size)
                .map_err(|e| at(pos, e))?;
        }
        if m.kind & trigger::FLAG != 0 {
            let s = &mut self.tables.semaphores[sem];
            s.outbound += 1;
            let token = Token {
                at: s.remote_token,
                count: s.outbound,
            };
            self.tables.connections[conn]
                .signal(token)
                .map_err(|e| at(pos, e))?;
        }
        if m.kind & trigger::FLUSH != 0 {
            self.tables.connections[conn].flush(pos)?;
        }
        Ok(())
    }

    /// Moves every connection's queued work on; true if any moved.
    fn progress(&mut self) -> Result<bool> {
        let mut any = false;
        for c in &mut self.tables.connections {
            any |= c.progress()?;
        }
        Ok(any)
    }

    /// The address `offset` of memory `mem` names, checked to hold `size` bytes.
    fn range(&self, mem: u32, offset: u64, size: u64, pos: u64) -> Result<Address> {
        let m = self.tables.memories.get(mem as usize).ok_or_else(|| {
            Error::invalid(
                "trigger",
                format!("position {pos}: memory {mem} is not registered"),
            )
        })?;
        match offset.checked_add(size) {
            Some(end) if end <= m.bytes => Ok(Address {
                addr: m.ptr + offset,
                key: m.key,
            }),
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

/// `e` with the trigger's position, for an invalid-argument error of a connection.
fn at(pos: u64, e: Error) -> Error {
    match e {
        Error::InvalidArgument { what, why } => Error::InvalidArgument {
            what,
            why: format!("position {pos}: {why}"),
        },
        e => e,
    }
}
