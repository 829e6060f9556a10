/* A stand-in libnvidia-ml.so.1 built from api.def: the same fake devices as the stub libcuda
 * (STUB_CUDA_DEVICES, STUB_CUDA_MEMORY_MIB), whole-card memory figures, and the calling
 * process listed as a compute process while the stub libcuda holds memory for it. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../api.h"

#define CU_HOOK(name, params, args, base, version, ptds)
#define CU_CALL(name, params, args, base, version, ptds)
#define NVML_HOOK(name, params, args)                                                    \
    __attribute__((visibility("hidden"))) nvmlReturn_t impl_##name params;               \
    extern __typeof__(impl_##name) name __attribute__((alias("impl_" #name), visibility("default")));
#define NVML_CALL NVML_HOOK
#include "../api.def"

#define MAX_DEV 8
static int initialized, ndev = 1;
static unsigned long long mem = 8192ULL << 20;
static struct nvmlDevice_st { unsigned int index; } devs[MAX_DEV];

static int valid(nvmlDevice_t d) { return d >= &devs[0] && d < &devs[ndev]; }

static unsigned long long used_on(unsigned int i) {
    unsigned long long (*used)(int) = (unsigned long long (*)(int))dlsym(RTLD_DEFAULT, "stubDeviceUsed");
    return used ? used((int)i) : 0;
}

nvmlReturn_t impl_nvmlInit_v2(void) {
    const char *d = getenv("STUB_CUDA_DEVICES"), *m = getenv("STUB_CUDA_MEMORY_MIB");
    if (d) ndev = atoi(d) > 0 && atoi(d) <= MAX_DEV ? atoi(d) : 1;
    if (m) mem = strtoull(m, NULL, 10) << 20;
    for (int i = 0; i < MAX_DEV; i++) devs[i].index = (unsigned int)i;
    initialized = 1;
    return NVML_SUCCESS;
}
nvmlReturn_t impl_nvmlShutdown(void) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    initialized = 0;
    return NVML_SUCCESS;
}
nvmlReturn_t impl_nvmlDeviceGetCount_v2(unsigned int *n) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (!n) return NVML_ERROR_INVALID_ARGUMENT;
    *n = (unsigned int)ndev;
    return NVML_SUCCESS;
}
nvmlReturn_t impl_nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *d) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (!d || i >= (unsigned int)ndev) return NVML_ERROR_INVALID_ARGUMENT;
    *d = &devs[i];
    return NVML_SUCCESS;
}
nvmlReturn_t impl_nvmlDeviceGetIndex(nvmlDevice_t d, unsigned int *i) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (!valid(d) || !i) return NVML_ERROR_INVALID_ARGUMENT;
    *i = d->index;
    return NVML_SUCCESS;
}
nvmlReturn_t impl_nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned int len) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (!valid(d) || !uuid) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned b = 0x10 + d->index;
    int n = snprintf(uuid, len, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b, b, b, b,
                     b, b, b, b, b, b, b, b, b, b, b, b);
    return n >= 0 && (unsigned int)n < len ? NVML_SUCCESS : NVML_ERROR_INSUFFICIENT_SIZE;
}
nvmlReturn_t impl_nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (!valid(d) || !m) return NVML_ERROR_INVALID_ARGUMENT;
    m->total = mem;
    m->used = used_on(d->index);
    m->free = mem - m->used;
    return NVML_SUCCESS;
}
nvmlReturn_t impl_nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (!valid(d) || !m) return NVML_ERROR_INVALID_ARGUMENT;
    if (m->version != nvmlMemory_v2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    m->total = mem;
    m->reserved = 0;
    m->used = used_on(d->index);
    m->free = mem - m->used;
    return NVML_SUCCESS;
}

static nvmlReturn_t procs(nvmlDevice_t d, unsigned int *count, void *infos, size_t stride) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (!valid(d) || !count) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned long long u = used_on(d->index);
    unsigned int n = u ? 1 : 0;
    if (*count < n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    if (n) {
        memset(infos, 0, stride);
        nvmlProcessInfo_v1_t *p = infos;
        p->pid = (unsigned int)getpid();
        p->usedGpuMemory = u;
    }
    *count = n;
    return NVML_SUCCESS;
}
nvmlReturn_t impl_nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t d, unsigned int *c, nvmlProcessInfo_v1_t *i) {
    return procs(d, c, i, sizeof *i);
}
nvmlReturn_t impl_nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t d, unsigned int *c, nvmlProcessInfo_t *i) {
    return procs(d, c, i, sizeof *i);
}
nvmlReturn_t impl_nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *c, nvmlProcessInfo_t *i) {
    return procs(d, c, i, sizeof *i);
}
