//! GPU test suite: needs CUDA GPUs, so every test is `#[ignore = "needs GPU"]`; run with
//! `cargo test --release --test gpu -- --ignored` (or `scripts/gpu-suite.sh`).
//!
//! Each test spawns its ranks as processes of this same test binary (running `gpu_rank` with the
//! case in `DOORBELL_GPU_CASE`), as a launcher would: one process per rank, `LOCAL_RANK % GPUs`
//! picks the GPU, so more ranks than GPUs share them. Payloads are derived from (sender,
//! receiver, round, byte index): a wrong byte says who sent it.

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, PushKernelArg};
use doorbell::channel::memory_channel::MemoryChannels;
use doorbell::communicator::Communicator;
use doorbell::device_api::MemoryChannelHandle;
use doorbell::{Error, WaitKind};
use std::sync::Arc;
use std::time::Duration;

mod common;
use common::{count_wrong, fill, launch_cfg, pattern, rank_counts, rank_main, run_case};

/// The rank side of every case. Does nothing unless spawned by `run_case`.
#[test]
#[ignore = "needs GPU"]
fn gpu_rank() {
    rank_main(|case, comm, stream| match case {
        "export_import" => export_import(comm, stream),
        "put" => exchange(comm, stream, false),
        "get" => exchange(comm, stream, true),
        "ll8" => packets(comm, stream, false),
        "ll16" => packets(comm, stream, true),
        "timeout" => forced_timeout(comm, stream, false),
        "packet_timeout" => forced_timeout(comm, stream, true),
        other => panic!("unknown case {other}"),
    });
}

#[test]
#[ignore = "needs GPU"]
fn memory_export_and_import_across_processes() {
    for n in rank_counts() {
        run_case("export_import", n, &[]);
    }
}

#[test]
#[ignore = "needs GPU"]
fn memory_channel_put_signal_wait() {
    for n in rank_counts() {
        run_case("put", n, &[]);
    }
}

#[test]
#[ignore = "needs GPU"]
fn memory_channel_get() {
    for n in rank_counts() {
        run_case("get", n, &[]);
    }
}

#[test]
#[ignore = "needs GPU"]
fn ll8_packet_round_trips() {
    for n in rank_counts() {
        run_case("ll8", n, &[]);
    }
}

#[test]
#[ignore = "needs GPU"]
fn ll16_packet_round_trips() {
    for n in rank_counts() {
        run_case("ll16", n, &[]);
    }
}

#[test]
#[ignore = "needs GPU"]
fn forced_semaphore_timeout_is_reported_with_its_fields() {
    run_case("timeout", 2, &[("DOORBELL_WAIT_TIMEOUT_MS", "300")]);
}

#[test]
#[ignore = "needs GPU"]
fn forced_packet_timeout_is_reported_with_its_fields() {
    run_case("packet_timeout", 2, &[("DOORBELL_WAIT_TIMEOUT_MS", "300")]);
}

#[test]
#[ignore = "needs GPU"]
fn no_such_gpu_is_an_error_not_a_panic() {
    match doorbell::gpu::cuda::Gpu::open(1 << 20) {
        Err(Error::InvalidArgument { why, .. }) => assert!(why.contains("sees"), "{why}"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

/// The elementwise kernels (NCCL's max, min and average where doorbell runs them): the maximum
/// and minimum over slices and the scaling, f32 and bf16 against the host, NaN losing to a
/// number as with fmaxf.
#[test]
#[ignore = "needs GPU"]
fn elementwise_max_min_and_scale_match_the_host() {
    use doorbell::collectives::elementwise::{Elementwise, Extremum};
    use doorbell::collectives::DataType;
    let gpu = doorbell::gpu::cuda::Gpu::open(0).expect("GPU 0");
    let ew = Elementwise::new(&gpu).unwrap();
    let s = gpu.new_stream().unwrap();
    let (slices, count) = (3usize, 5000usize);
    let v = |sl: usize, i: usize| ((i * 7 + sl * 13) % 17) as f32 - 8.0;
    let mut host: Vec<f32> = (0..slices * count)
        .map(|k| v(k / count, k % count))
        .collect();
    host[count + 4] = f32::NAN; // slice 1, element 4: the other slices' values win
    for (op, pick) in [
        (Extremum::Max, f32::max as fn(f32, f32) -> f32),
        (Extremum::Min, f32::min),
    ] {
        let want: Vec<f32> = (0..count)
            .map(|i| (1..slices).fold(host[i], |a, sl| pick(a, host[sl * count + i])))
            .collect();
        let src = s.clone_htod(&host).unwrap();
        let mut dst = s.alloc_zeros::<f32>(count).unwrap();
        {
            let (a, _ga) = src.device_ptr(&s);
            let (d, _gd) = dst.device_ptr_mut(&s);
            // SAFETY: both sized as the call says.
            unsafe {
                ew.reduce_slices_raw(&s, a, slices as u32, count as u64, DataType::F32, op, d)
            }
            .unwrap();
        }
        assert_eq!(s.clone_dtoh(&dst).unwrap(), want, "{op:?} f32");
        // bf16 as its bits (u16).
        let hb: Vec<u16> = host
            .iter()
            .map(|&x| half::bf16::from_f32(x).to_bits())
            .collect();
        let src = s.clone_htod(&hb).unwrap();
        let mut dst = s.alloc_zeros::<u16>(count).unwrap();
        {
            let (a, _ga) = src.device_ptr(&s);
            let (d, _gd) = dst.device_ptr_mut(&s);
            // SAFETY: as above.
            unsafe {
                ew.reduce_slices_raw(&s, a, slices as u32, count as u64, DataType::Bf16, op, d)
            }
            .unwrap();
        }
        let got: Vec<f32> = s
            .clone_dtoh(&dst)
            .unwrap()
            .iter()
            .map(|&b| half::bf16::from_bits(b).to_f32())
            .collect();
        assert_eq!(got, want, "{op:?} bf16");
    }
    let mut x = s.clone_htod(&host[..count]).unwrap();
    {
        let (p, _g) = x.device_ptr_mut(&s);
        // SAFETY: `count` f32 at p.
        unsafe { ew.scale_raw(&s, p, count as u64, DataType::F32, 0.25) }.unwrap();
    }
    let want: Vec<f32> = host[..count].iter().map(|x| x * 0.25).collect();
    assert_eq!(s.clone_dtoh(&x).unwrap(), want, "scale f32");
    // SAFETY: no slices is refused before anything is launched.
    assert!(
        unsafe { ew.reduce_slices_raw(&s, 16, 0, 4, DataType::F32, Extremum::Max, 32) }.is_err()
    );
}

// ---- host twin of the device pattern and launch helpers ---------------------------------------

fn upload(s: &Arc<CudaStream>, chans: &MemoryChannels) -> CudaSlice<MemoryChannelHandle> {
    s.clone_htod(&chans.handles()).unwrap()
}

fn peers(comm: &Communicator) -> Vec<usize> {
    (0..comm.world_size())
        .filter(|&p| p != comm.rank())
        .collect()
}

// ---- cases ---------------------------------------------------------------------------------

/// Every rank writes its pattern into its own VMM buffer and into a cudarc (cudaMalloc) buffer,
/// registers both, maps every peer's, and reads the peers' bytes through the mappings.
fn export_import(comm: &Communicator, s: &Arc<CudaStream>) {
    let me = comm.rank() as u32;
    let bytes = 3 * 1024 * 1024 + 5;
    let vmm = comm.alloc(bytes).unwrap();
    fill(comm, s, vmm.device_ptr(), 0, bytes as u64, me, 0, 7);
    // cudaMalloc-style memory (cuMemAlloc): shared with a legacy CUDA IPC handle.
    let plain = PlainAlloc::new(comm, bytes);
    let plain_ptr = plain.0;
    fill(comm, s, plain_ptr, 0, bytes as u64, me, 1, 7);
    // cudarc's own slices come from the stream-ordered pool, which legacy IPC cannot share: a
    // clear error, not a crash.
    let pooled: CudaSlice<u8> = s.alloc_zeros(4096).unwrap();
    // SAFETY: the registration fails, so nothing keeps the pointer.
    match unsafe { comm.register_external(pooled.device_ptr(s).0, 4096) } {
        Err(Error::InvalidArgument { why, .. }) => assert!(why.contains("stream-ordered"), "{why}"),
        other => panic!("expected InvalidArgument for pool memory, got {other:?}"),
    }
    comm.synchronize(s).unwrap();
    // The device pattern and its host twin agree.
    let mut head = vec![0u8; 4096];
    vmm.read(0, &mut head).unwrap();
    for (j, &b) in head.iter().enumerate() {
        assert_eq!(b, pattern(me, 0, 7, j as u64), "byte {j}");
    }
    let reg_vmm = comm.register(&vmm).unwrap();
    // SAFETY: `plain` outlives every use of this registration below.
    let reg_plain = unsafe { comm.register_external(plain_ptr, bytes) }.unwrap();
    let remote_vmm = comm.exchange(&reg_vmm).unwrap();
    let remote_plain = comm.exchange(&reg_plain).unwrap();
    for p in peers(comm) {
        let rv = remote_vmm[p].as_ref().expect("peer VMM mapped");
        let rp = remote_plain[p].as_ref().expect("peer cudaMalloc mapped");
        assert!(rv.len() >= bytes && rp.len() == bytes);
        let wrong_v = count_wrong(comm, s, rv.device_ptr(), 0, bytes as u64, p as u32, 0, 7);
        let wrong_p = count_wrong(comm, s, rp.device_ptr(), 0, bytes as u64, p as u32, 1, 7);
        assert_eq!(
            (wrong_v, wrong_p),
            (0, 0),
            "rank {me} reading rank {p}'s memory"
        );
    }
    assert!(remote_vmm[comm.rank()].is_none());
    // Peers keep reading until everyone is done.
    comm.bootstrap().barrier().unwrap();
}

/// A cuMemAlloc allocation (what cudaMalloc returns), freed on drop.
struct PlainAlloc(u64);

impl PlainAlloc {
    fn new(comm: &Communicator, bytes: usize) -> Self {
        comm.gpu().bind().unwrap();
        let mut p = 0;
        // SAFETY: plain allocation into `p`; freed in Drop.
        let r = unsafe { cudarc::driver::sys::cuMemAlloc_v2(&mut p, bytes) };
        assert_eq!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
        PlainAlloc(p)
    }
}

impl Drop for PlainAlloc {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemAlloc in `new`, freed once.
        unsafe { cudarc::driver::sys::cuMemFree_v2(self.0) };
    }
}

#[repr(C)]
#[derive(Clone, Copy)]
struct ExchangeArgs {
    channels: u64,
    rank: u32,
    world: u32,
    slot: u64,
    bytes: u64,
    src_skew: u64,
    dst_skew: u64,
    blocks_per_peer: u32,
    use_get: u32,
}
// SAFETY: matches `struct ExchangeArgs` in selftest.cu field for field.
unsafe impl DeviceRepr for ExchangeArgs {}

const SENTINEL: u8 = 0xEE;

/// Awkward sizes (1 byte, not a multiple of 16, one past a chunk) at aligned and skewed offsets,
/// several rounds (so semaphores are reused), one and several blocks per peer.
fn exchange(comm: &Communicator, s: &Arc<CudaStream>, use_get: bool) {
    let me = comm.rank() as u32;
    let world = comm.world_size() as u32;
    let slot: u64 = 4 << 20;
    let buf = comm.alloc((2 * world as u64 * slot) as usize).unwrap();
    let reg = comm.register(&buf).unwrap();
    let chans = comm.memory_channels(&reg, &reg, None).unwrap();
    let dev = upload(s, &chans);
    let dev_ptr = dev.device_ptr(s).0;
    let inbox = world as u64 * slot;
    let cases: &[(u64, u64, u64)] = &[
        (1, 0, 0),
        (15, 0, 0),
        (4097, 3, 3),
        (65537, 1, 5),
        (1 << 20, 8, 0),
        ((3 << 20) + 3, 0, 12),
    ];
    let f = comm
        .gpu()
        .function("selftest", "selftest_exchange")
        .unwrap();
    let hs = comm
        .gpu()
        .function("selftest", "selftest_handshake")
        .unwrap();
    let mut round = 0u32;
    for &(bytes, src_skew, dst_skew) in cases {
        for blocks_per_peer in [1u32, 4] {
            round += 1;
            buf.fill(inbox as usize, (world as u64 * slot) as usize, SENTINEL)
                .unwrap();
            for p in peers(comm) {
                fill(
                    comm,
                    s,
                    buf.device_ptr(),
                    p as u64 * slot + src_skew,
                    bytes,
                    me,
                    p as u32,
                    round,
                );
            }
            if use_get {
                let mut b = s.launch_builder(&hs);
                let npeers = world - 1;
                b.arg(&dev_ptr).arg(&npeers);
                // SAFETY: matches selftest_handshake; `dev` holds npeers handles.
                unsafe { b.launch(launch_cfg(1, 32)) }.unwrap();
            } else {
                // The peers' inbox sentinels must be in place before anyone puts.
                comm.synchronize(s).unwrap();
                comm.bootstrap().barrier().unwrap();
            }
            let args = ExchangeArgs {
                channels: dev_ptr,
                rank: me,
                world,
                slot,
                bytes,
                src_skew,
                dst_skew,
                blocks_per_peer,
                use_get: use_get as u32,
            };
            let mut b = s.launch_builder(&f);
            b.arg(&args);
            // SAFETY: matches selftest_exchange; every range lies inside `buf`.
            unsafe { b.launch(launch_cfg(blocks_per_peer * (world - 1), 256)) }.unwrap();
            comm.synchronize(s).unwrap();
            for p in peers(comm) {
                let at = inbox + p as u64 * slot + dst_skew;
                let wrong = count_wrong(comm, s, buf.device_ptr(), at, bytes, p as u32, me, round);
                assert_eq!(
                    wrong, 0,
                    "rank {me} from rank {p}: {bytes} bytes, skews {src_skew}/{dst_skew}, {blocks_per_peer} blocks, get={use_get}"
                );
                // Nothing written before or after the range.
                let mut edge = vec![0u8; 16];
                buf.read(
                    (at - dst_skew.min(16)) as usize,
                    &mut edge[..dst_skew.min(16) as usize],
                )
                .unwrap();
                assert!(
                    edge[..dst_skew.min(16) as usize]
                        .iter()
                        .all(|&b| b == SENTINEL),
                    "overrun before"
                );
                buf.read((at + bytes) as usize, &mut edge).unwrap();
                assert!(
                    edge.iter().all(|&b| b == SENTINEL),
                    "overrun after {bytes} bytes from rank {p}"
                );
            }
            // Nobody refills before everyone checked.
            comm.bootstrap().barrier().unwrap();
        }
    }
    drop(dev);
}

#[repr(C)]
#[derive(Clone, Copy)]
struct PacketArgs {
    channels: u64,
    rank: u32,
    world: u32,
    slot: u64,
    packet_slot: u64,
    bytes: u64,
    src_skew: u64,
    dst_skew: u64,
    flag: u32,
    ll16: u32,
}
// SAFETY: matches `struct PacketArgs` in selftest.cu field for field.
unsafe impl DeviceRepr for PacketArgs {}

/// LL round trips of awkward sizes; each round uses a new flag and never clears the packet
/// buffers, as collectives do.
fn packets(comm: &Communicator, s: &Arc<CudaStream>, ll16: bool) {
    let me = comm.rank() as u32;
    let world = comm.world_size() as u32;
    let slot: u64 = 1 << 20;
    let packet_slot: u64 = 2 << 20; // LL packets double the bytes
    let data = comm.alloc((2 * world as u64 * slot) as usize).unwrap();
    let pkts = comm.alloc((world as u64 * packet_slot) as usize).unwrap();
    let reg = comm.register(&data).unwrap();
    let reg_p = comm.register(&pkts).unwrap();
    let chans = comm.memory_channels(&reg, &reg, Some(&reg_p)).unwrap();
    let dev = upload(s, &chans);
    let dev_ptr = dev.device_ptr(s).0;
    let inbox = world as u64 * slot;
    let f = comm.gpu().function("selftest", "selftest_packets").unwrap();
    let cases: &[(u64, u64, u64)] = &[
        (1, 0, 0),
        (7, 1, 2),
        (8, 0, 0),
        (4097, 4, 8),
        ((1 << 19) + 3, 0, 3),
    ];
    let mut round = 0u32;
    for _ in 0..3 {
        for &(bytes, src_skew, dst_skew) in cases {
            round += 1;
            data.fill(inbox as usize, (world as u64 * slot) as usize, SENTINEL)
                .unwrap();
            for p in peers(comm) {
                fill(
                    comm,
                    s,
                    data.device_ptr(),
                    p as u64 * slot + src_skew,
                    bytes,
                    me,
                    p as u32,
                    round,
                );
            }
            let args = PacketArgs {
                channels: dev_ptr,
                rank: me,
                world,
                slot,
                packet_slot,
                bytes,
                src_skew,
                dst_skew,
                flag: round,
                ll16: ll16 as u32,
            };
            let mut b = s.launch_builder(&f);
            b.arg(&args);
            // SAFETY: matches selftest_packets; ranges lie inside the buffers.
            unsafe { b.launch(launch_cfg(world - 1, 256)) }.unwrap();
            comm.synchronize(s).unwrap();
            for p in peers(comm) {
                let at = inbox + p as u64 * slot + dst_skew;
                let wrong = count_wrong(comm, s, data.device_ptr(), at, bytes, p as u32, me, round);
                assert_eq!(
                    wrong,
                    0,
                    "rank {me} from rank {p}: {bytes} bytes in LL{} packets",
                    if ll16 { 16 } else { 8 }
                );
                let mut edge = vec![0u8; 16];
                data.read((at + bytes) as usize, &mut edge).unwrap();
                assert!(
                    edge.iter().all(|&b| b == SENTINEL),
                    "unpack wrote past {bytes} bytes"
                );
            }
            // A sender may not overwrite packets of this round before its peer consumed them:
            // with a fresh flag each round that is safe anyway, but keep ranks in step so a
            // failure names the round.
            comm.bootstrap().barrier().unwrap();
        }
    }
}

/// Rank 0 waits on a semaphore (or packet) that rank 1 never signals: the device wait must give
/// up within the budget and the host must report who waited for what.
fn forced_timeout(comm: &Communicator, s: &Arc<CudaStream>, packet: bool) {
    common::fault_on_purpose();
    let buf = comm.alloc(1 << 20).unwrap();
    let reg = comm.register(&buf).unwrap();
    let chans = comm.memory_channels(&reg, &reg, Some(&reg)).unwrap();
    if comm.rank() == 0 {
        let ch = chans.to(1).unwrap().device_handle();
        let started = std::time::Instant::now();
        if packet {
            let f = comm
                .gpu()
                .function("selftest", "selftest_packet_wait_forever")
                .unwrap();
            let mut b = s.launch_builder(&f);
            let flag = 77u32;
            b.arg(&ch).arg(&flag);
            // SAFETY: matches selftest_packet_wait_forever.
            unsafe { b.launch(launch_cfg(1, 32)) }.unwrap();
        } else {
            let f = comm
                .gpu()
                .function("selftest", "selftest_wait_forever")
                .unwrap();
            let mut b = s.launch_builder(&f);
            b.arg(&ch);
            // SAFETY: matches selftest_wait_forever.
            unsafe { b.launch(launch_cfg(1, 32)) }.unwrap();
        }
        let err = comm.synchronize(s).expect_err("the wait must time out");
        let elapsed = started.elapsed();
        eprintln!("reported: {err}");
        match err {
            Error::Timeout {
                rank,
                peer,
                what,
                expected,
                seen,
                waited_ms,
                ..
            } => {
                assert_eq!((rank, peer), (0, 1));
                if packet {
                    assert_eq!((what, expected, seen), (WaitKind::Packet, 77, 0));
                } else {
                    assert_eq!((what, expected, seen), (WaitKind::Semaphore, 1, 0));
                }
                assert!((300..5000).contains(&waited_ms), "waited {waited_ms} ms");
                assert!(elapsed < Duration::from_secs(20), "took {elapsed:?}");
            }
            other => panic!("expected Error::Timeout, got {other:?}"),
        }
    }
}
