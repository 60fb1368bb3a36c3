//! The GPU-side cost of the node-spanning low-latency MoE dispatch (issue 16's budget: a decode
//! dispatch of 128 tokens x top-8 posts all its WQEs within 10 us of GPU time), measured on the
//! library's own send kernel (`moe_net_dispatch_send`, `doorbell/coll/moe_net.cuh`) in one process: rank 0 of
//! `nodes` x 8 ranks (and 16 x 1, and 2 x 8 with the top-k ids off a 16-byte boundary),
//! DeepSeek-V3's shape (256 experts, top-8, hidden 7168, FP8 rows with one scale per 128). Its 7 same-node peers' areas are mapped (local memory standing in for NVLink,
//! so their stores cost less than over NVLink); every rank on another node is reached by a
//! PortChannel over a queue pair of an emulated NIC with the null data path (`NullDma`: WQEs are
//! parsed and completed, no byte moves), posted by the kernel (IBGDA) or rung by the host thread
//! (CPU-assisted), with the send queue and its doorbell record in pinned host memory (where
//! libmlx5 puts a verbs queue pair's rings: what doorbell maps on a ConnectX today) or in GPU
//! memory (NVSHMEM's IBGDA placement; the emulator reads them with `cuMemcpy`, as a NIC reads GPU
//! memory over PCIe). A first row per mode runs the same kernel on one node of 8 (no network
//! peer) for the cost of staging and NVLink stores alone. Every WQE must reach the NIC and
//! complete (counted per queue pair). `#[ignore = "needs GPU"]`; prints the table for
//! docs/performance.md:
//! `tests/moe_net_post --ignored --nocapture`.

use cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
use doorbell::device_api::{IbPortLink, MoeNetArgs, PortChannelHandle, WaitSite};
use doorbell::gpu::cuda::Gpu;
use doorbell::transport::ib::emulated::nic::{Delivery, EmulatedNic, NullDma};
use doorbell::transport::ib::posting::gpu_qp::{GpuQp, Posting, RingPlacement};
use std::sync::Arc;

const HIDDEN: usize = 7168;
const TOPK: usize = 8;
const EXPERTS: usize = 256;
const TOKENS: usize = 128;

/// xorshift, for a routing that is the same on every run.
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// 128 tokens x 8 distinct experts of 256, uniformly at random.
fn routing(seed: u64) -> Vec<i32> {
    let mut rng = Rng(seed);
    let mut idx = Vec::with_capacity(TOKENS * TOPK);
    for _ in 0..TOKENS {
        let mut picked: Vec<i32> = Vec::new();
        while picked.len() < TOPK {
            let e = rng.below(EXPERTS as u64) as i32;
            if !picked.contains(&e) {
                picked.push(e);
            }
        }
        idx.extend(picked);
    }
    idx
}

#[test]
#[ignore = "needs GPU"]
fn gpu_time_to_post_a_decode_dispatch_across_nodes() {
    let gpu = Gpu::open(0).expect("GPU 0");
    let s = gpu.new_stream().unwrap();
    let sms = gpu.sm_count().unwrap();
    let send = gpu.function("moe_net", "moe_net_dispatch_send").unwrap();
    let site = WaitSite {
        budget_ns: 20_000_000_000,
        rank: 0,
        peer: -1,
        ..Default::default()
    };
    let header = (16 + 8 * TOPK).next_multiple_of(16);
    let msg = header + HIDDEN * 2;
    let used = (header + HIDDEN + HIDDEN / 128 * 4).next_multiple_of(16) as u64;
    println!(
        "| posting | send queue in | nodes x ranks | remote messages | WQEs | WQEs/token | MB on the wire | \
         staged (us, median) | last doorbell (us, median of 20 / min) | kernel end (us, median / min) |"
    );
    println!("|---|---|---|---:|---:|---:|---:|---:|---:|---:|");
    let cases = [
        (Posting::Ibgda, RingPlacement::Host),
        (Posting::CpuAssisted, RingPlacement::Host),
        (Posting::Ibgda, RingPlacement::Gpu),
        (Posting::CpuAssisted, RingPlacement::Gpu),
    ];
    for (posting, placement) in cases {
        // One node first: the same kernel with every rank over NVLink (nothing to post).
        // Last: 16 nodes of one rank, the 2 x 8 routing with every peer remote (no NVLink
        // copies beside the posting, against 2 x 8's seven same-node peers).
        // Last but one: 2 x 8 with the top-k ids 4 bytes off a 16-byte boundary (the send reads
        // them an id at a time instead of 16 bytes at a time; the WQE counts check its lists).
        for (nodes, per_node, unaligned) in [
            (1usize, 8usize, false),
            (2, 8, false),
            (4, 8, false),
            (8, 8, false),
            (2, 8, true),
            (16, 1, false),
        ] {
            let world = nodes * per_node;
            let per_rank = EXPERTS / world;
            let idx = routing(0x9e37 + (world / 8) as u64);
            // Messages to each rank: a token goes once to every rank holding one of its experts.
            let mut to_rank = vec![0u64; world];
            for t in 0..TOKENS {
                let mut ranks: Vec<usize> = idx[t * TOPK..(t + 1) * TOPK]
                    .iter()
                    .map(|&e| e as usize / per_rank)
                    .collect();
                ranks.sort_unstable();
                ranks.dedup();
                for r in ranks {
                    to_rank[r] += 1;
                }
            }
            let remote: Vec<usize> = (per_node..world).collect();
            let remote_msgs: u64 = remote.iter().map(|&r| to_rank[r]).sum();
            let wqes = remote_msgs + 3 * remote.len() as u64;
            let wire = remote_msgs * used + 24 * remote.len() as u64;

            let alloc = |bytes: usize| s.alloc_zeros::<u8>(bytes.max(16)).unwrap();
            let area_bytes = 2 * world * TOKENS * msg + 2 * world * 8;
            let off_counts = (2 * world * TOKENS * msg) as u64;
            let area = alloc(area_bytes);
            let stage_counts = (2 * TOKENS * msg) as u64;
            let stage = alloc(stage_counts as usize + 2 * world * 8);
            let (area_p, stage_p) = (area.device_ptr(&s).0, stage.device_ptr(&s).0);
            let scratch = alloc(16 * world);
            let scratch_p = scratch.device_ptr(&s).0;
            // The null NIC: regions cover the addresses, nothing is touched.
            let nic = Arc::new(EmulatedNic::start(Box::new(NullDma), Delivery::Strict).unwrap());
            let far = area_p + (1 << 40); // the remote ranks' areas and tokens, never touched
            let src_key = nic
                .register(stage_p, stage_counts + 2 * world as u64 * 8, false)
                .unwrap();
            let dst_key = nic.register(far, area_bytes as u64, true).unwrap();
            let token_key = nic
                .register(far + (1 << 36), 8 * world as u64, true)
                .unwrap();
            let scratch_key = nic.register(scratch_p, 16 * world as u64, false).unwrap();
            let qps: Vec<GpuQp> = remote
                .iter()
                .map(|&r| {
                    GpuQp::placed(&gpu, &nic, 0x400 + r as u32, 12, posting, site, placement)
                        .unwrap()
                })
                .collect();
            let links: Vec<IbPortLink> = remote
                .iter()
                .zip(&qps)
                .map(|(&r, qp)| IbPortLink {
                    qp: qp.handle(),
                    src: stage_p,
                    dst: far,
                    token: far + (1 << 36) + 8 * r as u64,
                    scratch: scratch_p + 16 * r as u64,
                    src_key,
                    dst_key,
                    token_key,
                    scratch_key,
                    stripes: 1,
                    ..Default::default()
                })
                .collect();
            // (One entry at least: a device allocation is never empty.)
            let links_or_one = if links.is_empty() {
                vec![IbPortLink::default()]
            } else {
                links.clone()
            };
            let links_dev = s
                .clone_htod(bytemuck::cast_slice::<IbPortLink, u8>(&links_or_one))
                .unwrap();
            let links_p = links_dev.device_ptr(&s).0;
            let size = std::mem::size_of::<IbPortLink>() as u64;
            let mut handles = vec![PortChannelHandle::default(); world];
            let mut peer_area = vec![0u64; world];
            for r in 0..world {
                if r < per_node {
                    peer_area[r] = area_p; // same node: mapped (one area stands in for all)
                } else {
                    handles[r].ib = links_p + (r - per_node) as u64 * size;
                }
            }
            let upload = |b: &[u8]| s.clone_htod(b).unwrap();
            let handles_dev = upload(bytemuck::cast_slice(&handles));
            let peer_dev = upload(bytemuck::cast_slice(&peer_area));
            let sites_dev = upload(bytemuck::cast_slice(&vec![site; world]));
            let x = alloc(TOKENS * HIDDEN);
            let scales = alloc(TOKENS * HIDDEN / 128 * 4);
            let idx_dev = upload(bytemuck::cast_slice(
                &[if unaligned { vec![0i32] } else { vec![] }, idx.clone()].concat(),
            ));
            let idx_p = idx_dev.device_ptr(&s).0 + if unaligned { 4 } else { 0 };
            let w_dev = upload(bytemuck::cast_slice(&vec![0.125f32; TOKENS * TOPK]));
            let (fill, list, done, epochs, arrived, staged) = (
                alloc(world * 4),
                alloc(world * TOKENS * 4),
                alloc(16),
                alloc(32),
                alloc(world * 4),
                alloc(TOKENS.div_ceil(32) * 8 * 8),
            );
            let mut probe = s.alloc_zeros::<u64>(8).unwrap();
            let probe_p = probe.device_ptr(&s).0;
            let p = |b: &cudarc::driver::CudaSlice<u8>| b.device_ptr(&s).0;
            let args = MoeNetArgs {
                x: p(&x),
                scales: p(&scales),
                topk_idx: idx_p,
                topk_weights: p(&w_dev),
                num_tokens: TOKENS as u32,
                fp8: 1,
                hidden: HIDDEN as u32,
                topk: TOPK as u32,
                experts_per_rank: per_rank as u32,
                max_tokens: TOKENS as u32,
                rank: 0,
                world: world as u32,
                msg_bytes: msg as u32,
                header_bytes: header as u32,
                area: area_p,
                peer_area: p(&peer_dev),
                channels: p(&handles_dev),
                sites: p(&sites_dev),
                stage: stage_p,
                off_counts,
                stage_counts,
                fill: p(&fill),
                done: p(&done),
                epochs: p(&epochs),
                list: p(&list),
                arrived: p(&arrived),
                staged: p(&staged),
                probe: probe_p,
                ..Default::default()
            };
            let reps = 21;
            let mut posted = Vec::new();
            let mut ended = Vec::new();
            let mut staged = Vec::new();
            let mut steps: Vec<[f64; 5]> = Vec::new();
            for rep in 0..reps {
                let start: [u64; 8] = [u64::MAX, 0, 0, 0, 0, 0, 0, u64::MAX];
                s.memcpy_htod(&start, &mut probe).unwrap();
                let mut b = s.launch_builder(&send);
                b.arg(&args);
                // SAFETY: every address in `args` lies in this test's allocations (or in the null
                // NIC's regions, which move no data); the grid is one block per SM.
                unsafe {
                    b.launch(LaunchConfig {
                        grid_dim: (sms, 1, 1),
                        block_dim: (256, 1, 1),
                        shared_mem_bytes: 0,
                    })
                }
                .unwrap();
                s.synchronize().unwrap();
                let t: Vec<u64> = s.clone_dtoh(&probe).unwrap();
                if rep > 0 {
                    // No network peer: nothing rings (the column shows the kernel's end).
                    posted.push(t[1].max(t[0]).max(t[3]) as f64 / 1e3 - t[0] as f64 / 1e3);
                    ended.push((t[2] - t[0]) as f64 / 1e3);
                    staged.push((t[3] - t[0]) as f64 / 1e3);
                    if !remote.is_empty() {
                        // Network tasks: first start, last done listing its tokens, last done
                        // writing its batch, last past the staging, last doorbell.
                        let at = |i: usize| t[i].saturating_sub(t[0]) as f64 / 1e3;
                        steps.push([at(7), at(4), at(5), at(6), at(1)]);
                    }
                }
            }
            // Every WQE reached the NIC and completed: each remote rank's messages, then its
            // count WRITE, the READ and the fetch-add.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            for &r in &remote {
                let (qpn, want) = (0x400 + r as u32, reps as u64 * (to_rank[r] + 3));
                while nic.executed(qpn) < want && std::time::Instant::now() < deadline {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                assert_eq!(nic.executed(qpn), want, "{posting:?}: WQEs to rank {r}");
            }
            assert!(nic.faults().is_empty(), "{:?}", nic.faults());
            posted.sort_by(f64::total_cmp);
            ended.sort_by(f64::total_cmp);
            staged.sort_by(f64::total_cmp);
            let doorbell = if remote.is_empty() {
                "-".to_string()
            } else {
                format!("{:.1} / {:.1}", posted[posted.len() / 2], posted[0])
            };
            if !steps.is_empty() {
                steps.sort_by(|x, y| x[4].total_cmp(&y[4]));
                let m = steps[steps.len() / 2];
                eprintln!(
                    "{posting:?}, {placement:?}, {nodes} x {per_node}{}: network tasks start {:.1} us, listed {:.1}, \
                     batch written {:.1}, past the staging {:.1}, rung {:.1} (the run of median last doorbell)",
                    if unaligned { " (ids unaligned)" } else { "" },
                    m[0], m[1], m[2], m[3], m[4]
                );
            }
            println!(
                "| {posting:?} | {placement:?} | {nodes} x {per_node}{} | {remote_msgs} | {wqes} | {:.2} | {:.2} | {:.1} | {doorbell} | {:.1} / {:.1} |",
                if unaligned { " (ids unaligned)" } else { "" },
                wqes as f64 / TOKENS as f64,
                wire as f64 / 1e6,
                staged[staged.len() / 2],
                ended[ended.len() / 2],
                ended[0]
            );
            drop(qps);
        }
    }
}
