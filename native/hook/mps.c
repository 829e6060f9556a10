/* MPS mode: a grant with sharing == VGPU_SHARING_MPS (the card runs an MPS control daemon, the
 * node agent's) makes every process of the container an MPS client of the grant's pipe folder, its
 * compute held by the MPS active thread percentage and its device memory by the MPS pinned limit,
 * both the driver's, from the grant whatever the environment says:
 *   - CUDA_MPS_PIPE_DIRECTORY: the grant's mps_pipe (the host's pipe folder, mounted read-only);
 *   - CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: the grant's sm_limit, or the lower percentage the process
 *     set itself (1..100; with no granted limit, the process's own or none);
 *   - CUDA_MPS_PINNED_DEVICE_MEM_LIMIT: "<ordinal>=<MiB>M" for each granted device with a memory
 *     limit (none with none).
 * They are set in this library's constructor and again in its cuInit, before the driver's (which
 * reads them at its first cuInit), so a process that unset or raised them since it started, or
 * named a device it cannot see, gets the grant's again. The driver runs a process it cannot
 * connect to an MPS daemon outside MPS, silently: on an MPS card that would escape both limits,
 * so cuInit fails instead (CUDA_ERROR_MPS_CONNECTION_FAILED) while the pipe's control socket
 * takes no connection, saying why. The compute limiter stays out of launches (the threads hold
 * compute); memory is accounted against the grant as always. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "hook.h"

#define EXPORT __attribute__((visibility("default")))

int vgpu_mps;

static pthread_mutex_t env_mu = PTHREAD_MUTEX_INITIALIZER;

static void set(const char *name, const char *value) {
    const char *have = getenv(name);
    if (!value) {
        if (have) unsetenv(name);
    } else if (!have || strcmp(have, value) != 0) {
        setenv(name, value, 1);
    }
}

/* The process's own active thread percentage when it is a valid one lower than the grant's. */
static int own_lower(const char *v, uint32_t granted) {
    if (!v || !*v) return 0;
    char *end = NULL;
    errno = 0;
    double pct = strtod(v, &end);
    if (errno || end == v || *end || !(pct > 0 && pct <= 100)) return 0;
    return granted == 0 || pct < (double)granted;
}

static void set_variables(const struct vgpu_grant *g) {
    set("CUDA_MPS_PIPE_DIRECTORY", g->mps_pipe);
    uint32_t threads = 0;
    char pinned[VGPU_MAX_DEVICES * 32] = "", text[32];
    size_t at = 0;
    for (uint32_t i = 0; i < g->num_devices && i < VGPU_MAX_DEVICES; i++) {
        uint32_t sm = g->sm_limit[i];
        if (sm > 0 && sm <= 100 && (threads == 0 || sm < threads)) threads = sm;
        if (!g->limit[i]) continue;
        uint64_t mib = g->limit[i] >> 20;
        int n = snprintf(pinned + at, sizeof pinned - at, "%s%u=%lluM", at ? "," : "", i,
                         (unsigned long long)(mib ? mib : 1));
        if (n > 0 && (size_t)n < sizeof pinned - at) at += (size_t)n;
    }
    const char *own = getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
    if (!own_lower(own, threads)) {
        if (threads) snprintf(text, sizeof text, "%u", threads);
        set("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", threads ? text : NULL);
    }
    set("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", at ? pinned : NULL);
}

/* 0 when the control socket in the pipe folder takes a connection, else errno. The socket's type
 * is the daemon's to choose (driver 580's is not a stream: a stream connect gets EPROTOTYPE), so
 * each type is tried in turn. */
static int control_answers(const char *pipe_dir) {
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (snprintf(addr.sun_path, sizeof addr.sun_path, "%s/control", pipe_dir) >= (int)sizeof addr.sun_path)
        return ENAMETOOLONG;
    static const int types[] = {SOCK_SEQPACKET, SOCK_STREAM, SOCK_DGRAM};
    int err = EPROTOTYPE;
    for (size_t i = 0; i < sizeof types / sizeof types[0] && err == EPROTOTYPE; i++) {
        int fd = socket(AF_UNIX, types[i] | SOCK_CLOEXEC, 0);
        if (fd < 0) return errno;
        err = connect(fd, (struct sockaddr *)&addr, sizeof addr) == 0 ? 0 : errno;
        close(fd);
    }
    return err;
}

/* The grant now, and the variables set from it when it is an MPS one: 1 MPS, 0 not (or none),
 * -1 unreadable (damaged, or held mid-change longer than a writer takes). */
static int apply(struct vgpu_grant *g) {
    int read = vgpu_grant_read(g);
    if (read <= 0) return read;
    if (g->sharing != VGPU_SHARING_MPS) return 0;
    __atomic_store_n(&vgpu_mps, 1, __ATOMIC_RELAXED);
    pthread_mutex_lock(&env_mu);
    set_variables(g);
    pthread_mutex_unlock(&env_mu);
    return 1;
}

CUresult vgpu_mps_prepare(void) {
    static struct vgpu_grant g; /* 2 KiB: not on the caller's stack */
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&mu);
    CUresult rc = CUDA_SUCCESS;
    int mps = apply(&g);
    if (mps < 0 && __atomic_load_n(&vgpu_mps, __ATOMIC_RELAXED)) {
        /* an MPS container whose grant cannot be read now: its variables may be the tenant's */
        VGPU_LOG(VGPU_LOG_ERROR, "this container's card is shared through MPS, and its grant (" VGPU_GRANT_PATH
                 ", or VGPU_GRANT_FILE run by hand) cannot be read whole now: cuInit fails rather than start the "
                 "driver with MPS variables the grant did not set; restart the pod if this persists");
        rc = CUDA_ERROR_MPS_CONNECTION_FAILED;
    } else if (mps > 0) {
        int err = g.mps_pipe[0] ? control_answers(g.mps_pipe) : ENOENT;
        if (err) {
            VGPU_LOG(VGPU_LOG_ERROR, "this container's card is shared through MPS, and its MPS control daemon does "
                     "not answer at %s/control (%s): cuInit fails rather than run outside MPS, past its "
                     "compute and memory limits. The node agent restarts a dead daemon within seconds: retry; if "
                     "it persists, see docs/mps.md", g.mps_pipe, strerror(err));
            rc = CUDA_ERROR_MPS_CONNECTION_FAILED;
        } else {
            VGPU_LOG(VGPU_LOG_DEBUG, "MPS client of %s: active threads %s%%, pinned %s", g.mps_pipe,
                     getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") ? getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") : "100",
                     getenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT") ? getenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT") : "none");
        }
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

/* At load, before anything of the process can call the driver: the variables only (the socket is
 * asked at cuInit: a process that never starts CUDA needs no daemon). */
static void at_load(void) __attribute__((constructor));
static void at_load(void) {
    static struct vgpu_grant g; /* no log here: VGPU_LOG_LEVEL is read at first use, as before */
    apply(&g);
}

EXPORT CUresult cuInit(unsigned int Flags) {
    if (vgpu_in_hook) return CU_REAL(cuInit, (Flags));
    CUresult rc = vgpu_mps_prepare();
    if (rc != CUDA_SUCCESS) return rc;
    return CU_REAL(cuInit, (Flags));
}
