//! The `ib_test_puts` case shared by the emulated-NIC test (`tests/ib.rs`) and the ConnectX test
//! (`tests/ib_hw.rs`): 4 x 64 GPU threads each put 4 chunks of 1 KiB from `src` to `dst` and add
//! 1 to `signal` (old values into `result`), then wait for their completions. The caller
//! registers the four buffers with its NIC and passes the keys.
#![allow(dead_code)] // each test binary uses part of it

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use doorbell::device_api::IbQpHandle;
use doorbell::gpu::cuda::Gpu;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `n` bytes of device memory, byte i = `fill(i)`.
pub fn device_bytes(s: &Arc<CudaStream>, n: usize, fill: impl Fn(usize) -> u8) -> CudaSlice<u8> {
    let v: Vec<u8> = (0..n).map(fill).collect();
    s.clone_htod(&v).unwrap()
}

/// The buffers of one run.
pub struct Puts {
    pub src: CudaSlice<u8>,
    pub dst: CudaSlice<u8>,
    pub signal: CudaSlice<u8>,
    pub result: CudaSlice<u8>,
}

pub const BLOCKS: u32 = 4;
pub const THREADS: u32 = 64;
pub const PER_THREAD: u32 = 4;
pub const CHUNK: u32 = 1024;

/// GPU threads of a run.
pub const fn threads() -> usize {
    (BLOCKS * THREADS) as usize
}

/// WQEs a run posts (the puts and one fetch-add per thread).
pub const fn wqes() -> u64 {
    (BLOCKS * THREADS * (PER_THREAD + 1)) as u64
}

impl Puts {
    /// Fresh buffers: `src` patterned, `dst` and `signal` zero, `result` 0xff.
    pub fn new(s: &Arc<CudaStream>) -> Puts {
        let bytes = threads() * (PER_THREAD * CHUNK) as usize;
        Puts {
            src: device_bytes(s, bytes, |i| (i * 13 % 251) as u8),
            dst: device_bytes(s, bytes, |_| 0),
            signal: device_bytes(s, 8, |_| 0),
            result: device_bytes(s, 8 * threads(), |_| 0xff),
        }
    }

    /// The four buffers, in the order `run` takes their keys.
    pub fn buffers(&self) -> [&CudaSlice<u8>; 4] {
        [&self.src, &self.dst, &self.signal, &self.result]
    }

    /// Launches `ib_test_puts` on `qp` with `keys` (src, dst, signal, result), waits, and checks
    /// the data, the signal and that every fetch-add returned a distinct old value; returns the
    /// time from launch to the end of the kernel.
    pub fn run(
        &self,
        gpu: &Gpu,
        s: &Arc<CudaStream>,
        qp: IbQpHandle,
        keys: [u32; 4],
        what: &str,
    ) -> Duration {
        let f = gpu.function("ib", "ib_test_puts").unwrap();
        let p = |b: &CudaSlice<u8>| b.device_ptr(s).0;
        let (ps, pd, pg, pr) = (p(&self.src), p(&self.dst), p(&self.signal), p(&self.result));
        let (chunk, per_thread) = (CHUNK, PER_THREAD);
        let mut b = s.launch_builder(&f);
        b.arg(&qp)
            .arg(&ps)
            .arg(&keys[0])
            .arg(&pd)
            .arg(&keys[1])
            .arg(&chunk)
            .arg(&per_thread)
            .arg(&pg)
            .arg(&keys[2])
            .arg(&pr)
            .arg(&keys[3]);
        let start = Instant::now();
        // SAFETY: matches ib_test_puts; every address is inside a buffer registered under its
        // key (the kernel uses one key as both lkey and rkey, as the emulator and mlx5 allow).
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (BLOCKS, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .unwrap();
        s.synchronize().unwrap();
        let took = start.elapsed();
        assert_eq!(
            s.clone_dtoh(&self.dst).unwrap(),
            s.clone_dtoh(&self.src).unwrap(),
            "{what}: data"
        );
        let sig = u64::from_ne_bytes(s.clone_dtoh(&self.signal).unwrap()[..8].try_into().unwrap());
        assert_eq!(sig, threads() as u64, "{what}: signal");
        let mut olds: Vec<u64> = s
            .clone_dtoh(&self.result)
            .unwrap()
            .chunks(8)
            .map(|c| u64::from_ne_bytes(c.try_into().unwrap()))
            .collect();
        olds.sort_unstable();
        assert_eq!(
            olds,
            (0..threads() as u64).collect::<Vec<_>>(),
            "{what}: fetch-add results"
        );
        took
    }
}
