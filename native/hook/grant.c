/* The grant: the limits the device plugin granted this container, in a file the container can
 * only read (vgpu/hookabi/grant.py has the full story). Found at VGPU_GRANT_PATH (/etc/vgpu/limits,
 * mounted read-only by the device plugin) whatever the environment says; only where that path
 * does not exist (a process run by hand) may VGPU_GRANT_FILE name one. While a grant governs,
 * every limit comes from it and the environment's limits are ignored.
 *
 * The map is read-only and shared, so a live resize on the host (in place, seq odd while it
 * changes) is seen at once. Single words are read as they stand, as the region's were; the
 * checksum is verified once per new even seq, and a grant that fails it refuses every
 * allocation until the host rewrites it. */
#define _GNU_SOURCE
#include <errno.h>
#include <stddef.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "hook.h"

static struct {
    const struct vgpu_grant *g; /* the read-only map; NULL: no grant governs */
    char path[VGPU_PATH_BYTES];
    char region_path[VGPU_PATH_BYTES];
    uint64_t verified_seq;      /* the even seq whose checksum held */
    int bad;                    /* the grant failed its checks: refuse every allocation */
    uint64_t bad_seq;           /* the seq last reported bad, so each damage is logged once */
} G;

/* the read-only map for the launch path: set once, before the first launch can look (the grant is
 * loaded with the config, before the region attaches) */
const struct vgpu_grant *vgpu_grant_mapped;

uint64_t vgpu_fnv1a64(const void *data, size_t len) {
    const unsigned char *p = data;
    uint64_t h = 0xcbf29ce484222325ULL;
    for (size_t i = 0; i < len; i++) h = (h ^ p[i]) * 0x100000001b3ULL;
    return h;
}

/* The map as it stands is whole: magic, layout, device count and checksum. Returns NULL or why. */
static const char *check(const struct vgpu_grant *copy, char *why, size_t len) {
    if (copy->magic != VGPU_GRANT_MAGIC)
        snprintf(why, len, "is not a vgpu grant (magic 0x%016llx)", (unsigned long long)copy->magic);
    else if (copy->version != VGPU_GRANT_VERSION || copy->size != sizeof *copy)
        snprintf(why, len, "is grant layout %u of %u bytes, this hook reads %u of %zu", copy->version, copy->size,
                 VGPU_GRANT_VERSION, sizeof *copy);
    else if (copy->num_devices < 1 || copy->num_devices > VGPU_MAX_DEVICES)
        snprintf(why, len, "grants %u devices", copy->num_devices);
    else if (vgpu_fnv1a64((const char *)copy + VGPU_GRANT_PAYLOAD, sizeof *copy - VGPU_GRANT_PAYLOAD) != copy->checksum)
        snprintf(why, len, "is damaged (its checksum does not match its contents)");
    else
        return NULL;
    return why;
}

/* Copies the grant at an even seq that holds on both sides of the copy; -1 while a writer works. */
static int stable_copy(struct vgpu_grant *copy, uint64_t *seq) {
    for (int attempt = 0; attempt < 1000; attempt++) {
        uint64_t before = __atomic_load_n(&G.g->seq, __ATOMIC_ACQUIRE);
        if (before & 1) continue;
        memcpy(copy, (const void *)G.g, sizeof *copy);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&G.g->seq, __ATOMIC_RELAXED) == before) {
            *seq = before;
            return 0;
        }
    }
    return -1;
}

static void report_bad(uint64_t seq, const char *why) {
    __atomic_store_n(&G.bad, 1, __ATOMIC_RELEASE);
    if (__atomic_exchange_n(&G.bad_seq, seq + 1, __ATOMIC_RELAXED) != seq + 1)
        VGPU_LOG(VGPU_LOG_ERROR, "the granted limits %s %s; refusing every device memory allocation until the "
                 "device plugin rewrites it (restart the pod if it does not)", G.path, why);
}

int vgpu_grant_state(void) {
    if (!G.g) return 0;
    uint64_t seq = __atomic_load_n(&G.g->seq, __ATOMIC_ACQUIRE);
    if (seq != __atomic_load_n(&G.verified_seq, __ATOMIC_RELAXED) && !(seq & 1)) {
        struct vgpu_grant copy;
        char why[160];
        const char *bad;
        if (stable_copy(&copy, &seq) == 0) {
            if ((bad = check(&copy, why, sizeof why)) != NULL) {
                report_bad(seq, bad);
            } else {
                __atomic_store_n(&G.bad, 0, __ATOMIC_RELEASE);
                __atomic_store_n(&G.verified_seq, seq, __ATOMIC_RELEASE);
            }
        }
    }
    return __atomic_load_n(&G.bad, __ATOMIC_ACQUIRE) ? -1 : 1;
}

uint64_t vgpu_grant_seq(void) { return __atomic_load_n(&G.verified_seq, __ATOMIC_ACQUIRE); }

const struct vgpu_grant *vgpu_grant(void) { return G.g; }

const char *vgpu_grant_path(void) { return G.g ? G.path : NULL; }

static int open_grant(const char **used) {
    *used = VGPU_GRANT_PATH;
    int fd = open(VGPU_GRANT_PATH, O_RDONLY | O_CLOEXEC);
    if (fd >= 0 || errno != ENOENT) return fd;
    const char *env = getenv("VGPU_GRANT_FILE"); /* by hand only: the mounted path always wins */
    if (!env || !*env) return -2;
    *used = env;
    return open(env, O_RDONLY | O_CLOEXEC);
}

int vgpu_grant_read(struct vgpu_grant *copy) {
    const char *path;
    int fd = open_grant(&path);
    if (fd == -2) return 0;
    if (fd < 0) return -1;
    /* the host changes a grant in place (seq odd meanwhile, a few microseconds): read again while
     * a change is under way (seq odd, or moved during the read), for at most about 100 ms; a grant
     * that fails its checks at a steady even seq is damaged, at once */
    int whole = 0;
    for (int attempt = 0; attempt < 1000; attempt++) {
        if (attempt) usleep(100);
        uint64_t seq = 1;
        if (pread(fd, copy, sizeof *copy, 0) != (ssize_t)sizeof *copy) break;
        if (pread(fd, &seq, sizeof seq, offsetof(struct vgpu_grant, seq)) != (ssize_t)sizeof seq) break;
        if ((copy->seq & 1) || seq != copy->seq) continue;
        char why[160];
        whole = !check(copy, why, sizeof why);
        break;
    }
    close(fd);
    if (!whole) return -1;
    copy->mps_pipe[sizeof copy->mps_pipe - 1] = '\0';
    return 1;
}

static void refuse_all(struct vgpu_config *cfg) {
    cfg->enabled = 1;
    for (int i = 0; i < VGPU_MAX_DEVICES; i++) cfg->limit[i] = 1;
}

static void warn_if_env_asks_more(const struct vgpu_config *env, const struct vgpu_config *cfg) {
    for (uint32_t i = 0; i < cfg->num_devices; i++)
        if (cfg->limit[i] && env->limit[i] > cfg->limit[i]) {
            VGPU_LOG(VGPU_LOG_WARN, "the environment asks for a memory limit of %llu bytes on device %u; the grant "
                     "%s allows %llu: the grant holds", (unsigned long long)env->limit[i], i, G.path,
                     (unsigned long long)cfg->limit[i]);
            return;
        }
}

int vgpu_grant_load(struct vgpu_config *cfg) {
    const char *path;
    int fd = open_grant(&path);
    if (fd == -2) return 0;
    snprintf(G.path, sizeof G.path, "%s", path);
    struct stat st;
    const char *bad = NULL;
    char why[200];
    void *map = MAP_FAILED;
    if (fd < 0) {
        snprintf(why, sizeof why, "cannot be opened (%s)", strerror(errno));
        bad = why;
    } else if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size < (off_t)sizeof(struct vgpu_grant)) {
        snprintf(why, sizeof why, "is not a grant file of %zu bytes", sizeof(struct vgpu_grant));
        bad = why;
    } else if ((map = mmap(NULL, sizeof(struct vgpu_grant), PROT_READ, MAP_SHARED, fd, 0)) == MAP_FAILED) {
        snprintf(why, sizeof why, "cannot be mapped (%s)", strerror(errno));
        bad = why;
    }
    if (fd >= 0) close(fd);
    if (bad) {
        VGPU_LOG(VGPU_LOG_ERROR, "the granted limits %s %s; refusing every device memory allocation", G.path, bad);
        refuse_all(cfg);
        return -1;
    }
    G.g = map;
    __atomic_store_n(&vgpu_grant_mapped, G.g, __ATOMIC_RELEASE);
    struct vgpu_grant copy;
    uint64_t seq = 0;
    if (stable_copy(&copy, &seq) != 0 || (bad = check(&copy, why, sizeof why)) != NULL) {
        report_bad(seq, bad ? bad : "is held mid-change by its writer");
        refuse_all(cfg);
        return -1;
    }
    G.verified_seq = seq;
    struct vgpu_config env = *cfg;
    cfg->enabled = 1;
    cfg->num_devices = copy.num_devices;
    memcpy(cfg->limit, copy.limit, sizeof cfg->limit);
    memcpy(cfg->sm_limit, copy.sm_limit, sizeof cfg->sm_limit);
    memcpy(cfg->budget, copy.budget, sizeof cfg->budget);
    memcpy(cfg->uuid, copy.uuid, sizeof cfg->uuid);
    for (int i = 0; i < VGPU_MAX_DEVICES; i++) cfg->uuid[i][VGPU_UUID_BYTES - 1] = '\0';
    cfg->priority = copy.priority ? 1 : 0;
    cfg->sm_policy = copy.sm_policy ? 1 : 0;
    cfg->oversubscribe = copy.oversubscribe != 0;
    memcpy(G.region_path, copy.region_path, sizeof G.region_path);
    G.region_path[sizeof G.region_path - 1] = '\0';
    cfg->region_path = G.region_path[0] ? G.region_path : NULL;
    /* what a context costs is granted too: the environment may charge more, never less */
    uint64_t asked = 0;
    const char *reserve = getenv("VGPU_CONTEXT_RESERVE");
    cfg->context_reserve = copy.context_reserve;
    if (reserve && vgpu_parse_size(reserve, &asked) == 0 && asked > copy.context_reserve) cfg->context_reserve = asked;
    warn_if_env_asks_more(&env, cfg);
    VGPU_LOG(VGPU_LOG_INFO, "limits from the grant %s (%u devices; device 0 limit %llu bytes); the environment's "
             "limits are ignored", G.path, cfg->num_devices, (unsigned long long)cfg->limit[0]);
    return 1;
}
