#!/usr/bin/env bash
# Shares a list of GPU test jobs out over every GPU of the machine: a worker per GPU takes the
# next job that still fits before the deadline, runs it with `scripts/gpu-suite.sh run` on its
# own GPU (ranks sharing that GPU), and records the outcome. The way to run the suite at several
# rank counts, the allreduce matrix split by algorithm, and soaks side by side in one device call.
#
#   scripts/gpu-jobs.sh JOBS [LOGDIR]
#
# JOBS: one job per line, `NAME EST RANKS TESTS [ALGORITHMS...]`, `#` starts a comment.
#   NAME        the job's log folder under LOGDIR (unique)
#   EST         seconds it is expected to take: a worker takes it only while that much is left
#   RANKS       DOORBELL_TEST_RANKS for it (ranks sharing the worker's GPU)
#   TESTS       test binaries (comma-separated), `all`, or `all-but-X` (every binary but X);
#               `BINARY:FILTER` runs one binary's tests whose names contain FILTER; `python`
#               runs the Python GPU suite (SUITE=python: the wheel the bundle's build packed)
#   ALGORITHMS  for the allreduce matrix: runs only `every_algorithm` with
#               DOORBELL_TEST_ALGORITHMS set to them; without, the matrix is skipped
# DEADLINE: seconds from the start after which no job starts and running ones are stopped
# (default 520, for a 600 s device call). JOB_GPUS: the GPUs to use (default every one).
# LOGDIR (default $OUT, else ./gpu-logs) gets steps.txt (a line per job: GPU, exit, seconds,
# binaries passed and failed; NOT RUN for jobs that found no time) and a folder per job.
# Lists used so far: scripts/jobs/*.txt.
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
jobs=${1:?usage: scripts/gpu-jobs.sh JOBS [LOGDIR]}
logs=${2:-${OUT:-$root/gpu-logs}}
deadline=${DEADLINE:-520}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$logs/.claims"
if [ -f "$root/.gpu-pack/bundle.txz" ] && [ ! -d "$root/.gpu-bundle" ]; then
  tar -C "$root" -xJf "$root/.gpu-pack/bundle.txz"
fi
every=$(ls "$root/.gpu-bundle/tests" | tr '\n' ' ')
count=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
gpus=${JOB_GPUS:-$(seq 0 $((count - 1)))}
[ -n "$gpus" ] || { echo "gpu-jobs: no GPU" >&2; exit 1; }

worker() {
  local g=$1 i=0 name est ranks tests algos left start rc filter but suite
  while read -r name est ranks tests algos; do
    i=$((i + 1))
    [ -z "$name" ] || [ "${name#\#}" != "$name" ] && continue
    left=$((deadline - SECONDS))
    [ "$left" -lt "$est" ] && continue
    mkdir "$logs/.claims/$i" 2>/dev/null || continue
    suite=tests
    case $tests in
      python) suite=python ;;
      all) tests=$every ;;
      all-but-*) but=${tests#all-but-}; tests=" $every "; tests=${tests/ $but / } ;;
      *) tests=${tests//,/ } ;;
    esac
    filter="--skip every_algorithm"
    [ -n "$algos" ] && filter="every_algorithm"
    case $tests in *:*) filter=${tests#*:}; tests=${tests%%:*} ;; esac
    start=$SECONDS
    CUDA_VISIBLE_DEVICES=$g DOORBELL_TEST_RANKS=$ranks SUITE=$suite TESTS="$tests" TEST_ARGS="$filter" \
      DOORBELL_TEST_ALGORITHMS="$algos" timeout "$left" "$root/scripts/gpu-suite.sh" run "$logs/$name" \
      > "$logs/$name.out" 2>&1
    rc=$?
    echo "$name gpu$g rc=$rc $((SECONDS - start))s $(grep -c '^PASS' "$logs/$name/summary.txt") pass" \
      "$(grep -c '^FAIL' "$logs/$name/summary.txt") fail" >> "$logs/steps.txt"
  done < "$jobs"
}

for g in $gpus; do worker "$g" & done
wait
i=0
while read -r name est ranks tests algos; do
  i=$((i + 1))
  [ -z "$name" ] || [ "${name#\#}" != "$name" ] && continue
  [ -d "$logs/.claims/$i" ] || echo "NOT RUN $name" >> "$logs/steps.txt"
done < "$jobs"
rm -rf "$logs/.claims"
cat "$logs/steps.txt"
! grep -q -E " rc=[1-9]|^NOT RUN" "$logs/steps.txt"
