//! Collectives between ranks of different nodes (`collectives::net`, `#[ignore = "needs GPU"]`):
//! all-to-all and allreduce through PortChannels over every transport: CUDA IPC (one node), the
//! Ethernet proxies, and RDMA over the emulated mlx5 NIC in its three posting modes (the proxy,
//! kernels ringing themselves, kernels with a host thread ringing), with 2, 3 and 4 ranks acting
//! as separate nodes, and nodes of two ranks (CUDA IPC inside a node, the network between; at 4
//! ranks the allreduce is hierarchical: reduce-scatter in the node, shards between nodes,
//! all-gather in the node). Payloads name their (sender, receiver, round); the allreduce sums integers
//! exactly; repeated calls and graph replays reuse the buffers.

mod common;

use common::{count_wrong, fill, rank_counts, rank_main, run_case};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaStream, DevicePtr};
use doorbell::channel::port_channel::Transport;
use doorbell::collectives::net::NetCollectives;
use doorbell::collectives::DataType;
use doorbell::communicator::Communicator;
use half::bf16;
use std::sync::Arc;

#[test]
#[ignore = "needs GPU"]
fn gpu_rank() {
    rank_main(|case, comm, stream| match case {
        "net" => net(comm, stream),
        other => panic!("unknown case {other}"),
    });
}

fn variants() -> Vec<(&'static str, Vec<(&'static str, &'static str)>)> {
    let sep = ("DOORBELL_SEPARATE_NODES", "1");
    let emu = ("DOORBELL_IB_EMULATE", "1");
    let pair = ("DOORBELL_NODE_SIZE", "2");
    vec![
        ("CudaIpc", vec![]),
        // DOORBELL_IB_DISABLE: Ethernet even on hosts with an RDMA NIC.
        ("Ethernet", vec![sep, ("DOORBELL_IB_DISABLE", "1")]),
        ("Ib, proxy posting", vec![sep, emu]),
        (
            "Ib, IBGDA",
            vec![sep, emu, ("DOORBELL_IB_POSTING", "ibgda")],
        ),
        (
            "Ib, CPU-assisted",
            vec![sep, emu, ("DOORBELL_IB_POSTING", "cpu")],
        ),
        (
            "Ib, ibv_post_send",
            vec![sep, emu, ("DOORBELL_IB_POSTING", "verbs")],
        ),
        // Nodes of two ranks: CUDA IPC inside a node, the network between; with 4 ranks the
        // allreduce is hierarchical.
        (
            "Ethernet, 2 ranks per node",
            vec![sep, pair, ("DOORBELL_IB_DISABLE", "1")],
        ),
        ("Ib, proxy posting, 2 ranks per node", vec![sep, emu, pair]),
        (
            "Ib, IBGDA, 2 ranks per node",
            vec![sep, emu, pair, ("DOORBELL_IB_POSTING", "ibgda")],
        ),
        (
            "Ib, CPU-assisted, 2 ranks per node",
            vec![sep, emu, pair, ("DOORBELL_IB_POSTING", "cpu")],
        ),
        (
            "Ib, ibv_post_send, 2 ranks per node",
            vec![sep, emu, pair, ("DOORBELL_IB_POSTING", "verbs")],
        ),
    ]
}

#[test]
#[ignore = "needs GPU"]
fn alltoall_and_allreduce_across_nodes_over_every_transport() {
    // DOORBELL_TEST_VARIANTS=Ib,Ethernet keeps only the variants whose names contain one of them.
    let only = std::env::var("DOORBELL_TEST_VARIANTS").unwrap_or_default();
    let keep = |name: &str| only.is_empty() || only.split(',').any(|w| name.contains(w.trim()));
    for (name, env) in variants().into_iter().filter(|(name, _)| keep(name)) {
        for n in rank_counts() {
            eprintln!("{name}, {n} ranks");
            run_case("net", n, &env);
        }
    }
}

fn upload<T: cudarc::driver::DeviceRepr>(s: &CudaStream, ptr: u64, v: &[T]) {
    // SAFETY: every destination in this test is sized for the largest upload.
    unsafe { cudarc::driver::result::memcpy_htod_async(ptr, v, s.cu_stream()) }.unwrap();
}

fn download<T: cudarc::driver::DeviceRepr + Default + Clone>(
    comm: &Communicator,
    s: &CudaStream,
    ptr: u64,
    n: usize,
) -> Vec<T> {
    // Synchronize first: a failed wait in the collective is then reported with its fields.
    comm.synchronize(s).unwrap();
    let mut v = vec![T::default(); n];
    // SAFETY: the source holds `n` elements.
    unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut v, ptr, s.cu_stream()) }.unwrap();
    comm.synchronize(s).unwrap();
    v
}

fn net(comm: &Arc<Communicator>, s: &Arc<CudaStream>) {
    let (me, n) = (comm.rank(), comm.world_size());
    let nc = NetCollectives::new(comm, 1 << 20).unwrap();
    let env = |k: &str| std::env::var(k).unwrap_or_default();
    let separate = env("DOORBELL_SEPARATE_NODES") == "1";
    let between_nodes = if env("DOORBELL_IB_EMULATE") == "1" || env("DOORBELL_TEST_NIC") == "1" {
        Transport::Ib
    } else if separate {
        Transport::Ethernet
    } else {
        Transport::CudaIpc
    };
    let node_size: usize = env("DOORBELL_NODE_SIZE").parse().unwrap_or(1);
    for p in (0..n).filter(|&p| p != me) {
        let same_node = !separate || p / node_size == me / node_size;
        let want = if same_node {
            Transport::CudaIpc
        } else {
            between_nodes
        };
        assert_eq!(nc.transport(p), Some(want), "rank {me} to {p}");
    }
    // Hierarchical exactly when there are several nodes of equal size, more than one rank each.
    let hierarchical = separate && node_size > 1 && n % node_size == 0 && n > node_size;
    assert_eq!(nc.hierarchical(), hierarchical, "rank {me} of {n}");
    let (send, recv) = (nc.send_buffer(), nc.recv_buffer());
    let out = s.alloc_zeros::<f32>(1 << 16).unwrap();
    let out_ptr = out.device_ptr(s).0;
    let check_alltoall = |round: u32, block: u64| {
        for p in 0..n {
            let wrong = count_wrong(
                comm,
                s,
                recv,
                p as u64 * block,
                block,
                p as u32,
                me as u32,
                round,
            );
            assert_eq!(wrong, 0, "rank {me}, round {round}: block from rank {p}");
        }
    };
    let fill_alltoall = |round: u32, block: u64| {
        for p in 0..n {
            fill(
                comm,
                s,
                send,
                p as u64 * block,
                block,
                me as u32,
                p as u32,
                round,
            );
        }
    };
    let f32_input = |round: usize, count: usize| -> Vec<f32> {
        (0..count)
            .map(|i| ((me + 1) * ((i + round) % 7)) as f32)
            .collect()
    };
    let check_f32 = |round: usize, count: usize| {
        let got: Vec<f32> = download(comm, s, out_ptr, count);
        for (i, g) in got.iter().enumerate() {
            let want = (((i + round) % 7) * n * (n + 1) / 2) as f32;
            assert_eq!(*g, want, "rank {me}, round {round}: f32 element {i}");
        }
    };
    for round in 0..3u32 {
        let block = 4096 + 8 * u64::from(round);
        fill_alltoall(round, block);
        nc.alltoall(s, block as usize).unwrap();
        comm.synchronize(s).unwrap();
        check_alltoall(round, block);
        let count = 1000 + round as usize;
        upload(s, send, &f32_input(round as usize, count));
        // SAFETY: `out` holds 65536 f32.
        unsafe { nc.allreduce(s, DataType::F32, count, out_ptr) }.unwrap();
        check_f32(round as usize, count);
        let vals: Vec<bf16> = (0..count)
            .map(|i| bf16::from_f32(((me + 1) * (i % 3)) as f32))
            .collect();
        upload(s, send, &vals);
        // SAFETY: as above (bf16 takes half the room).
        unsafe { nc.allreduce(s, DataType::Bf16, count, out_ptr) }.unwrap();
        let got: Vec<bf16> = download(comm, s, out_ptr, count);
        for (i, g) in got.iter().enumerate() {
            assert_eq!(
                g.to_f32(),
                ((i % 3) * n * (n + 1) / 2) as f32,
                "rank {me}, round {round}: bf16 element {i}"
            );
        }
    }
    // A captured all-to-all and allreduce, replayed with new data each time.
    let (block, count) = (8192u64, 4096usize);
    comm.synchronize(s).unwrap();
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .unwrap();
    nc.alltoall(s, block as usize).unwrap();
    let g1 = s
        .end_capture(CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("a graph");
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .unwrap();
    // SAFETY: as above.
    unsafe { nc.allreduce(s, DataType::F32, count, out_ptr) }.unwrap();
    let g2 = s
        .end_capture(CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("a graph");
    for replay in 0..5u32 {
        let round = 100 + replay;
        fill_alltoall(round, block);
        comm.synchronize(s).unwrap();
        g1.launch().unwrap();
        comm.synchronize(s).unwrap();
        check_alltoall(round, block);
        upload(s, send, &f32_input(round as usize, count));
        comm.synchronize(s).unwrap();
        g2.launch().unwrap();
        check_f32(round as usize, count);
    }
}

/// The collectives across nodes through a real RDMA NIC (never run here: no machine of this
/// project has one), in each posting mode, nodes of one rank and of two. The GPU suite skips
/// `nic_` tests unless `NIC_TESTS=1`.
#[test]
#[ignore = "needs an RDMA NIC"]
fn nic_alltoall_and_allreduce_through_the_nic() {
    for posting in ["auto", "proxy", "verbs", "cpu", "ibgda"] {
        for pair in [None, Some(("DOORBELL_NODE_SIZE", "2"))] {
            for n in rank_counts() {
                let mut env = vec![
                    ("DOORBELL_SEPARATE_NODES", "1"),
                    ("DOORBELL_TEST_NIC", "1"),
                    ("DOORBELL_IB_POSTING", posting),
                ];
                env.extend(pair);
                eprintln!("posting {posting}, {n} ranks, {env:?}");
                run_case("net", n, &env);
            }
        }
    }
}
