#!/usr/bin/env bash
# For applications (issue H, item 2): installs BUILD_DIR into a temporary
# tree, builds tests/install/consumer against that tree with the CMake package
# (find_package(collectived)) and with pkg-config (collectived.pc), shared and
# static each, and runs the four programs against the installed daemon.
#
# The install is staged with DESTDIR at the build's own prefix, as the Debian
# package is: `--prefix` alone would still write the profile to the host's
# /etc (cmake/Install.cmake installs it to an absolute path). The staged tree
# is then used away from its prefix, which checks that both files relocate.
set -euo pipefail
build=$(cd "${1:?usage: install_test.sh BUILD_DIR}" && pwd)
consumer=$(cd "$(dirname "$0")/consumer" && pwd)

tmp=$(mktemp -d /tmp/collectived-install.XXXXXX)
daemon_pid=
cleanup() {
  if [ -n "$daemon_pid" ]; then kill -KILL "$daemon_pid" 2>/dev/null || true; fi
  rm -rf "$tmp"
}
trap cleanup EXIT

# kill -0 alone would take an exited but unreaped daemon (a zombie) for alive.
alive() { kill -0 "$1" 2>/dev/null && ! grep -qs '^State:[[:space:]]*Z' "/proc/$1/status"; }
die() {
  echo "FAIL: $*" >&2
  exit 1
}
# Runs a step with its output in $tmp/step.log, shown only when it fails.
step() {
  if ! timeout "$@" >"$tmp/step.log" 2>&1; then
    cat "$tmp/step.log" >&2
    die "${*:2}"
  fi
}

cache() { sed -n "s/^$1:[A-Z]*=//p" "$build/CMakeCache.txt"; }
prefix=$(cache CMAKE_INSTALL_PREFIX)
libdir=$(cache CMAKE_INSTALL_LIBDIR)
case $libdir in /*) ;; *) libdir=$prefix/$libdir ;; esac
root=$tmp/root
[ -n "$prefix" ] || die "no CMAKE_INSTALL_PREFIX in $build/CMakeCache.txt"

# The install, with nothing of the caller's environment steering it.
step 300 env -u CMAKE_INSTALL_MODE DESTDIR="$root" cmake --install "$build"
for f in "$libdir/cmake/collectived/collectivedConfig.cmake" "$libdir/pkgconfig/collectived.pc"; do
  [ -f "$root$f" ] || die "cmake --install did not install $f"
done
grep -qx "prefix=$prefix" "$root$libdir/pkgconfig/collectived.pc" ||
  die "collectived.pc does not name the install prefix $prefix"
if grep -rqF -e "$build" -e "$(cd "$consumer/../../.." && pwd)" "$root$libdir/cmake/collectived" \
    "$root$libdir/pkgconfig"; then
  die "the installed package files name the build or source tree"
fi
echo "ok - cmake --install $build (DESTDIR, prefix $prefix)"

# CMake package: found in the staged tree only (a collectived installed on
# the host must not stand in for it).
step 300 cmake -S "$consumer" -B "$tmp/cmake" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$root$prefix" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
grep -q "^collectived_DIR:PATH=$root" "$tmp/cmake/CMakeCache.txt" ||
  die "find_package(collectived) did not find the staged tree: $(grep ^collectived_DIR "$tmp/cmake/CMakeCache.txt")"
step 300 cmake --build "$tmp/cmake" -j2
echo "ok - find_package(collectived): collectived::collective and collectived::collective_static build"

# pkg-config: only the staged tree's files (PKG_CONFIG_LIBDIR replaces the
# default search path), relocated from $prefix to where it lies.
export PKG_CONFIG_LIBDIR=$root$libdir/pkgconfig
unset PKG_CONFIG_PATH PKG_CONFIG_SYSROOT_DIR
pc="pkg-config --define-variable=prefix=$root$prefix"
version=$($pc --modversion collectived) || die "pkg-config does not find collectived"
cp -r "$consumer" "$tmp/pc"
step 300 make -C "$tmp/pc" PKG_CONFIG="$pc"
echo "ok - pkg-config collectived $version: shared and static build"

# What each binary links: the shared ones libcollective.so.0, the static
# ones no libcollective at all.
for b in "$tmp/cmake/consumer_shared" "$tmp/pc/consumer_shared"; do
  # grep -q on a pipe may leave its writer a SIGPIPE, which pipefail
  # counts: the output is read whole first.
  grep -q 'NEEDED.*\[libcollective\.so\.0\]' <<<"$(readelf -d "$b")" || die "$b does not need libcollective.so.0"
done
for b in "$tmp/cmake/consumer_static" "$tmp/pc/consumer_static"; do
  ! grep -q 'NEEDED.*libcollective' <<<"$(readelf -d "$b")" || die "$b needs a shared libcollective"
done
export LD_LIBRARY_PATH=$root$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
grep -q "libcollective.so.0 => $root$libdir/" <<<"$(ldd "$tmp/cmake/consumer_shared")" ||
  die "consumer_shared does not load the staged libcollective: $(ldd "$tmp/cmake/consumer_shared")"

# The installed daemon, on a socket of its own.
sock=$tmp/d.sock
env -u NOTIFY_SOCKET -u WATCHDOG_USEC "$root$prefix/bin/collectived" --set client.socket="$sock" \
  </dev/null >"$tmp/daemon.log" 2>&1 &
daemon_pid=$!
deadline=$((SECONDS + 20))
until "$root$prefix/bin/collectivectl" --socket "$sock" --timeout-ms 1000 status >/dev/null 2>&1; do
  if ! alive "$daemon_pid" || [ $SECONDS -ge $deadline ]; then
    cat "$tmp/daemon.log" >&2
    die "the installed collectived did not answer on $sock within 20 s"
  fi
  sleep 0.1
done
echo "ok - installed collectived answers on its socket"

for b in cmake/consumer_shared cmake/consumer_static pc/consumer_shared pc/consumer_static; do
  out=$(timeout 60 "$tmp/$b" "$sock" "$version" 2>&1) || { echo "$out" >&2; die "$b failed"; }
  [ "$out" = ok ] || { echo "$out" >&2; die "$b printed no ok"; }
  echo "ok - $b: all_reduce through the daemon"
done

kill -TERM "$daemon_pid"
deadline=$((SECONDS + 20))
while alive "$daemon_pid"; do
  if [ $SECONDS -ge $deadline ]; then
    cat "$tmp/daemon.log" >&2
    die "collectived did not stop within 20 s of SIGTERM"
  fi
  sleep 0.1
done
rc=0
wait "$daemon_pid" || rc=$?
daemon_pid=
[ "$rc" -eq 0 ] || { cat "$tmp/daemon.log" >&2; die "collectived exited with $rc after SIGTERM"; }
echo "ok - collectived stopped"
