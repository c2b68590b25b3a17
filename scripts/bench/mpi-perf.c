/*
 * mpi-perf: an MPI anchor for collective-perf. Runs the collectives over host
 * memory with the local MPI library (Debian 12: Open MPI 4.1) and prints the
 * nccl-tests table format (see perf-common.h for the conventions).
 *
 *   mpicc -O2 -o build/bench/mpi-perf bench/mpi-perf.c -lm
 *   mpirun --allow-run-as-root --oversubscribe --bind-to none -np 4 \
 *       --mca btl self,vader build/bench/mpi-perf -b 8 -e 64M -f 4 --op all
 *
 * Mapping to MPI (in-place uses MPI_IN_PLACE wherever MPI defines it):
 *   all-reduce      MPI_Allreduce          in-place: MPI_IN_PLACE as sendbuf
 *   all-gather      MPI_Allgather          in-place: MPI_IN_PLACE, own block at recv+rank*count
 *   reduce-scatter  MPI_Reduce_scatter_block  in-place: MPI_IN_PLACE; the result lands at
 *                   recv[0..count) (NCCL puts it at recv+rank*count)
 *   broadcast       MPI_Bcast; MPI's broadcast is in-place by definition, so the
 *                   out-of-place variant is root: memcpy(send -> recv) + MPI_Bcast(recv)
 *                   (the copy is inside the timing, as NCCL also writes root's recvbuff)
 *   reduce          MPI_Reduce             in-place: MPI_IN_PLACE on the root only
 *   all-to-all      MPI_Alltoall           in-place: MPI_IN_PLACE
 * avg: MPI has no MPI_AVG. It is MPI_SUM followed by a local division of the
 * result by nranks (on every rank for all-reduce/reduce-scatter, on the root
 * for reduce), and the division is inside the timing.
 */
#include <mpi.h>

#include "perf-common.h"

static MPI_Datatype mpi_type(int dt) {
  switch (dt) {
    case DT_INT8: return MPI_INT8_T;
    case DT_UINT8: return MPI_UINT8_T;
    case DT_INT32: return MPI_INT32_T;
    case DT_UINT32: return MPI_UINT32_T;
    case DT_INT64: return MPI_INT64_T;
    case DT_UINT64: return MPI_UINT64_T;
    case DT_FLOAT: return MPI_FLOAT;
    default: return MPI_DOUBLE;
  }
}

static MPI_Op mpi_op(int redop) {
  switch (redop) {
    case RO_PROD: return MPI_PROD;
    case RO_MAX: return MPI_MAX;
    case RO_MIN: return MPI_MIN;
    default: return MPI_SUM; /* sum, and avg = sum + local division */
  }
}

static int g_rank, g_size;

static int mpi_run(int op, int in_place, const void* send, void* recv, size_t count, int dt, int redop,
                   int root) {
  MPI_Datatype t = mpi_type(dt);
  MPI_Op o = mpi_op(redop);
  int c = (int)count, rc = MPI_SUCCESS;
  size_t esz = perf_dtype_sizes[dt];
  if (count > (size_t)0x7fffffff) return 1;
  switch (op) {
    case OP_ALL_REDUCE:
      rc = MPI_Allreduce(in_place ? MPI_IN_PLACE : send, recv, c, t, o, MPI_COMM_WORLD);
      if (redop == RO_AVG) perf_divide(recv, dt, count, g_size);
      break;
    case OP_ALL_GATHER:
      if (in_place)
        rc = MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, recv, c, t, MPI_COMM_WORLD);
      else
        rc = MPI_Allgather(send, c, t, recv, c, t, MPI_COMM_WORLD);
      break;
    case OP_REDUCE_SCATTER:
      rc = MPI_Reduce_scatter_block(in_place ? MPI_IN_PLACE : send, recv, c, t, o, MPI_COMM_WORLD);
      if (redop == RO_AVG) perf_divide(recv, dt, count, g_size);
      break;
    case OP_BROADCAST:
      if (!in_place && g_rank == root && send != recv) memcpy(recv, send, count * esz);
      rc = MPI_Bcast(recv, c, t, root, MPI_COMM_WORLD);
      break;
    case OP_REDUCE:
      if (in_place)
        rc = MPI_Reduce(g_rank == root ? MPI_IN_PLACE : recv, recv, c, t, o, root, MPI_COMM_WORLD);
      else
        rc = MPI_Reduce(send, recv, c, t, o, root, MPI_COMM_WORLD);
      if (redop == RO_AVG && g_rank == root) perf_divide(recv, dt, count, g_size);
      break;
    case OP_ALL_TO_ALL:
      if (in_place)
        rc = MPI_Alltoall(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, recv, c, t, MPI_COMM_WORLD);
      else
        rc = MPI_Alltoall(send, c, t, recv, c, t, MPI_COMM_WORLD);
      break;
  }
  return rc != MPI_SUCCESS;
}

static void mpi_barrier(void) { MPI_Barrier(MPI_COMM_WORLD); }

static double mpi_allreduce_time(double v, int mode) {
  double out = v;
  switch (mode) {
    case 0: MPI_Bcast(&out, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD); break;
    case 1: MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD); out /= g_size; break;
    case 2: MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD); break;
    default: MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD); break;
  }
  return out;
}

static int64_t mpi_sum_i64(int64_t v) {
  int64_t out = 0;
  MPI_Allreduce(&v, &out, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  return out;
}

static void mpi_describe(FILE* f) {
  char lib[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(lib, &len);
  char* nl = strchr(lib, '\n');
  if (nl) *nl = 0;
  char* comma = strchr(lib, ',');
  if (comma) *comma = 0;
  fprintf(f, "# library: %s; host memory; avg = MPI_SUM + local division\n", lib);
  fprintf(f, "# Using devices\n");
  char host[256] = "?";
  gethostname(host, sizeof host);
  int r;
  for (r = 0; r < g_size; r++) fprintf(f, "#  Rank %2d Group  0 on %10s device cpu\n", r, host);
}

int main(int argc, char** argv) {
  struct perf_args a;
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  int pr = perf_parse_args(argc, argv, &a);
  if (pr != 0) {
    MPI_Finalize();
    return pr > 0 ? 0 : 2;
  }
  struct perf_backend b;
  memset(&b, 0, sizeof b);
  b.name = "mpi-perf";
  b.rank = g_rank;
  b.nranks = g_size;
  for (int op = 0; op < OP_COUNT; op++) b.supported[op] = 1;
  b.run = mpi_run;
  b.barrier = mpi_barrier;
  b.allreduce_time = mpi_allreduce_time;
  b.allreduce_sum_i64 = mpi_sum_i64;
  b.describe = mpi_describe;
  int rc = perf_main(&b, &a);
  MPI_Finalize();
  return rc;
}
