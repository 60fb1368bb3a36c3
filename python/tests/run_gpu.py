"""The GPU tests without pytest (GPU machines may not have it): `python run_gpu.py` runs every
case of ranks.py at DOORBELL_TEST_RANKS rank counts, prints PASS/FAIL lines, exits 1 on any
failure."""

import sys
import time

from ranks import CASES, RANKS, run_ranks


def main() -> int:
    bad = 0
    for n in RANKS:
        for case in CASES:
            start = time.time()
            failed = run_ranks(n, *case)
            took = time.time() - start
            print(f"{'FAIL' if failed else 'PASS'} {' '.join(case)} at {n} ranks ({took:.1f} s)", flush=True)
            for f in failed:
                print(f, flush=True)
            bad += bool(failed)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
