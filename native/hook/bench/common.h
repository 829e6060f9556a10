/* Shared by the bench programs: a monotonic clock in seconds, a driver-call check that prints
 * error=WHAT:RC and exits, and a comparison of doubles for qsort (medians of repeats). */
#ifndef VGPU_BENCH_COMMON_H
#define VGPU_BENCH_COMMON_H
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "api.h"

static inline double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static inline void check(CUresult rc, const char *what) {
    if (rc != CUDA_SUCCESS) {
        printf("error=%s:%d\n", what, rc);
        exit(1);
    }
}

static inline int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
#endif
