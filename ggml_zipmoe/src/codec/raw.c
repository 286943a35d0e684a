/* raw.c - the RAW codec: a chunk's code is its bytes. Experts of byte-layout types (F32, quantized blocks) are
 * stored this way: an order-0 coder saves them a few percent at most (docs/FORMAT.md), less than decoding costs. */
#include "zipmoe-impl.h"

size_t zipmoe_raw_bound(size_t n) { return n; }

int64_t zipmoe_raw_encode(const uint8_t * src, size_t n, uint8_t * dst, size_t cap) {
    if (cap < n) {
        return ZIPMOE_ERR_DST_TOO_SMALL;
    }
    if (n) {
        memcpy(dst, src, n);
    }
    return (int64_t) n;
}

int64_t zipmoe_raw_decode(const uint8_t * code, size_t code_size, uint8_t * dst, size_t n) {
    if (code_size != n) {
        return ZIPMOE_ERR_CORRUPT;
    }
    if (n) {
        memcpy(dst, code, n);
    }
    return (int64_t) n;
}
