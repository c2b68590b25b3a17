# Sourced by scripts/bench/ab, scripts/bench/ab-pair and scripts/bench/pair-mpi: sets of
# BENCH_NODES (4) collectived daemons on loopback (one per "node", one rank
# each), kept up for a whole comparison.
#   bench_daemons_init              T: a temporary folder with a cluster secret; P: no pids yet
#   bench_daemons NAME BUILD NET "key=value ..."
#                                   starts BENCH_NODES daemons of BUILD/bin/collectived
#                                   on 127.0.NET.2.. with those profile keys; their
#                                   pids join P, their sockets (comma-joined, rank
#                                   order) are in SOCKETS
#   bench_daemons_wait N            until N sockets are up; fails after 10 s
# The caller kills "${P[@]}" and removes "$T" on exit.

bench_daemons_init() {
  T=$(mktemp -d)
  P=()
  head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$T/secret"
  chmod 600 "$T/secret"
}

bench_daemons() {
  local name=$1 bd=$2 net=$3 sets=$4 i x
  local setargs=() bp=$(( 20000 + RANDOM % 20000 ))
  for x in $sets; do setargs+=(--set "$x"); done
  SOCKETS=""
  for i in $(seq 0 $(( ${BENCH_NODES:-4} - 1 ))); do
    "$bd/bin/collectived" --set client.socket="$T/$name$i.sock" --set log.level=warn --set node.name=node$i \
      --set peer.listen_address=127.0.$net.$((i + 2)) --set peer.port=$((bp + i)) \
      --set peer.secret_file="$T/secret" "${setargs[@]}" 2>>"$T/log" &
    P+=($!)
    SOCKETS="$SOCKETS${SOCKETS:+,}$T/$name$i.sock"
  done
}

bench_daemons_wait() {
  local n
  for _ in $(seq 1 100); do
    n=$(ls "$T"/*.sock 2>/dev/null | wc -l)
    [ "$n" -ge "$1" ] && return 0
    sleep 0.1
  done
  echo "bench daemons: $n of $1 client sockets up after 10 s; the daemons' log:" >&2
  tail -20 "$T/log" >&2
  return 1
}
