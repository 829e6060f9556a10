/* The stub driver's simulated GPU: kernel launches, streams, timing events and stream capture,
 * enough for libvgpu's compute limiter to be tested without a GPU.
 *
 * Every launch occupies its stream for the kernel time (STUB_CUDA_KERNEL_US, default 2 µs, or
 * stubSetKernelNs()): kernels of one stream run back to back from the launch time on
 * (start = max(now, the stream's previous end)); streams run side by side. An event records the
 * time at which its stream reaches it; cuEventQuery says CUDA_ERROR_NOT_READY until the wall clock
 * (CLOCK_MONOTONIC) passes it, and cuEventElapsedTime gives the difference in ms. Synchronize
 * calls sleep until the timeline is done.
 * STUB_CUDA_LAUNCH_US: host time each launch spends before it queues its kernel (a real driver's
 * launch call takes a few µs; default 0); STUB_CUDA_RECORD_US the same for an event's record. The legacy stream (NULL, CU_STREAM_LEGACY) is one per
 * process; the per-thread stream (CU_STREAM_PER_THREAD, or NULL through a _ptsz entry point) one
 * per thread. Stream capture is switched on by the tests (stubStreamSetCapturing, global mode):
 * launches into a capturing stream are recorded, not run, and a cuEventQuery from a thread not in
 * relaxed capture mode counts as a violation (the real driver fails the call and invalidates the
 * capture).
 *
 * With STUB_CUDA_PROCESS_DIR, the process's GPU time goes to <pid>@<start time>.sm there, as the
 * driver keeps it for nvmlDeviceGetProcessUtilization (the fake NVML backend turns it into
 * samples, vgpu/node/fake_nvml.py): one "<uuid or index> <launched ns> <end ns>..." line per
 * device, the kernel time ever queued and the CLOCK_MONOTONIC end of each stream still busy, so
 * that a reader at time t counts launched - sum(end - t, for each end past t). Rewritten (write,
 * rename) by a launch when 2 ms went by or 1 ms of kernel time was queued since the last write,
 * so what a process that stops launching leaves out is under 1 ms. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../api.h"

#define STUB_EXPORT __attribute__((visibility("default")))
#define HID __attribute__((visibility("hidden")))

/* included at the end of stub_cuda.c, which declares the impl_ functions and these two */
HID int stub_is_function(CUfunction f);
HID CUresult stub_current_ctx(CUcontext *ctx);

struct CUstream_st {
    uint64_t end;      /* ns at which the last queued kernel ends */
    int dev;           /* the device of its last launch */
    uint64_t launched; /* ns of kernels ever queued */
    int capturing;
    int destroyed;
    struct CUstream_st *next;
};

#define EVENT_MAGIC 0x45564e54u
struct CUevent_st {
    uint32_t magic;
    unsigned int flags;
    int recorded;
    uint64_t t;
};

static pthread_mutex_t tl = PTHREAD_MUTEX_INITIALIZER;
static struct CUstream_st legacy;
static struct CUstream_st *streams = &legacy; /* every stream ever made, for busy time and syncs */
static __thread struct CUstream_st *per_thread;
static __thread CUstreamCaptureMode capture_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;
static uint64_t kernel_ns = 2000, launch_ns = 0, record_ns = 0;
static int global_captures, fail_events;
static unsigned long long launches, captured_launches, events_on_capturing, capture_violations, events_live;
static pthread_once_t env_once = PTHREAD_ONCE_INIT;
static uint64_t dev_launched[MAX_DEV];            /* kernel ns ever queued per device (under tl) */
static uint64_t written_at, written_launched;     /* the .sm file's last write (under tl) */
static pthread_mutex_t sm_file = PTHREAD_MUTEX_INITIALIZER;

static void read_env(void) {
    const char *us = getenv("STUB_CUDA_KERNEL_US");
    if (us && *us) kernel_ns = (uint64_t)(strtod(us, NULL) * 1000.0);
    const char *call = getenv("STUB_CUDA_LAUNCH_US");
    if (call && *call) launch_ns = (uint64_t)(strtod(call, NULL) * 1000.0);
    const char *rec = getenv("STUB_CUDA_RECORD_US");
    if (rec && *rec) record_ns = (uint64_t)(strtod(rec, NULL) * 1000.0);
}


static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ULL + (uint64_t)t.tv_nsec;
}

static void host_part(uint64_t ns) {
    uint64_t until = now_ns() + ns;
    while (now_ns() < until) {}
}

static void sleep_until(uint64_t t) {
    struct timespec ts = {(time_t)(t / 1000000000ULL), (long)(t % 1000000000ULL)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {}
}

static struct CUstream_st *add_stream_locked(void) {
    struct CUstream_st *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->next = streams;
    streams = s;
    return s;
}

/* the stream a handle names; per_thread is made on first use */
static struct CUstream_st *resolve_locked(CUstream h, int ptds) {
    if (h == CU_STREAM_LEGACY || (h == NULL && !ptds)) return &legacy;
    if (h == CU_STREAM_PER_THREAD || h == NULL) {
        if (!per_thread) per_thread = add_stream_locked();
        return per_thread;
    }
    return h;
}

/* The .sm file from a snapshot taken under tl (ends[d][k]: busy streams' ends), written outside it. */
#define SM_ENDS 16
static void record_sm(const uint64_t *launched, uint64_t ends[][SM_ENDS], const int *nends) {
    const char *path = proc_path();
    if (!path || pthread_mutex_trylock(&sm_file) != 0) return; /* another thread writes it now */
    char file[600], tmp[620];
    snprintf(file, sizeof file, "%s.sm", path);
    snprintf(tmp, sizeof tmp, "%s.sm.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (f) {
        for (int d = 0; d < ndev; d++) {
            char key[96];
            device_key(d, key, sizeof key);
            fprintf(f, "%s %llu", key, (unsigned long long)launched[d]);
            for (int k = 0; k < nends[d]; k++) fprintf(f, " %llu", (unsigned long long)ends[d][k]);
            fputc('\n', f);
        }
        if (fclose(f) == 0) rename(tmp, file);
    }
    pthread_mutex_unlock(&sm_file);
}

static CUresult launch(CUstream h, int ptds, int ok) {
    pthread_once(&env_once, read_env);
    CUcontext ctx;
    CUresult rc = stub_current_ctx(&ctx);
    if (rc != CUDA_SUCCESS) return rc;
    if (!ok) return CUDA_ERROR_INVALID_VALUE;
    if (launch_ns) host_part(launch_ns); /* the host's part of a launch, as a driver's; the kernel is queued at its end */
    pthread_mutex_lock(&tl);
    struct CUstream_st *s = resolve_locked(h, ptds);
    if (!s) {
        pthread_mutex_unlock(&tl);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    int write = 0;
    uint64_t launched[MAX_DEV], ends[MAX_DEV][SM_ENDS];
    int nends[MAX_DEV] = {0};
    if (s->capturing) {
        captured_launches++;
    } else {
        uint64_t now = now_ns(), start = s->end > now ? s->end : now;
        s->end = start + kernel_ns;
        s->launched += kernel_ns;
        s->dev = ctx->dev;
        dev_launched[ctx->dev] += kernel_ns;
        launches++;
        uint64_t total = 0;
        for (int d = 0; d < ndev; d++) total += dev_launched[d];
        if (proc_path() && (now - written_at >= 2000000ULL || total - written_launched >= 1000000ULL)) {
            written_at = now;
            written_launched = total;
            write = 1;
            memcpy(launched, dev_launched, sizeof launched);
            for (struct CUstream_st *o = streams; o; o = o->next)
                if (o->end > now && nends[o->dev] < SM_ENDS) ends[o->dev][nends[o->dev]++] = o->end;
        }
    }
    pthread_mutex_unlock(&tl);
    if (write) record_sm(launched, ends, nends);
    return CUDA_SUCCESS;
}

static int dims_ok(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by,
                   unsigned int bz) {
    return stub_is_function(f) && gx && gy && gz && bx && by && bz;
}

CUresult impl_cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                             unsigned int by, unsigned int bz, unsigned int shared, CUstream s, void **params,
                             void **extra) {
    (void)shared, (void)params, (void)extra;
    return launch(s, 0, dims_ok(f, gx, gy, gz, bx, by, bz));
}
CUresult impl_cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                                  unsigned int by, unsigned int bz, unsigned int shared, CUstream s, void **params,
                                  void **extra) {
    (void)shared, (void)params, (void)extra;
    return launch(s, 1, dims_ok(f, gx, gy, gz, bx, by, bz));
}
CUresult impl_cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **params, void **extra) {
    (void)params, (void)extra;
    if (!c) return CUDA_ERROR_INVALID_VALUE;
    return launch(c->hStream, 0, dims_ok(f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX, c->blockDimY, c->blockDimZ));
}
CUresult impl_cuLaunchKernelEx_ptsz(const CUlaunchConfig *c, CUfunction f, void **params, void **extra) {
    (void)params, (void)extra;
    if (!c) return CUDA_ERROR_INVALID_VALUE;
    return launch(c->hStream, 1, dims_ok(f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX, c->blockDimY, c->blockDimZ));
}
CUresult impl_cuLaunchCooperativeKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                        unsigned int bx, unsigned int by, unsigned int bz, unsigned int shared,
                                        CUstream s, void **params) {
    (void)shared, (void)params;
    return launch(s, 0, dims_ok(f, gx, gy, gz, bx, by, bz));
}
CUresult impl_cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                             unsigned int bx, unsigned int by, unsigned int bz, unsigned int shared,
                                             CUstream s, void **params) {
    (void)shared, (void)params;
    return launch(s, 1, dims_ok(f, gx, gy, gz, bx, by, bz));
}
/* a graph is any non-NULL handle and runs as one kernel */
CUresult impl_cuGraphLaunch(CUgraphExec g, CUstream s) { return launch(s, 0, g != NULL); }
CUresult impl_cuGraphLaunch_ptsz(CUgraphExec g, CUstream s) { return launch(s, 1, g != NULL); }

/* streams */
CUresult impl_cuStreamCreate(CUstream *ph, unsigned int flags) {
    CUcontext ctx;
    CUresult rc = stub_current_ctx(&ctx);
    if (rc != CUDA_SUCCESS) return rc;
    if (!ph || flags > CU_STREAM_NON_BLOCKING) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&tl);
    *ph = add_stream_locked();
    pthread_mutex_unlock(&tl);
    return *ph ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult impl_cuStreamDestroy_v2(CUstream h) {
    if (!h || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD) return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&tl);
    h->destroyed = 1; /* kept: its queued work still counts */
    pthread_mutex_unlock(&tl);
    return CUDA_SUCCESS;
}

CUresult impl_cuStreamSynchronize(CUstream h) {
    CUcontext ctx;
    CUresult rc = stub_current_ctx(&ctx);
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&tl);
    struct CUstream_st *s = resolve_locked(h, 0);
    uint64_t end = s ? s->end : 0;
    pthread_mutex_unlock(&tl);
    sleep_until(end);
    return CUDA_SUCCESS;
}

CUresult impl_cuCtxSynchronize(void) {
    CUcontext ctx;
    CUresult rc = stub_current_ctx(&ctx);
    if (rc != CUDA_SUCCESS) return rc;
    uint64_t end = 0;
    pthread_mutex_lock(&tl);
    for (struct CUstream_st *s = streams; s; s = s->next)
        if (s->end > end) end = s->end;
    pthread_mutex_unlock(&tl);
    sleep_until(end);
    return CUDA_SUCCESS;
}

static CUresult is_capturing(CUstream h, int ptds, CUstreamCaptureStatus *status) {
    if (!status) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&tl);
    struct CUstream_st *s = resolve_locked(h, ptds);
    CUresult rc = CUDA_SUCCESS;
    /* as the driver: asking about the legacy stream while another stream captures is an error */
    if (s == &legacy && !legacy.capturing && global_captures > 0) rc = CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    else *status = s && s->capturing ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
    pthread_mutex_unlock(&tl);
    return rc;
}
CUresult impl_cuStreamIsCapturing(CUstream h, CUstreamCaptureStatus *st) { return is_capturing(h, 0, st); }
CUresult impl_cuStreamIsCapturing_ptsz(CUstream h, CUstreamCaptureStatus *st) { return is_capturing(h, 1, st); }

CUresult impl_cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode) {
    if (!mode || *mode > CU_STREAM_CAPTURE_MODE_RELAXED) return CUDA_ERROR_INVALID_VALUE;
    CUstreamCaptureMode old = capture_mode;
    capture_mode = *mode;
    *mode = old;
    return CUDA_SUCCESS;
}

/* events */
static int event_ok(CUevent e) { return e && e->magic == EVENT_MAGIC; }

CUresult impl_cuEventCreate(CUevent *ph, unsigned int flags) {
    CUcontext ctx;
    CUresult rc = stub_current_ctx(&ctx);
    if (rc != CUDA_SUCCESS) return rc;
    if (!ph || flags > 0xf) return CUDA_ERROR_INVALID_VALUE;
    CUevent e = calloc(1, sizeof *e);
    if (!e) return CUDA_ERROR_OUT_OF_MEMORY;
    e->magic = EVENT_MAGIC;
    e->flags = flags;
    __atomic_add_fetch(&events_live, 1, __ATOMIC_RELAXED);
    *ph = e;
    return CUDA_SUCCESS;
}

CUresult impl_cuEventDestroy_v2(CUevent e) {
    if (!event_ok(e)) return CUDA_ERROR_INVALID_HANDLE;
    e->magic = 0;
    free(e);
    __atomic_sub_fetch(&events_live, 1, __ATOMIC_RELAXED);
    return CUDA_SUCCESS;
}

static CUresult record(CUevent e, CUstream h, int ptds) {
    if (!event_ok(e)) return CUDA_ERROR_INVALID_HANDLE;
    pthread_once(&env_once, read_env);
    if (record_ns) host_part(record_ns);
    if (__atomic_load_n(&fail_events, __ATOMIC_RELAXED)) return CUDA_ERROR_CONTEXT_IS_DESTROYED;
    pthread_mutex_lock(&tl);
    struct CUstream_st *s = resolve_locked(h, ptds);
    if (s && s->capturing) {
        events_on_capturing++; /* becomes a node of the captured graph */
    } else if (s) {
        uint64_t now = now_ns();
        e->t = s->end > now ? s->end : now;
        e->recorded = 1;
    }
    pthread_mutex_unlock(&tl);
    return CUDA_SUCCESS;
}
CUresult impl_cuEventRecord(CUevent e, CUstream h) { return record(e, h, 0); }
CUresult impl_cuEventRecord_ptsz(CUevent e, CUstream h) { return record(e, h, 1); }

CUresult impl_cuEventQuery(CUevent e) {
    if (!event_ok(e)) return CUDA_ERROR_INVALID_HANDLE;
    if (__atomic_load_n(&fail_events, __ATOMIC_RELAXED)) return CUDA_ERROR_CONTEXT_IS_DESTROYED;
    if (capture_mode != CU_STREAM_CAPTURE_MODE_RELAXED && __atomic_load_n(&global_captures, __ATOMIC_RELAXED) > 0) {
        __atomic_add_fetch(&capture_violations, 1, __ATOMIC_RELAXED);
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
    if (!e->recorded) return CUDA_SUCCESS;
    return now_ns() >= e->t ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

CUresult impl_cuEventElapsedTime(float *ms, CUevent a, CUevent b) {
    if (!ms || !event_ok(a) || !event_ok(b)) return CUDA_ERROR_INVALID_HANDLE;
    if (__atomic_load_n(&fail_events, __ATOMIC_RELAXED)) return CUDA_ERROR_CONTEXT_IS_DESTROYED;
    if ((a->flags | b->flags) & CU_EVENT_DISABLE_TIMING) return CUDA_ERROR_INVALID_HANDLE;
    if (!a->recorded || !b->recorded) return CUDA_ERROR_INVALID_HANDLE;
    uint64_t now = now_ns();
    if (now < a->t || now < b->t) return CUDA_ERROR_NOT_READY;
    *ms = (float)((double)((int64_t)(b->t - a->t)) / 1e6);
    return CUDA_SUCCESS;
}
CUresult impl_cuEventElapsedTime_v2(float *ms, CUevent a, CUevent b) { return impl_cuEventElapsedTime(ms, a, b); }

/* For the tests. */
STUB_EXPORT void stubSetKernelNs(unsigned long long ns) {
    pthread_once(&env_once, read_env);
    __atomic_store_n(&kernel_ns, ns, __ATOMIC_RELAXED);
}
/* GPU time the simulated device has spent so far, over every stream */
STUB_EXPORT unsigned long long stubBusyNs(void) {
    unsigned long long busy = 0, now = now_ns();
    pthread_mutex_lock(&tl);
    for (struct CUstream_st *s = streams; s; s = s->next) busy += s->launched - (s->end > now ? s->end - now : 0);
    pthread_mutex_unlock(&tl);
    return busy;
}
STUB_EXPORT unsigned long long stubLaunches(void) { return __atomic_load_n(&launches, __ATOMIC_RELAXED); }
STUB_EXPORT int stubStreamSetCapturing(CUstream h, int on) {
    pthread_mutex_lock(&tl);
    struct CUstream_st *s = resolve_locked(h, 0);
    int rc = -1;
    if (s && !s->capturing != !on) {
        s->capturing = on;
        global_captures += on ? 1 : -1;
        rc = 0;
    }
    pthread_mutex_unlock(&tl);
    return rc;
}
STUB_EXPORT unsigned long long stubCapturedLaunches(void) { return captured_launches; }
STUB_EXPORT unsigned long long stubEventsOnCapturing(void) { return events_on_capturing; }
STUB_EXPORT unsigned long long stubCaptureViolations(void) { return capture_violations; }
STUB_EXPORT unsigned long long stubEventsLive(void) { return __atomic_load_n(&events_live, __ATOMIC_RELAXED); }
/* every event call fails as after the context was destroyed */
STUB_EXPORT void stubFailEvents(int on) { __atomic_store_n(&fail_events, on, __ATOMIC_RELAXED); }
