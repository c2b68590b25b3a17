#!/bin/sh
# The include check (cmake/Layering.cmake): it passes on the tree, and it fails,
# naming the file and the part, on a copy of the tree with one forbidden
# include planted (a transport that includes the engine).
#   check_layering.sh <source root> <build dir>
set -eu
root=$1
table=$2/layering.txt
check() { cmake -DTABLE="$table" -DROOT="$1" -P "$root/cmake/check_layering.cmake" 2>&1; }

out=$(check "$root") || { echo "$out"; echo "FAIL: the tree breaks its own layering"; exit 1; }
echo "$out"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for d in ipc config engine daemon client; do cp -r "$root/$d" "$tmp/$d"; done
planted=engine/transport/tcp/pair.h
printf '#include "engine/engine.h"\n' >> "$tmp/$planted"
if out=$(check "$tmp"); then
  echo "$out"
  echo "FAIL: a forbidden include in $planted was not caught"
  exit 1
fi
echo "$out"
case $out in
  *"$planted: #include \"engine/engine.h\" (engine): engine_tcp may include only"*) ;;
  *) echo "FAIL: the error does not name $planted and its part"; exit 1 ;;
esac
echo "ok: the planted include failed the check"
