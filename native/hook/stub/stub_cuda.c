/* A stand-in libcuda.so.1 for machines without a GPU, built from api.def. It behaves like the
 * driver where libvgpu and its tests can tell: cuInit first, a current context for allocations,
 * a fixed amount of memory per device and CUDA_ERROR_OUT_OF_MEMORY past it, frees of unknown
 * pointers refused, and cuGetProcAddress answering (name, version, flags) with the variant the
 * driver would (the _v2 of a name for version >= 3020, the _ptsz one for flag 2).
 *
 * STUB_CUDA_DEVICES (1), STUB_CUDA_MEMORY_MIB (8192): the fake devices.
 * STUB_CUDA_HOST_MIB (0 = no cap): pinned host memory cuMemHostAlloc hands out before it says
 * CUDA_ERROR_OUT_OF_MEMORY (as a host out of pinnable memory would).
 * Device pointers are backed by lazily mapped memory (untouched pages cost nothing) and host
 * allocations by malloc, so cuMemcpyHtoD/DtoH move real bytes; a host allocation's device
 * pointer is the host pointer (unified addressing).
 * STUB_CUDA_KERNEL_US (2): how long each launch occupies its stream on the simulated GPU
 * timeline (stub_launch.c), also settable with stubSetKernelNs().
 * STUB_CUDA_PROCESS_DIR: where the stub records this process's device memory as the real driver
 * keeps it for NVML (the fake NVML backend's processDir, vgpu/node/fake_nvml.py): the file
 * <pid>@<start time> (PID in the process's own namespace, /proc/self/stat field 22), one
 * "<uuid or index> <bytes>" line per device, rewritten (write, rename) on every allocation and free;
 * and its GPU time in <pid>@<start time>.sm (stub_launch.c), as the driver samples it for
 * nvmlDeviceGetProcessUtilization.
 * With STUB_CUDA_PROCESS_DIR, an allocation past the driver's cap on the process's cgroup, as the fake
 * NVML's nvmlDeviceSetMemoryLimits_v1 wrote it there (caps/, see over_cgroup_cap), fails with
 * CUDA_ERROR_OUT_OF_MEMORY, as an r615 driver's does.
 * STUB_CUDA_CONTEXTS_MAX=N with STUB_CUDA_CONTEXT_DIR: the driver makes at most N contexts at
 * once per device, across processes, and refuses the next with CUDA_ERROR_OUT_OF_MEMORY, as an
 * H200 (driver 580.159.04, in a VM) made 31 of 200 with 143 GB free. A context takes the flock of
 * one of N files ctx-<device>-<k> in the folder, held while the process lives.
 * MPS: at cuInit, when $CUDA_MPS_PIPE_DIRECTORY/control (default /tmp/nvidia-mps/control) accepts
 * a connection, the process is an MPS client, as with the real driver (which otherwise runs it
 * outside MPS, silently): its process file also gets the lines "mps 1", "mps_threads <pct>"
 * (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, 100 when unset) and "mps_pinned <bytes>" (device 0's
 * CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, "<ordinal>=<n>[K|M|G|T][B],..."; 0 when unset), written at
 * cuInit and with every allocation, and an allocation past a device's pinned limit fails with
 * CUDA_ERROR_OUT_OF_MEMORY as MPS refuses it. Old readers of the file skip these lines (no device
 * is named "mps...").
 * STUB_CUDA_PROC_TRAMPOLINES=1: cuGetProcAddress hands out internal addresses, not the exported
 * ones, as a driver may. Entry points are defined hidden and exported through aliases, so the
 * stub's own table never resolves to a preloaded library's functions. */
#define _GNU_SOURCE
#include <errno.h>
#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "../api.h"

#define STUB_EXPORT __attribute__((visibility("default")))
#define MAX_DEV 8

#define CU_HOOK(name, params, args, base, version, ptds)                                         \
    __attribute__((visibility("hidden"))) CUresult impl_##name params;                           \
    extern __typeof__(impl_##name) name __attribute__((alias("impl_" #name), visibility("default"))); \
    static CUresult tramp_##name params { return impl_##name args; }
#define CU_CALL CU_HOOK
#include "../api.def"

static const struct proc {
    const char *name, *base;
    int version, ptds;
    void *impl, *tramp;
} procs[] = {
#define CU_HOOK(name, params, args, base, version, ptds) {#name, base, version, ptds, (void *)impl_##name, (void *)tramp_##name},
#define CU_CALL CU_HOOK
#include "../api.def"
};
#define NPROCS (sizeof(procs) / sizeof(procs[0]))

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int initialized, ndev = 1;
static unsigned long long dev_mem = 8192ULL << 20, dev_used[MAX_DEV];
static struct CUctx_st { int dev; } ctxs[MAX_DEV];
static __thread CUcontext current;

enum { K_PTR = 1, K_HANDLE, K_ARRAY, K_MIPMAP };
static struct alloc { unsigned long long key, size; int dev, kind, backed; } *allocs;
static size_t nallocs, capallocs;
static unsigned long long next_addr = 0x7f0000000000ULL, next_handle = 1;
/* MPS client state, set at cuInit (see the top). */
static int mps_client, mps_threads = 100;
static unsigned long long mps_pinned[MAX_DEV];

/* This process's file in STUB_CUDA_PROCESS_DIR (<pid>@<start time>), or NULL when none is asked for. */
static const char *proc_path(void) {
    static char path[512], started[32];
    static int none; /* no directory asked for: the launch path asks every time */
    if (__atomic_load_n(&none, __ATOMIC_RELAXED)) return NULL;
    const char *dir = getenv("STUB_CUDA_PROCESS_DIR");
    if (!dir || !*dir) {
        __atomic_store_n(&none, 1, __ATOMIC_RELAXED);
        return NULL;
    }
    if (!started[0]) {
        char stat[1024];
        FILE *f = fopen("/proc/self/stat", "r");
        size_t n = f ? fread(stat, 1, sizeof stat - 1, f) : 0;
        if (f) fclose(f);
        stat[n] = 0;
        char *p = strrchr(stat, ')');
        for (int field = 2; p && field < 22; field++) p = strchr(p + 1, ' ');
        if (!p) return NULL;
        snprintf(started, sizeof started, "%llu", strtoull(p + 1, NULL, 10));
        snprintf(path, sizeof path, "%s/%d@%s", dir, (int)getpid(), started);
    }
    return path;
}

/* How NVML would name device d: the d-th UUID of NVIDIA_VISIBLE_DEVICES, else its index. */
static void device_key(int d, char *key, size_t len) {
    snprintf(key, len, "%d", d);
    const char *visible = getenv("NVIDIA_VISIBLE_DEVICES");
    if (visible && strncmp(visible, "GPU-", 4) == 0) {
        const char *v = visible;
        for (int i = 0; i < d && v; i++) v = strchr(v, ','), v = v ? v + 1 : NULL;
        if (v) {
            size_t n = strcspn(v, ",");
            if (n < len) memcpy(key, v, n), key[n] = 0;
        }
    }
}

/* This process's memory per device into STUB_CUDA_PROCESS_DIR, called with mu held. */
static void record_usage(void) {
    const char *path = proc_path();
    if (!path) return;
    char tmp[600];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) return;
    for (int d = 0; d < ndev; d++) {
        char key[96];
        device_key(d, key, sizeof key);
        fprintf(f, "%s %llu\n", key, dev_used[d]);
    }
    if (mps_client) fprintf(f, "mps 1\nmps_threads %d\nmps_pinned %llu\n", mps_threads, mps_pinned[0]);
    if (fclose(f) == 0) rename(tmp, path);
}

/* What process pid (in this PID namespace) holds on the device named key, from its file in dir
 * (<pid>@<start time>); 0 when it has none. */
static unsigned long long held_by(const char *dir, const char *pid, const char *key) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    unsigned long long held = 0;
    size_t n = strlen(pid);
    struct dirent *e;
    while ((e = readdir(d))) {
        if (strncmp(e->d_name, pid, n) != 0 || e->d_name[n] != '@' || strchr(e->d_name + n, '.')) continue;
        char path[600], k[96];
        unsigned long long bytes;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        FILE *f = fopen(path, "r");
        while (f && fscanf(f, "%95s %llu", k, &bytes) == 2)
            if (strcmp(k, key) == 0) held += bytes;
        if (f) fclose(f);
    }
    closedir(d);
    return held;
}

/* The driver's cap on this process's cgroup (r615's nvmlDeviceSetMemoryLimits_v1), as the fake NVML
 * writes it (vgpu/node/fake_memcap.py): STUB_CUDA_PROCESS_DIR/caps/<name of the cgroup's folder>,
 * "<cgroup folder> <uuid or index> <hard bytes>" per line. 1 when taking size more on dev would take
 * the cgroup's processes (its cgroup.procs, each one's file beside ours; ours from memory) past it. */
static int over_cgroup_cap(int dev, unsigned long long size) {
    const char *dir = getenv("STUB_CUDA_PROCESS_DIR");
    if (!dir || !*dir) return 0;
    char line[1024], cap[1200], key[96];
    FILE *cg = fopen("/proc/self/cgroup", "r"), *f = NULL;
    while (cg && !f && fgets(line, sizeof line, cg)) {
        line[strcspn(line, "\n")] = 0;
        const char *base = strrchr(line, '/');
        if (base && base[1]) snprintf(cap, sizeof cap, "%s/caps/%s", dir, base + 1), f = fopen(cap, "r");
    }
    if (cg) fclose(cg);
    if (!f) return 0;
    device_key(dev, key, sizeof key);
    char folder[800], k[96], self[32];
    unsigned long long hard, total = dev_used[dev] + size;
    int over = 0;
    snprintf(self, sizeof self, "%d", (int)getpid());
    while (!over && fscanf(f, "%799s %95s %llu", folder, k, &hard) == 3) {
        if (strcmp(k, key) != 0) continue;
        snprintf(cap, sizeof cap, "%s/cgroup.procs", folder);
        FILE *procs = fopen(cap, "r");
        char pid[32];
        while (procs && fscanf(procs, "%31s", pid) == 1)
            if (strcmp(pid, self) != 0) total += held_by(dir, pid, key);
        if (procs) fclose(procs);
        over = total > hard;
    }
    fclose(f);
    return over;
}

static CUresult take(int dev, unsigned long long size, int kind, unsigned long long *key) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (dev < 0 || dev >= ndev) return CUDA_ERROR_INVALID_DEVICE;
    if (size == 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    if (dev_used[dev] + size > dev_mem || (mps_client && mps_pinned[dev] && dev_used[dev] + size > mps_pinned[dev]) ||
        over_cgroup_cap(dev, size)) {
        pthread_mutex_unlock(&mu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (nallocs == capallocs) {
        capallocs = capallocs ? capallocs * 2 : 256;
        allocs = realloc(allocs, capallocs * sizeof *allocs);
    }
    int backed = 0;
    void *m = kind == K_PTR ? mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
                            : MAP_FAILED;
    if (kind == K_HANDLE) *key = next_handle++;
    else if (m != MAP_FAILED) *key = (uintptr_t)m, backed = 1;
    else {
        *key = next_addr;
        next_addr += ((size + (2u << 20) - 1) & ~((2ULL << 20) - 1)) + (2u << 20);
    }
    allocs[nallocs++] = (struct alloc){*key, size, dev, kind, backed};
    dev_used[dev] += size;
    record_usage();
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

static CUresult give(unsigned long long key, int kind) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    pthread_mutex_lock(&mu);
    for (size_t i = 0; i < nallocs; i++)
        if (allocs[i].key == key && allocs[i].kind == kind) {
            dev_used[allocs[i].dev] -= allocs[i].size;
            if (allocs[i].backed) munmap((void *)(uintptr_t)allocs[i].key, allocs[i].size);
            allocs[i] = allocs[--nallocs];
            record_usage();
            pthread_mutex_unlock(&mu);
            return CUDA_SUCCESS;
        }
    pthread_mutex_unlock(&mu);
    return kind == K_PTR ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_INVALID_HANDLE;
}

static int current_dev(void) { return current ? current->dev : -1; }

static CUresult alloc_current(CUdeviceptr *dptr, size_t size) {
    if (!dptr) return CUDA_ERROR_INVALID_VALUE;
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!current) return CUDA_ERROR_INVALID_CONTEXT;
    return take(current_dev(), size, K_PTR, dptr);
}

/* 1 when the MPS control daemon's socket in the pipe folder takes a connection. */
static int mps_listening(void) {
    const char *dir = getenv("CUDA_MPS_PIPE_DIRECTORY");
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (snprintf(addr.sun_path, sizeof addr.sun_path, "%s/control", dir && *dir ? dir : "/tmp/nvidia-mps") >=
        (int)sizeof addr.sun_path)
        return 0;
    static const int types[] = {SOCK_SEQPACKET, SOCK_STREAM, SOCK_DGRAM}; /* the daemon's choice */
    int ok = 0, wrong = 1;
    for (size_t i = 0; i < sizeof types / sizeof types[0] && !ok && wrong; i++) {
        int fd = socket(AF_UNIX, types[i] | SOCK_CLOEXEC, 0);
        if (fd < 0) return 0;
        ok = connect(fd, (struct sockaddr *)&addr, sizeof addr) == 0;
        wrong = !ok && errno == EPROTOTYPE;
        close(fd);
    }
    return ok;
}

/* CUDA_MPS_PINNED_DEVICE_MEM_LIMIT: "<ordinal>=<n>[K|M|G|T][B]" pairs, comma-separated. */
static void mps_parse_pinned(const char *v) {
    while (v && *v) {
        char *end;
        long dev = strtol(v, &end, 10);
        if (*end == '=') {
            unsigned long long n = strtoull(end + 1, &end, 10);
            int shift = 0;
            switch (*end) {
            case 'K': case 'k': shift = 10, end++; break;
            case 'M': case 'm': shift = 20, end++; break;
            case 'G': case 'g': shift = 30, end++; break;
            case 'T': case 't': shift = 40, end++; break;
            }
            if (*end == 'B' || *end == 'b') end++;
            if (dev >= 0 && dev < MAX_DEV) mps_pinned[dev] = n << shift;
        }
        v = strchr(end, ',');
        if (v) v++;
    }
}

CUresult impl_cuInit(unsigned int flags) {
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    const char *d = getenv("STUB_CUDA_DEVICES"), *m = getenv("STUB_CUDA_MEMORY_MIB");
    if (d) ndev = atoi(d) > 0 && atoi(d) <= MAX_DEV ? atoi(d) : 1;
    if (m) dev_mem = strtoull(m, NULL, 10) << 20;
    for (int i = 0; i < MAX_DEV; i++) ctxs[i].dev = i;
    pthread_mutex_lock(&mu);
    if (!initialized && mps_listening()) {
        /* the driver reads the MPS variables once, at its first cuInit */
        const char *t = getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
        double pct = t && *t ? strtod(t, NULL) : 100;
        mps_threads = pct >= 1 && pct <= 100 ? (int)(pct + 0.5) : 100;
        mps_parse_pinned(getenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"));
        mps_client = 1;
        record_usage();
    }
    initialized = 1;
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

CUresult impl_cuDeviceGet(CUdevice *device, int ordinal) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (ordinal < 0 || ordinal >= ndev) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

CUresult impl_cuDeviceGetCount(int *count) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    *count = ndev;
    return CUDA_SUCCESS;
}

CUresult impl_cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (dev < 0 || dev >= ndev) return CUDA_ERROR_INVALID_DEVICE;
    memset(uuid->bytes, 0x10 + dev, sizeof uuid->bytes);
    return CUDA_SUCCESS;
}

CUresult impl_cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (dev < 0 || dev >= ndev) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = dev_mem;
    return CUDA_SUCCESS;
}

/* A context slot on device dev under STUB_CUDA_CONTEXTS_MAX (see the top), called with mu held:
 * kept once taken (fd + 1 in ctx_slot), never given back before the process ends. */
static int ctx_slot[MAX_DEV];

static CUresult take_context_slot(int dev) {
    const char *max = getenv("STUB_CUDA_CONTEXTS_MAX"), *dir = getenv("STUB_CUDA_CONTEXT_DIR");
    if (!max || !*max || !dir || !*dir || ctx_slot[dev]) return CUDA_SUCCESS;
    for (int k = 0, n = atoi(max); k < n; k++) {
        char path[600];
        snprintf(path, sizeof path, "%s/ctx-%d-%d", dir, dev, k);
        int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
        if (fd < 0) return CUDA_ERROR_UNKNOWN; /* the folder is not there: a test set it wrong */
        if (flock(fd, LOCK_EX | LOCK_NB) == 0) {
            ctx_slot[dev] = fd + 1;
            return CUDA_SUCCESS;
        }
        close(fd);
    }
    return CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult impl_cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (dev < 0 || dev >= ndev) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&mu);
    CUresult rc = take_context_slot(dev);
    pthread_mutex_unlock(&mu);
    if (rc == CUDA_SUCCESS) *pctx = &ctxs[dev];
    return rc;
}

CUresult impl_cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    return dev >= 0 && dev < ndev ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

CUresult impl_cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    (void)flags;
    CUresult rc = impl_cuDevicePrimaryCtxRetain(pctx, dev);
    if (rc == CUDA_SUCCESS) current = *pctx;
    return rc;
}

CUresult impl_cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *params, int n, unsigned int flags, CUdevice dev) {
    (void)params, (void)n;
    return impl_cuCtxCreate_v2(pctx, flags, dev);
}

CUresult impl_cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *params, unsigned int flags, CUdevice dev) {
    (void)params;
    return impl_cuCtxCreate_v2(pctx, flags, dev);
}

CUresult impl_cuCtxSetCurrent(CUcontext ctx) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    current = ctx;
    return CUDA_SUCCESS;
}

CUresult impl_cuCtxGetCurrent(CUcontext *pctx) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    *pctx = current;
    return CUDA_SUCCESS;
}

CUresult impl_cuCtxGetDevice(CUdevice *device) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!current) return CUDA_ERROR_INVALID_CONTEXT;
    *device = current->dev;
    return CUDA_SUCCESS;
}

CUresult impl_cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!current) return CUDA_ERROR_INVALID_CONTEXT;
    *free_bytes = dev_mem - dev_used[current->dev];
    *total = dev_mem;
    return CUDA_SUCCESS;
}

CUresult impl_cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) { return alloc_current(dptr, bytesize); }
CUresult impl_cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    (void)flags;
    return alloc_current(dptr, bytesize);
}
CUresult impl_cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream s) {
    (void)s;
    return alloc_current(dptr, bytesize);
}
CUresult impl_cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream s) {
    return impl_cuMemAllocAsync(dptr, bytesize, s);
}
CUresult impl_cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (dev < 0 || dev >= ndev) return CUDA_ERROR_INVALID_DEVICE;
    *pool = (CUmemoryPool)(uintptr_t)(0x1000 + dev);
    return CUDA_SUCCESS;
}
CUresult impl_cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream s) {
    (void)s;
    uintptr_t p = (uintptr_t)pool;
    if (p < 0x1000 || p >= 0x1000 + (uintptr_t)ndev) return CUDA_ERROR_INVALID_VALUE;
    if (!dptr) return CUDA_ERROR_INVALID_VALUE;
    return take((int)(p - 0x1000), bytesize, K_PTR, dptr);
}
CUresult impl_cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream s) {
    return impl_cuMemAllocFromPoolAsync(dptr, bytesize, pool, s);
}
CUresult impl_cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t width, size_t height, unsigned int elem) {
    if (elem != 4 && elem != 8 && elem != 16) return CUDA_ERROR_INVALID_VALUE;
    size_t pitch = (width + 511) & ~(size_t)511;
    CUresult rc = alloc_current(dptr, pitch * height);
    if (rc == CUDA_SUCCESS) *pPitch = pitch;
    return rc;
}
CUresult impl_cuMemFree_v2(CUdeviceptr dptr) { return give(dptr, K_PTR); }
CUresult impl_cuMemFreeAsync(CUdeviceptr dptr, CUstream s) {
    (void)s;
    return give(dptr, K_PTR);
}
CUresult impl_cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream s) { return impl_cuMemFreeAsync(dptr, s); }

CUresult impl_cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                          unsigned long long flags) {
    if (!handle || !prop || flags != 0 || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
        prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE || size % (2u << 20) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    return take(prop->location.id, size, K_HANDLE, handle);
}
CUresult impl_cuMemRelease(CUmemGenericAllocationHandle handle) { return give(handle, K_HANDLE); }

static size_t elem(CUarray_format f, unsigned int ch) {
    size_t b = (f == CU_AD_FORMAT_UNSIGNED_INT8 || f == CU_AD_FORMAT_SIGNED_INT8) ? 1
               : (f == CU_AD_FORMAT_UNSIGNED_INT16 || f == CU_AD_FORMAT_SIGNED_INT16 || f == CU_AD_FORMAT_HALF) ? 2
                                                                                                                 : 4;
    return b * ch;
}
static size_t one(size_t v) { return v ? v : 1; }

CUresult impl_cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *d) {
    if (!pHandle || !d || !d->Width || !d->NumChannels) return CUDA_ERROR_INVALID_VALUE;
    if (!current) return initialized ? CUDA_ERROR_INVALID_CONTEXT : CUDA_ERROR_NOT_INITIALIZED;
    unsigned long long key;
    CUresult rc = take(current_dev(), d->Width * one(d->Height) * elem(d->Format, d->NumChannels), K_ARRAY, &key);
    if (rc == CUDA_SUCCESS) *pHandle = (CUarray)(uintptr_t)key;
    return rc;
}

static size_t size3d(const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned int levels) {
    size_t total = 0, w = one(d->Width), h = one(d->Height), z = one(d->Depth);
    for (unsigned int l = 0; l < levels; l++) {
        total += w * h * z * elem(d->Format, d->NumChannels);
        w = w > 1 ? w / 2 : 1, h = h > 1 ? h / 2 : 1, z = z > 1 ? z / 2 : 1;
    }
    return total;
}

CUresult impl_cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d) {
    if (!pHandle || !d || !d->Width || !d->NumChannels) return CUDA_ERROR_INVALID_VALUE;
    if (!current) return initialized ? CUDA_ERROR_INVALID_CONTEXT : CUDA_ERROR_NOT_INITIALIZED;
    unsigned long long key;
    CUresult rc = take(current_dev(), size3d(d, 1), K_ARRAY, &key);
    if (rc == CUDA_SUCCESS) *pHandle = (CUarray)(uintptr_t)key;
    return rc;
}
CUresult impl_cuArrayDestroy(CUarray a) { return give((uintptr_t)a, K_ARRAY); }

CUresult impl_cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned int levels) {
    if (!pHandle || !d || !d->Width || !d->NumChannels || !levels) return CUDA_ERROR_INVALID_VALUE;
    if (!current) return initialized ? CUDA_ERROR_INVALID_CONTEXT : CUDA_ERROR_NOT_INITIALIZED;
    unsigned long long key;
    CUresult rc = take(current_dev(), size3d(d, levels), K_MIPMAP, &key);
    if (rc == CUDA_SUCCESS) *pHandle = (CUmipmappedArray)(uintptr_t)key;
    return rc;
}
CUresult impl_cuMipmappedArrayDestroy(CUmipmappedArray a) { return give((uintptr_t)a, K_MIPMAP); }

CUresult impl_cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags,
                                  CUdriverProcAddressQueryResult *status) {
    if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
    const struct proc *best = NULL;
    int base_seen = 0;
    int want_ptds = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    for (size_t i = 0; i < NPROCS; i++) {
        const struct proc *p = &procs[i];
        if (strcmp(p->base, symbol) != 0) continue;
        base_seen = 1;
        if (p->version > version || (p->ptds && !want_ptds)) continue;
        if (!best || p->version > best->version || (p->ptds && !best->ptds)) best = p;
    }
    *pfn = NULL;
    if (!best) {
        if (status) *status = base_seen ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        return CUDA_ERROR_NOT_FOUND;
    }
    const char *tramp = getenv("STUB_CUDA_PROC_TRAMPOLINES");
    *pfn = tramp && *tramp == '1' ? best->tramp : best->impl;
    if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
}

CUresult impl_cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags) {
    return impl_cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}

/* Kernels: a module is any image, a function any name; launches need a current context. */
static struct CUmod_st { int unused; } the_module;
static struct CUfunc_st { int unused; } the_function;
CUresult impl_cuModuleLoadData(CUmodule *module, const void *image) {
    if (!current) return initialized ? CUDA_ERROR_INVALID_CONTEXT : CUDA_ERROR_NOT_INITIALIZED;
    if (!module || !image) return CUDA_ERROR_INVALID_VALUE;
    *module = &the_module;
    return CUDA_SUCCESS;
}
CUresult impl_cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name) {
    if (!f || m != &the_module || !name) return CUDA_ERROR_INVALID_VALUE;
    *f = &the_function;
    return CUDA_SUCCESS;
}
/* Launches, streams and events live in stub_launch.c (a simulated GPU timeline, included at the
 * end: the exported aliases need their definitions in this file); it asks these. */
__attribute__((visibility("hidden"))) int stub_is_function(CUfunction f) { return f == &the_function; }
__attribute__((visibility("hidden"))) CUresult stub_current_ctx(CUcontext *ctx) {
    *ctx = current;
    if (!current) return initialized ? CUDA_ERROR_INVALID_CONTEXT : CUDA_ERROR_NOT_INITIALIZED;
    return CUDA_SUCCESS;
}

/* Pinned host memory, mapped into the device's address space with CU_MEMHOSTALLOC_DEVICEMAP. */
static struct host { void *p; size_t size; unsigned int flags; } *hosts;
static size_t nhosts, caphosts;
static unsigned long long host_used;

static struct host *host_find(unsigned long long addr, size_t len, int exact) {
    for (size_t i = 0; i < nhosts; i++) {
        unsigned long long start = (uintptr_t)hosts[i].p;
        if (exact ? addr == start : addr >= start && addr - start <= hosts[i].size && len <= hosts[i].size - (addr - start))
            return &hosts[i];
    }
    return NULL;
}

CUresult impl_cuMemHostAlloc(void **pp, size_t bytesize, unsigned int flags) {
    if (!current) return initialized ? CUDA_ERROR_INVALID_CONTEXT : CUDA_ERROR_NOT_INITIALIZED;
    if (!pp || !bytesize || (flags & ~0x7u)) return CUDA_ERROR_INVALID_VALUE;
    const char *cap = getenv("STUB_CUDA_HOST_MIB");
    unsigned long long limit = cap ? strtoull(cap, NULL, 10) << 20 : 0;
    pthread_mutex_lock(&mu);
    void *p = limit && host_used + bytesize > limit ? NULL : malloc(bytesize);
    if (p && nhosts == caphosts) {
        caphosts = caphosts ? caphosts * 2 : 64;
        hosts = realloc(hosts, caphosts * sizeof *hosts);
    }
    if (p) {
        hosts[nhosts++] = (struct host){p, bytesize, flags};
        host_used += bytesize;
    }
    pthread_mutex_unlock(&mu);
    *pp = p;
    return p ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult impl_cuMemHostGetDevicePointer_v2(CUdeviceptr *pdptr, void *p, unsigned int flags) {
    if (!current) return initialized ? CUDA_ERROR_INVALID_CONTEXT : CUDA_ERROR_NOT_INITIALIZED;
    if (!pdptr || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    struct host *h = host_find((uintptr_t)p, 0, 0);
    int mapped = h && (h->flags & CU_MEMHOSTALLOC_DEVICEMAP);
    pthread_mutex_unlock(&mu);
    if (!mapped) return CUDA_ERROR_INVALID_VALUE;
    *pdptr = (uintptr_t)p;
    return CUDA_SUCCESS;
}

CUresult impl_cuMemFreeHost(void *p) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    pthread_mutex_lock(&mu);
    struct host *h = host_find((uintptr_t)p, 0, 1);
    if (h) {
        host_used -= h->size;
        free(h->p);
        *h = hosts[--nhosts];
    }
    pthread_mutex_unlock(&mu);
    return h ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* Where [addr, addr+len) lives: 1 device memory, 2 mapped host memory, 0 neither (or unbacked). */
static int kind_of(unsigned long long addr, size_t len, void **at) {
    for (size_t i = 0; i < nallocs; i++)
        if (allocs[i].kind == K_PTR && allocs[i].backed && addr >= allocs[i].key &&
            addr - allocs[i].key <= allocs[i].size && len <= allocs[i].size - (addr - allocs[i].key)) {
            *at = (void *)(uintptr_t)addr;
            return 1;
        }
    struct host *h = host_find(addr, len, 0);
    if (h && (h->flags & CU_MEMHOSTALLOC_DEVICEMAP)) {
        *at = (void *)(uintptr_t)addr;
        return 2;
    }
    return 0;
}

static CUresult copy(unsigned long long dev_addr, void *host, size_t n, int to_device) {
    if (!current) return initialized ? CUDA_ERROR_INVALID_CONTEXT : CUDA_ERROR_NOT_INITIALIZED;
    if (!host && n) return CUDA_ERROR_INVALID_VALUE;
    void *at = NULL;
    pthread_mutex_lock(&mu);
    int kind = kind_of(dev_addr, n, &at);
    if (kind) {
        if (to_device) memcpy(at, host, n);
        else memcpy(host, at, n);
    }
    pthread_mutex_unlock(&mu);
    return kind ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult impl_cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) { return copy(dst, (void *)(uintptr_t)src, n, 1); }
CUresult impl_cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) { return copy(src, dst, n, 0); }

/* For the tests: where a pointer lives (1 device, 2 mapped host, 0 unknown), and the host side. */
STUB_EXPORT int stubMemKind(unsigned long long addr) {
    void *at;
    pthread_mutex_lock(&mu);
    int kind = kind_of(addr, 1, &at);
    pthread_mutex_unlock(&mu);
    return kind;
}
STUB_EXPORT unsigned long long stubHostUsed(void) { return host_used; }
STUB_EXPORT unsigned long long stubHostAllocs(void) { return nhosts; }

/* For the tests: memory taken behind libvgpu's back, and what the fake device holds. */
STUB_EXPORT CUresult stubAllocUntracked(CUdeviceptr *dptr, size_t size) { return alloc_current(dptr, size); }
STUB_EXPORT unsigned long long stubDeviceUsed(int dev) { return dev >= 0 && dev < MAX_DEV ? dev_used[dev] : 0; }

#include "stub_launch.c"
