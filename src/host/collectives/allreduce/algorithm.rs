//! The allreduce's algorithms and the measured choice between them, its options, and the plan
//! of one call.

use crate::collectives::DataType;
use crate::error::{Error, Result};
use cudarc::driver::DeviceRepr;

/// Tiles each pipeline lane aims for: one, while the tile cap allows (the whole block then works
/// on each stage in turn); larger messages get several capped tiles per lane, whose stages
/// overlap from the third tile on (measured: smaller tiles to force overlap lose at 2-16 MiB).
pub(super) const TILES_PER_LANE: usize = 1;

/// An allreduce algorithm.
/// `#[non_exhaustive]`: algorithms are added as they are measured (`TwoShotDirect` was).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Algorithm {
    /// One-shot, LL8 packets (4 payload bytes per 8-byte packet).
    OneShotLl8,
    /// One-shot, LL16 packets (8 payload bytes per 16-byte packet).
    OneShotLl16,
    /// Two-shot (reduce-scatter + all-gather), LL8 packets.
    TwoShotLl8,
    /// Two-shot, LL16 packets.
    TwoShotLl16,
    /// Two-shot over sentinel-filled buffers: no flags, full payload per byte. Needs 16-byte
    /// aligned buffers and a multiple of 16 bytes; other calls fall back to [`Algorithm::TwoShotLl16`].
    TwoShotSentinel,
    /// Pipelined reduce-scatter + all-gather through scratch, with semaphores.
    Pipelined,
    /// Two-shot straight between registered windows ([`super::AllReduce::register_window`]): each
    /// rank reads every peer's input and writes every peer's output over NVLink, nothing staged.
    /// Calls whose buffers are not in windows fall back to [`Algorithm::Pipelined`].
    TwoShotDirect,
}

impl Algorithm {
    /// Every algorithm.
    pub const ALL: [Algorithm; 7] = [
        Algorithm::OneShotLl8,
        Algorithm::OneShotLl16,
        Algorithm::TwoShotLl8,
        Algorithm::TwoShotLl16,
        Algorithm::TwoShotSentinel,
        Algorithm::Pipelined,
        Algorithm::TwoShotDirect,
    ];

    /// The code call words carry (its index in [`Algorithm::ALL`]).
    pub fn code(self) -> u32 {
        Algorithm::ALL.iter().position(|&a| a == self).unwrap_or(15) as u32
    }

    /// The name used in settings, options and tables.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::OneShotLl8 => "oneshot-ll8",
            Algorithm::OneShotLl16 => "oneshot-ll16",
            Algorithm::TwoShotLl8 => "twoshot-ll8",
            Algorithm::TwoShotLl16 => "twoshot-ll16",
            Algorithm::TwoShotSentinel => "twoshot-sentinel",
            Algorithm::Pipelined => "pipelined",
            Algorithm::TwoShotDirect => "twoshot-direct",
        }
    }

    pub(super) fn kernel_stem(self) -> &'static str {
        match self {
            Algorithm::OneShotLl8 => "allreduce_oneshot_ll8",
            Algorithm::OneShotLl16 => "allreduce_oneshot_ll16",
            Algorithm::TwoShotLl8 => "allreduce_twoshot_ll8",
            Algorithm::TwoShotLl16 => "allreduce_twoshot_ll16",
            Algorithm::TwoShotSentinel => "allreduce_twoshot_sentinel",
            Algorithm::Pipelined => "allreduce_pipelined",
            Algorithm::TwoShotDirect => "allreduce_twoshot_direct",
        }
    }

    /// Packet size for the LL algorithms.
    pub(super) fn packet(self) -> Option<(usize, usize)> {
        // (packet bytes, payload bytes)
        match self {
            Algorithm::OneShotLl8 | Algorithm::TwoShotLl8 => Some((8, 4)),
            Algorithm::OneShotLl16 | Algorithm::TwoShotLl16 => Some((16, 8)),
            Algorithm::TwoShotSentinel | Algorithm::Pipelined | Algorithm::TwoShotDirect => None,
        }
    }

    /// The choice for `bytes` on `world` ranks of one node, from forced-algorithm sweeps on
    /// 4 x H200 (docs/performance.md, "Choosing the algorithms"): one-shot while the message is
    /// small (to 256 KiB on 2 GPUs, 64 KiB on 4), then the LL two-shot (4 GPUs, to 256 KiB),
    /// the sentinel two-shot (to 4 MiB on 2 GPUs, 2 MiB on 4), the pipeline above. 3 ranks take
    /// the 4-rank table; 5 to 8 ranks a guess (smaller one-shot range, as its traffic grows with
    /// the rank count) not yet measured on 8 GPUs.
    pub fn choose(world: usize, bytes: usize) -> Algorithm {
        let (oneshot_max, ll_twoshot_max, sentinel_max) = match world {
            0..=2 => (256 << 10, 256 << 10, 4 << 20),
            3..=4 => (64 << 10, 256 << 10, 2 << 20),
            _ => (32 << 10, 256 << 10, 4 << 20),
        };
        if bytes <= oneshot_max {
            Algorithm::OneShotLl16
        } else if bytes <= ll_twoshot_max {
            Algorithm::TwoShotLl16
        } else if bytes <= sentinel_max {
            Algorithm::TwoShotSentinel
        } else {
            Algorithm::Pipelined
        }
    }
}

impl Algorithm {
    /// The choice when both buffers lie in registered windows: [`Algorithm::TwoShotDirect`]
    /// where the staged choice is the pipeline (above 4 MiB on 2 ranks). On 2 x H100 it beat
    /// torch symmetric memory's two-shot from 8 MiB to 256 MiB (32.9 against 34.3 us at 8 MiB);
    /// below, its two handshakes cost more than the LL and sentinel kernels' staging (1 MiB:
    /// 10.7 us against the sentinel two-shot's 9.1; 4 MiB: 20.5 against 17.9).
    pub fn choose_registered(world: usize, bytes: usize) -> Algorithm {
        match Algorithm::choose(world, bytes) {
            Algorithm::Pipelined => Algorithm::TwoShotDirect,
            staged => staged,
        }
    }
}

impl std::str::FromStr for Algorithm {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Algorithm::ALL
            .into_iter()
            .find(|a| a.name() == s.trim())
            .ok_or_else(|| {
                Error::invalid(
                    "allreduce algorithm",
                    format!(
                        "{s:?}: expected one of {}",
                        Algorithm::ALL.map(|a| a.name()).join(", ")
                    ),
                )
            })
    }
}

/// Element types the allreduce takes through the typed API.
pub trait Element: DeviceRepr + Copy {
    /// Its [`DataType`].
    const DTYPE: DataType;
}

impl Element for half::bf16 {
    const DTYPE: DataType = DataType::Bf16;
}
impl Element for half::f16 {
    const DTYPE: DataType = DataType::F16;
}
impl Element for f32 {
    const DTYPE: DataType = DataType::F32;
}

/// Knobs of an [`super::AllReduce`]. The defaults are what the measurements chose.
#[derive(Debug, Clone)]
pub struct AllReduceOptions {
    /// Always use this algorithm (else `DOORBELL_ALLREDUCE_ALGO`, else [`Algorithm::choose`]).
    pub algorithm: Option<Algorithm>,
    /// Verify argument agreement on every call (else `DOORBELL_HOST_CALL_CHECK`).
    pub check_args: Option<bool>,
    /// Bytes of one sender's slot in the LL scratch areas (bounds the LL algorithms' sizes).
    pub ll_slot_bytes: usize,
    /// Bytes of one sender's slot in the sentinel two-shot's buffers (its largest message is
    /// world size x this; the region takes 3 x 2 x world x this).
    pub sentinel_slot_bytes: usize,
    /// Blocks of every LL launch (fixed per communicator: packet i always belongs to the same
    /// block, which is what lets each block keep its own epoch); capped by the number of SMs.
    pub ll_blocks: u32,
    /// Threads per block of the LL kernels.
    pub ll_threads: u32,
    /// Most pipeline lanes (blocks); capped by the number of SMs.
    pub max_lanes: u32,
    /// Scratch for the pipeline ring, all lanes together; sets the largest tile shard.
    pub pipeline_scratch_bytes: usize,
    /// Largest shard of one pipeline tile, bytes (a multiple of 16); `None`: what
    /// `pipeline_scratch_bytes` allows, at most 256 KiB.
    pub max_tile_bytes: Option<usize>,
    /// Smallest shard of one pipeline tile, bytes (a multiple of 16).
    pub min_tile_bytes: usize,
    /// Threads per block of the pipelined kernel.
    pub pipeline_threads: u32,
}

impl Default for AllReduceOptions {
    fn default() -> Self {
        AllReduceOptions {
            algorithm: None,
            check_args: None,
            ll_slot_bytes: 1 << 20,
            sentinel_slot_bytes: 2 << 20,
            ll_blocks: 64,
            ll_threads: 512,
            max_lanes: 128,
            pipeline_scratch_bytes: 96 << 20,
            max_tile_bytes: None,
            min_tile_bytes: 4 << 10,
            pipeline_threads: 512,
        }
    }
}

/// How one call will run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    /// The algorithm.
    pub algorithm: Algorithm,
    /// Blocks launched.
    pub blocks: u32,
    /// Threads per block.
    pub threads: u32,
    /// Pipeline: elements per shard of a tile (0 for LL algorithms).
    pub tile_elems: u64,
}
