//! Inputs with exact sums and the verification of results, for the collective tests and the
//! benchmarks' `--check` (kernels in `cuda/kernels/verify.cu`).
//!
//! [`value`] is the host twin of the device's `verify_value`: small integers derived from (rank,
//! index, seed), so the sum over up to 8 ranks is exact in every supported type and a wrong
//! element is a real error. [`Verifier::fill_random`] and [`Verifier::hash`] serve the pressure
//! tests: rounding there depends on summation order, so a race shows up as differing hashes.

use crate::collectives::DataType;
use crate::error::Result;
use crate::gpu::cuda::{cuda_err, Gpu};
use cudarc::driver::{CudaFunction, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use std::sync::Arc;

/// Element `i` of `rank`'s input with `seed` (twin of `verify_value` in verify.cu).
pub fn value(rank: u32, i: u64, seed: u32) -> i32 {
    ((i.wrapping_mul(7) + rank as u64 * 13 + seed as u64 * 5) % 17) as i32 - 8
}

/// The expected sum of element `i` over `world` ranks.
pub fn expected_sum(world: u32, i: u64, seed: u32) -> i32 {
    (0..world).map(|r| value(r, i, seed)).sum()
}

/// The verification kernels of one GPU, for every data type.
pub struct Verifier {
    fill: [CudaFunction; 3],
    count_wrong: [CudaFunction; 3],
    fill_random: [CudaFunction; 3],
    hash: [CudaFunction; 3],
    route_fill: CudaFunction,
    route_count_wrong: CudaFunction,
    delay: CudaFunction,
    stamp: CudaFunction,
}

/// One thread (the clock kernels).
const ONE_THREAD: LaunchConfig = LaunchConfig {
    grid_dim: (1, 1, 1),
    block_dim: (1, 1, 1),
    shared_mem_bytes: 0,
};

fn grid(count: usize) -> LaunchConfig {
    crate::collectives::flat_grid(count as u64)
}

/// Runs `launch` with the device address of one zeroed u64 and returns what the kernel left
/// there (synchronizes `s`).
fn one_u64(
    s: &Arc<CudaStream>,
    launch: impl FnOnce(u64) -> std::result::Result<(), cudarc::driver::DriverError>,
) -> Result<u64> {
    let out = s.alloc_zeros::<u64>(1).map_err(cuda_err("cuMemAlloc"))?;
    {
        let (p, _g) = out.device_ptr(s);
        launch(p).map_err(cuda_err("cuLaunchKernel"))?;
    }
    let v = s.clone_dtoh(&out).map_err(cuda_err("cuMemcpyDtoH"))?;
    Ok(v[0])
}

impl Verifier {
    /// Loads the kernels.
    pub fn new(gpu: &Arc<Gpu>) -> Result<Verifier> {
        let load = |stem: &str| crate::collectives::kernels_per_type(gpu, "verify", stem);
        Ok(Verifier {
            fill: load("verify_fill")?,
            count_wrong: load("verify_count_wrong")?,
            fill_random: load("verify_fill_random")?,
            hash: load("verify_hash")?,
            route_fill: gpu.function("selftest", "selftest_fill")?,
            route_count_wrong: gpu.function("selftest", "selftest_count_wrong")?,
            delay: gpu.function("verify", "verify_delay")?,
            stamp: gpu.function("verify", "verify_stamp")?,
        })
    }

    /// Writes the GPU's global timer (nanoseconds) to the u64 at `at` when `s` gets there: a
    /// clock between the calls of a CUDA graph (a kernel node costs less there than an event).
    ///
    /// # Safety
    /// `at` must be 8 bytes of this GPU's memory, 8-byte aligned, alive until the kernel ran.
    pub unsafe fn stamp(&self, s: &Arc<CudaStream>, at: u64) -> Result<()> {
        let mut b = s.launch_builder(&self.stamp);
        b.arg(&at);
        // SAFETY: verify_stamp(uint64_t*) writes 8 bytes at `at`, which the caller vouches for.
        unsafe { b.launch(ONE_THREAD) }.map_err(cuda_err("cuLaunchKernel"))?;
        Ok(())
    }

    /// Holds `s` for `d` of wall clock (one GPU thread sleeping), so one rank can be made late
    /// on purpose: its peers' kernels then wait that long for it.
    pub fn delay(&self, s: &Arc<CudaStream>, d: std::time::Duration) -> Result<()> {
        let ns = d.as_nanos().min(u64::MAX as u128) as u64;
        let mut b = s.launch_builder(&self.delay);
        b.arg(&ns);
        // SAFETY: verify_delay(uint64_t) touches no memory.
        unsafe { b.launch(ONE_THREAD) }.map_err(cuda_err("cuLaunchKernel"))?;
        Ok(())
    }

    /// Writes the bytes of the message `from` sends `to` in `round` (a pattern of the byte index,
    /// the two ranks and the round, so a block that lands in the wrong place or from the wrong
    /// rank shows) to `bytes` at `ptr`. For data-movement collectives (all-to-all, all-gather).
    ///
    /// # Safety
    /// `ptr` must be device memory of this GPU holding `bytes`.
    pub unsafe fn fill_route(
        &self,
        s: &Arc<CudaStream>,
        ptr: u64,
        bytes: usize,
        from: u32,
        to: u32,
        round: u32,
    ) -> Result<()> {
        let (off, n) = (0u64, bytes as u64);
        let mut b = s.launch_builder(&self.route_fill);
        b.arg(&ptr)
            .arg(&off)
            .arg(&n)
            .arg(&from)
            .arg(&to)
            .arg(&round);
        // SAFETY: matches selftest_fill; the caller vouches for the range.
        unsafe { b.launch(grid(bytes)) }.map_err(cuda_err("cuLaunchKernel"))?;
        Ok(())
    }

    /// Counts the bytes at `ptr` that differ from [`Verifier::fill_route`]'s pattern. Synchronizes
    /// `s`.
    ///
    /// # Safety
    /// As for [`Verifier::fill_route`].
    pub unsafe fn count_wrong_route(
        &self,
        s: &Arc<CudaStream>,
        ptr: u64,
        bytes: usize,
        from: u32,
        to: u32,
        round: u32,
    ) -> Result<u64> {
        one_u64(s, |w| {
            let (off, n) = (0u64, bytes as u64);
            let mut b = s.launch_builder(&self.route_count_wrong);
            b.arg(&ptr)
                .arg(&off)
                .arg(&n)
                .arg(&from)
                .arg(&to)
                .arg(&round)
                .arg(&w);
            // SAFETY: matches selftest_count_wrong; `w` holds one u64.
            unsafe { b.launch(grid(bytes)) }.map(drop)
        })
    }

    /// Writes `rank`'s input (`value(rank, i, seed)`) to `count` elements at `ptr`.
    ///
    /// # Safety
    /// `ptr` must be device memory of this GPU holding `count` elements of `dtype`.
    pub unsafe fn fill(
        &self,
        s: &Arc<CudaStream>,
        ptr: u64,
        count: usize,
        dtype: DataType,
        rank: u32,
        seed: u32,
    ) -> Result<()> {
        let f = &self.fill[dtype.code() as usize];
        let n = count as u64;
        let mut b = s.launch_builder(f);
        b.arg(&ptr).arg(&n).arg(&rank).arg(&seed);
        // SAFETY: matches verify_fill_*; the caller vouches for the range.
        unsafe { b.launch(grid(count)) }.map_err(cuda_err("cuLaunchKernel"))?;
        Ok(())
    }

    /// Pseudo-random values in [-1, 1) derived from (rank, index, seed).
    ///
    /// # Safety
    /// As for [`Verifier::fill`].
    pub unsafe fn fill_random(
        &self,
        s: &Arc<CudaStream>,
        ptr: u64,
        count: usize,
        dtype: DataType,
        rank: u32,
        seed: u32,
    ) -> Result<()> {
        let f = &self.fill_random[dtype.code() as usize];
        let n = count as u64;
        let mut b = s.launch_builder(f);
        b.arg(&ptr).arg(&n).arg(&rank).arg(&seed);
        // SAFETY: matches verify_fill_random_*; the caller vouches for the range.
        unsafe { b.launch(grid(count)) }.map_err(cuda_err("cuLaunchKernel"))?;
        Ok(())
    }

    /// Counts elements at `ptr` that are not the sum over `world` ranks of their inputs.
    /// Synchronizes `s`.
    ///
    /// # Safety
    /// As for [`Verifier::fill`].
    pub unsafe fn count_wrong(
        &self,
        s: &Arc<CudaStream>,
        ptr: u64,
        count: usize,
        dtype: DataType,
        world: u32,
        seed: u32,
    ) -> Result<u64> {
        one_u64(s, |w| {
            let n = count as u64;
            let mut b = s.launch_builder(&self.count_wrong[dtype.code() as usize]);
            b.arg(&ptr).arg(&n).arg(&world).arg(&seed).arg(&w);
            // SAFETY: matches verify_count_wrong_*; `w` holds one u64.
            unsafe { b.launch(grid(count)) }.map(drop)
        })
    }

    /// An order-independent hash of the `count` elements at `ptr`. Synchronizes `s`.
    ///
    /// # Safety
    /// As for [`Verifier::fill`].
    pub unsafe fn hash(
        &self,
        s: &Arc<CudaStream>,
        ptr: u64,
        count: usize,
        dtype: DataType,
    ) -> Result<u64> {
        one_u64(s, |o| {
            let n = count as u64;
            let mut b = s.launch_builder(&self.hash[dtype.code() as usize]);
            b.arg(&ptr).arg(&n).arg(&o);
            // SAFETY: matches verify_hash_*; `o` holds one u64.
            unsafe { b.launch(grid(count)) }.map(drop)
        })
    }
}

/// The name before [`Verifier`].
#[doc(hidden)]
pub type Checker = Verifier;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_are_exact_small_integers() {
        for world in 1..=8u32 {
            for i in 0..1000u64 {
                let s = expected_sum(world, i, 3);
                assert!(s.abs() <= 64, "{s}");
                // Exact in bf16: integers up to 256 have an exact representation.
                assert_eq!(half::bf16::from_f32(s as f32).to_f32(), s as f32);
            }
        }
        assert_eq!(value(0, 0, 0), -8);
        assert_eq!(value(1, 2, 3), ((14 + 13 + 15) % 17) - 8);
    }
}
