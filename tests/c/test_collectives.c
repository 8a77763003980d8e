#define _POSIX_C_SOURCE 200809L
/* Every collective from C with ranks as forked processes: exact expected values for several
 * data types and ops, in place and out of place, zero counts, CommSplit, a Send/Recv ring in
 * a group, bad arguments and their codes, non-blocking init, and abort. */
#include <pthread.h>
#include <time.h>

#include "common.h"

static const rocclDataType_t TYPES[] = {rocclInt8, rocclUint8, rocclInt32, rocclUint64,
                                        rocclFloat16, rocclBfloat16, rocclFloat32, rocclFloat64};
static const rocclRedOp_t OPS[] = {rocclSum, rocclProd, rocclMax, rocclMin, rocclAvg};
#define NTYPES (sizeof(TYPES) / sizeof(TYPES[0]))

static void check_buf(const char* what, rocclDataType_t t, const void* buf, size_t count,
                      double (*want)(rocclDataType_t, rocclRedOp_t, int, int, size_t),
                      rocclRedOp_t op, int n, int r) {
  for (size_t i = 0; i < count; i++) {
    double g = get_val(t, buf, i), w = want(t, op, n, r, i);
    EXPECT(close_to(t, g, w), "%s type %d op %d rank %d elem %zu: got %g want %g", what, (int)t,
           (int)op, r, i, g, w);
  }
}

static double want_reduced(rocclDataType_t t, rocclRedOp_t op, int n, int r, size_t i) {
  (void)r;
  return reduced(t, op, n, i);
}

static void collectives(rocclComm_t comm, int r, int n) {
  const size_t C = 1003;
  for (size_t ti = 0; ti < NTYPES; ti++) {
    rocclDataType_t t = TYPES[ti];
    size_t es = type_size(t);
    char* send = malloc(n * C * es);
    char* recv = malloc(n * C * es);
    for (int oi = 0; oi < 5; oi++) {
      rocclRedOp_t op = OPS[oi];
      /* all-reduce out of place, then in place */
      for (size_t i = 0; i < C; i++) set_val(t, send, i, val(t, op, r, i));
      CHECK(rocclAllReduce(send, recv, C, t, op, comm, NULL));
      check_buf("allreduce", t, recv, C, want_reduced, op, n, r);
      for (size_t i = 0; i < 17; i++) set_val(t, recv, i, val(t, op, r, i));
      CHECK(rocclAllReduce(recv, recv, 17, t, op, comm, NULL));
      check_buf("allreduce in place", t, recv, 17, want_reduced, op, n, r);
      /* reduce to the last rank; recvbuff NULL elsewhere */
      int root = n - 1;
      CHECK(rocclReduce(send, r == root ? recv : NULL, C, t, op, root, comm, NULL));
      if (r == root) check_buf("reduce", t, recv, C, want_reduced, op, n, r);
      /* reduce-scatter out of place and in place */
      for (size_t j = 0; j < (size_t)n * 21; j++) set_val(t, send, j, val(t, op, r, j));
      CHECK(rocclReduceScatter(send, recv, 21, t, op, comm, NULL));
      for (size_t i = 0; i < 21; i++) {
        double w = reduced(t, op, n, r * 21 + i), g = get_val(t, recv, i);
        EXPECT(close_to(t, g, w), "reducescatter type %d op %d elem %zu: got %g want %g", (int)t, (int)op, i, g, w);
      }
      CHECK(rocclReduceScatter(send, send + r * 21 * es, 21, t, op, comm, NULL));
      for (size_t i = 0; i < 21; i++) {
        double w = reduced(t, op, n, r * 21 + i), g = get_val(t, send, r * 21 + i);
        EXPECT(close_to(t, g, w), "reducescatter in place type %d op %d elem %zu: got %g want %g", (int)t, (int)op, i, g, w);
      }
    }
    /* broadcast from rank 1 (out of place; sendbuff NULL elsewhere), then in place */
    int root = 1 % n;
    for (size_t i = 0; i < C; i++) set_val(t, send, i, r == root ? val(t, rocclSum, root, i) : -1);
    CHECK(rocclBroadcast(r == root ? send : NULL, recv, C, t, root, comm, NULL));
    for (size_t i = 0; i < C; i++) EXPECT(get_val(t, recv, i) == val(t, rocclSum, root, i), "broadcast elem %zu", i);
    CHECK(rocclBcast(send, C, t, root, comm, NULL));
    for (size_t i = 0; i < C; i++) EXPECT(get_val(t, send, i) == val(t, rocclSum, root, i), "bcast elem %zu", i);
    /* all-gather out of place and in place */
    for (size_t i = 0; i < 33; i++) set_val(t, send, i, val(t, rocclSum, r, i));
    CHECK(rocclAllGather(send, recv, 33, t, comm, NULL));
    for (int q = 0; q < n; q++)
      for (size_t i = 0; i < 33; i++) EXPECT(get_val(t, recv, q * 33 + i) == val(t, rocclSum, q, i), "allgather %d %zu", q, i);
    memset(recv, 0, n * 33 * es);
    for (size_t i = 0; i < 33; i++) set_val(t, recv, r * 33 + i, val(t, rocclSum, r, i));
    CHECK(rocclAllGather(recv + r * 33 * es, recv, 33, t, comm, NULL));
    for (int q = 0; q < n; q++)
      for (size_t i = 0; i < 33; i++) EXPECT(get_val(t, recv, q * 33 + i) == val(t, rocclSum, q, i), "allgather in place %d %zu", q, i);
    /* all-to-all: block q of rank r holds 10*r + q */
    for (int q = 0; q < n; q++)
      for (size_t i = 0; i < 5; i++) set_val(t, send, q * 5 + i, is_signed(t) || t == rocclUint8 || t == rocclUint64 ? (double)(10 * r + q) : 0);
    CHECK(rocclAlltoAll(send, recv, 5, t, comm, NULL));
    for (int q = 0; q < n; q++)
      for (size_t i = 0; i < 5; i++) EXPECT(get_val(t, recv, q * 5 + i) == 10 * q + r, "alltoall from %d", q);
    free(send);
    free(recv);
  }
  /* zero counts with NULL buffers are fine */
  CHECK(rocclAllReduce(NULL, NULL, 0, rocclFloat, rocclSum, comm, NULL));
  CHECK(rocclAllGather(NULL, NULL, 0, rocclInt8, comm, NULL));
  CHECK(rocclBroadcast(NULL, NULL, 0, rocclDouble, 0, comm, NULL));
}

static void ring_in_group(rocclComm_t comm, int r, int n) {
  int out[1000], in[1000];
  for (int i = 0; i < 1000; i++) out[i] = r * 1000 + i;
  CHECK(rocclGroupStart());
  CHECK(rocclGroupStart()); /* nested */
  CHECK(rocclSend(out, 1000, rocclInt32, (r + 1) % n, comm, NULL));
  CHECK(rocclGroupEnd());
  CHECK(rocclRecv(in, 1000, rocclInt32, (r + n - 1) % n, comm, NULL));
  CHECK(rocclGroupEnd());
  for (int i = 0; i < 1000; i++) EXPECT(in[i] == ((r + n - 1) % n) * 1000 + i, "ring elem %d", i);
}

static void bad_arguments(rocclComm_t comm, int r, int n) {
  float f[4] = {0};
  EXPECT(rocclAllReduce(f, f, 4, rocclFloat, rocclSum, NULL, NULL) == rocclInvalidArgument, "NULL comm");
  EXPECT(strstr(rocclGetLastError(NULL), "comm is NULL") != NULL, "message: %s", rocclGetLastError(NULL));
  EXPECT(rocclAllReduce(NULL, f, 4, rocclFloat, rocclSum, comm, NULL) == rocclInvalidArgument, "NULL sendbuff");
  EXPECT(strstr(rocclGetLastError(NULL), "sendbuff") != NULL, "message: %s", rocclGetLastError(NULL));
  EXPECT(rocclAllReduce(f, f, 4, (rocclDataType_t)42, rocclSum, comm, NULL) == rocclInvalidArgument, "bad type");
  EXPECT(strstr(rocclGetLastError(NULL), "datatype 42") != NULL, "message: %s", rocclGetLastError(NULL));
  EXPECT(rocclAllReduce(f, f, 4, rocclFloat, (rocclRedOp_t)9, comm, NULL) == rocclInvalidArgument, "bad op");
  EXPECT(rocclBroadcast(f, f, 4, rocclFloat, n, comm, NULL) == rocclInvalidArgument, "bad root");
  EXPECT(strstr(rocclGetLastError(NULL), "root") != NULL, "message: %s", rocclGetLastError(NULL));
  EXPECT(rocclSend(f, 4, rocclFloat, -1, comm, NULL) == rocclInvalidArgument, "bad peer");
  EXPECT(rocclAllReduce(f, f, 4, rocclFloat, rocclSum, comm, (rocclStream_t)f) == rocclInvalidArgument, "stream");
  EXPECT(strstr(rocclGetLastError(NULL), "stream") != NULL, "message: %s", rocclGetLastError(NULL));
  EXPECT(rocclAllReduce(f, f + 1, 2, rocclFloat, rocclSum, comm, NULL) == rocclInvalidArgument, "overlap");
  EXPECT(rocclGroupEnd() == rocclInvalidUsage, "end without start");
  int x = 0;
  EXPECT(rocclCommCount(comm, NULL) == rocclInvalidArgument, "NULL count");
  CHECK(rocclCommCount(comm, &x));
  EXPECT(x == n, "count %d", x);
  CHECK(rocclCommUserRank(comm, &x));
  EXPECT(x == r, "rank %d", x);
  EXPECT(rocclGetUniqueId(NULL) == rocclInvalidArgument, "NULL id");
  rocclComm_t c2;
  rocclUniqueId junk;
  memset(&junk, 7, sizeof junk);
  EXPECT(rocclCommInitRank(&c2, 2, junk, 0) == rocclInvalidArgument, "junk id");
  EXPECT(c2 == NULL, "comm set on failure");
  EXPECT(rocclCommInitRank(&c2, 2, junk, 5) == rocclInvalidArgument, "rank out of range");
  /* still usable after argument errors */
  f[0] = 1;
  CHECK(rocclAllReduce(f, f, 1, rocclFloat, rocclSum, comm, NULL));
  EXPECT(f[0] == n, "sum after errors %g", f[0]);
}

static void split(rocclComm_t comm, int r, int n) {
  rocclComm_t sub;
  int color = (r == n - 1 && n > 2) ? ROCCL_SPLIT_NOCOLOR : r % 2;
  CHECK(rocclCommSplit(comm, color, -r, &sub, NULL));
  if (color == ROCCL_SPLIT_NOCOLOR) {
    EXPECT(sub == NULL, "no comm for NOCOLOR");
    return;
  }
  int sn, sr;
  CHECK(rocclCommCount(sub, &sn));
  CHECK(rocclCommUserRank(sub, &sr));
  int members = 0, higher = 0;
  for (int q = 0; q < n; q++) {
    int qc = (q == n - 1 && n > 2) ? -1 : q % 2;
    if (qc == color) {
      members++;
      if (q > r) higher++;
    }
  }
  EXPECT(sn == members, "split size %d want %d", sn, members);
  EXPECT(sr == higher, "split rank %d want %d (key orders by -rank)", sr, higher);
  int v = r;
  CHECK(rocclAllReduce(&v, &v, 1, rocclInt, rocclSum, sub, NULL));
  int want = 0;
  for (int q = 0; q < n; q++) {
    int qc = (q == n - 1 && n > 2) ? -1 : q % 2;
    if (qc == color) want += q;
  }
  EXPECT(v == want, "split sum %d want %d", v, want);
  CHECK(rocclCommDestroy(sub));
  EXPECT(rocclCommCount(sub, &sn) == rocclInvalidArgument, "destroyed comm");
}

struct abort_arg {
  rocclComm_t comm;
};

static void* abort_later(void* p) {
  struct timespec ts = {0, 300 * 1000 * 1000};
  nanosleep(&ts, NULL);
  rocclCommAbort(((struct abort_arg*)p)->comm);
  return NULL;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Rank 0 blocks in an all-reduce that rank 1 never joins; another thread aborts it. */
static void abort_test(rocclComm_t comm, int r) {
  rocclComm_t c2;
  CHECK(rocclCommSplit(comm, r < 2 ? 0 : ROCCL_SPLIT_NOCOLOR, r, &c2, NULL));
  if (r >= 2) {
    EXPECT(c2 == NULL, "no comm for NOCOLOR");
    return;
  }
  float f = 1;
  CHECK(rocclAllReduce(&f, &f, 1, rocclFloat, rocclSum, c2, NULL));
  if (r == 0) {
    pthread_t th;
    struct abort_arg a = {c2};
    pthread_create(&th, NULL, abort_later, &a);
    double t0 = now_s();
    rocclResult_t res = rocclAllReduce(&f, &f, 1, rocclFloat, rocclSum, c2, NULL);
    double dt = now_s() - t0;
    pthread_join(th, NULL);
    EXPECT(res != rocclSuccess, "aborted call succeeded");
    EXPECT(dt < 3.0, "abort took %.2f s", dt);
    EXPECT(rocclAllReduce(&f, &f, 1, rocclFloat, rocclSum, c2, NULL) == rocclInvalidArgument, "aborted comm usable");
  } else if (r == 1) {
    sleep(1);
    /* rank 0's communicator is gone: this one fails with a remote error naming it (the
     * first call may still complete with data rank 0 had sent before it was aborted) */
    rocclResult_t res = rocclSuccess;
    for (int k = 0; k < 3 && res == rocclSuccess; k++) res = rocclAllReduce(&f, &f, 1, rocclFloat, rocclSum, c2, NULL);
    EXPECT(res == rocclRemoteError || res == rocclSystemError, "after peer abort: %d", (int)res);
    rocclResult_t ae;
    CHECK(rocclCommGetAsyncError(c2, &ae));
    EXPECT(ae == res, "async error %d", (int)ae);
    EXPECT(strstr(rocclGetLastError(NULL), "rank 0") != NULL, "names rank 0: %s", rocclGetLastError(NULL));
    CHECK(rocclCommDestroy(c2));
  }
}

static void rank_main(int r, int n, rocclUniqueId id) {
  rocclComm_t comm;
  /* non-blocking init on odd ranks */
  if (r % 2) {
    rocclConfig_t cfg = ROCCL_CONFIG_INITIALIZER;
    /* An NCCL-initialized config (NCCL's magic, another layout) is refused, not misread. */
    rocclConfig_t nccl_like = cfg;
    nccl_like.magic = 0xcafebeefu;
    EXPECT(rocclCommInitRankConfig(&comm, n, id, r, &nccl_like) == rocclInvalidArgument,
           "an ncclConfig_t magic was accepted");
    EXPECT(strstr(rocclGetLastError(NULL), "ncclConfig_t") != NULL, "message: %s",
           rocclGetLastError(NULL));
    cfg.blocking = 0;
    rocclResult_t res = rocclCommInitRankConfig(&comm, n, id, r, &cfg);
    EXPECT(res == rocclInProgress || res == rocclSuccess, "nonblocking init %d", (int)res);
    rocclResult_t st;
    do {
      CHECK(rocclCommGetAsyncError(comm, &st));
    } while (st == rocclInProgress);
    EXPECT(st == rocclSuccess, "init finished with %d: %s", (int)st, rocclGetLastError(NULL));
  } else {
    CHECK(rocclCommInitRank(&comm, n, id, r));
  }
  int v;
  CHECK(rocclGetVersion(&v));
  EXPECT(v == ROCCL_VERSION_CODE, "version %d", v);
  collectives(comm, r, n);
  ring_in_group(comm, r, n);
  bad_arguments(comm, r, n);
  split(comm, r, n);
  abort_test(comm, r);
  CHECK(rocclCommFinalize(comm));
  CHECK(rocclCommDestroy(comm));
}

int main(void) {
  int failed = 0;
  for (int n = 2; n <= 4; n++) {
    int f = run_forked(n, rank_main);
    printf("test_collectives: %d ranks: %s\n", n, f ? "FAILED" : "ok");
    failed += f;
  }
  return failed ? 1 : 0;
}
