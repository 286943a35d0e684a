/* size.c - the one parser of byte sizes ("6GiB", "512M", "1.5g", "1000000"), shared by the loader glue
 * (ZIPMOE_MEMORY_BUDGET, ZIPMOE_READ_BUFFER) and, through cffi, by pyzipmoe, so that every layer reads a size the
 * same way. Exact: integer arithmetic, no floating point, so no value is rounded twice and inf, nan or huge
 * numbers cannot reach a float-to-integer conversion. */
#include "zipmoe.h"

#include <stddef.h>

static int is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r'; }
static int is_digit(char c) { return c >= '0' && c <= '9'; }
static char lower(char c) { return c >= 'A' && c <= 'Z' ? (char) (c - 'A' + 'a') : c; }

/* The power of two of a unit (case-insensitive), or -1. All binary: k = 1024, as llama.cpp and Docker read them. */
static int unit_shift(const char * u, size_t n) {
    static const struct {
        const char * name;
        int          shift;
    } units[] = {
        { "", 0 },    { "b", 0 },    { "k", 10 },  { "kb", 10 },  { "kib", 10 }, { "m", 20 },   { "mb", 20 },
        { "mib", 20 }, { "g", 30 },  { "gb", 30 }, { "gib", 30 }, { "t", 40 },   { "tb", 40 },  { "tib", 40 },
    };
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
        size_t j = 0;
        while (j < n && units[i].name[j] && lower(u[j]) == units[i].name[j]) {
            j++;
        }
        if (j == n && units[i].name[j] == 0) {
            return units[i].shift;
        }
    }
    return -1;
}

#define FRACTION_DIGITS 64 /* more fraction digits than this are refused (they could not matter to a size) */

int64_t zipmoe_parse_size(const char * text, uint64_t * out) {
    if (!text || !out) {
        return ZIPMOE_ERR_ARG;
    }
    const char * p = text;
    while (is_space(*p)) {
        p++;
    }
    if (!is_digit(*p)) {
        return ZIPMOE_ERR_ARG; /* no sign, no leading '.', no "inf" or "nan" */
    }
    uint64_t whole = 0;
    for (; is_digit(*p); p++) {
        if (whole > ZIPMOE_SIZE_MAX) {
            return ZIPMOE_ERR_ARG; /* (keeps whole * 10 below UINT64_MAX) */
        }
        whole = whole * 10 + (uint64_t) (*p - '0');
    }
    uint8_t digits[FRACTION_DIGITS];
    size_t  n_digits = 0;
    if (*p == '.') {
        for (p++; is_digit(*p); p++) {
            if (n_digits == FRACTION_DIGITS) {
                return ZIPMOE_ERR_ARG;
            }
            digits[n_digits++] = (uint8_t) (*p - '0');
        }
        if (n_digits == 0) {
            return ZIPMOE_ERR_ARG; /* "1." */
        }
    }
    const char * unit = p;
    while (*p && !is_space(*p)) {
        p++;
    }
    const int shift = unit_shift(unit, (size_t) (p - unit)); /* (an exponent, "1e3", is an unknown unit "e3") */
    while (is_space(*p)) {
        p++;
    }
    if (*p || shift < 0 || whole > (ZIPMOE_SIZE_MAX >> shift)) {
        return ZIPMOE_ERR_ARG;
    }
    /* the fraction's bytes, rounded down: its binary digits, one per doubling of the decimal fraction */
    uint64_t frac = 0;
    for (int b = 0; b < shift && n_digits > 0; b++) {
        unsigned carry = 0;
        for (size_t i = n_digits; i-- > 0;) {
            const unsigned v = digits[i] * 2u + carry;
            digits[i]        = (uint8_t) (v % 10);
            carry            = v / 10;
        }
        frac = frac << 1 | carry;
    }
    const uint64_t bytes = (whole << shift) + frac;
    if (bytes > ZIPMOE_SIZE_MAX) {
        return ZIPMOE_ERR_ARG;
    }
    *out = bytes;
    return ZIPMOE_OK;
}
