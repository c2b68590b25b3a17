/* tcp-lean: lean collectives over loopback TCP, the best this machine allows
 * a real implementation.
 *
 * tcp-ring streams a collective's bytes with nothing else to do; that is a
 * ceiling no collective reaches, since a collective also has to copy its own
 * block out of place, reduce what it receives, and read and write buffers of
 * its size rather than one cache-hot piece. tcp-lean does exactly that work
 * and nothing more: N processes (forked here) on 127.0.0.2.. joined in a ring
 * of TCP connections, one thread each, no daemon, no client, no messages
 * besides the bytes, every step pipelined into the next in pieces (-p):
 *
 *   all-reduce      ring reduce-scatter then ring all-gather, one stream per
 *                   link: a segment goes out as soon as its last piece is
 *                   reduced; pieces are received into one cache-hot buffer
 *                   and reduced from there into the output (float sum)
 *   all-gather      ring; out of place, the own block is copied first
 *   reduce-scatter  ring; partial sums in two rotating segment buffers
 *   broadcast       chain from rank 0 (N-1 transfers of the size, the fewest
 *                   bytes any TCP broadcast moves); out of place, the root
 *                   copies its input to its output first
 *
 * Output: nccl-tests tables ("# op: NAME" before each, out-of-place and
 * in-place columns, time = the slowest rank's average), so that
 * scripts/bench/compare.py and ceiling.py read it as they read collective-perf,
 * Open MPI and Gloo. The out-of-place result of the last iteration is checked
 * (#wrong); the in-place one is not (N/A: its input is the last output).
 *
 * usage: tcp-lean [-t N] [-b MIN] [-e MAX] [-f FACTOR] [-n ITERS] [-w WARMUP]
 *                 [-p PIECE] [--op all|all-reduce,all-gather,...]
 * Only loopback addresses are used. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <sys/wait.h>

#include "tcp-common.h"

enum { AR, AG, RS, BC, NOPS };
static const char* kNames[NOPS] = {"all-reduce", "all-gather", "reduce-scatter", "broadcast"};

/* One operation's view of the two streams on this rank's links: what the
 * x-th byte sent is read from and where the x-th byte received goes. */
typedef struct {
  int op, n, r;
  uint64_t g;          /* segment bytes: the size / N (broadcast: the size) */
  char *in, *out;      /* the operation's buffers (in == out in place) */
  char* acc[2];        /* reduce-scatter: rotating partial sums */
  float* tmp;          /* one piece, cache-hot: received before reduction */
  size_t piece;
} Op;

static int mod(int a, int n) { return ((a % n) + n) % n; }

/* The bytes this rank sends and receives in all. */
static uint64_t send_total(const Op* o) {
  switch (o->op) {
    case AR: return 2 * (uint64_t)(o->n - 1) * o->g;
    case BC: return o->r + 1 < o->n ? o->g : 0;
    default: return (uint64_t)(o->n - 1) * o->g;
  }
}
static uint64_t recv_total(const Op* o) {
  switch (o->op) {
    case AR: return 2 * (uint64_t)(o->n - 1) * o->g;
    case BC: return o->r > 0 ? o->g : 0;
    default: return (uint64_t)(o->n - 1) * o->g;
  }
}

/* Where the send stream's byte x is read from; *len: bytes contiguous there. */
static const char* send_at(const Op* o, uint64_t x, uint64_t* len) {
  const uint64_t g = o->g, s = x / g, off = x % g;
  *len = g - off;
  const int n = o->n, r = o->r;
  switch (o->op) {
    case AR:
      if (s < (uint64_t)(n - 1)) {  /* reduce-scatter step s: segment r - s */
        const char* src = s == 0 ? o->in : o->out;
        return src + (uint64_t)mod(r - (int)s, n) * g + off;
      }
      return o->out + (uint64_t)mod(r + 1 - (int)(s - (n - 1)), n) * g + off;
    case AG: return o->out + (uint64_t)mod(r - (int)s, n) * g + off;
    case RS:
      if (s == 0) return o->in + (uint64_t)mod(r - 1, n) * g + off;
      return o->acc[(s - 1) % 2] + off;
    default: /* BC */
      *len = g - x;
      return (r == 0 ? o->in : o->out) + x;
  }
}

/* Where the receive stream's byte x goes: straight into place (returned), or
 * into tmp for reduction (NULL; *seg_in, *seg_out: the reduction's operands). */
static char* recv_at(const Op* o, uint64_t x, uint64_t* len, const char** seg_in, char** seg_out) {
  const uint64_t g = o->g, s = x / g, off = x % g;
  *len = g - off;
  const int n = o->n, r = o->r;
  switch (o->op) {
    case AR:
      if (s < (uint64_t)(n - 1)) {
        const uint64_t seg = (uint64_t)mod(r - (int)s - 1, n) * g + off;
        *seg_in = o->in + seg;
        *seg_out = o->out + seg;
        return NULL;
      }
      return o->out + (uint64_t)mod(r - (int)(s - (n - 1)), n) * g + off;
    case AG: return o->out + (uint64_t)mod(r - (int)s - 1, n) * g + off;
    case RS:
      *seg_in = o->in + (uint64_t)mod(r - (int)s - 2, n) * g + off;
      *seg_out = s + 2 == (uint64_t)n ? o->out + off : o->acc[s % 2] + off;
      return NULL;
    default: /* BC */
      *len = g - x;
      return o->out + x;
  }
}

/* How far the send stream may go once `got` bytes are received (and
 * reduced): a step sends what the previous one received. */
static uint64_t send_limit(const Op* o, uint64_t got) {
  switch (o->op) {
    case BC: return o->r == 0 ? o->g : got;
    case RS:
    case AR:
    case AG: return o->g + got;
  }
  return 0;
}

/* How far the receive stream may go once `sent` bytes are out: the
 * reduce-scatter's partial sums reuse a buffer two steps later. */
static uint64_t recv_limit(const Op* o, uint64_t sent) {
  return o->op == RS ? sent + o->g : UINT64_MAX;
}

static void reduce_into(char* out, const char* in, const float* tmp, uint64_t bytes) {
  float* o = (float*)out;
  const float* a = (const float*)in;
  for (uint64_t i = 0; i < bytes / sizeof(float); ++i) o[i] = a[i] + tmp[i];
}

static void run(const Op* o, int out_fd, int in_fd) {
  const uint64_t st = send_total(o), rt = recv_total(o);
  /* done: the bytes received and, where they are reduced, reduced. */
  uint64_t sent = 0, got = 0, done = 0;
  while (sent < st || got < rt) {
    const uint64_t sl = send_limit(o, done), rl = recv_limit(o, sent);
    const int can_send = sent < st && sent < sl, can_recv = got < rt && got < rl;
    struct pollfd p[2] = {{out_fd, can_send ? POLLOUT : 0, 0}, {in_fd, can_recv ? POLLIN : 0, 0}};
    if (poll(p, 2, 10000) <= 0) die("poll (10 s without progress)");
    if (p[0].revents & POLLOUT) {
      uint64_t len;
      const char* src = send_at(o, sent, &len);
      uint64_t n = len;
      if (n > sl - sent) n = sl - sent;
      if (n > o->piece) n = o->piece;
      ssize_t w = send(out_fd, src, n, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (w < 0 && errno != EAGAIN) die("send");
      if (w > 0) sent += (uint64_t)w;
    }
    if (p[1].revents & (POLLIN | POLLHUP | POLLERR)) {
      uint64_t len;
      const char* seg_in = NULL;
      char* seg_out = NULL;
      char* dst = recv_at(o, got, &len, &seg_in, &seg_out);
      uint64_t n = len;
      if (n > rl - got) n = rl - got;
      /* Into tmp: pieces aligned to the segment's start, reduced into place
       * once complete (or at the segment's end). */
      const uint64_t at = dst == NULL ? (got % o->g) % o->piece : 0;
      if (n > o->piece - at) n = o->piece - at;
      ssize_t r = recv(in_fd, dst != NULL ? dst : (char*)o->tmp + at, n, MSG_DONTWAIT);
      if (r == 0) {
        fprintf(stderr, "tcp-lean: left neighbour closed\n");
        exit(1);
      }
      if (r < 0 && errno != EAGAIN) die("recv");
      if (r > 0) {
        got += (uint64_t)r;
        if (dst != NULL) {
          done = got;
        } else if (at + (uint64_t)r == o->piece || (uint64_t)r == len) {
          reduce_into(seg_out - at, seg_in - at, o->tmp, at + (uint64_t)r);
          done = got;
        }
      }
    }
  }
}

/* Input of rank r: small integers, so every sum is exact in float. */
static float input_value(int r, uint64_t i) { return (float)((r + 1) * (int)(1 + i % 7)); }

static int want[NOPS] = {1, 1, 1, 1};  // --op

static int lean_option(const char* opt, const char* val) {
  if (strcmp(opt, "--op") != 0) return 0;
  if (strcmp(val, "all") != 0) {
    for (int k = 0; k < NOPS; ++k) want[k] = strstr(val, kNames[k]) != NULL;
  }
  return 1;
}

int main(int argc, char** argv) {
  Sweep sw = {.n = 4, .iters = 20, .warmup = 5, .minb = 1 << 20, .maxb = 64 << 20, .factor = 2, .piece = 256 << 10};
  if (!sweep_parse(&sw, argc, argv, lean_option, "tcp-lean",
                   "                [-p PIECE (bytes per send/recv call and per reduction, 256K)]\n"
                   "                [--op all|all-reduce,all-gather,reduce-scatter,broadcast]\n",
                   4)) {
    return 2;
  }
  const int n = sw.n, iters = sw.iters, warmup = sw.warmup;
  const uint64_t minb = sw.minb, maxb = sw.maxb, factor = sw.factor, piece_bytes = sw.piece;
  const Ring ring = ring_start(n, 7);
  const int rank = ring.rank, out = ring.out, in = ring.in;

  const size_t piece = (size_t)piece_bytes;
  /* Buffers of the largest size, touched once, as a collective's are. */
  char* inbuf = malloc(maxb);
  char* outbuf = malloc(maxb);
  char* acc0 = malloc(maxb / (uint64_t)n + piece);
  char* acc1 = malloc(maxb / (uint64_t)n + piece);
  float* tmp = malloc(piece);
  if (!inbuf || !outbuf || !acc0 || !acc1 || !tmp) die("malloc");
  memset(outbuf, 0, maxb);
  memset(acc0, 0, maxb / (uint64_t)n + piece);
  memset(acc1, 0, maxb / (uint64_t)n + piece);
  memset(tmp, 0, piece);
  if (rank == 0) {
    printf("# tcp-lean: %d processes on 127.0.0.2.., ring (broadcast: chain from rank 0), float sum, pieces of %zu B\n",
           n, piece);
    printf("# time column: per-rank average over iters, the slowest rank's\n");
  }
  for (int op = 0; op < NOPS; ++op) {
    if (!want[op]) continue;
    if (rank == 0) {
      printf("#\n# op: %s\n", kNames[op]);
      printf("#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong\n");
    }
    for (uint64_t s = minb; s <= maxb; s *= factor) {
      const uint64_t g = op == BC ? s : s / (uint64_t)n;
      const uint64_t in_bytes = op == AG ? g : s;
      double us[2];
      long wrong = 0;
      for (int place = 0; place < 2; ++place) {
        Op o = {.op = op, .n = n, .r = rank, .g = g, .in = inbuf, .out = outbuf, .acc = {acc0, acc1},
                .tmp = tmp, .piece = piece};
        /* In place, nccl-tests' layout: the input is the output (all-gather:
         * the own block of it; reduce-scatter: the output is the own block). */
        float* fin = (float*)inbuf;
        if (place == 1) {
          if (op == AG) o.in = outbuf + (uint64_t)rank * g;
          else if (op == RS) {
            o.in = outbuf;
            o.out = outbuf + (uint64_t)rank * g;
          } else {
            o.in = outbuf;
          }
          fin = (float*)o.in;
        }
        for (uint64_t i = 0; i < in_bytes / 4; ++i) fin[i] = input_value(rank, i);
        for (int it = -warmup - 1; it < iters; ++it) {
          if (it == 0) {
            ring_sync(&ring); /* lines the processes up before timing */
            us[place] = now();
          }
          if (o.op == BC && rank == 0 && o.in != o.out) memcpy(o.out, o.in, s);
          if (o.op == AG && o.in != o.out + (uint64_t)rank * g) memcpy(o.out + (uint64_t)rank * g, o.in, g);
          run(&o, out, in);
        }
        us[place] = (now() - us[place]) * 1e6 / iters;
        if (place == 0) {
          /* Check the out-of-place result. */
          const float* f = (const float*)o.out;
          const uint64_t cnt = (op == RS ? g : s) / 4;
          const float tri = (float)(n * (n + 1) / 2);
          for (uint64_t i = 0; i < cnt; ++i) {
            float want_v;
            switch (op) {
              case AR: want_v = tri * (float)(1 + i % 7); break;
              case AG: want_v = input_value((int)(i * 4 / g), i % (g / 4)); break;
              case RS: want_v = tri * (float)(1 + ((uint64_t)rank * g / 4 + i) % 7); break;
              default: want_v = input_value(0, i); break;
            }
            if (f[i] != want_v) ++wrong;
          }
        }
      }
      /* The slowest rank's times and everyone's wrong elements. */
      double worst[2] = {us[0], us[1]};
      long all_wrong = wrong;
      if (rank != 0) {
        double msg[3] = {us[0], us[1], (double)wrong};
        if (write(ring.report[1], msg, sizeof msg) != sizeof msg) die("report");
      } else {
        for (int r = 1; r < n; ++r) {
          double msg[3];
          if (read(ring.report[0], msg, sizeof msg) != sizeof msg) die("report");
          if (msg[0] > worst[0]) worst[0] = msg[0];
          if (msg[1] > worst[1]) worst[1] = msg[1];
          all_wrong += (long)msg[2];
        }
        const double busf = op == AR ? 2.0 * (n - 1) / n : op == BC ? 1.0 : (double)(n - 1) / n;
        const double alg0 = s / worst[0] / 1e3, alg1 = s / worst[1] / 1e3;
        printf("  %10llu %12llu %9s %7s %7s %8.1f %7.2f %7.2f %6ld %8.1f %7.2f %7.2f %6s\n",
               (unsigned long long)s, (unsigned long long)(s / 4), "float", op == AR || op == RS ? "sum" : "none",
               op == BC ? "0" : "-1", worst[0], alg0, alg0 * busf, all_wrong, worst[1], alg1, alg1 * busf, "N/A");
        fflush(stdout);
      }
    }
  }
  close(out);
  close(in);
  if (rank == 0) {
    int bad = 0, st;
    while (wait(&st) > 0) bad |= !WIFEXITED(st) || WEXITSTATUS(st) != 0;
    return bad;
  }
  return 0;
}
