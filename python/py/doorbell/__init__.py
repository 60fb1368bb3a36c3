"""doorbell: GPU-initiated communication for PyTorch.

``doorbell.init()`` joins the job (torchrun/srun/mpirun variables, or an existing
``torch.distributed`` group) and returns a :class:`Communicator` whose ``all_reduce``,
``all_to_all`` and ``all_to_all_v`` take torch tensors on PyTorch's current stream;
``doorbell.moe.Buffer`` is MoE dispatch/combine with DeepEP's names. Importing needs no GPU; the
calls raise :class:`NoGpuError` without one. The core is the Rust crate of the same name, loaded
as ``doorbell._doorbell``; the CUDA driver (and for benchmarks NCCL) are loaded at run time.
``doorbell.nccl.library()`` is the path of ``libdoorbell_nccl.so``, NCCL's C ABI on doorbell, to
preload under PyTorch's "nccl" backend.
"""

from . import moe, nccl
from ._comm import Communicator, MemoryChannels, SymmetricMemory, Work, get_include, init
from ._doorbell import DoorbellError, NoGpuError, cuda_driver_present, device_count
from ._doorbell import version as _version

__version__: str = _version()

__all__ = [
    "Communicator",
    "MemoryChannels",
    "SymmetricMemory",
    "DoorbellError",
    "NoGpuError",
    "Work",
    "cuda_driver_present",
    "device_count",
    "get_include",
    "init",
    "moe",
    "nccl",
]
