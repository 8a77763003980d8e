/* See cuda_runtime.h: nothing nccl.h needs from here. */
