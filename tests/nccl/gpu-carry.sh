#!/usr/bin/env bash
# Here, after building nccl_shim nccl_gpu_test nccl-perf collective-perf collectived:
# fills CARRY (default build-carry-nccl/, git-ignored) with what gpu-check.sh runs
# on the GPU machine: stripped binaries, lib/nccl/libnccl.so.2, and the Debian
# libraries that machine lacks (libcapnp, libkj, libyaml-cpp; ../shared/GPU-NOTES.md).
#   tests/nccl/gpu-carry.sh [CARRY]
set -eu
B=${BUILD_DIR:-build}
C=${1:-build-carry-nccl}
rm -rf "$C"
mkdir -p "$C/bin" "$C/lib/nccl"
for b in collectived nccl_gpu_test nccl-perf collective-perf; do strip -o "$C/bin/$b" "$B/bin/$b"; done
strip -o "$C/lib/nccl/libnccl.so.2" "$B/lib/nccl/libnccl.so.2"
for l in libcapnp-0.9.2.so libkj-0.9.2.so libyaml-cpp.so.0.7; do
  cp -L "/lib/x86_64-linux-gnu/$l" "$C/lib/"
done
du -sh "$C"
