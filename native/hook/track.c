/* What this process allocated through libvgpu (pointer, VMM handle or array -> size and
 * device), so that a free uncharges exactly what was charged and a free of anything else
 * passes through untouched. Open addressing; live plus deleted slots stay under half the table. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "hook.h"

struct slot {
    uint64_t key;
    uint64_t size;
    uint64_t aux; /* VGPU_KIND_SPILL: the host pointer to give back */
    int32_t idx;
    uint8_t kind; /* 0 empty; 0xff deleted */
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct slot *slots;
static size_t cap, used_slots, deleted;

static size_t hash(int kind, uint64_t key) {
    uint64_t x = key ^ ((uint64_t)kind << 56);
    x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27; x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return (size_t)x;
}

static void put(struct slot *tab, size_t n, int kind, uint64_t key, uint64_t size, uint64_t aux, int idx) {
    size_t i = hash(kind, key) & (n - 1);
    while (tab[i].kind != 0 && tab[i].kind != 0xff) i = (i + 1) & (n - 1);
    tab[i] = (struct slot){key, size, aux, idx, (uint8_t)kind};
}

/* Rebuilds the table without its deleted slots, twice as large when it is half full of live ones. */
static int rebuild(void) {
    size_t n = cap ? ((used_slots + 1) * 4 > cap ? cap * 2 : cap) : 1024;
    struct slot *tab = calloc(n, sizeof *tab);
    if (!tab) return -1;
    for (size_t i = 0; i < cap; i++)
        if (slots[i].kind != 0 && slots[i].kind != 0xff)
            put(tab, n, slots[i].kind, slots[i].key, slots[i].size, slots[i].aux, slots[i].idx);
    free(slots);
    slots = tab;
    cap = n;
    deleted = 0;
    return 0;
}

void vgpu_track_add(int kind, uint64_t key, uint64_t size, int idx) { vgpu_track_add_aux(kind, key, size, 0, idx); }

void vgpu_track_add_aux(int kind, uint64_t key, uint64_t size, uint64_t aux, int idx) {
    pthread_mutex_lock(&mu);
    if ((used_slots + deleted + 1) * 2 > cap && rebuild() != 0) {
        pthread_mutex_unlock(&mu);
        return;
    }
    put(slots, cap, kind, key, size, aux, idx);
    used_slots++;
    pthread_mutex_unlock(&mu);
}

int vgpu_track_take(int kind, uint64_t key, uint64_t *size, int *idx) {
    uint64_t aux;
    return vgpu_track_take_aux(kind, key, size, &aux, idx);
}

int vgpu_track_take_aux(int kind, uint64_t key, uint64_t *size, uint64_t *aux, int *idx) {
    int found = 0;
    pthread_mutex_lock(&mu);
    if (cap) {
        size_t i = hash(kind, key) & (cap - 1);
        while (slots[i].kind != 0) {
            if (slots[i].kind == kind && slots[i].key == key) {
                *size = slots[i].size;
                *aux = slots[i].aux;
                *idx = slots[i].idx;
                slots[i].kind = 0xff;
                used_slots--;
                deleted++; /* still costs probes until rebuild() sweeps it */
                found = 1;
                break;
            }
            i = (i + 1) & (cap - 1);
        }
    }
    pthread_mutex_unlock(&mu);
    return found;
}

void vgpu_track_reset(void) {
    pthread_mutex_init(&mu, NULL);
    if (slots) memset(slots, 0, cap * sizeof *slots);
    used_slots = 0;
    deleted = 0;
}
