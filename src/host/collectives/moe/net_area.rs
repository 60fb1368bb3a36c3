//! The receive area both node-spanning MoE paths (`ht_net.rs`, `ll_net.rs`) share: this rank's
//! area (registered with the NIC, mapped by same-node peers), its staging area, PortChannels from
//! the staging area to every peer's area, and the device arrays the kernels find peers, counters
//! and epochs in. Layout: `doorbell/coll/moe_args.cuh` (`MoeNetArgs`) and `coll/moe_net.cuh`.

use super::shared::MoeConfig;
use crate::channel::memory_channel::RegisteredMemory;
use crate::channel::port_channel::PortChannels;
use crate::channel::proxy::ProxyService;
use crate::channel::symmetric::SymmetricBuffer;
use crate::communicator::Communicator;
use crate::device_api::limits::MAX_NET_RANKS;
use crate::device_api::{MoeNetArgs, PortChannelHandle, WaitSite};
use crate::error::{Error, Result};
use crate::gpu::cuda::cuda_err;
use crate::gpu::memory::Buffer;
use cudarc::driver::{CudaSlice, DevicePtr};
use std::sync::Arc;

/// Words of the call check's inbox in the area (`coll/moe_net.cuh`, kInboxWords): `[2][64]` slots, then
/// 64 counts of calls announced and 64 of calls checked.
const INBOX_WORDS: usize = 4 * MAX_NET_RANKS;

/// The channel id wait reports of this path carry.
const SITE_CHANNEL: u32 = u32::MAX - 1;

/// The shape of a [`NetReceiveArea`]: what each path keeps in the area and the staging area beside
/// the parts both share (the staged messages by token, the partial rows of the combine).
pub(super) struct ReceiveAreaShape {
    /// Bytes of the area's message region (at offset 0).
    pub messages: usize,
    /// Bytes of the area's count region (`off_counts`) and of the staging area's
    /// (`stage_counts`): count words, or chunk descriptors.
    pub counts: usize,
    /// u32 counters the path keeps after the per-rank message counts.
    pub fill_extra: usize,
    /// A second set of PortChannels for credit signals (high throughput).
    pub credits: bool,
    /// Rows (hidden bf16) of the area's partial-row region and of the staging area's: the
    /// combine's returns and what is staged for network peers (`world x max_tokens` each for
    /// doorbell's layout; DeepEP's layout returns a row per selection).
    pub part_rows: usize,
    pub stage_part_rows: usize,
    /// f32 values beside each partial row, in a region of their own in the area and in the
    /// staging area (the high-throughput combine's top-k weights; 0: none).
    pub part_weights: usize,
}

/// The memory and channels both node-spanning MoE paths share: this rank's area (registered with
/// the NIC, mapped by same-node peers), its staging area, PortChannels from the staging area to
/// every peer's area, and the device arrays the kernels find peers, counters and epochs in.
pub(super) struct NetReceiveArea {
    // Dropped first: the proxy thread stops before the memory it moves goes away.
    pub(super) proxy: ProxyService,
    /// The transport's fields of the kernels' arguments (the rest zero).
    pub(super) base: MoeNetArgs,
    pub(super) blocks: u32,
    /// Device address of the credit channels' handles (0 without them).
    pub(super) credits: u64,
    /// Offsets of the partial weights (`ReceiveAreaShape::part_weights`) in the area and in the
    /// staging area (0 without them).
    pub(super) off_part_w: u64,
    pub(super) stage_part_w: u64,
    _channels: Vec<PortChannels>,
    _area: SymmetricBuffer,
    _stage: (Arc<Buffer>, Arc<RegisteredMemory>),
    _device: Vec<CudaSlice<u8>>,
}

impl NetReceiveArea {
    /// Collective.
    pub(super) fn new(
        comm: &Arc<Communicator>,
        cfg: &MoeConfig,
        shape: ReceiveAreaShape,
    ) -> Result<Self> {
        let world = comm.world_size();
        let rank = comm.rank();
        if world > MAX_NET_RANKS || cfg.hidden == 0 || cfg.hidden % 8 != 0 {
            return Err(Error::invalid(
                "config",
                format!(
                    "at most {MAX_NET_RANKS} ranks and a hidden size that is a positive multiple \
                     of 8"
                ),
            ));
        }
        if cfg.num_experts == 0
            || cfg.num_experts % world != 0
            || cfg.topk == 0
            || cfg.topk > 32
            || cfg.max_tokens == 0
            || 2 * (cfg.num_experts as u64) * (cfg.max_tokens as u64) >= 1 << 31
        {
            return Err(Error::invalid(
                "config",
                "num_experts a positive multiple of the ranks; topk in 1..=32; max_tokens \
                 positive with 2 x num_experts x max_tokens below 2^31",
            ));
        }
        let gpu = comm.gpu().clone();
        let sms = gpu.sm_count()?;
        let blocks = cfg.blocks.unwrap_or(sms).clamp(1, sms);
        let msg = message_bytes(cfg);
        let row_out = cfg.hidden * 2;
        let section = |bytes: usize| bytes.next_multiple_of(256);
        // The area: messages, counts, partial rows, combine words (coll/moe_args.cuh).
        let off_counts = section(shape.messages);
        let off_part = off_counts + section(shape.counts.max(2 * world * 8));
        let off_cdone = off_part + section(shape.part_rows * row_out);
        let off_inbox = off_cdone + section(world * 8);
        let off_part_w = off_inbox + section(INBOX_WORDS * 8);
        let part_w_bytes = shape.part_weights * 4;
        let area_bytes = off_part_w + section(shape.part_rows * part_w_bytes);
        // The staging area: messages by token (two halves), counts, partial rows for remote
        // sources.
        let stage_counts = section(2 * cfg.max_tokens * msg);
        let stage_part = stage_counts + section(shape.counts.max(2 * world * 8));
        let stage_words = stage_part + section(shape.stage_part_rows * row_out);
        let stage_part_w = stage_words + section(32); // four call-check words (coll/moe_net.cuh)
        let stage_bytes = stage_part_w + section(shape.stage_part_rows * part_w_bytes);
        let area = comm.alloc_symmetric(area_bytes)?;
        let area_reg = area.registered().clone();
        let stage = comm.alloc(stage_bytes)?;
        let stage_reg = comm.register(&stage)?;
        let mut builder = comm.proxy_builder(0)?;
        let mut channels = vec![comm.port_channels(&mut builder, &stage_reg, &area_reg)?];
        if shape.credits {
            channels.push(comm.port_channels(&mut builder, &stage_reg, &area_reg)?);
        }
        let proxy = builder.start()?;

        let handles_of = |set: &PortChannels| -> Vec<PortChannelHandle> {
            (0..world)
                .map(|r| set.to(r).map(|c| c.device_handle()).unwrap_or_default())
                .collect()
        };
        let mut peer_area = vec![0u64; world];
        let mut sites = vec![WaitSite::default(); world];
        for r in 0..world {
            peer_area[r] = area.peer_ptr(r).unwrap_or(0);
            sites[r] = comm.diagnostics().site(r as i32, SITE_CHANNEL);
        }
        let stream = gpu.new_stream()?;
        let alloc = |bytes: usize| -> Result<CudaSlice<u8>> {
            stream
                .alloc_zeros::<u8>(bytes.max(16))
                .map_err(cuda_err("cuMemAlloc"))
        };
        let upload = |bytes: &[u8]| -> Result<CudaSlice<u8>> {
            stream.clone_htod(bytes).map_err(cuda_err("cuMemcpyHtoD"))
        };
        let mut device = vec![
            upload(bytemuck::cast_slice(&peer_area))?, // 0 peer_area
            upload(bytemuck::cast_slice(&handles_of(&channels[0])))?, // 1 channels
            upload(bytemuck::cast_slice(&sites))?,     // 2 sites
            alloc(2 * world * 4)?,                     // 3 msgs
            alloc((world + shape.fill_extra) * 4)?,    // 4 fill
            alloc(16)?,                                // 5 done
            alloc(48)?,                                // 6 epochs
        ];
        if shape.credits {
            device.push(upload(bytemuck::cast_slice(&handles_of(&channels[1])))?);
            // 7 credits
        }
        let p = |i: usize| device[i].device_ptr(&stream).0;
        let base = MoeNetArgs {
            hidden: cfg.hidden as u32,
            topk: cfg.topk as u32,
            experts_per_rank: (cfg.num_experts / world) as u32,
            max_tokens: cfg.max_tokens as u32,
            rank: rank as u32,
            world: world as u32,
            msg_bytes: msg as u32,
            header_bytes: header_bytes(cfg) as u32,
            area: area.device_ptr(),
            peer_area: p(0),
            channels: p(1),
            sites: p(2),
            stage: stage.device_ptr(),
            off_counts: off_counts as u64,
            off_part: off_part as u64,
            off_cdone: off_cdone as u64,
            stage_counts: stage_counts as u64,
            stage_part: stage_part as u64,
            off_inbox: off_inbox as u64,
            stage_words: stage_words as u64,
            msgs: p(3),
            fill: p(4),
            done: p(5),
            epochs: p(6),
            ..Default::default()
        };
        let credits = if shape.credits { p(7) } else { 0 };
        stream
            .synchronize()
            .map_err(cuda_err("cuStreamSynchronize"))?;
        Ok(NetReceiveArea {
            proxy,
            base,
            blocks,
            credits,
            off_part_w: if part_w_bytes == 0 {
                0
            } else {
                off_part_w as u64
            },
            stage_part_w: if part_w_bytes == 0 {
                0
            } else {
                stage_part_w as u64
            },
            _channels: channels,
            _area: area,
            _stage: (stage, stage_reg),
            _device: device,
        })
    }

    /// An error if the proxy stopped (the kernels would wait for it in vain).
    pub(super) fn proxy_alive(&self) -> Result<()> {
        match self.proxy.failure() {
            Some(why) => Err(Error::invalid(
                "MoE exchange",
                format!("the proxy stopped: {why}"),
            )),
            None => Ok(()),
        }
    }
}

/// Bytes of a message header: source token, row format, epoch, then top-k ids and weights
/// (`coll/moe_net.cuh`), rounded up to 16.
pub(super) fn header_bytes(cfg: &MoeConfig) -> usize {
    (16 + 8 * cfg.topk).next_multiple_of(16)
}

/// Bytes of a message slot: the header and room for a bf16 row (an e4m3 row and its scales take
/// less).
pub(super) fn message_bytes(cfg: &MoeConfig) -> usize {
    header_bytes(cfg) + cfg.hidden * 2
}
