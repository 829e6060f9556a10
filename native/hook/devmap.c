/* Which region device index a CUDA ordinal or an NVML handle is: by UUID where the container's
 * NVIDIA_VISIBLE_DEVICES named UUIDs, else by ordinal. Cached; the driver is asked once. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "hook.h"

#define CU_CACHE 64
static int cu_cache[CU_CACHE]; /* 0 unknown, else index + 1 */

void vgpu_format_uuid(const unsigned char b[16], char out[VGPU_UUID_BYTES]) {
    snprintf(out, VGPU_UUID_BYTES,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2], b[3],
             b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

static int by_uuid(const char *uuid, int fallback) {
    for (int i = 0; i < VGPU_MAX_DEVICES; i++) {
        const char *mine = vgpu_uuid(i);
        if (!mine[0]) continue;
        if (strcmp(mine, uuid) == 0) return i;
    }
    return fallback;
}

static int has_uuids(void) {
    for (int i = 0; i < VGPU_MAX_DEVICES; i++)
        if (vgpu_uuid(i)[0]) return 1;
    return 0;
}

int vgpu_index_of_cu(CUdevice dev) {
    if (dev < 0) return 0;
    if (dev < CU_CACHE) {
        int c = __atomic_load_n(&cu_cache[dev], __ATOMIC_RELAXED);
        if (c) return c - 1;
    }
    int idx = dev < VGPU_MAX_DEVICES ? dev : -1, known = 1;
    if (has_uuids()) {
        CUuuid u;
        vgpu_in_hook++;
        CUresult rc = CU_REAL(cuDeviceGetUuid, (&u, dev));
        vgpu_in_hook--;
        known = rc == CUDA_SUCCESS; /* not yet initialised, say: ask again next time */
        if (known) {
            char text[VGPU_UUID_BYTES];
            vgpu_format_uuid((const unsigned char *)u.bytes, text);
            idx = by_uuid(text, idx);
        }
    }
    if (known && dev < CU_CACHE) __atomic_store_n(&cu_cache[dev], idx + 1, __ATOMIC_RELAXED);
    return idx;
}

int vgpu_index_current(void) {
    CUdevice dev = 0;
    vgpu_in_hook++;
    CUresult rc = CU_REAL(cuCtxGetDevice, (&dev));
    vgpu_in_hook--;
    return rc == CUDA_SUCCESS ? vgpu_index_of_cu(dev) : 0;
}

static pthread_mutex_t nv_mu = PTHREAD_MUTEX_INITIALIZER;
static struct { nvmlDevice_t handle; int idx; } nv_cache[CU_CACHE];
static int nv_len;

int vgpu_index_of_nvml(nvmlDevice_t dev) {
    pthread_mutex_lock(&nv_mu);
    for (int i = 0; i < nv_len; i++)
        if (nv_cache[i].handle == dev) {
            int idx = nv_cache[i].idx;
            pthread_mutex_unlock(&nv_mu);
            return idx;
        }
    pthread_mutex_unlock(&nv_mu);
    int idx = -1;
    unsigned int ordinal = 0;
    vgpu_in_hook++;
    if (NVML_REAL(nvmlDeviceGetIndex, (dev, &ordinal)) == NVML_SUCCESS)
        idx = ordinal < VGPU_MAX_DEVICES ? (int)ordinal : -1;
    if (has_uuids()) {
        char text[VGPU_UUID_BYTES] = {0};
        if (NVML_REAL(nvmlDeviceGetUUID, (dev, text, sizeof text)) == NVML_SUCCESS) idx = by_uuid(text, idx);
    }
    vgpu_in_hook--;
    pthread_mutex_lock(&nv_mu);
    if (nv_len < CU_CACHE) nv_cache[nv_len++] = (__typeof__(nv_cache[0])){dev, idx};
    pthread_mutex_unlock(&nv_mu);
    return idx;
}
