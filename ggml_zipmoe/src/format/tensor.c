/* tensor.c - compressed expert tensors: the index of docs/FORMAT.md, parsed and validated before use
 * (it comes from a file, so it is untrusted), expert regions encoded and decoded. */
#include "zipmoe-impl.h"

#include <stdlib.h>

#define INDEX_MAGIC      0x3158444945504D5AULL /* "ZMPEIDX1" */
#define INDEX_VERSION    1
#define INDEX_HEADER     48
#define REGION_ALIGN_MIN 64
#define REGION_ALIGN_MAX 4096
#define SM_ALIGN         64
#define MAX_EXPERTS      (1 << 20)

struct zipmoe_tensor {
    zipmoe_tensor_info info;
    zipmoe_codec_ctx * codec;
    uint64_t           exp_offset;  /* same for every expert: align_up(n_units, 64) for SPLIT16, 0 for BYTES */
    uint64_t *         regions;     /* [n_expert][2]: offset, size */
    uint64_t *         chunks;      /* [n_expert][n_chunks][2]: end, checksum */
};

static int mul_overflows(uint64_t a, uint64_t b, uint64_t * out) {
    return __builtin_mul_overflow(a, b, out);
}

/* The raw plane of one expert: its units for SPLIT16 types (one sign+mantissa byte each), none for BYTES ones. */
static uint64_t plane_size(int32_t layout, uint64_t n_units) { return layout == ZIPMOE_LAYOUT_SPLIT16 ? n_units : 0; }

/* The header's fields (h: its INDEX_HEADER words), validated for a data companion of data_size bytes; *len_out:
 * the length in words the whole index must have; *units_out: the units of one expert (values of SPLIT16 types,
 * bytes of BYTES ones), *layout_out its type's layout. */
static int64_t check_header(const uint64_t * h, uint64_t data_size, uint64_t * len_out, uint64_t * units_out,
                            int32_t * layout_out) {
    if (h[0] != INDEX_MAGIC) {
        return ZIPMOE_ERR_CORRUPT;
    }
    if (h[1] != INDEX_VERSION) {
        return ZIPMOE_ERR_UNSUPPORTED;
    }
    const uint64_t codec = h[2], level = h[3], type = h[4];
    const uint64_t ne0 = h[5], ne1 = h[6], ne2 = h[7], ne3 = h[8];
    const uint64_t n_expert = h[9], n_per = h[10], chunk_n = h[11], n_chunks = h[12];
    if (codec != ZIPMOE_CODEC_ZSTD && codec != ZIPMOE_CODEC_HUFF && codec != ZIPMOE_CODEC_ESC &&
        codec != ZIPMOE_CODEC_RAW) {
        return ZIPMOE_ERR_UNSUPPORTED;
    }
    zipmoe_type_info ti;
    if (type > INT32_MAX || zipmoe_type_layout((int32_t) type, &ti) < 0) {
        return ZIPMOE_ERR_UNSUPPORTED;
    }
    if ((ti.layout == ZIPMOE_LAYOUT_BYTES) != (codec == ZIPMOE_CODEC_RAW)) {
        return ZIPMOE_ERR_CORRUPT; /* each layout has its codecs (zipmoe_codec_create_typed) */
    }
    uint64_t n_check;
    if (ne0 == 0 || ne1 == 0 || ne3 != 1 || ne2 != n_expert || n_expert == 0 || n_expert > MAX_EXPERTS ||
        mul_overflows(ne0, ne1, &n_check) || n_check != n_per || n_per > ((uint64_t) 1 << 48)) {
        return ZIPMOE_ERR_CORRUPT;
    }
    /* units: values, or the bytes of ne1 rows of ne0 / blck blocks (ggml's row size); at most 4 * 2^48 */
    uint64_t units = n_per;
    if (ti.layout == ZIPMOE_LAYOUT_BYTES) {
        if (ne0 % (uint64_t) ti.blck_size != 0) {
            return ZIPMOE_ERR_CORRUPT;
        }
        units = ne0 / (uint64_t) ti.blck_size * (uint64_t) ti.type_size * ne1;
    }
    if (chunk_n == 0 || chunk_n > ZIPMOE_CHUNK_MAX || n_chunks != (units + chunk_n - 1) / chunk_n) {
        return ZIPMOE_ERR_CORRUPT;
    }
    const uint64_t align = h[14]; /* 4096 for page-granular reads; smaller for experts under a page */
    if (h[13] != data_size || align < REGION_ALIGN_MIN || align > REGION_ALIGN_MAX || (align & (align - 1)) || h[15] != 0) {
        return ZIPMOE_ERR_CORRUPT;
    }
    if ((int64_t) level < -(1 << 17) || (int64_t) level > 64 || (codec != ZIPMOE_CODEC_ZSTD && level != 0)) {
        return ZIPMOE_ERR_CORRUPT;
    }
    /* Every region holds at least its sm plane and padding (exp_offset bytes), or for a BYTES type (RAW chunks, each
     * exactly its length) all its bytes, and regions do not overlap, so E * that <= data_size. Checked here, before
     * anything is allocated: an index that declares an absurd tensor (say 2^60 bytes of experts) for a small data
     * companion is refused at once, and every product the runtime forms from these counts (E * N * 2 bytes of
     * decoded memory, E * C chunk entries) is bounded by data_size, which is kept below 2^62. */
    const uint64_t min_region = ti.layout == ZIPMOE_LAYOUT_BYTES ? units : zipmoe_align_up(n_per, SM_ALIGN);
    uint64_t       min_data;
    if (data_size > ((uint64_t) 1 << 62) || mul_overflows(n_expert, min_region, &min_data) || min_data > data_size) {
        return ZIPMOE_ERR_CORRUPT;
    }
    /* index_len = 48 + 2E + 2EC + 1, computed without overflow (E <= 2^20, C <= 2^48) */
    uint64_t ec;
    if (mul_overflows(n_expert, n_chunks, &ec) || mul_overflows(ec, 2, &ec) || ec > ((uint64_t) 1 << 40)) {
        return ZIPMOE_ERR_CORRUPT;
    }
    *len_out    = INDEX_HEADER + 2 * n_expert + ec + 1;
    *units_out  = units;
    *layout_out = ti.layout;
    return ZIPMOE_OK;
}

int64_t zipmoe_tensor_index_size(const void * header, size_t header_size, uint64_t data_size, uint64_t * index_size) {
    if (!header || !index_size) {
        return ZIPMOE_ERR_ARG;
    }
    if (header_size < INDEX_HEADER * 8) {
        return ZIPMOE_ERR_CORRUPT;
    }
    uint64_t h[INDEX_HEADER], len, units;
    int32_t  layout;
    memcpy(h, header, sizeof h);
    const int64_t rc = check_header(h, data_size, &len, &units, &layout);
    if (rc < 0) {
        return rc;
    }
    *index_size = len * 8;
    return ZIPMOE_OK;
}

int64_t zipmoe_tensor_open(const void * index, size_t index_size, uint64_t data_size, zipmoe_tensor ** out) {
    if (!index || !out) {
        return ZIPMOE_ERR_ARG;
    }
    *out = NULL;
    if (index_size % 8 != 0 || index_size / 8 < INDEX_HEADER + 1) {
        return ZIPMOE_ERR_CORRUPT;
    }
    const uint64_t   len = index_size / 8;
    const uint8_t *  raw = (const uint8_t *) index;
    /* copy the header out: the index may be unaligned (it is a view into a file) */
    uint64_t h[INDEX_HEADER];
    memcpy(h, raw, sizeof h);

    if (h[0] != INDEX_MAGIC) {
        return ZIPMOE_ERR_CORRUPT;
    }
    if (h[1] != INDEX_VERSION) {
        return ZIPMOE_ERR_UNSUPPORTED;
    }
    if (zipmoe_checksum(raw, (len - 1) * 8, 0) != zipmoe_load64le(raw + (len - 1) * 8)) {
        return ZIPMOE_ERR_CHECKSUM;
    }
    uint64_t      expect, units;
    int32_t       layout;
    const int64_t hrc = check_header(h, data_size, &expect, &units, &layout);
    if (hrc < 0) {
        return hrc;
    }
    if (len != expect) {
        return ZIPMOE_ERR_CORRUPT;
    }
    const uint64_t codec = h[2], level = h[3], type = h[4];
    const uint64_t ne0 = h[5], ne1 = h[6], ne2 = h[7], ne3 = h[8];
    const uint64_t n_expert = h[9], n_per = h[10], chunk_n = h[11], n_chunks = h[12];
    const uint64_t align = h[14];
    const uint64_t ec    = 2 * n_expert * n_chunks;

    zipmoe_tensor * t = calloc(1, sizeof *t);
    if (!t) {
        return ZIPMOE_ERR_NOMEM;
    }
    t->regions = malloc(2 * n_expert * sizeof(uint64_t));
    t->chunks  = malloc(ec * sizeof(uint64_t) + 1);
    int64_t rc = ZIPMOE_OK;
    if (!t->regions || !t->chunks) {
        rc = ZIPMOE_ERR_NOMEM;
        goto fail;
    }
    memcpy(t->regions, raw + INDEX_HEADER * 8, 2 * n_expert * 8);
    memcpy(t->chunks, raw + (INDEX_HEADER + 2 * n_expert) * 8, ec * 8);

    uint8_t lengths[256];
    memcpy(lengths, &h[16], 256);
    if (codec == ZIPMOE_CODEC_RAW) {
        /* no table: the bytes must be zero, as the format says (nothing unchecked in an index) */
        for (int i = 0; i < 256; i++) {
            if (lengths[i]) {
                rc = ZIPMOE_ERR_CORRUPT;
                goto fail;
            }
        }
    }
    const int table = codec == ZIPMOE_CODEC_HUFF || codec == ZIPMOE_CODEC_ESC;
    rc = zipmoe_codec_create_typed((zipmoe_codec) codec, (int) (int64_t) level, table ? lengths : NULL, (int32_t) type,
                                   &t->codec);
    if (rc < 0) {
        rc = rc == ZIPMOE_ERR_NOMEM ? rc : ZIPMOE_ERR_CORRUPT;
        goto fail;
    }

    t->exp_offset = zipmoe_align_up(plane_size(layout, units), SM_ALIGN);
    const uint64_t last_chunk_n = units - (n_chunks - 1) * chunk_n;
    uint64_t       prev_end     = 0;
    for (uint64_t e = 0; e < n_expert; e++) {
        const uint64_t off = t->regions[2 * e], size = t->regions[2 * e + 1];
        if (off % align || off < prev_end || off > data_size || size > data_size - off || size < t->exp_offset) {
            rc = ZIPMOE_ERR_CORRUPT;
            goto fail;
        }
        prev_end = off + size;
        /* chunk ends: non-decreasing, each chunk within the codec's bound, the last one at the end */
        const uint64_t * ch   = t->chunks + 2 * e * n_chunks;
        uint64_t         prev = 0;
        for (uint64_t c = 0; c < n_chunks; c++) {
            const uint64_t end = ch[2 * c];
            const uint64_t n   = c + 1 < n_chunks ? chunk_n : last_chunk_n;
            /* a RAW chunk is exactly its bytes; any other no larger than its codec's bound */
            if (end < prev || end - prev > zipmoe_chunk_bound(t->codec, n) ||
                (codec == ZIPMOE_CODEC_RAW && end - prev != n)) {
                rc = ZIPMOE_ERR_CORRUPT;
                goto fail;
            }
            prev = end;
        }
        if (prev != size - t->exp_offset) {
            rc = ZIPMOE_ERR_CORRUPT;
            goto fail;
        }
    }

    t->info = (zipmoe_tensor_info){
        .codec        = (int32_t) codec,
        .level        = (int32_t) (int64_t) level,
        .ggml_type    = (int32_t) type,
        .ne           = { (int64_t) ne0, (int64_t) ne1, (int64_t) ne2, (int64_t) ne3 },
        .n_expert     = (int64_t) n_expert,
        .n_per_expert = (int64_t) n_per,
        .chunk_n      = (int64_t) chunk_n,
        .n_chunks     = (int64_t) n_chunks,
        .data_size    = data_size,
        .layout       = layout,
        .n_units      = (int64_t) units,
        .expert_size  = (int64_t) (layout == ZIPMOE_LAYOUT_SPLIT16 ? 2 * n_per : units),
    };
    *out = t;
    return ZIPMOE_OK;

fail:
    zipmoe_tensor_free(t);
    return rc;
}

void zipmoe_tensor_free(zipmoe_tensor * t) {
    if (!t) {
        return;
    }
    zipmoe_codec_free(t->codec);
    free(t->regions);
    free(t->chunks);
    free(t);
}

void zipmoe_tensor_get_info(const zipmoe_tensor * t, zipmoe_tensor_info * info) { *info = t->info; }

const zipmoe_codec_ctx * zipmoe_tensor_codec(const zipmoe_tensor * t) { return t->codec; }

int64_t zipmoe_tensor_expert_span(const zipmoe_tensor * t, int64_t expert, zipmoe_expert_span * span) {
    if (!t || !span || expert < 0 || expert >= t->info.n_expert) {
        return ZIPMOE_ERR_ARG;
    }
    span->offset     = t->regions[2 * expert];
    span->size       = t->regions[2 * expert + 1];
    span->exp_offset = t->exp_offset;
    return ZIPMOE_OK;
}

int64_t zipmoe_tensor_decode_expert(const zipmoe_tensor * t, zipmoe_workspace * ws, int64_t expert,
                                    const void * region, size_t region_size, void * dst, int ith, int nth) {
    if (!t || !ws || !region || !dst || expert < 0 || expert >= t->info.n_expert || nth < 1 || ith < 0 || ith >= nth) {
        return ZIPMOE_ERR_ARG;
    }
    if ((uint64_t) ws->chunk_n < (uint64_t) t->info.chunk_n) {
        return ZIPMOE_ERR_ARG;
    }
    if (region_size < t->regions[2 * expert + 1]) {
        return ZIPMOE_ERR_ARG;
    }
    const uint8_t *  r      = (const uint8_t *) region;
    const uint8_t *  code   = r + t->exp_offset;
    const uint64_t * ch     = t->chunks + 2 * expert * t->info.n_chunks;
    const int64_t    units  = t->info.n_units;
    const int64_t    chunk  = t->info.chunk_n;
    const int        split  = t->info.layout == ZIPMOE_LAYOUT_SPLIT16;
    const size_t     unit   = split ? 2 : 1; /* bytes a unit decodes to */
    int64_t          done   = 0;
    for (int64_t c = ith; c < t->info.n_chunks; c += nth) {
        const uint64_t begin = c ? ch[2 * (c - 1)] : 0;
        const uint64_t end   = ch[2 * c];
        const int64_t  first = c * chunk;
        const int64_t  n     = units - first < chunk ? units - first : chunk;
        const int64_t  rc    = zipmoe_chunk_decode(t->codec, ws, code + begin, end - begin, split ? r + first : NULL,
                                                   (size_t) n, 1, ch[2 * c + 1], (uint8_t *) dst + (size_t) first * unit);
        if (rc < 0) {
            return rc;
        }
        done++;
    }
    return done;
}

void zipmoe_tensor_chunk(const zipmoe_tensor * t, int64_t e, int64_t c, zipmoe_chunk_ref * ref) {
    const uint64_t * ch    = t->chunks + 2 * e * t->info.n_chunks;
    const uint64_t   begin = c ? ch[2 * (c - 1)] : 0;
    ref->code_offset       = t->exp_offset + begin;
    ref->code_size         = ch[2 * c] - begin;
    ref->checksum          = ch[2 * c + 1];
    ref->first             = c * t->info.chunk_n;
    ref->n = t->info.n_units - ref->first < t->info.chunk_n ? t->info.n_units - ref->first : t->info.chunk_n;
}

size_t zipmoe_expert_region_bound(const zipmoe_codec_ctx * c, int64_t n_units, int64_t chunk_n) {
    if (!c || n_units < 0 || chunk_n <= 0) {
        return 0;
    }
    const int64_t n_chunks = (n_units + chunk_n - 1) / chunk_n;
    return zipmoe_align_up(plane_size(c->layout, (uint64_t) n_units), SM_ALIGN) +
           (size_t) n_chunks * zipmoe_chunk_bound(c, (size_t) chunk_n);
}

int64_t zipmoe_expert_encode(const zipmoe_codec_ctx * c, zipmoe_workspace * ws,
                             const void * src, int64_t n_units, int64_t chunk_n,
                             void * region, size_t cap, uint64_t * chunk_ends, uint64_t * checksums) {
    if (!c || !ws || !src || !region || n_units <= 0 || chunk_n <= 0 || (uint64_t) chunk_n > ws->chunk_n ||
        !chunk_ends || !checksums) {
        return ZIPMOE_ERR_ARG;
    }
    if (cap < zipmoe_expert_region_bound(c, n_units, chunk_n)) {
        return ZIPMOE_ERR_DST_TOO_SMALL;
    }
    uint8_t *    r          = (uint8_t *) region;
    const int    split      = c->layout == ZIPMOE_LAYOUT_SPLIT16;
    const size_t plane      = (size_t) plane_size(c->layout, (uint64_t) n_units);
    const size_t exp_offset = zipmoe_align_up(plane, SM_ALIGN);
    memset(r + plane, 0, exp_offset - plane);
    size_t         pos      = exp_offset;
    const int64_t  n_chunks = (n_units + chunk_n - 1) / chunk_n;
    for (int64_t k = 0; k < n_chunks; k++) {
        const int64_t first = k * chunk_n;
        const int64_t n     = n_units - first < chunk_n ? n_units - first : chunk_n;
        int64_t       size;
        if (split) {
            /* the sm bytes go straight to their place in the region; exponents through the scratch */
            zipmoe_split_bf16((const uint16_t *) src + first, (size_t) n, ws->exp, r + first);
            size = zipmoe_encode_exp(c, ws, ws->exp, (size_t) n, r + pos, cap - pos);
        } else {
            size = zipmoe_encode_exp(c, ws, (const uint8_t *) src + first, (size_t) n, r + pos, cap - pos);
        }
        if (size < 0) {
            return size;
        }
        checksums[k] = zipmoe_chunk_checksum(r + pos, (size_t) size, split ? r + first : NULL, split ? (size_t) n : 0);
        pos += (size_t) size;
        chunk_ends[k] = pos - exp_offset;
    }
    return (int64_t) pos;
}
