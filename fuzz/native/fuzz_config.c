/* libFuzzer harness: the hook's environment parsing (native/hook/config.c), linked in as is.
 *
 * The input is a list of values separated by NUL bytes, given in turn to the variables below
 * (a variable past the end of the list is unset); then vgpu_config_load() reads them as the hook
 * does when it attaches. The first value is also parsed on its own by vgpu_parse_size(), whose
 * result is checked against the number the text spells: a size that does not fit in 64 bits must
 * be refused, never wrap around to a small limit (or 0, which means no limit at all). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hook.h"

static const char *const NAMES[] = {
    "CUDA_DEVICE_MEMORY_LIMIT", "CUDA_DEVICE_SM_LIMIT", "NVIDIA_VISIBLE_DEVICES",
    "CUDA_DEVICE_MEMORY_BUDGET", "CUDA_TASK_PRIORITY", "CUDA_SM_POLICY", "CUDA_OVERSUBSCRIBE",
    "VGPU_CONTEXT_RESERVE", "CUDA_DEVICE_MEMORY_LIMIT_0", "CUDA_DEVICE_SM_LIMIT_1",
    "CUDA_DEVICE_MEMORY_BUDGET_2", "CUDA_DEVICE_MEMORY_LIMIT_15", "CUDA_DEVICE_MEMORY_SHARED_CACHE",
};
#define NNAMES (sizeof NAMES / sizeof NAMES[0])

#include <unistd.h>

/* stderr as it was before libFuzzer's -close_fd_mask=2 (which silences the hook's own log) */
static int report_fd = 2;
#define FAIL(...) do { dprintf(report_fd, "fuzz_config: " __VA_ARGS__); dprintf(report_fd, "\n"); abort(); } while (0)

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    report_fd = dup(2);
    if (report_fd < 0) report_fd = 2;
    vgpu_log_level = VGPU_LOG_DEBUG; /* format every message (run with -close_fd_mask=2 to silence them) */
    return 0;
}

/* The value the text spells as vgpu_parse_size's grammar reads it, saturated past 2^64. */
static unsigned __int128 spelled(const char *text) {
    const unsigned __int128 cap = (unsigned __int128)1 << 65;
    unsigned __int128 v = 0;
    const char *p = text;
    for (; *p >= '0' && *p <= '9'; p++) {
        v = v * 10 + (unsigned)(*p - '0');
        if (v > cap) v = cap;
    }
    switch (*p) {
    case 'k': case 'K': v <<= 10; break;
    case 'm': case 'M': v <<= 20; break;
    case 'g': case 'G': v <<= 30; break;
    default: break;
    }
    return v;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *buf = malloc(size + 1);
    if (!buf) return 0;
    memcpy(buf, data, size);
    buf[size] = '\0';
    /* putenv of our own buffers, not setenv: glibc's setenv never frees a value it replaced, and
     * millions of distinct values would grow the fuzzer past its memory limit */
    static char env[NNAMES][64 + 8192];
    const char *p = buf, *end = buf + size;
    for (size_t i = 0; i < NNAMES; i++) {
        unsetenv(NAMES[i]);
        if (p <= end) {
            snprintf(env[i], sizeof env[i], "%s=%s", NAMES[i], p);
            putenv(env[i]);
            p += strlen(p) + 1;
        }
    }

    uint64_t out = 0;
    if (vgpu_parse_size(buf, &out) == 0) {
        unsigned __int128 want = spelled(buf);
        if (want > UINT64_MAX || (uint64_t)want != out)
            FAIL("vgpu_parse_size(\"%s\") accepted it as %llu, but it spells a number that %s", buf,
                 (unsigned long long)out, want > UINT64_MAX ? "does not fit in 64 bits" : "differs");
    }

    struct vgpu_config cfg;
    vgpu_config_load(&cfg);
    if (cfg.num_devices < 1 || cfg.num_devices > VGPU_MAX_DEVICES) FAIL("num_devices %u", cfg.num_devices);
    if (cfg.priority > 1) FAIL("priority %u", cfg.priority);
    if (cfg.sm_policy > 1) FAIL("sm_policy %u", cfg.sm_policy);
    for (int i = 0; i < VGPU_MAX_DEVICES; i++) {
        if (cfg.sm_limit[i] > 100) FAIL("sm_limit[%d] %u", i, cfg.sm_limit[i]);
        size_t len = strnlen(cfg.uuid[i], VGPU_UUID_BYTES);
        if (len == VGPU_UUID_BYTES) FAIL("uuid[%d] is not NUL-terminated", i);
        if (len && strncmp(cfg.uuid[i], "GPU-", 4) != 0 && strncmp(cfg.uuid[i], "MIG-", 4) != 0)
            FAIL("uuid[%d] '%s' is no GPU- or MIG- UUID", i, cfg.uuid[i]);
    }
    free(buf);
    return 0;
}
