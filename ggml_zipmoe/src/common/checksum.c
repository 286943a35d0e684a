/* checksum.c - XXH3-64, compiled in from xxhash.h so the library has no run-time dependency on it.
 * The AVX2 build of XXH3 (checksum_avx2.c) runs about twice as fast; chunks are checksummed on
 * every decode, so it is worth the dispatch. On AArch64 xxhash would pick NEON by itself: this file's build is
 * kept portable there, so that the NEON one (checksum_neon.c) runs only after a CPU check and has an oracle. */
#define XXH_INLINE_ALL
#if defined(__aarch64__)
#    define XXH_VECTOR XXH_SCALAR
#endif
#include <xxhash.h>

#include "zipmoe-impl.h"
#include "common/cpu.h"

uint64_t zipmoe_checksum(const void * data, size_t size, uint64_t seed) {
#if defined(ZIPMOE_HAVE_AVX2)
    if (zipmoe_cpu_has_avx2()) {
        return zipmoe_checksum_avx2(data, size, seed);
    }
#endif
#if defined(ZIPMOE_HAVE_NEON)
    if (zipmoe_cpu_has_neon()) {
        return zipmoe_checksum_neon(data, size, seed);
    }
#endif
    return XXH3_64bits_withSeed(data, size, seed);
}

uint64_t zipmoe_checksum_portable(const void * data, size_t size, uint64_t seed) {
    return XXH3_64bits_withSeed(data, size, seed);
}
