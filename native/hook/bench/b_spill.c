/* What virtual device memory costs: cuMemAlloc+cuMemFree of one chunk on the device and spilled
 * to mapped host memory, and (on a real GPU) how fast a kernel reads a buffer in each place.
 * Linked against the driver like any CUDA program; run it with libvgpu preloaded,
 * CUDA_OVERSUBSCRIBE=true and a region file (CUDA_DEVICE_MEMORY_SHARED_CACHE): it moves the
 * spill point itself by writing budget[0] into the region, as the node monitor does.
 * usage: b_spill CHUNK_MIB ITERS REPEATS [READ_MIB]
 * prints device_alloc_free_us, spilled_alloc_free_us (medians), spilled_bytes_seen, and where a
 * kernel can run: device_read_gbps, spilled_read_gbps, read_sum_ok */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "bench/common.h"
#include "region_layout.h"

/* sums n 16-byte vectors of 32-bit words into *out, grid-stride */
static const char ptx[] =
    ".version 7.0\n.target sm_50\n.address_size 64\n"
    ".visible .entry rd(.param .u64 src, .param .u64 n, .param .u64 out)\n{\n"
    " .reg .pred %p;\n .reg .b32 %r<12>;\n .reg .b64 %rd<8>;\n"
    " ld.param.u64 %rd1, [src];\n ld.param.u64 %rd2, [n];\n ld.param.u64 %rd3, [out];\n"
    " cvta.to.global.u64 %rd1, %rd1;\n cvta.to.global.u64 %rd3, %rd3;\n"
    " mov.u32 %r1, %ctaid.x;\n mov.u32 %r2, %ntid.x;\n mov.u32 %r3, %tid.x;\n mov.u32 %r4, %nctaid.x;\n"
    " mad.lo.s32 %r5, %r1, %r2, %r3;\n mul.lo.s32 %r6, %r4, %r2;\n"
    " cvt.u64.u32 %rd4, %r5;\n cvt.u64.u32 %rd5, %r6;\n mov.u32 %r7, 0;\n"
    "L1:\n setp.ge.u64 %p, %rd4, %rd2;\n @%p bra L2;\n"
    " shl.b64 %rd6, %rd4, 4;\n add.s64 %rd7, %rd1, %rd6;\n"
    " ld.global.v4.u32 {%r8, %r9, %r10, %r11}, [%rd7];\n"
    " add.s32 %r7, %r7, %r8;\n add.s32 %r7, %r7, %r9;\n add.s32 %r7, %r7, %r10;\n add.s32 %r7, %r7, %r11;\n"
    " add.s64 %rd4, %rd4, %rd5;\n bra.uni L1;\n"
    "L2:\n atom.global.add.u32 %r8, [%rd3], %r7;\n ret;\n}\n";

static struct vgpu_region_header *region;

static void set_budget(uint64_t bytes) { __atomic_store_n(&region->budget[0], bytes, __ATOMIC_RELAXED); }

static double alloc_free_us(size_t chunk, int iters, int repeats) {
    double t[64];
    for (int r = 0; r < repeats; r++) {
        CUdeviceptr p;
        double t0 = now();
        for (int i = 0; i < iters; i++) {
            check(cuMemAlloc_v2(&p, chunk), "cuMemAlloc");
            check(cuMemFree_v2(p), "cuMemFree");
        }
        t[r] = (now() - t0) / iters * 1e6;
    }
    qsort(t, (size_t)repeats, sizeof t[0], cmp);
    return t[repeats / 2];
}

/* GB/s of a kernel summing `bytes` of ones at p; *ok = the sum came out right */
static double read_gbps(CUfunction fn, CUdeviceptr p, size_t bytes, CUdeviceptr out, int repeats, int *ok) {
    unsigned long long n = bytes / 16;
    unsigned int zero = 0, sum = 0;
    void *params[] = {&p, &n, &out};
    double best = 0;
    *ok = 1;
    for (int r = 0; r < repeats; r++) {
        check(cuMemcpyHtoD_v2(out, &zero, sizeof zero), "zero");
        check(cuCtxSynchronize(), "sync");
        double t0 = now();
        check(cuLaunchKernel(fn, 1024, 1, 1, 256, 1, 1, 0, NULL, params, NULL), "launch");
        check(cuCtxSynchronize(), "sync");
        double gbps = (double)bytes / (now() - t0) / 1e9;
        if (gbps > best) best = gbps;
        check(cuMemcpyDtoH_v2(&sum, out, sizeof sum), "sum");
        if (sum != (unsigned int)(n * 4)) *ok = 0;
    }
    return best;
}

int main(int argc, char **argv) {
    size_t chunk = (size_t)(argc > 1 ? atoi(argv[1]) : 64) << 20;
    int iters = argc > 2 ? atoi(argv[2]) : 200, repeats = argc > 3 ? atoi(argv[3]) : 5;
    size_t read = (size_t)(argc > 4 ? atoi(argv[4]) : 1024) << 20;
    if (repeats > 64) repeats = 64;
    const char *path = getenv("CUDA_DEVICE_MEMORY_SHARED_CACHE");
    int fd = path ? open(path, O_RDWR) : -1;
    CUdevice dev;
    CUcontext ctx;
    check(cuInit(0), "cuInit");
    check(cuDeviceGet(&dev, 0), "cuDeviceGet");
    check(cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
    check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
    CUdeviceptr warm;
    check(cuMemAlloc_v2(&warm, 1 << 20), "cuMemAlloc"); /* libvgpu creates the region file here */
    if (fd < 0 && path) fd = open(path, O_RDWR);
    region = fd >= 0 ? mmap(NULL, VGPU_REGION_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
    if (region == MAP_FAILED) {
        printf("error=set CUDA_DEVICE_MEMORY_SHARED_CACHE (and preload libvgpu with CUDA_OVERSUBSCRIBE=true)\n");
        return 1;
    }
    uint64_t budget = region->budget[0];
    set_budget(0);
    printf("device_alloc_free_us=%.3f\n", alloc_free_us(chunk, iters, repeats));
    set_budget(1); /* every allocation is now past the budget: spilled */
    CUdeviceptr probe;
    check(cuMemAlloc_v2(&probe, chunk), "cuMemAlloc");
    printf("spilled_bytes_seen=%llu\n", (unsigned long long)__atomic_load_n(&region->spilled[0], __ATOMIC_RELAXED));
    check(cuMemFree_v2(probe), "cuMemFree");
    printf("spilled_alloc_free_us=%.3f\n", alloc_free_us(chunk, iters, repeats));
    if (!dlsym(RTLD_DEFAULT, "stubMemKind") && read) { /* a real GPU: how fast kernels reach each place */
        CUmodule mod;
        CUfunction fn;
        check(cuModuleLoadData(&mod, ptx), "cuModuleLoadData");
        check(cuModuleGetFunction(&fn, mod, "rd"), "cuModuleGetFunction");
        unsigned int *ones = malloc(read);
        if (!ones) check(CUDA_ERROR_OUT_OF_MEMORY, "malloc");
        for (size_t i = 0; i < read / 4; i++) ones[i] = 1;
        CUdeviceptr out, p;
        set_budget(0);
        check(cuMemAlloc_v2(&out, 4096), "cuMemAlloc out");
        int ok_dev = 0, ok_sp = 0;
        check(cuMemAlloc_v2(&p, read), "cuMemAlloc device");
        check(cuMemcpyHtoD_v2(p, ones, read), "fill");
        printf("device_read_gbps=%.1f\n", read_gbps(fn, p, read, out, repeats, &ok_dev));
        check(cuMemFree_v2(p), "cuMemFree");
        set_budget(1);
        check(cuMemAlloc_v2(&p, read), "cuMemAlloc spilled");
        printf("spilled_now=%llu\n", (unsigned long long)__atomic_load_n(&region->spilled[0], __ATOMIC_RELAXED));
        check(cuMemcpyHtoD_v2(p, ones, read), "fill");
        printf("spilled_read_gbps=%.1f\n", read_gbps(fn, p, read, out, repeats, &ok_sp));
        check(cuMemFree_v2(p), "cuMemFree");
        printf("read_sum_ok=%d\n", ok_dev && ok_sp);
    }
    set_budget(budget);
    return 0;
}
