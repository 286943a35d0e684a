/* replay.c - runs a fuzz target's LLVMFuzzerTestOneInput on files and directories of inputs, without libFuzzer:
 * the regression inputs in tests/fuzz_regressions and the seed corpus replay in any build (with sanitizers in
 * build-asan). Prints how many inputs ran; a crash or a sanitizer report is the failure. */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size);

static int run_file(const char * path) {
    FILE * f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "cannot open %s\n", path);
        return -1;
    }
    fseek(f, 0, SEEK_END);
    const long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t * buf = malloc(size > 0 ? (size_t) size : 1);
    if (!buf || fread(buf, 1, (size_t) size, f) != (size_t) size) {
        fprintf(stderr, "cannot read %s\n", path);
        fclose(f);
        free(buf);
        return -1;
    }
    fclose(f);
    LLVMFuzzerTestOneInput(buf, (size_t) size);
    free(buf);
    return 1;
}

static int run_path(const char * path) {
    struct stat st;
    if (stat(path, &st) != 0) {
        fprintf(stderr, "no such input: %s\n", path);
        return -1;
    }
    if (!S_ISDIR(st.st_mode)) {
        return run_file(path);
    }
    DIR * d = opendir(path);
    if (!d) {
        return -1;
    }
    int              n = 0;
    struct dirent * de;
    while ((de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.') {
            continue;
        }
        char child[4096];
        snprintf(child, sizeof child, "%s/%s", path, de->d_name);
        const int r = run_path(child);
        if (r < 0) {
            closedir(d);
            return -1;
        }
        n += r;
    }
    closedir(d);
    return n;
}

int main(int argc, char ** argv) {
    int n = 0;
    for (int i = 1; i < argc; i++) {
        const int r = run_path(argv[i]);
        if (r < 0) {
            return 2;
        }
        n += r;
    }
    printf("%d inputs ran\n", n);
    return 0;
}
