# Sourced by scripts/bench-host and scripts/bench/pair-mpi: how the Open MPI
# anchor is launched, in one place.
#   mpi_launch NRANKS BTL PROGRAM ARGS...
# runs PROGRAM under mpirun with ANCHOR_ENV in its ranks' environment (and
# under `timeout MPI_TIMEOUT` where that is set).
#
# ANCHOR_ENV: glibc malloc told never to hand memory back to the kernel (no
# mmap'ed chunks, no trimming). On this VM a first-touch page fault costs
# ~12 us (a fresh 32 MiB buffer: ~100 ms), and Open MPI allocates per-call
# temporaries of the message size; >= 32 MiB they always come from a fresh
# mmap (glibc's largest mmap threshold), so all-reduce at 32 MiB drops from
# ~2.2 to ~0.2 GB/s busbw, and reduce-scatter read 4-5x slower. The tuning
# measures the collective, not the page-fault path. Ours runs untuned on
# purpose: a per-call allocation in collectived or collective-perf shows up as
# the same cliff. ANCHOR_MALLOC_TUNING=0 turns it off.
#
# mpirun's flags:
# --oversubscribe: 4 ranks on 2 cores. Open MPI then defaults to
#   mpi_yield_when_idle=1 (set explicitly here): its progress loop still polls
#   but calls sched_yield between polls, so a waiting rank gives its core away.
# --bind-to none: with more ranks than cores, binding would pin two ranks to a
#   core for good; unbound the kernel balances them.
# --mca btl BTL: "self,vader" (shared memory; large messages through CMA single
#   copy) inside one node, "tcp,self" for the TCP anchor.
# oob/btl tcp limited to lo: nothing leaves loopback.
ANCHOR_MALLOC_TUNING=${ANCHOR_MALLOC_TUNING:-1}
ANCHOR_ENV=()
if [ "$ANCHOR_MALLOC_TUNING" = 1 ]; then
  ANCHOR_ENV=(MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=17179869184)
fi

mpi_launch() {
  local n=$1 btl=$2 kv
  shift 2
  local xargs=() tmo=()
  for kv in "${ANCHOR_ENV[@]}"; do xargs+=(-x "${kv%%=*}"); done
  [ -n "${MPI_TIMEOUT:-}" ] && tmo=(timeout "$MPI_TIMEOUT")
  env "${ANCHOR_ENV[@]}" "${tmo[@]}" mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$n" \
    --mca btl "$btl" --mca mpi_yield_when_idle 1 \
    --mca oob_tcp_if_include lo --mca btl_tcp_if_include lo \
    "${xargs[@]}" "$@"
}
