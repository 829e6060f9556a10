/* libFuzzer harness: the hook loading a container's grant (native/hook/grant.c).
 *
 * grant.c is compiled into this harness (#include below) so its static state can be reset
 * between inputs. Each input becomes the grant file's bytes, named by VGPU_GRANT_FILE (the path
 * a process run by hand uses; /etc/vgpu/limits does not exist where this runs). The first byte
 * is a switch: odd, the rest gets a correct checksum, so the checks past it see fuzzed fields.
 * Properties: no crash (ASan/UBSan); a grant is taken (1) only when it passes every check, and
 * then every limit in the config is the file's; otherwise (-1) every device refuses (limit 1). */
#include "../../native/hook/grant.c"

static char file[4096];

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    const char *tmp = getenv("TMPDIR");
    snprintf(file, sizeof file, "%s/vgpu-fuzz-grant-%d", tmp && *tmp ? tmp : "/tmp", (int)getpid());
    static char env[4200];
    snprintf(env, sizeof env, "VGPU_GRANT_FILE=%s", file);
    putenv(env);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    static uint8_t body[sizeof(struct vgpu_grant) + 4096];
    size_t n = size - 1 < sizeof body ? size - 1 : sizeof body;
    memcpy(body, data + 1, n);
    if ((data[0] & 1) && n >= sizeof(struct vgpu_grant)) {
        uint64_t sum = vgpu_fnv1a64(body + VGPU_GRANT_PAYLOAD, sizeof(struct vgpu_grant) - VGPU_GRANT_PAYLOAD);
        memcpy(body + offsetof(struct vgpu_grant, checksum), &sum, sizeof sum);
    }
    int fd = open(file, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) abort();
    if (n && write(fd, body, n) != (ssize_t)n) abort();
    close(fd);

    struct vgpu_config cfg;
    memset(&cfg, 0, sizeof cfg);
    int rc = vgpu_grant_load(&cfg);
    if (rc == 1) {
        struct vgpu_grant copy;
        memcpy(&copy, body, sizeof copy);
        char why[160];
        if (check(&copy, why, sizeof why) != NULL || vgpu_grant_state() != 1) abort();
        if (cfg.num_devices != copy.num_devices || memcmp(cfg.limit, copy.limit, sizeof cfg.limit) != 0) abort();
        if (cfg.context_reserve < copy.context_reserve) abort();
    } else if (rc == -1) {
        for (int i = 0; i < VGPU_MAX_DEVICES; i++)
            if (cfg.limit[i] != 1) abort();
    } else {
        abort(); /* the file exists: a grant governs, whole or refusing */
    }
    if (G.g) munmap((void *)G.g, sizeof(struct vgpu_grant));
    memset(&G, 0, sizeof G);
    unlink(file);
    return 0;
}
