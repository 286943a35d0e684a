/* config.c - the one place where the native code reads ZIPMOE_* environment variables (zipmoe.h,
 * zipmoe_runtime_config, lists them). Bare llama.cpp programs are configured through the environment; reading it
 * here, into a plain struct, leaves every other file to take its settings as parameters. And the one value of the
 * environment zipmoe sets for OpenMP (zipmoe_openmp_spincount), which the programs and pyzipmoe read here. */
#include "zipmoe.h"

#include <stdlib.h>
#include <string.h>

/* The value of a variable, or NULL where it is unset or empty. */
static const char * text(const char * name) {
    const char * v = getenv(name);
    return v && *v ? v : NULL;
}

/* Whether a switch that is on by default is set to "0". */
static int off(const char * name) {
    const char * v = getenv(name);
    return v && strcmp(v, "0") == 0;
}

void zipmoe_runtime_config_from_env(zipmoe_runtime_config * cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->memory_budget = text("ZIPMOE_MEMORY_BUDGET");
    cfg->hot_share     = text("ZIPMOE_HOT_SHARE");
    cfg->sm_share      = text("ZIPMOE_SM_SHARE");
    cfg->plan          = text("ZIPMOE_PLAN");
    cfg->cache_policy  = text("ZIPMOE_CACHE_POLICY");
    cfg->cache         = text("ZIPMOE_CACHE");
    cfg->direct_io     = text("ZIPMOE_DIRECT_IO");
    cfg->read_buffer   = text("ZIPMOE_READ_BUFFER");
    cfg->predict       = text("ZIPMOE_PREDICT");
    cfg->control       = text("ZIPMOE_CONTROL");
    cfg->prior         = text("ZIPMOE_PRIOR");
    cfg->prior_record  = text("ZIPMOE_PRIOR_RECORD");
    cfg->prefill       = !off("ZIPMOE_PREFILL");
    cfg->fused         = !off("ZIPMOE_FUSED");
    cfg->stream        = !off("ZIPMOE_STREAM");
    cfg->esc_simd      = !off("ZIPMOE_ESC_SIMD");
    const char * integrity = getenv("ZIPMOE_INTEGRITY");
    cfg->integrity     = !(integrity && strcmp(integrity, "skip") == 0);
}

const char * zipmoe_openmp_spincount(void) {
    return "2000"; /* zipmoe.h says what it was measured against */
}
