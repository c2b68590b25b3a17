/*
 * perf-common.h -- the backend-independent half of the host-memory anchor
 * benchmarks (bench/mpi-perf.c, bench/gloo-perf.cc).
 *
 * It reproduces what nccl-tests (src/common.cu and the per-collective files)
 * does, on host memory instead of GPU memory:
 *   - option parsing: -b -e -f -i -n -w -d -o -r -c -a --op (sizes take K/M/G,
 *     powers of 1024, as nccl-tests' parsesize does);
 *   - the per-collective byte/element conventions of getCollByteCount: the
 *     printed size of all-gather, reduce-scatter and all-to-all is the whole
 *     array (per-rank count * nranks * element size) and the count column is
 *     the per-rank count, so "-b 8" with 4 float ranks prints a 0-byte row;
 *   - the timing loop: warm-up at max and min size, then per size and per
 *     placement (out-of-place, then in-place): init data, one untimed call,
 *     barrier, `iters` back-to-back calls on a buffer offset that rotates
 *     through the allocation (nccl-tests' shift, to avoid always-hot caches),
 *     then time/iters;
 *   - the check: fresh data, one call, every rank compares its output with
 *     the expected values, #wrong is the sum over ranks;
 *   - the table format (Reporter in common.cu) and the footer lines.
 *
 * Time column: each rank's wall time for the `iters` calls divided by iters,
 * then reduced across ranks with MAX by default (-a 3). nccl-tests' -a
 * selects 0=rank 0, 1=mean (its default), 2=min, 3=max; all are supported.
 * algbw = bytes / time (GB = 1e9 B); busbw = algbw * factor, factor
 * 2(n-1)/n for all-reduce, (n-1)/n for all-gather, reduce-scatter and
 * all-to-all, 1 for broadcast and reduce.
 *
 * Test data: element i of rank r is a small integer (0..10; for prod 1 or
 * 2), so every reduction is exact in every type and the check can compare
 * for equality (floating types get a 1e-6 relative tolerance only for avg).
 *
 * A backend fills struct perf_backend and calls perf_main().
 * Usable from C99 and C++11.
 */
#ifndef COLLECTIVED_BENCH_PERF_COMMON_H
#define COLLECTIVED_BENCH_PERF_COMMON_H

#include <getopt.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum perf_op {
  OP_ALL_REDUCE = 0,
  OP_ALL_GATHER,
  OP_REDUCE_SCATTER,
  OP_BROADCAST,
  OP_REDUCE,
  OP_ALL_TO_ALL,
  OP_COUNT
};
static const char* const perf_op_names[OP_COUNT] = {
    "all-reduce", "all-gather", "reduce-scatter", "broadcast", "reduce", "all-to-all"};
/* Names nccl-tests' binaries print in "# Collective test concluded: ...". */
static const char* const perf_op_testnames[OP_COUNT] = {
    "all_reduce_perf", "all_gather_perf", "reduce_scatter_perf",
    "broadcast_perf", "reduce_perf", "alltoall_perf"};

enum perf_dtype {
  DT_INT8 = 0, DT_UINT8, DT_INT32, DT_UINT32, DT_INT64, DT_UINT64, DT_FLOAT, DT_DOUBLE, DT_COUNT
};
static const char* const perf_dtype_names[DT_COUNT] = {
    "int8", "uint8", "int32", "uint32", "int64", "uint64", "float", "double"};
static const size_t perf_dtype_sizes[DT_COUNT] = {1, 1, 4, 4, 8, 8, 4, 8};

enum perf_redop { RO_SUM = 0, RO_PROD, RO_MAX, RO_MIN, RO_AVG, RO_COUNT };
static const char* const perf_redop_names[RO_COUNT] = {"sum", "prod", "max", "min", "avg"};

struct perf_args {
  size_t min_bytes, max_bytes, step_bytes, step_factor;
  int iters, warmup, check, average, root;
  int dtype, redop;
  int ops[OP_COUNT]; /* which ops to run */
  int nranks_request; /* -t / --np: processes to start (backends that launch themselves) */
};

/* What a backend provides. rank/nranks are set by the backend before
 * perf_main(). run() performs one collective; it returns 0 on success and
 * non-zero on an error (reported and fatal). The pointers follow nccl-tests:
 *   all-reduce, broadcast, reduce: count elements in send and recv;
 *   all-gather: send has count, recv has count*n; in-place send == recv+rank*count;
 *   reduce-scatter: send has count*n, recv has count; in-place send == recv
 *     (nccl-tests puts the result at recv+rank*count; MPI and Gloo put it at
 *     recv[0], so in-place checks recv[0..count)) -- see check_output();
 *   all-to-all: send and recv have count*n; in-place send == recv.
 * For broadcast in-place, send == recv. */
struct perf_backend {
  const char* name;       /* e.g. "mpi-perf" */
  int rank, nranks;
  int supported[OP_COUNT]; /* 0 = not offered by this library */
  const char* unsupported_why[OP_COUNT];
  int no_shift[OP_COUNT]; /* 1: keep one buffer address (APIs that bind buffers at setup) */
  int (*run)(int op, int in_place, const void* send, void* recv, size_t count, int dtype,
             int redop, int root);
  void (*barrier)(void);
  double (*allreduce_time)(double local, int mode); /* mode: -a value */
  int64_t (*allreduce_sum_i64)(int64_t v);
  void (*describe)(FILE* f); /* optional extra '#' lines */
};

static double perf_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double perf_parsesize(const char* value) {
  double size;
  char lit[2] = {0, 0};
  int n = sscanf(value, "%lf %1s", &size, lit);
  double units;
  if (n == 2) {
    switch (lit[0]) {
      case 'G': case 'g': units = 1024.0 * 1024 * 1024; break;
      case 'M': case 'm': units = 1024.0 * 1024; break;
      case 'K': case 'k': units = 1024.0; break;
      default: return -1.0;
    }
  } else if (n == 1) {
    units = 1;
  } else {
    return -1.0;
  }
  return size * units;
}

/* ---- element access; values are small integers, exact in every type ---- */
static void perf_set(void* buf, int dt, size_t i, double v) {
  switch (dt) {
    case DT_INT8: ((int8_t*)buf)[i] = (int8_t)v; break;
    case DT_UINT8: ((uint8_t*)buf)[i] = (uint8_t)v; break;
    case DT_INT32: ((int32_t*)buf)[i] = (int32_t)v; break;
    case DT_UINT32: ((uint32_t*)buf)[i] = (uint32_t)v; break;
    case DT_INT64: ((int64_t*)buf)[i] = (int64_t)v; break;
    case DT_UINT64: ((uint64_t*)buf)[i] = (uint64_t)v; break;
    case DT_FLOAT: ((float*)buf)[i] = (float)v; break;
    case DT_DOUBLE: ((double*)buf)[i] = v; break;
  }
}
static double perf_get(const void* buf, int dt, size_t i) {
  switch (dt) {
    case DT_INT8: return ((const int8_t*)buf)[i];
    case DT_UINT8: return ((const uint8_t*)buf)[i];
    case DT_INT32: return ((const int32_t*)buf)[i];
    case DT_UINT32: return ((const uint32_t*)buf)[i];
    case DT_INT64: return (double)((const int64_t*)buf)[i];
    case DT_UINT64: return (double)((const uint64_t*)buf)[i];
    case DT_FLOAT: return ((const float*)buf)[i];
    case DT_DOUBLE: return ((const double*)buf)[i];
  }
  return NAN;
}

/* In-place avg helper for backends without a native avg: x[i] /= n, in the
 * element type (integer types truncate, like NCCL's integer avg). */
static void perf_divide(void* buf, int dt, size_t count, int n) {
  size_t i;
  switch (dt) {
#define PERF_DIV_CASE(tag, T) \
  case tag: { T* p = (T*)buf; for (i = 0; i < count; i++) p[i] = (T)(p[i] / (T)n); } break;
    PERF_DIV_CASE(DT_INT8, int8_t)
    PERF_DIV_CASE(DT_UINT8, uint8_t)
    PERF_DIV_CASE(DT_INT32, int32_t)
    PERF_DIV_CASE(DT_UINT32, uint32_t)
    PERF_DIV_CASE(DT_INT64, int64_t)
    PERF_DIV_CASE(DT_UINT64, uint64_t)
    PERF_DIV_CASE(DT_FLOAT, float)
    PERF_DIV_CASE(DT_DOUBLE, double)
#undef PERF_DIV_CASE
  }
}

/* Value of element i contributed by rank r (rep varies it between checks). */
static double perf_val(int r, size_t i, int redop, int rep) {
  if (redop == RO_PROD) return ((i + (size_t)r * 3 + (size_t)rep) % 5 == 0) ? 2.0 : 1.0;
  return (double)((i * 7 + (size_t)r * 13 + (size_t)rep) % 11);
}

/* Expected reduction over all ranks of element i. */
static double perf_expect_red(int n, size_t i, int dt, int redop, int rep) {
  double acc = perf_val(0, i, redop, rep);
  int r;
  for (r = 1; r < n; r++) {
    double v = perf_val(r, i, redop, rep);
    switch (redop) {
      case RO_SUM: case RO_AVG: acc += v; break;
      case RO_PROD: acc *= v; break;
      case RO_MAX: acc = v > acc ? v : acc; break;
      case RO_MIN: acc = v < acc ? v : acc; break;
    }
  }
  if (redop == RO_AVG) {
    acc /= n;
    if (dt != DT_FLOAT && dt != DT_DOUBLE) acc = floor(acc); /* values are >= 0 */
  }
  return acc;
}

static int perf_equal(double got, double want, int dt, int redop) {
  if ((dt == DT_FLOAT || dt == DT_DOUBLE) && redop == RO_AVG)
    return fabs(got - want) <= 1e-6 * fabs(want) + 1e-12;
  return got == want;
}

static const char* perf_redop_column(int op, int redop) {
  if (op == OP_ALL_REDUCE || op == OP_REDUCE || op == OP_REDUCE_SCATTER)
    return perf_redop_names[redop];
  return "none";
}

static int perf_op_has_root(int op) { return op == OP_BROADCAST || op == OP_REDUCE; }

/* nccl-tests getCollByteCount: from the nominal size in elements to
 * send/recv element counts and the per-call count parameter. */
static void perf_counts(int op, size_t count, int n, size_t* send, size_t* recv, size_t* param) {
  switch (op) {
    case OP_ALL_GATHER:
      *send = count / n; *recv = (count / n) * n; *param = count / n; break;
    case OP_REDUCE_SCATTER:
      *send = (count / n) * n; *recv = count / n; *param = count / n; break;
    case OP_ALL_TO_ALL:
      *send = (count / n) * n; *recv = (count / n) * n; *param = count / n; break;
    default:
      *send = count; *recv = count; *param = count; break;
  }
}

static void perf_bw(int op, size_t param, size_t esz, double sec, int n, double* alg, double* bus) {
  double bytes, factor;
  switch (op) {
    case OP_ALL_REDUCE: bytes = (double)param * esz; factor = 2.0 * (n - 1) / n; break;
    case OP_ALL_GATHER: case OP_REDUCE_SCATTER: case OP_ALL_TO_ALL:
      bytes = (double)param * esz * n; factor = (double)(n - 1) / n; break;
    default: bytes = (double)param * esz; factor = 1.0; break;
  }
  *alg = sec > 0 ? bytes / 1.0e9 / sec : 0.0;
  *bus = *alg * factor;
}

/* Fill inputs (and poison outputs) for one call on buffers send/recv
 * (already shifted). */
static void perf_init(const struct perf_backend* b, int op, int in_place, void* send, void* recv,
                      size_t param, int dt, int redop, int root, int rep) {
  int n = b->nranks, me = b->rank;
  size_t esz = perf_dtype_sizes[dt], i;
  size_t sendc, recvc, p;
  perf_counts(op, param * (op == OP_ALL_GATHER || op == OP_REDUCE_SCATTER || op == OP_ALL_TO_ALL ? (size_t)n : 1), n,
              &sendc, &recvc, &p);
  /* poison the output area (0xA5 bytes: never an expected value) */
  memset(recv, 0xA5, (sendc > recvc ? sendc : recvc) * esz);
  switch (op) {
    case OP_ALL_REDUCE: case OP_REDUCE:
      for (i = 0; i < param; i++) perf_set(in_place ? recv : send, dt, i, perf_val(me, i, redop, rep));
      break;
    case OP_BROADCAST:
      if (me == root)
        for (i = 0; i < param; i++) perf_set(in_place ? recv : send, dt, i, perf_val(me, i, redop, rep));
      break;
    case OP_ALL_GATHER:
      for (i = 0; i < param; i++)
        perf_set(in_place ? (char*)recv + (size_t)me * param * esz : (char*)send, dt, i,
                 perf_val(me, i, redop, rep));
      break;
    case OP_REDUCE_SCATTER: case OP_ALL_TO_ALL:
      for (i = 0; i < param * n; i++) perf_set(in_place ? recv : send, dt, i, perf_val(me, i, redop, rep));
      break;
  }
}

static int64_t perf_check(const struct perf_backend* b, int op, const void* recv, size_t param, int dt,
                          int redop, int root, int rep) {
  int n = b->nranks, me = b->rank, p;
  size_t i;
  int64_t wrong = 0;
  switch (op) {
    case OP_ALL_REDUCE:
      for (i = 0; i < param; i++)
        if (!perf_equal(perf_get(recv, dt, i), perf_expect_red(n, i, dt, redop, rep), dt, redop)) wrong++;
      break;
    case OP_REDUCE:
      if (me == root)
        for (i = 0; i < param; i++)
          if (!perf_equal(perf_get(recv, dt, i), perf_expect_red(n, i, dt, redop, rep), dt, redop)) wrong++;
      break;
    case OP_BROADCAST:
      for (i = 0; i < param; i++)
        if (perf_get(recv, dt, i) != perf_val(root, i, redop, rep)) wrong++;
      break;
    case OP_ALL_GATHER:
      for (p = 0; p < n; p++)
        for (i = 0; i < param; i++)
          if (perf_get(recv, dt, (size_t)p * param + i) != perf_val(p, i, redop, rep)) wrong++;
      break;
    case OP_REDUCE_SCATTER:
      for (i = 0; i < param; i++)
        if (!perf_equal(perf_get(recv, dt, i),
                        perf_expect_red(n, (size_t)me * param + i, dt, redop, rep), dt, redop))
          wrong++;
      break;
    case OP_ALL_TO_ALL:
      for (p = 0; p < n; p++)
        for (i = 0; i < param; i++)
          if (perf_get(recv, dt, (size_t)p * param + i) != perf_val(p, (size_t)me * param + i, redop, rep))
            wrong++;
      break;
  }
  return wrong;
}

/* Buffers passed to run() for one call, following nccl-tests' in-place
 * offsets. */
static void perf_ptrs(int op, int in_place, int me, size_t param, size_t esz, char* sendb, char* recvb,
                      const void** s, void** r) {
  *r = recvb;
  if (!in_place) { *s = sendb; return; }
  if (op == OP_ALL_GATHER) *s = recvb + (size_t)me * param * esz;
  else *s = recvb;
}

static void perf_fatal(const struct perf_backend* b, const char* what, int op) {
  fprintf(stderr, "%s: rank %d: %s failed (op %s)\n", b->name, b->rank, what, perf_op_names[op]);
  fflush(stderr);
  exit(2);
}

static void perf_timestr(double us, char* out) {
  if (us >= 10000.0) sprintf(out, "%7.0f", us);
  else if (us >= 100.0) sprintf(out, "%7.1f", us);
  else sprintf(out, "%7.2f", us);
}

static void perf_usage(const char* prog, FILE* f) {
  fprintf(f,
          "USAGE: %s\n"
          "\t[-b,--minbytes <min size in bytes, K/M/G suffixes>]\n"
          "\t[-e,--maxbytes <max size in bytes>]\n"
          "\t[-i,--stepbytes <increment size>]\n"
          "\t[-f,--stepfactor <increment factor>]\n"
          "\t[-n,--iters <iteration count>]\n"
          "\t[-w,--warmup_iters <warmup iteration count>]\n"
          "\t[-c,--check <0/1>]\n"
          "\t[-d,--datatype <int8/uint8/int32/uint32/int64/uint64/float/double>]\n"
          "\t[-o,--redop <sum/prod/min/max/avg>]\n"
          "\t[-r,--root <root>]\n"
          "\t[-a,--average <0/1/2/3> time across ranks: 0=rank0 1=mean 2=min 3=max (default 3)]\n"
          "\t[-t,--np <ranks to start> (self-launching backends only)]\n"
          "\t[--op all-reduce|all-gather|reduce-scatter|broadcast|reduce|all-to-all|all (default all-reduce)]\n"
          "\t[-h,--help]\n",
          prog);
}

/* Returns 0 on success, 1 to exit 0 (help), -1 on error. */
static int perf_parse_args(int argc, char** argv, struct perf_args* a) {
  static struct option longopts[] = {
      {"minbytes", required_argument, 0, 'b'}, {"maxbytes", required_argument, 0, 'e'},
      {"stepbytes", required_argument, 0, 'i'}, {"stepfactor", required_argument, 0, 'f'},
      {"iters", required_argument, 0, 'n'},    {"warmup_iters", required_argument, 0, 'w'},
      {"check", required_argument, 0, 'c'},    {"datatype", required_argument, 0, 'd'},
      {"redop", required_argument, 0, 'o'},    {"root", required_argument, 0, 'r'},
      {"average", required_argument, 0, 'a'},  {"np", required_argument, 0, 't'},
      {"op", required_argument, 0, 'O'},       {"help", no_argument, 0, 'h'},
      {0, 0, 0, 0}};
  int c, k;
  double parsed;
  memset(a, 0, sizeof(*a));
  a->min_bytes = 32u << 20; a->max_bytes = 32u << 20; a->step_bytes = 1u << 20; a->step_factor = 1;
  a->iters = 20; a->warmup = 5; a->check = 1; a->average = 3; a->root = 0;
  a->dtype = DT_FLOAT; a->redop = RO_SUM; a->nranks_request = 0;
  int any_op = 0;
  optind = 1;
  while ((c = getopt_long(argc, argv, "b:e:i:f:n:w:c:d:o:r:a:t:h", longopts, NULL)) != -1) {
    switch (c) {
      case 'b': case 'e':
        parsed = perf_parsesize(optarg);
        if (parsed < 0) { fprintf(stderr, "invalid size '%s'\n", optarg); return -1; }
        if (c == 'b') a->min_bytes = (size_t)parsed; else a->max_bytes = (size_t)parsed;
        break;
      case 'i': a->step_bytes = strtoul(optarg, NULL, 0); break;
      case 'f': a->step_factor = strtoul(optarg, NULL, 0); break;
      case 'n': a->iters = (int)strtol(optarg, NULL, 0); break;
      case 'w': a->warmup = (int)strtol(optarg, NULL, 0); break;
      case 'c': a->check = (int)strtol(optarg, NULL, 0); break;
      case 'r': a->root = (int)strtol(optarg, NULL, 0); break;
      case 'a': a->average = (int)strtol(optarg, NULL, 0); break;
      case 't': a->nranks_request = (int)strtol(optarg, NULL, 0); break;
      case 'd':
        for (k = 0; k < DT_COUNT; k++) if (!strcmp(optarg, perf_dtype_names[k])) break;
        if (k == DT_COUNT && !strcmp(optarg, "float32")) k = DT_FLOAT;
        if (k == DT_COUNT && !strcmp(optarg, "float64")) k = DT_DOUBLE;
        if (k == DT_COUNT) { fprintf(stderr, "unsupported datatype '%s'\n", optarg); return -1; }
        a->dtype = k;
        break;
      case 'o':
        for (k = 0; k < RO_COUNT; k++) if (!strcmp(optarg, perf_redop_names[k])) break;
        if (k == RO_COUNT) { fprintf(stderr, "unsupported redop '%s'\n", optarg); return -1; }
        a->redop = k;
        break;
      case 'O':
        if (!strcmp(optarg, "all")) {
          for (k = 0; k < OP_COUNT; k++) a->ops[k] = 1;
        } else {
          for (k = 0; k < OP_COUNT; k++) if (!strcmp(optarg, perf_op_names[k])) break;
          if (k == OP_COUNT) { fprintf(stderr, "unknown --op '%s'\n", optarg); return -1; }
          a->ops[k] = 1;
        }
        any_op = 1;
        break;
      case 'h': perf_usage(argv[0], stdout); return 1;
      default: perf_usage(argv[0], stderr); return -1;
    }
  }
  if (!any_op) a->ops[OP_ALL_REDUCE] = 1;
  if (a->min_bytes > a->max_bytes) {
    fprintf(stderr, "invalid sizes for 'minbytes' and 'maxbytes': %zu > %zu\n", a->min_bytes, a->max_bytes);
    return -1;
  }
  if (a->iters < 1) a->iters = 1;
  if (a->step_factor < 1) a->step_factor = 1;
  return 0;
}

/* One timed + checked measurement; prints "  time  algbw  busbw  #wrong". */
static double perf_bench_time(const struct perf_backend* b, const struct perf_args* a, int op, int in_place,
                              char* sendb, char* recvb, size_t param, int64_t* errors, int* rep) {
  int dt = a->dtype, redop = a->redop, root = a->root, n = b->nranks, it;
  size_t esz = perf_dtype_sizes[dt];
  size_t sendc, recvc, p0;
  perf_counts(op, param * ((op == OP_ALL_GATHER || op == OP_REDUCE_SCATTER || op == OP_ALL_TO_ALL) ? (size_t)n : 1),
              n, &sendc, &recvc, &p0);
  size_t total = (sendc > recvc ? sendc : recvc) * esz;
  size_t steps = total ? a->max_bytes / total : 1;
  if (steps == 0 || b->no_shift[op]) steps = 1;
  const void* s;
  void* r;

  if (a->check) perf_init(b, op, in_place, sendb, recvb, param, dt, redop, root, 99);
  perf_ptrs(op, in_place, b->rank, param, esz, sendb, recvb, &s, &r);
  if (b->run(op, in_place, s, r, param, dt, redop, root)) perf_fatal(b, "sync call", op);
  b->barrier();

  double t0 = perf_now();
  for (it = 0; it < a->iters; it++) {
    size_t shift = total * ((size_t)it % steps);
    perf_ptrs(op, in_place, b->rank, param, esz, sendb + shift, recvb + shift, &s, &r);
    if (b->run(op, in_place, s, r, param, dt, redop, root)) perf_fatal(b, "timed call", op);
  }
  double sec = (perf_now() - t0) / a->iters;
  sec = b->allreduce_time(sec, a->average);

  double alg, bus;
  perf_bw(op, param, esz, sec, n, &alg, &bus);

  int64_t wrong = 0;
  if (a->check) {
    (*rep)++;
    perf_init(b, op, in_place, sendb, recvb, param, dt, redop, root, *rep);
    perf_ptrs(op, in_place, b->rank, param, esz, sendb, recvb, &s, &r);
    if (b->run(op, in_place, s, r, param, dt, redop, root)) perf_fatal(b, "check call", op);
    wrong = perf_check(b, op, recvb, param, dt, redop, root, *rep);
    wrong = b->allreduce_sum_i64(wrong);
    if (wrong) (*errors)++;
  }

  if (b->rank == 0) {
    char ts[32];
    perf_timestr(sec * 1e6, ts);
    if (a->check) printf("  %7s  %6.2f  %6.2f  %5li", ts, alg, bus, (long)wrong);
    else printf("  %7s  %6.2f  %6.2f  %5s", ts, alg, bus, "N/A");
  }
  return bus;
}

static void perf_print_header(void) {
  printf("# %10s  %12s  %8s  %6s  %6s           out-of-place                       in-place          \n",
         "", "", "", "", "");
  printf("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s %6s  %7s  %6s  %6s %6s\n", "size", "count", "type",
         "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong");
  printf("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %5s  %7s  %6s  %6s  %5s\n", "(B)", "(elements)", "", "",
         "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "");
}

/* Runs every selected op; returns the process exit code. */
static int perf_main(struct perf_backend* b, const struct perf_args* a) {
  int op, n = b->nranks, me = b->rank, failed = 0;
  size_t esz = perf_dtype_sizes[a->dtype];
  /* every buffer is max_bytes, like nccl-tests (the shift keeps calls inside) */
  size_t alloc = a->max_bytes ? a->max_bytes : esz;
  char* sendb = (char*)aligned_alloc(4096, (alloc + 4095) / 4096 * 4096);
  char* recvb = (char*)aligned_alloc(4096, (alloc + 4095) / 4096 * 4096);
  if (!sendb || !recvb) { fprintf(stderr, "%s: out of memory\n", b->name); return 2; }
  memset(sendb, 0, alloc);
  memset(recvb, 0, alloc);
  if (a->root < 0 || a->root >= n) { if (me == 0) fprintf(stderr, "%s: bad root %d\n", b->name, a->root); return 2; }

  setvbuf(stdout, NULL, _IOLBF, 0);
  if (me == 0) {
    printf("# %s: nranks %d minBytes %zu maxBytes %zu step: %zu(%s) warmup iters: %d iters: %d validation: %d\n",
           b->name, n, a->min_bytes, a->max_bytes, a->step_factor > 1 ? a->step_factor : a->step_bytes,
           a->step_factor > 1 ? "factor" : "bytes", a->warmup, a->iters, a->check);
    printf("# time column: per-rank average over iters, reduced across ranks with %s (-a %d)\n",
           a->average == 0 ? "rank 0's value" : a->average == 1 ? "MEAN" : a->average == 2 ? "MIN" : "MAX",
           a->average);
    if (b->describe) b->describe(stdout);
    printf("#\n");
  }

  for (op = 0; op < OP_COUNT; op++) {
    if (!a->ops[op]) continue;
    if (!b->supported[op]) {
      if (me == 0)
        printf("# op: %s\n# SKIPPED: %s does not offer %s (%s)\n#\n", perf_op_names[op], b->name, perf_op_names[op],
               b->unsupported_why[op] ? b->unsupported_why[op] : "unsupported");
      continue;
    }
    int64_t errors = 0;
    double bwsum = 0;
    int bwcount = 0, rep = 0, it;
    int root = perf_op_has_root(op) ? a->root : -1;
    size_t sendc, recvc, param;
    const void* s;
    void* r;
    if (me == 0) {
      printf("# op: %s\n", perf_op_names[op]);
      perf_print_header();
    }
    b->barrier();
    /* warm-up at max size, then min size (out-of-place), like nccl-tests */
    size_t wsizes[2] = {a->max_bytes, a->min_bytes};
    for (int w = 0; w < 2; w++) {
      perf_counts(op, wsizes[w] / esz, n, &sendc, &recvc, &param);
      for (it = 0; it < a->warmup; it++) {
        perf_ptrs(op, 0, me, param, esz, sendb, recvb, &s, &r);
        if (b->run(op, 0, s, r, param, a->dtype, a->redop, a->root)) perf_fatal(b, "warm-up call", op);
      }
    }
    for (size_t size = a->min_bytes; size <= a->max_bytes;
         size = (a->step_factor > 1) ? size * a->step_factor : size + a->step_bytes) {
      perf_counts(op, size / esz, n, &sendc, &recvc, &param);
      size_t shown = (sendc > recvc ? sendc : recvc) * esz;
      if (me == 0)
        printf("%12zu  %12zu  %8s  %6s  %6i", shown, param, perf_dtype_names[a->dtype],
               perf_redop_column(op, a->redop), root);
      bwsum += perf_bench_time(b, a, op, 0, sendb, recvb, param, &errors, &rep);
      bwsum += perf_bench_time(b, a, op, 1, sendb, recvb, param, &errors, &rep);
      bwcount += 2;
      if (me == 0) printf("\n");
      if (size == 0) break; /* 0 * factor would loop forever */
    }
    if (me == 0) {
      printf("# Out of bounds values : %d %s\n", (int)errors, errors ? "FAILED" : "OK");
      printf("# Avg bus bandwidth    : %g \n", bwcount ? bwsum / bwcount : 0.0);
      printf("#\n");
      printf("# Collective test concluded: %s\n", perf_op_testnames[op]);
      printf("#\n");
    }
    if (errors) failed = 1;
    b->barrier();
  }
  free(sendb);
  free(recvb);
  return failed ? 1 : 0;
}

#endif
