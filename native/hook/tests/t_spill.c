/* Virtual device memory, driven line by line from stdin so the test can change the region (as
 * the node monitor does) between steps. Each command answers one line of key=value pairs.
 *   alloc MIB     cuMemAlloc_v2; on success writes a pattern into the chunk -> rc= id= kind=
 *   pitch MIB     cuMemAllocPitch_v2, MIB rows of 1 MiB, 4-byte elements -> rc= id= kind= pitch=
 *   free ID       cuMemFree_v2 (freeasync ID: cuMemFreeAsync on the default stream) -> rc=
 *   check         reads every live chunk's pattern back -> ok= bad=
 *   info          cuMemGetInfo and the stub's own view -> free= total= driver_used= host_used= host_allocs=
 *   storm T N MIB T threads each allocate, write, read back and free N chunks (PyTorch allocates
 *                 from several threads) -> done= failed= refused= device= spilled=
 * kind: 1 device memory, 2 mapped host memory, 0 unknown to the stub, -1 not the stub.
 * usage: t_spill MODE */
#include <pthread.h>

#include "common.h"

#define MAXC 4096
#define PAT (64u << 10)

static struct chunk { CUdeviceptr p; size_t size; int live; } chunks[MAXC];
static int nchunks;
static int (*mem_kind)(unsigned long long);

static void fill(unsigned char *buf, int id, int part) {
    for (unsigned i = 0; i < PAT; i++) buf[i] = (unsigned char)(id * 37 + part * 101 + i * 7 + (i >> 9));
}

/* the pattern goes to the first and the last 64 KiB of the chunk */
static CUresult write_pattern(int id) {
    static unsigned char buf[PAT];
    struct chunk *c = &chunks[id];
    for (int part = 0; part < 2; part++) {
        fill(buf, id, part);
        CUresult rc = R(cuMemcpyHtoD_v2, "cuMemcpyHtoD")(c->p + (part ? c->size - PAT : 0), buf, PAT);
        if (rc) return rc;
    }
    return CUDA_SUCCESS;
}

static int pattern_ok(int id) {
    static unsigned char want[PAT], got[PAT];
    struct chunk *c = &chunks[id];
    for (int part = 0; part < 2; part++) {
        fill(want, id, part);
        memset(got, 0, sizeof got);
        if (R(cuMemcpyDtoH_v2, "cuMemcpyDtoH")(got, c->p + (part ? c->size - PAT : 0), PAT)) return 0;
        if (memcmp(want, got, PAT) != 0) return 0;
    }
    return 1;
}

static void added(CUresult rc, CUdeviceptr p, size_t size, const char *extra) {
    if (rc != CUDA_SUCCESS || nchunks == MAXC) {
        printf("rc=%d id=-1 kind=0%s\n", rc, extra);
        return;
    }
    int id = nchunks++;
    chunks[id] = (struct chunk){p, size, 1};
    CUresult w = write_pattern(id);
    printf("rc=%d id=%d kind=%d write=%d%s\n", rc, id, mem_kind ? mem_kind(p) : -1, w, extra);
}

static struct storm { long iters; size_t size; CUcontext ctx; int failed, refused, device, spilled; } storm;

static void *storm_thread(void *arg) {
    (void)arg;
    unsigned char out[256], in[256];
    R(cuCtxSetCurrent, "cuCtxSetCurrent")(storm.ctx);
    for (long i = 0; i < storm.iters; i++) {
        CUdeviceptr p = 0;
        CUresult rc = R(cuMemAlloc_v2, "cuMemAlloc")(&p, storm.size);
        if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
            __atomic_fetch_add(&storm.refused, 1, __ATOMIC_RELAXED);
            continue;
        }
        int kind = mem_kind ? mem_kind(p) : 0;
        __atomic_fetch_add(kind == 2 ? &storm.spilled : &storm.device, 1, __ATOMIC_RELAXED);
        for (int k = 0; k < 256; k++) out[k] = (unsigned char)(p + (CUdeviceptr)(i + k));
        int bad = rc != CUDA_SUCCESS || R(cuMemcpyHtoD_v2, "cuMemcpyHtoD")(p + storm.size - 256, out, 256) ||
                  R(cuMemcpyDtoH_v2, "cuMemcpyDtoH")(in, p + storm.size - 256, 256) || memcmp(in, out, 256) != 0 ||
                  R(cuMemFree_v2, "cuMemFree")(p);
        if (bad) __atomic_fetch_add(&storm.failed, 1, __ATOMIC_RELAXED);
    }
    return NULL;
}

int main(int argc, char **argv) {
    setup(argc > 1 ? argv[1] : "procaddr");
    CUdevice dev = open_device(0);
    mem_kind = (int (*)(unsigned long long))dlsym(cuda_handle, "stubMemKind");
    unsigned long long (*host_used)(void) = (unsigned long long (*)(void))dlsym(cuda_handle, "stubHostUsed");
    unsigned long long (*host_allocs)(void) = (unsigned long long (*)(void))dlsym(cuda_handle, "stubHostAllocs");
    printf("ready=1 pid=%d\n", (int)getpid());
    fflush(stdout);
    char line[256], cmd[32];
    long arg;
    while (fgets(line, sizeof line, stdin)) {
        int n = sscanf(line, "%31s %ld", cmd, &arg);
        if (n < 1) continue;
        if (strcmp(cmd, "alloc") == 0 && n == 2) {
            CUdeviceptr p = 0;
            size_t size = (size_t)arg << 20;
            CUresult rc = R(cuMemAlloc_v2, "cuMemAlloc")(&p, size);
            added(rc, p, size, "");
        } else if (strcmp(cmd, "pitch") == 0 && n == 2) {
            CUdeviceptr p = 0;
            size_t pitch = 0;
            CUresult rc = R(cuMemAllocPitch_v2, "cuMemAllocPitch")(&p, &pitch, 1 << 20, (size_t)arg, 4);
            char extra[64];
            snprintf(extra, sizeof extra, " pitch=%zu", pitch);
            added(rc, p, pitch * (size_t)arg, extra);
        } else if ((strcmp(cmd, "free") == 0 || strcmp(cmd, "freeasync") == 0) && n == 2) {
            if (arg < 0 || arg >= nchunks || !chunks[arg].live) {
                printf("rc=-1\n");
            } else {
                CUresult rc = cmd[4] ? R(cuMemFreeAsync, "cuMemFreeAsync")(chunks[arg].p, NULL)
                                     : R(cuMemFree_v2, "cuMemFree")(chunks[arg].p);
                if (rc == CUDA_SUCCESS) chunks[arg].live = 0;
                printf("rc=%d\n", rc);
            }
        } else if (strcmp(cmd, "check") == 0) {
            int ok = 0, bad = 0;
            for (int i = 0; i < nchunks; i++)
                if (chunks[i].live) pattern_ok(i) ? ok++ : bad++;
            printf("ok=%d bad=%d\n", ok, bad);
        } else if (strcmp(cmd, "info") == 0) {
            size_t fr = 0, total = 0;
            CUresult rc = R(cuMemGetInfo_v2, "cuMemGetInfo")(&fr, &total);
            printf("rc=%d free=%zu total=%zu driver_used=%llu host_used=%llu host_allocs=%llu\n", rc, fr, total,
                   driver_used(dev), host_used ? host_used() : 0, host_allocs ? host_allocs() : 0);
        } else if (strcmp(cmd, "storm") == 0) {
            int threads = 0;
            long iters = 0, mib = 0;
            if (sscanf(line, "%*s %d %ld %ld", &threads, &iters, &mib) != 3 || threads < 1 || threads > 64) {
                printf("error=usage: storm THREADS ITERS MIB\n");
            } else {
                memset(&storm, 0, sizeof storm);
                storm.iters = iters;
                storm.size = (size_t)mib << 20;
                R(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain")(&storm.ctx, dev);
                pthread_t t[64];
                for (int i = 0; i < threads; i++) pthread_create(&t[i], NULL, storm_thread, NULL);
                for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
                printf("done=%ld failed=%d refused=%d device=%d spilled=%d\n", iters * threads, storm.failed,
                       storm.refused, storm.device, storm.spilled);
            }
        } else if (strcmp(cmd, "quit") == 0) {
            break;
        } else {
            printf("error=unknown command\n");
        }
        fflush(stdout);
    }
    return 0;
}
