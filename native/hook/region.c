/* The shared region of contract 5 (docs/contracts.md): one file per container, a process-shared robust mutex,
 * per-device limits and usage, one slot per process, dead processes reaped. The layout comes
 * from region_layout.h, generated from vgpu/hookabi/layout.py. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "hook.h"

static struct {
    int enabled;
    int exiting;
    int slot; /* this process's slot, -1 until its first charge */
    struct vgpu_region_header *h;
    struct vgpu_region_slot *slots;
    uint64_t context_reserve;
    int oversubscribe;
    const char *path; /* the region file, for messages */
    int file;         /* the region is that file (not a private map) */
    uint64_t mirrored_seq; /* the grant's seq the region's copy last followed */
} R = {.slot = -1};

static pthread_once_t attach_once = PTHREAD_ONCE_INIT;

static pthread_mutex_t *mtx(void) { return (pthread_mutex_t *)(void *)R.h->lock; }

static void seq_begin(void) { __atomic_fetch_add(&R.h->seq, 1, __ATOMIC_ACQ_REL); }
static void seq_end(void) { __atomic_fetch_add(&R.h->seq, 1, __ATOMIC_RELEASE); }

/* Frees the slots of processes that died without cleaning up (SIGKILL, OOM killer): every slot
 * looked at, one /proc read a live one (gone: NULL), or only those vgpu_slots_gone() marked. */
static int reap_locked(const uint64_t *gone) { return vgpu_slots_reap(R.h, R.slots, R.slot, gone); }

/* After a holder died mid-update: reap, then recompute the totals from the slots. */
static void repair_locked(void) {
    VGPU_LOG(VGPU_LOG_INFO, "a process died holding the region lock; recovering");
    if (R.h->seq & 1) R.h->seq++; /* it died mid-update: readers must not wait for it */
    reap_locked(NULL);
    uint64_t sum[VGPU_MAX_DEVICES] = {0}, spill[VGPU_MAX_DEVICES] = {0};
    for (int k = 0; k < VGPU_MAX_PROCS; k++)
        if (R.slots[k].active)
            for (int i = 0; i < VGPU_MAX_DEVICES; i++) {
                sum[i] += R.slots[k].used[i];
                spill[i] += R.slots[k].spilled[i];
            }
    seq_begin();
    memcpy(R.h->used, sum, sizeof sum);
    memcpy(R.h->spilled, spill, sizeof spill);
    seq_end();
}

static int lock(void) {
    int rc = pthread_mutex_lock(mtx());
    if (rc == EOWNERDEAD) {
        repair_locked();
        pthread_mutex_consistent(mtx());
        return 0;
    }
    if (rc != 0) {
        static int told;
        if (!told++) VGPU_LOG(VGPU_LOG_ERROR, "region lock unusable (%s); counting without it", strerror(rc));
        return -1;
    }
    return 0;
}

static void unlock(int locked) {
    if (locked == 0) pthread_mutex_unlock(mtx());
}

/* Dead processes' slots given back: found without the lock (deep: /proc too, else kill(pid, 0)
 * alone), dropped under it. A process joining sweeps shallow: what died cleanly or was killed
 * and waited for goes, its usage (spilled host memory too) with it, and the lock is held only for
 * the drops. A charge over the limit sweeps deep, as zombies and reused pids may hold the room. */
static int sweep(int deep) {
    uint64_t gone[VGPU_SLOT_WORDS];
    if (vgpu_slots_gone(R.slots, deep, R.slot, gone) == 0) return 0;
    int locked = lock();
    int dropped = reap_locked(gone);
    unlock(locked);
    return dropped;
}

/* The deep sweep, one at a time per region: a process refused while another sweeps waits for that
 * sweep's end and looks at the limit again rather than reading every live slot's /proc itself (a
 * grant that fits 150 of 300 processes starting together refuses 150 at once). The turn is an
 * open-file-description lock on the byte past the region's end: no flock of region_file.c's, released
 * when the file is closed, also by a process that dies. The wait is bounded (100 ms, a sweep of
 * 1024 slots takes a few): a holder that cannot let go (stopped, or a fork's child that inherited
 * the open file mid-sweep) costs the others that much, never a wedge. */
static void sweep_deep(void) {
    int fd = R.file ? open(R.path, O_RDWR | O_CLOEXEC) : -1;
    struct flock turn = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = VGPU_REGION_SIZE, .l_len = 1};
    if (fd >= 0 && fcntl(fd, F_OFD_SETLK, &turn) != 0 && (errno == EAGAIN || errno == EACCES)) {
        for (int waited = 0; waited < 100; waited++) { /* another sweeps: wait for its end */
            struct timespec ms = {0, 1000000};
            nanosleep(&ms, NULL);
            if (fcntl(fd, F_OFD_SETLK, &turn) == 0) { /* it ended: its drops are in, look again */
                close(fd);
                return;
            }
        }
    }
    sweep(1); /* our turn, no file to take turns on, or the other's sweep did not end in time */
    if (fd >= 0) close(fd);
}

/* This process's slot, claimed at its first charge (the caller swept first): the first free one;
 * -1 when every slot is taken. */
static int my_slot_locked(uint64_t start) {
    if (R.slot >= 0 || R.exiting) return R.slot;
    for (int k = 0; k < VGPU_MAX_PROCS; k++) {
        struct vgpu_region_slot *s = &R.slots[k];
        if (s->active) continue;
        memset(s, 0, sizeof *s);
        s->pid = getpid();
        s->start_time = start;
        __atomic_store_n(&s->active, 1, __ATOMIC_RELEASE);
        return R.slot = k;
    }
    return -1;
}

static void mirror_grant(int report);

/* vgpu_grant_state(), and the region's copy brought to a live resize of the grant the first time
 * one is seen (nothing to report: the host changed the grant). grant.c calls nothing here: the
 * dependency goes one way, region.c -> grant.c. */
static int grant_state(void) {
    int state = vgpu_grant_state();
    if (state > 0) {
        uint64_t seq = vgpu_grant_seq();
        if (__atomic_load_n(&R.mirrored_seq, __ATOMIC_RELAXED) != seq &&
            __atomic_exchange_n(&R.mirrored_seq, seq, __ATOMIC_RELAXED) != seq)
            mirror_grant(0);
    }
    return state;
}

/* The limit words as they hold now: the grant's where one governs (a damaged grant refuses every
 * allocation: a limit of 1 byte), else the region's own (a process run by hand). */
static uint64_t limit_word(int idx) {
    int granted = grant_state();
    if (granted < 0) return 1;
    if (granted > 0) return __atomic_load_n(&vgpu_grant()->limit[idx], __ATOMIC_RELAXED);
    return __atomic_load_n(&R.h->limit[idx], __ATOMIC_RELAXED);
}

static uint64_t budget_word(int idx) {
    if (grant_state() > 0) return __atomic_load_n(&vgpu_grant()->budget[idx], __ATOMIC_RELAXED);
    return __atomic_load_n(&R.h->budget[idx], __ATOMIC_RELAXED);
}

/* The region's limit words are a mirror of the grant, kept for the tools that read the region.
 * The container can write them; a difference is put back, and logged where it was not ours. */
static void mirror_grant(int report) {
    const struct vgpu_grant *g = vgpu_grant();
    struct vgpu_region_header *h = R.h;
    if (!g || !h || __atomic_load_n(&g->seq, __ATOMIC_ACQUIRE) & 1) return;
    static int reports;
    uint32_t n = g->num_devices <= VGPU_MAX_DEVICES ? g->num_devices : VGPU_MAX_DEVICES;
#define MIRROR(what, field, i)                                                                                  \
    do {                                                                                                        \
        __typeof__(h->field) want = __atomic_load_n(&g->field, __ATOMIC_RELAXED);                               \
        __typeof__(h->field) have = __atomic_load_n(&h->field, __ATOMIC_RELAXED);                               \
        if (have == want) break;                                                                                \
        if (report && __atomic_fetch_add(&reports, 1, __ATOMIC_RELAXED) < 20)                                   \
            VGPU_LOG(VGPU_LOG_ERROR, "region file %s: its limits were changed on disk (device %d %s %llu there, " \
                     "%llu granted in %s); the region's copy is ignored and put back, the granted limits hold", \
                     R.path, (i), (what), (unsigned long long)have, (unsigned long long)want, vgpu_grant_path()); \
        __atomic_store_n(&h->field, want, __ATOMIC_RELAXED);                                                    \
    } while (0)
    for (uint32_t i = 0; i < n; i++) {
        MIRROR("memory limit", limit[i], (int)i);
        MIRROR("SM limit", sm_limit[i], (int)i);
        MIRROR("budget", budget[i], (int)i);
    }
    MIRROR("priority", priority, -1);
    MIRROR("SM policy", sm_policy, -1);
#undef MIRROR
    if (h->num_devices != n || memcmp(h->uuid, g->uuid, sizeof h->uuid) != 0) {
        if (report && __atomic_fetch_add(&reports, 1, __ATOMIC_RELAXED) < 20)
            VGPU_LOG(VGPU_LOG_ERROR, "region file %s: its device list was changed on disk; put back from %s", R.path,
                     vgpu_grant_path());
        h->num_devices = n;
        memcpy(h->uuid, g->uuid, sizeof h->uuid);
    }
}

uint32_t vgpu_sm_limit(int idx) {
    if (grant_state() > 0) return __atomic_load_n(&vgpu_grant()->sm_limit[idx], __ATOMIC_RELAXED);
    return __atomic_load_n(&R.h->sm_limit[idx], __ATOMIC_RELAXED);
}

uint32_t vgpu_priority(void) {
    if (grant_state() > 0) return __atomic_load_n(&vgpu_grant()->priority, __ATOMIC_RELAXED);
    return __atomic_load_n(&R.h->priority, __ATOMIC_RELAXED);
}

uint32_t vgpu_sm_policy(void) {
    if (grant_state() > 0) return __atomic_load_n(&vgpu_grant()->sm_policy, __ATOMIC_RELAXED);
    return __atomic_load_n(&R.h->sm_policy, __ATOMIC_RELAXED);
}

static void at_exit(void) __attribute__((destructor));
static void at_exit(void) {
    if (!R.enabled || R.exiting) return;
    int locked = lock();
    if (R.slot >= 0) {
        seq_begin();
        vgpu_slot_drop(R.h, &R.slots[R.slot]);
        seq_end();
    }
    R.slot = -1;
    R.exiting = 1;
    unlock(locked);
}

static void child_after_fork(void) {
    R.slot = -1;
    vgpu_track_reset();
}

static void attach(void) {
    vgpu_log_init();
    struct vgpu_config cfg;
    vgpu_config_load(&cfg);
    vgpu_grant_load(&cfg); /* a grant, where one is mounted, overrides the environment's limits */
    if (!cfg.enabled) return;
    R.context_reserve = cfg.context_reserve;
    R.oversubscribe = cfg.oversubscribe;
    void *map = cfg.region_path ? vgpu_region_map(&cfg) : NULL;
    R.file = map != NULL;
    if (!map) { /* no region file: this process alone (and its forks) share the limits */
        map = mmap(NULL, VGPU_REGION_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        if (map == MAP_FAILED) {
            VGPU_LOG(VGPU_LOG_ERROR, "cannot map a private region (%s); limits are NOT enforced", strerror(errno));
            return;
        }
        vgpu_region_init(map, &cfg);
    }
    R.h = map;
    R.path = cfg.region_path && map != NULL ? cfg.region_path : "(private)";
    for (int i = 0; i < VGPU_MAX_DEVICES; i++) /* a UUID string found in the file ends inside its field */
        R.h->uuid[i][VGPU_UUID_BYTES - 1] = '\0';
    R.mirrored_seq = vgpu_grant_seq();
    mirror_grant(1); /* a region found with other limits than the grant's was changed on disk */
    R.slots = (struct vgpu_region_slot *)((char *)map + sizeof(struct vgpu_region_header));
    pthread_atfork(NULL, NULL, child_after_fork);
    R.enabled = 1;
    VGPU_LOG(VGPU_LOG_INFO, "region %s attached; device 0 limit %llu bytes", cfg.region_path ? cfg.region_path : "(private)",
             (unsigned long long)R.h->limit[0]);
}

int vgpu_enabled(void) {
    pthread_once(&attach_once, attach);
    return R.enabled && !R.exiting;
}

static int charge(int idx, uint64_t bytes, int force, int *over_budget) {
    if (over_budget) *over_budget = 0;
    if (idx < 0 || idx >= VGPU_MAX_DEVICES || !vgpu_enabled()) return 0;
    uint64_t start = 0;
    if (R.slot < 0 && !R.exiting) { /* joining: what dead processes left goes first, off the lock */
        sweep(0);
        start = vgpu_proc_start(getpid());
    }
    for (int swept = 0;; swept = 1) {
        int locked = lock();
        int k = my_slot_locked(start);
        if (k < 0 && !R.exiting) { /* every slot taken: nothing may be held uncounted */
            unlock(locked);
            if (!swept) { /* dead processes may hold slots: look deep, off the lock, then again */
                sweep_deep();
                continue;
            }
            static int told;
            if (!__atomic_exchange_n(&told, 1, __ATOMIC_RELAXED))
                VGPU_LOG(VGPU_LOG_ERROR, "all %d process slots of the region %s are held by live processes; this "
                         "process's contexts and device memory are refused (CUDA_ERROR_OUT_OF_MEMORY) so that "
                         "nothing it holds goes uncounted. A container runs at most %d CUDA processes at once",
                         VGPU_MAX_PROCS, R.path, VGPU_MAX_PROCS);
            return -2;
        }
        /* limit and budget are live-resizable: read on every call, never cached */
        uint64_t limit = limit_word(idx);
        mirror_grant(1);
        if (!force && limit && (bytes > limit || R.h->used[idx] > limit - bytes)) {
            uint64_t used = R.h->used[idx];
            unlock(locked);
            if (!swept) { /* dead processes may hold the room: look deep, off the lock, then again */
                sweep_deep();
                continue;
            }
            static int told_below;
            if (used > limit && !__atomic_exchange_n(&told_below, 1, __ATOMIC_RELAXED))
                VGPU_LOG(VGPU_LOG_WARN, "device %d: the limit (%llu bytes) is below the %llu bytes in use, so it was "
                         "lowered while this container ran; new allocations are refused until enough is freed, "
                         "and memory already held stays valid", idx, (unsigned long long)limit,
                         (unsigned long long)used);
            VGPU_LOG(VGPU_LOG_DEBUG, "refused %llu bytes on device %d: %llu of %llu in use", (unsigned long long)bytes,
                     idx, (unsigned long long)used, (unsigned long long)limit);
            return -1;
        }
        if (over_budget) {
            uint64_t budget = budget_word(idx);
            uint64_t resident = R.h->used[idx] > R.h->spilled[idx] ? R.h->used[idx] - R.h->spilled[idx] : 0;
            *over_budget = budget && (bytes > budget || resident > budget - bytes);
        }
        seq_begin();
        R.h->used[idx] += bytes;
        if (k >= 0) R.slots[k].used[idx] += bytes;
        seq_end();
        unlock(locked);
        return 0;
    }
}

int vgpu_charge(int idx, uint64_t bytes, int force) { return charge(idx, bytes, force, NULL); }

int vgpu_charge_budget(int idx, uint64_t bytes, int *over_budget) { return charge(idx, bytes, 0, over_budget); }

void vgpu_spill_move(int idx, uint64_t bytes) {
    if (idx < 0 || idx >= VGPU_MAX_DEVICES || !vgpu_enabled()) return;
    int locked = lock();
    seq_begin();
    R.h->spilled[idx] += bytes;
    if (R.slot >= 0) R.slots[R.slot].spilled[idx] += bytes;
    seq_end();
    unlock(locked);
}

void vgpu_uncharge_spilled(int idx, uint64_t bytes) {
    if (idx < 0 || idx >= VGPU_MAX_DEVICES || !vgpu_enabled()) return;
    int locked = lock();
    seq_begin();
    R.h->used[idx] = R.h->used[idx] > bytes ? R.h->used[idx] - bytes : 0;
    R.h->spilled[idx] = R.h->spilled[idx] > bytes ? R.h->spilled[idx] - bytes : 0;
    if (R.slot >= 0) {
        uint64_t *u = &R.slots[R.slot].used[idx], *sp = &R.slots[R.slot].spilled[idx];
        *u = *u > bytes ? *u - bytes : 0;
        *sp = *sp > bytes ? *sp - bytes : 0;
    }
    seq_end();
    unlock(locked);
}

uint64_t vgpu_budget(int idx) {
    if (idx < 0 || idx >= VGPU_MAX_DEVICES || !vgpu_enabled()) return 0;
    return budget_word(idx);
}

void vgpu_uncharge(int idx, uint64_t bytes) {
    if (idx < 0 || idx >= VGPU_MAX_DEVICES || !vgpu_enabled()) return;
    int locked = lock();
    seq_begin();
    R.h->used[idx] = R.h->used[idx] > bytes ? R.h->used[idx] - bytes : 0;
    if (R.slot >= 0) {
        uint64_t *u = &R.slots[R.slot].used[idx];
        *u = *u > bytes ? *u - bytes : 0;
    }
    seq_end();
    unlock(locked);
}

uint64_t vgpu_limit(int idx) {
    if (idx < 0 || idx >= VGPU_MAX_DEVICES || !vgpu_enabled()) return 0;
    return limit_word(idx);
}

uint64_t vgpu_used(int idx) {
    if (idx < 0 || idx >= VGPU_MAX_DEVICES || !vgpu_enabled()) return 0;
    return __atomic_load_n(&R.h->used[idx], __ATOMIC_RELAXED);
}

const char *vgpu_uuid(int idx) {
    if (idx < 0 || idx >= VGPU_MAX_DEVICES || !vgpu_enabled()) return "";
    return vgpu_grant() ? vgpu_grant()->uuid[idx] : R.h->uuid[idx]; /* the region's copy is the container's */
}

uint64_t vgpu_context_reserve(void) { return vgpu_enabled() ? R.context_reserve : 0; }

int vgpu_processes(int idx, unsigned int *pids, uint64_t *used, int max) {
    if (idx < 0 || idx >= VGPU_MAX_DEVICES || !vgpu_enabled()) return 0;
    int n = 0;
    int locked = lock();
    reap_locked(NULL);
    for (int k = 0; k < VGPU_MAX_PROCS; k++) {
        const struct vgpu_region_slot *s = &R.slots[k];
        if (!s->active || s->used[idx] == 0) continue;
        if (n < max) {
            pids[n] = (unsigned int)s->pid;
            used[n] = s->used[idx];
        }
        n++;
    }
    unlock(locked);
    return n;
}

struct vgpu_region_header *vgpu_header(void) { return vgpu_enabled() ? R.h : NULL; }

int vgpu_oversubscribe(void) { return vgpu_enabled() && R.oversubscribe; }
