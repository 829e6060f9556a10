/* libvgpu internals shared by its files; nothing here is exported. */
#ifndef VGPU_HOOK_H
#define VGPU_HOOK_H
#include <stddef.h>
#include <stdint.h>
#include "api.h"
#include "region_layout.h"

#define HIDDEN __attribute__((visibility("hidden")))

/* typed pointers to the real driver functions, resolved once */
#define CU_HOOK(name, params, args, base, version, ptds) extern HIDDEN __typeof__(&name) real_##name;
#define CU_CALL(name, params, args, base, version, ptds) extern HIDDEN __typeof__(&name) real_##name;
#define NVML_HOOK(name, params, args) extern HIDDEN __typeof__(&name) real_##name;
#define NVML_CALL(name, params, args) extern HIDDEN __typeof__(&name) real_##name;
#include "api.def"

HIDDEN void vgpu_cuda_ready(void);
HIDDEN void vgpu_nvml_ready(void);

/* forward to the real function; a symbol the driver lacks is an error code, never a NULL call */
#define CU_REAL(name, args) \
    (vgpu_cuda_ready(), real_##name ? real_##name args : CUDA_ERROR_NOT_FOUND)
#define NVML_REAL(name, args) \
    (vgpu_nvml_ready(), real_##name ? real_##name args : NVML_ERROR_FUNCTION_NOT_FOUND)

/* re-entry guard: set while libvgpu itself calls into the driver */
extern HIDDEN __thread int vgpu_in_hook __attribute__((tls_model("initial-exec")));

/* log.c */
enum { VGPU_LOG_OFF, VGPU_LOG_ERROR, VGPU_LOG_WARN, VGPU_LOG_INFO, VGPU_LOG_DEBUG };
extern HIDDEN int vgpu_log_level;
HIDDEN void vgpu_log_init(void);
HIDDEN void vgpu_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define VGPU_LOG(level, ...) \
    do { if (__builtin_expect(vgpu_log_level >= (level), 0)) vgpu_log(level, __VA_ARGS__); } while (0)

/* config.c: the environment of contract 4 (docs/contracts.md) */
#define VGPU_DEFAULT_CONTEXT_RESERVE (640ULL << 20)
struct vgpu_config {
    int enabled;                 /* any limit or a region path given */
    const char *region_path;     /* CUDA_DEVICE_MEMORY_SHARED_CACHE, or NULL */
    uint32_t num_devices;
    uint64_t limit[VGPU_MAX_DEVICES];
    uint32_t sm_limit[VGPU_MAX_DEVICES];
    char uuid[VGPU_MAX_DEVICES][VGPU_UUID_BYTES];
    uint64_t context_reserve;    /* VGPU_CONTEXT_RESERVE: charged once per device per process */
    uint64_t budget[VGPU_MAX_DEVICES]; /* CUDA_DEVICE_MEMORY_BUDGET[_i]: device bytes before spilling */
    uint32_t priority;           /* CUDA_TASK_PRIORITY: 0 high, 1 normal (default) */
    uint32_t sm_policy;          /* CUDA_SM_POLICY: 0 cap (default), 1 elastic (work-conserving alone) */
    int oversubscribe;           /* CUDA_OVERSUBSCRIBE=true: spill past the budget to mapped host memory */
};
HIDDEN int vgpu_parse_size(const char *text, uint64_t *out);
HIDDEN void vgpu_config_load(struct vgpu_config *cfg);

/* region.c: the shared region of contract 5 (docs/contracts.md) */
HIDDEN int vgpu_enabled(void);               /* attaches on first use; 0 = pass everything through */
/* 0 = granted, -1 = over the limit, -2 = no process slot left in the region (logged once) */
HIDDEN int vgpu_charge(int idx, uint64_t bytes, int force);
HIDDEN void vgpu_uncharge(int idx, uint64_t bytes);
/* virtual device memory: like vgpu_charge (not forced), and *over_budget = 1 when the bytes on the
 * device (used - spilled, this charge included) pass budget[idx] (0 = no budget) */
HIDDEN int vgpu_charge_budget(int idx, uint64_t bytes, int *over_budget);
HIDDEN void vgpu_spill_move(int idx, uint64_t bytes);       /* charged bytes now live in host memory */
HIDDEN void vgpu_uncharge_spilled(int idx, uint64_t bytes); /* a spilled allocation was given back */
HIDDEN uint64_t vgpu_budget(int idx);
HIDDEN uint64_t vgpu_limit(int idx);
HIDDEN uint64_t vgpu_used(int idx);
HIDDEN const char *vgpu_uuid(int idx);      /* "" when the region holds none */
HIDDEN uint64_t vgpu_context_reserve(void);
HIDDEN int vgpu_processes(int idx, unsigned int *pids, uint64_t *used, int max);
HIDDEN struct vgpu_region_header *vgpu_header(void); /* the mapped header, NULL when not enabled */
HIDDEN int vgpu_oversubscribe(void);          /* CUDA_OVERSUBSCRIBE=true was given */

/* region_file.c: the region file, made by its first process and mapped by the others */
HIDDEN void *vgpu_region_map(const struct vgpu_config *cfg); /* NULL: none usable (logged) */
HIDDEN void vgpu_region_init(struct vgpu_region_header *h, const struct vgpu_config *cfg); /* header, lock, magic */

/* slots.c: which process slots of the region belong to processes that are gone, found without
 * the region's lock (region.c drops them under it) */
#define VGPU_SLOT_WORDS ((VGPU_MAX_PROCS + 63) / 64)
HIDDEN uint64_t vgpu_proc_start(int pid);                     /* clock ticks since boot; 0 = unknown */
HIDDEN int vgpu_slot_alive(const struct vgpu_region_slot *s); /* 0: gone, a zombie, or its pid reused */
/* marks the slots (bits of gone[VGPU_SLOT_WORDS]) whose process looks gone: deep 0 by kill(pid, 0)
 * alone, deep 1 as vgpu_slot_alive(); never `own` (-1: none); returns how many */
HIDDEN int vgpu_slots_gone(const struct vgpu_region_slot *slots, int deep, int own, uint64_t *gone);
/* under the lock: drops the slots (never `own`) whose process is gone, of those marked in gone
 * (NULL: of all), seq odd meanwhile; returns how many */
HIDDEN int vgpu_slots_reap(struct vgpu_region_header *h, struct vgpu_region_slot *slots, int own, const uint64_t *gone);
HIDDEN void vgpu_slot_drop(struct vgpu_region_header *h, struct vgpu_region_slot *s); /* its usage out of the totals */

/* grant.c: the limits granted to the container, read-only to it (vgpu/hookabi/grant.py) */
HIDDEN int vgpu_grant_load(struct vgpu_config *cfg); /* 1: a grant governs cfg; 0: none; -1: damaged, cfg refuses */
HIDDEN int vgpu_grant_state(void);                   /* 1: valid, 0: no grant, -1: damaged: refuse allocations */
HIDDEN uint64_t vgpu_grant_seq(void);                /* the even seq whose checksum last held: a new one is a live resize */
HIDDEN const struct vgpu_grant *vgpu_grant(void);    /* the read-only map, NULL without a grant */
HIDDEN const char *vgpu_grant_path(void);
/* the same map as vgpu_grant(), as a variable: the limiter reads the node's gate (hold_until_ns)
 * with one load per launch, no call */
HIDDEN extern const struct vgpu_grant *vgpu_grant_mapped;
HIDDEN uint64_t vgpu_fnv1a64(const void *data, size_t len);
/* a private copy of the grant read from its file now, without mapping it or touching the state
 * above (the constructor's and cuInit's look at the sharing mode): 1 whole, 0 none, -1 unusable */
HIDDEN int vgpu_grant_read(struct vgpu_grant *copy);
/* grant.c calls nothing in region.c: region.c reads the grant and keeps its own copy following it */

/* region.c: the limits as they hold now, the grant's where one governs */
HIDDEN uint32_t vgpu_sm_limit(int idx);
HIDDEN uint32_t vgpu_priority(void);
HIDDEN uint32_t vgpu_sm_policy(void);

/* mps.c: a grant with sharing == VGPU_SHARING_MPS makes every process an MPS client of the
 * grant's pipe, its MPS variables set from the grant before the driver's cuInit */
extern HIDDEN int vgpu_mps; /* 1 once an MPS grant was seen: the compute limiter stays out of launches */
HIDDEN CUresult vgpu_mps_prepare(void); /* CUDA_SUCCESS, or why cuInit must fail */

/* track.c: what this process allocated, so frees can be uncharged */
enum { VGPU_KIND_PTR = 1, VGPU_KIND_HANDLE = 2, VGPU_KIND_ARRAY = 3, VGPU_KIND_MIPMAP = 4, VGPU_KIND_SPILL = 5 };
HIDDEN void vgpu_track_add(int kind, uint64_t key, uint64_t size, int idx);
HIDDEN int vgpu_track_take(int kind, uint64_t key, uint64_t *size, int *idx); /* 1 = found and removed */
HIDDEN void vgpu_track_add_aux(int kind, uint64_t key, uint64_t size, uint64_t aux, int idx);
HIDDEN int vgpu_track_take_aux(int kind, uint64_t key, uint64_t *size, uint64_t *aux, int *idx);
HIDDEN void vgpu_track_reset(void);

/* devmap.c: CUDA ordinals and NVML handles to region device indexes */
HIDDEN int vgpu_index_of_cu(CUdevice dev);
HIDDEN int vgpu_index_current(void);
HIDDEN int vgpu_index_of_nvml(nvmlDevice_t dev);
HIDDEN void vgpu_format_uuid(const unsigned char bytes[16], char out[VGPU_UUID_BYTES]);

#endif
