#!/usr/bin/env bash
# doorbell's Python package: builds the wheel and runs its CPU tests in a fresh venv.
#
#   scripts/python-wheel.sh build   the abi3 wheel (CPython 3.9+, x86-64 Linux) into python/dist/,
#                                   linked by zig against glibc 2.28 (manylinux_2_28: Ubuntu 20.04+,
#                                   RHEL 8+), so the build host's glibc does not leak in
#   scripts/python-wheel.sh test    installs python/dist's wheel in a fresh venv with pytest and
#                                   mypy, checks the package's types (--strict, as Python 3.9)
#                                   and runs the CPU suite (python/tests, GPU tests deselected)
#   scripts/python-wheel.sh         both
#
# Needs what the Rust build needs (scripts/install-nvcc.sh) and Python 3 with venv; maturin and
# zig come from PyPI (pinned below) into .toolchain/py-build.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tools="$root/.toolchain/py-build"

build() {
  if [ ! -x "$tools/bin/maturin" ]; then
    python3 -m venv "$tools"
    "$tools/bin/pip" install -q --disable-pip-version-check maturin==1.9.6 ziglang==0.13.0
  fi
  rm -rf "$root/python/dist"
  # libdoorbell_nccl.so (NCCL's C ABI on doorbell) ships in the package: doorbell.nccl.library().
  # It is linked against this machine's glibc, not manylinux's.
  (cd "$root" && cargo build --release -p doorbell-nccl)
  mkdir -p "$root/python/py/doorbell/lib"
  cp "$root/target/release/libdoorbell_nccl.so" "$root/python/py/doorbell/lib/"
  (cd "$root/python" && PATH="$tools/bin:$PATH" maturin build --release --zig \
    --compatibility manylinux_2_28 --out dist --interpreter python3)
  ls -la "$root/python/dist"
}

test_wheel() {
  local venv
  venv=$(mktemp -d)/venv
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check pytest==8.3.3 mypy==1.13.0 "$root"/python/dist/doorbell-*.whl
  # The package's types, as Python 3.9 reads them (the stubs of the extension included).
  (cd "$root/python/py" && "$venv/bin/mypy" --python-version 3.9 --strict --ignore-missing-imports doorbell)
  # From outside the source tree, so the installed wheel is what gets imported.
  (cd "$(dirname "$venv")" && "$venv/bin/python" -m pytest -q -m "not gpu" "$root/python/tests")
}

case "${1:-all}" in
  build) build ;;
  test) test_wheel ;;
  all) build; test_wheel ;;
  *) echo "usage: $0 [build|test]" >&2; exit 2 ;;
esac
