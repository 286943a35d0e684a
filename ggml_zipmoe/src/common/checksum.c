/* checksum.c - XXH3-64, compiled in from xxhash.h so the library has no run-time dependency on it.
 * The AVX2 build of XXH3 (checksum_avx2.c) runs about twice as fast; chunks are checksummed on
 * every decode, so it is worth the dispatch. */
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "zipmoe-impl.h"
#include "common/cpu.h"

uint64_t zipmoe_checksum(const void * data, size_t size, uint64_t seed) {
#if defined(ZIPMOE_HAVE_AVX2)
    if (zipmoe_cpu_has_avx2()) {
        return zipmoe_checksum_avx2(data, size, seed);
    }
#endif
    return XXH3_64bits_withSeed(data, size, seed);
}
