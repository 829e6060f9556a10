/* A process that bypasses the hook: it loads the driver into a new link-map namespace with
 * dlmopen(LM_ID_NEWLM) (where neither /etc/ld.so.preload nor LD_PRELOAD reaches) and finds
 * cuMemAlloc_v2 and the rest in libcuda's own ELF symbol table, never through dlsym (which the
 * hook interposes) nor the dynamic linker's symbol lookup. Whatever the hook's grant says, only
 * the driver decides, so only the node's enforcer (vgpu/monitor/enforce.py) can stop it.
 *
 *   t_bypass BELOW_MIB TARGET_MIB
 * allocates BELOW_MIB, says "below total_mib=..." and waits 1 s (the enforcer sees it within its
 * grant), allocates up to TARGET_MIB and says "crossed total_mib=... mono_ns=..." (CLOCK_MONOTONIC,
 * the same clock in every container of the host), then holds until killed.
 *
 *   t_bypass launch SECONDS
 * launches 1 ms kernels (the stub's STUB_CUDA_KERNEL_US) on the legacy stream, waiting for the
 * queue every 16 launches, for SECONDS of wall time, as a program that bypasses the compute limit
 * would: says "started mono_ns=...", then "second=N share=..." (the stub's busy time over each
 * wall second) and at the end "share=... wall_ns=...". Only the node's freezer can hold it.
 *
 * T_BYPASS_UNSET_MPS=1: unset CUDA_MPS_PIPE_DIRECTORY (which the hook's constructor set under an
 * MPS grant) before its cuInit, so the driver runs it outside MPS: on an MPS card it is a plain
 * compute process, past the MPS limits, which only the node's second line can see. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <link.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "api.h"

static void fail(const char *what) {
    printf("fatal=%s\n", what);
    fflush(stdout);
    exit(3);
}

/* The address of ``name`` in the loaded object ``lm``, from the file's .dynsym. */
static void *own_symbol(struct link_map *lm, const char *name) {
    int fd = open(lm->l_name, O_RDONLY);
    if (fd < 0) fail("open libcuda");
    struct stat st;
    if (fstat(fd, &st) != 0) fail("stat libcuda");
    const unsigned char *file = mmap(NULL, st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (file == MAP_FAILED) fail("mmap libcuda");
    const ElfW(Ehdr) *eh = (const ElfW(Ehdr) *)file;
    const ElfW(Shdr) *sh = (const ElfW(Shdr) *)(file + eh->e_shoff);
    void *found = NULL;
    for (int i = 0; i < eh->e_shnum && !found; i++) {
        if (sh[i].sh_type != SHT_DYNSYM) continue;
        const ElfW(Sym) *syms = (const ElfW(Sym) *)(file + sh[i].sh_offset);
        const char *names = (const char *)(file + sh[sh[i].sh_link].sh_offset);
        for (size_t j = 0; j < sh[i].sh_size / sizeof(ElfW(Sym)); j++)
            if (syms[j].st_value && strcmp(names + syms[j].st_name, name) == 0) {
                found = (void *)(lm->l_addr + syms[j].st_value);
                break;
            }
    }
    munmap((void *)file, st.st_size);
    if (!found) fail(name);
    return found;
}

static long long mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int launch_for(struct link_map *lm, double seconds) {
    __typeof__(&cuModuleLoadData) load = own_symbol(lm, "cuModuleLoadData");
    __typeof__(&cuModuleGetFunction) get_function = own_symbol(lm, "cuModuleGetFunction");
    __typeof__(&cuLaunchKernel) launch = own_symbol(lm, "cuLaunchKernel");
    __typeof__(&cuStreamSynchronize) sync = own_symbol(lm, "cuStreamSynchronize");
    unsigned long long (*busy)(void) = own_symbol(lm, "stubBusyNs");
    CUmodule mod;
    CUfunction fn;
    if (load(&mod, "stub") != CUDA_SUCCESS || get_function(&fn, mod, "k") != CUDA_SUCCESS) fail("function");
    long long t0 = mono_ns(), mark = t0, end = t0 + (long long)(seconds * 1e9);
    unsigned long long b0 = busy(), bmark = b0;
    printf("started mono_ns=%lld\n", t0);
    fflush(stdout);
    for (unsigned long n = 1; mono_ns() < end; n++) {
        if (launch(fn, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) != CUDA_SUCCESS) fail("launch");
        if (n % 16 == 0) sync(NULL);
        long long now = mono_ns();
        if (now - mark >= 1000000000LL) {
            unsigned long long b = busy();
            printf("second=%lld share=%.4f\n", (now - t0) / 1000000000LL, (double)(b - bmark) / (double)(now - mark));
            fflush(stdout);
            mark = now;
            bmark = b;
        }
    }
    sync(NULL);
    long long wall = mono_ns() - t0;
    printf("share=%.4f wall_ns=%lld\n", (double)(busy() - b0) / (double)wall, wall);
    fflush(stdout);
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 3) fail("usage: t_bypass BELOW_MIB TARGET_MIB | t_bypass launch SECONDS");
    const char *unset_mps = getenv("T_BYPASS_UNSET_MPS");
    if (unset_mps && strcmp(unset_mps, "1") == 0) unsetenv("CUDA_MPS_PIPE_DIRECTORY");
    unsigned long long below = strtoull(argv[1], NULL, 10) << 20, target = strtoull(argv[2], NULL, 10) << 20;
    void *handle = dlmopen(LM_ID_NEWLM, "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!handle) fail("dlmopen libcuda.so.1");
    struct link_map *lm = NULL;
    if (dlinfo(handle, RTLD_DI_LINKMAP, &lm) != 0 || !lm) fail("dlinfo");
    __typeof__(&cuInit) init = own_symbol(lm, "cuInit");
    __typeof__(&cuDeviceGet) device_get = own_symbol(lm, "cuDeviceGet");
    __typeof__(&cuCtxCreate_v2) ctx_create = own_symbol(lm, "cuCtxCreate_v2");
    __typeof__(&cuMemAlloc_v2) alloc = own_symbol(lm, "cuMemAlloc_v2");
    CUdevice dev;
    CUcontext ctx;
    if (init(0) != CUDA_SUCCESS || device_get(&dev, 0) != CUDA_SUCCESS || ctx_create(&ctx, 0, dev) != CUDA_SUCCESS)
        fail("context");
    if (strcmp(argv[1], "launch") == 0) return launch_for(lm, atof(argv[2]));
    CUdeviceptr p;
    CUresult rc = alloc(&p, below);
    printf("below total_mib=%llu rc=%d\n", below >> 20, (int)rc);
    fflush(stdout);
    if (rc != CUDA_SUCCESS) return 2;
    sleep(1);
    rc = alloc(&p, target - below);
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    printf("crossed total_mib=%llu rc=%d mono_ns=%lld\n", target >> 20, (int)rc,
           (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec);
    fflush(stdout);
    if (rc != CUDA_SUCCESS) return 2;
    for (;;) pause();
}
