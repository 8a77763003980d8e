/* A C program compiled against NCCL 2.32's real nccl.h (from the nvidia-nccl-cu13 wheel) and
 * linked against libroccl-nccl.so alone: every function the header declares (and its pnccl alias) must resolve
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

/* Every function of nccl.h 2.32, and its profiling alias (pnccl). */
static void (*const every[])(void) = {
    (void (*)(void))ncclAllGather,
    (void (*)(void))pncclAllGather,
    (void (*)(void))ncclAllGatherConfig,
    (void (*)(void))pncclAllGatherConfig,
    (void (*)(void))ncclAllReduce,
    (void (*)(void))pncclAllReduce,
    (void (*)(void))ncclAllReduceConfig,
    (void (*)(void))pncclAllReduceConfig,
    (void (*)(void))ncclAlltoAll,
    (void (*)(void))pncclAlltoAll,
    (void (*)(void))ncclAlltoAllConfig,
    (void (*)(void))pncclAlltoAllConfig,
    (void (*)(void))ncclBcast,
    (void (*)(void))pncclBcast,
    (void (*)(void))ncclBroadcast,
    (void (*)(void))pncclBroadcast,
    (void (*)(void))ncclBroadcastConfig,
    (void (*)(void))pncclBroadcastConfig,
    (void (*)(void))ncclCommAbort,
    (void (*)(void))pncclCommAbort,
    (void (*)(void))ncclCommCount,
    (void (*)(void))pncclCommCount,
    (void (*)(void))ncclCommCuDevice,
    (void (*)(void))pncclCommCuDevice,
    (void (*)(void))ncclCommDeregister,
    (void (*)(void))pncclCommDeregister,
    (void (*)(void))ncclCommDestroy,
    (void (*)(void))pncclCommDestroy,
    (void (*)(void))ncclCommFinalize,
    (void (*)(void))pncclCommFinalize,
    (void (*)(void))ncclCommGetAsyncError,
    (void (*)(void))pncclCommGetAsyncError,
    (void (*)(void))ncclCommGetUniqueId,
    (void (*)(void))pncclCommGetUniqueId,
    (void (*)(void))ncclCommGrow,
    (void (*)(void))pncclCommGrow,
    (void (*)(void))ncclCommInitAll,
    (void (*)(void))pncclCommInitAll,
    (void (*)(void))ncclCommInitRank,
    (void (*)(void))pncclCommInitRank,
    (void (*)(void))ncclCommInitRankConfig,
    (void (*)(void))pncclCommInitRankConfig,
    (void (*)(void))ncclCommInitRankScalable,
    (void (*)(void))pncclCommInitRankScalable,
    (void (*)(void))ncclCommMemStats,
    (void (*)(void))pncclCommMemStats,
    (void (*)(void))ncclCommRegister,
    (void (*)(void))pncclCommRegister,
    (void (*)(void))ncclCommResume,
    (void (*)(void))pncclCommResume,
    (void (*)(void))ncclCommRevoke,
    (void (*)(void))pncclCommRevoke,
    (void (*)(void))ncclCommShrink,
    (void (*)(void))pncclCommShrink,
    (void (*)(void))ncclCommSplit,
    (void (*)(void))pncclCommSplit,
    (void (*)(void))ncclCommSuspend,
    (void (*)(void))pncclCommSuspend,
    (void (*)(void))ncclCommUserRank,
    (void (*)(void))pncclCommUserRank,
    (void (*)(void))ncclCommWindowDeregister,
    (void (*)(void))pncclCommWindowDeregister,
    (void (*)(void))ncclCommWindowRegister,
    (void (*)(void))pncclCommWindowRegister,
    (void (*)(void))ncclGather,
    (void (*)(void))pncclGather,
    (void (*)(void))ncclGatherConfig,
    (void (*)(void))pncclGatherConfig,
    (void (*)(void))ncclGetErrorString,
    (void (*)(void))pncclGetErrorString,
    (void (*)(void))ncclGetLastError,
    (void (*)(void))pncclGetLastError,
    (void (*)(void))ncclGetUniqueId,
    (void (*)(void))pncclGetUniqueId,
    (void (*)(void))ncclGetVersion,
    (void (*)(void))pncclGetVersion,
    (void (*)(void))ncclGroupEnd,
    (void (*)(void))pncclGroupEnd,
    (void (*)(void))ncclGroupSimulateEnd,
    (void (*)(void))pncclGroupSimulateEnd,
    (void (*)(void))ncclGroupStart,
    (void (*)(void))pncclGroupStart,
    (void (*)(void))ncclMemAlloc,
    (void (*)(void))pncclMemAlloc,
    (void (*)(void))ncclMemFree,
    (void (*)(void))pncclMemFree,
    (void (*)(void))ncclParamBind,
    (void (*)(void))pncclParamBind,
    (void (*)(void))ncclParamDumpAll,
    (void (*)(void))pncclParamDumpAll,
    (void (*)(void))ncclParamGet,
    (void (*)(void))pncclParamGet,
    (void (*)(void))ncclParamGetAllParameterKeys,
    (void (*)(void))pncclParamGetAllParameterKeys,
    (void (*)(void))ncclParamGetParameter,
    (void (*)(void))pncclParamGetParameter,
    (void (*)(void))ncclParamGetStr,
    (void (*)(void))pncclParamGetStr,
    (void (*)(void))ncclPutSignal,
    (void (*)(void))pncclPutSignal,
    (void (*)(void))ncclRecv,
    (void (*)(void))pncclRecv,
    (void (*)(void))ncclRedOpCreatePreMulSum,
    (void (*)(void))pncclRedOpCreatePreMulSum,
    (void (*)(void))ncclRedOpDestroy,
    (void (*)(void))pncclRedOpDestroy,
    (void (*)(void))ncclReduce,
    (void (*)(void))pncclReduce,
    (void (*)(void))ncclReduceConfig,
    (void (*)(void))pncclReduceConfig,
    (void (*)(void))ncclReduceScatter,
    (void (*)(void))pncclReduceScatter,
    (void (*)(void))ncclReduceScatterConfig,
    (void (*)(void))pncclReduceScatterConfig,
    (void (*)(void))ncclResetDebugInit,
    (void (*)(void))pncclResetDebugInit,
    (void (*)(void))ncclScatter,
    (void (*)(void))pncclScatter,
    (void (*)(void))ncclScatterConfig,
    (void (*)(void))pncclScatterConfig,
    (void (*)(void))ncclSend,
    (void (*)(void))pncclSend,
    (void (*)(void))ncclSetEncryption,
    (void (*)(void))pncclSetEncryption,
    (void (*)(void))ncclSignal,
    (void (*)(void))pncclSignal,
    (void (*)(void))ncclWaitSignal,
    (void (*)(void))pncclWaitSignal,
    (void (*)(void))ncclWinGetUserPtr,
    (void (*)(void))pncclWinGetUserPtr,
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
