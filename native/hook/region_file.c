/* The region file (contract 5, docs/contracts.md): made by the first CUDA process of a container
 * (sized, its header written, the process-shared robust mutex set up, the magic last), mapped by
 * the others once it is whole, refused when it is not a region of this layout. region.c attaches
 * through vgpu_region_map(); the fuzz harness fuzz/native/fuzz_region.c includes this file. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "hook.h"

_Static_assert(sizeof(pthread_mutex_t) <= VGPU_LOCK_BYTES, "the region's lock field cannot hold a pthread mutex");

static void init_header(struct vgpu_region_header *h, const struct vgpu_config *cfg) {
    h->version = VGPU_REGION_VERSION;
    h->header_size = sizeof(struct vgpu_region_header);
    h->slot_size = sizeof(struct vgpu_region_slot);
    h->max_devices = VGPU_MAX_DEVICES;
    h->max_procs = VGPU_MAX_PROCS;
    h->num_devices = cfg->num_devices;
    memcpy(h->limit, cfg->limit, sizeof h->limit);
    memcpy(h->sm_limit, cfg->sm_limit, sizeof h->sm_limit);
    memcpy(h->uuid, cfg->uuid, sizeof h->uuid);
    memcpy(h->budget, cfg->budget, sizeof h->budget);
    h->priority = cfg->priority;
    h->sm_policy = cfg->sm_policy;
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init((pthread_mutex_t *)(void *)h->lock, &attr);
    pthread_mutexattr_destroy(&attr);
    __atomic_store_n(&h->magic, VGPU_REGION_MAGIC, __ATOMIC_RELEASE);
}

static const char *check_header(const struct vgpu_region_header *h, char *why, size_t len) {
    if (h->magic != VGPU_REGION_MAGIC)
        snprintf(why, len, "is not a vgpu region (magic 0x%016llx, expected 0x%016llx)",
                 (unsigned long long)h->magic, (unsigned long long)VGPU_REGION_MAGIC);
    else if (h->version != VGPU_REGION_VERSION)
        snprintf(why, len, "has region layout version %u, this hook speaks %u", h->version, VGPU_REGION_VERSION);
    else if (h->header_size != sizeof *h || h->slot_size != sizeof(struct vgpu_region_slot) ||
             h->max_devices != VGPU_MAX_DEVICES || h->max_procs != VGPU_MAX_PROCS)
        snprintf(why, len, "has a header that does not match layout version %u", VGPU_REGION_VERSION);
    else
        return NULL;
    return why;
}

/* A file no creator finished: empty, or sized with its magic (written last) still zero because its
 * creator died in between. Looked at under the file's lock, so never while a creator works. */
static int unfinished(int fd, const struct stat *st) {
    uint64_t magic = 1;
    if (st->st_size == 0) return 1;
    return st->st_size >= (off_t)VGPU_REGION_SIZE && pread(fd, &magic, sizeof magic, 0) == (ssize_t)sizeof magic &&
           magic == 0;
}

static void *map_file(const struct vgpu_config *cfg) {
    const char *path = cfg->region_path;
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0) {
        VGPU_LOG(VGPU_LOG_WARN, "cannot open region file %s (%s); this process enforces its limits alone",
                 path, strerror(errno));
        return NULL;
    }
    void *map = NULL;
    char why[256];
    const char *bad = NULL;
    struct stat st;
    /* Shared while the file is whole already (every process but the first: hundreds starting at
     * once map it side by side); exclusive to create it: one creator, and the others wait until its
     * header is whole. Taking LOCK_EX drops LOCK_SH first, so the file is looked at again. */
    flock(fd, LOCK_SH);
    int examined = fstat(fd, &st) == 0;
    if (examined && unfinished(fd, &st)) {
        flock(fd, LOCK_EX);
        examined = fstat(fd, &st) == 0;
    }
    if (!examined) {
        bad = "cannot be examined";
    } else if (unfinished(fd, &st)) {
        if ((st.st_size == 0 && fchmod(fd, 0666) != 0) || ftruncate(fd, VGPU_REGION_SIZE) != 0) {
            bad = "cannot be sized";
        } else {
            map = mmap(NULL, VGPU_REGION_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            if (map == MAP_FAILED) {
                map = NULL, bad = "cannot be mapped";
            } else {
                if (st.st_size != 0) { /* its creator died between sizing it and its magic: start again */
                    VGPU_LOG(VGPU_LOG_WARN, "region file %s was left unfinished by a process that died creating "
                             "it; made again", path);
                    memset(map, 0, VGPU_REGION_SIZE);
                }
                init_header(map, cfg);
            }
        }
    } else if (st.st_size < (off_t)VGPU_REGION_SIZE) {
        snprintf(why, sizeof why, "holds %lld bytes, fewer than a layout-%u region (%u)", (long long)st.st_size,
                 VGPU_REGION_VERSION, VGPU_REGION_SIZE);
        bad = why;
    } else {
        map = mmap(NULL, VGPU_REGION_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (map == MAP_FAILED) map = NULL, bad = "cannot be mapped";
        else if ((bad = check_header(map, why, sizeof why)) != NULL) munmap(map, VGPU_REGION_SIZE), map = NULL;
    }
    flock(fd, LOCK_UN);
    close(fd);
    if (bad)
        VGPU_LOG(VGPU_LOG_ERROR, "region file %s %s; this process enforces its own limits alone. "
                 "Remove the file and restart the container to share limits again", path, bad);
    return map;
}

void *vgpu_region_map(const struct vgpu_config *cfg) { return map_file(cfg); }

void vgpu_region_init(struct vgpu_region_header *h, const struct vgpu_config *cfg) { init_header(h, cfg); }
