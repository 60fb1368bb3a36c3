#!/usr/bin/env bash
# Pipeline configuration sweep for the allreduce (graph timing only, doorbell only), used to pick
# the library's defaults. Run on the GPU machine after `scripts/gpu-suite.sh build`:
#   scripts/tune-allreduce.sh > tune.txt
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ar=${AR:-.gpu-bundle/examples/allreduce}
for n in ${RANKS:-4 2}; do
  while read -r cfg; do
    echo "## ranks $n: $cfg"
    timeout 120 $ar --nranks "$n" --no-nccl --no-eager --min-bytes 2M --max-bytes 1G --factor 4 $cfg 2>&1 |
      grep -E "^\[rank 0\] +[0-9]" | awk '{print $3, $10, $11}'
  done <<CFGS
${CONFIGS:---lanes 128 --threads 512
--lanes 128 --threads 384
--lanes 64 --threads 512 --tile-kib 64
--lanes 128 --threads 512 --tile-kib 16
--lanes 128 --threads 512 --tile-kib 64
--lanes 96 --threads 512}
CFGS
done
