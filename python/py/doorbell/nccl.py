"""``libdoorbell_nccl.so``, NCCL's C ABI on doorbell, shipped in this package (docs/nccl.md).

Preload it in place of NCCL so that PyTorch's "nccl" backend (and anything else that calls
NCCL's C functions) runs doorbell's collectives, the rest forwarded to the real NCCL::

    LD_PRELOAD=$(python -m doorbell.nccl) torchrun --nproc-per-node 2 train.py

``python -m doorbell.nccl`` prints the library's path; ``python -m doorbell.nccl --real`` the
path of the NCCL that PyTorch ships, for ``DOORBELL_NCCL_REAL``.
"""

import os
import sys
from typing import List, Optional

LIBRARY = "libdoorbell_nccl.so"


def library() -> str:
    """The path of ``libdoorbell_nccl.so`` in this package. Raises ``FileNotFoundError`` naming
    where it was looked for when this install has none (a build without it)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib", LIBRARY)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path}: this install of doorbell has no {LIBRARY} (scripts/python-wheel.sh build "
            "puts it in the wheel; `cargo build --release -p doorbell-nccl` builds it alone)"
        )
    return path


def torch_nccl() -> Optional[str]:
    """The real ``libnccl.so.2`` that PyTorch's wheel loads (``nvidia/nccl/lib``), or None when
    torch is missing or links NCCL another way."""
    try:
        import torch
    except ImportError:
        return None
    path = os.path.realpath(
        os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "nccl", "lib", "libnccl.so.2")
    )
    return path if os.path.isfile(path) else None


def main(argv: List[str]) -> int:
    if argv[1:] == ["--real"]:
        real = torch_nccl()
        if real is None:
            print("no NCCL found beside torch (set DOORBELL_NCCL_REAL to a libnccl.so.2)", file=sys.stderr)
            return 1
        print(real)
        return 0
    if argv[1:]:
        print("usage: python -m doorbell.nccl [--real]", file=sys.stderr)
        return 2
    try:
        print(library())
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
