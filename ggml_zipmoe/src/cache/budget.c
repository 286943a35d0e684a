/* budget.c - what a model needs of a memory budget and the one check of a budget against it (its message too), and
 * one budget's room for the experts split between the cache tiers (by shares), a prompt's read buffers and the
 * allowance for the expert tensor in flight, and generation's larger hot budget. The glue applies them at load
 * (zipmoe-config.cpp), pyzipmoe before it loads a model (runtime/budget.py) and the memory monitor
 * (pyzipmoe/runtime/controller.py) when it changes a budget split by shares, so that all keep the same accounting.
 * Pure functions: nothing here touches the stores. */
#include "zipmoe-impl.h"
#include "zipmoe-cache.h"

#include <stdio.h>
#include <string.h>

static uint64_t min_u64(uint64_t a, uint64_t b) { return a < b ? a : b; }
static uint64_t max_u64(uint64_t a, uint64_t b) { return a > b ? a : b; }
static double   min_d(double a, double b) { return a < b ? a : b; }

/* The most a store decodes anew when a batch routes to all of its experts, with hot tier h shared out by BF16 size
 * (config.c's quota()): a store keeps at least the whole experts of its share. */
static uint64_t allowance_for(const zipmoe_store_size * stores, size_t n, uint64_t h, uint64_t experts) {
    uint64_t most = 0;
    for (size_t i = 0; i < n; i++) {
        if (stores[i].n_expert == 0) {
            continue;
        }
        const uint64_t expert = stores[i].bf16_bytes / stores[i].n_expert;
        const uint64_t share  = (uint64_t) ((double) h * (double) stores[i].bf16_bytes / (double) experts);
        const uint64_t kept   = expert ? share / expert * expert : 0;
        most                  = max_u64(most, stores[i].bf16_bytes - min_u64(stores[i].bf16_bytes, kept));
    }
    return most;
}

int64_t zipmoe_budget_split_tiers(const zipmoe_store_size * stores, size_t n_stores, uint64_t tiers, double hot_share,
                                  double sm_share, zipmoe_budget_split * out) {
    if ((!stores && n_stores) || !out || !(hot_share >= 0 && sm_share >= 0 && hot_share + sm_share <= 1 + 1e-9)) {
        return ZIPMOE_ERR_ARG;
    }
    uint64_t working_set = 0, experts = 0;
    for (size_t i = 0; i < n_stores; i++) {
        working_set = max_u64(working_set, stores[i].bf16_bytes);
        experts += stores[i].bf16_bytes;
    }
    *out           = (zipmoe_budget_split) { 0 };
    out->in_flight = working_set;
    // A prompt's reads: the staging buffer of the store that decodes and the read-ahead buffer of the next hold the
    // compressed bytes of what a store does not keep decoded, each. Out of the budget, at 40% of the 2.8g model they
    // took ~100 MiB from the page cache of the other weights under a limit of the budget + 160 MiB (llama-bench
    // pp512: 166-171 tokens/s, 171-179 with the budget 100 MiB smaller, stock 161-171). So the tiers of a batch
    // leave room for them (at most half the tiers); generation, whose reads are a few experts, has it back
    // (token_hot).
    // A store's experts are shared out between the tiers as config.c's quota() does (by BF16 size): those no tier
    // keeps are read whole, those of the sm tier their codes (the region less the plane, a byte a value).
    // Without generation's hot budget (no hot tier, or an sm tier) the room is never given back, so it holds two
    // regions a buffer, enough to keep the disk busy: a store that reads more reads through rings (plan.c).
    if (experts > 0) {
        const double hot = (double) tiers * hot_share < (double) experts ? (double) tiers * hot_share / (double) experts : 1.0;
        uint64_t     largest = 0;
        for (size_t i = 0; i < n_stores; i++) {
            const double n = (double) stores[i].n_expert;
            if (n == 0 || stores[i].compressed_bytes == 0 || stores[i].bf16_bytes == 0) {
                continue; /* (nothing to read, and no sizes to divide by) */
            }
            const double share  = (double) stores[i].bf16_bytes / (double) experts;
            const double region = (double) stores[i].compressed_bytes / n;
            const double plane  = (double) stores[i].bf16_bytes / n / 2;
            const double rest   = n * (1.0 - hot);
            const double warm   = min_d(rest, (double) tiers * (1.0 - hot_share - sm_share) * share / region);
            const double sm     = min_d(rest - warm, (double) tiers * sm_share * share / plane);
            const double cold   = rest - warm - sm;
            // each expert's read takes its span of whole O_DIRECT blocks in the buffer: up to two blocks more
            const double   align  = 2 * (double) ZIPMOE_DIRECT_ALIGN;
            const uint64_t buffer = (uint64_t) (cold * (region + align) + sm * (region - plane + align) + 0.999);
            out->reads            = max_u64(out->reads, 2 * buffer);
            largest               = max_u64(largest, (uint64_t) (region + align + 0.999));
        }
        if (!(hot_share > 0 && sm_share == 0)) {
            out->reads = min_u64(out->reads, 2 * 2 * largest);
        }
        out->reads = min_u64(out->reads, tiers / 2);
        tiers -= out->reads;
    }
    out->hot  = (uint64_t) ((double) tiers * hot_share);
    out->sm   = min_u64(tiers - out->hot, (uint64_t) ((double) tiers * sm_share));
    out->warm = tiers - out->hot - out->sm;
    // The experts in flight that are decoded already need no room of their own: the hot tier holds them. A store
    // keeps at least the whole experts of its share of the hot tier (config.c passes what a share holds beyond
    // whole experts on to the next store, so the rest of the hot tier may be full meanwhile), and a prompt that
    // routes to all of its experts decodes the others anew: the allowance is the most any store decodes so. It
    // comes out of what the hot tier and the allowance share; a smaller hot tier can only need more allowance, so
    // a few steps down from the fractional answer (the hot tier at h / (1 - L / experts)) find the largest hot
    // tier that fits.
    if (out->hot > 0 && experts > working_set) {
        const uint64_t shared = out->hot + working_set;
        uint64_t       grown  = min_u64(experts,
                                           (uint64_t) ((double) out->hot / (1.0 - (double) working_set / (double) experts)));
        uint64_t need = allowance_for(stores, n_stores, grown, experts);
        for (int step = 0; step < 64 && grown + need > shared; step++) {
            grown = shared - need;
            need  = allowance_for(stores, n_stores, grown, experts);
        }
        if (grown + need <= shared) {
            out->in_flight = shared - grown;
            out->hot       = grown;
        }
    }
    // a token's misses take their victims' places and read a few experts: generation needs neither the allowance
    // nor the read room beside the hot tier, which then holds them too (not with an sm tier: plan.c's place_plan
    // does not evict first there)
    if (out->hot > 0 && out->sm == 0) {
        out->token_hot = out->hot + out->in_flight + out->reads;
    }
    return ZIPMOE_OK;
}

double zipmoe_budget_default_hot_share(const zipmoe_store_size * stores, size_t n_stores, uint64_t tiers, int warm_fast,
                                       double sm_share) {
    uint64_t bf16 = 0, compressed = 0;
    for (size_t i = 0; stores && i < n_stores; i++) {
        bf16 += stores[i].bf16_bytes;
        compressed += stores[i].compressed_bytes;
    }
    const int fits_compressed = (double) tiers >= ZIPMOE_WARM_FIRST_FIT * (double) compressed;
    const int fits_decoded    = (double) tiers >= ZIPMOE_WARM_FIRST_FIT * (double) bf16;
    const double hot          = warm_fast && compressed > 0 && fits_compressed && !fits_decoded ? 0.0 : 1.0;
    return min_d(hot, sm_share > 0 ? (sm_share < 1 ? 1 - sm_share : 0) : 1); /* (gives way to an sm share) */
}

uint64_t zipmoe_budget_embd_charge(uint64_t embd_bytes, uint64_t row_bytes, uint64_t page) {
    if (row_bytes == 0 || page == 0) {
        return embd_bytes;
    }
    if (row_bytes > ZIPMOE_SIZE_MAX || page > ZIPMOE_SIZE_MAX) {
        return embd_bytes; /* (no table has such rows: charge it whole rather than overflow) */
    }
    const uint64_t row = ((row_bytes + page - 1) / page + 1) * page; /* an unaligned row touches one page more */
    return row > embd_bytes / ZIPMOE_EMBD_BATCH_ROWS ? embd_bytes : ZIPMOE_EMBD_BATCH_ROWS * row;
}

int64_t zipmoe_budget_need_of(const zipmoe_store_size * stores, size_t n_stores, uint64_t other_bytes,
                              uint64_t embd_bytes, uint64_t embd_row_bytes, uint64_t page, zipmoe_budget_need * out) {
    if (!out || (n_stores > 0 && !stores) || embd_bytes > other_bytes || other_bytes > ZIPMOE_SIZE_MAX) {
        return ZIPMOE_ERR_ARG;
    }
    zipmoe_budget_need need = { 0 };
    need.embd_charged       = zipmoe_budget_embd_charge(embd_bytes, embd_row_bytes, page);
    need.other              = other_bytes - embd_bytes + need.embd_charged;
    for (size_t i = 0; i < n_stores; i++) {
        if (stores[i].bf16_bytes > ZIPMOE_SIZE_MAX) {
            return ZIPMOE_ERR_ARG;
        }
        need.in_flight = max_u64(need.in_flight, stores[i].bf16_bytes);
        need.experts += stores[i].bf16_bytes;
        if (need.experts > ZIPMOE_SIZE_MAX) {
            return ZIPMOE_ERR_ARG;
        }
    }
    need.minimum = need.other + need.in_flight;
    *out         = need;
    return ZIPMOE_OK;
}

int64_t zipmoe_budget_check(uint64_t budget, const zipmoe_budget_need * need, uint64_t embd_bytes,
                            const char * said, char * msg, size_t msg_size) {
    if (msg && msg_size > 0) {
        msg[0] = 0;
    }
    if (!need) {
        return ZIPMOE_ERR_ARG;
    }
    if (budget >= need->minimum) {
        return ZIPMOE_OK;
    }
    if (!msg || msg_size == 0) {
        return ZIPMOE_ERR_ARG;
    }
    char given[32], minimum[32], other[32], in_flight[32], exact[48] = "", embd[128] = "";
    zipmoe_size_text(budget, given, sizeof given);
    zipmoe_size_text(need->minimum, minimum, sizeof minimum);
    zipmoe_size_text(need->other, other, sizeof other);
    zipmoe_size_text(need->in_flight, in_flight, sizeof in_flight);
    if (strcmp(given, minimum) == 0) { /* (1 byte short reads the same rounded: say the bytes) */
        snprintf(exact, sizeof exact, " (%llu bytes)", (unsigned long long) budget);
        snprintf(minimum, sizeof minimum, "%llu bytes", (unsigned long long) need->minimum);
    }
    if (need->embd_charged < embd_bytes) {
        char charged[32], whole[32];
        zipmoe_size_text(need->embd_charged, charged, sizeof charged);
        zipmoe_size_text(embd_bytes, whole, sizeof whole);
        snprintf(embd, sizeof embd, " (token_embd: the rows of a batch, %s of %s)", charged, whole);
    }
    snprintf(msg, msg_size,
             "memory budget %s%s is below the minimum of %s for this model (%s of weights that are not experts%s + %s "
             "for the experts of one expert tensor in flight); raise --memory-budget",
             said ? said : given, exact, minimum, other, embd, in_flight);
    return ZIPMOE_ERR_ARG;
}
