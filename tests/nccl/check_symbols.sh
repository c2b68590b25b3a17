#!/usr/bin/env bash
# collectived's libnccl.so.2 as a stand-in for NVIDIA's: it defines every
# call of issue L's item 2 and every nccl* symbol that torch's
# libtorch_cuda.so imports (a missing one stops `import torch`), exports
# nothing else, without symbol versions (as NVIDIA's), has the soname
# libnccl.so.2, and needs neither the CUDA driver nor the runtime at load time.
# usage: check_symbols.sh LIBNCCL [LIBTORCH_CUDA]
set -u
lib=${1:?usage: check_symbols.sh LIBNCCL [LIBTORCH_CUDA]}
torch=${2:-}
fail=0
defined=$(nm -D --defined-only "$lib" | awk '{print $3}' | sort -u)
item2="ncclGetUniqueId ncclCommInitRank ncclCommInitAll ncclCommInitRankConfig ncclCommSplit
ncclCommFinalize ncclCommDestroy ncclCommAbort ncclCommGetAsyncError ncclGetLastError
ncclGetErrorString ncclCommCount ncclCommCuDevice ncclCommUserRank ncclGroupStart ncclGroupEnd
ncclAllReduce ncclBroadcast ncclBcast ncclReduce ncclAllGather ncclReduceScatter ncclSend ncclRecv
ncclRedOpCreatePreMulSum ncclRedOpDestroy ncclMemAlloc ncclMemFree ncclGetVersion"
missing() {  # $1: what, rest: names
  local what=$1 n=0; shift
  for s in "$@"; do
    grep -qx "$s" <<<"$defined" || { echo "FAIL $what: $s is not defined by $lib"; fail=1; n=$((n + 1)); }
  done
  echo "$what: $# symbols, $n missing"
}
# shellcheck disable=SC2086
missing "issue L item 2" $item2
if [ -n "$torch" ] && [ -f "$torch" ]; then
  imports=$(nm -D --undefined-only "$torch" | awk '{print $2}' | sed 's/@.*//' | grep '^nccl' | sort -u)
  # shellcheck disable=SC2086
  missing "imports of $(basename "$torch")" $imports
else
  echo "SKIPPED torch's imports: no libtorch_cuda.so (${torch:-none given}); run scripts/torch-venv"
fi
others=$(grep -v '^nccl' <<<"$defined" || true)
if [ -n "$others" ]; then
  echo "FAIL exported symbols other than nccl*:"; sed 's/^/    /' <<<"$others"; fail=1
fi
if nm -D --defined-only --with-symbol-versions "$lib" | awk '{print $3}' | grep -q '@'; then
  echo "FAIL the symbols carry versions (NVIDIA's libnccl.so.2 has none)"; fail=1
fi
readelf -d "$lib" | grep -q 'Library soname: \[libnccl.so.2\]' || { echo "FAIL soname is not libnccl.so.2"; fail=1; }
if readelf -d "$lib" | grep NEEDED | grep -qE 'libcuda\.so|libcudart|libnccl'; then
  echo "FAIL $lib needs the CUDA driver, runtime or another NCCL at load time:"
  readelf -d "$lib" | grep NEEDED | sed 's/^/    /'; fail=1
fi
if ldd -r "$lib" 2>&1 | grep -qE 'undefined symbol|not found'; then
  echo "FAIL unresolved:"; ldd -r "$lib" 2>&1 | grep -E 'undefined symbol|not found' | sed 's/^/    /'; fail=1
fi
echo "$(grep -c . <<<"$defined") symbols exported; $([ $fail -eq 0 ] && echo OK || echo FAILED)"
exit $fail
