/* The region's process slots: which belong to processes that are gone, and giving those back.
 * vgpu_slots_gone() looks without the region's lock: a process joining a region of hundreds looks
 * at every slot, and doing that under the lock (a /proc read per live slot) made every join wait
 * for all the others' (issue 23: 300 processes starting together took 1.2 s at p99 on the stub
 * driver, against 10 ms without the hook). region.c then takes the lock and has vgpu_slots_reap()
 * drop only the marked slots that are still gone. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "hook.h"

/* Reads /proc/PID/stat: the process state letter and its start time (clock ticks since boot). */
static int proc_stat(pid_t pid, char *state, uint64_t *start) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return -1;
    buf[n] = '\0';
    char *p = strrchr(buf, ')'); /* the command name may hold spaces */
    if (!p || p[1] != ' ') return -1;
    *state = p[2];
    /* after ") " come fields 3..; starttime is field 22 */
    for (int field = 2; field < 22 && p; field++) p = strchr(p + 1, ' ');
    *start = p ? strtoull(p + 1, NULL, 10) : 0;
    return 0;
}

uint64_t vgpu_proc_start(int pid) {
    char state;
    uint64_t start = 0;
    return proc_stat(pid, &state, &start) == 0 ? start : 0;
}

int vgpu_slot_alive(const struct vgpu_region_slot *s) {
    if (kill(s->pid, 0) == -1 && errno == ESRCH) return 0;
    char state;
    uint64_t start = 0;
    if (proc_stat(s->pid, &state, &start) != 0) return 1; /* cannot tell: keep it */
    if (state == 'Z' || state == 'X') return 0;           /* dead, not yet waited for */
    if (s->start_time && start && start != s->start_time) return 0; /* the pid was reused */
    return 1;
}

/* Marks in `gone` (one bit per slot) the active slots whose process looks gone, reading the slots
 * without the lock (a word being written is seen old or new, never torn: aligned loads).
 * shallow: kill(pid, 0) says there is no such process, one system call a slot; deep: also what
 * /proc says (a zombie, a pid now another process's), one more file read a live slot. `own` is
 * the caller's slot (-1: none), never marked; any other slot holding the caller's pid is: a dead
 * process's whose pid came back to the caller. Returns how many it marked. */
int vgpu_slots_gone(const struct vgpu_region_slot *slots, int deep, int own, uint64_t *gone) {
    int found = 0;
    pid_t self = getpid();
    memset(gone, 0, VGPU_SLOT_WORDS * sizeof *gone);
    for (int k = 0; k < VGPU_MAX_PROCS; k++) {
        const struct vgpu_region_slot *s = &slots[k];
        if (k == own || !__atomic_load_n(&s->active, __ATOMIC_RELAXED)) continue;
        struct vgpu_region_slot seen = {.pid = __atomic_load_n(&s->pid, __ATOMIC_RELAXED),
                                        .start_time = __atomic_load_n(&s->start_time, __ATOMIC_RELAXED)};
        if (seen.pid <= 0) continue; /* not a process id: left for the locked reap to judge */
        int dead = seen.pid == self || (deep ? !vgpu_slot_alive(&seen) : kill(seen.pid, 0) == -1 && errno == ESRCH);
        if (dead) {
            gone[k / 64] |= 1ULL << (k % 64);
            found++;
        }
    }
    return found;
}

void vgpu_slot_drop(struct vgpu_region_header *h, struct vgpu_region_slot *s) {
    for (int i = 0; i < VGPU_MAX_DEVICES; i++) {
        uint64_t u = s->used[i], sp = s->spilled[i];
        h->used[i] = h->used[i] > u ? h->used[i] - u : 0;
        h->spilled[i] = h->spilled[i] > sp ? h->spilled[i] - sp : 0; /* the driver unpins a dead process's memory */
    }
    memset(s, 0, sizeof *s);
}

int vgpu_slots_reap(struct vgpu_region_header *h, struct vgpu_region_slot *slots, int own, const uint64_t *gone) {
    int reaped = 0;
    pid_t self = getpid();
    for (int k = 0; k < VGPU_MAX_PROCS; k++) {
        struct vgpu_region_slot *s = &slots[k];
        if (k == own || !s->active || (gone && !(gone[k / 64] >> (k % 64) & 1))) continue;
        if (s->pid != self && vgpu_slot_alive(s)) continue;
        if (!reaped++) __atomic_fetch_add(&h->seq, 1, __ATOMIC_ACQ_REL); /* odd: usage changes */
        VGPU_LOG(VGPU_LOG_INFO, "reaping process %d, which died holding %llu bytes on device 0 "
                 "(%llu of them spilled to host memory)",
                 s->pid, (unsigned long long)s->used[0], (unsigned long long)s->spilled[0]);
        vgpu_slot_drop(h, s);
    }
    if (reaped) __atomic_fetch_add(&h->seq, 1, __ATOMIC_RELEASE);
    return reaped;
}
