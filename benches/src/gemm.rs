//! A bf16 GEMM through cuBLAS (loaded at run time, like NCCL) to run beside a collective: the
//! model compute that a communication library shares the GPU's SMs and memory with.

use cudarc::cublas::{CudaBlas, Gemm as _, GemmConfig};
use cudarc::driver::{CudaSlice, CudaStream};
use doorbell::{Error, Result};
use half::bf16;
use std::sync::Arc;

/// C = A B for square `n` x `n` bf16 matrices (f32 accumulation), on one stream.
pub struct Gemm {
    blas: CudaBlas,
    a: CudaSlice<bf16>,
    b: CudaSlice<bf16>,
    c: CudaSlice<bf16>,
    n: usize,
}

impl Gemm {
    /// cuBLAS on `stream` and the three matrices (A and B hold small values, C zeros).
    /// `Error::Invalid` when libcublas cannot be loaded, naming where it may be found.
    pub fn new(stream: &Arc<CudaStream>, n: usize) -> Result<Gemm> {
        if n == 0 || n > 1 << 16 {
            return Err(Error::invalid(
                "gemm",
                format!("size {n}: must be in 1..=65536"),
            ));
        }
        // SAFETY: only tries to load the library (cudarc panics on a missing one otherwise).
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(Error::invalid(
                "cuBLAS",
                "libcublas not found: put the directory holding libcublas.so.13 on \
                 LD_LIBRARY_PATH (e.g. /usr/local/cuda/lib64, or PyTorch's \
                 site-packages/nvidia/cu13/lib)",
            ));
        }
        let blas = CudaBlas::new(stream.clone()).map_err(|e| Error::Cuda {
            call: "cublasCreate",
            code: e.to_string(),
        })?;
        let alloc = |e: cudarc::driver::DriverError| Error::Cuda {
            call: "cuMemAlloc",
            code: e.to_string(),
        };
        // Values in [-1/16, 1/16): nothing overflows however large n is.
        let host: Vec<bf16> = (0..n * n)
            .map(|i| bf16::from_f32(((i * 7919) % 256) as f32 / 2048.0 - 0.0625))
            .collect();
        let a = stream.clone_htod(&host).map_err(alloc)?;
        let b = stream.clone_htod(&host).map_err(alloc)?;
        let c = stream.alloc_zeros::<bf16>(n * n).map_err(alloc)?;
        Ok(Gemm { blas, a, b, c, n })
    }

    /// Enqueues one multiplication on the stream.
    pub fn run(&mut self) -> Result<()> {
        let n = self.n as i32;
        let cfg = GemmConfig {
            transa: cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N,
            transb: cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N,
            m: n,
            n,
            k: n,
            alpha: bf16::ONE,
            lda: n,
            ldb: n,
            beta: bf16::ZERO,
            ldc: n,
        };
        // SAFETY: the three matrices hold n * n elements each, as the configuration says.
        unsafe { self.blas.gemm(cfg, &self.a, &self.b, &mut self.c) }.map_err(|e| Error::Cuda {
            call: "cublasGemmEx",
            code: e.to_string(),
        })
    }

    /// Floating-point operations of one multiplication (2 n^3).
    pub fn flops(&self) -> f64 {
        2.0 * (self.n as f64).powi(3)
    }
}
