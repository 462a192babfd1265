#!/usr/bin/env bash
# Packs what a GPU run of pagedkv needs onto the lent device machine, which
# has no network and Python 3.12 with torch: MAX and the Mojo compiler, the
# test and serving extras the machine lacks, FlashInfer (its Python package
# and tvm-ffi; its kernels build by JIT there) and SmolLM2's GGUF. One run
# call carries 64 MiB with the tree, so the pack is cut into parts that each
# travel in one call.
#
#   bash tools/device/stage.sh          # in the repository root, here
#   FLASHINFER=0 bash tools/device/stage.sh   # without FlashInfer: one part
#                                       # fewer, and no nvcc builds beside the checks
#   GEMMA=1 bash tools/device/stage.sh  # Gemma 3 270M's GGUF too (five parts
#                                       # more), for checks.sh's gemma-tests
#
# Writes .devstage/p1 .. pN (git-ignored through .git/info/exclude) and prints
# the device calls, in order. The parts' plain tar holds FlashInfer first, so
# the first call can already start FlashInfer's JIT builds in the background
# (tools/device/receive.sh); the last call installs everything.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.devstage
part_mib=${PART_MIB:-58}
py=3.12
platforms=(--platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64
  --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
mkdir -p .git/info
grep -qx "/$out/" .git/info/exclude 2>/dev/null || echo "/$out/" >>.git/info/exclude
rm -rf "$out" && mkdir -p "$out/build"
build=$out/build

install_target() { # DIR REQUIREMENTS... : a site tree for the device's Python
  local dir=$1 log
  shift
  # A requirement with no wheel for these platforms fails the whole install:
  # stop here rather than stage a site that lacks every package.
  if ! log=$(pip install --quiet --no-deps --only-binary=:all: --python-version "$py" \
    --implementation cp "${platforms[@]}" --target "$dir" "$@" 2>&1); then
    echo "$log" >&2
    echo "stage.sh: pip could not stage $* for the device" >&2
    exit 1
  fi
  grep -v '^WARNING' <<<"$log" || true
}

# FlashInfer's Python package and tvm-ffi; its import pulls in every kernel
# family (cuDNN, CUTLASS DSL, ...), so the package's __init__ is cut down
# to the paged-attention entry points the benchmark uses.
sites=(extsite maxsite)
if [ "${FLASHINFER:-1}" != 0 ]; then
  sites=(fisite "${sites[@]}")
  install_target "$build/fisite" "flashinfer-python==0.7.2.post1" "apache-tvm-ffi>=0.1.11,<0.2"
  cat >"$build/fisite/flashinfer/__init__.py" <<'INIT'
# Cut down by pagedkv's tools/device/stage.sh: the paged-attention entry points only.
from .version import __version__ as __version__
from . import jit as jit
from .decode import BatchDecodeWithPagedKVCacheWrapper as BatchDecodeWithPagedKVCacheWrapper
from .mla import BatchMLAPagedAttentionWrapper as BatchMLAPagedAttentionWrapper
from .page import append_paged_kv_cache as append_paged_kv_cache
INIT
fi
# What pagedkv[serve,test] needs beyond the machine's own packages.
install_target "$build/extsite" -r tools/device/requirements.txt
# MAX and the Mojo compiler.
install_target "$build/maxsite" "max==26.7.0" "max-core==26.7.0" "max-mojo-libs==26.7.0" \
  "max-shmem-libs==26.7.0" "mojo-compiler==1.2.0" "mojo-compiler-mojo-libs==1.2.0" \
  msgspec taskgroup exceptiongroup
# The models' GGUFs, from this machine's pagedkv cache (fetched here if absent).
models=(smollm2-135m-instruct)
[ "${GEMMA:-0}" != 0 ] && models+=(gemma3-270m)
for name in "${models[@]}"; do
  gguf=$(python -c "import sys; from pagedkv.models import fetch_gguf; print(fetch_gguf(sys.argv[1]))" "$name")
  rel=$(python -c "import sys; from pathlib import Path; from pagedkv._ops.paths import cache_root; print(Path(sys.argv[1]).relative_to(cache_root()))" "$gguf")
  mkdir -p "$build/model/$(dirname "$rel")"
  cp "$gguf" "$build/model/$rel"
done
# The kernel package, built here: the device then skips `mojo precompile`.
package=$(python -c "from pagedkv._ops.kernels import kernel_package as k; print(k())")
mkdir -p "$build/model/$(basename "$(dirname "$package")")"
cp "$package" "$build/model/$(basename "$(dirname "$package")")/"

for d in "${sites[@]}"; do
  tar -C "$build" -cf - "$d" | xz -T0 -6 >"$build/$d.tar.xz"
done
# FlashInfer first (receive.sh starts its builds as soon as it is complete),
# the model before MAX.
members=("${sites[@]/%/.tar.xz}")
tar -C "$build" -cf "$out/all.tar" "${members[@]:0:${#members[@]}-1}" model maxsite.tar.xz
rm -rf "$build"
split -b "${part_mib}m" -d -a 1 "$out/all.tar" "$out/part-"
rm "$out/all.tar"
n=0
for f in "$out"/part-*; do
  n=$((n + 1))
  mkdir -p "$out/p$n"
  mv "$f" "$out/p$n/"
done
echo "staged $n parts under $out/ ($(du -sh "$out" | cut -f1))"
for i in $(seq 1 "$n"); do
  echo "call $i: carry [\"$out/p$i\"], command: bash tools/device/receive.sh $n"
done
