/* One allocation path, until the driver or the hook says no; then a free and a retry.
 * usage: t_alloc MODE PATH CHUNK_MIB [DEVICE]   (T_ALLOC_PAUSE=1: stop after the first chunk until a line on stdin)
 * PATH: alloc pitch managed async pool vmm array array3d mipmap */
#include "common.h"

static const char *path;
static CUdevice dev;
static size_t chunk;
static CUmemoryPool pool;

static uint64_t chunk_bytes(void) {
    if (strcmp(path, "mipmap") == 0) return chunk + chunk / 4; /* two levels of a 2D image */
    return chunk;
}

static CUresult take(unsigned long long *handle) {
    size_t mib = chunk >> 20;
    if (strcmp(path, "alloc") == 0) return R(cuMemAlloc_v2, "cuMemAlloc")(handle, chunk);
    if (strcmp(path, "pitch") == 0) {
        size_t pitch = 0;
        return R(cuMemAllocPitch_v2, "cuMemAllocPitch")(handle, &pitch, 1 << 20, mib, 4);
    }
    if (strcmp(path, "managed") == 0) return R(cuMemAllocManaged, "cuMemAllocManaged")(handle, chunk, 1);
    if (strcmp(path, "async") == 0) return R(cuMemAllocAsync, "cuMemAllocAsync")(handle, chunk, NULL);
    if (strcmp(path, "pool") == 0) return R(cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync")(handle, chunk, pool, NULL);
    if (strcmp(path, "vmm") == 0) {
        CUmemAllocationProp prop;
        memset(&prop, 0, sizeof prop);
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = dev;
        return R(cuMemCreate, "cuMemCreate")(handle, chunk, &prop, 0);
    }
    if (strcmp(path, "array") == 0) {
        CUDA_ARRAY_DESCRIPTOR d = {16384, 16 * mib, CU_AD_FORMAT_FLOAT, 1};
        return R(cuArrayCreate_v2, "cuArrayCreate")((CUarray *)handle, &d);
    }
    CUDA_ARRAY3D_DESCRIPTOR d = {16384, 16, mib, CU_AD_FORMAT_FLOAT, 1, 0};
    if (strcmp(path, "array3d") == 0) return R(cuArray3DCreate_v2, "cuArray3DCreate")((CUarray *)handle, &d);
    if (strcmp(path, "mipmap") == 0) {
        CUDA_ARRAY3D_DESCRIPTOR m = {16384, 16 * mib, 0, CU_AD_FORMAT_FLOAT, 1, 0};
        return R(cuMipmappedArrayCreate, "cuMipmappedArrayCreate")((CUmipmappedArray *)handle, &m, 2);
    }
    die("unknown path", 0);
    return CUDA_ERROR_UNKNOWN;
}

static CUresult give(unsigned long long handle) {
    if (strcmp(path, "async") == 0 || strcmp(path, "pool") == 0)
        return R(cuMemFreeAsync, "cuMemFreeAsync")(handle, NULL);
    if (strcmp(path, "vmm") == 0) return R(cuMemRelease, "cuMemRelease")(handle);
    if (strcmp(path, "array") == 0 || strcmp(path, "array3d") == 0)
        return R(cuArrayDestroy, "cuArrayDestroy")((CUarray)(uintptr_t)handle);
    if (strcmp(path, "mipmap") == 0) return R(cuMipmappedArrayDestroy, "cuMipmappedArrayDestroy")((CUmipmappedArray)(uintptr_t)handle);
    return R(cuMemFree_v2, "cuMemFree")(handle);
}

int main(int argc, char **argv) {
    if (argc < 4) die("usage: t_alloc MODE PATH CHUNK_MIB [DEVICE]", 0);
    setup(argv[1]);
    path = argv[2];
    chunk = (size_t)strtoull(argv[3], NULL, 10) << 20;
    dev = open_device(argc > 4 ? atoi(argv[4]) : 0);
    if (strcmp(path, "pool") == 0) R(cuDeviceGetDefaultMemPool, "cuDeviceGetDefaultMemPool")(&pool, dev);
    printf("chunk_bytes=%llu\n", (unsigned long long)chunk_bytes());
    unsigned long long handles[4096];
    int n = 0;
    CUresult rc = CUDA_SUCCESS;
    const char *pause = getenv("T_ALLOC_PAUSE"); /* after the first chunk, wait for a line on stdin */
    while (n < 4096 && (rc = take(&handles[n])) == CUDA_SUCCESS) {
        if (++n == 1 && pause && *pause) {
            printf("paused=1\n");
            fflush(stdout);
            char line[8];
            if (!fgets(line, sizeof line, stdin)) die("stdin closed while paused", 0);
        }
    }
    printf("chunks=%d\nrefused=%d\n", n, rc);
    printf("driver_used=%llu\n", driver_used(dev));
    if (n > 0) {
        printf("free=%d\n", give(handles[n - 1]));
        printf("again=%d\n", take(&handles[n - 1]));
        for (int i = 0; i < n; i++) give(handles[i]);
    }
    printf("driver_used_end=%llu\n", driver_used(dev));
    printf("alive=1\n");
    return 0;
}
