/*
 * roccl.h — C API of roccl, collective communications for RoCE v2 and Ethernet clusters.
 *
 * NCCL's API with the prefix nccl -> roccl: same argument order, types and numeric values,
 * with cudaStream_t -> rocclStream_t. Link with -lroccl (pkg-config --cflags --libs roccl).
 *
 * Memory and streams: buffers are host memory, or device memory of the GPU runtime. The
 * NULL stream has NCCL's meaning. Without a GPU runtime (none built or openable, or
 * ROCCL_DEVICE=none) buffers are host memory and a call outside a group returns when its
 * operation is complete. With a runtime (ROCCL_DEVICE=hip, cuda or sim, or unset and one
 * opens), NULL is the runtime's legacy default stream: when any buffer is device memory the
 * CPU cannot access (the runtime says so; roccl does not take it on trust), the call is
 * ordered on that stream as below and the CPU never touches the buffer; when all buffers are
 * host-accessible, the call waits for the work queued on the default stream, runs, and
 * returns when complete. A program that wants the per-thread default stream passes its
 * handle (cudaStreamPerThread) like any stream. With a non-NULL stream the call returns at once;
 * the operation starts after all work enqueued earlier on that stream and work enqueued later
 * waits for it (buffers must stay valid until then); a failure is reported by
 * rocclCommGetAsyncError. Streams need a GPU runtime: ROCCL_DEVICE=sim selects roccl's
 * simulated device (any non-NULL handle is a stream; for testing stream-ordered code without
 * a GPU); roccl built with --features hip or cuda orders calls on that runtime's streams
 * (written and built, not yet run on a real GPU: docs/GPU.md). Without one, a non-NULL stream
 * is rejected with rocclInvalidArgument. A call on a stream being captured into a graph
 * (CUDA stream capture, HIP graphs) records work that runs the collective at every replay of
 * the graph, with the buffers' contents at that replay (keep them valid while the graph
 * lives); a group spanning several streams cannot be captured (rocclInvalidUsage). Calls
 * between rocclGroupStart and
 * rocclGroupEnd are queued and run together by the outermost rocclGroupEnd, which returns
 * when all are complete: send/receive exchanges in any pattern, and several communicators
 * driven from one thread, cannot deadlock. Within a group, each communicator runs its
 * collectives in call order, then all of its sends and receives at once; communicators run
 * concurrently.
 *
 * Errors: every function checks its arguments and returns a rocclResult_t; on failure
 * rocclGetLastError() gives a sentence naming what was wrong. rocclInvalidArgument: a bad
 * argument (NULL pointer, NULL buffer with a non-zero count, root/peer/rank out of range,
 * unknown data type or op, a stream without a GPU runtime, a communicator handle that was
 * destroyed or aborted). rocclInvalidUsage: the communicator cannot be used (still
 * initializing, aborted while a call ran, or broken by an earlier error).
 * rocclRemoteError: a peer exited, failed or did not respond within ROCCL_TIMEOUT seconds
 * (the message names the rank). rocclSystemError: an OS or network call failed.
 * rocclInternalError: a bug in roccl. After a remote or system error the communicator is
 * unusable; rocclCommGetAsyncError reports the error.
 *
 * Configuration comes from the environment (ROCCL_NET, ROCCL_SOCKET_IFNAME, ROCCL_TIMEOUT,
 * ROCCL_ALGO, ...; see README.md).
 *
 * Thread safety: calls on different communicators may come from different threads. Calls
 * on one communicator are executed in the order they are made. rocclCommAbort may be called
 * from another thread while a call on the same communicator is blocked; that call then
 * returns promptly with an error.
 */
#ifndef ROCCL_H_
#define ROCCL_H_

#include <limits.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define ROCCL_MAJOR 0
#define ROCCL_MINOR 1
#define ROCCL_PATCH 0
/* Version code: major * 10000 + minor * 100 + patch (as returned by rocclGetVersion). */
#define ROCCL_VERSION_CODE (ROCCL_MAJOR * 10000 + ROCCL_MINOR * 100 + ROCCL_PATCH)

#define ROCCL_UNIQUE_ID_BYTES 128
/* Color for rocclCommSplit: take part in the split but get no communicator. */
#define ROCCL_SPLIT_NOCOLOR (-1)
#define ROCCL_CONFIG_UNDEF_INT INT_MIN

/* Opaque communicator handle. */
typedef struct rocclComm* rocclComm_t;

/* Stream handle (cudaStream_t / hipStream_t); NULL: the runtime's default stream, or a
 * blocking call on host memory without a runtime (see the top of this file). */
typedef void* rocclStream_t;

/* Identifies a communicator being created; made by rocclGetUniqueId on one rank and passed
 * to all ranks out of band (e.g. over MPI, a file, or the launcher). */
typedef struct {
  char internal[ROCCL_UNIQUE_ID_BYTES];
} rocclUniqueId;

typedef enum {
  rocclSuccess = 0,
  rocclUnhandledDeviceError = 1,
  rocclSystemError = 2,
  rocclInternalError = 3,
  rocclInvalidArgument = 4,
  rocclInvalidUsage = 5,
  rocclRemoteError = 6,
  rocclInProgress = 7,
  rocclNumResults = 8
} rocclResult_t;

typedef enum {
  rocclInt8 = 0,
  rocclChar = 0,
  rocclUint8 = 1,
  rocclInt32 = 2,
  rocclInt = 2,
  rocclUint32 = 3,
  rocclInt64 = 4,
  rocclUint64 = 5,
  rocclFloat16 = 6,
  rocclHalf = 6,
  rocclFloat32 = 7,
  rocclFloat = 7,
  rocclFloat64 = 8,
  rocclDouble = 8,
  rocclBfloat16 = 9,
  rocclFloat8e4m3 = 10, /* OCP E4M3 (e4m3fn): max 448, no inf; reduced in float, rounded
                           to nearest-even and saturated to the largest finite value */
  rocclFloat8e5m2 = 11, /* OCP E5M2: max 57344; reduced like rocclFloat8e4m3 */
  rocclNumTypes = 12
} rocclDataType_t;

typedef enum {
  rocclSum = 0,
  rocclProd = 1,
  rocclMax = 2,
  rocclMin = 3,
  rocclAvg = 4, /* sum divided by nranks (integer division for integer types) */
  rocclNumOps = 5
} rocclRedOp_t;

/* Communicator options for rocclCommInitRankConfig and rocclCommSplit. Initialize with
 * ROCCL_CONFIG_INITIALIZER, then set fields. Its magic (ROCCL_CONFIG_MAGIC) is not NCCL's:
 * an ncclConfig_t, laid out differently, is refused here (libroccl-nccl.so takes those). */
typedef struct {
  size_t size;          /* sizeof(rocclConfig_t), set by the initializer */
  unsigned int magic;   /* set by the initializer */
  unsigned int version; /* set by the initializer */
  int blocking;         /* 1 (default): init returns when done; 0: init returns rocclInProgress
                           and continues in the background (poll rocclCommGetAsyncError) */
  const char* netName;  /* network ("auto", "tcp"); NULL: ROCCL_NET or auto */
} rocclConfig_t;

#define ROCCL_CONFIG_MAGIC 0x524f4343u /* "ROCC" */
#define ROCCL_CONFIG_INITIALIZER \
  { sizeof(rocclConfig_t), ROCCL_CONFIG_MAGIC, ROCCL_VERSION_CODE, ROCCL_CONFIG_UNDEF_INT, NULL }

/* Version code of the library (ROCCL_VERSION_CODE of the build). Errors: version NULL. */
rocclResult_t rocclGetVersion(int* version);

/* Create a unique id. Starts, in this process, the small rendezvous server the ranks meet
 * at; it serves one communicator and exits. Errors: uniqueId NULL; no usable network
 * interface (rocclInvalidArgument names ROCCL_SOCKET_IFNAME and the interfaces found). */
rocclResult_t rocclGetUniqueId(rocclUniqueId* uniqueId);

/* Join the communicator identified by commId as rank `rank` of `nranks`. Blocks until all
 * ranks have joined; after ROCCL_TIMEOUT seconds fails with rocclRemoteError naming the
 * ranks that never arrived. On failure *comm is NULL. Errors: comm NULL, nranks < 1, rank
 * out of range, commId not from rocclGetUniqueId, mismatched nranks between ranks. */
rocclResult_t rocclCommInitRank(rocclComm_t* comm, int nranks, rocclUniqueId commId, int rank);

/* rocclCommInitRank with options. With config->blocking == 0 it returns rocclInProgress at
 * once with *comm set; initialization continues in the background and
 * rocclCommGetAsyncError(*comm) reports rocclInProgress until it ends. config may be NULL. */
rocclResult_t rocclCommInitRankConfig(rocclComm_t* comm, int nranks, rocclUniqueId commId,
                                      int rank, rocclConfig_t* config);

/* Create ndev communicators forming one clique inside this process (ranks 0..ndev-1, one
 * per array element). Blocks until all are ready. devlist is ignored (host memory) and may
 * be NULL. Drive them from one thread with rocclGroupStart/End, or one thread each. */
rocclResult_t rocclCommInitAll(rocclComm_t* comms, int ndev, const int* devlist);

/* Complete outstanding work. Calls are synchronous, so this only waits for nothing — except
 * a non-blocking init still running, which gives rocclInProgress. */
rocclResult_t rocclCommFinalize(rocclComm_t comm);

/* Free a communicator (a non-blocking init still running is ended first, within about a
 * second; its peers then fail their init). Its connections close; peers
 * still using it get an error. Using the handle afterwards gives rocclInvalidArgument (a
 * handle is never reused, so a stale one never names a later communicator). */
rocclResult_t rocclCommDestroy(rocclComm_t comm);

/* Abort and free a communicator. May be called from another thread while a call on comm is
 * blocked: that call returns promptly with rocclInvalidUsage. A non-blocking init still
 * running is ended within about a second. */
rocclResult_t rocclCommAbort(rocclComm_t comm);

/* Split comm: ranks passing the same color form a new communicator, ranked by key then by
 * rank in comm. Collective over comm (every rank must call it). color ROCCL_SPLIT_NOCOLOR:
 * *newcomm is NULL. config may be NULL. Errors: newcomm NULL, color < 0 other than
 * ROCCL_SPLIT_NOCOLOR. */
rocclResult_t rocclCommSplit(rocclComm_t comm, int color, int key, rocclComm_t* newcomm,
                             rocclConfig_t* config);

/* Number of ranks in comm. Errors: count NULL, comm not usable. */
rocclResult_t rocclCommCount(const rocclComm_t comm, int* count);

/* This process's rank in comm. Errors: rank NULL, comm not usable. */
rocclResult_t rocclCommUserRank(const rocclComm_t comm, int* rank);

/* The communicator's state: rocclInProgress while a non-blocking init runs, the error that
 * made it unusable (rocclRemoteError, rocclSystemError, ...; rocclGetLastError then gives
 * the message), or rocclSuccess. Errors: asyncError NULL, comm unknown. */
rocclResult_t rocclCommGetAsyncError(rocclComm_t comm, rocclResult_t* asyncError);

/* A static string describing a result code. */
const char* rocclGetErrorString(rocclResult_t result);

/* The message of the last failing roccl call on this thread ("" if none). Valid until the
 * thread's next failing call. comm is ignored and may be NULL. */
const char* rocclGetLastError(rocclComm_t comm);

/* recvbuff[i] = op over ranks of sendbuff[i], count elements. In place when sendbuff ==
 * recvbuff. Blocking outside a group. */
rocclResult_t rocclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
                             rocclDataType_t datatype, rocclRedOp_t op, rocclComm_t comm,
                             rocclStream_t stream);

/* Copy count elements of root's sendbuff to every rank's recvbuff. sendbuff is read on the
 * root only (may be NULL elsewhere). In place when sendbuff == recvbuff. */
rocclResult_t rocclBroadcast(const void* sendbuff, void* recvbuff, size_t count,
                             rocclDataType_t datatype, int root, rocclComm_t comm,
                             rocclStream_t stream);

/* In-place broadcast of buff (NCCL's legacy ncclBcast). */
rocclResult_t rocclBcast(void* buff, size_t count, rocclDataType_t datatype, int root,
                         rocclComm_t comm, rocclStream_t stream);

/* Reduce count elements of every rank's sendbuff into root's recvbuff. recvbuff is written on
 * the root only (may be NULL elsewhere). In place when sendbuff == recvbuff. */
rocclResult_t rocclReduce(const void* sendbuff, void* recvbuff, size_t count,
                          rocclDataType_t datatype, rocclRedOp_t op, int root, rocclComm_t comm,
                          rocclStream_t stream);

/* Gather sendcount elements from every rank into recvbuff (nranks * sendcount, rank order).
 * In place when sendbuff == recvbuff + rank * sendcount elements. */
rocclResult_t rocclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                             rocclDataType_t datatype, rocclComm_t comm, rocclStream_t stream);

/* Reduce sendbuff (nranks * recvcount elements) over ranks; block `rank` goes to recvbuff.
 * In place when recvbuff == sendbuff + rank * recvcount elements. */
rocclResult_t rocclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                                 rocclDataType_t datatype, rocclRedOp_t op, rocclComm_t comm,
                                 rocclStream_t stream);

/* Block j (count elements) of sendbuff goes to rank j; block i of recvbuff comes from rank i.
 * Both buffers hold nranks * count elements. In place when sendbuff == recvbuff. */
rocclResult_t rocclAlltoAll(const void* sendbuff, void* recvbuff, size_t count,
                            rocclDataType_t datatype, rocclComm_t comm, rocclStream_t stream);

/* Send count elements to peer. Outside a group it returns once the data has left this
 * process's buffer; pair it with rocclRecv on the peer, in a group when both directions are
 * used, to avoid deadlock. Messages between two ranks are matched in call order. */
rocclResult_t rocclSend(const void* sendbuff, size_t count, rocclDataType_t datatype, int peer,
                        rocclComm_t comm, rocclStream_t stream);

/* Receive count elements from peer (the sender must send exactly count elements). */
rocclResult_t rocclRecv(void* recvbuff, size_t count, rocclDataType_t datatype, int peer,
                        rocclComm_t comm, rocclStream_t stream);

/* Start a group (groups nest; only the outermost end runs the queued calls). Argument errors
 * of queued calls are returned by those calls; errors while running by rocclGroupEnd. */
rocclResult_t rocclGroupStart(void);

/* End a group; the outermost end runs all calls queued on this thread and returns when they
 * are complete. Errors: no matching rocclGroupStart (rocclInvalidUsage); operations that run
 * at the same time writing overlapping buffers (rocclInvalidArgument). */
rocclResult_t rocclGroupEnd(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ROCCL_H_ */
