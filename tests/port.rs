//! PortChannels on GPUs (`#[ignore = "needs GPU"]`; run with `--ignored`), over CUDA IPC, over
//! the Ethernet transport and over RDMA to the emulated mlx5 NIC (ranks of one host acting as
//! separate nodes): every operation between
//! 2..4 ranks with rank-derived payloads, transfers and offsets past 4 GiB, a proxy stopped under
//! a waiting kernel (reported, not hung), and the copy-engine all-gather.

mod common;

use common::{count_wrong, fill, rank_counts, rank_main, run_case};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use doorbell::channel::port_channel::Transport;
use doorbell::communicator::Communicator;
use doorbell::device_api::PortChannelHandle;
use doorbell::{Error, WaitKind};
use std::sync::Arc;
use std::time::Duration;

#[test]
#[ignore = "needs GPU"]
fn gpu_rank() {
    rank_main(|case, comm, stream| match case {
        "ops" => ops(comm, stream),
        "huge" => huge(comm, stream),
        "stop" => stop(comm, stream),
        "storm" => storm(comm, stream),
        "allgather" => allgather(comm, stream),
        other => panic!("unknown case {other}"),
    });
}

#[test]
#[ignore = "needs GPU"]
fn every_port_channel_operation() {
    for n in rank_counts() {
        run_case("ops", n, &[]);
    }
}

#[test]
#[ignore = "needs GPU"]
fn copy_engine_allgather_over_port_channels() {
    for n in rank_counts() {
        run_case("allgather", n, &[]);
    }
}

/// Ranks of one host told to act as separate nodes: PortChannels take the Ethernet transport
/// (`DOORBELL_IB_DISABLE`: even on hosts with an RDMA NIC).
const SEPARATE: &[(&str, &str)] = &[
    ("DOORBELL_SEPARATE_NODES", "1"),
    ("DOORBELL_IB_DISABLE", "1"),
];

#[test]
#[ignore = "needs GPU"]
fn every_port_channel_operation_over_ethernet() {
    for n in rank_counts() {
        run_case("ops", n, SEPARATE);
    }
}

#[test]
#[ignore = "needs GPU"]
fn copy_engine_allgather_kernel_over_ethernet() {
    for n in rank_counts() {
        run_case("allgather", n, SEPARATE);
    }
}

#[test]
#[ignore = "needs GPU"]
fn transfers_and_offsets_past_4_gib_over_ethernet() {
    run_case("huge", 2, SEPARATE);
}

#[test]
#[ignore = "needs GPU"]
fn stopping_the_proxy_releases_a_waiting_kernel_over_ethernet() {
    run_case(
        "stop",
        2,
        &[
            ("DOORBELL_WAIT_TIMEOUT_MS", "20000"),
            ("DOORBELL_SEPARATE_NODES", "1"),
        ],
    );
}

/// Ranks of one host as separate nodes, PortChannels over RDMA work requests the proxies post to
/// their emulated mlx5 NICs (the verbs-proxy posting mode).
const IB: &[(&str, &str)] = &[
    ("DOORBELL_SEPARATE_NODES", "1"),
    ("DOORBELL_IB_EMULATE", "1"),
];

#[test]
#[ignore = "needs GPU"]
fn every_port_channel_operation_over_emulated_ib() {
    for n in rank_counts() {
        run_case("ops", n, IB);
    }
}

#[test]
#[ignore = "needs GPU"]
fn transfers_and_offsets_past_4_gib_over_emulated_ib() {
    run_case("huge", 2, IB);
}

#[test]
#[ignore = "needs GPU"]
fn stopping_the_proxy_releases_a_waiting_kernel_over_emulated_ib() {
    run_case(
        "stop",
        2,
        &[
            ("DOORBELL_WAIT_TIMEOUT_MS", "20000"),
            ("DOORBELL_SEPARATE_NODES", "1"),
            ("DOORBELL_IB_EMULATE", "1"),
        ],
    );
}

/// The same with kernels posting their own work requests: IBGDA (the GPU rings the doorbell) and
/// CPU-assisted (a host thread rings), instead of the proxy.
const IB_GDA: &[(&str, &str)] = &[
    ("DOORBELL_SEPARATE_NODES", "1"),
    ("DOORBELL_IB_EMULATE", "1"),
    ("DOORBELL_IB_POSTING", "ibgda"),
];
const IB_CPU: &[(&str, &str)] = &[
    ("DOORBELL_SEPARATE_NODES", "1"),
    ("DOORBELL_IB_EMULATE", "1"),
    ("DOORBELL_IB_POSTING", "cpu"),
];

/// Through a real RDMA NIC (never run here: no machine of this project has one): two or more
/// ranks of this host, each its own node, connect their queue pairs through the NIC nearest
/// their GPU and run every PortChannel operation in each posting mode the NIC takes. The GPU
/// suite skips `nic_` tests unless `NIC_TESTS=1`.
#[test]
#[ignore = "needs an RDMA NIC"]
fn nic_every_port_channel_operation_through_the_nic() {
    for posting in ["auto", "proxy", "verbs", "cpu", "ibgda"] {
        for n in rank_counts() {
            eprintln!("posting {posting}, {n} ranks");
            run_case(
                "ops",
                n,
                &[
                    ("DOORBELL_SEPARATE_NODES", "1"),
                    ("DOORBELL_TEST_NIC", "1"),
                    ("DOORBELL_IB_POSTING", posting),
                ],
            );
        }
    }
}

/// The proxy posting through `ibv_post_send` / `ibv_poll_cq` (the mode for NICs that are not
/// mlx5), on the emulated provider.
const IB_VERBS: &[(&str, &str)] = &[
    ("DOORBELL_SEPARATE_NODES", "1"),
    ("DOORBELL_IB_EMULATE", "1"),
    ("DOORBELL_IB_POSTING", "verbs"),
];

#[test]
#[ignore = "needs GPU"]
fn every_port_channel_operation_posted_with_ibv_post_send_over_emulated_ib() {
    for n in rank_counts() {
        run_case("ops", n, IB_VERBS);
    }
    run_case("huge", 2, IB_VERBS);
}

#[test]
#[ignore = "needs GPU"]
fn every_port_channel_operation_posted_by_the_gpu_over_emulated_ib() {
    for n in rank_counts() {
        run_case("ops", n, IB_GDA);
        run_case("ops", n, IB_CPU);
    }
}

#[test]
#[ignore = "needs GPU"]
fn transfers_and_offsets_past_4_gib_posted_by_the_gpu_over_emulated_ib() {
    run_case("huge", 2, IB_GDA);
}

/// Puts of 1 MiB and more striped over several queue pairs per channel
/// (`DOORBELL_IB_QPS_PER_PEER`): every operation, in both GPU posting modes, and transfers past
/// 4 GiB over four QPs.
#[test]
#[ignore = "needs GPU"]
fn striped_over_several_queue_pairs_posted_by_the_gpu_over_emulated_ib() {
    for n in rank_counts() {
        run_case(
            "ops",
            n,
            &[IB_GDA, &[("DOORBELL_IB_QPS_PER_PEER", "3")]].concat(),
        );
        run_case(
            "ops",
            n,
            &[IB_CPU, &[("DOORBELL_IB_QPS_PER_PEER", "2")]].concat(),
        );
    }
    run_case(
        "huge",
        2,
        &[IB_GDA, &[("DOORBELL_IB_QPS_PER_PEER", "4")]].concat(),
    );
}

/// The same striping by the proxy, writing mlx5 WQEs and through `ibv_post_send`: a put of
/// 1 MiB or more goes out as one part per queue pair, a signal after every part completed.
#[test]
#[ignore = "needs GPU"]
fn striped_over_several_queue_pairs_posted_by_the_proxy_over_emulated_ib() {
    for n in rank_counts() {
        run_case(
            "ops",
            n,
            &[IB, &[("DOORBELL_IB_QPS_PER_PEER", "3")]].concat(),
        );
        run_case(
            "ops",
            n,
            &[IB_VERBS, &[("DOORBELL_IB_QPS_PER_PEER", "2")]].concat(),
        );
    }
    run_case(
        "huge",
        2,
        &[IB_VERBS, &[("DOORBELL_IB_QPS_PER_PEER", "4")]].concat(),
    );
}

#[test]
#[ignore = "needs GPU"]
fn many_pushers_many_laps_deliver_every_signal_once() {
    run_case("storm", 2, &[]);
}

#[test]
#[ignore = "needs GPU"]
fn transfers_and_offsets_past_4_gib() {
    run_case("huge", 2, &[]);
}

#[test]
#[ignore = "needs GPU"]
fn stopping_the_proxy_releases_a_waiting_kernel() {
    run_case("stop", 2, &[("DOORBELL_WAIT_TIMEOUT_MS", "20000")]);
}

fn cfg(threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn ops(comm: &Communicator, s: &Arc<CudaStream>) {
    let me = comm.rank() as u32;
    let world = comm.world_size() as u32;
    let slot: u64 = 4 << 20;
    let buf = comm.alloc((2 * world as u64 * slot) as usize).unwrap();
    let reg = comm.register(&buf).unwrap();
    let mut proxy = comm.proxy_builder(0).unwrap();
    let chans = comm.port_channels(&mut proxy, &reg, &reg).unwrap();
    let on = |k: &str| std::env::var(k).as_deref() == Ok("1");
    let want = if on("DOORBELL_IB_EMULATE") || on("DOORBELL_TEST_NIC") {
        Transport::Ib
    } else if std::env::var("DOORBELL_SEPARATE_NODES").as_deref() == Ok("1") {
        Transport::Ethernet
    } else {
        Transport::CudaIpc
    };
    for p in (0..world as usize).filter(|&p| p != me as usize) {
        assert_eq!(
            chans.to(p).unwrap().transport(),
            want,
            "channel to rank {p}"
        );
    }
    let proxy = proxy.start().unwrap();
    let dev: CudaSlice<PortChannelHandle> = s.clone_htod(&chans.handles()).unwrap();
    let dev_ptr = dev.device_ptr(s).0;
    let f = comm.gpu().function("port", "port_exchange").unwrap();
    let inbox = world as u64 * slot;
    let mut round = 0;
    for mode in 0u32..4 {
        for &(bytes, src_skew, dst_skew) in &[
            (1u64, 0u64, 0u64),
            (4097, 3, 5),
            ((1 << 20) + 3, 8, 1),
            (3 << 20, 0, 0),
        ] {
            round += 1;
            buf.fill(inbox as usize, (world as u64 * slot) as usize, 0xEE)
                .unwrap();
            for p in (0..world).filter(|&p| p != me) {
                fill(
                    comm,
                    s,
                    buf.device_ptr() + p as u64 * slot + src_skew,
                    0,
                    bytes,
                    me,
                    p,
                    round,
                );
            }
            comm.synchronize(s).unwrap();
            comm.bootstrap().barrier().unwrap();
            let mut b = s.launch_builder(&f);
            b.arg(&dev_ptr)
                .arg(&me)
                .arg(&world)
                .arg(&slot)
                .arg(&bytes)
                .arg(&src_skew)
                .arg(&dst_skew)
                .arg(&mode);
            // SAFETY: matches port_exchange; ranges lie inside `buf` on every rank.
            unsafe { b.launch(cfg(32)) }.unwrap();
            if let Err(e) = comm.synchronize(s) {
                panic!(
                    "mode {mode}, {bytes} bytes: {e}; proxy: {:?}",
                    proxy.failure()
                );
            }
            for p in (0..world).filter(|&p| p != me) {
                let at = buf.device_ptr() + inbox + p as u64 * slot + dst_skew;
                let wrong = count_wrong(comm, s, at, 0, bytes, p, me, round);
                assert_eq!(wrong, 0, "rank {me} from {p}: mode {mode}, {bytes} bytes");
                let mut edge = [0u8; 16];
                buf.read(
                    (inbox + p as u64 * slot + dst_skew + bytes) as usize,
                    &mut edge,
                )
                .unwrap();
                assert!(
                    edge.iter().all(|&b| b == 0xEE),
                    "mode {mode}: wrote past {bytes} bytes"
                );
            }
            comm.bootstrap().barrier().unwrap();
        }
    }
    assert!(proxy.failure().is_none(), "{:?}", proxy.failure());
    proxy.stop().unwrap();
}

/// One put of 4 GiB + 2 MiB into the peer's buffer at offset 4 GiB + 2 MiB, and one 1 MiB put
/// between offsets past 4 GiB: nothing is truncated to 32 bits.
fn huge(comm: &Communicator, s: &Arc<CudaStream>) {
    let me = comm.rank() as u32;
    let peer = 1 - me;
    let big: u64 = (4 << 30) + (2 << 20);
    // [my message: big][receive area for the peer's: big]
    let buf = comm.alloc((2 * big) as usize).unwrap();
    let reg = comm.register(&buf).unwrap();
    let mut proxy = comm.proxy_builder(0).unwrap();
    let chans = comm.port_channels(&mut proxy, &reg, &reg).unwrap();
    let proxy = proxy.start().unwrap();
    let ch = chans.to(peer as usize).unwrap().device_handle();
    fill(comm, s, buf.device_ptr(), 0, big, me, peer, 9);
    comm.synchronize(s).unwrap();
    comm.bootstrap().barrier().unwrap();
    let put = comm.gpu().function("port", "port_put").unwrap();
    let drain = comm.gpu().function("port", "port_drain").unwrap();
    let (one, no) = (1u64, 0u32);
    let mut b = s.launch_builder(&put);
    b.arg(&ch).arg(&big).arg(&big).arg(&big); // one trigger of `big` bytes to offset `big`
                                              // SAFETY: matches port_put; [0, big) and [big, 2 big) are inside both buffers.
    unsafe { b.launch(cfg(32)) }.unwrap();
    let mut b = s.launch_builder(&drain);
    b.arg(&ch).arg(&one).arg(&no);
    // SAFETY: matches port_drain.
    unsafe { b.launch(cfg(32)) }.unwrap();
    comm.synchronize(s).unwrap();
    let wrong = count_wrong(comm, s, buf.device_ptr() + big, 0, big, peer, me, 9);
    assert_eq!(wrong, 0, "rank {me}: one {big}-byte put");

    // 1 MiB from source offset 4 GiB + 1 KiB (inside my message half) to destination offset
    // big + 2 KiB (inside the receive half): the two ranges never overlap.
    comm.bootstrap().barrier().unwrap();
    let (src_off, dst_off, n) = ((4u64 << 30) + 1024, big + 2048, 1u64 << 20);
    fill(comm, s, buf.device_ptr() + src_off, 0, n, me, peer, 10);
    comm.synchronize(s).unwrap();
    comm.bootstrap().barrier().unwrap();
    let f = comm.gpu().function("port", "port_exchange").unwrap();
    // port_exchange with slot 0 puts [src_skew, +n) to the peer's [dst_skew, +n).
    let dev = s.clone_htod(&[ch]).unwrap();
    let dev_ptr = dev.device_ptr(s).0;
    let (slot, world, mode) = (0u64, 2u32, 1u32);
    let mut b = s.launch_builder(&f);
    b.arg(&dev_ptr)
        .arg(&me)
        .arg(&world)
        .arg(&slot)
        .arg(&n)
        .arg(&src_off)
        .arg(&dst_off)
        .arg(&mode);
    // SAFETY: matches port_exchange; both ranges are inside `buf` on both ranks.
    unsafe { b.launch(cfg(32)) }.unwrap();
    comm.synchronize(s).unwrap();
    let wrong = count_wrong(comm, s, buf.device_ptr() + dst_off, 0, n, peer, me, 10);
    assert_eq!(wrong, 0, "rank {me}: put between offsets past 4 GiB");
    comm.bootstrap().barrier().unwrap();
    proxy.stop().unwrap();
}

/// Rank 0: 8 blocks x 64 threads each push 8 signals (4096 triggers through a 32-slot ring,
/// 128 laps, 512 pushers at once); rank 1 must count exactly that many.
fn storm(comm: &Communicator, s: &Arc<CudaStream>) {
    let buf = comm.alloc(1 << 20).unwrap();
    let reg = comm.register(&buf).unwrap();
    let mut proxy = comm.proxy_builder(32).unwrap();
    let chans = comm.port_channels(&mut proxy, &reg, &reg).unwrap();
    let proxy = proxy.start().unwrap();
    let ch = chans.to(1 - comm.rank()).unwrap().device_handle();
    let (blocks, threads, per) = (8u32, 64u32, 8u32);
    let total = (blocks * threads * per) as u64;
    if comm.rank() == 0 {
        let f = comm.gpu().function("port", "port_signal_storm").unwrap();
        let mut b = s.launch_builder(&f);
        b.arg(&ch).arg(&per);
        let c = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches port_signal_storm.
        unsafe { b.launch(c) }.unwrap();
        if let Err(e) = comm.synchronize(s) {
            panic!("{e}; proxy: {:?}", proxy.failure());
        }
    } else {
        let f = comm.gpu().function("port", "port_count_signals").unwrap();
        let extra: CudaSlice<u32> = s.alloc_zeros(1).unwrap();
        {
            let (e, _g) = extra.device_ptr(s);
            let mut b = s.launch_builder(&f);
            b.arg(&ch).arg(&total).arg(&e);
            // SAFETY: matches port_count_signals; `extra` holds one u32.
            unsafe { b.launch(cfg(32)) }.unwrap();
        }
        if let Err(e) = comm.synchronize(s) {
            panic!("{e}; proxy: {:?}", proxy.failure());
        }
        assert_eq!(
            s.clone_dtoh(&extra).unwrap()[0],
            0,
            "more signals than pushes arrived"
        );
    }
    comm.bootstrap().barrier().unwrap();
    assert!(proxy.failure().is_none(), "{:?}", proxy.failure());
    proxy.stop().unwrap();
}

/// Rank 0 waits for a signal nobody sends; the host stops its proxy: the kernel must give up with
/// a ProxyStopped report well before the wait budget.
fn stop(comm: &Communicator, s: &Arc<CudaStream>) {
    common::fault_on_purpose();
    let buf = comm.alloc(1 << 20).unwrap();
    let reg = comm.register(&buf).unwrap();
    let mut proxy = comm.proxy_builder(0).unwrap();
    let chans = comm.port_channels(&mut proxy, &reg, &reg).unwrap();
    let proxy = proxy.start().unwrap();
    if comm.rank() == 0 {
        let ch = chans.to(1).unwrap().device_handle();
        let f = comm.gpu().function("port", "port_wait_forever").unwrap();
        let mut b = s.launch_builder(&f);
        b.arg(&ch);
        // SAFETY: matches port_wait_forever.
        unsafe { b.launch(cfg(32)) }.unwrap();
        std::thread::sleep(Duration::from_millis(300));
        let started = std::time::Instant::now();
        proxy.stop().unwrap();
        let err = comm.synchronize(s).expect_err("the wait must be released");
        eprintln!("reported: {err}");
        match err {
            Error::Timeout {
                what, rank, peer, ..
            } => {
                assert_eq!((what, rank, peer), (WaitKind::ProxyStopped, 0, 1));
                assert!(
                    started.elapsed() < Duration::from_secs(5),
                    "{:?}",
                    started.elapsed()
                );
            }
            other => panic!("expected Error::Timeout(ProxyStopped), got {other:?}"),
        }
    } else {
        proxy.stop().unwrap();
        // Rank 0's report reaches this rank too, naming the rank it waited for and the cause.
        let started = std::time::Instant::now();
        let err = loop {
            if let Err(e) = comm.check_health() {
                break e;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "rank 0's report never came"
            );
            std::thread::sleep(Duration::from_millis(5));
        };
        eprintln!("relayed: {err}");
        assert!(
            matches!(&err, Error::PeerFailed { rank: 1, cause, .. } if cause.contains("proxy service")),
            "{err}"
        );
    }
}

/// The copy-engine all-gather: sizes of 1 byte, odd sizes, one past a piece boundary (64 KiB
/// pieces here), the shard passed in place and copied in, then 100 replays of a captured graph
/// with a new input before each, every rank's shard checked on every rank each time.
fn allgather(comm: &Arc<Communicator>, s: &Arc<CudaStream>) {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    use doorbell::collectives::allgather::{AllGatherOptions, PortAllGather};
    let me = comm.rank() as u32;
    let world = comm.world_size() as u32;
    let piece = 64u64 << 10;
    let ag = PortAllGather::new(
        comm,
        1 << 20,
        AllGatherOptions {
            piece_bytes: piece as usize,
            ..Default::default()
        },
    )
    .unwrap();
    let input: CudaSlice<u8> = s.alloc_zeros(1 << 20).unwrap();
    let in_ptr = input.device_ptr(s).0;
    let check = |shard: u64, round: u32, what: &str| {
        for r in 0..world {
            let at = ag.output() + r as u64 * shard;
            let wrong = count_wrong(comm, s, at, 0, shard, r, 0, round);
            assert_eq!(
                wrong, 0,
                "rank {me}: shard of rank {r}, {shard} bytes, {what}"
            );
        }
    };
    let mut round = 0;
    for &shard in &[1u64, 7, 4097, piece, piece + 1, 3 * piece + 5, 1 << 20] {
        for in_place in [false, true] {
            round += 1;
            let src = if in_place {
                ag.my_shard(shard as usize)
            } else {
                in_ptr
            };
            fill(comm, s, src, 0, shard, me, 0, round);
            // SAFETY: `src` holds `shard` bytes (our input, or our slot of the output).
            unsafe { ag.run_raw(s, src, shard as usize) }.unwrap();
            comm.synchronize(s).unwrap();
            check(
                shard,
                round,
                if in_place { "in place" } else { "copied in" },
            );
        }
    }
    // Graph replays: the captured call copies whatever `input` holds at replay time.
    let shard = 3 * piece + 5;
    comm.synchronize(s).unwrap();
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .unwrap();
    // SAFETY: as above.
    unsafe { ag.run_raw(s, in_ptr, shard as usize) }.unwrap();
    let graph = s
        .end_capture(CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("a graph");
    for replay in 0..100 {
        round += 1;
        fill(comm, s, in_ptr, 0, shard, me, 0, round);
        graph.launch().unwrap();
        comm.synchronize(s).unwrap();
        check(shard, round, &format!("graph replay {replay}"));
    }
    // Refused loudly, not truncated.
    // SAFETY: refused before anything is enqueued.
    assert!(unsafe { ag.run_raw(s, in_ptr, (1 << 20) + 1) }.is_err());
}
