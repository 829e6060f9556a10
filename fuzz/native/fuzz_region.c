/* libFuzzer harness: the hook attaching to an existing region file (native/hook/region_file.c).
 *
 * region_file.c is compiled into this harness (#include below): its map_file() and check_header()
 * are static. Each input becomes the region file's bytes; map_file() then opens it exactly as the hook does when a
 * container's CUDA process starts (size check, map, magic/version/sizes check). The first byte
 * is a switch: even, the rest is the file as is; odd, the rest is padded with zeros to a whole
 * region, so the header checks see every field. An empty file is the "first process creates it"
 * path. Properties: no crash (ASan/UBSan), and a file is mapped only when its header passes
 * check_header (the layout this hook writes). */
#include "../../native/hook/region_file.c"

#include <stdlib.h>

static char path[4096];

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    const char *tmp = getenv("TMPDIR");
    snprintf(path, sizeof path, "%s/vgpu-fuzz-region-%d", tmp && *tmp ? tmp : "/tmp", (int)getpid());
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) abort();
    size_t body = size - 1;
    if (body && write(fd, data + 1, body) != (ssize_t)body) abort();
    if ((data[0] & 1) && body < VGPU_REGION_SIZE && ftruncate(fd, VGPU_REGION_SIZE) != 0) abort();
    close(fd);

    struct vgpu_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.region_path = path;
    cfg.num_devices = 1;
    struct vgpu_region_header *h = map_file(&cfg);
    if (h) {
        char why[256];
        if (check_header(h, why, sizeof why) != NULL) {
            fprintf(stderr, "fuzz_region: mapped a file whose header %s\n", why);
            abort();
        }
        munmap(h, VGPU_REGION_SIZE);
    }
    unlink(path);
    return 0;
}
