/* Pass-through: the real driver's entry points, resolved once, and the two ways a process
 * finds entry points (dlsym on the driver's handle, and the cuGetProcAddress chain), both
 * answered with libvgpu's function wherever libvgpu polices that entry point. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "hook.h"

__thread int vgpu_in_hook __attribute__((tls_model("initial-exec")));

#define CU_HOOK(name, params, args, base, version, ptds) __typeof__(&name) real_##name;
#define CU_CALL(name, params, args, base, version, ptds) __typeof__(&name) real_##name;
#define NVML_HOOK(name, params, args) __typeof__(&name) real_##name;
#define NVML_CALL(name, params, args) __typeof__(&name) real_##name;
#include "api.def"

struct entry {
    const char *name;
    const char *base;
    int version;
    int ptds;
    int cuda;
    void *hook;  /* libvgpu's own function; NULL where libvgpu only forwards */
    void **real;
};

static const struct entry table[] = {
#define CU_HOOK(name, params, args, base, version, ptds) {#name, base, version, ptds, 1, (void *)&name, (void **)&real_##name},
#define CU_CALL(name, params, args, base, version, ptds) {#name, base, version, ptds, 1, NULL, (void **)&real_##name},
#define NVML_HOOK(name, params, args) {#name, #name, 0, 0, 0, (void *)&name, (void **)&real_##name},
#define NVML_CALL(name, params, args) {#name, #name, 0, 0, 0, NULL, (void **)&real_##name},
#include "api.def"
};
#define TABLE_LEN (sizeof(table) / sizeof(table[0]))

typedef void *(*dlsym_fn)(void *, const char *);
static dlsym_fn real_dlsym;
static pthread_once_t dlsym_once = PTHREAD_ONCE_INIT;

static void find_real_dlsym(void) {
    static const char *versions[] = {"GLIBC_2.34", "GLIBC_2.17", "GLIBC_2.2.5", NULL};
    for (int i = 0; versions[i] && !real_dlsym; i++)
        real_dlsym = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
}

static void *sym(void *handle, const char *name) {
    pthread_once(&dlsym_once, find_real_dlsym);
    return real_dlsym ? real_dlsym(handle, name) : NULL;
}

static void resolve(int cuda, const char *env, const char *soname) {
    vgpu_in_hook++;
    const char *path = getenv(env);
    const char *file = path && *path ? path : soname;
    void *handle = dlopen(file, RTLD_NOW | RTLD_NOLOAD); /* the copy the process already loaded */
    if (!handle) handle = dlopen(file, RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
        VGPU_LOG(VGPU_LOG_INFO, "cannot load %s (%s): its calls return errors", soname, dlerror());
    } else {
        for (size_t i = 0; i < TABLE_LEN; i++)
            if (table[i].cuda == cuda) *table[i].real = sym(handle, table[i].name);
    }
    vgpu_in_hook--;
}

static pthread_once_t cuda_once = PTHREAD_ONCE_INIT;
static pthread_once_t nvml_once = PTHREAD_ONCE_INIT;
static void resolve_cuda(void) { vgpu_log_init(); resolve(1, "VGPU_CUDA_LIBRARY", "libcuda.so.1"); }
static void resolve_nvml(void) { vgpu_log_init(); resolve(0, "VGPU_NVML_LIBRARY", "libnvidia-ml.so.1"); }
void vgpu_cuda_ready(void) { pthread_once(&cuda_once, resolve_cuda); }
void vgpu_nvml_ready(void) { pthread_once(&nvml_once, resolve_nvml); }

static const struct entry *by_name(const char *name) {
    if (!name || !((name[0] == 'c' && name[1] == 'u') || strncmp(name, "nvml", 4) == 0)) return NULL;
    for (size_t i = 0; i < TABLE_LEN; i++)
        if (table[i].hook && strcmp(table[i].name, name) == 0) return &table[i];
    return NULL;
}

/* dlsym: a policed name found in the asked library is answered with libvgpu's function. */
__attribute__((visibility("default"))) void *dlsym(void *handle, const char *name) {
    void *found = sym(handle, name);
    if (!found || vgpu_in_hook) return found;
    const struct entry *e = by_name(name);
    if (!e) return found;
    if (e->cuda) vgpu_cuda_ready(); else vgpu_nvml_ready();
    return e->hook;
}

/* What the driver handed out for (symbol, version, flags), swapped for libvgpu's function when
 * it is one libvgpu polices: first by identity with the exported real function, then by name,
 * version and flags for drivers that hand out internal addresses. */
static void *swap(const char *symbol, void *fn, int version, cuuint64_t flags) {
    for (size_t i = 0; i < TABLE_LEN; i++)
        if (table[i].hook && table[i].cuda && *table[i].real == fn) return table[i].hook;
    const struct entry *best = NULL;
    int want_ptds = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    for (size_t i = 0; i < TABLE_LEN; i++) {
        const struct entry *e = &table[i];
        if (!e->cuda || strcmp(e->base, symbol) != 0 || e->version > version) continue;
        if (e->ptds && !want_ptds) continue;
        if (!best || e->version > best->version || (e->ptds && !best->ptds)) best = e;
    }
    if (best && best->hook) {
        VGPU_LOG(VGPU_LOG_DEBUG, "cuGetProcAddress(%s, %d, %llu): driver address unknown, using %s by name",
                 symbol, version, flags, best->name);
        return best->hook;
    }
    return fn;
}

__attribute__((visibility("default"))) CUresult cuGetProcAddress_v2(
    const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags, CUdriverProcAddressQueryResult *symbolStatus) {
    CUresult rc = CU_REAL(cuGetProcAddress_v2, (symbol, pfn, cudaVersion, flags, symbolStatus));
    if (rc == CUDA_SUCCESS && pfn && *pfn && symbol && !vgpu_in_hook) *pfn = swap(symbol, *pfn, cudaVersion, flags);
    return rc;
}

__attribute__((visibility("default"))) CUresult cuGetProcAddress(
    const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
    CUresult rc = CU_REAL(cuGetProcAddress, (symbol, pfn, cudaVersion, flags));
    if (rc == CUDA_SUCCESS && pfn && *pfn && symbol && !vgpu_in_hook) *pfn = swap(symbol, *pfn, cudaVersion, flags);
    return rc;
}
