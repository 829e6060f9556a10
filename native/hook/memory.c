/* Policy: every way device memory is taken is charged against the device's limit before the
 * driver is asked, and uncharged when the driver gives it back. Over the limit the call returns
 * CUDA_ERROR_OUT_OF_MEMORY and the driver is never asked. Frees of anything libvgpu did not
 * see go to the driver untouched.
 *
 * Virtual device memory: the budget (budget[i], 0 = none) caps the bytes on the device itself
 * (used - spilled). cuMemAlloc_v2 and cuMemAllocPitch_v2 past the budget, or refused by the
 * driver for want of memory, are served from pinned host memory mapped into the device
 * (cuMemHostAlloc DEVICEMAP|PORTABLE) when CUDA_OVERSUBSCRIBE is on; the limit still counts
 * them. Without it, and on every other path, the budget is a device cap: past it,
 * CUDA_ERROR_OUT_OF_MEMORY. Never managed memory. */
#include <pthread.h>
#include <string.h>
#include <time.h>

#include "hook.h"

#define EXPORT __attribute__((visibility("default")))
#define ACTIVE() (__builtin_expect(!vgpu_in_hook, 1) && vgpu_enabled())

#define GUARDED(name, args) \
    ({ vgpu_in_hook++; CUresult r_ = CU_REAL(name, args); vgpu_in_hook--; r_; })

#define LOG_ONCE(level, ...)                                               \
    do {                                                                   \
        static int told_;                                                  \
        if (!__atomic_exchange_n(&told_, 1, __ATOMIC_RELAXED)) VGPU_LOG(level, __VA_ARGS__); \
    } while (0)

/* Past the budget without a way to spill: refused, said once. */
static CUresult over_budget(int idx, uint64_t bytes, const char *call) {
    vgpu_uncharge(idx, bytes);
    LOG_ONCE(VGPU_LOG_WARN, "device %d: %s of %llu bytes refused (CUDA_ERROR_OUT_OF_MEMORY): the container's device "
             "memory budget of %llu bytes is reached. %s", idx, call, (unsigned long long)bytes,
             (unsigned long long)vgpu_budget(idx),
             vgpu_oversubscribe() ? "Only cuMemAlloc and cuMemAllocPitch (cudaMalloc) spill to host memory; "
                                    "raise CUDA_DEVICE_MEMORY_BUDGET or allocate through cudaMalloc"
                                  : "Set CUDA_OVERSUBSCRIBE=true to spill past it into host memory, or raise "
                                    "CUDA_DEVICE_MEMORY_BUDGET");
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* charge, allocate, keep or roll back */
#define ALLOC(name, args, idx_expr, bytes_expr, kind, key_expr)            \
    do {                                                                   \
        if (!ACTIVE()) return CU_REAL(name, args);                         \
        int idx_ = (idx_expr), over_ = 0;                                  \
        uint64_t bytes_ = (bytes_expr);                                    \
        if (vgpu_charge_budget(idx_, bytes_, &over_) != 0) return CUDA_ERROR_OUT_OF_MEMORY; \
        if (over_) return over_budget(idx_, bytes_, #name);                \
        CUresult rc_ = GUARDED(name, args);                                \
        if (rc_ == CUDA_SUCCESS) vgpu_track_add(kind, (uint64_t)(key_expr), bytes_, idx_); \
        else vgpu_uncharge(idx_, bytes_);                                  \
        return rc_;                                                        \
    } while (0)

/* take out of the table, free, put back if the driver refused */
#define FREE(name, args, kind, key_expr)                                   \
    do {                                                                   \
        if (!ACTIVE()) return CU_REAL(name, args);                         \
        uint64_t size_ = 0;                                                \
        int idx_ = 0;                                                      \
        int mine_ = vgpu_track_take(kind, (uint64_t)(key_expr), &size_, &idx_); \
        CUresult rc_ = GUARDED(name, args);                                \
        if (mine_ && rc_ == CUDA_SUCCESS) vgpu_uncharge(idx_, size_);       \
        else if (mine_) vgpu_track_add(kind, (uint64_t)(key_expr), size_, idx_); \
        return rc_;                                                        \
    } while (0)

/* Spilled allocations this process holds; frees look in the table for them only while there are some. */
static int spills_live;

/* Serves `bytes`, already charged, from pinned host memory mapped into the device's address
 * space. The caller uncharges when this fails. */
static CUresult spill(int idx, uint64_t bytes, CUdeviceptr *dptr, int over) {
    void *host = NULL;
    CUresult rc = GUARDED(cuMemHostAlloc, (&host, (size_t)bytes, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE));
    if (rc != CUDA_SUCCESS) {
        LOG_ONCE(VGPU_LOG_ERROR, "device %d: cannot spill %llu bytes to host memory: cuMemHostAlloc returned %d. "
                 "Pinned host memory is bounded by the host's RAM, the container's memory limit and, on some "
                 "systems, RLIMIT_MEMLOCK (ulimit -l); free host memory or raise those limits, or lower "
                 "CUDA_DEVICE_MEMORY_LIMIT toward the budget. The allocation fails with "
                 "CUDA_ERROR_OUT_OF_MEMORY", idx, (unsigned long long)bytes, (int)rc);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUdeviceptr d = 0;
    rc = GUARDED(cuMemHostGetDevicePointer_v2, (&d, host, 0));
    if (rc != CUDA_SUCCESS) {
        GUARDED(cuMemFreeHost, (host));
        LOG_ONCE(VGPU_LOG_ERROR, "device %d: host memory for a spill cannot be mapped into the device "
                 "(cuMemHostGetDevicePointer returned %d): the device or driver does not map host memory. "
                 "The allocation fails with CUDA_ERROR_OUT_OF_MEMORY; unset CUDA_OVERSUBSCRIBE for this card",
                 idx, (int)rc);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    vgpu_spill_move(idx, bytes);
    vgpu_track_add_aux(VGPU_KIND_SPILL, d, bytes, (uint64_t)(uintptr_t)host, idx);
    __atomic_fetch_add(&spills_live, 1, __ATOMIC_RELAXED);
    LOG_ONCE(VGPU_LOG_WARN, "device %d: spilling to mapped host memory (%s); kernels reach spilled data over the "
             "host link, far slower than device memory. Raise CUDA_DEVICE_MEMORY_BUDGET or use less memory to "
             "keep data on the card", idx,
             over ? "the device memory budget is reached" : "the card is out of free memory");
    *dptr = d;
    return CUDA_SUCCESS;
}

/* After the device part was refused (past the budget, or the driver's `rc`): spill or give up. */
static CUresult spill_or_refuse(int idx, uint64_t bytes, CUdeviceptr *dptr, int over, CUresult rc, const char *call) {
    if ((over || rc == CUDA_ERROR_OUT_OF_MEMORY) && idx >= 0 && vgpu_oversubscribe()) {
        rc = spill(idx, bytes, dptr, over);
        if (rc == CUDA_SUCCESS) return rc;
    } else if (over) {
        return over_budget(idx, bytes, call);
    }
    vgpu_uncharge(idx, bytes); /* the driver's own error, untouched */
    return rc;
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    if (!ACTIVE() || !dptr || !bytesize) return CU_REAL(cuMemAlloc_v2, (dptr, bytesize));
    int idx = vgpu_index_current(), over = 0;
    if (vgpu_charge_budget(idx, bytesize, &over) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = CUDA_ERROR_OUT_OF_MEMORY;
    if (!over) {
        rc = GUARDED(cuMemAlloc_v2, (dptr, bytesize));
        if (rc == CUDA_SUCCESS) {
            vgpu_track_add(VGPU_KIND_PTR, *dptr, bytesize, idx);
            return rc;
        }
    }
    return spill_or_refuse(idx, bytesize, dptr, over, rc, "cuMemAlloc");
}

EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    ALLOC(cuMemAllocManaged, (dptr, bytesize, flags), vgpu_index_current(), bytesize, VGPU_KIND_PTR, *dptr);
}

EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    ALLOC(cuMemAllocAsync, (dptr, bytesize, hStream), vgpu_index_current(), bytesize, VGPU_KIND_PTR, *dptr);
}

EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    ALLOC(cuMemAllocAsync_ptsz, (dptr, bytesize, hStream), vgpu_index_current(), bytesize, VGPU_KIND_PTR, *dptr);
}

EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream) {
    ALLOC(cuMemAllocFromPoolAsync, (dptr, bytesize, pool, hStream), vgpu_index_current(), bytesize, VGPU_KIND_PTR,
          *dptr);
}

EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                             CUstream hStream) {
    ALLOC(cuMemAllocFromPoolAsync_ptsz, (dptr, bytesize, pool, hStream), vgpu_index_current(), bytesize,
          VGPU_KIND_PTR, *dptr);
}

/* The pitch is the driver's choice: charge a 512-byte-aligned guess, then settle on the truth.
 * A spilled pitched allocation gets that guess as its pitch. Arguments the driver would refuse
 * go to it untouched. */
EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                                   unsigned int ElementSizeBytes) {
    if (!ACTIVE() || !dptr || !pPitch || !WidthInBytes || !Height ||
        (ElementSizeBytes != 4 && ElementSizeBytes != 8 && ElementSizeBytes != 16))
        return CU_REAL(cuMemAllocPitch_v2, (dptr, pPitch, WidthInBytes, Height, ElementSizeBytes));
    int idx = vgpu_index_current(), over = 0;
    size_t pitch = (WidthInBytes + 511) & ~(size_t)511;
    uint64_t guess = (uint64_t)pitch * Height;
    if (vgpu_charge_budget(idx, guess, &over) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = over ? CUDA_ERROR_OUT_OF_MEMORY
                       : GUARDED(cuMemAllocPitch_v2, (dptr, pPitch, WidthInBytes, Height, ElementSizeBytes));
    if (rc != CUDA_SUCCESS) {
        rc = spill_or_refuse(idx, guess, dptr, over, rc, "cuMemAllocPitch");
        if (rc == CUDA_SUCCESS) *pPitch = pitch;
        return rc;
    }
    uint64_t real = (uint64_t)*pPitch * Height;
    if (real > guess) vgpu_charge(idx, real - guess, 1);
    else if (real < guess) vgpu_uncharge(idx, guess - real);
    vgpu_track_add(VGPU_KIND_PTR, *dptr, real, idx);
    return rc;
}

/* A spilled pointer goes back with cuMemFreeHost, after the work queued on the context is done
 * (a free, even a stream-ordered one, must not pull pages from under a running kernel). 1 = it
 * was a spilled pointer and *rc says how its free went. Also while the process exits (its
 * region slot already dropped): the driver's cuMemFree would refuse a host pointer. */
static int free_spilled(CUdeviceptr dptr, CUresult *rc) {
    if (!__atomic_load_n(&spills_live, __ATOMIC_RELAXED)) return 0;
    uint64_t size = 0, host = 0;
    int idx = 0;
    if (!vgpu_track_take_aux(VGPU_KIND_SPILL, dptr, &size, &host, &idx)) return 0;
    GUARDED(cuCtxSynchronize, ()); /* its error, if any, is the next call's to report */
    *rc = GUARDED(cuMemFreeHost, ((void *)(uintptr_t)host));
    if (*rc == CUDA_SUCCESS) {
        vgpu_uncharge_spilled(idx, size);
        __atomic_fetch_sub(&spills_live, 1, __ATOMIC_RELAXED);
    } else {
        vgpu_track_add_aux(VGPU_KIND_SPILL, dptr, size, host, idx);
    }
    return 1;
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) {
    CUresult rc;
    if (!vgpu_in_hook && free_spilled(dptr, &rc)) return rc;
    FREE(cuMemFree_v2, (dptr), VGPU_KIND_PTR, dptr);
}
EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) {
    CUresult rc;
    if (!vgpu_in_hook && free_spilled(dptr, &rc)) return rc;
    FREE(cuMemFreeAsync, (dptr, hStream), VGPU_KIND_PTR, dptr);
}
EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream) {
    CUresult rc;
    if (!vgpu_in_hook && free_spilled(dptr, &rc)) return rc;
    FREE(cuMemFreeAsync_ptsz, (dptr, hStream), VGPU_KIND_PTR, dptr);
}

/* VMM: physical memory is taken by cuMemCreate and given back by cuMemRelease; mapping and
 * reserving address space take none. */
EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                            unsigned long long flags) {
    if (!prop || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE) return CU_REAL(cuMemCreate, (handle, size, prop, flags));
    ALLOC(cuMemCreate, (handle, size, prop, flags), vgpu_index_of_cu(prop->location.id), size, VGPU_KIND_HANDLE,
          *handle);
}

EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    FREE(cuMemRelease, (handle), VGPU_KIND_HANDLE, handle);
}

/* Arrays: the driver pads them; the element count times the element size is a floor. */
static uint64_t element_bytes(CUarray_format format, unsigned int channels) {
    uint64_t b;
    switch (format) {
    case CU_AD_FORMAT_UNSIGNED_INT8: case CU_AD_FORMAT_SIGNED_INT8: b = 1; break;
    case CU_AD_FORMAT_UNSIGNED_INT16: case CU_AD_FORMAT_SIGNED_INT16: case CU_AD_FORMAT_HALF: b = 2; break;
    default: b = 4; break;
    }
    return b * (channels ? channels : 1);
}

static uint64_t dim(size_t v) { return v ? (uint64_t)v : 1; }

static uint64_t array3d_bytes(const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned int levels) {
    if (!d) return 0;
    uint64_t total = 0, w = dim(d->Width), h = dim(d->Height), z = dim(d->Depth);
    for (unsigned int l = 0; l < (levels ? levels : 1); l++) {
        total += w * h * z * element_bytes(d->Format, d->NumChannels);
        w = w > 1 ? w / 2 : 1;
        h = h > 1 ? h / 2 : 1;
        z = z > 1 ? z / 2 : 1;
    }
    return total;
}

EXPORT CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *d) {
    ALLOC(cuArrayCreate_v2, (pHandle, d), vgpu_index_current(),
          d ? dim(d->Width) * dim(d->Height) * element_bytes(d->Format, d->NumChannels) : 0, VGPU_KIND_ARRAY,
          (uintptr_t)*pHandle);
}

EXPORT CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d) {
    ALLOC(cuArray3DCreate_v2, (pHandle, d), vgpu_index_current(), array3d_bytes(d, 1), VGPU_KIND_ARRAY,
          (uintptr_t)*pHandle);
}

EXPORT CUresult cuArrayDestroy(CUarray hArray) { FREE(cuArrayDestroy, (hArray), VGPU_KIND_ARRAY, (uintptr_t)hArray); }

EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                       unsigned int numMipmapLevels) {
    ALLOC(cuMipmappedArrayCreate, (pHandle, d, numMipmapLevels), vgpu_index_current(),
          array3d_bytes(d, numMipmapLevels), VGPU_KIND_MIPMAP, (uintptr_t)*pHandle);
}

EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray h) {
    FREE(cuMipmappedArrayDestroy, (h), VGPU_KIND_MIPMAP, (uintptr_t)h);
}

/* The context's own footprint: VGPU_CONTEXT_RESERVE, charged once per device per process, before
 * the driver is asked. A context that does not fit the limit is refused with
 * CUDA_ERROR_OUT_OF_MEMORY, as a full card refuses one, and the card is never asked: many
 * processes starting at once hold no more than the grant (issue 23), where charging after the
 * driver's answer let every one of them through. Per device: 0 not charged, 1 being charged (by
 * another thread of this process: wait for its answer), 2 charged. */
static int context_state[VGPU_MAX_DEVICES];
static pthread_once_t context_fork_once = PTHREAD_ONCE_INIT;

/* A fork's child has only the forking thread: a charge another thread had in flight never ends there. */
static void context_child_after_fork(void) {
    for (int i = 0; i < VGPU_MAX_DEVICES; i++)
        if (__atomic_load_n(&context_state[i], __ATOMIC_RELAXED) == 1) __atomic_store_n(&context_state[i], 0, __ATOMIC_RELAXED);
}

static void context_register_fork(void) { pthread_atfork(NULL, NULL, context_child_after_fork); }

/* 1: charged now (ctx_settle() keeps or gives it back); 0: nothing to charge; -1: over the limit */
static int ctx_charge(CUdevice dev, int *idx) {
    uint64_t reserve = vgpu_context_reserve();
    *idx = vgpu_index_of_cu(dev);
    if (*idx < 0 || *idx >= VGPU_MAX_DEVICES || !reserve) return 0;
    pthread_once(&context_fork_once, context_register_fork);
    for (;;) {
        int state = 0;
        if (__atomic_compare_exchange_n(&context_state[*idx], &state, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) break;
        if (state == 2) return 0;
        struct timespec pause = {0, 1000000}; /* another thread's context creation: 1 ms */
        nanosleep(&pause, NULL);
    }
    int rc = vgpu_charge(*idx, reserve, 0);
    if (rc == 0) return 1;
    __atomic_store_n(&context_state[*idx], 0, __ATOMIC_RELEASE);
    if (rc == -1)
            LOG_ONCE(VGPU_LOG_WARN, "device %d: a CUDA context refused (CUDA_ERROR_OUT_OF_MEMORY): its %llu bytes "
                 "(VGPU_CONTEXT_RESERVE) do not fit the container's limit of %llu bytes beside the %llu bytes its "
                 "processes hold. Fewer processes with a context at once, or a larger nvidia.com/gpumem", *idx,
                 (unsigned long long)reserve, (unsigned long long)vgpu_limit(*idx),
                 (unsigned long long)vgpu_used(*idx));
    return -1;
}

static CUresult ctx_settle(int charged, int idx, CUresult rc) {
    if (charged <= 0) return rc;
    if (rc == CUDA_SUCCESS) {
        __atomic_store_n(&context_state[idx], 2, __ATOMIC_RELEASE);
    } else {
        vgpu_uncharge(idx, vgpu_context_reserve());
        __atomic_store_n(&context_state[idx], 0, __ATOMIC_RELEASE);
    }
    return rc;
}

#define CONTEXT(name, args, dev)                                           \
    do {                                                                   \
        if (!ACTIVE()) return CU_REAL(name, args);                         \
        int idx_ = -1, charged_ = ctx_charge(dev, &idx_);                  \
        if (charged_ < 0) return CUDA_ERROR_OUT_OF_MEMORY;                 \
        return ctx_settle(charged_, idx_, GUARDED(name, args));            \
    } while (0)

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    CONTEXT(cuDevicePrimaryCtxRetain, (pctx, dev), dev);
}

EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    CONTEXT(cuCtxCreate_v2, (pctx, flags, dev), dev);
}

EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams, unsigned int flags,
                               CUdevice dev) {
    CONTEXT(cuCtxCreate_v3, (pctx, paramsArray, numParams, flags, dev), dev);
}

EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams, unsigned int flags, CUdevice dev) {
    CONTEXT(cuCtxCreate_v4, (pctx, ctxCreateParams, flags, dev), dev);
}

/* What the process sees: the vGPU, total = its limit, free = what is left of it. With
 * CUDA_OVERSUBSCRIBE the card's own free memory no longer bounds it (spills serve the rest), so
 * the limit is shown even where it is larger than the card. */
EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    CUresult rc = CU_REAL(cuMemGetInfo_v2, (free_bytes, total_bytes));
    if (rc != CUDA_SUCCESS || !ACTIVE()) return rc;
    int idx = vgpu_index_current();
    uint64_t limit = vgpu_limit(idx);
    if (!limit) return rc;
    uint64_t used = vgpu_used(idx);
    uint64_t left = used < limit ? limit - used : 0;
    if (vgpu_oversubscribe()) {
        if (free_bytes) *free_bytes = (size_t)left;
        if (total_bytes) *total_bytes = (size_t)limit;
        return rc;
    }
    if (free_bytes && left < *free_bytes) *free_bytes = (size_t)left;
    if (total_bytes && limit < *total_bytes) *total_bytes = (size_t)limit;
    return rc;
}

EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    CUresult rc = CU_REAL(cuDeviceTotalMem_v2, (bytes, dev));
    if (rc != CUDA_SUCCESS || !bytes || !ACTIVE()) return rc;
    uint64_t limit = vgpu_limit(vgpu_index_of_cu(dev));
    if (limit && (limit < *bytes || vgpu_oversubscribe())) *bytes = (size_t)limit;
    return rc;
}
