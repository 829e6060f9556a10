/* What a process sees of its device: the driver's and NVML's memory figures and process list.
 * usage: t_info MODE ALLOC_MIB */
#include "common.h"

int main(int argc, char **argv) {
    if (argc < 3) die("usage: t_info MODE ALLOC_MIB", 0);
    setup(argv[1]);
    CUdevice dev = open_device(0);
    size_t mib = (size_t)strtoull(argv[2], NULL, 10);
    CUdeviceptr p = 0;
    if (mib) printf("alloc=%d\n", R(cuMemAlloc_v2, "cuMemAlloc")(&p, mib << 20));
    size_t free_b = 0, total = 0, dtotal = 0;
    printf("meminfo_rc=%d\n", R(cuMemGetInfo_v2, "cuMemGetInfo")(&free_b, &total));
    printf("cu_free=%zu\ncu_total=%zu\n", free_b, total);
    printf("totalmem_rc=%d\n", R(cuDeviceTotalMem_v2, "cuDeviceTotalMem")(&dtotal, dev));
    printf("cu_device_total=%zu\n", dtotal);

    void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!nvml) die("dlopen libnvidia-ml.so.1", 0);
#define N(name) ((__typeof__(&name))dlsym(nvml, #name))
    N(nvmlInit_v2)();
    nvmlDevice_t d;
    N(nvmlDeviceGetHandleByIndex_v2)(0, &d);
    nvmlMemory_t m1;
    printf("nvml_rc=%d\n", N(nvmlDeviceGetMemoryInfo)(d, &m1));
    printf("nvml_total=%llu\nnvml_used=%llu\nnvml_free=%llu\n", m1.total, m1.used, m1.free);
    nvmlMemory_v2_t m2;
    memset(&m2, 0, sizeof m2);
    m2.version = nvmlMemory_v2;
    printf("nvml2_rc=%d\n", N(nvmlDeviceGetMemoryInfo_v2)(d, &m2));
    printf("nvml2_total=%llu\nnvml2_used=%llu\nnvml2_free=%llu\n", m2.total, m2.used, m2.free);
    unsigned int count = 0;
    nvmlReturn_t rc = N(nvmlDeviceGetComputeRunningProcesses_v3)(d, &count, NULL);
    printf("procs_query_rc=%d\nprocs_needed=%u\n", rc, count);
    nvmlProcessInfo_t infos[64];
    count = 64;
    rc = N(nvmlDeviceGetComputeRunningProcesses_v3)(d, &count, infos);
    printf("procs_rc=%d\nprocs=%u\n", rc, count);
    for (unsigned int i = 0; i < count && i < 64; i++) printf("proc=%u:%llu\n", infos[i].pid, infos[i].usedGpuMemory);
    nvmlProcessInfo_v1_t v1[64];
    count = 64;
    rc = N(nvmlDeviceGetComputeRunningProcesses)(d, &count, v1);
    printf("procs_v1_rc=%d\nprocs_v1=%u\n", rc, count);
    for (unsigned int i = 0; i < count && i < 64; i++) printf("proc_v1=%u:%llu\n", v1[i].pid, v1[i].usedGpuMemory);
    printf("pid=%d\n", (int)getpid());
    return 0;
}
