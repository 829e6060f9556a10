/* Hold device memory until stdin closes; with "lock", also hold the region's lock (as a process
 * killed in the middle of an update would).
 * usage: t_hold MIB [lock] */
#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common.h"
#include "region_layout.h"

int main(int argc, char **argv) {
    if (argc < 2) die("usage: t_hold MIB [lock]", 0);
    setup("procaddr");
    open_device(0);
    CUdeviceptr p = 0;
    size_t mib = (size_t)strtoull(argv[1], NULL, 10);
    printf("held=%d\n", mib ? R(cuMemAlloc_v2, "cuMemAlloc")(&p, mib << 20) : 0);
    fflush(stdout);
    if (argc > 2 && strcmp(argv[2], "lock") == 0) {
        const char *path = getenv("CUDA_DEVICE_MEMORY_SHARED_CACHE");
        int fd = path ? open(path, O_RDWR) : -1;
        if (fd < 0) die("open region", 0);
        struct vgpu_region_header *h = mmap(NULL, VGPU_REGION_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (h == MAP_FAILED) die("mmap region", 0);
        int rc = pthread_mutex_lock((pthread_mutex_t *)(void *)h->lock);
        __atomic_fetch_add(&h->seq, 1, __ATOMIC_ACQ_REL); /* die mid-update: seq left odd */
        printf("locked=%d\n", rc);
        fflush(stdout);
    }
    char buf[16];
    while (read(0, buf, sizeof buf) > 0) {
    }
    if (p) R(cuMemFree_v2, "cuMemFree")(p);
    return 0;
}
