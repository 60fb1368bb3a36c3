"""GPU tests (pytest -m gpu python/tests on a GPU machine; DOORBELL_TEST_RANKS="2 4" picks the
rank counts): each case runs gpu_worker.py as several ranks sharing the GPUs (ranks.py)."""

import pytest

from ranks import CASES, RANKS, run_ranks


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_against_torch(case, ranks):
    failed = run_ranks(ranks, *case)
    assert not failed, "\n".join(failed)
