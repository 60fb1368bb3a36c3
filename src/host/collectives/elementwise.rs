//! Elementwise work on one GPU beside the collectives (kernels in `cuda/kernels/elementwise.cu`):
//! the maximum or minimum over slices that an all-gather laid side by side, and a scaling in
//! place. Callers compose NCCL's other reductions from them: the average as the sum scaled by
//! 1 / ranks, the maximum and minimum as an all-gather and then [`Elementwise::reduce_slices_raw`]
//! (the NCCL-compatible library, `nccl/`, where no real NCCL runs them). Both launch on the
//! caller's stream, take no host memory, and may be captured in a CUDA graph.

use crate::collectives::DataType;
use crate::collectives::{flat_grid, kernels_per_type};
use crate::error::{Error, Result};
use crate::gpu::cuda::{cuda_err, Gpu};
use cudarc::driver::{CudaFunction, CudaStream, PushKernelArg};
use std::sync::Arc;

/// An elementwise maximum or minimum.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Extremum {
    /// The largest value (a NaN loses to a number, as `fmaxf`).
    Max,
    /// The smallest value (a NaN loses to a number, as `fminf`).
    Min,
}

/// The elementwise kernels of one GPU, for every data type (indexed by [`DataType::code`]).
pub struct Elementwise {
    max: [CudaFunction; 3],
    min: [CudaFunction; 3],
    scale: [CudaFunction; 3],
}

impl Elementwise {
    /// Loads the kernels on `gpu`.
    pub fn new(gpu: &Arc<Gpu>) -> Result<Elementwise> {
        let load = |op: &str| kernels_per_type(gpu, "elementwise", &format!("elementwise_{op}"));
        Ok(Elementwise {
            max: load("max")?,
            min: load("min")?,
            scale: load("scale")?,
        })
    }

    /// `dst[i]` = the maximum (or minimum) over `s < slices` of `src[s * count + i]`, on `s`.
    /// `dst` may be `src`'s first slice.
    ///
    /// # Safety
    /// `src` must be this GPU's memory holding `slices * count` elements of `dtype`, `dst`
    /// `count`, both valid until the stream's work is done; `dst` must not overlap slices past
    /// the first.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn reduce_slices_raw(
        &self,
        s: &Arc<CudaStream>,
        src: u64,
        slices: u32,
        count: u64,
        dtype: DataType,
        op: Extremum,
        dst: u64,
    ) -> Result<()> {
        if slices == 0 {
            return Err(Error::invalid("slices", "0: at least one slice to reduce"));
        }
        if count == 0 {
            return Ok(());
        }
        let f = match op {
            Extremum::Max => &self.max,
            Extremum::Min => &self.min,
        };
        let mut b = s.launch_builder(&f[dtype.code() as usize]);
        b.arg(&src).arg(&count).arg(&slices).arg(&dst);
        // SAFETY: matches elementwise_{max,min}_T(const T*, uint64_t, uint32_t, T*); the caller
        // vouches for the ranges.
        unsafe { b.launch(flat_grid(count)) }.map_err(cuda_err("cuLaunchKernel"))?;
        Ok(())
    }

    /// `x[i] = x[i] * factor` (in f32, rounded once to `dtype`), on `s`.
    ///
    /// # Safety
    /// `x` must be this GPU's memory holding `count` elements of `dtype`, valid until the
    /// stream's work is done.
    pub unsafe fn scale_raw(
        &self,
        s: &Arc<CudaStream>,
        x: u64,
        count: u64,
        dtype: DataType,
        factor: f32,
    ) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let mut b = s.launch_builder(&self.scale[dtype.code() as usize]);
        b.arg(&x).arg(&count).arg(&factor);
        // SAFETY: matches elementwise_scale_T(T*, uint64_t, float); the caller vouches for `x`.
        unsafe { b.launch(flat_grid(count)) }.map_err(cuda_err("cuLaunchKernel"))?;
        Ok(())
    }
}
