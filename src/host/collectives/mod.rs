//! Collectives built on the channels: algorithm choice and launch. Kernels live in
//! `cuda/kernels/`; this layer picks one, sizes its launch, and keeps the per-communicator state
//! (scratch buffers, semaphores, per-call epochs in device memory) that makes every call
//! stream-ordered and CUDA-graph safe.

pub mod allgather;
pub mod allreduce;
pub mod alltoall;
pub mod elementwise;
pub mod moe;
pub mod net;
pub mod verify;

/// The name before [`verify`] ("check" now means only the call check).
#[doc(hidden)]
pub use verify as check;

use crate::error::{Error, Result};

/// Element types the collectives reduce or move.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DataType {
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
    /// IEEE single.
    F32,
}

impl DataType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DataType::Bf16 | DataType::F16 => 2,
            DataType::F32 => 4,
        }
    }

    /// The name nccl-tests prints.
    pub fn name(self) -> &'static str {
        match self {
            DataType::Bf16 => "bfloat16",
            DataType::F16 => "half",
            DataType::F32 => "float",
        }
    }

    /// Code shared with the kernels and the argument check.
    pub fn code(self) -> u32 {
        match self {
            DataType::Bf16 => 0,
            DataType::F16 => 1,
            DataType::F32 => 2,
        }
    }

    /// All types, in code order.
    pub const ALL: [DataType; 3] = [DataType::Bf16, DataType::F16, DataType::F32];

    /// The suffix of this type's kernels (`{stem}_bf16`, `_f16`, `_f32`).
    pub(crate) fn kernel_suffix(self) -> &'static str {
        match self {
            DataType::Bf16 => "bf16",
            DataType::F16 => "f16",
            DataType::F32 => "f32",
        }
    }
}

/// Kernel `{stem}_{type}` of `module` for every type, in code order ([`DataType::code`]).
pub(crate) fn kernels_per_type(
    gpu: &crate::gpu::cuda::Gpu,
    module: &str,
    stem: &str,
) -> Result<[cudarc::driver::CudaFunction; 3]> {
    let f = |t: DataType| gpu.function(module, &format!("{stem}_{}", t.kernel_suffix()));
    Ok([f(DataType::Bf16)?, f(DataType::F16)?, f(DataType::F32)?])
}

/// The launch of a kernel that loops over `count` items: one thread an item, 256 a block, at
/// most 1024 blocks.
pub(crate) fn flat_grid(count: u64) -> cudarc::driver::LaunchConfig {
    cudarc::driver::LaunchConfig {
        grid_dim: (count.div_ceil(256).clamp(1, 1024) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl std::str::FromStr for DataType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "bf16" | "bfloat16" => Ok(DataType::Bf16),
            "f16" | "fp16" | "half" => Ok(DataType::F16),
            "f32" | "fp32" | "float" => Ok(DataType::F32),
            other => Err(Error::invalid(
                "dtype",
                format!("{other:?}: expected bf16, f16 or f32"),
            )),
        }
    }
}

/// Reduction operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Elementwise sum.
    Sum,
}

impl ReduceOp {
    /// The name nccl-tests prints.
    pub fn name(self) -> &'static str {
        "sum"
    }
    /// Code shared with the argument check.
    pub fn code(self) -> u32 {
        0
    }
}

/// The first rank whose shape differs from `me`'s, as the error every rank returns.
pub(crate) fn shape_mismatch(me: usize, shapes: &[Vec<u8>]) -> Option<Error> {
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    let peer = (0..shapes.len()).find(|&r| shapes[r] != shapes[me])?;
    Some(Error::ArgumentMismatch {
        rank: me,
        mine: text(&shapes[me]),
        peer,
        theirs: text(&shapes[peer]),
    })
}

/// Every rank builds the same collective object (collective: one all-gather of `mine`, the
/// object's shape in words): a rank whose shape differs is named on every rank with both shapes.
/// The call check of a collective whose words travel over its channels (across nodes, or the
/// copy-engine ring) instead of into mapped inboxes: counts calls into the communicator's goodbye
/// count; off with `DOORBELL_CALL_CHECK=0`.
pub(crate) fn channel_call_checker(
    comm: &crate::communicator::Communicator,
) -> Result<crate::gpu::signature::CallChecker> {
    Ok(crate::gpu::signature::CallChecker::new(
        [0; crate::device_api::MAX_RANKS],
        comm.settings().call_check,
        comm.bootstrap().call_counter(),
    ))
}

pub(crate) fn agree(comm: &crate::communicator::Communicator, mine: String) -> Result<()> {
    let shapes = comm.bootstrap().all_gather(mine.as_bytes())?;
    shape_mismatch(comm.rank(), &shapes).map_or(Ok(()), Err)
}
