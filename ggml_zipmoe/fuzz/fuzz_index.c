/* fuzz_index.c - the expert index parser (zipmoe_tensor_open) and expert decoding (zipmoe_tensor_decode_expert)
 * on arbitrary input, with the index checksum and the chunk checksums forged to match (a hostile file forges
 * them), so that the fuzzer reaches every validation and the decoders behind them.
 *
 * Input: [mode: 1][index size: 4, LE][index][data companion: the rest]
 *   mode bit 0: forge the index checksum; bit 1: forge the chunk checksums too.
 * Each expert's region is copied into a buffer of exactly its size and decoded into a buffer of exactly one
 * expert, so AddressSanitizer sees any read or write outside them. */
#include "zipmoe.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INDEX_HEADER 48

static uint64_t load64(const uint8_t * p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static void store64(uint8_t * p, uint64_t v) { memcpy(p, &v, 8); }

static void forge_index_checksum(uint8_t * index, size_t size) {
    if (size >= 8 && size % 8 == 0) {
        store64(index + size - 8, zipmoe_checksum(index, size - 8, 0));
    }
}

int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    if (size < 5) {
        return 0;
    }
    const int mode       = data[0];
    size_t    index_size = (size_t) data[1] | (size_t) data[2] << 8 | (size_t) data[3] << 16 | (size_t) data[4] << 24;
    if (index_size > size - 5) {
        index_size = size - 5;
    }
    const size_t data_size = size - 5 - index_size;
    uint8_t *    index     = malloc(index_size ? index_size : 1);
    uint8_t *    companion = malloc(data_size ? data_size : 1);
    if (!index || !companion) {
        free(index);
        free(companion);
        return 0;
    }
    memcpy(index, data + 5, index_size);
    memcpy(companion, data + 5 + index_size, data_size);
    if (mode & 1) {
        forge_index_checksum(index, index_size);
    }
    zipmoe_tensor * t = NULL;
    if (zipmoe_tensor_open(index, index_size, data_size, &t) < 0) {
        goto done;
    }
    zipmoe_tensor_info info;
    zipmoe_tensor_get_info(t, &info);
    if (mode & 2) {
        /* rewrite every chunk checksum to match the data, then reopen */
        const uint8_t * chunk_table = index + (INDEX_HEADER + 2 * (size_t) info.n_expert) * 8;
        for (int64_t e = 0; e < info.n_expert; e++) {
            zipmoe_expert_span span;
            zipmoe_tensor_expert_span(t, e, &span);
            const uint8_t * region = companion + span.offset;
            uint64_t        begin  = 0;
            for (int64_t c = 0; c < info.n_chunks; c++) {
                uint8_t *      pair  = (uint8_t *) chunk_table + ((size_t) (e * info.n_chunks + c)) * 16;
                const uint64_t end   = load64(pair);
                const int64_t  first = c * info.chunk_n;
                const int64_t  n     = info.n_units - first < info.chunk_n ? info.n_units - first : info.chunk_n;
                /* a bytes-layout chunk has no raw plane: the outer hash runs over no bytes */
                const size_t   plane = info.layout == ZIPMOE_LAYOUT_SPLIT16 ? (size_t) n : 0;
                store64(pair + 8, zipmoe_checksum(region + first, plane,
                                                  zipmoe_checksum(region + span.exp_offset + begin, end - begin, 0)));
                begin = end;
            }
        }
        forge_index_checksum(index, index_size);
        zipmoe_tensor_free(t);
        t = NULL;
        if (zipmoe_tensor_open(index, index_size, data_size, &t) < 0) {
            goto done; /* cannot happen: only checksums changed */
        }
    }
    zipmoe_workspace * ws = zipmoe_workspace_create((size_t) info.chunk_n);
    uint8_t *          dst = malloc((size_t) info.expert_size);
    for (int64_t e = 0; ws && dst && e < info.n_expert; e++) {
        zipmoe_expert_span span;
        zipmoe_tensor_expert_span(t, e, &span);
        uint8_t * region = malloc(span.size ? span.size : 1);
        if (!region) {
            break;
        }
        memcpy(region, companion + span.offset, span.size);
        zipmoe_tensor_decode_expert(t, ws, e, region, span.size, dst, 0, 1);
        zipmoe_tensor_decode_expert(t, ws, e, region, span.size, dst, 1, 2);
        free(region);
    }
    free(dst);
    zipmoe_workspace_free(ws);
done:
    zipmoe_tensor_free(t);
    free(index);
    free(companion);
    return 0;
}
