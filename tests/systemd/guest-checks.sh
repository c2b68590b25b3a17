#!/bin/bash
# guest-checks.sh: the collectived package under systemd, checked from inside
# the test guest (tests/systemd/run-systemd-vm boots it; the unit
# collectived-vm-checks.service runs this as root after multi-user.target).
# One "ok - " or "FAIL - " line per check, "# phase NAME: N s" per phase, a
# summary; exit 1 on any failure. Every wait has a deadline.
#
# Guest-only change to the shipped unit: the watchdog phase shortens
# WatchdogSec=30s to 5s with a drop-in (as `systemctl edit` writes one), and
# removes it afterwards.
set -u   # not -e: a failed check is reported and the next one runs; no pipefail: grep -q ends pipes early

UNIT=collectived
SOCK=/run/collectived/collectived.sock
CONF=/etc/collectived/collectived.yaml
DROPIN=/etc/systemd/system/$UNIT.service.d/50-vm-watchdog.conf
CTL=/run/sdvm-ctl
W=$(mktemp -d)
export SYSTEMD_PAGER='' SYSTEMD_COLORS=0 LC_ALL=C.UTF-8

PASS=0 FAILED=()
ok() { echo "ok - $*"; PASS=$((PASS + 1)); }
fail() { echo "FAIL - $*"; FAILED+=("${1%%:*}"); }
note() { echo "# $*"; }
indent() { sed 's/^/#   /'; }

PHASE='' PHASE_T=
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
phase() {
  [ -z "$PHASE" ] || note "phase $PHASE: $(since "$PHASE_T") s"
  PHASE=$1 PHASE_T=$(now)
  [ "$PHASE" = end ] || note "--- $PHASE"
}

prop() { systemctl show -p "$1" --value "$UNIT"; }
# wait_for SECONDS CMD...: until CMD succeeds; 1 after the deadline.
wait_for() {
  local end=$((SECONDS + $1)); shift
  until "$@"; do [ $SECONDS -lt $end ] || return 1; sleep 0.2; done
}
is_state() { [ "$(prop ActiveState)" = "$1" ]; }
# The journal from a cursor on: lines of the unit (the daemon's and systemd's about it).
cursor() { journalctl -q -n 1 -o export | sed -n 's/^__CURSOR=//p'; }
jsince() { journalctl -q -u "$UNIT" --after-cursor "$1" -o cat --no-pager; }
jhas() { jsince "$1" | grep -qE -- "$2"; }
# as USER CMD...: a client process of USER (supplementary groups from /etc/group).
as() { local u=$1; shift; timeout 120 runuser -u "$u" -- "$@"; }

# set_key SECTION KEY VALUE: edits the profile's "SECTION:\n  KEY: VALUE" line;
# fails unless exactly one line changed.
set_key() {
  awk -v s="$1" -v k="$2" -v v="$3" '
    /^[^ #]/ { in_s = ($0 == s ":") }
    in_s && $0 ~ "^  " k ":" { print "  " k ": " v; n++; next }
    { print }
    END { exit n == 1 ? 0 : 1 }' "$CONF" > "$W/conf" && cat "$W/conf" > "$CONF"
}
# reload: systemctl reload; once that failed (reported once), SIGHUP through
# systemd instead, so that the daemon's own reload is still checked.
RELOAD_BROKEN=''
reload() {
  local out
  if [ -z "$RELOAD_BROKEN" ]; then
    out=$(timeout 60 systemctl reload "$UNIT" 2>&1) && return 0
    RELOAD_BROKEN=1
    wait_for 5 jhas "$RELOAD_CUR" 'Reload failed'
    fail "systemctl reload $UNIT: $(head -n 1 <<<"$out") journal: $(jsince "$RELOAD_CUR" |
         grep -E 'Failed|failed|ExecReload|status=' | grep -v '^Reload failed' | head -n 3 | tr '\n' ' ')"
    note "reloading with systemctl kill -s HUP --kill-who=main from here on"
  fi
  systemctl kill -s HUP --kill-who=main "$UNIT"
}

# ------------------------------------------------------------------ boot
phase boot
up=$(cut -d' ' -f1 /proc/uptime)
mu=$(systemctl show -p ActiveEnterTimestampMonotonic --value multi-user.target)
note "multi-user.target reached $(awk -v u="$mu" 'BEGIN { printf "%.1f", u / 1e6 }') s after boot; checks start at $up s"
failed_units=$(systemctl list-units --state=failed --no-legend --plain | awk '{print $1}' | tr '\n' ' ')
[ -z "$failed_units" ] || note "failed units at boot: $failed_units"
[ "$(systemctl is-enabled $UNIT 2>&1)" = enabled ] && ok "postinst enabled $UNIT.service" ||
  fail "postinst enabled $UNIT.service: is-enabled says $(systemctl is-enabled $UNIT 2>&1)"
is_state active && ok "$UNIT started at boot (MainPID $(prop MainPID))" ||
  fail "$UNIT started at boot: $(prop ActiveState)/$(prop SubState); $(journalctl -b -u $UNIT -o cat -n 5 | tr '\n' ' ')"
getent group collectived >/dev/null && ok "postinst created group collectived" || fail "postinst created group collectived"

# ------------------------------------------------------------------ start
# Type=notify: the unit is "activating" until the daemon's READY=1 (which
# carries STATUS=serving clients); once "active", the socket is there. The
# daemon is SIGSTOPped for 3 s as soon as its cgroup has a process (read
# without forking, so well before READY=1): systemd must keep the unit
# "activating" meanwhile (Type=simple would be "active" at once).
phase start
timeout 60 systemctl stop "$UNIT"
CG=/sys/fs/cgroup/system.slice/$UNIT.service/cgroup.procs
systemctl start --no-block "$UNIT"
held='' held_st='' pid=''
end=$((SECONDS + 30))
while [ $SECONDS -lt $end ] && [ -z "$pid" ]; do read -r pid 2>/dev/null < "$CG"; done
if [ -n "$pid" ] && kill -STOP "$pid" 2>/dev/null; then
  held=$pid
  sleep 3
  held_st=$(prop ActiveState) held_sock=$([ -S "$SOCK" ] && echo there || echo absent)
  kill -CONT "$pid"
fi
seen='' last='' bad=''
end=$((SECONDS + 60))
while [ $SECONDS -lt $end ]; do
  st=$(prop ActiveState)
  [ "$last" = "$st" ] || seen+=" $st" last=$st
  if [ "$st" = active ]; then [ -S "$SOCK" ] || bad="active before the socket existed"; break; fi
  [ "$st" != failed ] || break
  sleep 0.05
done
note "states seen after the SIGCONT:$seen"
[ "$(prop Type)" = notify ] || fail "unit Type: $(prop Type), not notify"
case $held_st in
  activating) ok "daemon stopped before READY=1 for 3 s: the unit stays activating (socket $held_sock)" ;;
  active) note "inconclusive: READY=1 came before the SIGSTOP (the daemon started too fast to catch)" ;;
  '') fail "no process in $CG within 30 s of systemctl start" ;;
  *) fail "daemon stopped before READY=1: the unit went $held_st" ;;
esac
if [ "$st" = active ] && [ -z "$bad" ]; then
  ok "systemctl start: active with the socket in place ($(prop SubState), MainPID $(prop MainPID))"
else
  fail "systemctl start: ${bad:-ended $st}"
fi
[ "$(prop StatusText)" = "serving clients" ] &&
  ok "active after the daemon's READY=1 (StatusText \"serving clients\" came with it)" ||
  fail "StatusText after start: \"$(prop StatusText)\" (READY=1 carries \"serving clients\")"
mode=$(stat -c '%U:%G %a' "$SOCK" 2>&1)
[ "$mode" = "root:collectived 660" ] && ok "socket $SOCK is $mode" || fail "socket $SOCK: $mode (want root:collectived 660)"

# ------------------------------------------------------------------ clients
phase clients
useradd -M -N -G collectived -s /usr/sbin/nologin alice
useradd -M -N -s /usr/sbin/nologin bob
out=$(as alice collective-demo 2>&1); rc=$?
[ $rc = 0 ] && grep -q 'demo OK' <<<"$out" &&
  ok "alice (group collectived) runs collective-demo: registers a buffer, reads status" ||
  { fail "alice runs collective-demo: exit $rc"; indent <<<"$out"; }
out=$(as bob collective-demo 2>&1); rc=$?
if [ $rc != 0 ] && [ $rc != 124 ] && grep -qi 'permission denied' <<<"$out"; then
  ok "bob (not in the group) is refused: $(tail -n 1 <<<"$out")"
else
  fail "bob is refused with a clear message: exit $rc"; indent <<<"$out"
fi
t=$(now)
out=$(as alice collective-perf -t 2 -b 256K -e 256K -n 3 -w 1 --op all 2>&1); rc=$?
if [ $rc = 0 ]; then
  ok "alice runs collective-perf -t 2 --op all (6 collectives, 2 ranks, checked; $(since "$t") s)"
else
  fail "alice runs collective-perf: exit $rc"; tail -n 15 <<<"$out" | indent
fi

# ------------------------------------------------------------------ reload
# log.level is live: SIGHUP applies it. A broken profile is refused and the
# running one kept (an error line); a restart-only key is named (a warning).
phase reload
cp "$CONF" "$W/conf.orig"
pid=$(prop MainPID)
RELOAD_CUR=$(cursor)
if set_key log level debug; then
  reload
  if wait_for 30 jhas "$RELOAD_CUR" 'event=reloaded '; then
    jhas "$RELOAD_CUR" 'event=reload_changed key=log.level from=info to=debug' &&
      ok "reload: the daemon applies log.level info -> debug ($(jsince "$RELOAD_CUR" | grep -m1 'event=reloaded '))" ||
      fail "reload: no reload_changed line for log.level"
    [ "$(prop MainPID)" = "$pid" ] && is_state active && ok "reload: same MainPID $pid, still active" ||
      fail "reload: MainPID $pid -> $(prop MainPID), $(prop ActiveState)"
    collectivectl status 2>&1 | grep -q 'log level debug' && ok "collectivectl status: log level debug" ||
      fail "collectivectl status after reload: $(collectivectl status 2>&1 | head -1)"
    cur=$(cursor)
    as alice collective-demo >/dev/null 2>&1
    wait_for 10 jhas "$cur" 'level=debug event=client_connected' &&
      ok "debug lines in the journal after the reload (client_connected)" ||
      fail "no debug line (client_connected) in the journal after the reload"
  else
    fail "reload: no 'reloaded' line within 30 s"; jsince "$RELOAD_CUR" | tail -n 5 | indent
  fi
else
  fail "profile $CONF has no single 'log:\n  level:' line to edit"
fi
cur=$(cursor) RELOAD_CUR=$cur
if set_key log level loud; then
  reload
  wait_for 30 jhas "$cur" 'event=reload_failed' && [ "$(prop MainPID)" = "$pid" ] && is_state active &&
    ok "reload of a broken profile: refused, the daemon keeps running (same pid)" ||
    fail "reload of a broken profile: $(jsince "$cur" | tail -n 2 | tr '\n' ' ') state $(prop ActiveState)"
fi
cat "$W/conf.orig" > "$CONF"
cur=$(cursor) RELOAD_CUR=$cur
if set_key memory host_pool_bytes 32MiB; then
  reload
  wait_for 30 jhas "$cur" 'event=reload_needs_restart key=memory.host_pool_bytes' &&
    ok "reload of a restart-only key: logged as needing a restart" ||
    fail "reload of memory.host_pool_bytes: no reload_needs_restart line"
else
  fail "profile $CONF has no single 'memory:\n  host_pool_bytes:' line to edit"
fi
cat "$W/conf.orig" > "$CONF"
cur=$(cursor) RELOAD_CUR=$cur
reload
wait_for 30 jhas "$cur" 'event=reloaded ' || fail "reload back to the shipped profile: no 'reloaded' line"

# ------------------------------------------------------------------ watchdog
# A stopped event loop stops the pings: systemd kills the daemon and
# Restart=on-failure starts a new one, which serves clients.
phase watchdog
mkdir -p "${DROPIN%/*}"
printf '# tests/systemd: the shipped 30 s, shortened for the test\n[Service]\nWatchdogSec=5s\n' > "$DROPIN"
note "drop-in $DROPIN: WatchdogSec=5s (shipped: 30s) to keep the test short"
systemctl daemon-reload
timeout 60 systemctl restart "$UNIT"
[ "$(prop WatchdogUSec)" = 5s ] || fail "drop-in WatchdogSec=5s: WatchdogUSec is $(prop WatchdogUSec)"
n0=$(prop NRestarts) pid=$(prop MainPID)
cur=$(cursor) t=$(now)
kill -STOP "$pid"
restarted() { [ "$(prop NRestarts)" -gt "$n0" ] && is_state active && [ "$(prop MainPID)" != "$pid" ] && [ "$(prop MainPID)" != 0 ]; }
if wait_for 90 restarted; then
  new=$(prop MainPID)
  ok "SIGSTOPped daemon (pid $pid) restarted by the watchdog: NRestarts $n0 -> $(prop NRestarts), MainPID $new, $(since "$t") s"
  jhas "$cur" 'Watchdog timeout' && ok "journal: $(jsince "$cur" | grep -m1 'Watchdog timeout')" ||
    fail "journal: no 'Watchdog timeout' line"
  out=$(as alice collective-demo 2>&1)
  grep -q "pid $new," <<<"$out" && grep -q 'demo OK' <<<"$out" && ok "the new daemon (pid $new) serves alice" ||
    { fail "the new daemon serves alice"; indent <<<"$out"; }
else
  kill -CONT "$pid" 2>/dev/null
  fail "no watchdog restart within 90 s: $(prop ActiveState)/$(prop SubState) NRestarts $(prop NRestarts) MainPID $(prop MainPID)"
  jsince "$cur" | tail -n 8 | indent
fi
rm -f "$DROPIN"; rmdir "${DROPIN%/*}" 2>/dev/null
systemctl daemon-reload
timeout 60 systemctl restart "$UNIT"
[ "$(prop WatchdogUSec)" = 30s ] && ok "drop-in removed: shipped WatchdogSec=30s back" ||
  fail "after removing the drop-in: WatchdogUSec $(prop WatchdogUSec)"

# ------------------------------------------------------------------ stop
# Two ranks with collectives in flight; systemctl stop must fail them with an
# error (not hang them) and the daemon must exit 0 within TimeoutStopSec.
#   stop_with_work LABEL PERF-ARGS...
stop_with_work() {
  local label=$1 perf rc out res msg line cur t; shift
  timeout 60 systemctl start "$UNIT"
  as alice collective-perf -t 2 -b 1M -e 1M -n 1000000 -w 0 "$@" > "$W/perf.out" 2>&1 &
  perf=$!
  running() { collectivectl status 2>/dev/null | grep -qE '^operations: .* [1-9][0-9]* completed'; }
  wait_for 60 running || { fail "$label: collective-perf ran no collective within 60 s"; tail -n 5 "$W/perf.out" | indent; }
  note "$label: $(collectivectl status 2>&1 | grep -E '^operations:')"
  cur=$(cursor) t=$(now)
  out=$(timeout 60 systemctl stop "$UNIT" 2>&1); rc=$?
  [ $rc = 0 ] && ok "$label: systemctl stop exits 0 ($(since "$t") s)" || fail "$label: systemctl stop: exit $rc $out"
  res="Result=$(prop Result) ExecMainCode=$(prop ExecMainCode) ExecMainStatus=$(prop ExecMainStatus)"
  if [ "$res" = "Result=success ExecMainCode=1 ExecMainStatus=0" ]; then ok "$label: the daemon exited 0 ($res)"
  else fail "$label: the daemon did not exit 0 by itself: $res"; jsince "$cur" | grep -vE 'event=client_' | tail -n 6 | indent; fi
  if wait_for 60 eval '! kill -0 $perf 2>/dev/null'; then
    wait $perf; rc=$?
    msg=$(grep -m1 -E 'collective-perf: rank' "$W/perf.out")
    if [ $rc != 0 ] && [ $rc != 124 ] && grep -qiE 'stopping|aborted' <<<"$msg"; then
      ok "$label: the client got an error naming the stop, not a hang (exit $rc): ${msg#collective-perf: }"
    else
      fail "$label: the client's error (exit $rc) does not say the daemon is stopping: ${msg:-none}"
    fi
  else
    kill -KILL $perf 2>/dev/null
    fail "$label: the client still runs 60 s after the stop (a hang)"; tail -n 6 "$W/perf.out" | indent
  fi
  line=$(jsince "$cur" | grep -m1 'event=stopping ')
  grep -qE 'signal=SIGTERM clients=[1-9]' <<<"$line" || fail "$label: journal stopping line: '$line'"
  jhas "$cur" 'event=stopped ' || fail "$label: journal: no 'stopped' line from the daemon"
  [ ! -e "$SOCK" ] && [ ! -e /run/collectived ] ||
    fail "$label: left after stop: $(ls -d "$SOCK" /run/collectived 2>/dev/null | tr '\n' ' ')"
}
phase stop
# Blocking calls (-z 1): one collective per rank in flight, as most clients run.
stop_with_work "stop, blocking client"  -z 1
# Non-blocking (-z 0): the ranks queue collectives as fast as they can (a deep queue).
stop_with_work "stop, deep queue" -z 0

# ------------------------------------------------------------------ journal
# Under journald the daemon writes <N> prefixes: each line's PRIORITY matches its level.
phase journal
journalctl -q -u "$UNIT" -o json --no-pager > "$W/journal.json"
awk '
  match($0, /"MESSAGE":"level=[a-z]+ /) {
    lvl = substr($0, RSTART + 17, RLENGTH - 18)
    if (!match($0, /"PRIORITY":"[0-9]"/)) { bad++; next }
    p = substr($0, RSTART + 12, 1)
    want = (lvl == "trace" || lvl == "debug") ? 7 : lvl == "info" ? 6 : lvl == "warn" ? 4 : lvl == "error" ? 3 : -1
    if (p != want) bad++
    n[lvl " " p]++
  }
  END { for (k in n) printf "%s=%d ", k, n[k]; print ""; exit bad > 0 }' "$W/journal.json" > "$W/prio"
rc=$?
counts=$(cat "$W/prio")
[ $rc = 0 ] && ok "every daemon line's PRIORITY matches its level (level priority=count: $counts)" ||
  fail "PRIORITY does not match the level: $counts"
for want in "info 6" "warn 4" "error 3" "debug 7"; do
  grep -q "$want=" <<<"$counts" || fail "no daemon line at $want (level priority) in the journal"
done
grep -q '"MESSAGE":"<[0-9]>' "$W/journal.json" && fail "a <N> prefix reached the journal's MESSAGE"
pri=$(grep -m1 'event=listening' "$W/journal.json" | grep -o '"PRIORITY":"[0-9]"')
note "journalctl -u $UNIT -o json: listening has $pri"

# ------------------------------------------------------------------ purge
phase purge
timeout 60 systemctl start "$UNIT"    # running: prerm must stop it
dpkg-query -L collectived > "$W/files" 2>/dev/null
t=$(now)
out=$(timeout 300 apt-get purge -y -q collectived 2>&1); rc=$?
[ $rc = 0 ] && ok "apt-get purge collectived ($(since "$t") s)" || { fail "apt-get purge: exit $rc"; tail -n 10 <<<"$out" | indent; }
left=$(while read -r f; do
  [ -d "$f" ] && case $f in *collectived*) ;; *) continue ;; esac
  [ -e "$f" ] || [ -L "$f" ] && echo "$f"; done < "$W/files")
left+=$(ls -d /etc/collectived /run/collectived /etc/systemd/system/*.wants/collectived.service \
        /etc/systemd/system/collectived.service /var/lib/systemd/deb-systemd-helper-*/*collectived* 2>/dev/null)
[ -z "$left" ] && ok "no file of the package left ($(wc -l < "$W/files") paths checked), /etc/collectived gone" ||
  fail "left after purge: $(tr '\n' ' ' <<<"$left")"
load=$(prop LoadState) st=$(prop ActiveState)
[ "$load" = not-found ] && [ "$st" = inactive ] && ok "service gone (LoadState=$load, ActiveState=$st)" ||
  fail "service after purge: LoadState=$load ActiveState=$st"
pgrep_daemon=$(for p in /proc/[0-9]*; do [ "$(cat "$p/comm" 2>/dev/null)" = collectived ] && echo "${p#/proc/}"; done)
[ -z "$pgrep_daemon" ] || fail "a collectived process survived the purge: pid $pgrep_daemon"
getent group collectived >/dev/null && fail "group collectived left after purge" || ok "group collectived removed"
dpkg-query -W -f='${Status}' collectived 2>/dev/null | grep -q installed &&
  fail "dpkg still lists collectived: $(dpkg-query -W -f='${Status}' collectived)"

# ------------------------------------------------------------------ summary
phase end
journalctl -b -o short-monotonic --no-pager > "$CTL/journal.txt" 2>&1
if [ ${#FAILED[@]} = 0 ]; then
  echo "# all $PASS checks passed"
  exit 0
fi
echo "# $PASS passed, ${#FAILED[@]} failed:"
printf '%s\n' "${FAILED[@]}" | uniq -c | sed 's/^ */#   /'   # "N check": N failures of that check
exit 1
