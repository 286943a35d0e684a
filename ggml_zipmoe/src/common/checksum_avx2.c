/* checksum_avx2.c - XXH3-64 built for AVX2 (the same function, a faster kernel). */
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "zipmoe-impl.h"

uint64_t zipmoe_checksum_avx2(const void * data, size_t size, uint64_t seed) {
    return XXH3_64bits_withSeed(data, size, seed);
}
