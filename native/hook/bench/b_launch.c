/* What libvgpu adds to a kernel launch: ns per cuLaunchKernel, the launch call alone (the queue is
 * drained between repeats, not timed). Run it bare, preloaded with no limit (the fast path), and
 * preloaded with an SM limit (the metered path); `make bench-launch` runs all three against the
 * stub driver and bench/bench_launch.py interleaves them over rounds, on the stub or a GPU.
 * Against the stub the kernels take no time (stubSetKernelNs(0)); against a real driver the
 * kernel is an empty PTX one.
 * usage: b_launch LAUNCHES REPEATS [BURST]
 * BURST > 0: launches come in bursts of BURST, each followed by a pause twice as long as the
 * burst took (the stream drains), and only the bursts are timed: the work then keeps the card busy
 * for well under half the time, so a cap above that never makes a launch wait and the figure is
 * the metering's cost alone (a measured empty kernel on an idle stream counts its launch latency
 * too, a few µs on a GPU, so back-to-back launches can reach even a 99 % cap).
 * prints launch_ns (median of the repeats) and launch_min_ns; with CUDA_DEVICE_MEMORY_SHARED_CACHE
 * set, also the region's throttled_ns and busy_ns for device 0 at the end (time the launches
 * waited for the limit is in launch_ns too, so a run that waited does not measure the hook alone) */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "bench/common.h"
#include "region_layout.h"

static const char ptx[] =
    ".version 7.0\n.target sm_50\n.address_size 64\n.visible .entry empty()\n{\n ret;\n}\n";

static void print_region(void) {
    const char *file = getenv("CUDA_DEVICE_MEMORY_SHARED_CACHE");
    if (!file || !*file) return;
    int fd = open(file, O_RDONLY);
    if (fd < 0) return;
    void *m = mmap(NULL, VGPU_REGION_SIZE, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) return;
    const struct vgpu_region_header *h = m;
    printf("throttled_ns=%llu\n", (unsigned long long)__atomic_load_n(&h->throttled_ns[0], __ATOMIC_RELAXED));
    printf("busy_ns=%llu\n", (unsigned long long)__atomic_load_n(&h->busy_ns[0], __ATOMIC_RELAXED));
    munmap(m, VGPU_REGION_SIZE);
}

int main(int argc, char **argv) {
    int launches = argc > 1 ? atoi(argv[1]) : 200000, repeats = argc > 2 ? atoi(argv[2]) : 7;
    if (repeats > 64) repeats = 64;
    if (repeats < 1) repeats = 1;
    int burst = argc > 3 ? atoi(argv[3]) : 0;
    if (burst < 0 || burst > launches) burst = 0;
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
        double spent = 0;
        for (int done = 0; done < launches;) {
            int n = burst ? (launches - done < burst ? launches - done : burst) : launches;
            double t0 = now();
            for (int i = 0; i < n; i++) check(cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL), "launch");
            double took = now() - t0;
            spent += took;
            done += n;
            if (burst) {
                double until = now() + 2 * took;
                while (now() < until) {}
            }
        }
        ns[r] = spent / launches * 1e9;
        check(cuStreamSynchronize(s), "sync");
    }
    qsort(ns, (size_t)repeats, sizeof ns[0], cmp);
    printf("launch_ns=%.1f\nlaunch_min_ns=%.1f\n", ns[repeats / 2], ns[0]);
    print_region();
    return 0;
}
