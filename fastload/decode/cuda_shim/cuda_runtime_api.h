/* The one CUDA type nvimgcodec.h uses, so that _nvimgcodec_batch.c builds without the CUDA
 * toolkit's headers: a stream handle, passed through as the pointer it is. */
#ifndef FASTLOAD_CUDA_SHIM_H
#define FASTLOAD_CUDA_SHIM_H
#include <stddef.h> /* cuda_runtime_api.h brings it; nvimgcodec.h relies on that */
typedef struct CUstream_st *cudaStream_t;
#endif
