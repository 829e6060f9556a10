/* Prototypes of every function in api.def, so libvgpu's definitions and the stubs' are
 * type-checked against one declaration. */
#ifndef VGPU_API_H
#define VGPU_API_H
#include "cuda_min.h"

#define CU_HOOK(name, params, args, base, version, ptds) CUresult name params;
#define CU_CALL(name, params, args, base, version, ptds) CUresult name params;
#define NVML_HOOK(name, params, args) nvmlReturn_t name params;
#define NVML_CALL(name, params, args) nvmlReturn_t name params;
#include "api.def"

#endif
