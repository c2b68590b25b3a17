#!/usr/bin/env bash
# Link hygiene: every executable and shared object we build resolves all of its
# symbols (ldd -r reports none undefined), and none depends at load time on
# libibverbs or the CUDA driver: those are dlopen'ed, so the same binaries start
# on machines without an HCA or a GPU. Python extension modules (build/python)
# may leave the interpreter's C API alone undefined: the python that imports
# them defines it.
set -u
build=${1:?usage: check_links.sh BUILD_DIR}
fail=0
checked=0
for f in "$build"/bin/* "$build"/lib/*.so* "$build"/lib/nccl/*.so* "$build"/python/*/*.so; do
  [ -f "$f" ] && [ ! -L "$f" ] || continue
  file -b "$f" 2>/dev/null | grep -q ELF || head -c4 "$f" | grep -q ELF || continue
  checked=$((checked + 1))
  out=$(ldd -r "$f" 2>&1)
  case "$f" in
    "$build"/python/*) out=$(grep -vE 'undefined symbol: _?Py[A-Za-z_]' <<<"$out") ;;
  esac
  if grep -qE 'undefined symbol|not found' <<<"$out"; then
    echo "FAIL $f:"
    grep -E 'undefined symbol|not found' <<<"$out" | sed 's/^/    /'
    fail=1
  fi
  if grep -qE 'libibverbs|libcuda\.so|libnvidia' <<<"$out"; then
    echo "FAIL $f links libibverbs or the CUDA driver at load time (they must be dlopen'ed):"
    grep -E 'libibverbs|libcuda|libnvidia' <<<"$out" | sed 's/^/    /'
    fail=1
  fi
done
if [ "$checked" -eq 0 ]; then
  echo "FAIL: no ELF files found under $build/bin and $build/lib"
  exit 1
fi
echo "checked $checked ELF files: $([ $fail -eq 0 ] && echo 'no undefined symbols' || echo 'problems above')"
exit $fail
