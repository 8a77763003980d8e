/* The few CUDA runtime names nccl.h uses, so that NCCL's real header compiles on a machine
 * without the CUDA toolkit (roccl's test of its NCCL ABI; no CUDA code is built). */
#ifndef ROCCL_TEST_CUDA_RUNTIME_STUB_H
#define ROCCL_TEST_CUDA_RUNTIME_STUB_H
#include <stddef.h>
#include <stdint.h>
#define CUDART_VERSION 13000
typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
#endif
