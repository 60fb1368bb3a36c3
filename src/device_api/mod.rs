//! `#[repr(C)]` mirrors of the device handles in `cuda/include/doorbell/` (its tiers: `core/`,
//! `ib/`, `channel/`, `coll/`, `detail/`).
//!
//! Each struct here is byte-identical to the C++ struct of the same name: the layout test below
//! compares every size and field offset with what the C++ compiler produced for the headers (a
//! table build.rs generates by running `cuda/probe/layout_probe.cpp`). Handles are plain `Pod`
//! data: the host fills them and passes them to kernels by value or in device arrays. Raw device
//! addresses are `u64`, as the driver API has them. One file per header, named as the header is
//! in its tier (`wait.rs` mirrors `core/wait.cuh`, `moe_args.rs` mirrors `coll/moe_args.cuh`,
//! `collective_args.rs` mirrors `detail/collective_args.cuh`, ...), every item re-exported here;
//! `limits` mirrors the constants of `coll/limits.cuh`, which the same test holds equal.

mod call_check;
mod collective_args;
mod fifo;
mod ibgda;
pub mod limits;
mod memory_channel;
mod moe_args;
mod packet;
mod port_channel;
mod semaphore;
mod wait;
pub use call_check::*;
pub use collective_args::*;
pub use fifo::*;
pub use ibgda::*;
pub use memory_channel::*;
pub use moe_args::*;
pub use packet::*;
pub use port_channel::*;
pub use semaphore::*;
pub use wait::*;

#[cfg(test)]
mod layout {
    use super::*;
    use bytemuck::Zeroable;
    use std::collections::BTreeMap;
    use std::mem::{align_of, offset_of, size_of};

    include!(concat!(env!("OUT_DIR"), "/cuda_layout.rs"));

    /// Fields as (name, offset, size).
    type Fields = Vec<(&'static str, usize, usize)>;

    /// (struct, size, align, fields) as Rust lays them out.
    fn rust_layout() -> Vec<(&'static str, usize, usize, Fields)> {
        macro_rules! field_size {
            ($t:ty, $f:ident) => {{
                let probe: $t = <$t>::zeroed();
                std::mem::size_of_val(&probe.$f)
            }};
        }
        macro_rules! layout {
            ($name:literal, $t:ty, [$($f:ident),* $(,)?]) => {
                ($name, size_of::<$t>(), align_of::<$t>(),
                 vec![$((stringify!($f), offset_of!($t, $f), field_size!($t, $f))),*])
            };
        }
        vec![
            layout!(
                "WaitReport",
                WaitReport,
                [
                    valid,
                    what,
                    rank,
                    peer,
                    channel,
                    block,
                    thread,
                    reserved,
                    expected,
                    seen,
                    waited_ns,
                    abort,
                    mismatch_peer,
                    mismatch_mine,
                    mismatch_theirs,
                    mismatch_valid,
                    mismatch_counts,
                    mismatch_mine_send,
                    mismatch_mine_recv,
                    mismatch_theirs_send,
                    mismatch_theirs_recv,
                    dead_peers
                ]
            ),
            layout!(
                "WaitSite",
                WaitSite,
                [report, claim, budget_ns, rank, peer, channel, reserved]
            ),
            layout!(
                "SemaphoreHandle",
                SemaphoreHandle,
                [inbound_token, expected_inbound, remote_inbound_token, site]
            ),
            layout!(
                "MemoryChannelHandle",
                MemoryChannelHandle,
                [
                    semaphore,
                    dst,
                    src,
                    packet_buffer,
                    remote_packet_buffer,
                    dst_bytes,
                    src_bytes,
                    packet_buffer_bytes
                ]
            ),
            layout!(
                "AllReduceArgs",
                AllReduceArgs,
                [
                    input,
                    output,
                    count,
                    scratch,
                    rs_sems,
                    ag_sems,
                    epochs,
                    ll_offset,
                    ll_half_bytes,
                    ll_slot_bytes,
                    pipe_offset,
                    pipe_lane_bytes,
                    tile_elems,
                    lamport_offset,
                    lamport_buf_bytes,
                    lamport_slot_bytes,
                    lamport_state,
                    rank,
                    world,
                    site,
                    call
                ]
            ),
            layout!(
                "AllReduceDirectArgs",
                AllReduceDirectArgs,
                [base, peer_input, peer_output]
            ),
            layout!("CallCheck", CallCheck, [word, inbox]),
            layout!(
                "AllToAllArgs",
                AllToAllArgs,
                [
                    input,
                    output,
                    counts,
                    equal_bytes,
                    scratch,
                    data,
                    credit,
                    tile,
                    rank,
                    world,
                    lanes,
                    depth,
                    send_threads,
                    reserved,
                    ll_offset,
                    ll_slot_bytes,
                    epochs,
                    call,
                    input_bytes,
                    output_bytes,
                    pair_ll_max,
                    pair_epochs
                ]
            ),
            layout!(
                "MoeArgs",
                MoeArgs,
                [
                    x,
                    scales,
                    topk_idx,
                    topk_weights,
                    y,
                    out,
                    num_tokens,
                    hidden,
                    topk,
                    experts_per_rank,
                    max_tokens,
                    rank,
                    world,
                    blocks,
                    land,
                    comb_buf,
                    off_idx,
                    off_weights,
                    off_src,
                    off_matrix,
                    off_scales,
                    pos,
                    num_recv,
                    expert_counts,
                    calls,
                    sems,
                    rank_prefix,
                    y_weights,
                    out_weights,
                    off_comb_weights,
                    in_rank,
                    tokens_per_expert,
                    off_expert_in,
                    off_slots,
                    slot_bytes,
                    slot,
                    fill_rows,
                    call
                ]
            ),
            layout!(
                "MoeLlArgs",
                MoeLlArgs,
                [
                    x,
                    topk_idx,
                    topk_weights,
                    out,
                    num_tokens,
                    hidden,
                    topk,
                    experts_per_rank,
                    max_tokens,
                    rank,
                    world,
                    blocks,
                    area,
                    off_src,
                    off_counts,
                    off_from,
                    off_weight,
                    off_rec,
                    off_part,
                    off_queue,
                    off_sent,
                    y,
                    fill,
                    done,
                    epochs,
                    layout,
                    recv_count,
                    ready,
                    call,
                    packed_x,
                    packed_scales,
                    packed_src,
                    packed_range,
                    packed_count,
                    packed_stats,
                    off_ret,
                    packed,
                    packed_pad,
                    ticket,
                    rank_mask,
                    wait_cycles
                ]
            ),
            layout!(
                "MoeNetArgs",
                MoeNetArgs,
                [
                    x,
                    scales,
                    topk_idx,
                    topk_weights,
                    out,
                    num_tokens,
                    fp8,
                    hidden,
                    topk,
                    experts_per_rank,
                    max_tokens,
                    rank,
                    world,
                    msg_bytes,
                    header_bytes,
                    area,
                    peer_area,
                    channels,
                    sites,
                    stage,
                    off_counts,
                    off_part,
                    off_cdone,
                    stage_counts,
                    stage_part,
                    y,
                    recv_x,
                    recv_src,
                    recv_weights,
                    recv_scales,
                    rec,
                    msgs,
                    fill,
                    done,
                    epochs,
                    layout,
                    recv_count,
                    list,
                    probe,
                    arrived,
                    staged,
                    call_word,
                    off_inbox,
                    stage_words,
                    packed_x,
                    packed_scales,
                    packed_src,
                    packed_range,
                    packed_count,
                    packed_stats,
                    ticket,
                    in_x,
                    in_ids,
                    packed,
                    back,
                ]
            ),
            layout!(
                "MoeHtArgs",
                MoeHtArgs,
                [
                    nodes,
                    node,
                    rail,
                    node_of,
                    local_of,
                    fwd_x,
                    fwd_scales,
                    fwd_idx,
                    fwd_w,
                    fwd_origin,
                    fwd_out,
                    net_rows,
                    node_src,
                    node_num_recv,
                    origin_of,
                    recv_src,
                    chunks,
                    weights,
                    off_ring,
                    off_desc,
                    stage_desc,
                    credits,
                    sent_chunks,
                    recv_chunks,
                    list,
                    node_counts,
                    node_rows,
                    node_max_rows,
                    fwd_wout,
                    w_out,
                    off_part_w,
                    stage_part_w,
                    in_rank,
                    fwd_in_rank,
                    tokens_per_expert,
                    fwd_tpe,
                    tok_nodes,
                    desc_bytes,
                    by_rank,
                ]
            ),
            layout!("HtChunkDesc", HtChunkDesc, [epoch, messages, last]),
            layout!("LamportState", LamportState, [call, reserved, prev_count]),
            layout!(
                "ProxyTrigger",
                ProxyTrigger,
                [src_offset, dst_offset, size, meta]
            ),
            layout!(
                "IbQpHandle",
                IbQpHandle,
                [
                    sq, dbr, doorbell, cq, cq_ci, state, sizes, host_ready, qpn, sq_log2, cq_log2,
                    flags, site
                ]
            ),
            layout!(
                "FifoHandle",
                FifoHandle,
                [triggers, head, tail, tail_cache, stopped, size_log2, reserved, site]
            ),
            layout!(
                "PortChannelHandle",
                PortChannelHandle,
                [
                    fifo,
                    inbound_token,
                    expected_inbound,
                    flush_done,
                    semaphore,
                    dst_mem,
                    src_mem,
                    reserved,
                    ib
                ]
            ),
            layout!(
                "IbPortLink",
                IbPortLink,
                [
                    qp,
                    src,
                    dst,
                    token,
                    scratch,
                    src_key,
                    dst_key,
                    token_key,
                    scratch_key,
                    stripes,
                    reserved,
                    more
                ]
            ),
            layout!("LL16Packet", Ll16Packet, [data1, flag1, data2, flag2]),
            layout!("LL8Packet", Ll8Packet, [data, flag]),
        ]
    }

    #[test]
    fn trigger_meta_round_trips() {
        let m = TriggerMeta {
            kind: trigger::DATA | trigger::FLAG,
            semaphore: ProxyTrigger::MAX_SEMAPHORE,
            src_mem: 7,
            dst_mem: ProxyTrigger::MAX_MEMORY,
            parity: 1,
        };
        assert_eq!(ProxyTrigger::unpack(ProxyTrigger::pack(m)), m);
        assert_eq!(ProxyTrigger::pack(m) >> 63, 1);
    }

    #[test]
    fn every_mirror_matches_the_cuda_layout() {
        let mut cuda: BTreeMap<&str, (usize, usize, Fields)> = BTreeMap::new();
        for &(kind, name, field, a, b) in CUDA_LAYOUT {
            let e = cuda.entry(name).or_insert((0, 0, Vec::new()));
            if kind == "struct" {
                (e.0, e.1) = (a, b);
            } else {
                e.2.push((field, a, b));
            }
        }
        let rust = rust_layout();
        let rust_names: Vec<&str> = rust.iter().map(|r| r.0).collect();
        let cuda_names: Vec<&str> = cuda.keys().copied().collect();
        let mut sorted = rust_names.clone();
        sorted.sort();
        assert_eq!(
            sorted, cuda_names,
            "structs mirrored in Rust vs probed in C++"
        );
        for (name, size, align, fields) in rust {
            let (csize, calign, cfields) = &cuda[name];
            assert_eq!(
                (size, align),
                (*csize, *calign),
                "{name}: (size, align) Rust vs C++"
            );
            assert_eq!(
                &fields, cfields,
                "{name}: fields (name, offset, size) Rust vs C++"
            );
            // The listed fields must tile the struct: a field added on one side but not listed
            // would leave a hole of at least its size.
            let mut end = 0;
            for &(f, off, sz) in &fields {
                assert!(
                    off >= end && off - end < 8,
                    "{name}.{f}: unlisted bytes before it"
                );
                end = off + sz;
            }
            assert!(
                size - end < align.max(8),
                "{name}: unlisted bytes at the end"
            );
        }
    }

    /// Every constant and enum code the probe prints has its Rust twin listed here, equal; and
    /// every twin listed was printed (a constant renamed or dropped on one side fails too).
    #[test]
    fn shared_constants_and_codes_match_the_headers() {
        use crate::WaitKind;
        let twins: Vec<(&str, u64)> = vec![
            ("kMaxRanks", MAX_RANKS as u64),
            ("kInboxWords", INBOX_WORDS as u64),
            ("kPipeDepth", limits::PIPE_DEPTH as u64),
            ("kHtMaxLocalExperts", limits::HT_MAX_LOCAL_EXPERTS as u64),
            ("kLlMaxPairs", limits::LL_MAX_PAIRS as u64),
            ("kHtChunk", limits::HT_CHUNK as u64),
            ("moe_net::kMaxRanks", limits::MAX_NET_RANKS as u64),
            ("moe_net::kStageParts", limits::NET_STAGE_PARTS as u64),
            ("moe_net::kMaxPackPairs", limits::NET_MAX_PACK_PAIRS as u64),
            ("kTriggerData", trigger::DATA as u64),
            ("kTriggerFlag", trigger::FLAG as u64),
            ("kTriggerFlush", trigger::FLUSH as u64),
        ];
        // The device writes these codes; the host decodes them with WaitKind::from_code.
        let waits = [
            ("kWaitSemaphore", WaitKind::Semaphore),
            ("kWaitPacket", WaitKind::Packet),
            ("kWaitFifoSlot", WaitKind::FifoSlot),
            ("kWaitFlush", WaitKind::Flush),
            ("kWaitProxyStopped", WaitKind::ProxyStopped),
            ("kWaitBadTrigger", WaitKind::BadTrigger),
            ("kWaitBadInput", WaitKind::BadInput),
            ("kWaitIbProgress", WaitKind::IbProgress),
            ("kWaitIbError", WaitKind::IbError),
            ("kWaitArgMismatch", WaitKind::ArgumentMismatch),
            ("kWaitBadCounts", WaitKind::BadCounts),
        ];
        for &(name, value) in CUDA_CONSTS {
            if let Some(&(_, kind)) = waits.iter().find(|(n, _)| *n == name) {
                assert_eq!(WaitKind::from_code(value as u32), kind, "{name} = {value}");
                continue;
            }
            let Some(&(_, rust)) = twins.iter().find(|(n, _)| *n == name) else {
                panic!("{name} (= {value}): printed by the probe, but no Rust twin is listed");
            };
            assert_eq!(rust, value, "{name}: Rust's twin against the header's");
        }
        for name in twins.iter().map(|t| t.0).chain(waits.iter().map(|w| w.0)) {
            assert!(
                CUDA_CONSTS.iter().any(|(n, _)| *n == name),
                "{name}: listed here, not printed by cuda/probe/layout_probe.cpp"
            );
        }
    }
}
