#!/usr/bin/env bash
# There (the GPU machine, from the repository root, $OUT set): collectived's
# libnccl.so.2 under MPS on GPU 0, from the folder gpu-carry.sh filled here.
#   tests/nccl/gpu-check.sh tests [CARRY]   nccl_gpu_test with 2, then 3 ranks (RANKS="2 3")
#   tests/nccl/gpu-check.sh perf [CARRY]    the shim's cost per call: collective-perf -g
#       (libcollective's stream calls) and nccl-perf through our libnccl.so.2, 2 ranks,
#       same daemon and sizes; NVIDIA's NCCL (torch's wheel) too where 2 GPUs are
set -u
PART=${1:-tests}
C=$(cd "${2:-build-carry-nccl}" && pwd)
OUT=${OUT:-/tmp/nccl-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=$C/lib/nccl:$C/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export COLLECTIVED_BIN=$C/bin/collectived
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
t() { echo "=== $(date +%T) $*"; }
t "$PART"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d && echo "MPS started"
if [ "$PART" = tests ]; then
  for n in ${RANKS:-2 3}; do
    t "nccl_gpu_test $n"
    timeout 280 "$C/bin/nccl_gpu_test" "$n" > "$OUT/nccl-gpu-$n.log" 2>&1
    echo "rc=$?"
    grep -E "FAIL|checks|passed|FAILED|surfaced|SKIPPED|done \(" "$OUT/nccl-gpu-$n.log" | head -40
  done
else
  sock=/tmp/nccl-perf.sock
  "$C/bin/collectived" --set client.socket=$sock --set client.socket_mode=0666 \
    --set log.level=warn 2> "$OUT/daemon.log" &
  daemon=$!
  for _ in $(seq 100); do [ -S $sock ] && break; sleep 0.1; done
  export COLLECTIVED_SOCKET=$sock
  args=(-t 2 -b 8 -e 64M -f 8 -n 50 -w 10)
  t "collective-perf -g (libcollective's stream calls)"
  timeout 200 "$C/bin/collective-perf" -g "${args[@]}" --op all-reduce 2>&1 | tee "$OUT/capi.txt"
  t "nccl-perf through collectived's libnccl.so.2"
  timeout 200 "$C/bin/nccl-perf" "${args[@]}" --op all-reduce 2>&1 | tee "$OUT/shim.txt"
  kill $daemon; wait $daemon
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    lib=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))')
    t "nccl-perf through NVIDIA's NCCL ($lib), one rank per GPU"
    LD_LIBRARY_PATH=$lib:$C/lib timeout 200 "$C/bin/nccl-perf" "${args[@]}" --op all-reduce 2>&1 |
      tee "$OUT/nccl.txt"
  fi
fi
echo quit | nvidia-cuda-mps-control
t end
