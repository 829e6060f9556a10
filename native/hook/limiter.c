/* Compute (SM) limits and priority: a duty-cycle limiter over every kernel launch path.
 *
 * The limit is a cap on the container's share of the card's time, measured from its own work and
 * held for the sum of its processes, which share the region:
 *   - a token bucket per device in the region (tokens[i], ns of GPU time) is refilled at
 *     sm_limit[i]% of wall time since refill_ns[i], up to a burst, with atomics only: every
 *     process refills and debits it without the region lock;
 *   - GPU time is measured with timing events on the launch streams: a start event before a launch
 *     that finds its stream idle, an end event after each launch (re-recorded for the launches of
 *     the next 0.5 ms, so a busy stream holds a few events, not one per launch); completed
 *     intervals are harvested on later launches (cuEventQuery, never blocking) and
 *     cuEventElapsedTime between them is debited from the bucket and added to busy_ns[i];
 *   - each launch is charged a prediction at once (this process's recent GPU time per launch on
 *     the device), settled against the measurement when its interval completes, so the queue of
 *     launched-but-unfinished work cannot run far past the limit;
 *   - before each launch: while the bucket is empty (or a priority-0 container holds the card),
 *     wait; waits are added to throttled_ns[i];
 *   - while priority-0 and normal containers share a card (FLAG_GUARD on both), each keeps its
 *     queue short: a normal one at most GUARD_QUEUE_NS of work per stream, so that its yield takes
 *     hold within milliseconds; a priority-0 one at most HIGH_QUEUE_NS, so that it keeps launching
 *     while busy (the monitor sees it active by its launches) rather than sit for seconds in a
 *     sync on a queue the driver holds, looking idle while its work still runs.
 *   - short kernels (this process's launches on the device average under FAST_MAX_NS, and no
 *     yield or guard flag) are sampled instead: a thread measures one launch in 32 at random,
 *     alone between a start and an end event of its own, and that measure stands for the
 *     thread's unmeasured launches since its previous sample too (its weight), so every launch is
 *     settled against a measurement and the long-run share holds as before. The unmeasured
 *     launches make no driver call but the capture check: each is charged the prediction against
 *     an allowance the process takes from the region's bucket in chunks (CHUNK_LAUNCHES
 *     launches' worth, through the same gate), with no lock, clock read or shared write beyond a
 *     coarse last_launch_ns stamp. At most FAST_AHEAD launches' prediction may be charged past
 *     the last completed measurement (a deep queue, kernels turning long): beyond, every launch
 *     is measured again.
 * Under MPS (mps.c) the driver holds compute: every launch takes the no-limit path below.
 * With no limit and no yield or guard flag a launch costs a few relaxed loads and, at most once a
 * millisecond, a store of last_launch_ns[i]. Launches into a capturing stream are forwarded
 * untouched; the limiter's own driver calls run in relaxed capture mode. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "hook.h"

#define EXPORT __attribute__((visibility("default")))

#define BURST_NS 20000000LL        /* bucket size at 100 %: 20 ms, scaled by the limit */
#define REFILL_MIN_NS 20000ULL     /* refills closer together than this are skipped (CAS traffic) */
#define SEAL_NS 500000ULL          /* an end event takes the launches of 0.5 ms, then a new one */
#define SEAL_LAUNCHES 32
#define QUEUE_MAX 64               /* events per stream */
#define INFLIGHT_MAX 256           /* launches per stream not measured yet: wait beyond */
#define GUARD_QUEUE_NS 8000000LL   /* queued work per stream under FLAG_GUARD: a yield holds in ms */
#define HIGH_QUEUE_NS 40000000LL   /* the same for priority 0: within the monitor's activity window */
#define WAIT_MIN_NS 200000ULL
#define WAIT_MAX_NS 5000000ULL
#define YIELD_WAIT_NS 1000000ULL
#define DEPTH_WAIT_NS 100000ULL
#define DEPTH_WAIT_MAX_NS 1000000000ULL
#define STAMP_NS 1000000ULL        /* last_launch_ns is refreshed when older than this */
#define POOL_MAX 128               /* idle events kept per context */
#define STREAMS_MAX 1024
#define POOLS_MAX 32
#define FAST_MAX_NS 10000LL        /* launches averaging less GPU time than this are metered by sampling */
#define SAMPLE_SPAN 64             /* a measured launch every 1..63 launches per thread, 32 on average */
#define CHUNK_LAUNCHES 32          /* the sampled path takes this many launches' time from the bucket at once */
#define FAST_AHEAD 256             /* launches the sampled path may charge beyond the last measurement */
#define SAMPLE_HOST_MAX_NS 50000ULL /* a sample whose launch took the host longer stands for itself only */

/* The one clock: CLOCK_MONOTONIC ns, the monitor's clock too. */
static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ULL + (uint64_t)t.tv_nsec;
}

/* The same clock at tick resolution (1-4 ms) for about a fifth of the cost: for last_launch_ns on
 * the no-limit path, where the monitor needs to know only that the container launched lately. */
static uint64_t coarse_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &t);
    return (uint64_t)t.tv_sec * 1000000000ULL + (uint64_t)t.tv_nsec;
}

static void sleep_ns(uint64_t ns) {
    struct timespec t = {(time_t)(ns / 1000000000ULL), (long)(ns % 1000000000ULL)};
    while (nanosleep(&t, &t) == -1 && errno == EINTR) {}
}

struct ev {
    CUevent e;
    uint8_t end;       /* 0 start (the stream was idle before it), 1 end of the launches before it */
    uint8_t done;      /* seen complete */
    uint8_t sealed;    /* the end of one sampled launch, or launches went past it unmeasured: never moved */
    uint32_t launches; /* launches between the previous event and this one */
    uint32_t weight;   /* launches its measure stands for: the sampled path's since the thread's last sample, and it */
    int64_t predicted; /* ns charged for them in advance */
    uint64_t first_ns; /* when it was first recorded */
    CUevent from;      /* a sample's: the end of this thread's previous sample on the stream (out of the pool) */
    uint64_t by;       /* a sample's end: the thread that recorded it */
};

struct stream {
    int used;
    int idx;
    CUcontext ctx;
    CUstream h;      /* NULL = legacy stream, CU_STREAM_PER_THREAD = the thread's own */
    uint64_t thread; /* owner of a per-thread stream, else 0 */
    uint32_t inflight;
    int n;
    struct ev q[QUEUE_MAX];
};

struct pool {
    CUcontext ctx;
    int n;
    CUevent free[POOL_MAX];
};

static struct {
    pthread_mutex_t mu;
    struct stream *streams[STREAMS_MAX];
    int nstreams;
    struct pool pools[POOLS_MAX];
    int npools;
    int64_t avg[VGPU_MAX_DEVICES]; /* ns of GPU time per launch, recent; 0 = not measured yet */
} L = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* The sampled path's allowance per device, in this process only: GPU time taken from the region's
 * bucket (drawn) against the predictions charged to its launches (charged); mark: charged when
 * the last measurement came in. Its own cache line: these launches touch nothing shared. */
static struct allowance {
    int64_t charged, drawn, mark;
} __attribute__((aligned(64))) A[VGPU_MAX_DEVICES];
static pthread_mutex_t draw_mu = PTHREAD_MUTEX_INITIALIZER;
static int unmeasured[VGPU_MAX_DEVICES]; /* sampled-path launches went by since the last full-path launch */

/* A thread's sampled-path launches since its last measured one: charged their prediction now,
 * settled by the next launch it measures (their count is that launch's weight). */
static __thread struct pending {
    uint32_t left, rng; /* launches until the next sample; xorshift state */
    int dev;            /* their device */
    uint32_t count;
    int64_t charged;
    CUstream stream;   /* their stream, while they all went to one (mixed = 0) */
    int mixed;
} P __attribute__((tls_model("initial-exec"))); /* as vgpu_in_hook: no __tls_get_addr per launch */

static uint64_t next_thread = 1;
static __thread uint64_t my_thread;

static uint64_t thread_id(void) {
    if (!my_thread) my_thread = __atomic_fetch_add(&next_thread, 1, __ATOMIC_RELAXED);
    return my_thread;
}

/* once-only log lines */
enum { TOLD_LIMIT, TOLD_YIELD, TOLD_EVENTS, TOLD_BROKEN, TOLD_STREAMS, TOLD_NO_EVENTS, TOLD_TAMPER, TOLD_HELD, TOLD_MAX };
static int told[TOLD_MAX];
static int first_time(int what) { return !__atomic_exchange_n(&told[what], 1, __ATOMIC_RELAXED); }

/* after fork the child's CUDA state is not the parent's: forget the events, keep nothing */
static void child_after_fork(void) {
    pthread_mutex_init(&L.mu, NULL);
    pthread_mutex_init(&draw_mu, NULL);
    for (int i = 0; i < VGPU_MAX_DEVICES; i++) A[i].drawn = A[i].mark = A[i].charged; /* the parent's, not ours */
    P.count = 0; /* the parent settles those */
    P.charged = 0;
    for (int i = 0; i < L.nstreams; i++) free(L.streams[i]);
    L.nstreams = 0;
    L.npools = 0;
}
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;
static void register_fork(void) { pthread_atfork(NULL, NULL, child_after_fork); }

/* ---- the region's bucket: atomics only ---- */

static int64_t burst_of(uint32_t limit) { return BURST_NS * (int64_t)limit / 100; }

static void refill(struct vgpu_region_header *h, int i, uint64_t now, uint32_t limit) {
    uint64_t last = __atomic_load_n(&h->refill_ns[i], __ATOMIC_ACQUIRE);
    int64_t burst = burst_of(limit);
    if (last == 0) {
        if (__atomic_compare_exchange_n(&h->refill_ns[i], &last, now, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            __atomic_store_n(&h->tokens[i], burst, __ATOMIC_RELEASE);
        return;
    }
    if (last > now + 1000000000ULL) {
        /* a refill stamp in the future never comes due: only a write into the region makes one
         * (the container can write its region, never its grant); start the bucket over */
        if (first_time(TOLD_TAMPER))
            VGPU_LOG(VGPU_LOG_ERROR, "device %d: the region's compute bucket was changed on disk; it is reset "
                     "and the granted SM limit holds", i);
        if (__atomic_compare_exchange_n(&h->refill_ns[i], &last, now, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            __atomic_store_n(&h->tokens[i], 0, __ATOMIC_RELEASE);
        return;
    }
    /* more than a full bucket is never spent: trimmed on every pass, not only at a refill, so a
     * bucket written full on disk (or left over a shrunk limit) buys one burst at most */
    int64_t held = __atomic_load_n(&h->tokens[i], __ATOMIC_RELAXED);
    while (held > burst &&
           !__atomic_compare_exchange_n(&h->tokens[i], &held, burst, 1, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {}
    if (now <= last || now - last < REFILL_MIN_NS) return;
    if (!__atomic_compare_exchange_n(&h->refill_ns[i], &last, now, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) return;
    uint64_t gap = now - last;
    if (gap > 1000000000000ULL) gap = 1000000000000ULL; /* an hour idle: the bucket is full anyway */
    int64_t add = (int64_t)(gap * limit / 100);
    int64_t old = __atomic_load_n(&h->tokens[i], __ATOMIC_RELAXED), want;
    do {
        want = old + add > burst ? burst : old + add; /* also trims a bucket the limit shrank */
    } while (!__atomic_compare_exchange_n(&h->tokens[i], &old, want, 1, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED));
}

static void floor_tokens(struct vgpu_region_header *h, int i) {
    int64_t old = __atomic_load_n(&h->tokens[i], __ATOMIC_RELAXED);
    while (old < 0 && !__atomic_compare_exchange_n(&h->tokens[i], &old, 0, 1, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {}
}

static int arbiter_fresh(struct vgpu_region_header *h, uint64_t now) {
    uint64_t a = __atomic_load_n(&h->arbiter_ns, __ATOMIC_ACQUIRE);
    if (!a) return 0;
    return a > now ? a - now < VGPU_ARBITER_STALE_NS : now - a < VGPU_ARBITER_STALE_NS;
}

static void stamp(struct vgpu_region_header *h, int i, uint64_t now) {
    uint64_t last = __atomic_load_n(&h->last_launch_ns[i], __ATOMIC_RELAXED);
    if (now > last + STAMP_NS) __atomic_store_n(&h->last_launch_ns[i], now, __ATOMIC_RELAXED);
}

/* ---- the limiter's own driver calls, in relaxed capture mode ---- */

static int relaxed_enter(CUstreamCaptureMode *saved) {
    *saved = CU_STREAM_CAPTURE_MODE_RELAXED;
    return real_cuThreadExchangeStreamCaptureMode && real_cuThreadExchangeStreamCaptureMode(saved) == CUDA_SUCCESS;
}

static void relaxed_leave(int entered, CUstreamCaptureMode saved) {
    if (entered) real_cuThreadExchangeStreamCaptureMode(&saved);
}

/* ns from event a to event b (0 where the driver says b came first) */
static CUresult elapsed_ns(int64_t *ns, CUevent a, CUevent b) {
    float ms = 0;
    CUresult rc = real_cuEventElapsedTime_v2 ? real_cuEventElapsedTime_v2(&ms, a, b)
                  : real_cuEventElapsedTime  ? real_cuEventElapsedTime(&ms, a, b)
                                             : CUDA_ERROR_NOT_FOUND;
    *ns = rc == CUDA_SUCCESS && ms > 0 ? (int64_t)((double)ms * 1e6) : 0;
    return rc;
}

static int have_event_api(void) {
    return real_cuEventCreate && real_cuEventRecord && real_cuEventQuery && real_cuEventDestroy_v2 &&
           (real_cuEventElapsedTime_v2 || real_cuEventElapsedTime) && real_cuCtxGetCurrent;
}

/* ---- per-context event pools (under L.mu) ---- */

static struct pool *pool_of(CUcontext ctx) {
    for (int i = 0; i < L.npools; i++)
        if (L.pools[i].ctx == ctx) return &L.pools[i];
    if (L.npools == POOLS_MAX) return NULL;
    struct pool *p = &L.pools[L.npools++];
    p->ctx = ctx;
    p->n = 0;
    return p;
}

static CUevent event_get(CUcontext ctx) {
    struct pool *p = pool_of(ctx);
    if (p && p->n > 0) return p->free[--p->n];
    CUevent e = NULL;
    CUresult rc = real_cuEventCreate(&e, CU_EVENT_DEFAULT); /* timing on: no DISABLE_TIMING */
    if (rc != CUDA_SUCCESS) {
        if (first_time(TOLD_EVENTS))
            VGPU_LOG(VGPU_LOG_WARN, "cannot create a timing event (CUDA error %d): the compute limit does not see "
                     "this work; check that the driver supports cuEventCreate in this context", rc);
        return NULL;
    }
    return e;
}

static void event_put(CUcontext ctx, CUevent e) {
    struct pool *p = pool_of(ctx);
    if (p && p->n < POOL_MAX) p->free[p->n++] = e;
    else real_cuEventDestroy_v2(e);
}

/* a context that is gone: its pooled events are dropped, never reused or destroyed */
static void forget_context(CUcontext ctx) {
    for (int i = 0; i < L.npools; i++)
        if (L.pools[i].ctx == ctx) {
            L.pools[i] = L.pools[--L.npools];
            break;
        }
}

/* ---- streams (under L.mu) ---- */

static struct stream *stream_find(CUcontext ctx, CUstream h, uint64_t thread) {
    for (int i = 0; i < L.nstreams; i++) {
        struct stream *s = L.streams[i];
        if (s->used && s->ctx == ctx && s->h == h && s->thread == thread) return s;
    }
    return NULL;
}

/* broken: an event call failed, so the stream's events are dropped, not pooled (destroying a
 * handle of a destroyed context is not safe); ctx_gone: the context's pool goes too */
static void stream_drop(struct stream *s, struct vgpu_region_header *hd, int broken, int ctx_gone) {
    for (int k = 0; k < s->n; k++) {
        if (s->q[k].predicted) __atomic_add_fetch(&hd->tokens[s->idx], s->q[k].predicted, __ATOMIC_RELAXED);
        if (!broken) event_put(s->ctx, s->q[k].e);
        if (!broken && s->q[k].from) event_put(s->ctx, s->q[k].from);
    }
    if (ctx_gone) forget_context(s->ctx);
    s->n = 0;
    s->used = 0;
}

static struct stream *stream_get(CUcontext ctx, CUstream h, uint64_t thread, int idx, struct vgpu_region_header *hd) {
    struct stream *s = stream_find(ctx, h, thread);
    if (s) return s;
    for (int i = 0; i < L.nstreams; i++)
        if (!L.streams[i]->used) s = L.streams[i];
    if (!s && L.nstreams < STREAMS_MAX) {
        s = calloc(1, sizeof *s);
        if (s) L.streams[L.nstreams++] = s;
    }
    if (!s) { /* full: take over one whose work is done */
        for (int i = 0; i < L.nstreams && !s; i++) {
            struct stream *o = L.streams[i];
            if (o->n == 0 || (o->n == 1 && real_cuEventQuery(o->q[0].e) != CUDA_ERROR_NOT_READY)) {
                stream_drop(o, hd, 0, 0);
                s = o;
            }
        }
    }
    if (!s) {
        if (first_time(TOLD_STREAMS))
            VGPU_LOG(VGPU_LOG_WARN, "more than %d streams are busy at once: launches on further streams are not "
                     "measured for the compute limit", STREAMS_MAX);
        return NULL;
    }
    memset(s, 0, sizeof *s);
    s->used = 1;
    s->ctx = ctx;
    s->h = h;
    s->thread = thread;
    s->idx = idx;
    return s;
}

static void broken(struct stream *s, struct vgpu_region_header *hd, CUresult rc) {
    if (first_time(TOLD_BROKEN))
        VGPU_LOG(VGPU_LOG_INFO, "a timing event failed (CUDA error %d), most likely because its context was "
                 "destroyed: that stream's unfinished work is not counted", rc);
    stream_drop(s, hd, 1,
                rc == CUDA_ERROR_CONTEXT_IS_DESTROYED || rc == CUDA_ERROR_INVALID_CONTEXT || rc == CUDA_ERROR_DEINITIALIZED);
}

static int capped(int idx) {
    uint32_t limit = vgpu_sm_limit(idx);
    return limit > 0 && limit < 100;
}

#define VGPU_SHARE_SCALE_ONE 65536u /* vgpu.hookabi.layout.SHARE_SCALE_ONE */

/* One measure of a share: the node, which reads the driver's samples of this container's GPU
 * time, writes their ratio to this measure into the grant, and the hook charges its measure (and
 * predicts its launches) times that; 1.0 until the node says (vgpu/monitor/sharescale.py). */
static inline int64_t scaled(int idx, int64_t ns) {
    const struct vgpu_grant *g = __atomic_load_n(&vgpu_grant_mapped, __ATOMIC_RELAXED);
    uint32_t scale = g ? __atomic_load_n(&g->share_scale[idx], __ATOMIC_RELAXED) : 0;
    if (!scale || scale == VGPU_SHARE_SCALE_ONE || ns <= 0) return ns;
    int64_t out = (int64_t)(((unsigned __int128)(uint64_t)ns * scale) >> 16);
    return out > 0 ? out : 1;
}

static void settle(struct vgpu_region_header *hd, int idx, int64_t busy, int64_t span, const struct ev *b) {
    /* a sampled launch's measure stands for the unmeasured launches before it too (weight) */
    int64_t per = b->launches ? busy / (int64_t)b->launches : 0;
    int64_t total = b->weight > b->launches && b->launches ? per * (int64_t)b->weight : busy;
    /* A sample's own measure may be mostly the host's: where its start event runs before the
     * kernel is submitted (an idle stream, or one that drains while the host launches), the
     * interval holds the launch call, so an empty kernel measured about 4.8 us on an H100 against
     * 2.6 us of wall time per launch back to back, and standing for 32 launches it charged more
     * than the stream could have been busy. The launches it stands for all ran on this stream
     * after this thread's previous sample ended there: together they kept it busy no longer than
     * the GPU time from that end to this one (span). */
    if (span > 0 && b->weight > b->launches && total > span) {
        total = span;
        per = total / (int64_t)b->weight;
    }
    total = scaled(idx, total);
    /* the bucket only runs under a cap: work done without one leaves no debt behind */
    __atomic_add_fetch(&hd->tokens[idx], capped(idx) ? b->predicted - total : b->predicted, __ATOMIC_RELAXED);
    __atomic_add_fetch(&hd->busy_ns[idx], (uint64_t)total, __ATOMIC_RELAXED);
    __atomic_store_n(&A[idx].mark, __atomic_load_n(&A[idx].charged, __ATOMIC_RELAXED), __ATOMIC_RELAXED);
    if (b->launches) {
        if (per < 1) per = 1;
        __atomic_store_n(&L.avg[idx], L.avg[idx] ? (7 * L.avg[idx] + per) / 8 : per, __ATOMIC_RELAXED);
    }
}

/* counts every completed interval of a stream; 0 = it is broken and was dropped */
static int harvest(struct stream *s, struct vgpu_region_header *hd) {
    while (s->n >= 2) {
        struct ev *a = &s->q[0], *b = &s->q[1];
        CUresult rc = real_cuEventQuery(b->e);
        if (rc == CUDA_ERROR_NOT_READY) break;
        if (rc != CUDA_SUCCESS) return broken(s, hd, rc), 0;
        b->done = 1;
        if (b->end) {
            int64_t busy = 0, span = 0;
            rc = elapsed_ns(&busy, a->e, b->e);
            if (rc == CUDA_ERROR_NOT_READY) break;
            if (rc != CUDA_SUCCESS) return broken(s, hd, rc), 0;
            if (b->from) {
                elapsed_ns(&span, b->from, b->e); /* 0 where it fails: no bound */
                event_put(s->ctx, b->from);
                b->from = NULL;
            }
            settle(hd, s->idx, busy, span, b);
            s->inflight = s->inflight > b->launches ? s->inflight - b->launches : 0;
        }
        event_put(s->ctx, a->e);
        memmove(&s->q[0], &s->q[1], (size_t)(s->n - 1) * sizeof s->q[0]);
        s->n--;
    }
    return 1;
}

/* idle = nothing recorded, or the newest event done; an idle stream's events go back to the pool */
static int idle(struct stream *s, struct vgpu_region_header *hd) {
    if (s->n >= 2) return 0;
    if (s->n == 1) {
        struct ev *t = &s->q[0];
        if (!t->done) {
            CUresult rc = real_cuEventQuery(t->e);
            if (rc == CUDA_ERROR_NOT_READY) return 0;
            if (rc != CUDA_SUCCESS) return broken(s, hd, rc), 1;
        }
        event_put(s->ctx, t->e);
        s->n = 0;
        s->inflight = 0;
    }
    return 1;
}

static void harvest_all(struct vgpu_region_header *hd) {
    pthread_mutex_lock(&L.mu);
    for (int i = 0; i < L.nstreams; i++)
        if (L.streams[i]->used) harvest(L.streams[i], hd);
    pthread_mutex_unlock(&L.mu);
}

/* ---- the gate ---- */

static void gate(struct vgpu_region_header *hd, int idx, uint64_t now) {
    uint64_t t0 = now;
    int waited = 0;
    for (;;) {
        uint32_t limit = vgpu_sm_limit(idx);
        uint32_t flags = __atomic_load_n(&hd->flags[idx], __ATOMIC_RELAXED);
        int fresh = flags ? arbiter_fresh(hd, now) : 0;
        uint64_t wait;
        if (fresh && (flags & VGPU_FLAG_YIELD) && vgpu_priority() != 0) {
            if (first_time(TOLD_YIELD))
                VGPU_LOG(VGPU_LOG_INFO, "device %d: a priority-0 container is busy on this card; launches wait "
                         "until it is done (CUDA_TASK_PRIORITY=0 never waits)", idx);
            harvest_all(hd);
            wait = YIELD_WAIT_NS;
        } else if (limit == 0 || limit >= 100) {
            floor_tokens(hd, idx);
            break;
        } else if (fresh && (flags & VGPU_FLAG_ALONE) && vgpu_sm_policy() == 1) {
            floor_tokens(hd, idx); /* work-conserving while alone; the cap resumes from an empty bucket */
            break;
        } else {
            refill(hd, idx, now, limit);
            if (__atomic_load_n(&hd->tokens[idx], __ATOMIC_ACQUIRE) > 0) break;
            harvest_all(hd);
            int64_t tok = __atomic_load_n(&hd->tokens[idx], __ATOMIC_ACQUIRE);
            if (tok > 0) break;
            if (first_time(TOLD_LIMIT))
                VGPU_LOG(VGPU_LOG_INFO, "device %d: compute limit %u%% reached; launches wait for their share "
                         "(CUDA_DEVICE_SM_LIMIT)", idx, limit);
            wait = (uint64_t)(-tok) * 100 / limit;
            if (wait < WAIT_MIN_NS) wait = WAIT_MIN_NS;
            if (wait > WAIT_MAX_NS) wait = WAIT_MAX_NS;
        }
        sleep_ns(wait);
        waited = 1;
        now = now_ns();
    }
    if (waited && now > t0) __atomic_add_fetch(&hd->throttled_ns[idx], now - t0, __ATOMIC_RELAXED);
}

/* ---- one launch ---- */

struct launch {
    struct vgpu_region_header *hd;
    int idx;
    int relaxed;
    CUstreamCaptureMode saved;
    CUcontext ctx;
    CUstream h;
    uint64_t thread;
    int64_t predicted;
    int bracket; /* a sampled launch: measured alone, between a start and an end event of its own */
    int started; /* its start event was recorded */
    CUevent from; /* a sampled launch's: the end of this thread's previous sample on the stream */
    uint64_t start_ns;
};

static int device_index(void) {
    static int single = -1; /* the index of the process's only device; -2: several */
    int s = __atomic_load_n(&single, __ATOMIC_RELAXED);
    if (s >= 0) return s;
    if (s == -1) {
        int n = 0;
        vgpu_in_hook++;
        CUresult rc = CU_REAL(cuDeviceGetCount, (&n));
        vgpu_in_hook--;
        if (rc == CUDA_SUCCESS) {
            s = n == 1 ? vgpu_index_of_cu(0) : -2;
            if (s == -1) s = -2;
            __atomic_store_n(&single, s, __ATOMIC_RELAXED);
            if (s >= 0) return s;
        }
    }
    return vgpu_index_current();
}

/* the stream a handle names, as one key: legacy = NULL, per-thread = CU_STREAM_PER_THREAD */
static CUstream normal(CUstream h, int ptds) {
    if (h == CU_STREAM_LEGACY) return NULL;
    if (h == NULL && ptds) return CU_STREAM_PER_THREAD;
    return h;
}

/* the last event of each of the device's streams is sealed: launches went past it unmeasured */
static void seal_streams(int idx) {
    for (int i = 0; i < L.nstreams; i++) {
        struct stream *s = L.streams[i];
        if (s->used && s->idx == idx && s->n) s->q[s->n - 1].sealed = 1;
    }
}

static int slow_enter(struct launch *l, struct vgpu_region_header *hd, int idx, CUstream h, uint64_t now, int bracket) {
    pthread_once(&fork_once, register_fork);
    vgpu_cuda_ready();
    if (!have_event_api()) {
        if (first_time(TOLD_NO_EVENTS))
            VGPU_LOG(VGPU_LOG_WARN, "the driver lacks the event functions the compute limit measures with; "
                     "the limit is not enforced");
        return 0;
    }
    l->hd = hd;
    l->idx = idx;
    l->relaxed = relaxed_enter(&l->saved);
    /* a launch into a capturing stream does not run now: forward it untouched, no events */
    CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
    CUresult rc = real_cuStreamIsCapturing ? real_cuStreamIsCapturing(h, &cs) : CUDA_SUCCESS;
    if (rc != CUDA_SUCCESS || cs != CU_STREAM_CAPTURE_STATUS_NONE || real_cuCtxGetCurrent(&l->ctx) != CUDA_SUCCESS ||
        !l->ctx) {
        relaxed_leave(l->relaxed, l->saved);
        return 0;
    }
    l->h = h;
    l->thread = h == CU_STREAM_PER_THREAD ? thread_id() : 0;
    l->predicted = 0;
    l->bracket = bracket;
    l->started = 0;
    l->from = NULL;
    gate(hd, idx, now);

    pthread_mutex_lock(&L.mu);
    struct stream *s = stream_get(l->ctx, h, l->thread, idx, hd);
    uint64_t waited = 0;
    /* beside each other, a normal container keeps only a few ms of work queued (the driver runs
     * whatever is queued, so a deeper queue would outlast its yield by seconds) and a priority-0
     * one tens of ms (so that it keeps launching, and so counts as active, while its work runs) */
    uint32_t flags = __atomic_load_n(&hd->flags[idx], __ATOMIC_RELAXED);
    int64_t queue_max = vgpu_priority() != 0 ? GUARD_QUEUE_NS : HIGH_QUEUE_NS;
    int guarded = (flags & VGPU_FLAG_GUARD) && arbiter_fresh(hd, now);
    while (s && harvest(s, hd)) {
        /* bounded look-ahead: an unmeasured device, or too much queued, waits for the GPU */
        int deep = s->inflight >= INFLIGHT_MAX || (!L.avg[idx] && s->inflight > 0 && !idle(s, hd)) ||
                   (guarded && (int64_t)s->inflight * L.avg[idx] >= queue_max);
        if (!deep || waited >= DEPTH_WAIT_MAX_NS) break;
        pthread_mutex_unlock(&L.mu);
        sleep_ns(DEPTH_WAIT_NS);
        waited += DEPTH_WAIT_NS;
        pthread_mutex_lock(&L.mu);
        s = stream_find(l->ctx, h, l->thread);
    }
    if (!bracket && __atomic_load_n(&unmeasured[idx], __ATOMIC_RELAXED) &&
        __atomic_exchange_n(&unmeasured[idx], 0, __ATOMIC_RELAXED))
        seal_streams(idx);
    /* a sample standing for unmeasured launches, all on this stream since this thread's previous
     * sample ended there: that end is kept, to bound what they took (settle) */
    if (bracket && s && s->used && s->n == 1 && s->q[0].end && s->q[0].sealed && s->q[0].done &&
        s->q[0].by == thread_id() && P.count && P.dev == idx && !P.mixed && P.stream == h) {
        l->from = s->q[0].e;
        s->n = 0;
        s->inflight = 0;
    }
    /* a start event where the stream is idle; for a sampled launch, or after a sealed end, always
     * (what ran before it was charged already, so the interval up to it is not counted) */
    int start = s && s->used && idle(s, hd);
    if (s && s->used && !start && s->n > 0)
        start = bracket ? s->n <= QUEUE_MAX - 2 : s->q[s->n - 1].sealed && s->n < QUEUE_MAX;
    if (s && s->used && start) {
        CUevent e = event_get(l->ctx);
        if (e) {
            rc = real_cuEventRecord(e, h);
            if (rc == CUDA_SUCCESS) {
                s->q[s->n++] = (struct ev){.e = e, .end = 0, .first_ns = now};
                l->started = 1;
                l->start_ns = now_ns();
            } else {
                broken(s, hd, rc);
            }
        }
    }
    if (s && s->used) {
        l->predicted = capped(idx) ? scaled(idx, L.avg[idx]) : 0;
        if (l->predicted) __atomic_sub_fetch(&hd->tokens[idx], l->predicted, __ATOMIC_RELAXED);
    }
    pthread_mutex_unlock(&L.mu);
    return 1;
}

static void slow_leave(struct launch *l, CUresult launched) {
    struct vgpu_region_header *hd = l->hd;
    pthread_mutex_lock(&L.mu);
    struct stream *s = stream_find(l->ctx, l->h, l->thread);
    if (s && launched == CUDA_SUCCESS && l->bracket && !l->started) {
        /* a sampled launch without its own start event is not measured: its prediction stands */
        if (l->predicted) __atomic_add_fetch(&hd->busy_ns[l->idx], (uint64_t)l->predicted, __ATOMIC_RELAXED);
    } else if (s && launched == CUDA_SUCCESS) {
        uint64_t now = now_ns();
        struct ev *t = s->n ? &s->q[s->n - 1] : NULL;
        CUresult rc;
        /* never the first event: it is where the next interval starts */
        if (t && s->n >= 2 && t->end && !t->done && !t->sealed && !l->bracket &&
            ((now - t->first_ns < SEAL_NS && t->launches < SEAL_LAUNCHES) || s->n == QUEUE_MAX)) {
            rc = real_cuEventRecord(t->e, l->h); /* the end moves past this launch */
            if (rc == CUDA_SUCCESS) {
                t->launches++;
                t->weight++;
                t->predicted += l->predicted;
                s->inflight++;
            }
        } else if (s->n < QUEUE_MAX) {
            CUevent e = event_get(l->ctx);
            rc = e ? real_cuEventRecord(e, l->h) : CUDA_SUCCESS;
            if (e && rc == CUDA_SUCCESS) {
                struct ev end = {.e = e, .end = 1, .launches = 1, .weight = 1, .predicted = l->predicted, .first_ns = now};
                /* a sample stands for this thread's unmeasured launches before it too, unless the
                 * thread was held up between its events (preempted): then for itself alone */
                if (l->bracket && now - l->start_ns <= SAMPLE_HOST_MAX_NS && P.count && P.dev == l->idx) {
                    end.weight += P.count;
                    end.predicted += P.charged;
                    end.from = l->from;
                    l->from = NULL;
                    P.count = 0;
                    P.charged = 0;
                }
                end.sealed = (uint8_t)l->bracket;
                if (l->bracket) end.by = thread_id();
                s->q[s->n++] = end;
                s->inflight++;
            } else if (e) {
                event_put(l->ctx, e);
            }
        } else {
            rc = CUDA_SUCCESS;
        }
        if (rc != CUDA_SUCCESS) {
            __atomic_add_fetch(&hd->tokens[l->idx], l->predicted, __ATOMIC_RELAXED);
            broken(s, hd, rc);
        }
    } else if (l->predicted) {
        __atomic_add_fetch(&hd->tokens[l->idx], l->predicted, __ATOMIC_RELAXED); /* not launched: refund */
    }
    if (l->from) event_put(l->ctx, l->from); /* not used: the sample stood for itself, or failed */
    l->from = NULL;
    pthread_mutex_unlock(&L.mu);
    relaxed_leave(l->relaxed, l->saved);
}

/* ---- the sampled path: short kernels under a cap, no driver call but the capture check ---- */

/* 1 when this thread's launch is to be measured: every 1..63 launches (32 on average), at random
 * so that no periodic pattern of kernels is always or never measured */
static int sample_now(void) {
    if (P.left > 1) {
        P.left--;
        return 0;
    }
    uint32_t x = P.rng ? P.rng : ((uint32_t)thread_id() * 2654435761u) | 1u;
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5; /* xorshift32: never 0 from a non-zero seed */
    P.rng = x;
    P.left = 1 + x % (SAMPLE_SPAN - 1);
    return 1;
}

/* The allowance ran out: pass the gate (the same gate as every
 * measured launch: the bucket, the yield flag, a live resize) and take the next chunk. */
static void draw(struct vgpu_region_header *hd, int idx, uint32_t limit, int64_t avg) {
    struct allowance *a = &A[idx];
    pthread_mutex_lock(&draw_mu);
    while (__atomic_load_n(&a->charged, __ATOMIC_RELAXED) > __atomic_load_n(&a->drawn, __ATOMIC_RELAXED)) {
        uint64_t now = now_ns();
        __atomic_store_n(&hd->last_launch_ns[idx], now, __ATOMIC_RELAXED);
        CUstreamCaptureMode saved;
        int relaxed = relaxed_enter(&saved); /* the gate may harvest: event queries, never into a capture */
        gate(hd, idx, now);
        relaxed_leave(relaxed, saved);
        int64_t chunk = avg * CHUNK_LAUNCHES, most = burst_of(limit) / 8;
        if (chunk > most) chunk = most;
        if (chunk < avg) chunk = avg;
        __atomic_sub_fetch(&hd->tokens[idx], chunk, __ATOMIC_RELAXED);
        __atomic_add_fetch(&a->drawn, chunk, __ATOMIC_RELAXED);
    }
    pthread_mutex_unlock(&draw_mu);
}

/* 0 = forward untouched (a capturing stream); 2 = charged its prediction, refund if it fails */
static int fast(struct launch *l, struct vgpu_region_header *hd, int idx, uint32_t limit, int64_t avg, CUstream h) {
    CUstreamCaptureMode saved;
    int relaxed = relaxed_enter(&saved);
    CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
    CUresult rc = real_cuStreamIsCapturing ? real_cuStreamIsCapturing(h, &cs) : CUDA_SUCCESS;
    relaxed_leave(relaxed, saved);
    if (rc != CUDA_SUCCESS || cs != CU_STREAM_CAPTURE_STATUS_NONE) return 0;
    stamp(hd, idx, coarse_ns());
    if (!__atomic_load_n(&unmeasured[idx], __ATOMIC_RELAXED)) __atomic_store_n(&unmeasured[idx], 1, __ATOMIC_RELAXED);
    l->idx = idx;
    l->predicted = avg;
    if (!P.count) {
        P.stream = h;
        P.mixed = 0;
    } else if (h != P.stream) {
        P.mixed = 1;
    }
    P.dev = idx;
    P.count++;
    P.charged += avg;
    if (__atomic_add_fetch(&A[idx].charged, avg, __ATOMIC_RELAXED) > __atomic_load_n(&A[idx].drawn, __ATOMIC_RELAXED))
        draw(hd, idx, limit, avg);
    return 2;
}

static void fast_refund(const struct launch *l) {
    __atomic_sub_fetch(&A[l->idx].charged, l->predicted, __ATOMIC_RELAXED);
    P.count--;
    P.charged -= l->predicted;
}

/* ---- the node's gate: the grant's hold_until_ns, written by the node monitor ---- */

/* The node measures the container's share of the card from the driver (NVML), where nothing the
 * container writes counts, and closes this gate while the container ran past its grant (its
 * region's bucket was written, say). No launch starts before the word's time; the host may move
 * it either way while we wait, so it is read again every few ms. Never closed for a container the
 * node sees within its grant, so an honest container only ever pays the load. */
static __attribute__((noinline)) void node_gate(struct vgpu_region_header *hd, int idx, const struct vgpu_grant *g) {
    uint64_t t0 = now_ns(), now = t0;
    for (;;) {
        uint64_t until = __atomic_load_n(&g->hold_until_ns[idx], __ATOMIC_RELAXED);
        if (until <= now || until - now > 10 * VGPU_ARBITER_STALE_NS) break; /* open, or nonsense: never frozen */
        if (first_time(TOLD_HELD))
            VGPU_LOG(VGPU_LOG_INFO, "device %d: the node measured this container past its compute limit; launches "
                     "wait for the node's gate (the grant's hold_until_ns)", idx);
        uint64_t wait = until - now;
        sleep_ns(wait < WAIT_MAX_NS ? wait : WAIT_MAX_NS);
        now = now_ns();
    }
    if (now > t0) __atomic_add_fetch(&hd->throttled_ns[idx], now - t0, __ATOMIC_RELAXED);
}

/* a launch under a cap or an arbiter flag: sampled or measured (out of line: the no-limit path
 * stays as small as it was) */
static __attribute__((noinline)) int enter_limited(struct launch *l, struct vgpu_region_header *hd, int idx,
                                                    uint32_t limit, uint32_t flags, CUstream h, int ptds) {
    int cap = limit > 0 && limit < 100;
    /* the node's gate, before either path: one aligned load; closed only for a container over its grant */
    const struct vgpu_grant *g = __atomic_load_n(&vgpu_grant_mapped, __ATOMIC_RELAXED);
    if (g && __builtin_expect(__atomic_load_n(&g->hold_until_ns[idx], __ATOMIC_RELAXED) != 0, 0))
        node_gate(hd, idx, g);
    /* a cap and no arbiter flag that needs every launch seen: short kernels are sampled, while the
     * measurements keep up (at most FAST_AHEAD launches' prediction charged since the last came in) */
    int bracket = 0;
    if (cap && !(flags & (VGPU_FLAG_YIELD | VGPU_FLAG_GUARD)) && (!(flags & VGPU_FLAG_ALONE) || vgpu_sm_policy() == 0)) {
        int64_t avg = __atomic_load_n(&L.avg[idx], __ATOMIC_RELAXED);
        if (avg > 0 && avg < FAST_MAX_NS) {
            if (P.count && P.dev != idx) P.count = 0, P.charged = 0; /* another device's: their prediction stands */
            if (__atomic_load_n(&A[idx].charged, __ATOMIC_RELAXED) - __atomic_load_n(&A[idx].mark, __ATOMIC_RELAXED) <
                FAST_AHEAD * avg) {
                if (!sample_now()) return fast(l, hd, idx, limit, scaled(idx, avg), normal(h, ptds));
                bracket = 1;
            }
        }
    }
    /* a measured launch of a thread with unmeasured ones is measured alone and stands for them too */
    if (P.count) {
        if (P.dev == idx) bracket = 1;
        else P.count = 0, P.charged = 0;
    }
    uint64_t now = now_ns();
    __atomic_store_n(&hd->last_launch_ns[idx], now, __ATOMIC_RELAXED);
    return slow_enter(l, hd, idx, normal(h, ptds), now, bracket);
}

/* 0 = forward untouched (no limit, no yield, capture); 1 = measured, call slow_leave after;
 * 2 = sampled path, call fast_refund if the launch fails */
static inline int enter(struct launch *l, CUstream h, int ptds) {
    if (__builtin_expect(vgpu_in_hook, 0)) return 0;
    struct vgpu_region_header *hd = vgpu_header();
    if (!hd) return 0;
    int idx = device_index();
    if (idx < 0 || idx >= VGPU_MAX_DEVICES) return 0;
    /* under MPS the driver holds compute (the active thread percentage, mps.c): no cap, no flag */
    if (__atomic_load_n(&vgpu_mps, __ATOMIC_RELAXED)) {
        stamp(hd, idx, coarse_ns());
        return 0;
    }
    uint32_t limit = vgpu_sm_limit(idx);
    uint32_t flags = __atomic_load_n(&hd->flags[idx], __ATOMIC_RELAXED);
    if ((limit == 0 || limit >= 100) && !(flags & (VGPU_FLAG_YIELD | VGPU_FLAG_GUARD))) {
        stamp(hd, idx, coarse_ns());
        return 0;
    }
    return enter_limited(l, hd, idx, limit, flags, h, ptds);
}

#define LAUNCH(name, args, stream, ptds)                        \
    do {                                                        \
        struct launch l_;                                       \
        int how_ = enter(&l_, (stream), (ptds));                \
        if (!how_) return CU_REAL(name, args);                  \
        CUresult rc_ = CU_REAL(name, args);                     \
        if (how_ == 1) slow_leave(&l_, rc_);                    \
        else if (rc_ != CUDA_SUCCESS) fast_refund(&l_);         \
        return rc_;                                             \
    } while (0)

EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                               unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                               unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra) {
    LAUNCH(cuLaunchKernel, (f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream,
                            kernelParams, extra), hStream, 0);
}

EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                                    unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                                    unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra) {
    LAUNCH(cuLaunchKernel_ptsz, (f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes,
                                 hStream, kernelParams, extra), hStream, 1);
}

EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra) {
    LAUNCH(cuLaunchKernelEx, (config, f, kernelParams, extra), config ? config->hStream : NULL, 0);
}

EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra) {
    LAUNCH(cuLaunchKernelEx_ptsz, (config, f, kernelParams, extra), config ? config->hStream : NULL, 1);
}

EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                          unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                          unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                          void **kernelParams) {
    LAUNCH(cuLaunchCooperativeKernel, (f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
                                       sharedMemBytes, hStream, kernelParams), hStream, 0);
}

EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                               unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                               unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                               void **kernelParams) {
    LAUNCH(cuLaunchCooperativeKernel_ptsz, (f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
                                            sharedMemBytes, hStream, kernelParams), hStream, 1);
}

EXPORT CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream) {
    LAUNCH(cuGraphLaunch, (hGraphExec, hStream), hStream, 0);
}

EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream) {
    LAUNCH(cuGraphLaunch_ptsz, (hGraphExec, hStream), hStream, 1);
}
