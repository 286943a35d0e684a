/* codec.c - codec instances, per-thread workspaces, and the chunk: checksum + code-plane codec + merge. */
#include "zipmoe-impl.h"

#include <stdlib.h>

#define GGML_TYPE_BF16 30

int64_t zipmoe_codec_create(zipmoe_codec codec, int level, const uint8_t lengths[256], zipmoe_codec_ctx ** out) {
    return zipmoe_codec_create_typed(codec, level, lengths, GGML_TYPE_BF16, out);
}

int64_t zipmoe_codec_create_typed(zipmoe_codec codec, int level, const uint8_t lengths[256], int32_t ggml_type,
                                  zipmoe_codec_ctx ** out) {
    if (!out) {
        return ZIPMOE_ERR_ARG;
    }
    *out = NULL;
    zipmoe_type_info ti;
    if (zipmoe_type_layout(ggml_type, &ti) < 0) {
        return ZIPMOE_ERR_UNSUPPORTED;
    }
    /* entropy coders for split values; the bytes of quantized blocks are stored (FORMAT.md says why) */
    const int split_codec = codec == ZIPMOE_CODEC_ZSTD || codec == ZIPMOE_CODEC_HUFF || codec == ZIPMOE_CODEC_ESC;
    if (ti.layout == ZIPMOE_LAYOUT_SPLIT16 ? !split_codec : codec != ZIPMOE_CODEC_RAW) {
        return ZIPMOE_ERR_UNSUPPORTED;
    }
    if ((codec == ZIPMOE_CODEC_HUFF || codec == ZIPMOE_CODEC_ESC) && !lengths) {
        return ZIPMOE_ERR_ARG;
    }
    zipmoe_codec_ctx * c = calloc(1, sizeof *c);
    if (!c) {
        return ZIPMOE_ERR_NOMEM;
    }
    c->codec     = codec;
    c->level     = codec == ZIPMOE_CODEC_ZSTD ? level : 0;
    c->ggml_type = ggml_type;
    c->layout    = ti.layout;
    if (codec == ZIPMOE_CODEC_HUFF) {
        const int64_t rc = zipmoe_huff_init(&c->huff, lengths);
        if (rc < 0) {
            free(c);
            return rc;
        }
    }
    if (codec == ZIPMOE_CODEC_ESC) {
        const int64_t rc = zipmoe_esc_init(&c->esc, lengths);
        if (rc < 0) {
            free(c);
            return rc;
        }
    }
    *out = c;
    return ZIPMOE_OK;
}

void zipmoe_codec_free(zipmoe_codec_ctx * c) { free(c); }

zipmoe_workspace * zipmoe_workspace_create(size_t chunk_n) {
    if (chunk_n == 0 || chunk_n > ZIPMOE_CHUNK_MAX) {
        return NULL;
    }
    zipmoe_workspace * ws = calloc(1, sizeof *ws);
    if (!ws) {
        return NULL;
    }
    ws->chunk_n = chunk_n;
    ws->exp     = malloc(chunk_n + ZIPMOE_SCRATCH_SLACK);
    ws->sm      = malloc(chunk_n);
    ws->zstd_d  = zipmoe_zstd_dctx_create();
    if (!ws->exp || !ws->sm || !ws->zstd_d) {
        zipmoe_workspace_free(ws);
        return NULL;
    }
    return ws;
}

void zipmoe_workspace_free(zipmoe_workspace * ws) {
    if (!ws) {
        return;
    }
    free(ws->exp);
    free(ws->sm);
    if (ws->zstd_d) {
        zipmoe_zstd_dctx_free(ws->zstd_d);
    }
    if (ws->zstd_c) {
        zipmoe_zstd_cctx_free(ws->zstd_c);
    }
    free(ws);
}

size_t zipmoe_chunk_bound(const zipmoe_codec_ctx * c, size_t n) {
    return c->codec == ZIPMOE_CODEC_HUFF ? zipmoe_huff_bound(n)
         : c->codec == ZIPMOE_CODEC_ESC  ? zipmoe_esc_bound(n)
         : c->codec == ZIPMOE_CODEC_RAW  ? zipmoe_raw_bound(n)
                                         : zipmoe_zstd_bound(n);
}

uint64_t zipmoe_chunk_checksum(const void * code, size_t code_size, const uint8_t * sm, size_t n) {
    /* a BYTES chunk has no raw plane: the second hash then runs over no bytes (sm may be NULL) */
    return zipmoe_checksum(n ? (const void *) sm : code, n, zipmoe_checksum(code, code_size, 0));
}

int64_t zipmoe_encode_exp(const zipmoe_codec_ctx * c, zipmoe_workspace * ws, const uint8_t * exp, size_t n, void * dst, size_t cap) {
    if (c->codec == ZIPMOE_CODEC_HUFF) {
        return zipmoe_huff_encode(&c->huff, exp, n, (uint8_t *) dst, cap);
    }
    if (c->codec == ZIPMOE_CODEC_ESC) {
        return zipmoe_esc_encode(&c->esc, exp, n, (uint8_t *) dst, cap);
    }
    if (c->codec == ZIPMOE_CODEC_RAW) {
        return zipmoe_raw_encode(exp, n, (uint8_t *) dst, cap);
    }
    return zipmoe_zstd_encode(ws, c->level, exp, n, (uint8_t *) dst, cap);
}

int64_t zipmoe_chunk_encode(const zipmoe_codec_ctx * c, zipmoe_workspace * ws,
                            const void * src, size_t n, void * dst, size_t cap) {
    if (!c || !ws || (!src && n) || !dst) {
        return ZIPMOE_ERR_ARG;
    }
    if (n > ws->chunk_n) {
        return ZIPMOE_ERR_ARG;
    }
    if (c->layout == ZIPMOE_LAYOUT_BYTES) {
        return zipmoe_encode_exp(c, ws, (const uint8_t *) src, n, dst, cap);
    }
    zipmoe_split_bf16((const uint16_t *) src, n, ws->exp, ws->sm);
    return zipmoe_encode_exp(c, ws, ws->exp, n, dst, cap);
}

int64_t zipmoe_decode_exp(const zipmoe_codec_ctx * c, zipmoe_workspace * ws, const void * code, size_t code_size,
                          uint8_t * exp, size_t n, const void * warm, size_t warm_size) {
    switch (c->codec) {
    case ZIPMOE_CODEC_HUFF:
        return zipmoe_huff_decode(&c->huff, (const uint8_t *) code, code_size, exp, n, warm, warm_size);
    case ZIPMOE_CODEC_ESC:
        return zipmoe_esc_decode(&c->esc, (const uint8_t *) code, code_size, exp, n, (const uint8_t *) warm, warm_size);
    case ZIPMOE_CODEC_RAW:
        return zipmoe_raw_decode((const uint8_t *) code, code_size, exp, n);
    default:
        return zipmoe_zstd_decode(ws, (const uint8_t *) code, code_size, exp, n);
    }
}

int64_t zipmoe_esc_decode_chunk_at(const zipmoe_codec_ctx * c, int level, const void * code, size_t code_size,
                                   uint8_t * exp, size_t n) {
    if (!c || c->codec != ZIPMOE_CODEC_ESC || !code || (!exp && n) || level < 0) {
        return ZIPMOE_ERR_ARG;
    }
    return zipmoe_esc_decode_at(&c->esc, level, (const uint8_t *) code, code_size, exp, n, NULL, 0);
}

int64_t zipmoe_chunk_decode_exponents(const zipmoe_codec_ctx * c, zipmoe_workspace * ws,
                                      const void * code, size_t code_size, uint8_t * exp, size_t n) {
    if (!c || !ws || !code || (!exp && n)) {
        return ZIPMOE_ERR_ARG;
    }
    return zipmoe_decode_exp(c, ws, code, code_size, exp, n, NULL, 0);
}

int64_t zipmoe_chunk_decode(const zipmoe_codec_ctx * c, zipmoe_workspace * ws,
                            const void * code, size_t code_size, const uint8_t * sm, size_t n,
                            int checksum_check, uint64_t checksum, void * dst) {
    const int bytes = c && c->layout == ZIPMOE_LAYOUT_BYTES;
    if (!c || !ws || !code || (!sm && n && !bytes) || (!dst && n)) {
        return ZIPMOE_ERR_ARG;
    }
    if (n > ws->chunk_n) {
        return ZIPMOE_ERR_ARG;
    }
    if (checksum_check && zipmoe_chunk_checksum(code, code_size, bytes ? NULL : sm, bytes ? 0 : n) != checksum) {
        return ZIPMOE_ERR_CHECKSUM;
    }
    if (bytes) {
        return zipmoe_decode_exp(c, ws, code, code_size, (uint8_t *) dst, n, NULL, 0);
    }
    const int64_t rc = zipmoe_decode_exp(c, ws, code, code_size, ws->exp, n, sm, n);
    if (rc < 0) {
        return rc;
    }
    zipmoe_merge_bf16(ws->exp, sm, n, (uint16_t *) dst);
    return (int64_t) n;
}
