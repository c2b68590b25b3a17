/* tcp-common.h: what tcp-ring.c and tcp-lean.c share: N processes forked
 * here, joined in a ring of loopback TCP connections on 127.0.0.2.., a pipe
 * to report to rank 0, sizes with K/M/G, and a token around the ring that
 * lines the processes up before timing. Only loopback addresses are used. */
#ifndef COLLECTIVED_BENCH_TCP_COMMON_H
#define COLLECTIVED_BENCH_TCP_COMMON_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static uint64_t parse_size(const char* s) {
  char* end;
  double v = strtod(s, &end);
  if (*end == 'K' || *end == 'k') v *= 1024;
  if (*end == 'M' || *end == 'm') v *= 1024 * 1024;
  if (*end == 'G' || *end == 'g') v *= 1024.0 * 1024 * 1024;
  return (uint64_t)v;
}

static void die(const char* what) {
  perror(what);
  exit(1);
}

/* The sweep both tools take, nccl-tests' flags: -t ranks, -b -e sizes, -f
 * factor, -n iterations, -w warm-up, -p bytes per send/recv call. */
typedef struct {
  int n, iters, warmup;
  uint64_t minb, maxb, factor, piece;
} Sweep;

/* Takes `opt val` into `s` if it is one of the sweep's flags (1), else 0. */
static int sweep_option(Sweep* s, const char* opt, const char* val) {
  if (!strcmp(opt, "-t")) s->n = atoi(val);
  else if (!strcmp(opt, "-b")) s->minb = parse_size(val);
  else if (!strcmp(opt, "-e")) s->maxb = parse_size(val);
  else if (!strcmp(opt, "-f")) s->factor = parse_size(val);
  else if (!strcmp(opt, "-n")) s->iters = atoi(val);
  else if (!strcmp(opt, "-w")) s->warmup = atoi(val);
  else if (!strcmp(opt, "-p")) s->piece = parse_size(val);
  else return 0;
  return 1;
}

/* The sweep's flags, for a usage line. */
#define SWEEP_USAGE "[-t N] [-b MIN] [-e MAX] [-f FACTOR] [-n ITERS] [-w WARMUP]"

/* Whether the sweep makes sense: 2..200 ranks, a factor of 2 or more, sizes
 * and pieces above 0, pieces a multiple of `align` bytes. */
static int sweep_ok(const Sweep* s, uint64_t align) {
  return s->n >= 2 && s->n <= 200 && s->factor >= 2 && s->minb != 0 && s->piece != 0 && s->piece % align == 0;
}

/* Parses argv (flag value pairs): the sweep's into `s`, any other through
 * `other` (returns 0 for a flag it does not know). On an unknown flag or a
 * sweep that makes no sense (sweep_ok with `align`), prints `usage` or why
 * and returns 0. */
static int sweep_parse(Sweep* s, int argc, char** argv, int (*other)(const char*, const char*),
                       const char* name, const char* usage, uint64_t align) {
  for (int i = 1; i < argc; i += 2) {
    if (i + 1 == argc || (!sweep_option(s, argv[i], argv[i + 1]) && !other(argv[i], argv[i + 1]))) {
      fprintf(stderr, "usage: %s " SWEEP_USAGE "\n%s", name, usage);
      return 0;
    }
  }
  if (!sweep_ok(s, align)) {
    fprintf(stderr, "%s: bad arguments\n", name);
    return 0;
  }
  return 1;
}

/* The processes of one run. */
typedef struct {
  int n, rank;
  int out, in;   /* to the right neighbour, from the left one */
  int report[2]; /* ranks 1.. write, rank 0 reads */
} Ring;

/* Forks N-1 processes and joins all N in a ring: rank r listens on
 * 127.0.0.(2+r), connects to the right and accepts from the left, every
 * socket on cubic, as the daemons' peer sockets (a pacing system default,
 * bbr, slows loopback streams down; scripts/bench/congestion.sh), set before
 * listen and connect (accepted sockets inherit the listener's), and
 * TCP_NODELAY on the sending side. */
static Ring ring_start(int n, int port_salt) {
  static const char kCc[] = "cubic";
  Ring g = {.n = n, .rank = 0};
  const int port = 20000 + (int)((getpid() * (pid_t)port_salt) % 20000);
  if (pipe(g.report) != 0) die("pipe");
  for (int r = 1; r < n; ++r) {
    pid_t pid = fork();
    if (pid < 0) die("fork");
    if (pid == 0) {
      g.rank = r;
      break;
    }
  }
  int ls = socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  setsockopt(ls, IPPROTO_TCP, TCP_CONGESTION, kCc, sizeof kCc - 1);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)(port + g.rank))};
  a.sin_addr.s_addr = htonl(0x7f000002u + (uint32_t)g.rank);
  if (bind(ls, (struct sockaddr*)&a, sizeof a) != 0) die("bind");
  if (listen(ls, 4) != 0) die("listen");
  const int right = (g.rank + 1) % n;
  struct sockaddr_in b = {.sin_family = AF_INET, .sin_port = htons((uint16_t)(port + right))};
  b.sin_addr.s_addr = htonl(0x7f000002u + (uint32_t)right);
  for (int tries = 0;; ++tries) {
    g.out = socket(AF_INET, SOCK_STREAM, 0);
    setsockopt(g.out, IPPROTO_TCP, TCP_CONGESTION, kCc, sizeof kCc - 1);
    if (connect(g.out, (struct sockaddr*)&b, sizeof b) == 0) break;
    if (tries > 500) die("connect");
    close(g.out);
    usleep(10000);
  }
  setsockopt(g.out, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  g.in = accept(ls, NULL, NULL);
  if (g.in < 0) die("accept");
  close(ls);
  return g;
}

/* A token around the ring: every process has reached this point. */
static void ring_sync(const Ring* g) {
  char tok = 1;
  if (g->rank == 0) {
    if (send(g->out, &tok, 1, 0) != 1 || recv(g->in, &tok, 1, MSG_WAITALL) != 1) die("sync");
  } else {
    if (recv(g->in, &tok, 1, MSG_WAITALL) != 1 || send(g->out, &tok, 1, 0) != 1) die("sync");
  }
}

#endif
