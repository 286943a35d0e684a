/* size.c - the one parser of byte sizes ("6GiB", "512M", "1.5g", "1000000") and budgets ("60%", "auto"), shared by the loader glue
 * (ZIPMOE_MEMORY_BUDGET, ZIPMOE_READ_BUFFER) and, through cffi, by pyzipmoe, so that every layer reads a size the
 * same way. Exact: integer arithmetic, no floating point, so no value is rounded twice and inf, nan or huge
 * numbers cannot reach a float-to-integer conversion. And the native messages' writer of sizes (zipmoe_size_text),
 * whose one decimal is for people only. */
#include "zipmoe.h"

#include <stddef.h>
#include <stdio.h>

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

/* A decimal number as written: its whole part and its fraction's digits. */
typedef struct {
    uint64_t whole;
    uint8_t  digits[FRACTION_DIGITS];
    size_t   n_digits;
} decimal;

/* Reads digits, optionally '.' and digits, from p (no sign, no leading '.', no "inf" or "nan"); the end, or NULL. */
static const char * read_decimal(const char * p, decimal * d) {
    if (!is_digit(*p)) {
        return NULL;
    }
    d->whole    = 0;
    d->n_digits = 0;
    for (; is_digit(*p); p++) {
        if (d->whole > ZIPMOE_SIZE_MAX) {
            return NULL; /* (keeps whole * 10 below UINT64_MAX) */
        }
        d->whole = d->whole * 10 + (uint64_t) (*p - '0');
    }
    if (*p == '.') {
        for (p++; is_digit(*p); p++) {
            if (d->n_digits == FRACTION_DIGITS) {
                return NULL;
            }
            d->digits[d->n_digits++] = (uint8_t) (*p - '0');
        }
        if (d->n_digits == 0) {
            return NULL; /* "1." */
        }
    }
    return p;
}

static const char * skip_space(const char * p) {
    while (is_space(*p)) {
        p++;
    }
    return p;
}

/* d << shift, the fraction's bytes rounded down (its binary digits, one per doubling of the decimal fraction);
 * ZIPMOE_ERR_ARG above ZIPMOE_SIZE_MAX. d's digits are consumed. */
static int64_t scale(decimal * d, int shift, uint64_t * out) {
    if (d->whole > (ZIPMOE_SIZE_MAX >> shift)) {
        return ZIPMOE_ERR_ARG;
    }
    uint64_t frac = 0;
    for (int b = 0; b < shift && d->n_digits > 0; b++) {
        unsigned carry = 0;
        for (size_t i = d->n_digits; i-- > 0;) {
            const unsigned v = d->digits[i] * 2u + carry;
            d->digits[i]     = (uint8_t) (v % 10);
            carry            = v / 10;
        }
        frac = frac << 1 | carry;
    }
    const uint64_t bytes = (d->whole << shift) + frac;
    if (bytes > ZIPMOE_SIZE_MAX) {
        return ZIPMOE_ERR_ARG;
    }
    *out = bytes;
    return ZIPMOE_OK;
}

/* The unit after a number (optionally after white space), up to white space or the end: its shift, or -1. */
static int read_unit(const char ** pp) {
    const char * unit = skip_space(*pp);
    const char * p    = unit;
    while (*p && !is_space(*p)) {
        p++;
    }
    *pp = p;
    return unit_shift(unit, (size_t) (p - unit)); /* (an exponent, "1e3", is an unknown unit "e3") */
}

int64_t zipmoe_parse_size(const char * text, uint64_t * out) {
    if (!text || !out) {
        return ZIPMOE_ERR_ARG;
    }
    decimal      d;
    const char * p = read_decimal(skip_space(text), &d);
    if (!p) {
        return ZIPMOE_ERR_ARG;
    }
    const int shift = read_unit(&p);
    if (*skip_space(p) || shift < 0) {
        return ZIPMOE_ERR_ARG;
    }
    return scale(&d, shift, out);
}

#define PERCENT_DIGITS 4 /* a percentage's fraction digits at most ("12.3456%") */

int64_t zipmoe_parse_budget(const char * text, uint64_t total, uint64_t * out) {
    if (!text || !out || total > ZIPMOE_SIZE_MAX) {
        return ZIPMOE_ERR_ARG;
    }
    decimal      d;
    const char * p = read_decimal(skip_space(text), &d);
    if (!p) {
        return ZIPMOE_ERR_ARG;
    }
    const char * end = skip_space(p);
    if (*end != '%') {
        return zipmoe_parse_size(text, out);
    }
    if (*skip_space(end + 1) || d.whole > 100 || d.n_digits > PERCENT_DIGITS) {
        return ZIPMOE_ERR_ARG;
    }
    /* total x (whole.digits) / 100, rounded down, exactly: the percentage in units of 10^-PERCENT_DIGITS percent */
    uint64_t hundredths = d.whole;
    for (size_t i = 0; i < PERCENT_DIGITS; i++) {
        hundredths = hundredths * 10 + (i < d.n_digits ? d.digits[i] : 0);
    }
    if (hundredths > 100 * 10000ull) {
        return ZIPMOE_ERR_ARG; /* more than 100% */
    }
    /* total <= 2^60 and hundredths <= 10^6 < 2^20: split total to keep each product below 2^64 */
    const uint64_t div = 100 * 10000ull, hi = total >> 20, lo = total & ((1u << 20) - 1);
    const uint64_t hi_part = hi * hundredths; /* < 2^60, and the exact sum below is hi_part * 2^20 + lo_part */
    const uint64_t lo_part = lo * hundredths;
    *out = (hi_part / div << 20) + ((hi_part % div << 20) + lo_part) / div;
    return ZIPMOE_OK;
}

int zipmoe_budget_is_auto(const char * text) {
    if (!text) {
        return 0;
    }
    const char * p = skip_space(text);
    for (const char * w = "auto"; *w; w++, p++) {
        if (lower(*p) != *w) {
            return 0;
        }
    }
    return *skip_space(p) == 0;
}

int zipmoe_budget_valid(const char * text) {
    uint64_t bytes = 0;
    return zipmoe_budget_is_auto(text) || zipmoe_parse_budget(text, ZIPMOE_SIZE_MAX, &bytes) == ZIPMOE_OK;
}

int64_t zipmoe_size_text(uint64_t bytes, char * buf, size_t size) {
    static const char * const units[] = { "KiB", "MiB", "GiB", "TiB", "PiB" };
    if (!buf || size == 0) {
        return ZIPMOE_ERR_ARG;
    }
    int n;
    if (bytes < 1024) {
        n = snprintf(buf, size, "%llu B", (unsigned long long) bytes);
    } else {
        double v = (double) bytes / 1024.0;
        size_t u = 0;
        while (v >= 1024.0 && u + 1 < sizeof units / sizeof units[0]) {
            v /= 1024.0;
            u++;
        }
        n = snprintf(buf, size, "%.1f %s", v, units[u]);
    }
    return n < 0 ? ZIPMOE_ERR_ARG : (size_t) n >= size ? ZIPMOE_ERR_DST_TOO_SMALL : n;
}
