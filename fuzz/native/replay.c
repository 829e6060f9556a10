/* Runs a libFuzzer harness over files, without libFuzzer: what tests/unit/test_fuzz_regressions.py
 * builds with gcc (and ASan/UBSan) to replay fuzz/regressions/ and the seeds. Exit 0 when every
 * input passed; a failed property aborts, as under the fuzzer. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int main(int argc, char **argv) {
    LLVMFuzzerInitialize(&argc, &argv);
    for (int i = 1; i < argc; i++) {
        FILE *f = fopen(argv[i], "rb");
        if (!f) { perror(argv[i]); return 2; }
        static uint8_t buf[1 << 20];
        size_t n = fread(buf, 1, sizeof buf, f);
        fclose(f);
        uint8_t *copy = malloc(n ? n : 1); /* a heap copy of its exact size: ASan sees an overread */
        if (!copy) return 2;
        for (size_t k = 0; k < n; k++) copy[k] = buf[k];
        LLVMFuzzerTestOneInput(copy, n);
        free(copy);
        printf("replayed %s\n", argv[i]);
    }
    return 0;
}
