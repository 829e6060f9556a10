/* One of many processes started at once (bench/bench_many.py, tests/support/many.py): waits at a
 * barrier, then goes through a CUDA program's start-up as the driver API sees it and reports how
 * long each step took, holds what it got until told to finish, gives it back and exits.
 *
 * usage: b_many MODE ALLOC_BYTES GO_FD HOLD_FD READY_FD
 *   MODE ctx: cuInit, the devices enumerated (count, handle, UUID), cuDeviceTotalMem, the primary
 *        context retained and made current, one allocation of ALLOC_BYTES, cuMemGetInfo;
 *   MODE query: the same up to cuDeviceTotalMem, no context (what a process that only looks at
 *        the devices does; it attaches the hook all the same).
 *   GO_FD: the barrier, read until end of file (the parent closes its end to release everyone);
 *   HOLD_FD: read until end of file after the report, holding the context and the allocation;
 *   READY_FD: one byte written when waiting at the barrier, one more when the report is out.
 * Prints one line of key=value pairs (one write, so many processes may share one O_APPEND file):
 * pid, wake_ns and done_ns (CLOCK_MONOTONIC, comparable across processes), the steps' ns, the
 * driver's answer to context creation (ctx_rc, -1 when not asked) and to the allocation
 * (alloc_rc), cuDeviceTotalMem's total and cuMemGetInfo's free and total; failed=STEP:RC when a
 * step other than those two failed. Exit status 0 unless a step failed or a pipe broke. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "api.h"

static uint64_t ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ULL + (uint64_t)t.tv_nsec;
}

static int wait_eof(int fd) {
    char buf[64];
    ssize_t n;
    while ((n = read(fd, buf, sizeof buf)) > 0) {
    }
    return n == 0 ? 0 : -1;
}

static int signal_ready(int fd) { return write(fd, "r", 1) == 1 ? 0 : -1; }

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: b_many ctx|query ALLOC_BYTES GO_FD HOLD_FD READY_FD\n");
        return 2;
    }
    int with_ctx = strcmp(argv[1], "ctx") == 0;
    size_t alloc = (size_t)strtoull(argv[2], NULL, 10);
    int go = atoi(argv[3]), hold = atoi(argv[4]), ready = atoi(argv[5]);
    if (signal_ready(ready) != 0 || wait_eof(go) != 0) return 3;

    uint64_t wake = ns(), t = wake, init_ns = 0, query_ns = 0, ctx_ns = 0, alloc_ns = 0;
    const char *failed = NULL;
    CUresult rc = CUDA_SUCCESS, ctx_rc = (CUresult)-1, alloc_rc = (CUresult)-1;
    int count = 0;
    CUdevice dev = 0;
    CUuuid uuid;
    CUcontext ctx = NULL;
    CUdeviceptr ptr = 0;
    size_t total = 0, info_free = 0, info_total = 0;
#define STEP(what, call) \
    do { if (!failed && (rc = (call)) != CUDA_SUCCESS) failed = what; } while (0)
    STEP("cuInit", cuInit(0));
    init_ns = ns() - t, t = ns();
    STEP("cuDeviceGetCount", cuDeviceGetCount(&count));
    STEP("cuDeviceGet", cuDeviceGet(&dev, 0));
    STEP("cuDeviceGetUuid", cuDeviceGetUuid(&uuid, dev));
    STEP("cuDeviceTotalMem", cuDeviceTotalMem_v2(&total, dev));
    query_ns = ns() - t, t = ns();
    if (!failed && with_ctx) {
        ctx_rc = cuDevicePrimaryCtxRetain(&ctx, dev);
        if (ctx_rc == CUDA_SUCCESS) STEP("cuCtxSetCurrent", cuCtxSetCurrent(ctx));
        ctx_ns = ns() - t, t = ns();
        if (ctx_rc == CUDA_SUCCESS && !failed) {
            alloc_rc = cuMemAlloc_v2(&ptr, alloc);
            STEP("cuMemGetInfo", cuMemGetInfo_v2(&info_free, &info_total));
            alloc_ns = ns() - t;
        }
    }
#undef STEP
    uint64_t done = ns();
    char why[96] = "";
    if (failed) snprintf(why, sizeof why, " failed=%s:%d", failed, (int)rc);
    char line[512];
    int n = snprintf(line, sizeof line,
                     "pid=%d wake_ns=%llu done_ns=%llu init_ns=%llu query_ns=%llu ctx_ns=%llu alloc_ns=%llu "
                     "devices=%d ctx_rc=%d alloc_rc=%d total=%llu info_free=%llu info_total=%llu%s\n",
                     (int)getpid(), (unsigned long long)wake, (unsigned long long)done,
                     (unsigned long long)init_ns, (unsigned long long)query_ns, (unsigned long long)ctx_ns,
                     (unsigned long long)alloc_ns, count, (int)ctx_rc, (int)alloc_rc, (unsigned long long)total,
                     (unsigned long long)info_free, (unsigned long long)info_total, why);
    if (n <= 0 || write(STDOUT_FILENO, line, (size_t)n) != n) return 3;
    if (signal_ready(ready) != 0 || wait_eof(hold) != 0) return 3;
    if (alloc_rc == CUDA_SUCCESS) cuMemFree_v2(ptr);
    if (ctx_rc == CUDA_SUCCESS) cuDevicePrimaryCtxRelease_v2(dev);
    return failed ? 1 : 0;
}
