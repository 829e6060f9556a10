/* Contract 4's environment: CUDA_DEVICE_MEMORY_LIMIT[_i], CUDA_DEVICE_SM_LIMIT[_i],
 * CUDA_DEVICE_MEMORY_SHARED_CACHE, NVIDIA_VISIBLE_DEVICES, CUDA_TASK_PRIORITY, CUDA_OVERSUBSCRIBE;
 * plus CUDA_DEVICE_MEMORY_BUDGET[_i], CUDA_SM_POLICY and VGPU_CONTEXT_RESERVE. */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hook.h"

int vgpu_parse_size(const char *text, uint64_t *out) {
    char *end = NULL;
    if (!text || !isdigit((unsigned char)*text)) return -1;
    errno = 0;
    unsigned long long v = strtoull(text, &end, 10);
    if (errno == ERANGE) return -1; /* past 2^64: refused, never read as the largest size */
    uint64_t scale = 1;
    switch (*end) {
    case 'k': case 'K': scale = 1ULL << 10; end++; break;
    case 'm': case 'M': scale = 1ULL << 20; end++; break;
    case 'g': case 'G': scale = 1ULL << 30; end++; break;
    default: break;
    }
    if (*end == 'i' || *end == 'b' || *end == 'B') end++; /* tolerate 4Gi, 4gb */
    if (*end != '\0') return -1;
    if (v > UINT64_MAX / scale) return -1; /* would wrap around to a small limit, or to 0: no limit */
    *out = (uint64_t)v * scale;
    return 0;
}

static void limit_from(const char *name, uint64_t *slot) {
    const char *v = getenv(name);
    if (!v || !*v) return;
    if (vgpu_parse_size(v, slot) != 0) {
        VGPU_LOG(VGPU_LOG_ERROR,
                 "%s='%s' is not a size (bytes, or a number with k, m or g, e.g. 4096m); "
                 "refusing device memory on that device until it is fixed", name, v);
        *slot = 1;
    }
}

static void sm_from(const char *name, uint32_t *slot) {
    const char *v = getenv(name);
    if (!v || !*v) return;
    char *end = NULL;
    unsigned long p = strtoul(v, &end, 10);
    if (*end != '\0' || p > 100) {
        VGPU_LOG(VGPU_LOG_ERROR, "%s='%s' is not a percent 0..100; ignoring it", name, v);
        return;
    }
    *slot = (uint32_t)p;
}

static void budget_from(const char *name, uint64_t *slot) {
    const char *v = getenv(name);
    if (!v || !*v) return;
    if (vgpu_parse_size(v, slot) != 0) {
        VGPU_LOG(VGPU_LOG_ERROR, "%s='%s' is not a size (bytes, or a number with k, m or g, e.g. 4096m); "
                 "ignoring it: the card's free memory is the budget", name, v);
        *slot = 0;
    }
}

static void priority_from(struct vgpu_config *cfg) {
    cfg->priority = 1;
    const char *v = getenv("CUDA_TASK_PRIORITY");
    if (!v || !*v) return;
    if (strcmp(v, "0") == 0) cfg->priority = 0;
    else if (strcmp(v, "1") != 0)
        VGPU_LOG(VGPU_LOG_ERROR, "CUDA_TASK_PRIORITY='%s' is not 0 (high) or 1 (normal); using 1", v);
}

static void policy_from(struct vgpu_config *cfg) {
    const char *v = getenv("CUDA_SM_POLICY");
    if (!v || !*v || strcmp(v, "cap") == 0) return;
    if (strcmp(v, "elastic") == 0) cfg->sm_policy = 1;
    else VGPU_LOG(VGPU_LOG_ERROR, "CUDA_SM_POLICY='%s' is not cap or elastic; holding to the cap", v);
}

void vgpu_config_load(struct vgpu_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    char name[64];
    uint64_t all = 0, all_budget = 0;
    uint32_t all_sm = 0;
    limit_from("CUDA_DEVICE_MEMORY_LIMIT", &all);
    sm_from("CUDA_DEVICE_SM_LIMIT", &all_sm);
    budget_from("CUDA_DEVICE_MEMORY_BUDGET", &all_budget);
    priority_from(cfg);
    policy_from(cfg);
    const char *over = getenv("CUDA_OVERSUBSCRIBE");
    cfg->oversubscribe = over && (strcmp(over, "true") == 0 || strcmp(over, "1") == 0);
    uint32_t highest = 0;
    for (int i = 0; i < VGPU_MAX_DEVICES; i++) {
        cfg->limit[i] = all;
        cfg->sm_limit[i] = all_sm;
        snprintf(name, sizeof name, "CUDA_DEVICE_MEMORY_LIMIT_%d", i);
        if (getenv(name)) highest = (uint32_t)i + 1;
        limit_from(name, &cfg->limit[i]);
        snprintf(name, sizeof name, "CUDA_DEVICE_SM_LIMIT_%d", i);
        sm_from(name, &cfg->sm_limit[i]);
        cfg->budget[i] = all_budget;
        snprintf(name, sizeof name, "CUDA_DEVICE_MEMORY_BUDGET_%d", i);
        budget_from(name, &cfg->budget[i]);
        if (cfg->limit[i] || cfg->sm_limit[i]) cfg->enabled = 1;
    }
    /* NVIDIA_VISIBLE_DEVICES: UUIDs map devices by identity; anything else by ordinal. */
    const char *vis = getenv("NVIDIA_VISIBLE_DEVICES");
    uint32_t listed = 0;
    if (vis && strcmp(vis, "all") != 0 && strcmp(vis, "none") != 0 && strcmp(vis, "void") != 0) {
        const char *p = vis;
        while (*p && listed < VGPU_MAX_DEVICES) {
            size_t len = strcspn(p, ",");
            if (len > 0) {
                if (len > 4 && (strncmp(p, "GPU-", 4) == 0 || strncmp(p, "MIG-", 4) == 0) && len < VGPU_UUID_BYTES)
                    memcpy(cfg->uuid[listed], p, len);
                listed++;
            }
            p += len;
            if (*p == ',') p++;
        }
    }
    cfg->num_devices = listed > highest ? listed : highest;
    if (cfg->num_devices == 0) cfg->num_devices = 1;
    const char *path = getenv("CUDA_DEVICE_MEMORY_SHARED_CACHE");
    if (path && *path) {
        cfg->region_path = path;
        cfg->enabled = 1;
    }
    /* What a CUDA context itself takes on the card, which no allocation call shows: measured on
     * an H200 with CUDA 13 at 518 MiB (CuPy), 550 MiB (JAX) and 612 MiB (PyTorch). */
    cfg->context_reserve = VGPU_DEFAULT_CONTEXT_RESERVE;
    const char *reserve = getenv("VGPU_CONTEXT_RESERVE");
    if (reserve && *reserve && vgpu_parse_size(reserve, &cfg->context_reserve) != 0) {
        VGPU_LOG(VGPU_LOG_ERROR, "VGPU_CONTEXT_RESERVE='%s' is not a size (e.g. 640m); charging the default %llu MiB",
                 reserve, (unsigned long long)(VGPU_DEFAULT_CONTEXT_RESERVE >> 20));
        cfg->context_reserve = VGPU_DEFAULT_CONTEXT_RESERVE;
    }
}
