/* The region and grant layouts as the C compiler lays them out, for the Python side to compare. */
#include <stdio.h>

#include "region_layout.h"

#define H(f) printf("header.%s %zu\n", #f, offsetof(struct vgpu_region_header, f));
#define S(f) printf("slot.%s %zu\n", #f, offsetof(struct vgpu_region_slot, f));
#define G(f) printf("grant.%s %zu\n", #f, offsetof(struct vgpu_grant, f));

int main(void) {
    VGPU_REGION_HEADER_FIELDS(H)
    VGPU_REGION_SLOT_FIELDS(S)
    VGPU_GRANT_FIELDS(G)
    printf("grant_size %zu\ngrant_magic %llu\ngrant_version %u\ngrant_payload %u\n", sizeof(struct vgpu_grant),
           (unsigned long long)VGPU_GRANT_MAGIC, VGPU_GRANT_VERSION, VGPU_GRANT_PAYLOAD);
    printf("header_size %zu\nslot_size %zu\nregion_size %u\nmagic %llu\nversion %u\n",
           sizeof(struct vgpu_region_header), sizeof(struct vgpu_region_slot), VGPU_REGION_SIZE,
           (unsigned long long)VGPU_REGION_MAGIC, VGPU_REGION_VERSION);
    return 0;
}
