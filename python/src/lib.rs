//! `doorbell._doorbell`: the Rust core as seen from Python. Everything crosses as plain numbers:
//! device addresses, element counts, dtype names and CUDA stream handles (PyTorch's
//! `torch.cuda.current_stream().cuda_stream`), so no libtorch is linked. The Python package
//! (`python/py/doorbell`) checks tensors (device, dtype, contiguity, alignment, sizes) before
//! anything reaches this module; the functions here trust the addresses they are given, which is
//! why only that package should call them.
//!
//! Every blocking call (bootstrap, collective setup, argument agreement) releases the GIL.
//! Errors raise `doorbell.DoorbellError` with the library's message (which names the rank and
//! the cause), or `doorbell.NoGpuError` when there is no CUDA driver or GPU.

use cudarc::driver::{sys, CudaStream, DevicePtr};
use doorbell::channel::memory_channel::{MemoryChannels, RegisteredMemory};
use doorbell::collectives::allreduce::{AllReduce, AllReduceOptions};
use doorbell::collectives::alltoall::{AllToAll, AllToAllOptions};
use doorbell::collectives::moe::{
    MoeConfig, MoeHighThroughput, MoeLowLatency, PackedCombineOptions, PackedHandle, PackedOutputs,
};
use doorbell::collectives::DataType;
use doorbell::communicator::Communicator;
use doorbell::device_api::MemoryChannelHandle;
use doorbell::job::bootstrap::{Bootstrap, BootstrapConfig};
use doorbell::Error;
use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::borrow::Cow;
use std::sync::{Arc, Mutex};

create_exception!(
    _doorbell,
    DoorbellError,
    PyRuntimeError,
    "A doorbell call failed; the message names the rank and the cause."
);
create_exception!(
    _doorbell,
    NoGpuError,
    DoorbellError,
    "No CUDA driver or no GPU: doorbell's calls need an NVIDIA GPU."
);

fn py_err(e: Error) -> PyErr {
    match e {
        Error::NoCudaDriver { .. } => NoGpuError::new_err(e.to_string()),
        _ => DoorbellError::new_err(e.to_string()),
    }
}

/// The library's version.
#[pyfunction]
fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

/// Whether libcuda can be loaded here (no driver call is made).
#[pyfunction]
fn cuda_driver_present() -> bool {
    // SAFETY: only probes whether the library loads.
    unsafe { sys::is_culib_present() }
}

/// A TCP port free a moment ago, below the kernel's ephemeral range where there is room (so no
/// outgoing connection takes it before rank 0 listens on it; `doorbell::job::launch::free_port`).
/// The cause and remedy every timeout names when this process loads CUDA modules lazily while
/// host threads of doorbell make CUDA calls that kernels wait for; None otherwise.
#[pyfunction]
fn lazy_loading_hint() -> Option<String> {
    doorbell::error::lazy_loading_hint()
}

#[pyfunction]
fn free_port() -> PyResult<u16> {
    doorbell::job::launch::free_port().map_err(py_err)
}

/// GPUs this process sees; raises NoGpuError without a driver or a GPU.
#[pyfunction]
fn device_count() -> PyResult<usize> {
    doorbell::gpu::cuda::device_count().map_err(py_err)
}

fn dtype(name: &str) -> PyResult<DataType> {
    match name {
        "bfloat16" => Ok(DataType::Bf16),
        "float16" => Ok(DataType::F16),
        "float32" => Ok(DataType::F32),
        other => Err(PyValueError::new_err(format!(
            "dtype {other}: all_reduce sums bfloat16, float16 or float32"
        ))),
    }
}

/// A communicator of the job, on one GPU of this process (its primary context, the one PyTorch
/// uses), with its collectives built on first use.
#[pyclass(frozen, module = "doorbell._doorbell")]
struct Comm {
    comm: Arc<Communicator>,
    allreduce: Mutex<Option<AllReduce>>,
    alltoall: Mutex<Option<AllToAll>>,
}

impl Comm {
    /// PyTorch's stream `handle` (0: the legacy default stream) as a cudarc stream of this GPU.
    fn stream(&self, handle: u64) -> PyResult<Arc<CudaStream>> {
        self.comm.gpu().bind().map_err(py_err)?;
        // SAFETY: the handle is a live stream of this device's primary context (the package
        // passes torch.cuda.current_stream(device).cuda_stream); the wrapper does not own it.
        Ok(unsafe {
            self.comm
                .gpu()
                .context()
                .wrap_borrowed_stream(handle as sys::CUstream)
        })
    }
}

#[pymethods]
impl Comm {
    /// Joins the job: rank 0 listens on `port` of `addr`, every rank proves `secret`, then the
    /// communicator is built on GPU `device`. Collective; blocks (without the GIL) until every
    /// rank has joined or `timeout_s` passed.
    #[staticmethod]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (rank, world_size, local_rank, local_world_size, addr, port, secret, device, timeout_s=300.0))]
    fn connect(
        py: Python<'_>,
        rank: usize,
        world_size: usize,
        local_rank: usize,
        local_world_size: usize,
        addr: String,
        port: u16,
        secret: Vec<u8>,
        device: usize,
        timeout_s: f64,
    ) -> PyResult<Comm> {
        let timeout = doorbell::job::config::timeout_from_secs("timeout_s", timeout_s)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let comm = py
            .allow_threads(|| {
                doorbell::gpu::cuda::device_count()?;
                let settings = doorbell::job::config::Settings::from_env()?;
                let bootstrap = Bootstrap::connect(BootstrapConfig {
                    rank,
                    world_size,
                    local_rank,
                    local_world_size,
                    master_addr: addr,
                    master_port: port,
                    secret,
                    timeout,
                    heartbeat: settings.heartbeat_timeout,
                })?;
                Communicator::new(bootstrap, device)
            })
            .map_err(py_err)?;
        Ok(Comm {
            comm: Arc::new(comm),
            allreduce: Mutex::new(None),
            alltoall: Mutex::new(None),
        })
    }

    #[getter]
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    #[getter]
    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    #[getter]
    fn device(&self) -> usize {
        self.comm.gpu().ordinal()
    }

    /// Whether the ranks span more than one node (host).
    #[getter]
    fn spans_nodes(&self) -> bool {
        self.comm.spans_nodes()
    }

    /// Each rank's node, numbered from 0 in the order the nodes' first ranks come.
    #[getter]
    fn node_of_rank(&self) -> Vec<usize> {
        let ids = self.comm.node_ids();
        let mut seen: Vec<u64> = Vec::new();
        ids.iter()
            .map(|id| {
                seen.iter().position(|s| s == id).unwrap_or_else(|| {
                    seen.push(*id);
                    seen.len() - 1
                })
            })
            .collect()
    }

    /// Sums `count` elements of `dtype` at `input` over the ranks into `output` (may equal
    /// `input`), on `stream`. The first call builds the allreduce (collective).
    fn all_reduce(
        &self,
        py: Python<'_>,
        input: u64,
        output: u64,
        count: usize,
        dtype_name: &str,
        stream: u64,
    ) -> PyResult<()> {
        let dt = dtype(dtype_name)?;
        let s = self.stream(stream)?;
        py.allow_threads(|| {
            built(
                &self.allreduce,
                || AllReduce::new(&self.comm, AllReduceOptions::default()),
                |ar| {
                    // SAFETY: the package checked both tensors: CUDA tensors of this device,
                    // contiguous, `count` elements of `dtype`, alive until the stream's work is done
                    // (the caller keeps them, as with torch.distributed).
                    unsafe { ar.run_raw(&s, input, output, count, dt) }
                },
            )
        })
        .map_err(py_err)
    }

    /// Equal blocks of `bytes_per_peer` from `input` to every rank, into `output`.
    fn all_to_all(
        &self,
        py: Python<'_>,
        input: u64,
        output: u64,
        bytes_per_peer: usize,
        stream: u64,
    ) -> PyResult<()> {
        let s = self.stream(stream)?;
        py.allow_threads(|| {
            self.with_all_to_all(|a2a| {
                // SAFETY: checked by the package (see all_reduce); world * bytes_per_peer each.
                unsafe { a2a.run_raw(&s, input, output, bytes_per_peer) }
            })
        })
        .map_err(py_err)
    }

    /// Per-peer blocks whose byte counts and offsets sit in device memory at `counts` (4 x world
    /// u64: send counts, send offsets, recv counts, recv offsets), read by the kernel (graph
    /// replays may change them), which refuses any range outside `input_bytes` / `output_bytes`
    /// before writing anything.
    #[allow(clippy::too_many_arguments)]
    fn all_to_all_v(
        &self,
        py: Python<'_>,
        input: u64,
        input_bytes: usize,
        output: u64,
        output_bytes: usize,
        counts: u64,
        stream: u64,
    ) -> PyResult<()> {
        let s = self.stream(stream)?;
        py.allow_threads(|| {
            self.with_all_to_all(|a2a| {
                // SAFETY: the package passes live tensors of those sizes and a (4, world) int64
                // tensor of this device; the kernel checks every range the counts name.
                unsafe { a2a.run_v_raw(&s, input, input_bytes, output, output_bytes, counts) }
            })
        })
        .map_err(py_err)
    }

    /// Waits for `stream`; raises naming the rank and the cause when a fault cut a call on it
    /// short (its outputs are then not results) or the job has failed.
    fn synchronize(&self, py: Python<'_>, stream: u64) -> PyResult<()> {
        let s = self.stream(stream)?;
        py.allow_threads(|| self.comm.synchronize(&s))
            .map_err(py_err)
    }

    /// Checks the job's health: raises naming the failed ranks, if any.
    fn check_health(&self) -> PyResult<()> {
        self.comm.check_health().map_err(py_err)
    }

    /// `nbytes` of zero-filled GPU memory that peers on this host can map (for MemoryChannels).
    fn alloc(&self, py: Python<'_>, nbytes: usize) -> PyResult<Registered> {
        if nbytes == 0 {
            return Err(PyValueError::new_err("nbytes: at least 1"));
        }
        let mem = py
            .allow_threads(|| {
                let buf = self.comm.alloc(nbytes)?;
                self.comm.register(&buf)
            })
            .map_err(py_err)?;
        Ok(Registered { mem })
    }

    /// MemoryChannels to every peer (collective; every rank on this host): puts from `src` land
    /// in each peer's `dst`; `packets` (optional) is the LL packet area.
    #[pyo3(signature = (src, dst, packets=None))]
    fn memory_channels(
        &self,
        py: Python<'_>,
        src: &Registered,
        dst: &Registered,
        packets: Option<&Registered>,
    ) -> PyResult<MemChannels> {
        let inner = py
            .allow_threads(|| {
                self.comm
                    .memory_channels(&src.mem, &dst.mem, packets.map(|p| &p.mem))
            })
            .map_err(py_err)?;
        Ok(MemChannels {
            inner,
            world: self.comm.world_size(),
        })
    }
}

/// GPU memory allocated and registered by doorbell (peers on this host can map it).
#[pyclass(frozen, module = "doorbell._doorbell")]
struct Registered {
    mem: Arc<RegisteredMemory>,
}

#[pymethods]
impl Registered {
    #[getter]
    fn ptr(&self) -> u64 {
        self.mem.device_ptr()
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.mem.len()
    }
}

/// MemoryChannels to every peer; alive as long as this object.
#[pyclass(frozen, module = "doorbell._doorbell")]
struct MemChannels {
    inner: MemoryChannels,
    world: usize,
}

#[pymethods]
impl MemChannels {
    /// `world` handles of `handle_size()` bytes each, entry p the channel to rank p (this rank's
    /// own entry zero): the `doorbell::MemoryChannelHandle` array kernels take.
    fn handles(&self) -> Cow<'static, [u8]> {
        let mut all = vec![MemoryChannelHandle::default(); self.world];
        for c in self.inner.iter() {
            all[c.peer()] = c.device_handle();
        }
        Cow::Owned(bytemuck::cast_slice(&all).to_vec())
    }

    /// Bytes of one `doorbell::MemoryChannelHandle`.
    #[staticmethod]
    fn handle_size() -> usize {
        std::mem::size_of::<MemoryChannelHandle>()
    }
}

impl Comm {
    fn with_all_to_all(
        &self,
        f: impl FnOnce(&AllToAll) -> doorbell::Result<()>,
    ) -> doorbell::Result<()> {
        built(
            &self.alltoall,
            || AllToAll::new(&self.comm, AllToAllOptions::default()),
            f,
        )
    }
}

/// Runs `f` on the collective in `slot`, building it with `make` on first use (collective: every
/// rank's first call of that kind builds it at the same point).
fn built<T>(
    slot: &Mutex<Option<T>>,
    make: impl FnOnce() -> doorbell::Result<T>,
    f: impl FnOnce(&T) -> doorbell::Result<()>,
) -> doorbell::Result<()> {
    let mut slot = slot.lock().unwrap_or_else(|p| p.into_inner());
    if slot.is_none() {
        *slot = Some(make()?);
    }
    f(slot.as_ref().expect("built above"))
}

fn moe_config(
    hidden: usize,
    topk: usize,
    num_experts: usize,
    max_tokens: usize,
    sms: Option<u32>,
    net_chunks: Option<usize>,
) -> MoeConfig {
    MoeConfig::new(hidden, topk, num_experts, max_tokens)
        .with_blocks(sms)
        .with_net_chunks(net_chunks)
}

/// MoE dispatch/combine, high-throughput layout (DeepEP's normal kernels); node-spanning when the
/// communicator spans nodes.
#[pyclass(frozen, name = "MoeHighThroughput", module = "doorbell._doorbell")]
struct MoeHt {
    comm: Py<Comm>,
    inner: MoeHighThroughput,
}

fn results_dict<'py>(py: Python<'py>, items: &[(&str, u64)]) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (k, v) in items {
        d.set_item(k, v)?;
    }
    Ok(d)
}

#[pymethods]
impl MoeHt {
    /// Collective: allocates and exchanges the buffers for `max_tokens` tokens per rank, with
    /// `receive_slots` receive slots (`set_receive_slot`).
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (comm, hidden, topk, num_experts, max_tokens, sms=None, net_chunks=None, receive_slots=1))]
    fn new(
        py: Python<'_>,
        comm: Py<Comm>,
        hidden: usize,
        topk: usize,
        num_experts: usize,
        max_tokens: usize,
        sms: Option<u32>,
        net_chunks: Option<usize>,
        receive_slots: usize,
    ) -> PyResult<MoeHt> {
        let c = comm.get().comm.clone();
        let cfg = moe_config(hidden, topk, num_experts, max_tokens, sms, net_chunks)
            .with_receive_slots(receive_slots);
        let inner = py
            .allow_threads(|| MoeHighThroughput::new(&c, cfg))
            .map_err(py_err)?;
        Ok(MoeHt { comm, inner })
    }

    #[getter]
    fn spans_nodes(&self) -> bool {
        self.inner.spans_nodes()
    }

    #[getter]
    fn sms(&self) -> u32 {
        self.inner.sms()
    }

    /// bf16 rows `x [num_tokens, hidden]`, `topk_idx` i32 and `topk_weights` f32 `[num_tokens,
    /// topk]` (device addresses checked by the package).
    fn dispatch(
        &self,
        py: Python<'_>,
        x: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
        stream: u64,
    ) -> PyResult<()> {
        let s = self.comm.get().stream(stream)?;
        // SAFETY: checked by the package (shapes, dtypes, device, alignment, id range).
        py.allow_threads(|| unsafe {
            self.inner
                .dispatch_raw(&s, x, topk_idx, topk_weights, num_tokens)
        })
        .map_err(py_err)
    }

    /// e4m3 rows and one f32 scale per 128 values.
    #[allow(clippy::too_many_arguments)]
    fn dispatch_fp8(
        &self,
        py: Python<'_>,
        x: u64,
        scales: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
        stream: u64,
    ) -> PyResult<()> {
        let s = self.comm.get().stream(stream)?;
        // SAFETY: as for dispatch.
        py.allow_threads(|| unsafe {
            self.inner
                .dispatch_fp8_raw(&s, x, scales, topk_idx, topk_weights, num_tokens)
        })
        .map_err(py_err)
    }

    /// Dispatch routed by ranks: `in_rank [num_tokens, world]` bool, `tokens_per_expert
    /// [experts]` i32 or 0; `scales` nonzero for e4m3 rows.
    #[allow(clippy::too_many_arguments)]
    fn dispatch_by_rank(
        &self,
        py: Python<'_>,
        x: u64,
        scales: u64,
        in_rank: u64,
        tokens_per_expert: u64,
        num_tokens: usize,
        stream: u64,
    ) -> PyResult<()> {
        let s = self.comm.get().stream(stream)?;
        // SAFETY: the package checked the tensors' shapes, dtypes and devices.
        py.allow_threads(|| unsafe {
            self.inner
                .dispatch_by_rank_raw(&s, x, scales, in_rank, tokens_per_expert, num_tokens)
        })
        .map_err(py_err)
    }

    /// `y` (one bf16 row per received row of the last dispatch) into `out [num_tokens, hidden]`.
    /// With `y_weights` and `out_weights` (nonzero), the rows' `[*, topk]` f32 weights are summed
    /// the same way into `out_weights [num_tokens, topk]`.
    #[pyo3(signature = (y, out, stream, y_weights = 0, out_weights = 0))]
    fn combine(
        &self,
        py: Python<'_>,
        y: u64,
        out: u64,
        stream: u64,
        y_weights: u64,
        out_weights: u64,
    ) -> PyResult<()> {
        let s = self.comm.get().stream(stream)?;
        // SAFETY: checked by the package against the last dispatch's shapes.
        py.allow_threads(|| unsafe {
            if y_weights == 0 && out_weights == 0 {
                self.inner.combine_raw(&s, y, out)
            } else {
                self.inner
                    .combine_with_weights_raw(&s, y, out, y_weights, out_weights)
            }
        })
        .map_err(py_err)
    }

    /// Device addresses of the last dispatch's results and the room for rows.
    fn results<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let r = self.inner.results();
        results_dict(
            py,
            &[
                ("recv_x", r.recv_x),
                ("recv_idx", r.recv_idx),
                ("recv_weights", r.recv_weights),
                ("recv_src", r.recv_src),
                ("recv_scales", r.recv_scales),
                ("num_recv", r.num_recv),
                ("expert_counts", r.expert_counts),
                ("rank_prefix", r.rank_prefix),
                ("max_rows", r.max_rows as u64),
                ("slot_bytes", r.slot_bytes as u64),
            ],
        )
    }

    /// The receive slot of the next dispatches (and of `results`).
    fn set_receive_slot(&self, slot: usize) -> PyResult<()> {
        self.inner.set_receive_slot(slot).map_err(py_err)
    }

    /// The next dispatches set the ids of rows past the received ones, up to `rows`, to -1.
    fn set_worst_rows(&self, rows: usize) -> PyResult<()> {
        self.inner.set_worst_rows(rows).map_err(py_err)
    }

    /// Room for the expert outputs (`[rows, hidden]` bf16), allocated on first use.
    fn combine_buffer(&self) -> PyResult<u64> {
        self.inner.combine_buffer().map_err(py_err)
    }
}

/// MoE dispatch/combine, low-latency layout (DeepEP's decode kernels).
#[pyclass(frozen, name = "MoeLowLatency", module = "doorbell._doorbell")]
struct MoeLl {
    comm: Py<Comm>,
    inner: MoeLowLatency,
}

#[pymethods]
impl MoeLl {
    /// Collective: allocates and exchanges the receive areas for `max_tokens` tokens per rank
    /// (with `deep_ep_layout`, also DeepEP's layout: `dispatch_packed`, `combine_packed`; with
    /// `rank_mask` too, DeepEP's rank mask: `set_rank_masked`, `clean_rank_mask`,
    /// `rank_mask_ptr`).
    #[new]
    #[pyo3(signature = (comm, hidden, topk, num_experts, max_tokens, sms=None, deep_ep_layout=false, rank_mask=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        comm: Py<Comm>,
        hidden: usize,
        topk: usize,
        num_experts: usize,
        max_tokens: usize,
        sms: Option<u32>,
        deep_ep_layout: bool,
        rank_mask: bool,
    ) -> PyResult<MoeLl> {
        let c = comm.get().comm.clone();
        let cfg = moe_config(hidden, topk, num_experts, max_tokens, sms, None)
            .with_deep_ep_layout(deep_ep_layout)
            .with_rank_mask(rank_mask);
        let inner = py
            .allow_threads(|| MoeLowLatency::new(&c, cfg))
            .map_err(py_err)?;
        Ok(MoeLl { comm, inner })
    }

    #[getter]
    fn spans_nodes(&self) -> bool {
        self.inner.spans_nodes()
    }

    /// Masks (or unmasks) `rank` for the calls issued after on `stream` (DeepEP's
    /// `low_latency_update_mask_buffer`).
    fn set_rank_masked(
        &self,
        py: Python<'_>,
        rank: usize,
        masked: bool,
        stream: u64,
    ) -> PyResult<()> {
        let s = self.comm.get().stream(stream)?;
        py.allow_threads(|| self.inner.set_rank_masked(&s, rank, masked))
            .map_err(py_err)
    }

    /// Unmasks every rank on `stream` (DeepEP's `low_latency_clean_mask_buffer`).
    fn clean_rank_mask(&self, py: Python<'_>, stream: u64) -> PyResult<()> {
        let s = self.comm.get().stream(stream)?;
        py.allow_threads(|| self.inner.clean_rank_mask(&s))
            .map_err(py_err)
    }

    /// The rank mask's device address (`[world]` int32, 1 = masked), or 0 without one, after
    /// writing the peers found dead into it on `stream`.
    fn rank_mask_ptr(&self, py: Python<'_>, stream: u64) -> PyResult<u64> {
        let s = self.comm.get().stream(stream)?;
        py.allow_threads(|| self.inner.mask_dead_peers(&s))
            .map_err(py_err)?;
        Ok(self.inner.rank_mask().map_or(0, |m| m.device_ptr(&s).0))
    }

    /// The send half (bf16 rows, or e4m3 rows with `scales` != 0).
    #[allow(clippy::too_many_arguments)]
    fn dispatch_send(
        &self,
        py: Python<'_>,
        x: u64,
        scales: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
        stream: u64,
    ) -> PyResult<()> {
        let s = self.comm.get().stream(stream)?;
        // SAFETY: checked by the package (shapes, dtypes, device, alignment, id range).
        py.allow_threads(|| unsafe {
            if scales != 0 {
                self.inner
                    .dispatch_send_fp8_raw(&s, x, scales, topk_idx, topk_weights, num_tokens)
            } else {
                self.inner
                    .dispatch_send_raw(&s, x, topk_idx, topk_weights, num_tokens)
            }
        })
        .map_err(py_err)
    }

    /// Prepares a dispatch whose send half runs in the caller's kernel: launches nothing and
    /// returns ("nvlink", the bytes of a `doorbell::MoeLlArgs`) or ("net", the bytes of a
    /// `doorbell::MoeNetArgs`), the struct that kernel passes to `moe_ll::put_token` /
    /// `moe_net::put_token` and `finish_send` (layouts in `doorbell/coll/moe_args.cuh`).
    fn begin_fused_send(
        &self,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> PyResult<(&'static str, Cow<'static, [u8]>)> {
        use doorbell::collectives::moe::FusedSend;
        // SAFETY: checked by the package (shapes, dtypes, device); the tensors are kept until
        // the matching combine.
        let f = unsafe {
            self.inner
                .begin_fused_send(topk_idx, topk_weights, num_tokens)
        }
        .map_err(py_err)?;
        Ok(match f {
            FusedSend::Nvlink(a) => ("nvlink", Cow::Owned(bytemuck::bytes_of(&a).to_vec())),
            FusedSend::Net(a) => ("net", Cow::Owned(bytemuck::bytes_of(&a).to_vec())),
        })
    }

    /// The receive half.
    fn dispatch_recv(&self, py: Python<'_>, stream: u64) -> PyResult<()> {
        let s = self.comm.get().stream(stream)?;
        py.allow_threads(|| self.inner.dispatch_recv(&s))
            .map_err(py_err)
    }

    /// The combine's send half: the combine buffer's rows go back to their tokens' ranks.
    fn combine_send(&self, py: Python<'_>, stream: u64) -> PyResult<()> {
        let s = self.comm.get().stream(stream)?;
        py.allow_threads(|| self.inner.combine_send(&s))
            .map_err(py_err)
    }

    /// The combine's receive half, into `out [num_tokens, hidden]` bf16.
    fn combine_recv(&self, py: Python<'_>, out: u64, stream: u64) -> PyResult<()> {
        let s = self.comm.get().stream(stream)?;
        // SAFETY: checked by the package against the last dispatch's shapes.
        py.allow_threads(|| unsafe { self.inner.combine_recv_raw(&s, out) })
            .map_err(py_err)
    }

    /// DeepEP's layout: a dispatch (both halves, or with `send_only` the send half), its outputs
    /// at the addresses given (`scales` 0: bf16 rows; `stats` 0: none; `ticket` two u64 that
    /// pairs the receive half with this send, or 0; `wait_cycles` `[world]` i64 the receive half
    /// adds each source's wait to, or 0).
    #[pyo3(signature = (x, topk_idx, num_tokens, out_x, scales, round_scale, ue8m0, src_info, layout_range, count, stats, ticket, send_only, stream, ids_i64=false, wait_cycles=0))]
    #[allow(clippy::too_many_arguments)]
    fn dispatch_packed(
        &self,
        py: Python<'_>,
        x: u64,
        topk_idx: u64,
        num_tokens: usize,
        out_x: u64,
        scales: u64,
        round_scale: bool,
        ue8m0: bool,
        src_info: u64,
        layout_range: u64,
        count: u64,
        stats: u64,
        ticket: u64,
        send_only: bool,
        stream: u64,
        ids_i64: bool,
        wait_cycles: u64,
    ) -> PyResult<()> {
        let s = self.comm.get().stream(stream)?;
        let out = PackedOutputs::new(out_x, src_info, layout_range, count)
            .with_fp8(scales, round_scale, ue8m0)
            .with_stats(stats)
            .with_ticket(ticket)
            .with_i64_ids(ids_i64)
            .with_wait_cycles(wait_cycles);
        // SAFETY: checked by the package (shapes, dtypes, device, alignment); the tensors are
        // kept until the stream has run the call.
        py.allow_threads(|| unsafe {
            if send_only {
                self.inner
                    .dispatch_packed_send_raw(&s, x, topk_idx, num_tokens, &out)
            } else {
                self.inner
                    .dispatch_packed_raw(&s, x, topk_idx, num_tokens, &out)
            }
        })
        .map_err(py_err)
    }

    /// DeepEP's layout: a dispatch's receive half (after `dispatch_packed(.., send_only=True)`).
    #[pyo3(signature = (out_x, scales, round_scale, ue8m0, src_info, layout_range, count, stats, ticket, stream, wait_cycles=0))]
    #[allow(clippy::too_many_arguments)]
    fn dispatch_packed_recv(
        &self,
        py: Python<'_>,
        out_x: u64,
        scales: u64,
        round_scale: bool,
        ue8m0: bool,
        src_info: u64,
        layout_range: u64,
        count: u64,
        stats: u64,
        ticket: u64,
        stream: u64,
        wait_cycles: u64,
    ) -> PyResult<()> {
        let s = self.comm.get().stream(stream)?;
        let out = PackedOutputs::new(out_x, src_info, layout_range, count)
            .with_fp8(scales, round_scale, ue8m0)
            .with_stats(stats)
            .with_ticket(ticket)
            .with_wait_cycles(wait_cycles);
        // SAFETY: as in dispatch_packed.
        py.allow_threads(|| unsafe { self.inner.dispatch_packed_recv_raw(&s, &out) })
            .map_err(py_err)
    }

    /// DeepEP's layout: a combine's halves (`send`: `y` and the handle's `src_info` and
    /// `layout_range` go out; `recv`: `out [num_tokens, hidden]` from `topk_idx` and
    /// `topk_weights`, int64 ids with `ids_i64`; `ticket` pairs a receive half with its send,
    /// or 0; `wait_cycles` `[world]` i64 the receive half adds each source's wait to, or 0;
    /// `logfmt`: the rows go back as 10-bit log rows, both halves alike).
    #[pyo3(signature = (y, src_info, layout_range, topk_idx, topk_weights, num_tokens, out, ticket, send, recv, stream, ids_i64=false, wait_cycles=0, logfmt=false))]
    #[allow(clippy::too_many_arguments)]
    fn combine_packed(
        &self,
        py: Python<'_>,
        y: u64,
        src_info: u64,
        layout_range: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
        out: u64,
        ticket: u64,
        send: bool,
        recv: bool,
        stream: u64,
        ids_i64: bool,
        wait_cycles: u64,
        logfmt: bool,
    ) -> PyResult<()> {
        let s = self.comm.get().stream(stream)?;
        let options = PackedCombineOptions::new()
            .with_wait_cycles(wait_cycles)
            .with_logfmt(logfmt);
        let handle = PackedHandle {
            src_info,
            layout_range,
        };
        // SAFETY: checked by the package (shapes, dtypes, device, alignment).
        py.allow_threads(|| unsafe {
            match (send, recv) {
                (true, true) => self.inner.combine_packed_with_raw(
                    &s,
                    y,
                    &handle,
                    (topk_idx, ids_i64),
                    topk_weights,
                    num_tokens,
                    out,
                    &options,
                ),
                (true, false) => self
                    .inner
                    .combine_packed_send_with_raw(&s, y, &handle, ticket, &options),
                (false, true) => self.inner.combine_packed_recv_with_raw(
                    &s,
                    (topk_idx, ids_i64),
                    topk_weights,
                    num_tokens,
                    out,
                    ticket,
                    &options,
                ),
                (false, false) => Ok(()),
            }
        })
        .map_err(py_err)
    }

    /// Device addresses of the results of dispatch number `n` (1-based; None: the last one
    /// issued from the host), and the combine buffer.
    #[pyo3(signature = (n=None))]
    fn results<'py>(&self, py: Python<'py>, n: Option<u64>) -> PyResult<Bound<'py, PyDict>> {
        let r = match n {
            Some(n) => self.inner.results_of(n),
            None => self.inner.results(),
        };
        results_dict(
            py,
            &[
                ("recv_x", r.recv_x),
                ("recv_src", r.recv_src),
                ("recv_weights", r.recv_weights),
                ("recv_scales", r.recv_scales),
                ("layout", r.layout),
                ("recv_count", r.recv_count),
                ("combine_buffer", self.inner.combine_buffer()),
            ],
        )
    }
}

#[pymodule]
fn _doorbell(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_driver_present, m)?)?;
    m.add_function(wrap_pyfunction!(device_count, m)?)?;
    m.add_function(wrap_pyfunction!(free_port, m)?)?;
    m.add_function(wrap_pyfunction!(lazy_loading_hint, m)?)?;
    m.add_class::<Comm>()?;
    m.add_class::<MoeHt>()?;
    m.add_class::<MoeLl>()?;
    m.add_class::<Registered>()?;
    m.add_class::<MemChannels>()?;
    m.add("DoorbellError", m.py().get_type::<DoorbellError>())?;
    m.add("NoGpuError", m.py().get_type::<NoGpuError>())?;
    Ok(())
}
