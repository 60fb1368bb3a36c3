"""The GPU tests without pytest (GPU machines may not have it): `python run_gpu.py` runs every
case of ranks.py at DOORBELL_TEST_RANKS rank counts, prints PASS/FAIL lines, exits 1 on any
failure. DOORBELL_TEST_CASES="kill_loop moe" runs only the cases whose name is one of those."""

import os
import sys
import time

from ranks import CASES, RANKS, run_ranks


def main() -> int:
    bad = 0
    only = os.environ.get("DOORBELL_TEST_CASES", "").split()
    cases = [case for case in CASES if not only or case[0] in only]
    if not cases:
        print(f"FAIL no case named {only}", flush=True)
        return 1
    for n in RANKS:
        for case in cases:
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
