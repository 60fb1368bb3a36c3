#!/usr/bin/env bash
# Installs what the CPU tests need besides Rust and the nvcc wheels: rdma-core's headers
# (tests/wqe_golden.rs compiles a C program against infiniband/mlx5dv.h; nothing is linked), which
# scripts/regen-verbs.sh --check also reads (it installs its own libclang from PyPI).
set -euo pipefail
if [ -f /usr/include/infiniband/mlx5dv.h ]; then
  echo "rdma-core headers present"
  exit 0
fi
sudo=""
if [ "$(id -u)" != 0 ]; then
  sudo=sudo
fi
$sudo apt-get update -q
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q libibverbs-dev
echo "rdma-core headers installed"
