#!/usr/bin/env bash
# systemd-analyze verify on the shipped unit, with ExecStart pointed at the
# built daemon (the installed path does not exist on a build machine).
set -eu
src=${1:?usage: verify_unit.sh UNIT COLLECTIVED_BIN}
bin=${2:?}
command -v systemd-analyze >/dev/null || { echo "systemd-analyze missing: run scripts/install-deps"; exit 1; }
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
sed "s|/usr/local/bin/collectived|$bin|" "$src" > "$dir/collectived.service"
out=$(systemd-analyze verify "$dir/collectived.service" 2>&1) || { echo "$out"; exit 1; }
# verify exits 0 on some warnings: treat any output about our unit as a failure.
if grep -q "collectived.service" <<<"$out"; then echo "$out"; exit 1; fi
echo "systemd-analyze verify: collectived.service OK"
