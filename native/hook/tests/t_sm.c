/* The compute limiter over the stub's simulated GPU timeline.
 * usage: t_sm MODE SCENARIO [ARGS]
 *   rate PATH SECONDS [STREAM [THREADS]]  launch 1 ms kernels for SECONDS (STREAM: legacy, ptds,
 *                                         created); THREADS each on its own created stream
 *   phases PATH SPEC                      SPEC = step,step,... with step = SECONDS[:ACTION[+ACTION...]],
 *                                         ACTION: limit=N  flags=N  fresh=0|1 (keep arbiter_ns fresh),
 *                                         kernel_us=N (the kernels' length from then on),
 *                                         as the node monitor writes them, or steal=1 (fill the
 *                                         bucket on disk as a tenant could); prints each step's share
 *   queue PATH SPEC                       as phases, never syncing: prints each step's deepest queue
 *   capture                               launches into a capturing stream, then on another stream
 *   events_fail                           every event call fails for a while (a destroyed context)
 *   fork                                  a forked child launches on under the limit
 * PATH: kernel kernel_ptsz ex ex_ptsz coop coop_ptsz graph graph_ptsz
 * The GPU share is the stub's own busy time over wall time; the region's counters come from
 * CUDA_DEVICE_MEMORY_SHARED_CACHE, mapped here as the monitor maps it. */
#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>

#include "common.h"
#include "region_layout.h"

static CUfunction fn;
static const char *path = "kernel";
static struct vgpu_region_header *hd;
static unsigned long long (*busy)(void);
static void (*set_kernel)(unsigned long long);
static CUcontext ctx;
static unsigned long long kernel_ns; /* each simulated kernel's length */

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ULL + (uint64_t)t.tv_nsec;
}

static void *stub(const char *name) {
    void *p = dlsym(cuda_handle, name);
    if (!p) die(name, -1);
    return p;
}

static void map_region(void) {
    const char *file = getenv("CUDA_DEVICE_MEMORY_SHARED_CACHE");
    if (!file) return;
    int fd = open(file, O_RDWR);
    if (fd < 0) die("open region", 0);
    void *m = mmap(NULL, VGPU_REGION_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) die("mmap region", 0);
    hd = m;
}

static CUresult launch(CUstream s) {
    static CUlaunchConfig cfg = {1, 1, 1, 1, 1, 1, 0, NULL, NULL, 0};
    cfg.hStream = s;
    CUgraphExec graph = (CUgraphExec)(uintptr_t)0x6a;
    if (strcmp(path, "kernel") == 0) return R(cuLaunchKernel, "cuLaunchKernel")(fn, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
    if (strcmp(path, "kernel_ptsz") == 0)
        return R(cuLaunchKernel_ptsz, "cuLaunchKernel")(fn, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
    if (strcmp(path, "ex") == 0) return R(cuLaunchKernelEx, "cuLaunchKernelEx")(&cfg, fn, NULL, NULL);
    if (strcmp(path, "ex_ptsz") == 0) return R(cuLaunchKernelEx_ptsz, "cuLaunchKernelEx")(&cfg, fn, NULL, NULL);
    if (strcmp(path, "coop") == 0)
        return R(cuLaunchCooperativeKernel, "cuLaunchCooperativeKernel")(fn, 1, 1, 1, 1, 1, 1, 0, s, NULL);
    if (strcmp(path, "coop_ptsz") == 0)
        return R(cuLaunchCooperativeKernel_ptsz, "cuLaunchCooperativeKernel")(fn, 1, 1, 1, 1, 1, 1, 0, s, NULL);
    if (strcmp(path, "graph") == 0) return R(cuGraphLaunch, "cuGraphLaunch")(graph, s);
    if (strcmp(path, "graph_ptsz") == 0) return R(cuGraphLaunch_ptsz, "cuGraphLaunch")(graph, s);
    die("unknown path", 0);
    return CUDA_ERROR_UNKNOWN;
}

static CUstream make_stream(const char *kind) {
    if (strcmp(kind, "legacy") == 0) return NULL;
    if (strcmp(kind, "ptds") == 0) return CU_STREAM_PER_THREAD;
    CUstream s;
    CUresult rc = R(cuStreamCreate, "cuStreamCreate")(&s, 0);
    if (rc) die("cuStreamCreate", rc);
    return s;
}

/* launch, keeping at most 16 kernels queued, as an application that waits for its results */
static unsigned long run_for(CUstream s, uint64_t until) {
    unsigned long n = 0;
    while (now_ns() < until) {
        CUresult rc = launch(s);
        if (rc) die("launch", rc);
        if (++n % 16 == 0) R(cuStreamSynchronize, "cuStreamSynchronize")(s);
    }
    return n;
}

static void print_region(void) {
    if (!hd) return;
    printf("region_busy_ns=%llu\n", (unsigned long long)__atomic_load_n(&hd->busy_ns[0], __ATOMIC_RELAXED));
    printf("throttled_ns=%llu\n", (unsigned long long)__atomic_load_n(&hd->throttled_ns[0], __ATOMIC_RELAXED));
    printf("last_launch_ns=%llu\n", (unsigned long long)__atomic_load_n(&hd->last_launch_ns[0], __ATOMIC_RELAXED));
    printf("tokens=%lld\n", (long long)__atomic_load_n(&hd->tokens[0], __ATOMIC_RELAXED));
}

struct worker { const char *kind; uint64_t until; unsigned long n; };
static void *work(void *arg) {
    struct worker *w = arg;
    R(cuCtxSetCurrent, "cuCtxSetCurrent")(ctx);
    w->n = run_for(make_stream(w->kind), w->until);
    return NULL;
}

static int rate(int argc, char **argv) {
    double seconds = argc > 4 ? atof(argv[4]) : 1.0;
    const char *kind = argc > 5 ? argv[5] : "legacy";
    int threads = argc > 6 ? atoi(argv[6]) : 1;
    if (threads < 1 || threads > 16) die("threads", threads);
    uint64_t t0 = now_ns();
    unsigned long long b0 = busy();
    struct worker w[16];
    pthread_t th[16];
    for (int i = 0; i < threads; i++) {
        w[i] = (struct worker){threads > 1 ? "created" : kind, t0 + (uint64_t)(seconds * 1e9), 0};
        if (threads > 1) pthread_create(&th[i], NULL, work, &w[i]);
        else work(&w[i]);
    }
    unsigned long total = 0;
    for (int i = 0; i < threads; i++) {
        if (threads > 1) pthread_join(th[i], NULL);
        total += w[i].n;
    }
    R(cuCtxSynchronize, "cuCtxSynchronize")();
    uint64_t wall = now_ns() - t0;
    printf("launches=%lu\nwall_ns=%llu\nbusy_ns=%llu\n", total, (unsigned long long)wall, busy() - b0);
    printf("share=%.4f\n", (double)(busy() - b0) / (double)wall);
    printf("start_ns=%llu\n", (unsigned long long)t0);
    print_region();
    return 0;
}

/* The monitor's side, on its own thread (a held launch must not hold up the flags that release
 * it): each step's actions, arbiter_ns kept fresh every 20 ms while `fresh`, and each step's share. */
static volatile int done;
static unsigned long launched;
static char *spec;
static unsigned long long max_queue; /* the deepest queue (ns of work launched, not yet run) this step */
static int track_queue;
static volatile int applied; /* the first step's actions are in */

static void *monitor(void *arg) {
    (void)arg;
    int fresh = 0, step = 0;
    for (char *tok = strtok(spec, ","); tok; tok = strtok(NULL, ","), step++) {
        for (const char *action = strchr(tok, ':'); action; action = strchr(action + 1, '+')) {
            action++;
            if (strncmp(action, "limit=", 6) == 0)
                __atomic_store_n(&hd->sm_limit[0], (uint32_t)atoi(action + 6), __ATOMIC_RELAXED);
            else if (strncmp(action, "flags=", 6) == 0)
                __atomic_store_n(&hd->flags[0], (uint32_t)atoi(action + 6), __ATOMIC_RELAXED);
            else if (strncmp(action, "fresh=", 6) == 0)
                fresh = atoi(action + 6);
            else if (strncmp(action, "kernel_us=", 10) == 0) /* the program's kernels change length */
                set_kernel((unsigned long long)(atof(action + 10) * 1000));
            else if (strncmp(action, "steal=", 6) == 0 && atoi(action + 6)) {
                /* a tenant's write into its region: a bucket full for hours, its refill stamp
                 * an hour ahead so it would never be trimmed at a refill */
                __atomic_store_n(&hd->refill_ns[0], now_ns() + 3600000000000ULL, __ATOMIC_RELEASE);
                __atomic_store_n(&hd->tokens[0], (int64_t)1 << 60, __ATOMIC_RELEASE);
            }
        }
        uint64_t t0 = now_ns(), until = t0 + (uint64_t)(atof(tok) * 1e9);
        if (fresh) __atomic_store_n(&hd->arbiter_ns, t0, __ATOMIC_RELEASE);
        unsigned long long b0 = busy();
        __atomic_store_n(&max_queue, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&applied, 1, __ATOMIC_RELEASE);
        unsigned long n0 = __atomic_load_n(&launched, __ATOMIC_RELAXED);
        for (uint64_t t = t0; t < until; t = now_ns()) {
            if (fresh) __atomic_store_n(&hd->arbiter_ns, t, __ATOMIC_RELEASE);
            uint64_t nap = until - t < 20000000ULL ? until - t : 20000000ULL;
            struct timespec ts = {0, (long)nap};
            nanosleep(&ts, NULL);
        }
        printf("step%d_launches=%lu\nstep%d_share=%.4f\n", step, __atomic_load_n(&launched, __ATOMIC_RELAXED) - n0,
               step, (double)(busy() - b0) / (double)(now_ns() - t0));
        if (track_queue)
            printf("step%d_max_queue_ms=%.1f\n", step, (double)__atomic_load_n(&max_queue, __ATOMIC_RELAXED) / 1e6);
        fflush(stdout);
    }
    done = 1;
    return NULL;
}

static int phases(int argc, char **argv) {
    if (argc < 5 || !hd) die("usage: t_sm MODE phases PATH SPEC (with a region)", 0);
    spec = strdup(argv[4]);
    CUstream s = make_stream("created");
    pthread_t th;
    pthread_create(&th, NULL, monitor, NULL);
    while (!done) {
        CUresult rc = launch(s);
        if (rc) die("launch", rc);
        if (__atomic_add_fetch(&launched, 1, __ATOMIC_RELAXED) % 16 == 0) R(cuStreamSynchronize, "cuStreamSynchronize")(s);
    }
    pthread_join(th, NULL);
    R(cuCtxSynchronize, "cuCtxSynchronize")();
    print_region();
    return 0;
}

/* queue: as phases, but never waiting for the work (a training loop that syncs rarely): how deep
 * the device's queue grows is then up to the limiter alone */
static int queue(int argc, char **argv) {
    if (argc < 5 || !hd) die("usage: t_sm MODE queue PATH SPEC (with a region)", 0);
    spec = strdup(argv[4]);
    track_queue = 1;
    CUstream s = make_stream("created");
    unsigned long long b0 = busy(), n = 0;
    pthread_t th;
    pthread_create(&th, NULL, monitor, NULL);
    while (!__atomic_load_n(&applied, __ATOMIC_ACQUIRE)) {}
    while (!done) {
        CUresult rc = launch(s);
        if (rc) die("launch", rc);
        __atomic_add_fetch(&launched, 1, __ATOMIC_RELAXED);
        unsigned long long q = ++n * kernel_ns - (busy() - b0);
        if (q > __atomic_load_n(&max_queue, __ATOMIC_RELAXED)) __atomic_store_n(&max_queue, q, __ATOMIC_RELAXED);
        if (q > 2000000000ULL) { /* two seconds queued: the limiter held nothing back */
            struct timespec ts = {0, 1000000};
            nanosleep(&ts, NULL);
        }
    }
    pthread_join(th, NULL);
    print_region();
    return 0;
}

static int capture(void) {
    int (*set_capturing)(CUstream, int) = (int (*)(CUstream, int))stub("stubStreamSetCapturing");
    unsigned long long (*on_capturing)(void) = (unsigned long long (*)(void))stub("stubEventsOnCapturing");
    unsigned long long (*violations)(void) = (unsigned long long (*)(void))stub("stubCaptureViolations");
    unsigned long long (*captured)(void) = (unsigned long long (*)(void))stub("stubCapturedLaunches");
    CUstream a = make_stream("created"), b = make_stream("created");
    if (set_capturing(a, 1) != 0) die("stubStreamSetCapturing", 0);
    uint64_t t0 = now_ns();
    for (int i = 0; i < 2000; i++)
        if (launch(a)) die("captured launch", 0);
    printf("capture_ms=%.1f\n", (double)(now_ns() - t0) / 1e6);
    printf("captured=%llu\n", captured());
    print_region();
    /* meanwhile another stream of the process runs under the limit: the limiter's event queries
     * for it must not break the global-mode capture */
    unsigned long long b0 = busy();
    t0 = now_ns();
    unsigned long n = run_for(b, t0 + 500000000ULL);
    R(cuStreamSynchronize, "cuStreamSynchronize")(b);
    printf("other_launches=%lu\nother_share=%.4f\n", n, (double)(busy() - b0) / (double)(now_ns() - t0));
    printf("events_on_capturing=%llu\nviolations=%llu\n", on_capturing(), violations());
    set_capturing(a, 0);
    return 0;
}

static int events_fail(void) {
    void (*fail)(int) = (void (*)(int))stub("stubFailEvents");
    CUstream s = make_stream("created");
    uint64_t t0 = now_ns();
    run_for(s, t0 + 300000000ULL);
    fail(1);
    unsigned long long b0 = busy();
    uint64_t t1 = now_ns();
    unsigned long n = run_for(s, t1 + 300000000ULL);
    printf("failing_launches=%lu\nfailing_share=%.4f\n", n, (double)(busy() - b0) / (double)(now_ns() - t1));
    fail(0);
    b0 = busy();
    t1 = now_ns();
    run_for(s, t1 + 1000000000ULL);
    R(cuStreamSynchronize, "cuStreamSynchronize")(s);
    printf("after_share=%.4f\n", (double)(busy() - b0) / (double)(now_ns() - t1));
    unsigned long long (*live)(void) = (unsigned long long (*)(void))stub("stubEventsLive");
    printf("events_live=%llu\n", live());
    return 0;
}

/* a forked child keeps launching under the limit (the stub, unlike a real driver, lets it): the
 * hook's own state must not carry the parent's events or a lock held at the fork */
static int forked(void) {
    CUstream s = make_stream("created");
    run_for(s, now_ns() + 300000000ULL);
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        unsigned long long b0 = busy();
        uint64_t t0 = now_ns();
        run_for(s, t0 + 800000000ULL);
        R(cuStreamSynchronize, "cuStreamSynchronize")(s);
        printf("child_share=%.4f\n", (double)(busy() - b0) / (double)(now_ns() - t0));
        fflush(stdout);
        _exit(0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    printf("child_status=%d\n", status);
    return 0;
}

static const char ptx[] = ".version 7.0\n.target sm_50\n.address_size 64\n.visible .entry spin()\n{\n ret;\n}\n";

int main(int argc, char **argv) {
    if (argc < 3) die("usage: t_sm MODE SCENARIO [ARGS]", 0);
    setup(argv[1]);
    if (argc > 3) path = argv[3];
    CUdevice dev = open_device(0);
    (void)dev;
    busy = (unsigned long long (*)(void))stub("stubBusyNs");
    set_kernel = (void (*)(unsigned long long))stub("stubSetKernelNs");
    const char *k = getenv("TEST_KERNEL_US");
    kernel_ns = k ? (unsigned long long)(atof(k) * 1000) : 1000000ULL;
    set_kernel(kernel_ns);
    CUmodule mod;
    CUresult rc = R(cuModuleLoadData, "cuModuleLoadData")(&mod, ptx);
    if (rc) die("cuModuleLoadData", rc);
    if ((rc = R(cuModuleGetFunction, "cuModuleGetFunction")(&fn, mod, "spin"))) die("cuModuleGetFunction", rc);
    R(cuCtxGetCurrent, "cuCtxGetCurrent")(&ctx);
    map_region();
    int ret = 0;
    if (strcmp(argv[2], "rate") == 0) ret = rate(argc, argv);
    else if (strcmp(argv[2], "phases") == 0) ret = phases(argc, argv);
    else if (strcmp(argv[2], "queue") == 0) ret = queue(argc, argv);
    else if (strcmp(argv[2], "capture") == 0) ret = capture();
    else if (strcmp(argv[2], "events_fail") == 0) ret = events_fail();
    else if (strcmp(argv[2], "fork") == 0) ret = forked();
    else die("unknown scenario", 0);
    printf("alive=1\n");
    return ret;
}
