#!/usr/bin/env bash
# Doorbell's own timings in two builds on one machine, alternating, so that "no slower than
# before" is measured in one run rather than against a table recorded on another day:
#
#   scripts/perf-ab.sh OLD_EXAMPLES NEW_EXAMPLES [ROUNDS] [LOGDIR]
#
# OLD_EXAMPLES and NEW_EXAMPLES are folders holding the `allreduce`, `alltoall` and `moe` examples
# of each build (release; the new one is usually .gpu-bundle/examples). Each round runs the three
# from the old folder, then from the new one (--no-nccl: doorbell alone; allreduce on registered
# windows as in the performance check), on the visible GPUs, a rank per GPU. ROUNDS defaults to 2.
# LOGDIR (default $OUT, else ./gpu-logs) gets the CSVs and ab.md: per collective and size, the
# median over rounds of each build's mean time per call (graph and eager, max over ranks) and
# new / old. Exits non-zero if a run fails; the ratios are for the reader (and docs/performance.md)
# to judge, next to the spread between rounds of one build that the table also shows.
set -u
old=$1 new=$2 rounds=${3:-2}
logs=${4:-${OUT:-gpu-logs}}/ab
mkdir -p "$logs"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
failed=0
run() { # BUILD-NAME FOLDER ROUND
  local name=$1 dir=$2 r=$3
  timeout 300 "$dir/allreduce" --windows --no-nccl --min-bytes 8 --max-bytes 256M --factor 8 \
    --csv "$logs/$name-allreduce-$r.csv" > "$logs/$name-allreduce-$r.txt" 2>&1 || failed=1
  timeout 300 "$dir/alltoall" --no-nccl --min-bytes 1K --max-bytes 256M --factor 8 \
    --csv "$logs/$name-alltoall-$r.csv" > "$logs/$name-alltoall-$r.txt" 2>&1 || failed=1
  timeout 300 "$dir/moe" --no-nccl --csv "$logs/$name-moe-$r.csv" > "$logs/$name-moe-$r.txt" 2>&1 || failed=1
}
for r in $(seq 1 "$rounds"); do
  run old "$old" "$r"
  run new "$new" "$r"
done
python3 - "$logs" "$rounds" > "$logs/ab.md" << 'EOF'
import csv, glob, os, statistics, sys
logs, rounds = sys.argv[1], int(sys.argv[2])
rows = {}  # (collective, bytes) -> build -> column -> [values per round]
for path in glob.glob(os.path.join(logs, "*.csv")):
    build = os.path.basename(path).split("-")[0]
    with open(path) as f:
        for row in csv.DictReader(f):
            if row["library"] != "doorbell":
                continue
            key = (row["collective"], int(row["bytes"]))
            for col in ("graph_us", "eager_us"):
                try:
                    v = float(row[col])
                except (KeyError, ValueError):
                    continue
                rows.setdefault(key, {}).setdefault(build, {}).setdefault(col, []).append(v)
def size(b):
    for unit, n in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if b >= n and b % n == 0:
            return f"{b // n}{unit}"
    return str(b)
print(f"doorbell alone, old and new build alternating, {rounds} rounds each; us per call = median over")
print("rounds of each run's mean (max over ranks); min-max over rounds in brackets\n")
print("| collective | size | graph old | graph new | new/old | eager old | eager new | new/old |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
worst = []
for (c, b) in sorted(rows):
    cells = [c, size(b)]
    for col in ("graph_us", "eager_us"):
        o = rows[(c, b)].get("old", {}).get(col, [])
        n = rows[(c, b)].get("new", {}).get(col, [])
        if not o or not n:
            cells += ["-", "-", "-"]
            continue
        mo, mn = statistics.median(o), statistics.median(n)
        cells += [f"{mo:.2f} [{min(o):.2f}-{max(o):.2f}]", f"{mn:.2f} [{min(n):.2f}-{max(n):.2f}]", f"{mn / mo:.3f}"]
        worst.append((mn / mo, c, size(b), col))
    print("| " + " | ".join(cells) + " |")
if worst:
    worst.sort(reverse=True)
    r, c, s, col = worst[0]
    print(f"\nlargest new/old: {r:.3f} ({c} {s} {col.split('_')[0]}); smallest: {worst[-1][0]:.3f}")
EOF
cat "$logs/ab.md"
exit $failed
