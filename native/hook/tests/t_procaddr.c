/* Which library answers each lookup, through cuGetProcAddress (name, version, flags) and dlsym.
 * Prints: how name version flags rc library symbol */
#include "common.h"

static void show(const char *how, const char *name, int version, int flags, int rc, void *p) {
    Dl_info info;
    const char *lib = "-", *sym = "-";
    if (p && dladdr(p, &info)) {
        lib = info.dli_fname ? strrchr(info.dli_fname, '/') ? strrchr(info.dli_fname, '/') + 1 : info.dli_fname : "-";
        sym = info.dli_sname ? info.dli_sname : "-";
    }
    printf("%s %s %d %d %d %s %s\n", how, name, version, flags, rc, p ? lib : "NULL", sym);
}

int main(void) {
    setup("procaddr");
    static const struct { const char *name; int version, flags; } q[] = {
        {"cuMemAlloc", 12080, 0}, {"cuMemAllocAsync", 12080, 0}, {"cuMemAllocAsync", 12080, 2},
        {"cuMemFreeAsync", 12080, 2}, {"cuMemGetInfo", 12080, 0}, {"cuGetProcAddress", 12080, 0},
        {"cuGetProcAddress", 11080, 0}, {"cuInit", 12080, 0}, {"cuCtxGetDevice", 12080, 0},
        {"cuMemAlloc", 3000, 0}, {"cuNoSuchFunction", 12080, 0},
    };
    for (size_t i = 0; i < sizeof q / sizeof q[0]; i++) {
        void *p = (void *)0x1;
        CUresult rc = gpa(q[i].name, &p, q[i].version, (cuuint64_t)q[i].flags, NULL);
        show("procaddr", q[i].name, q[i].version, q[i].flags, rc, p);
    }
    static const char *names[] = {"cuMemAlloc_v2", "cuMemCreate", "cuDeviceGet", "cuGetProcAddress_v2", "cuNoSuchFunction"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) show("dlsym", names[i], 0, 0, 0, dlsym(cuda_handle, names[i]));
    return 0;
}
