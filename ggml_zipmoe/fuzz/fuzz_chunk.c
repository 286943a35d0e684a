/* fuzz_chunk.c - the chunk decoders (huff, zstd and esc) on arbitrary input, with the checksum check off and with a
 * checksum forged to match (an attacker who writes the file can forge any checksum, so the decoders must be
 * safe on their own).
 *
 * Input: [mode: 1][n: 3, LE][code table: 256][sm: n bytes][code: the rest]
 *   mode bit 0: codec (0 huff, 1 zstd); bit 1: decode with a forged checksum (else unchecked); bit 2: esc instead,
 *   its classes made valid from the table (each byte % 11, a class kept only where it first appears), and the
 *   dispatched decoder's result held to every level's this CPU has (the portable one's too).
 * Outputs go to buffers of exactly the decoded size, so AddressSanitizer sees any write past them. */
#include "zipmoe.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define HEADER     (1 + 3 + 256)
#define MAX_VALUES (1 << 18)

int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    if (size < HEADER) {
        return 0;
    }
    const int    mode = data[0];
    size_t       n    = ((size_t) data[1] | (size_t) data[2] << 8 | (size_t) data[3] << 16) % (MAX_VALUES + 1);
    const size_t rest = size - HEADER;
    if (n > rest) {
        n = rest;
    }
    const uint8_t * lengths   = data + 4;
    const uint8_t * sm        = data + HEADER;
    const uint8_t * code      = sm + n;
    const size_t    code_size = rest - n;

    zipmoe_codec_ctx * c   = NULL;
    const int          zs  = mode & 1;
    const int          esc = (mode >> 2) & 1;
    uint8_t            classes[256];
    if (esc) {
        unsigned seen = 0;
        for (int s = 0; s < 256; s++) {
            const unsigned k = lengths[s] % 11;
            classes[s]       = k && !(seen >> k & 1) ? (uint8_t) k : 0;
            seen |= 1u << k;
        }
    }
    const zipmoe_codec codec = esc ? ZIPMOE_CODEC_ESC : zs ? ZIPMOE_CODEC_ZSTD : ZIPMOE_CODEC_HUFF;
    if (zipmoe_codec_create(codec, esc ? 0 : 1, esc ? classes : lengths, &c) < 0) {
        return 0; /* lengths that are no complete prefix code: refused, as they must be */
    }
    zipmoe_workspace * ws = zipmoe_workspace_create(n ? n : 1);
    /* copies of exactly their size: a read past either is a sanitizer error */
    uint8_t *  code_copy = malloc(code_size ? code_size : 1);
    uint8_t *  exp       = malloc(n ? n : 1);
    uint16_t * dst       = malloc(n ? 2 * n : 2);
    if (ws && code_copy && exp && dst) {
        memcpy(code_copy, code, code_size);
        const int64_t rc = zipmoe_chunk_decode_exponents(c, ws, code_copy, code_size, exp, n);
        uint8_t * ref = esc ? malloc(n ? n : 1) : NULL;
        for (int level = 0; ref && level <= zipmoe_esc_simd_level(); level += 2) { /* each against the dispatched one */
            const int64_t rc_level = zipmoe_esc_decode_chunk_at(c, level, code_copy, code_size, ref, n);
            if (rc != rc_level || (rc >= 0 && memcmp(exp, ref, n) != 0)) {
                fprintf(stderr, "esc: the dispatched decoder (%lld) and level %d's (%lld) disagree\n", (long long) rc,
                        level, (long long) rc_level);
                abort();
            }
        }
        free(ref);
        const int      check    = (mode >> 1) & 1;
        const uint64_t checksum = check ? zipmoe_checksum(sm, n, zipmoe_checksum(code_copy, code_size, 0)) : 0;
        zipmoe_chunk_decode(c, ws, code_copy, code_size, sm, n, check, checksum, dst);
    }
    free(code_copy);
    free(exp);
    free(dst);
    zipmoe_workspace_free(ws);
    zipmoe_codec_free(c);
    return 0;
}
