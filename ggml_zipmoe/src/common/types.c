/* types.c - which ggml types zipmoe stores, and how: the block sizes of ggml's type traits (ggml.c), restated
 * here because the library does not link ggml; tests/native/test_expert_types.py checks them against gguf-py's. */
#include "zipmoe-impl.h"

typedef struct {
    int32_t type, layout, blck, size;
} type_row;

#define SPLIT ZIPMOE_LAYOUT_SPLIT16
#define BYTES ZIPMOE_LAYOUT_BYTES

/* GGML_TYPE_* number, layout, values per block, bytes per block: the types llama.cpp keeps weights in */
static const type_row TYPES[] = {
    { 0, BYTES, 1, 4 },      /* F32 */
    { 1, SPLIT, 1, 2 },      /* F16 */
    { 2, BYTES, 32, 18 },    /* Q4_0 */
    { 3, BYTES, 32, 20 },    /* Q4_1 */
    { 6, BYTES, 32, 22 },    /* Q5_0 */
    { 7, BYTES, 32, 24 },    /* Q5_1 */
    { 8, BYTES, 32, 34 },    /* Q8_0 */
    { 10, BYTES, 256, 84 },  /* Q2_K */
    { 11, BYTES, 256, 110 }, /* Q3_K */
    { 12, BYTES, 256, 144 }, /* Q4_K */
    { 13, BYTES, 256, 176 }, /* Q5_K */
    { 14, BYTES, 256, 210 }, /* Q6_K */
    { 16, BYTES, 256, 66 },  /* IQ2_XXS */
    { 17, BYTES, 256, 74 },  /* IQ2_XS */
    { 18, BYTES, 256, 98 },  /* IQ3_XXS */
    { 19, BYTES, 256, 50 },  /* IQ1_S */
    { 20, BYTES, 32, 18 },   /* IQ4_NL */
    { 21, BYTES, 256, 110 }, /* IQ3_S */
    { 22, BYTES, 256, 82 },  /* IQ2_S */
    { 23, BYTES, 256, 136 }, /* IQ4_XS */
    { 29, BYTES, 256, 56 },  /* IQ1_M */
    { 30, SPLIT, 1, 2 },     /* BF16 */
    { 34, BYTES, 256, 54 },  /* TQ1_0 */
    { 35, BYTES, 256, 66 },  /* TQ2_0 */
    { 39, BYTES, 32, 17 },   /* MXFP4 */
    { 40, BYTES, 64, 36 },   /* NVFP4 */
    { 41, BYTES, 128, 18 },  /* Q1_0 */
};

int64_t zipmoe_type_layout(int32_t ggml_type, zipmoe_type_info * out) {
    if (!out) {
        return ZIPMOE_ERR_ARG;
    }
    for (size_t i = 0; i < sizeof TYPES / sizeof TYPES[0]; i++) {
        if (TYPES[i].type == ggml_type) {
            *out = (zipmoe_type_info){ .layout = TYPES[i].layout, .blck_size = TYPES[i].blck, .type_size = TYPES[i].size };
            return ZIPMOE_OK;
        }
    }
    return ZIPMOE_ERR_UNSUPPORTED;
}
