#!/usr/bin/env bash
# DeepEP's own tests against doorbell.deep_ep (issue 27), from a folder outside git.
#
#   scripts/deep-ep-tests.sh DEEPEP_TESTS [LOGDIR]
#
# DEEPEP_TESTS: a folder with DeepEP's tests/legacy files (test_intranode.py,
# test_low_latency.py), fetched at run time (on this machine: `git -C <mirror of
# deepseek-ai/DeepEP> archive HEAD tests/legacy | tar -x -C .gpu-pack/deepep`; .gpu-pack is
# ignored by git and carried to the GPU machine). They are copied to a temporary folder, their
# `deep_ep` imports pointed at `doorbell.deep_ep` (the only change), and run with the packed wheel
# beside the machine's torch. TESTS (default "test_intranode test_low_latency"), NPROC ranks
# (default 2; ranks share GPUs when there are fewer, and init_dist then takes gloo for the
# process group), ARGS added to every test's command line. Logs to LOGDIR (default $OUT, else
# ./deep-ep-logs); exits non-zero when a test fails.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
src=${1:?usage: scripts/deep-ep-tests.sh DEEPEP_TESTS [LOGDIR]}
logs=${2:-${OUT:-$root/deep-ep-logs}}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Emulated nodes (DOORBELL_SEPARATE_NODES=1): the emulated NIC copies on host threads with CUDA
# calls, which a kernel PyTorch loads lazily while doorbell's kernels wait holds back until the
# waits give up; load modules eagerly there unless told otherwise.
if [ "${DOORBELL_SEPARATE_NODES:-0}" = 1 ]; then export CUDA_MODULE_LOADING=${CUDA_MODULE_LOADING:-EAGER}; fi
mkdir -p "$logs"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for f in "$src"/test_*.py; do
  sed -e 's/^import deep_ep$/import doorbell.deep_ep as deep_ep/' \
      -e 's/^from deep_ep\.utils\./from doorbell.deep_ep.utils./' "$f" > "$work/$(basename "$f")"
done
py=${PYTHON:-python3}
"$py" -m pip install -q --no-index --no-deps --target "$work/site" "$root"/.gpu-pack/doorbell-*.whl || exit 1
failed=0
for t in ${TESTS:-test_intranode test_low_latency}; do
  start=$SECONDS
  # shellcheck disable=SC2086
  if (cd "$work" && PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}" timeout "${LIMIT:-560}" \
      "$py" "$t.py" --num-processes "${NPROC:-2}" ${ARGS:-}) > "$logs/$t.log" 2>&1; then
    echo "PASS $t ($((SECONDS - start)) s)" | tee -a "$logs/summary.txt"
  else
    echo "FAIL $t ($((SECONDS - start)) s)" | tee -a "$logs/summary.txt"
    tail -5 "$logs/$t.log"
    failed=1
  fi
done
exit $failed
