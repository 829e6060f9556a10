/* Frees of memory libvgpu never saw go to the driver, which decides.
 * usage: t_free_unseen MODE */
#include "common.h"

int main(int argc, char **argv) {
    setup(argc > 1 ? argv[1] : "procaddr");
    open_device(0);
    CUresult (*untracked)(CUdeviceptr *, size_t) = (CUresult(*)(CUdeviceptr *, size_t))dlsym(cuda_handle, "stubAllocUntracked");
    if (!untracked) die("stubAllocUntracked", 0);
    CUdeviceptr p = 0;
    printf("untracked=%d\n", untracked(&p, 64u << 20));
    printf("driver_used_before=%llu\n", driver_used(0));
    printf("free_unseen=%d\n", R(cuMemFree_v2, "cuMemFree")(p));
    printf("driver_used_after=%llu\n", driver_used(0));
    printf("free_bogus=%d\n", R(cuMemFree_v2, "cuMemFree")(0x1234));
    return 0;
}
