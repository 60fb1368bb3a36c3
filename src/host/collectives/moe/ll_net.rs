//! The node-spanning path of [`super::MoeLowLatency`]: the low-latency (decode) dispatch and
//! combine for any mix of same-node peers (NVLink stores into their mapped areas) and peers on
//! other nodes (PortChannel puts: RDMA WRITEs posted by the kernels themselves with IBGDA or
//! CPU-assisted posting, or by the proxy, as the transports chose; or the Ethernet proxies).
//! Protocol: `cuda/include/doorbell/coll/moe_net.cuh`; kernels: `cuda/kernels/moe_net.cu`.
//!
//! Same results and contract as the NVLink path: rows at `[local expert][source rank][i]` in the
//! half the dispatch's epoch picks, the same combine sums (each rank's selections of a token in
//! top-k order, then the ranks' partial rows in rank order), everything counted on the device so
//! a dispatch and a combine can be captured in a CUDA graph, every call checked against the peers'
//! (the call words ride the channels into each peer's inbox). Differences: a token crosses to each
//! destination rank once with its top-k ids and weights in a header, and the receive half copies
//! it into each selected expert's slot. The area and channels: `net_area.rs`.

use super::net_area::{message_bytes, NetReceiveArea, ReceiveAreaShape};
use super::packed::{PackedCombine, PackedOutputs};
use super::path::LowLatencyPath;
use super::shared::{launch, FusedSend, LowLatencyResults, MoeConfig};
use crate::communicator::Communicator;
use crate::device_api::limits::{NET_MAX_PACK_PAIRS, NET_STAGE_PARTS};
use crate::device_api::{packed, MoeNetArgs};
use crate::error::{Error, Result};
use crate::gpu::cuda::cuda_err;
use crate::gpu::signature::{self, CallChecker, CallKind};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// DeepEP's layout across nodes: what its calls keep on the host to pair halves and handles.
#[derive(Default)]
struct PackedLog {
    /// The last packed sends, newest last: `(ticket, send ordinal, call word, FP8, received)`.
    sends: std::collections::VecDeque<(u64, u64, u64, bool, bool)>,
    /// The last two packed receives, newest first: `(layout_range address, send ordinal)`;
    /// the device keeps their epochs in the same order (`epochs[4..6]`).
    received: std::collections::VecDeque<(u64, u64)>,
    /// A combine's send half ran and its receive half has not.
    combine_in_flight: bool,
}

/// Node-spanning low-latency MoE state. Collective to build and to call.
pub(super) struct LlNet {
    area: NetReceiveArea,
    comm: Arc<Communicator>,
    base: MoeNetArgs,
    kernels: [CudaFunction; 8],
    dispatches: AtomicU64,
    /// topk_idx and token count of the last dispatch (the combine needs them).
    last: Mutex<(u64, u32)>,
    rows: u64,
    _device: Vec<CudaSlice<u8>>,
    /// The call check (`coll/moe_net.cuh`): every dispatch and combine counts one call; the words of
    /// the last dispatch and the last combine, for their receive halves.
    calls: CallChecker,
    words: Mutex<(u64, u64)>,
    /// DeepEP's layout (`MoeConfig::with_deep_ep_layout`): the scratch each send's prep kernel
    /// writes (two sets, taken by send parity: `[rows e4m3, scales f32, ids i32]` addresses),
    /// and the host's log of packed calls.
    prep: Option<[[u64; 3]; 2]>,
    packed: Mutex<PackedLog>,
}

impl LlNet {
    pub(super) fn new(comm: &Arc<Communicator>, cfg: &MoeConfig) -> Result<LlNet> {
        let world = comm.world_size();
        let local = cfg.num_experts / world.max(1);
        if cfg.deep_ep_layout && local * world > NET_MAX_PACK_PAIRS {
            return Err(Error::invalid(
                "config",
                format!(
                    "DeepEP's layout across nodes takes at most {NET_MAX_PACK_PAIRS} (local expert, \
                     rank) pairs; {local} experts a rank at {world} ranks are {}",
                    local * world
                ),
            ));
        }
        let area = NetReceiveArea::new(
            comm,
            cfg,
            ReceiveAreaShape {
                messages: 2 * world * cfg.max_tokens * message_bytes(cfg),
                counts: 2 * world * 8,
                fill_extra: local * world,
                credits: false,
                // DeepEP's layout returns a row per selection: slot (combine parity, token, k)
                // here, staged at (source, message, k) for a network peer.
                part_rows: if cfg.deep_ep_layout {
                    (2 * cfg.topk).max(world) * cfg.max_tokens
                } else {
                    world * cfg.max_tokens
                },
                stage_part_rows: world
                    * cfg.max_tokens
                    * if cfg.deep_ep_layout { cfg.topk } else { 1 },
                part_weights: 0,
            },
        )?;
        let gpu = comm.gpu().clone();
        let rows = local * world * cfg.max_tokens;
        let stream = gpu.new_stream()?;
        let alloc = |bytes: usize| -> Result<CudaSlice<u8>> {
            stream
                .alloc_zeros::<u8>(bytes.max(16))
                .map_err(cuda_err("cuMemAlloc"))
        };
        let mut device = vec![
            alloc(rows * cfg.hidden * 2)?,                             // 0 y
            alloc(2 * rows * cfg.hidden * 2)?,                         // 1 recv_x
            alloc(2 * rows * 4)?,                                      // 2 recv_src
            alloc(2 * rows * 4)?,                                      // 3 recv_weights
            alloc(2 * rows * (cfg.hidden / 128).max(1) * 4)?,          // 4 recv_scales
            alloc(2 * world * cfg.max_tokens * cfg.topk * 4)?,         // 5 rec
            alloc(local * world * 4)?,                                 // 6 layout
            alloc(local * 4)?,                                         // 7 recv_count
            alloc(world * cfg.max_tokens * 4)?,                        // 8 list
            alloc(world * 4)?,                                         // 9 arrived
            alloc(cfg.max_tokens.div_ceil(32) * NET_STAGE_PARTS * 8)?, // 10 staged
        ];
        if cfg.deep_ep_layout {
            // 11-16: the prep kernel's scratch, two sets (rows e4m3, scales, ids).
            for _ in 0..2 {
                device.push(alloc(cfg.max_tokens * cfg.hidden)?);
                device.push(alloc(cfg.max_tokens * (cfg.hidden / 128).max(1) * 4)?);
                device.push(alloc(cfg.max_tokens * cfg.topk * 4)?);
            }
        }
        let p = |i: usize| device[i].device_ptr(&stream).0;
        let prep = cfg
            .deep_ep_layout
            .then(|| [[p(11), p(12), p(13)], [p(14), p(15), p(16)]]);
        let base = MoeNetArgs {
            y: p(0),
            recv_x: p(1),
            recv_src: p(2),
            recv_weights: p(3),
            recv_scales: p(4),
            rec: p(5),
            layout: p(6),
            recv_count: p(7),
            list: p(8),
            arrived: p(9),
            staged: p(10),
            ..area.base
        };
        stream
            .synchronize()
            .map_err(cuda_err("cuStreamSynchronize"))?;
        let k = |name: &str| gpu.function("moe_net", name);
        let kernels = [
            k("moe_net_dispatch_send")?,
            k("moe_net_dispatch_recv")?,
            k("moe_net_combine_send")?,
            k("moe_net_combine_recv")?,
            k("moe_net_dispatch_prep")?,
            k("moe_net_dispatch_pack")?,
            k("moe_net_combine_send_packed")?,
            k("moe_net_combine_recv_packed")?,
        ];
        comm.bootstrap().barrier()?;
        Ok(LlNet {
            area,
            comm: comm.clone(),
            base,
            kernels,
            dispatches: AtomicU64::new(0),
            last: Mutex::new((0, 0)),
            rows: rows as u64,
            _device: device,
            // The words travel to each peer\'s inbox in its area, not mapped ones.
            calls: crate::collectives::channel_call_checker(comm)?,
            words: Mutex::new((0, 0)),
            prep,
            packed: Mutex::new(PackedLog::default()),
        })
    }

    /// The next call's word (counts the call), kept for its receive half.
    fn next_word(&self, kind: CallKind, graph: bool) -> u64 {
        let word = self.calls.next(kind, 0, 0, 0, 0, graph).word;
        let mut w = self.words.lock().unwrap_or_else(|p| p.into_inner());
        if kind == CallKind::MoeLlDispatch {
            w.0 = word;
        } else {
            w.1 = word;
        }
        word
    }

    fn launch(&self, stream: &CudaStream, k: usize, args: &MoeNetArgs) -> Result<()> {
        self.launch_on(stream, k, self.area.blocks, args)
    }

    fn launch_on(
        &self,
        stream: &CudaStream,
        k: usize,
        blocks: u32,
        args: &MoeNetArgs,
    ) -> Result<()> {
        self.area.proxy_alive()?;
        // The send (task-parallel, moe_net_dispatch_send) runs 256 threads a block: more registers per
        // thread for its posting paths; the others 512.
        let threads = if k == 0 { 256 } else { 512 };
        launch(&self.comm, &self.kernels[k], stream, blocks, threads, args)
    }

    /// Checks a dispatch's inputs, counts it, and returns its send arguments (`graph`: the
    /// send is being captured; false for a fused send, whose stream only the caller knows).
    fn prepare_send(
        &self,
        x: u64,
        scales: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
        graph: bool,
    ) -> Result<MoeNetArgs> {
        let max = self.base.max_tokens as usize;
        if num_tokens > max || x % 16 != 0 || topk_idx % 4 != 0 || topk_weights % 4 != 0 {
            return Err(Error::invalid(
                "dispatch",
                format!(
                    "{num_tokens} tokens (at most {max}), x 16-byte, topk_idx and topk_weights \
                     4-byte aligned"
                ),
            ));
        }
        if scales != 0 && (self.base.hidden % 128 != 0 || scales % 4 != 0) {
            return Err(Error::invalid(
                "dispatch",
                format!(
                    "FP8 rows need a hidden size that is a multiple of 128 (it is {}) and \
                     4-byte aligned scales",
                    self.base.hidden
                ),
            ));
        }
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = (topk_idx, num_tokens as u32);
        self.dispatches.fetch_add(1, Ordering::Relaxed);
        Ok(MoeNetArgs {
            x,
            scales,
            fp8: u32::from(scales != 0),
            topk_idx,
            topk_weights,
            num_tokens: num_tokens as u32,
            call_word: self.next_word(CallKind::MoeLlDispatch, graph),
            ..self.base
        })
    }

    /// Launches the send half with prepared arguments.
    fn send(&self, stream: &CudaStream, args: &MoeNetArgs) -> Result<()> {
        self.launch(stream, 0, args)
    }

    /// Dispatches issued from the host so far.
    fn dispatches(&self) -> u64 {
        self.dispatches.load(Ordering::Relaxed)
    }
}

impl LlNet {
    /// DeepEP's layout was built (`MoeConfig::with_deep_ep_layout`): the prep kernel's scratch.
    fn prep(&self) -> Result<&[[u64; 3]; 2]> {
        self.prep.as_ref().ok_or_else(|| {
            Error::invalid(
                "DeepEP's low-latency layout",
                "build the MoeLowLatency with MoeConfig::with_deep_ep_layout(true)",
            )
        })
    }

    fn log(&self) -> std::sync::MutexGuard<'_, PackedLog> {
        self.packed.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// DeepEP's layout, the receive half: the send of `out`'s ticket (else the last), then the
    /// pack into `out`.
    fn packed_recv(&self, stream: &CudaStream, out: &PackedOutputs, bits: u32) -> Result<()> {
        let (ordinal, word) = {
            let mut log = self.log();
            let now = self.dispatches();
            let at = if out.ticket != 0 {
                log.sends.iter().rposition(|s| s.0 == out.ticket)
            } else {
                log.sends.len().checked_sub(1)
            };
            let Some(at) = at else {
                return Err(Error::invalid(
                    "dispatch receive",
                    "no send in DeepEP's layout to receive (give the ticket its send was given)",
                ));
            };
            let (_, ordinal, word, fp8, _) = log.sends[at];
            if fp8 != (out.scales != 0) {
                return Err(Error::invalid(
                    "dispatch receive",
                    format!(
                        "its send wrote {} rows; give the receive half the same outputs ({})",
                        if fp8 { "FP8" } else { "bf16" },
                        if fp8 { "with scales" } else { "without scales" }
                    ),
                ));
            }
            if now - ordinal >= 2 {
                return Err(Error::invalid(
                    "dispatch receive",
                    "two later dispatches were sent since its send, so its rows were \
                     overwritten: at most two dispatches in flight",
                ));
            }
            // The call check reads each peer's words in the order they were announced, so across
            // nodes the receive halves run in their sends' order.
            if log.sends.iter().take(at).any(|s| !s.4 && now - s.1 < 2) {
                return Err(Error::invalid(
                    "dispatch receive",
                    "across nodes the receive halves run in their sends' order: receive the \
                     dispatch sent before this one first",
                ));
            }
            log.sends[at].4 = true;
            (ordinal, word)
        };
        let recv = MoeNetArgs {
            call_word: word,
            ticket: out.ticket,
            packed: packed::PACKED,
            ..self.base
        };
        self.launch(stream, 1, &recv)?;
        let pack = MoeNetArgs {
            packed_x: out.x,
            packed_scales: out.scales,
            packed_src: out.src_info,
            packed_range: out.layout_range,
            packed_count: out.count,
            packed_stats: out.stats,
            packed: bits,
            ..self.base
        };
        self.launch(stream, 5, &pack)?;
        let mut log = self.log();
        log.received.push_front((out.layout_range, ordinal));
        log.received.truncate(2);
        Ok(())
    }
}

impl LowLatencyPath for LlNet {
    fn spans_nodes(&self) -> bool {
        true
    }

    fn last_tokens(&self) -> usize {
        self.last.lock().unwrap_or_else(|p| p.into_inner()).1 as usize
    }

    unsafe fn dispatch_send(
        &self,
        stream: &CudaStream,
        x: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<()> {
        let graph = signature::capturing(stream);
        let args = self.prepare_send(x, 0, topk_idx, topk_weights, num_tokens, graph)?;
        self.send(stream, &args)
    }

    unsafe fn dispatch_send_fp8(
        &self,
        stream: &CudaStream,
        x: u64,
        scales: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<()> {
        if scales == 0 {
            return Err(Error::invalid("scales", "a device address is needed"));
        }
        let graph = signature::capturing(stream);
        let args = self.prepare_send(x, scales, topk_idx, topk_weights, num_tokens, graph)?;
        self.send(stream, &args)
    }

    unsafe fn begin_fused_send(
        &self,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<FusedSend> {
        self.prepare_send(0, 0, topk_idx, topk_weights, num_tokens, false)
            .map(FusedSend::Net)
    }

    fn dispatch_recv(&self, stream: &CudaStream) -> Result<()> {
        let call_word = self.words.lock().unwrap_or_else(|p| p.into_inner()).0;
        let args = MoeNetArgs {
            call_word,
            ..self.base
        };
        self.launch(stream, 1, &args)
    }

    unsafe fn dispatch(
        &self,
        stream: &CudaStream,
        x: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<()> {
        let graph = signature::capturing(stream);
        let args = self.prepare_send(x, 0, topk_idx, topk_weights, num_tokens, graph)?;
        self.send(stream, &args)?;
        self.dispatch_recv(stream)
    }

    fn results(&self) -> LowLatencyResults {
        self.results_of(self.dispatches())
    }

    fn results_of(&self, n: u64) -> LowLatencyResults {
        let half = n & 1;
        let b = &self.base;
        LowLatencyResults {
            recv_x: b.recv_x + half * self.rows * b.hidden as u64 * 2,
            recv_src: b.recv_src + half * self.rows * 4,
            recv_weights: b.recv_weights + half * self.rows * 4,
            recv_scales: b.recv_scales + half * self.rows * (b.hidden as u64 / 128).max(1) * 4,
            layout: b.layout,
            recv_count: b.recv_count,
        }
    }

    fn combine_buffer(&self) -> u64 {
        self.base.y
    }

    fn combine_send(&self, stream: &CudaStream) -> Result<()> {
        let args = MoeNetArgs {
            call_word: self.next_word(CallKind::MoeLlCombine, signature::capturing(stream)),
            ..self.base
        };
        self.launch(stream, 2, &args)
    }

    unsafe fn combine_recv(&self, stream: &CudaStream, out: u64) -> Result<()> {
        if out % 16 != 0 {
            return Err(Error::invalid("combine", "out 16-byte aligned"));
        }
        let (topk_idx, num_tokens) = *self.last.lock().unwrap_or_else(|p| p.into_inner());
        let call_word = self.words.lock().unwrap_or_else(|p| p.into_inner()).1;
        let args = MoeNetArgs {
            topk_idx,
            num_tokens,
            out,
            call_word,
            ..self.base
        };
        self.launch(stream, 3, &args)
    }

    unsafe fn combine(&self, stream: &CudaStream, out: u64) -> Result<()> {
        self.combine_send(stream)?;
        // SAFETY: as the trait's contract says.
        unsafe { self.combine_recv(stream, out) }
    }

    /// DeepEP's layout across nodes: the prep kernel (ids as i32, FP8 cast once, as on one
    /// node), the node-spanning send with no weights, and unless `send_only` the receive half.
    unsafe fn dispatch_packed(
        &self,
        stream: &CudaStream,
        x: u64,
        topk_idx: u64,
        num_tokens: usize,
        out: &PackedOutputs,
        send_only: bool,
    ) -> Result<()> {
        let prep = *self.prep()?;
        let bits = out.bits(self.base.hidden as usize)?;
        untimed(out.wait_cycles, "dispatch")?;
        let max = self.base.max_tokens as usize;
        let id_align = if out.ids_i64 { 8 } else { 4 };
        if num_tokens > max
            || x % 16 != 0
            || topk_idx % id_align != 0
            || (num_tokens > 0 && (x == 0 || topk_idx == 0))
        {
            return Err(Error::invalid(
                "dispatch",
                format!(
                    "{num_tokens} tokens (at most {max}), x 16-byte and topk_idx {id_align}-byte \
                     aligned"
                ),
            ));
        }
        let fp8 = out.scales != 0;
        {
            // Across nodes the staging half of a send is reused two sends later, and only a
            // receive in between proves the NIC has read it: one dispatch in flight at a time.
            let log = self.log();
            let now = self.dispatches();
            if log.sends.iter().any(|s| !s.4 && now - s.1 < 1) {
                return Err(Error::invalid(
                    "dispatch",
                    "across nodes one dispatch is in flight at a time: run the last dispatch's \
                     receive half (its hook) first",
                ));
            }
        }
        let [rows, scales, ids] = prep[(self.dispatches() % 2) as usize];
        let tokens_blocks = (num_tokens.div_ceil(16) as u32).clamp(1, self.area.blocks);
        let prep_args = MoeNetArgs {
            in_x: x,
            in_ids: topk_idx,
            x: rows,
            scales,
            topk_idx: ids,
            fp8: u32::from(fp8),
            num_tokens: num_tokens as u32,
            packed: bits,
            ..self.base
        };
        self.launch_on(stream, 4, tokens_blocks, &prep_args)?;
        let graph = signature::capturing(stream);
        let (sx, ss) = if fp8 { (rows, scales) } else { (x, 0) };
        let send = MoeNetArgs {
            ticket: out.ticket,
            ..self.prepare_send(sx, ss, ids, 0, num_tokens, graph)?
        };
        self.send(stream, &send)?;
        {
            let mut log = self.log();
            if log.sends.len() == 8 {
                log.sends.pop_front();
            }
            log.sends
                .push_back((out.ticket, self.dispatches(), send.call_word, fp8, false));
        }
        if send_only {
            return Ok(());
        }
        self.packed_recv(stream, out, bits)
    }

    unsafe fn dispatch_packed_recv(&self, stream: &CudaStream, out: &PackedOutputs) -> Result<()> {
        self.prep()?;
        let bits = out.bits(self.base.hidden as usize)?;
        untimed(out.wait_cycles, "dispatch")?;
        self.packed_recv(stream, out, bits)
    }

    /// DeepEP's layout across nodes: the send half returns a row per selection of the handle's
    /// dispatch (one of the last two received, its rows not yet overwritten); the receive half
    /// applies the combine's weights. One combine in flight at a time.
    unsafe fn combine_packed(&self, stream: &CudaStream, call: &PackedCombine) -> Result<()> {
        self.prep()?;
        untimed(call.options.wait_cycles, "combine")?;
        if call.options.logfmt {
            return Err(Error::invalid(
                "combine",
                "across nodes the rows go back as bf16 only (no log rows yet); pass logfmt off",
            ));
        }
        let mut send_args = None;
        if let Some((y, h)) = call.checked_send()? {
            let log = self.log();
            if log.combine_in_flight {
                return Err(Error::invalid(
                    "combine",
                    "across nodes one combine is in flight at a time: run the last combine's \
                     receive half (its hook) first",
                ));
            }
            let Some(back) = log.received.iter().position(|r| r.0 == h.layout_range) else {
                return Err(Error::invalid(
                    "combine",
                    "across nodes a combine takes the handle of one of the last two dispatches \
                     this rank received (this one is older, or not a dispatch's)",
                ));
            };
            if self.dispatches() - log.received[back].1 >= 2 {
                return Err(Error::invalid(
                    "combine",
                    "two dispatches were sent after the handle's, so its rows are gone: combine \
                     it before the second dispatch after it",
                ));
            }
            send_args = Some(MoeNetArgs {
                y,
                packed_range: h.layout_range,
                back: back as u32,
                ..self.base
            });
        }
        let mut recv_args = None;
        if let Some((topk_idx, topk_weights, num_tokens, out)) =
            call.checked_recv(self.base.max_tokens as usize)?
        {
            if send_args.is_none() && !self.log().combine_in_flight {
                return Err(Error::invalid(
                    "combine receive",
                    "no combine's send half is waiting for it",
                ));
            }
            recv_args = Some(MoeNetArgs {
                in_ids: topk_idx,
                topk_weights,
                num_tokens: num_tokens as u32,
                out,
                packed: packed::PACKED | if call.ids_i64 { packed::IDS64 } else { 0 },
                ..self.base
            });
        }
        if let Some(args) = send_args {
            let args = MoeNetArgs {
                call_word: self.next_word(CallKind::MoeLlCombine, signature::capturing(stream)),
                ..args
            };
            self.launch(stream, 6, &args)?;
            self.log().combine_in_flight = true;
        }
        if let Some(args) = recv_args {
            let args = MoeNetArgs {
                call_word: self.words.lock().unwrap_or_else(|p| p.into_inner()).1,
                ..args
            };
            self.launch(stream, 7, &args)?;
            self.log().combine_in_flight = false;
        }
        Ok(())
    }
}

/// Refuses a wait-statistics array (`PackedOutputs::wait_cycles`, the combine's): the
/// node-spanning kernels do not keep them yet.
fn untimed(wait_cycles: u64, call: &str) -> Result<()> {
    if wait_cycles == 0 {
        return Ok(());
    }
    Err(Error::invalid(
        call,
        "across nodes the receive waits are not added up per source yet (DeepEP's \
         wait_recv_cost_stats); pass none",
    ))
}
