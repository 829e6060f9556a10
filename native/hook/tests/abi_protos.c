/* Every prototype in api.def redeclared next to the real cuda.h/nvml.h: a mismatch is a
 * "conflicting types" error. The internal-version switch keeps cuda.h from renaming
 * cuGetProcAddress & co. to their _v2 forms (and nvml.h its functions to their newest versions),
 * so the unversioned prototypes are declared too. */
#define __CUDA_API_VERSION_INTERNAL 1
#define NVML_NO_UNVERSIONED_FUNC_DEFS 1
#include <cuda.h>
#include <nvml.h>

#define CU_HOOK(name, params, args, base, version, ptds) CUresult CUDAAPI name params;
#define CU_CALL CU_HOOK
#define NVML_HOOK(name, params, args) nvmlReturn_t DECLDIR name params;
#define NVML_CALL NVML_HOOK
#include "api.def"
