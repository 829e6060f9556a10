/* Shared by the test programs: find driver entry points the way real programs do.
 *   link     call the symbols the program was linked against (a program built with -lcuda)
 *   dlsym    dlopen("libcuda.so.1") and dlsym each versioned name (PyTorch's ~240 symbols)
 *   procaddr dlsym cuGetProcAddress_v2, ask it for cuGetProcAddress, then ask that for each base
 *            name with a CUDA version (the CUDA runtime); procaddr_ptds adds flag 2. */
#ifndef VGPU_TEST_COMMON_H
#define VGPU_TEST_COMMON_H
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "api.h"

enum mode { M_LINK, M_DLSYM, M_PROCADDR, M_PROCADDR_PTDS };
static enum mode mode;
static void *cuda_handle;
static __typeof__(&cuGetProcAddress_v2) gpa;

static inline void die(const char *what, int rc) {
    printf("fatal=%s rc=%d\n", what, rc);
    fflush(stdout);
    exit(3);
}

static inline void *resolve(const char *versioned, void *linked, const char *base) {
    void *p = NULL;
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SUCCESS;
    switch (mode) {
    case M_LINK: return linked;
    case M_DLSYM:
        p = dlsym(cuda_handle, versioned);
        if (!p) die(versioned, -1);
        return p;
    default: {
        CUresult rc = gpa(base, &p, 12080, mode == M_PROCADDR_PTDS ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : 0, &st);
        if (rc != CUDA_SUCCESS || !p) die(base, rc);
        return p;
    }
    }
}
#define R(name, base) ((__typeof__(&name))resolve(#name, (void *)&name, base))

/* T_MPS_ENV: the process changes its MPS variables after it started (after the hook's constructor
 * set them), before its cuInit: "unset" drops all three, "raise" asks for all threads, 64 GiB
 * pinned on device 0 and another pipe folder. */
static inline void mps_env_change(void) {
    const char *how = getenv("T_MPS_ENV");
    if (!how || !*how) return;
    if (strcmp(how, "unset") == 0) {
        unsetenv("CUDA_MPS_PIPE_DIRECTORY");
        unsetenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
        unsetenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT");
    } else if (strcmp(how, "raise") == 0) {
        setenv("CUDA_MPS_PIPE_DIRECTORY", "/tmp/t-mps-elsewhere", 1);
        setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100", 1);
        setenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=64G", 1);
    } else {
        die("T_MPS_ENV is unset or raise", 0);
    }
}

static inline void setup(const char *mode_name) {
    mps_env_change();
    const char *pause = getenv("T_PAUSE_BEFORE_INIT"); /* after the hook's constructor, before cuInit */
    if (pause && *pause) {
        printf("before_init=1\n");
        fflush(stdout);
        char line[8];
        if (!fgets(line, sizeof line, stdin)) die("stdin closed before cuInit", 0);
    }
    if (strcmp(mode_name, "link") == 0) mode = M_LINK;
    else if (strcmp(mode_name, "dlsym") == 0) mode = M_DLSYM;
    else if (strcmp(mode_name, "procaddr") == 0) mode = M_PROCADDR;
    else if (strcmp(mode_name, "procaddr_ptds") == 0) mode = M_PROCADDR_PTDS;
    else die("unknown mode", 0);
    cuda_handle = dlopen("libcuda.so.1", RTLD_NOW);
    if (!cuda_handle) die("dlopen libcuda.so.1", 0);
    __typeof__(&cuGetProcAddress_v2) first = (__typeof__(first))dlsym(cuda_handle, "cuGetProcAddress_v2");
    if (!first) die("dlsym cuGetProcAddress_v2", 0);
    void *p = NULL;
    CUresult rc = first("cuGetProcAddress", &p, 12080, 0, NULL);
    if (rc != CUDA_SUCCESS || !p) die("cuGetProcAddress(cuGetProcAddress)", rc);
    gpa = (__typeof__(gpa))p;
}

static inline CUdevice open_device(int ordinal) {
    CUresult rc = R(cuInit, "cuInit")(0);
    if (rc) die("cuInit", rc);
    CUdevice dev;
    if ((rc = R(cuDeviceGet, "cuDeviceGet")(&dev, ordinal))) die("cuDeviceGet", rc);
    CUcontext ctx;
    const char *create = getenv("TEST_CTX_CREATE"); /* v2, v3, v4: cuCtxCreate instead of the primary context */
    if (create && strcmp(create, "v4") == 0) {
        if ((rc = R(cuCtxCreate_v4, "cuCtxCreate")(&ctx, NULL, 0, dev))) die("cuCtxCreate_v4", rc);
    } else if (create && strcmp(create, "v3") == 0) {
        __typeof__(&cuCtxCreate_v3) v3 = (__typeof__(v3))dlsym(cuda_handle, "cuCtxCreate_v3");
        if (!v3 || (rc = v3(&ctx, NULL, 0, 0, dev))) die("cuCtxCreate_v3", rc);
    } else if (create && strcmp(create, "v2") == 0) {
        __typeof__(&cuCtxCreate_v2) v2 = (__typeof__(v2))dlsym(cuda_handle, "cuCtxCreate_v2");
        if (!v2 || (rc = v2(&ctx, 0, dev))) die("cuCtxCreate_v2", rc);
    } else {
        if ((rc = R(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain")(&ctx, dev))) die("cuDevicePrimaryCtxRetain", rc);
    }
    if ((rc = R(cuCtxSetCurrent, "cuCtxSetCurrent")(ctx))) die("cuCtxSetCurrent", rc);
    return dev;
}

static inline unsigned long long driver_used(int dev) {
    unsigned long long (*used)(int) = (unsigned long long (*)(int))dlsym(cuda_handle, "stubDeviceUsed");
    return used ? used(dev) : 0;
}
#endif
