# Sourced by scripts/bench-tcp and scripts/bench-gpu: the TCP congestion
# control the anchors (Open MPI, Gloo, NCCL on sockets, tcp-ring) run on.
# Our daemons set their own on their peer streams (tcp.congestion_control,
# default cubic); the anchors use the system's default. Where that is a
# pacing algorithm (bbr), it stalls bursty collective traffic (4 daemons on
# loopback, all-gather 1 MiB: stalls of 4-120 ms; Open MPI all-gather 4 MiB
# 3.0-4.2 ms with bbr, 1.8-2.2 ms with cubic). So that all run on the same
# one, anchor_cc_switch sets the system's default to ANCHOR_CC (cubic) when it
# differs and we are root, and anchor_cc_restore puts it back (call it on
# EXIT). ANCHOR_CC=system leaves the system alone.
ANCHOR_CC=${ANCHOR_CC:-cubic}
CC_FILE=/proc/sys/net/ipv4/tcp_congestion_control
SYSTEM_CC=$(cat "$CC_FILE" 2>/dev/null || echo unknown)
CC_SWITCHED=0

anchor_cc_switch() {  # $1: the caller's log prefix
  if [ "$ANCHOR_CC" = system ] || [ "$SYSTEM_CC" = unknown ] || [ "$SYSTEM_CC" = "$ANCHOR_CC" ]; then
    echo "== $1: TCP congestion control: $SYSTEM_CC (system default, the anchors'); our daemons: tcp.congestion_control"
  elif [ "$(id -u)" = 0 ] && echo "$ANCHOR_CC" >"$CC_FILE" 2>/dev/null; then
    CC_SWITCHED=1
    echo "== $1: system TCP congestion control $SYSTEM_CC -> $ANCHOR_CC for this run (the anchors use it; our daemons set $ANCHOR_CC themselves)"
  else
    echo "== $1: WARNING: the anchors run on the system's TCP congestion control $SYSTEM_CC, our daemons on their own (tcp.congestion_control); run as root to compare on $ANCHOR_CC"
  fi
}

anchor_cc_restore() {
  if [ "$CC_SWITCHED" = 1 ]; then
    echo "$SYSTEM_CC" >"$CC_FILE" && echo "== system TCP congestion control restored to $SYSTEM_CC"
    CC_SWITCHED=0
  fi
}
