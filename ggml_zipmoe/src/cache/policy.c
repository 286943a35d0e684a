/* policy.c - the cache's eviction policies by name: the one list that ZIPMOE_CACHE_POLICY, llama.cpp's
 * --cache-policy, pyzipmoe's --policy and a Modelfile's cache_policy take (pyzipmoe reads it through cffi). */
#include "zipmoe-cache.h"

#include <stdio.h>
#include <string.h>

/* The default first (ZIPMOE_POLICY_DEFAULT; docs/cache-and-planner.md, "Which policy"). */
static const struct {
    const char *  name;
    zipmoe_policy policy;
} policies[] = {
    { "lfuda", ZIPMOE_POLICY_LFUDA }, /* LFU with dynamic ageing, the counts of evicted experts kept */
    { "tlfu", ZIPMOE_POLICY_TOKEN_LFU }, /* the paper's token-weighted LFU */
    { "lru", ZIPMOE_POLICY_LRU },
    { "lfu", ZIPMOE_POLICY_LFU },
    { "fifo", ZIPMOE_POLICY_FIFO },
};
#define N_POLICIES (sizeof policies / sizeof policies[0])

const char * zipmoe_policy_name(size_t index) {
    return index < N_POLICIES ? policies[index].name : NULL;
}

int64_t zipmoe_policy_parse(const char * name, zipmoe_policy * out) {
    for (size_t i = 0; name && i < N_POLICIES; i++) {
        if (strcmp(name, policies[i].name) == 0) {
            if (out) {
                *out = policies[i].policy;
            }
            return ZIPMOE_OK;
        }
    }
    return ZIPMOE_ERR_ARG;
}

int64_t zipmoe_policy_names(char * buf, size_t size) {
    if (!buf || size == 0) {
        return ZIPMOE_ERR_ARG;
    }
    size_t n = 0;
    buf[0]   = 0;
    for (size_t i = 0; i < N_POLICIES; i++) {
        const char * sep = i == 0 ? "" : i + 1 == N_POLICIES ? " or " : ", ";
        const int    k   = snprintf(buf + n, size - n, "%s%s", sep, policies[i].name);
        if (k < 0 || (size_t) k >= size - n) {
            return ZIPMOE_ERR_DST_TOO_SMALL;
        }
        n += (size_t) k;
    }
    return (int64_t) n;
}
