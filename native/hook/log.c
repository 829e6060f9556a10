/* Logging: VGPU_LOG_LEVEL = off | error | warn (default) | info | debug. Policed calls log only
 * at debug; warn carries the one-off problems a user must see (a bad limit, a foreign region). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "hook.h"

int vgpu_log_level = VGPU_LOG_WARN;

#ifndef VGPU_HOOK_VERSION
#define VGPU_HOOK_VERSION "dev"
#endif
/* The build's version (make HOOK_VERSION=...; tools/images.sh passes the image's tag): in the
 * library's bytes, so two builds differ in content and the plugin installs them apart, and in
 * the first line the hook logs at info. */
static const char hook_version[] __attribute__((used)) = "libvgpu.so version " VGPU_HOOK_VERSION;

void vgpu_log_init(void) {
    static int done;
    if (done) return;
    done = 1;
    const char *v = getenv("VGPU_LOG_LEVEL");
    if (!v || !*v) return;
    static const char *names[] = {"off", "error", "warn", "info", "debug"};
    for (int i = 0; i < 5; i++)
        if (strcmp(v, names[i]) == 0) vgpu_log_level = i;
    VGPU_LOG(VGPU_LOG_INFO, "%s", hook_version);
}

void vgpu_log(int level, const char *fmt, ...) {
    static const char *tags[] = {"", "error", "warn", "info", "debug"};
    char line[1024];
    int n = snprintf(line, sizeof line, "vgpu[%d] %s: ", (int)getpid(), tags[level]);
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && n < (int)sizeof line) n += vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if (n > (int)sizeof line - 2) n = (int)sizeof line - 2;
    line[n++] = '\n';
    ssize_t w = write(STDERR_FILENO, line, (size_t)n);
    (void)w;
}
