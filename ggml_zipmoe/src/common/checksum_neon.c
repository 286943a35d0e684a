/* checksum_neon.c - XXH3-64 built with xxhash's NEON kernel (the same function, a faster kernel); called only
 * after a CPU check (cpu.h). checksum.c holds the portable build it is tested against. */
#define XXH_INLINE_ALL
#define XXH_VECTOR XXH_NEON
#include <xxhash.h>

#include "zipmoe-impl.h"

uint64_t zipmoe_checksum_neon(const void * data, size_t size, uint64_t seed) {
    return XXH3_64bits_withSeed(data, size, seed);
}
