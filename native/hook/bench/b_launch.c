/* What libvgpu adds to a kernel launch: ns per cuLaunchKernel, the launch call alone (the queue is
 * drained between repeats, not timed). Run it bare, preloaded with no limit (the fast path), and
 * preloaded with a limit the work never reaches (the measured path: timing events, bucket,
 * capture check); `make bench-launch` runs all three against the stub driver. Against the stub
 * the kernels take no time (stubSetKernelNs(0)); against a real driver the kernel is an empty PTX
 * one.
 * usage: b_launch LAUNCHES REPEATS
 * prints launch_ns (median of the repeats) and launch_min_ns */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "bench/common.h"

static const char ptx[] =
    ".version 7.0\n.target sm_50\n.address_size 64\n.visible .entry empty()\n{\n ret;\n}\n";

int main(int argc, char **argv) {
    int launches = argc > 1 ? atoi(argv[1]) : 200000, repeats = argc > 2 ? atoi(argv[2]) : 7;
    if (repeats > 64) repeats = 64;
    if (repeats < 1) repeats = 1;
    void (*set_kernel)(unsigned long long) = (void (*)(unsigned long long))dlsym(RTLD_DEFAULT, "stubSetKernelNs");
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    CUfunction fn;
    CUstream s;
    check(cuInit(0), "cuInit");
    if (set_kernel) set_kernel(0);
    check(cuDeviceGet(&dev, 0), "cuDeviceGet");
    check(cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
    check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
    check(cuModuleLoadData(&mod, ptx), "cuModuleLoadData");
    check(cuModuleGetFunction(&fn, mod, "empty"), "cuModuleGetFunction");
    check(cuStreamCreate(&s, 0), "cuStreamCreate");
    double ns[64];
    for (int r = 0; r < repeats; r++) {
        for (int i = 0; i < 1000; i++) check(cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL), "warm");
        check(cuStreamSynchronize(s), "sync");
        double t0 = now();
        for (int i = 0; i < launches; i++) check(cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL), "launch");
        ns[r] = (now() - t0) / launches * 1e9;
        check(cuStreamSynchronize(s), "sync");
    }
    qsort(ns, (size_t)repeats, sizeof ns[0], cmp);
    printf("launch_ns=%.1f\nlaunch_min_ns=%.1f\n", ns[repeats / 2], ns[0]);
    return 0;
}
