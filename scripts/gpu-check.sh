#!/usr/bin/env bash
# The whole GPU check of a change in one device call on a 4-GPU kind (nvidia-h100-x4), a GPU per
# rank: the performance check first with nothing beside it (its eager MoE rows are bound by the
# host's launch time, which other processes slow), the NCCL ABI's overhead alone too (host time),
# and, when .gpu-pack/old/ (or old.txz) holds an earlier build's allreduce, alltoall and moe examples,
# scripts/perf-ab.sh between those and this bundle's (doorbell alone, alternating); then two lanes
# side by side:
#   GPUs 0,1: every test binary at 2 ranks, then SUITE=nccl at 2 and 4 ranks (4 sharing 2 GPUs)
#   GPUs 2,3: the Python GPU suite, DeepEP's own tests at 2 ranks (when .gpu-pack/deepep holds
#             them), the examples, DeepEP's test_intranode at 2 ranks sharing one GPU, and
#             `torchrun -m doorbell.bench deep_ep` (the DeepEP API against doorbell's own calls)
# Build and pack first (scripts/python-wheel.sh build && scripts/gpu-suite.sh build; for DeepEP's
# tests: git -C <mirror of deepseek-ai/DeepEP> archive HEAD tests/legacy | tar -x -C
# .gpu-pack/deepep), carry .gpu-pack, then, from the repository root:
#
#   scripts/gpu-check.sh [LOGDIR]
#
# LOGDIR (default $OUT, else ./gpu-logs) gets steps.txt (a line as each part starts and ends,
# with its summary) and a folder per part; logs.tgz is rewritten every 20 s, so a call that runs
# out of time still brings back what was done. With two GPUs (nvidia-h100-x2) the lanes run one
# after the other on both. Exits non-zero when a part failed.
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
logs=${1:-${OUT:-$root/gpu-logs}}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$logs/l"
cd "$root" || exit 1
t0=$SECONDS
step() { echo "$(date +%T) +$((SECONDS - t0))s $*" >> "$logs/steps.txt"; }
(while sleep 20; do
  tar -C "$logs" -czf "$logs/logs.tgz.tmp" l 2> /dev/null && mv "$logs/logs.tgz.tmp" "$logs/logs.tgz"
done) &
tarpid=$!
if [ -f .gpu-pack/bundle.txz ] && [ ! -d .gpu-bundle ]; then tar -xJf .gpu-pack/bundle.txz; fi
# An earlier build's examples for scripts/perf-ab.sh: .gpu-pack/old.txz holds old/{allreduce,
# alltoall,moe,COMMIT} (tar -cf - old | xz > .gpu-pack/old.txz).
if [ -f .gpu-pack/old.txz ] && [ ! -d .gpu-pack/old ]; then tar -C .gpu-pack -xJf .gpu-pack/old.txz; fi
gpus=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU')
step "bundle $(cat .gpu-bundle/COMMIT 2> /dev/null) on $gpus GPU(s)"
failed=0

suite() { # NAME GPUS ENV...: scripts/gpu-suite.sh run into l/NAME
  local name=$1 visible=$2 rc
  shift 2
  mkdir -p "$logs/l/$name"
  step "start $name"
  env CUDA_VISIBLE_DEVICES="$visible" "$@" scripts/gpu-suite.sh run "$logs/l/$name" > "$logs/l/$name/out.txt" 2>&1
  rc=$?
  [ $rc = 0 ] || failed=1
  step "end $name rc=$rc :: $(tr '\n' ';' < "$logs/l/$name/summary.txt" | cut -c1-700)"
  return $rc
}

deepep() { # NAME GPUS ENV...: DeepEP's tests (scripts/deep-ep-tests.sh) into l/NAME
  local name=$1 visible=$2 rc
  shift 2
  [ -d .gpu-pack/deepep/tests/legacy ] || { step "skip $name: no .gpu-pack/deepep/tests/legacy"; return 0; }
  mkdir -p "$logs/l/$name"
  step "start $name"
  env CUDA_VISIBLE_DEVICES="$visible" "$@" scripts/deep-ep-tests.sh .gpu-pack/deepep/tests/legacy "$logs/l/$name" \
    > "$logs/l/$name/out.txt" 2>&1
  rc=$?
  [ $rc = 0 ] || failed=1
  step "end $name rc=$rc :: $(tr '\n' ';' < "$logs/l/$name/summary.txt" 2> /dev/null)"
  return $rc
}

bench_deep_ep() { # GPUS: torchrun -m doorbell.bench deep_ep (2 ranks, the packed wheel) into l/bench_deep_ep
  local visible=$1 site="$logs/l/bench_deep_ep/.site" rc
  mkdir -p "$logs/l/bench_deep_ep"
  step "start bench_deep_ep"
  python3 -m pip install -q --no-index --no-deps --target "$site" .gpu-pack/doorbell-*.whl > /dev/null 2>&1
  CUDA_VISIBLE_DEVICES="$visible" PYTHONPATH="$site" timeout 300 python3 -m torch.distributed.run \
    --nproc-per-node 2 -m doorbell.bench deep_ep > "$logs/l/bench_deep_ep/out.txt" 2>&1
  rc=$?
  [ $rc = 0 ] || failed=1
  rm -rf "$site"
  step "end bench_deep_ep rc=$rc :: $(grep -E '^ +(normal|\.\.\.)' "$logs/l/bench_deep_ep/out.txt" | tr -s ' ' | tr '\n' ';')"
  return $rc
}

lane_a() {
  suite tests "$1" DOORBELL_TEST_RANKS=2 SUITE=tests
  suite nccl "$1" DOORBELL_TEST_RANKS="2 4" SUITE=nccl NCCL_OVERHEAD=0
}

ab() { # GPUS: scripts/perf-ab.sh .gpu-pack/old this bundle's examples, into l/ab
  local visible=$1 rc old=.gpu-pack/old
  [ -x "$old/moe" ] || { step "skip ab: no earlier build in $old"; return 0; }
  mkdir -p "$logs/l"
  step "start ab ($(cat "$old/COMMIT" 2> /dev/null) against $(cat .gpu-bundle/COMMIT 2> /dev/null))"
  CUDA_VISIBLE_DEVICES="$visible" scripts/perf-ab.sh "$old" .gpu-bundle/examples "${AB_ROUNDS:-2}" "$logs/l" \
    > "$logs/l/ab-out.txt" 2>&1
  rc=$?
  [ $rc = 0 ] || failed=1
  step "end ab rc=$rc :: $(tail -1 "$logs/l/ab/ab.md" 2> /dev/null)"
  return $rc
}
lane_b() {
  suite python "$1" DOORBELL_TEST_RANKS=2 SUITE=python
  deepep deepep "$1" NPROC=2
  suite bench "$1" SUITE=bench
  deepep deepep_shared "${1%%,*}" NPROC=2 TESTS=test_intranode
  bench_deep_ep "$1"
}

if [ "$gpus" -lt 2 ]; then
  step "FAIL: $gpus GPU(s); the check needs a GPU per rank (two or more)"
  failed=1
else
  suite perf 0,1 SUITE=perf
  suite nccl_overhead 0,1 SUITE=nccl NCCL_OVERHEAD=only
  ab 0,1
  if [ "$gpus" -ge 4 ]; then
    # Lanes in subshells: each reports its failures through its exit status.
    (failed=0; lane_a 0,1; exit $failed) &
    a=$!
    (failed=0; lane_b 2,3; exit $failed) &
    b=$!
    wait $a || failed=1
    wait $b || failed=1
  else
    lane_a 0,1
    lane_b 0,1
  fi
fi
kill $tarpid 2> /dev/null
tar -C "$logs" -czf "$logs/logs.tgz" l
step "done: $([ $failed = 0 ] && echo PASS || echo FAIL)"
exit $failed
