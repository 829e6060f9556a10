/* Built twice on a machine with the CUDA toolkit: once against the real cuda.h/nvml.h (-DREAL),
 * once against cuda_min.h. `make abi-check` diffs the two outputs. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#ifdef REAL
#include <cuda.h>
#include <nvml.h>
#else
#include "cuda_min.h"
#endif

#define SZ(t) printf("sizeof %s %zu\n", #t, sizeof(t));
#define OFF(t, f) printf("offsetof %s.%s %zu\n", #t, #f, offsetof(t, f));
#define VAL(v) printf("value %s %lld\n", #v, (long long)(v));

int main(void) {
    SZ(CUdeviceptr) SZ(CUdevice) SZ(CUmemGenericAllocationHandle) SZ(CUuuid) SZ(cuuint64_t)
    SZ(CUDA_ARRAY_DESCRIPTOR) OFF(CUDA_ARRAY_DESCRIPTOR, Format) OFF(CUDA_ARRAY_DESCRIPTOR, NumChannels)
    SZ(CUDA_ARRAY3D_DESCRIPTOR) OFF(CUDA_ARRAY3D_DESCRIPTOR, Depth) OFF(CUDA_ARRAY3D_DESCRIPTOR, Format)
    OFF(CUDA_ARRAY3D_DESCRIPTOR, Flags)
    SZ(CUmemAllocationProp) OFF(CUmemAllocationProp, location) OFF(CUmemAllocationProp, location.id)
    OFF(CUmemAllocationProp, win32HandleMetaData) OFF(CUmemAllocationProp, allocFlags)
    SZ(CUmemLocation)
    VAL(CUDA_ERROR_OUT_OF_MEMORY) VAL(CUDA_ERROR_NOT_INITIALIZED) VAL(CUDA_ERROR_INVALID_CONTEXT)
    VAL(CUDA_ERROR_NOT_FOUND) VAL(CUDA_ERROR_INVALID_VALUE) VAL(CUDA_ERROR_INVALID_HANDLE)
    VAL(CUDA_ERROR_INVALID_DEVICE) VAL(CUDA_ERROR_NOT_SUPPORTED) VAL(CUDA_ERROR_MPS_CONNECTION_FAILED)
    VAL(CU_MEM_LOCATION_TYPE_DEVICE) VAL(CU_MEM_ALLOCATION_TYPE_PINNED)
    VAL(CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) VAL(CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT)
    VAL(CU_MEMHOSTALLOC_PORTABLE) VAL(CU_MEMHOSTALLOC_DEVICEMAP)
    VAL(CU_AD_FORMAT_FLOAT) VAL(CU_AD_FORMAT_HALF) VAL(CU_AD_FORMAT_SIGNED_INT16)
    SZ(CUlaunchConfig) OFF(CUlaunchConfig, sharedMemBytes) OFF(CUlaunchConfig, hStream) OFF(CUlaunchConfig, attrs)
    OFF(CUlaunchConfig, numAttrs) SZ(CUevent) SZ(CUgraphExec) SZ(CUstreamCaptureStatus) SZ(CUstreamCaptureMode)
    VAL(CUDA_ERROR_NOT_READY) VAL(CUDA_ERROR_CONTEXT_IS_DESTROYED) VAL(CUDA_ERROR_DEINITIALIZED) VAL(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
    VAL(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED) VAL(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)
    VAL(CU_STREAM_CAPTURE_STATUS_ACTIVE) VAL(CU_STREAM_CAPTURE_STATUS_INVALIDATED) VAL(CU_STREAM_CAPTURE_MODE_RELAXED)
    VAL(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) VAL(CU_EVENT_DEFAULT) VAL(CU_EVENT_DISABLE_TIMING)
    VAL(CU_STREAM_NON_BLOCKING) VAL((uintptr_t)CU_STREAM_LEGACY) VAL((uintptr_t)CU_STREAM_PER_THREAD)
    SZ(nvmlMemory_t) SZ(nvmlMemory_v2_t) OFF(nvmlMemory_v2_t, total) OFF(nvmlMemory_v2_t, used) VAL(nvmlMemory_v2)
    SZ(nvmlProcessInfo_t) OFF(nvmlProcessInfo_t, usedGpuMemory) OFF(nvmlProcessInfo_t, computeInstanceId)
    SZ(nvmlProcessInfo_v1_t)
    VAL(NVML_ERROR_INSUFFICIENT_SIZE) VAL(NVML_ERROR_FUNCTION_NOT_FOUND) VAL(NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
    return 0;
}
