#define _POSIX_C_SOURCE 200809L
/* Minimal roccl program: N processes all-reduce a buffer of floats.
 *
 *   cc allreduce.c $(pkg-config --cflags --libs roccl) -o allreduce && ./allreduce 4
 *
 * Here one process creates the unique id and forks the ranks. In a real job, rank 0 calls
 * rocclGetUniqueId and sends the 128 bytes to the others (MPI_Bcast, a shared file, ...),
 * and every process calls rocclCommInitRank with its own rank. */
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "roccl.h"

#define CHECK(call)                                                                      \
  do {                                                                                   \
    rocclResult_t r_ = (call);                                                           \
    if (r_ != rocclSuccess) {                                                            \
      fprintf(stderr, "%s failed: %s (%s)\n", #call, rocclGetErrorString(r_),            \
              rocclGetLastError(NULL));                                                  \
      exit(1);                                                                           \
    }                                                                                    \
  } while (0)

static int run_rank(int rank, int nranks, rocclUniqueId id) {
  rocclComm_t comm;
  CHECK(rocclCommInitRank(&comm, nranks, id, rank));
  size_t count = 1 << 20;
  float* buf = malloc(count * sizeof(float));
  for (size_t i = 0; i < count; i++) buf[i] = (float)rank;
  /* NULL stream: host memory, returns when the all-reduce is complete. */
  CHECK(rocclAllReduce(buf, buf, count, rocclFloat, rocclSum, comm, NULL));
  float want = nranks * (nranks - 1) / 2.0f;
  int ok = buf[0] == want && buf[count - 1] == want;
  if (rank == 0) printf("all-reduce of %zu floats on %d ranks: %s\n", count, nranks, ok ? "ok" : "WRONG");
  free(buf);
  CHECK(rocclCommDestroy(comm));
  fflush(stdout);
  return ok ? 0 : 1;
}

int main(int argc, char** argv) {
  int nranks = argc > 1 ? atoi(argv[1]) : 2;
  if (nranks < 1 || nranks > 64) {
    fprintf(stderr, "usage: %s [nranks 1..64]\n", argv[0]);
    return 2;
  }
  rocclUniqueId id;
  CHECK(rocclGetUniqueId(&id));
  fflush(stdout);
  for (int r = 0; r < nranks; r++)
    if (fork() == 0) _exit(run_rank(r, nranks, id));
  int failed = 0, status;
  while (wait(&status) > 0) failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  return failed ? 1 : 0;
}
