/* A C program compiled against NCCL 2.32's real nccl.h (from the nvidia-nccl-cu13 wheel) and
 * linked against libroccl-nccl.so alone: every function the header declares must resolve
 * (their addresses are taken below, so the link fails on any missing one), and NCCL's enum
 * values, ncclUniqueId and the versioned structs must be what roccl implements. Then one rank
 * runs an all-reduce through an NCCL_CONFIG_INITIALIZER config with netName and commName. */
#include <nccl.h>
#include <roccl.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

_Static_assert(sizeof(ncclUniqueId) == 128 && NCCL_UNIQUE_ID_BYTES == 128, "ncclUniqueId");
_Static_assert(sizeof(ncclUniqueId) == sizeof(rocclUniqueId), "unique id size");
_Static_assert(ncclSuccess == rocclSuccess && ncclUnhandledCudaError == rocclUnhandledDeviceError &&
                   ncclSystemError == rocclSystemError && ncclInternalError == rocclInternalError &&
                   ncclInvalidArgument == rocclInvalidArgument && ncclInvalidUsage == rocclInvalidUsage &&
                   ncclRemoteError == rocclRemoteError && ncclInProgress == rocclInProgress,
               "result codes");
_Static_assert(ncclInt8 == rocclInt8 && ncclUint8 == rocclUint8 && ncclInt32 == rocclInt32 &&
                   ncclUint32 == rocclUint32 && ncclInt64 == rocclInt64 && ncclUint64 == rocclUint64 &&
                   ncclFloat16 == rocclFloat16 && ncclFloat32 == rocclFloat32 &&
                   ncclFloat64 == rocclFloat64 && ncclBfloat16 == rocclBfloat16 &&
                   ncclFloat8e4m3 == rocclFloat8e4m3 && ncclFloat8e5m2 == rocclFloat8e5m2 &&
                   ncclNumTypes == rocclNumTypes,
               "data types");
_Static_assert(ncclSum == rocclSum && ncclProd == rocclProd && ncclMax == rocclMax &&
                   ncclMin == rocclMin && ncclAvg == rocclAvg && ncclNumOps == rocclNumOps,
               "reduction ops");
_Static_assert(NCCL_SPLIT_NOCOLOR == ROCCL_SPLIT_NOCOLOR, "split no-color");
/* ncclConfig_t: the offsets libroccl-nccl.so reads (ffi/nccl/src/config.rs). */
_Static_assert(offsetof(ncclConfig_t, size) == 0 && offsetof(ncclConfig_t, magic) == 8 &&
                   offsetof(ncclConfig_t, version) == 12 && offsetof(ncclConfig_t, blocking) == 16 &&
                   offsetof(ncclConfig_t, netName) == 32 && offsetof(ncclConfig_t, commName) == 48,
               "ncclConfig_t layout");
/* ncclEncryptionConfig_t (ffi/nccl/src/lib.rs) and ncclCollConfig_t's head. */
_Static_assert(sizeof(ncclEncryptionConfig_t) == 32 && offsetof(ncclEncryptionConfig_t, mode) == 16 &&
                   offsetof(ncclEncryptionConfig_t, psk) == 24,
               "ncclEncryptionConfig_t layout");
_Static_assert(offsetof(ncclCollConfig_t, magic) == 8 && offsetof(ncclCollConfig_t, version) == 12,
               "ncclCollConfig_t head");

/* Every function of nccl.h 2.32. */
static void (*const every[])(void) = {
    (void (*)(void))ncclAllGather,
    (void (*)(void))ncclAllGatherConfig,
    (void (*)(void))ncclAllReduce,
    (void (*)(void))ncclAllReduceConfig,
    (void (*)(void))ncclAlltoAll,
    (void (*)(void))ncclAlltoAllConfig,
    (void (*)(void))ncclBcast,
    (void (*)(void))ncclBroadcast,
    (void (*)(void))ncclBroadcastConfig,
    (void (*)(void))ncclCommAbort,
    (void (*)(void))ncclCommCount,
    (void (*)(void))ncclCommCuDevice,
    (void (*)(void))ncclCommDeregister,
    (void (*)(void))ncclCommDestroy,
    (void (*)(void))ncclCommFinalize,
    (void (*)(void))ncclCommGetAsyncError,
    (void (*)(void))ncclCommGetUniqueId,
    (void (*)(void))ncclCommGrow,
    (void (*)(void))ncclCommInitAll,
    (void (*)(void))ncclCommInitRank,
    (void (*)(void))ncclCommInitRankConfig,
    (void (*)(void))ncclCommInitRankScalable,
    (void (*)(void))ncclCommMemStats,
    (void (*)(void))ncclCommRegister,
    (void (*)(void))ncclCommResume,
    (void (*)(void))ncclCommRevoke,
    (void (*)(void))ncclCommShrink,
    (void (*)(void))ncclCommSplit,
    (void (*)(void))ncclCommSuspend,
    (void (*)(void))ncclCommUserRank,
    (void (*)(void))ncclCommWindowDeregister,
    (void (*)(void))ncclCommWindowRegister,
    (void (*)(void))ncclGather,
    (void (*)(void))ncclGatherConfig,
    (void (*)(void))ncclGetErrorString,
    (void (*)(void))ncclGetLastError,
    (void (*)(void))ncclGetUniqueId,
    (void (*)(void))ncclGetVersion,
    (void (*)(void))ncclGroupEnd,
    (void (*)(void))ncclGroupSimulateEnd,
    (void (*)(void))ncclGroupStart,
    (void (*)(void))ncclMemAlloc,
    (void (*)(void))ncclMemFree,
    (void (*)(void))ncclParamBind,
    (void (*)(void))ncclParamDumpAll,
    (void (*)(void))ncclParamGet,
    (void (*)(void))ncclParamGetAllParameterKeys,
    (void (*)(void))ncclParamGetParameter,
    (void (*)(void))ncclParamGetStr,
    (void (*)(void))ncclPutSignal,
    (void (*)(void))ncclRecv,
    (void (*)(void))ncclRedOpCreatePreMulSum,
    (void (*)(void))ncclRedOpDestroy,
    (void (*)(void))ncclReduce,
    (void (*)(void))ncclReduceConfig,
    (void (*)(void))ncclReduceScatter,
    (void (*)(void))ncclReduceScatterConfig,
    (void (*)(void))ncclResetDebugInit,
    (void (*)(void))ncclScatter,
    (void (*)(void))ncclScatterConfig,
    (void (*)(void))ncclSend,
    (void (*)(void))ncclSetEncryption,
    (void (*)(void))ncclSignal,
    (void (*)(void))ncclWaitSignal,
    (void (*)(void))ncclWinGetUserPtr,
};

int main(void) {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess || v < NCCL_VERSION(2, 32, 0)) {
    fprintf(stderr, "ncclGetVersion: %d (an NCCL 2.32 host API reports 2.32)\n", v);
    return 1;
  }
  ncclUniqueId id;
  if (ncclGetUniqueId(&id) != ncclSuccess) return 1;
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.netName = "Socket";
  cfg.commName = "header-test";
  ncclComm_t comm;
  if (ncclCommInitRankConfig(&comm, 1, id, 0, &cfg) != ncclSuccess) {
    fprintf(stderr, "init: %s\n", ncclGetLastError(NULL));
    return 1;
  }
  float x[4] = {1, 2, 3, 4}, y[4] = {0};
  ncclCollConfig_t cc = NCCL_COLLCONFIG_INITIALIZER;
  if (ncclAllReduceConfig(x, y, 4, ncclFloat32, ncclSum, comm, NULL, &cc) != ncclSuccess || y[3] != 4) {
    fprintf(stderr, "all-reduce: %s\n", ncclGetLastError(comm));
    return 1;
  }
  ncclConfig_t bad = NCCL_CONFIG_INITIALIZER;
  bad.netName = "NVLS";
  ncclComm_t c2;
  if (ncclCommInitRankConfig(&c2, 1, id, 0, &bad) != ncclInvalidArgument ||
      strstr(ncclGetLastError(NULL), "netName") == NULL) {
    fprintf(stderr, "an unknown netName was not refused: %s\n", ncclGetLastError(NULL));
    return 1;
  }
  ncclCommDestroy(comm);
  printf("nccl.h 2.32: %zu functions resolved in libroccl-nccl.so, layouts and values match, "
         "one-rank all-reduce ok (version %d)\n",
         sizeof every / sizeof every[0], v);
  return 0;
}
