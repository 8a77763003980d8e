/* The same measurement as roccl-perf, with MPI: for each size, warm-up, then per iteration
 * the time of MPI_Allreduce (or the collective named by argv[1]); per iteration the slowest
 * rank's time (MPI_MAX), then the median. Prints "op bytes time_us busbw_gbs" per size.
 *
 *   mpi_allreduce OP MINBYTES MAXBYTES FACTOR ITERS WARMUP
 *   OP: all_reduce | all_gather | reduce_scatter | broadcast
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, n;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  if (argc < 7) {
    if (rank == 0) fprintf(stderr, "usage: %s OP MIN MAX FACTOR ITERS WARMUP\n", argv[0]);
    MPI_Finalize();
    return 2;
  }
  const char *op = argv[1];
  size_t lo = strtoull(argv[2], 0, 0), hi = strtoull(argv[3], 0, 0);
  int f = atoi(argv[4]), iters = atoi(argv[5]), warm = atoi(argv[6]);
  size_t maxb = hi * (size_t)n + 64;
  float *s = malloc(maxb), *r = malloc(maxb);
  for (size_t i = 0; i < maxb / 4; i++) s[i] = (float)(i % 97 + rank);
  double *t = malloc(sizeof(double) * (size_t)iters);
  for (size_t b = lo; b <= hi; b *= (size_t)f) {
    /* Sizes are totals, as in roccl-perf and nccl-tests: all_gather and reduce_scatter move
     * blocks of b / n bytes per rank. */
    int blocked = !strcmp(op, "all_gather") || !strcmp(op, "reduce_scatter");
    int count = (int)(b / 4 / (blocked ? (size_t)n : 1));
    if (count < 1) count = 1;
    double factor = 1.0;
    for (int it = -warm; it < iters; it++) {
      MPI_Barrier(MPI_COMM_WORLD);
      double t0 = MPI_Wtime();
      if (!strcmp(op, "all_reduce")) {
        MPI_Allreduce(s, r, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        factor = 2.0 * (n - 1) / n;
      } else if (!strcmp(op, "all_gather")) {
        MPI_Allgather(s, count, MPI_FLOAT, r, count, MPI_FLOAT, MPI_COMM_WORLD);
        factor = (double)(n - 1) / n;
      } else if (!strcmp(op, "reduce_scatter")) {
        MPI_Reduce_scatter_block(s, r, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        factor = (double)(n - 1) / n;
      } else {
        MPI_Bcast(s, count, MPI_FLOAT, 0, MPI_COMM_WORLD);
        factor = 1.0;
      }
      double dt = (MPI_Wtime() - t0) * 1e6;
      if (it >= 0) t[it] = dt;
      if (b == 0) break;
    }
    MPI_Allreduce(MPI_IN_PLACE, t, iters, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    qsort(t, (size_t)iters, sizeof(double), cmp);
    double med = t[iters / 2];
    double bytes = blocked ? (double)count * 4 * n : (double)count * 4;
    if (rank == 0) printf("%s %zu %.2f %.3f\n", op, b, med, bytes / med / 1e3 * factor);
    fflush(stdout);
    if (b == 0) break;
  }
  MPI_Finalize();
  return 0;
}
