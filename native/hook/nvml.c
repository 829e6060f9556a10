/* NVML as the container should see it: the vGPU's memory (total = limit, used = the
 * container's usage) and the container's own processes. */
#include <string.h>

#include "hook.h"

#define EXPORT __attribute__((visibility("default")))

static int policed(nvmlDevice_t dev, int *idx, uint64_t *limit) {
    if (vgpu_in_hook || !vgpu_enabled()) return 0;
    *idx = vgpu_index_of_nvml(dev);
    *limit = vgpu_limit(*idx);
    return *limit != 0;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    nvmlReturn_t rc = NVML_REAL(nvmlDeviceGetMemoryInfo, (device, memory));
    int idx;
    uint64_t limit;
    if (rc != NVML_SUCCESS || !memory || !policed(device, &idx, &limit)) return rc;
    uint64_t used = vgpu_used(idx);
    memory->total = limit;
    memory->used = used;
    memory->free = used < limit ? limit - used : 0;
    return rc;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    nvmlReturn_t rc = NVML_REAL(nvmlDeviceGetMemoryInfo_v2, (device, memory));
    int idx;
    uint64_t limit;
    if (rc != NVML_SUCCESS || !memory || !policed(device, &idx, &limit)) return rc;
    uint64_t used = vgpu_used(idx);
    memory->total = limit;
    memory->reserved = 0;
    memory->used = used;
    memory->free = used < limit ? limit - used : 0;
    return rc;
}

/* The region's processes with their usage, in the caller's struct layout (v1: 16 bytes;
 * v2/v3: 24 bytes). NVML's convention: too small a buffer gives INSUFFICIENT_SIZE and the count. */
#define MAX_LISTED VGPU_MAX_PROCS /* every slot: a container's processes are never cut short */
static nvmlReturn_t list(nvmlDevice_t device, unsigned int *count, void *infos, int v1, nvmlReturn_t real_rc) {
    int idx;
    uint64_t limit;
    if (!count || (real_rc != NVML_SUCCESS && real_rc != NVML_ERROR_INSUFFICIENT_SIZE) ||
        !policed(device, &idx, &limit))
        return real_rc;
    unsigned int pids[MAX_LISTED];
    uint64_t used[MAX_LISTED];
    int n = vgpu_processes(idx, pids, used, MAX_LISTED);
    if (n > MAX_LISTED) n = MAX_LISTED;
    if (*count < (unsigned int)n || (!infos && n > 0)) {
        *count = (unsigned int)n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (int i = 0; i < n; i++) {
        if (v1) {
            nvmlProcessInfo_v1_t *out = (nvmlProcessInfo_v1_t *)infos + i;
            out->pid = pids[i];
            out->usedGpuMemory = used[i];
        } else {
            nvmlProcessInfo_t *out = (nvmlProcessInfo_t *)infos + i;
            memset(out, 0, sizeof *out);
            out->pid = pids[i];
            out->usedGpuMemory = used[i];
            out->gpuInstanceId = 0xFFFFFFFFu;
            out->computeInstanceId = 0xFFFFFFFFu;
        }
    }
    *count = (unsigned int)n;
    return NVML_SUCCESS;
}

/* Ask the driver first (it checks the handle), with a scratch buffer so the caller's is ours. */
#define SCRATCH 64
EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                         nvmlProcessInfo_v1_t *infos) {
    nvmlProcessInfo_v1_t scratch[SCRATCH];
    unsigned int n = SCRATCH;
    int idx;
    uint64_t limit;
    if (!policed(device, &idx, &limit))
        return NVML_REAL(nvmlDeviceGetComputeRunningProcesses, (device, infoCount, infos));
    nvmlReturn_t rc = NVML_REAL(nvmlDeviceGetComputeRunningProcesses, (device, &n, scratch));
    return list(device, infoCount, infos, 1, rc);
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                            nvmlProcessInfo_t *infos) {
    nvmlProcessInfo_t scratch[SCRATCH];
    unsigned int n = SCRATCH;
    int idx;
    uint64_t limit;
    if (!policed(device, &idx, &limit))
        return NVML_REAL(nvmlDeviceGetComputeRunningProcesses_v2, (device, infoCount, infos));
    nvmlReturn_t rc = NVML_REAL(nvmlDeviceGetComputeRunningProcesses_v2, (device, &n, scratch));
    return list(device, infoCount, infos, 0, rc);
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                            nvmlProcessInfo_t *infos) {
    nvmlProcessInfo_t scratch[SCRATCH];
    unsigned int n = SCRATCH;
    int idx;
    uint64_t limit;
    if (!policed(device, &idx, &limit))
        return NVML_REAL(nvmlDeviceGetComputeRunningProcesses_v3, (device, infoCount, infos));
    nvmlReturn_t rc = NVML_REAL(nvmlDeviceGetComputeRunningProcesses_v3, (device, &n, scratch));
    return list(device, infoCount, infos, 0, rc);
}
