#!/usr/bin/env bash
# Regenerates src/host/transport/ib/boundary/sys.rs, doorbell's bindings of rdma-core's
# infiniband/verbs.h and infiniband/mlx5dv.h, with bindgen (tools/verbs-bindgen) from the headers
# installed here (apt install libibverbs-dev; scripts/install-test-deps.sh does).
#
#   scripts/regen-verbs.sh           rewrites sys.rs
#   scripts/regen-verbs.sh --check   regenerates into a temporary file and fails, with the diff
#                                    and the rdma-core versions (found here, recorded in sys.rs),
#                                    if anything would change (CI runs this)
#
# libclang comes from PyPI (the wheel pinned below) into .toolchain/libclang-venv; clang's own
# headers (stddef.h and friends, which the wheel lacks) from the C compiler's include folder.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out="$root/src/host/transport/ib/boundary/sys.rs"
check=0
case "${1:-}" in
  --check) check=1 ;;
  "") ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

if [ ! -f /usr/include/infiniband/mlx5dv.h ]; then
  echo "rdma-core's headers are missing: run scripts/install-test-deps.sh (apt install libibverbs-dev)" >&2
  exit 1
fi
# libibverbs' pkg-config version is ABI.rdma-core (1.14.44.0 is rdma-core 44.0).
found=$(pkg-config --modversion libibverbs 2>/dev/null | cut -d. -f3-)
if [ -z "$found" ]; then
  found=$(dpkg-query -W -f='${Version}' libibverbs-dev 2>/dev/null | cut -d- -f1)
fi
if [ -z "$found" ]; then
  echo "cannot tell which rdma-core is installed (no pkg-config libibverbs, no dpkg libibverbs-dev)" >&2
  exit 1
fi
recorded=$(sed -n 's/.*(rdma-core \([^,]*\),.*/\1/p' "$out" 2>/dev/null | head -n 1 || true)

venv="$root/.toolchain/libclang-venv"
if [ ! -x "$venv/bin/python3" ]; then
  python3 -m venv "$venv"
fi
if ! "$venv/bin/python3" -m pip show -q libclang 2>/dev/null | grep -q '^Version: 18.1.1$'; then
  "$venv/bin/python3" -m pip install -q --disable-pip-version-check libclang==18.1.1
fi
libclang_dir=$(dirname "$(ls "$venv"/lib/python3*/site-packages/clang/native/libclang.so)")
cc_include=$("${CC:-cc}" -print-file-name=include)

# A debug build: it compiles in about half the time of a release one and runs for a second.
target="${CARGO_TARGET_DIR:-$root/target}/tools"
CARGO_TARGET_DIR="$target" cargo build -q --locked \
  --manifest-path "$root/tools/verbs-bindgen/Cargo.toml"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
LIBCLANG_PATH="$libclang_dir" BINDGEN_EXTRA_CLANG_ARGS="-isystem $cc_include" \
  "$target/debug/verbs-bindgen" "$tmp/sys.rs" "$found"

if [ "$check" = 1 ]; then
  if ! diff -u "$out" "$tmp/sys.rs" > "$tmp/diff"; then
    cat "$tmp/diff"
    echo "src/host/transport/ib/boundary/sys.rs is not what scripts/regen-verbs.sh generates" \
      "(rdma-core $found installed, ${recorded:-none} recorded): run scripts/regen-verbs.sh" \
      "and commit the result" >&2
    exit 1
  fi
  echo "sys.rs is up to date (rdma-core $found installed, ${recorded:-none} recorded)"
else
  cp "$tmp/sys.rs" "$out"
  echo "wrote $out (rdma-core $found; was ${recorded:-none})"
fi
