/* tcp-ring: the loopback TCP ceiling for ring collectives on this machine.
 *
 * N processes (forked here) on 127.0.0.2.. form a ring of TCP connections,
 * as N daemons would. For each size S, every process streams 2(N-1)/N * S
 * bytes to its right neighbour while reading as many from its left one:
 * exactly the bytes a ring all-reduce of S moves per node, but with nothing
 * else to do: no reduction, no dependency between steps, no copy in user
 * space beyond the kernel's (reads land in one cache-hot buffer). The bus
 * bandwidth printed is therefore what no ring all-reduce over loopback TCP can
 * beat on this machine; it bounds collective-perf, Open MPI and Gloo alike.
 * (All-gather and reduce-scatter move (N-1)/N * S per node: the same rate.)
 *
 * With -o 1, sends read from and reads land at their offset in buffers of
 * the bytes streamed, as a collective's input and output are, instead of
 * one cache-hot piece: what moving the bytes costs a real collective.
 *
 * usage: tcp-ring [-t N] [-b MIN] [-e MAX] [-f FACTOR] [-n ITERS] [-w WARMUP] [-p PIECE] [-s SOCKBUF] [-o 0|1]
 * Only loopback addresses are used. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <sys/wait.h>

#include "tcp-common.h"

/* Streams `bytes` out on `out` and in on `in` at the same time. */
static int spread;  // -o 1: buffers of the streamed size, offset by what moved

static void stream(int out, int in, uint64_t bytes, char* sbuf, char* rbuf, size_t piece) {
  uint64_t sent = 0, got = 0;
  while (sent < bytes || got < bytes) {
    struct pollfd p[2] = {{out, sent < bytes ? POLLOUT : 0, 0}, {in, got < bytes ? POLLIN : 0, 0}};
    if (poll(p, 2, 10000) <= 0) die("poll (10 s without progress)");
    if (p[0].revents & POLLOUT) {
      size_t n = bytes - sent < piece ? bytes - sent : piece;
      ssize_t w = send(out, spread ? sbuf + sent : sbuf, n, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (w < 0 && errno != EAGAIN) die("send");
      if (w > 0) sent += (uint64_t)w;
    }
    if (p[1].revents & (POLLIN | POLLHUP | POLLERR)) {
      size_t n = bytes - got < piece ? bytes - got : piece;
      ssize_t r = recv(in, spread ? rbuf + got : rbuf, n, MSG_DONTWAIT);
      if (r == 0) {
        fprintf(stderr, "tcp-ring: left neighbour closed\n");
        exit(1);
      }
      if (r < 0 && errno != EAGAIN) die("recv");
      if (r > 0) got += (uint64_t)r;
    }
  }
}

static uint64_t sockbuf;  // -s: SO_SNDBUF/SO_RCVBUF, 0: the kernel's

static int ring_option(const char* opt, const char* val) {
  if (!strcmp(opt, "-s")) sockbuf = parse_size(val);
  else if (!strcmp(opt, "-o")) spread = atoi(val);
  else return 0;
  return 1;
}

int main(int argc, char** argv) {
  static const char kUsage[] =
      "                [-p PIECE (bytes per send/recv call, 1M)] [-s SOCKBUF (SO_SNDBUF/SO_RCVBUF, kernel default)]\n"
      "                [-o 1 (buffers of the streamed size, as a collective's; 0: one cache-hot piece)]\n";
  Sweep sw = {.n = 4, .iters = 10, .warmup = 3, .minb = 1 << 20, .maxb = 64 << 20, .factor = 2, .piece = 1 << 20};
  if (!sweep_parse(&sw, argc, argv, ring_option, "tcp-ring", kUsage, 1)) return 2;
  const Ring g = ring_start(sw.n, 1);
  const int n = sw.n, iters = sw.iters, warmup = sw.warmup, rank = g.rank, out = g.out, in = g.in;
  const uint64_t minb = sw.minb, maxb = sw.maxb, factor = sw.factor, piece_bytes = sw.piece;
  if (sockbuf != 0) {
    const int b = (int)sockbuf;
    setsockopt(out, SOL_SOCKET, SO_SNDBUF, &b, sizeof b);
    setsockopt(in, SOL_SOCKET, SO_RCVBUF, &b, sizeof b);
  }
  const size_t piece = (size_t)piece_bytes;
  /* -o 1: room for the most bytes streamed (2 (n-1)/n x MAX), touched once. */
  const size_t room = spread ? (size_t)(2 * (uint64_t)(n - 1) * (maxb / (uint64_t)n)) + piece : piece;
  char* sbuf = malloc(room);
  char* rbuf = malloc(room);
  if (sbuf == NULL || rbuf == NULL) die("malloc");
  memset(sbuf, 1, room);
  memset(rbuf, 0, room);
  if (rank == 0) {
    printf("# tcp-ring: %d processes on 127.0.0.2.., ring all-reduce bytes per node, no compute%s\n", n,
           spread ? ", buffers of the streamed size" : "");
    printf("# %12s %12s %10s %10s\n", "size", "bytes/node", "time(us)", "busbw");
  }
  for (uint64_t s = minb; s <= maxb; s *= factor) {
    const uint64_t bytes = 2 * (uint64_t)(n - 1) * (s / (uint64_t)n);
    for (int i = 0; i < warmup; ++i) stream(out, in, bytes, sbuf, rbuf, piece);
    ring_sync(&g); /* lines the processes up before timing */
    const double t0 = now();
    for (int i = 0; i < iters; ++i) stream(out, in, bytes, sbuf, rbuf, piece);
    const double us = (now() - t0) * 1e6 / iters;
    double worst = us;
    if (rank != 0) {
      if (write(g.report[1], &us, sizeof us) != sizeof us) die("report");
    } else {
      for (int r = 1; r < n; ++r) {
        double t;
        if (read(g.report[0], &t, sizeof t) != sizeof t) die("report");
        if (t > worst) worst = t;
      }
      printf("  %12llu %12llu %10.1f %10.2f\n", (unsigned long long)s, (unsigned long long)bytes,
             worst, bytes / worst / 1e3);
      fflush(stdout);
    }
  }
  close(out);
  close(in);
  if (rank == 0) {
    while (wait(NULL) > 0) {
    }
  }
  return 0;
}
