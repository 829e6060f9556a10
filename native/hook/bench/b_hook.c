/* Per-call cost of an empty-kernel launch and of a 1 MiB cuMemAlloc+cuMemFree, through the
 * driver API as a program linked with -lcuda calls it (so libvgpu, when preloaded, is on the
 * path exactly as for any application). The kernel is PTX, JIT-compiled by the driver: no nvcc.
 * usage: b_hook LAUNCHES ALLOCS REPEATS
 * prints the median and the best of the repeats: launch_us, launch_min_us, alloc_free_us, alloc_free_min_us */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "bench/common.h"

static const char ptx[] =
    ".version 7.0\n.target sm_50\n.address_size 64\n.visible .entry empty()\n{\n ret;\n}\n";

int main(int argc, char **argv) {
    int launches = argc > 1 ? atoi(argv[1]) : 100000, allocs = argc > 2 ? atoi(argv[2]) : 20000;
    int repeats = argc > 3 ? atoi(argv[3]) : 5;
    if (repeats > 64) repeats = 64;
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    CUfunction fn;
    check(cuInit(0), "cuInit");
    check(cuDeviceGet(&dev, 0), "cuDeviceGet");
    check(cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
    check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
    check(cuModuleLoadData(&mod, ptx), "cuModuleLoadData");
    check(cuModuleGetFunction(&fn, mod, "empty"), "cuModuleGetFunction");
    double launch[64], alloc[64];
    for (int r = 0; r < repeats; r++) {
        for (int i = 0; i < 1000; i++) check(cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL), "warm");
        check(cuCtxSynchronize(), "sync");
        double t0 = now();
        for (int i = 0; i < launches; i++) check(cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL), "launch");
        check(cuCtxSynchronize(), "sync");
        launch[r] = (now() - t0) / launches * 1e6;
        CUdeviceptr p;
        t0 = now();
        for (int i = 0; i < allocs; i++) {
            check(cuMemAlloc_v2(&p, 1 << 20), "cuMemAlloc");
            check(cuMemFree_v2(p), "cuMemFree");
        }
        alloc[r] = (now() - t0) / allocs * 1e6;
    }
    qsort(launch, (size_t)repeats, sizeof launch[0], cmp);
    qsort(alloc, (size_t)repeats, sizeof alloc[0], cmp);
    printf("launch_us=%.4f\nalloc_free_us=%.4f\n", launch[repeats / 2], alloc[repeats / 2]);
    printf("launch_min_us=%.4f\nalloc_free_min_us=%.4f\n", launch[0], alloc[0]);
    return 0;
}
