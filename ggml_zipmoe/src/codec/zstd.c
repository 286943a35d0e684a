/* zstd.c - the paper's codec: one zstd frame per chunk of exponent bytes. */
#include "zipmoe-impl.h"

#include <zstd.h>
#include <zstd_errors.h>

size_t zipmoe_zstd_bound(size_t n) { return ZSTD_compressBound(n); }

void * zipmoe_zstd_dctx_create(void) { return ZSTD_createDCtx(); }
void   zipmoe_zstd_dctx_free(void * dctx) { ZSTD_freeDCtx((ZSTD_DCtx *) dctx); }
void   zipmoe_zstd_cctx_free(void * cctx) { ZSTD_freeCCtx((ZSTD_CCtx *) cctx); }

int64_t zipmoe_zstd_encode(zipmoe_workspace * ws, int level, const uint8_t * exp, size_t n, uint8_t * dst, size_t cap) {
    if (!ws->zstd_c) {
        ws->zstd_c = ZSTD_createCCtx();
        if (!ws->zstd_c) {
            return ZIPMOE_ERR_NOMEM;
        }
    }
    const size_t size = ZSTD_compressCCtx((ZSTD_CCtx *) ws->zstd_c, dst, cap, exp, n, level);
    if (ZSTD_isError(size)) {
        return ZSTD_getErrorCode(size) == ZSTD_error_dstSize_tooSmall ? ZIPMOE_ERR_DST_TOO_SMALL : ZIPMOE_ERR_CODEC;
    }
    return (int64_t) size;
}

int64_t zipmoe_zstd_decode(zipmoe_workspace * ws, const uint8_t * code, size_t code_size, uint8_t * exp, size_t n) {
    if (!ws->zstd_d) {
        return ZIPMOE_ERR_ARG;
    }
    /* zstd never writes past `n`; a frame that claims more is an error, not a truncation */
    const size_t size = ZSTD_decompressDCtx((ZSTD_DCtx *) ws->zstd_d, exp, n, code, code_size);
    if (ZSTD_isError(size) || size != n) {
        return ZIPMOE_ERR_CORRUPT;
    }
    return (int64_t) size;
}
