"""DeepEP's V1 API (``deep_ep.Buffer``, DeepEP's ``deep_ep/buffers/legacy.py``) on doorbell.

Code written for DeepEP switches by its import::

    import doorbell.deep_ep as deep_ep

``Buffer``, ``Config``, ``EventOverlap`` and ``topk_idx_t`` keep DeepEP's names, arguments,
shapes, dtypes, handles and stream rules. Work in progress (issue 27): ``docs/deep_ep.md`` lists
every feature and where it stands; a call that needs a feature not built yet raises
``NotImplementedError`` naming it, never a result of other semantics.

``doorbell.deep_ep.utils`` holds the helpers DeepEP's tests import from ``deep_ep.utils``
(``envs.init_dist``, ``math``, ``testing``), written for doorbell with the same meaning.
"""

from __future__ import annotations

from typing import Any

from ._buffer import Buffer, Config, EventOverlap

__all__ = ["Buffer", "Config", "EventOverlap", "topk_idx_t"]


def __getattr__(name: str) -> Any:
    # torch is imported on first use only: the package imports without it (CPU CI).
    if name == "topk_idx_t":
        import torch

        return torch.int64
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
