#define _POSIX_C_SOURCE 200809L
/* Several ranks in one process (rocclCommInitAll) driven from one thread with groups:
 * collectives on every communicator and a Send/Recv ring across them. */
#include "common.h"

#define N 4
#define C 4099

int main(void) {
  rocclComm_t comms[N];
  CHECK(rocclCommInitAll(comms, N, NULL));
  static double buf[N][C];
  static float ring_out[N][C], ring_in[N][C];
  for (int r = 0; r < N; r++) {
    int x;
    CHECK(rocclCommUserRank(comms[r], &x));
    EXPECT(x == r, "rank %d at %d", x, r);
    for (int i = 0; i < C; i++) buf[r][i] = r + i;
  }
  /* Outside a group, calling comms[0] alone would block forever; inside one it cannot. */
  CHECK(rocclGroupStart());
  for (int r = 0; r < N; r++) CHECK(rocclAllReduce(buf[r], buf[r], C, rocclDouble, rocclSum, comms[r], NULL));
  CHECK(rocclGroupEnd());
  for (int r = 0; r < N; r++)
    for (int i = 0; i < C; i++) EXPECT(buf[r][i] == 6 + 4.0 * i, "allreduce r%d i%d: %g", r, i, buf[r][i]);

  for (int r = 0; r < N; r++)
    for (int i = 0; i < C; i++) ring_out[r][i] = (float)(r * 10 + i % 10);
  CHECK(rocclGroupStart());
  for (int r = 0; r < N; r++) {
    CHECK(rocclSend(ring_out[r], C, rocclFloat, (r + 1) % N, comms[r], NULL));
    CHECK(rocclRecv(ring_in[r], C, rocclFloat, (r + N - 1) % N, comms[r], NULL));
  }
  CHECK(rocclGroupEnd());
  for (int r = 0; r < N; r++)
    for (int i = 0; i < C; i++)
      EXPECT(ring_in[r][i] == (float)(((r + N - 1) % N) * 10 + i % 10), "ring r%d i%d", r, i);

  /* Several collectives per communicator in one group run in call order. */
  int v[N];
  CHECK(rocclGroupStart());
  for (int r = 0; r < N; r++) {
    v[r] = r + 1;
    CHECK(rocclAllReduce(&v[r], &v[r], 1, rocclInt, rocclSum, comms[r], NULL));
    CHECK(rocclBroadcast(&v[r], &v[r], 1, rocclInt, 2, comms[r], NULL));
    CHECK(rocclAllReduce(&v[r], &v[r], 1, rocclInt, rocclMax, comms[r], NULL));
  }
  CHECK(rocclGroupEnd());
  for (int r = 0; r < N; r++) EXPECT(v[r] == 10, "v[%d] = %d", r, v[r]);

  /* A group whose concurrent operations write the same memory is refused. */
  CHECK(rocclGroupStart());
  CHECK(rocclRecv(ring_in[0], C, rocclFloat, 1, comms[0], NULL));
  CHECK(rocclRecv(ring_in[0], C, rocclFloat, 2, comms[0], NULL));
  EXPECT(rocclGroupEnd() == rocclInvalidArgument, "overlapping receives");
  EXPECT(strstr(rocclGetLastError(NULL), "overlapping") != NULL, "%s", rocclGetLastError(NULL));

  for (int r = 0; r < N; r++) CHECK(rocclCommDestroy(comms[r]));
  EXPECT(rocclCommDestroy(comms[0]) == rocclInvalidArgument, "double destroy");
  printf("test_initall: ok\n");
  return 0;
}
