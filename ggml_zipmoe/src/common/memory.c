/* memory.c - how much memory this process may use, and the budget of `--memory-budget auto` (zipmoe.h): the
 * machine's memory from /proc/meminfo and the binding limit of the process's cgroup hierarchy (v1 or v2), read the
 * way pyzipmoe.runtime.memory reads them, so that a bare llama.cpp program and `zipmoe run` come to the same
 * budget. Readings are advisory: a cgroup file that is missing, unreadable or garbled counts as no limit there. */
#define _GNU_SOURCE
#include "zipmoe.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define UNLIMITED_FROM ((int64_t) 1 << 60) /* v1 writes "no limit" as its largest page count in bytes */
#define MIN_MARGIN     ((uint64_t) 32 << 20)
#define MARGIN_SHARE   0.03
#define PATH_BYTES     4096
#define FILE_BYTES     65536 /* memory.stat is a few KiB; /proc/self/cgroup and meminfo less */

/* The first FILE_BYTES - 1 bytes of a file, NUL-terminated, into buf; 0 if it cannot be read. */
static int read_text(const char * path, char * buf, size_t size) {
    FILE * f = fopen(path, "re");
    if (!f) {
        return 0;
    }
    const size_t n = fread(buf, 1, size - 1, f);
    const int    ok = !ferror(f);
    fclose(f);
    buf[n] = 0;
    return ok;
}

/* A decimal integer with optional sign and surrounding white space (as Python's int() reads a cgroup file), or 0
 * if the text is anything else ("max", garbled, out of range). */
static int parse_int(const char * s, const char * end, int64_t * out) {
    while (s < end && (*s == ' ' || *s == '\t' || *s == '\n' || *s == '\r')) {
        s++;
    }
    while (end > s && (end[-1] == ' ' || end[-1] == '\t' || end[-1] == '\n' || end[-1] == '\r')) {
        end--;
    }
    int negative = 0;
    if (s < end && (*s == '+' || *s == '-')) {
        negative = *s == '-';
        s++;
    }
    if (s == end) {
        return 0;
    }
    uint64_t v = 0;
    for (; s < end; s++) {
        if (*s < '0' || *s > '9' || v > (uint64_t) INT64_MAX / 10) {
            return 0;
        }
        v = v * 10 + (uint64_t) (*s - '0');
        if (v > (uint64_t) INT64_MAX) {
            return 0;
        }
    }
    *out = negative ? -(int64_t) v : (int64_t) v;
    return 1;
}

static int read_int(const char * path, int64_t * out) {
    char buf[256];
    return read_text(path, buf, sizeof buf) && parse_int(buf, buf + strlen(buf), out);
}

static int is_dir(const char * path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

static int is_file(const char * path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

static int join(char * out, const char * a, const char * b) {
    const int n = snprintf(out, PATH_BYTES, "%s/%s", a, b);
    return n > 0 && n < PATH_BYTES;
}

/* The value of the first of keys ("key value" lines of a memory.stat) found in stat, or 0. */
static int64_t stat_value(const char * stat, const char * const * keys) {
    for (; *keys; keys++) {
        const size_t n = strlen(*keys);
        for (const char * line = stat; *line;) {
            const char * eol = strchr(line, '\n');
            const char * end = eol ? eol : line + strlen(line);
            int64_t      v   = 0;
            if ((size_t) (end - line) > n && strncmp(line, *keys, n) == 0 && line[n] == ' ' &&
                parse_int(line + n + 1, end, &v)) {
                return v;
            }
            line = eol ? eol + 1 : end;
        }
    }
    return 0;
}

typedef struct {
    int     found;
    int64_t limit, usage, reclaimable, file_cache;
} cgroup_memory;

typedef struct {
    const char *         limit_file;
    const char *         usage_file;
    const char * const * inactive_keys;
    const char * const * active_keys;
} cgroup_files;

static const char * const V1_INACTIVE[] = { "total_inactive_file", "inactive_file", NULL };
static const char * const V1_ACTIVE[]   = { "total_active_file", "active_file", NULL };
static const char * const V2_INACTIVE[] = { "inactive_file", NULL };
static const char * const V2_ACTIVE[]   = { "active_file", NULL };
static const cgroup_files V1 = { "memory.limit_in_bytes", "memory.usage_in_bytes", V1_INACTIVE, V1_ACTIVE };
static const cgroup_files V2 = { "memory.max", "memory.current", V2_INACTIVE, V2_ACTIVE };

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

static __int128 room(const cgroup_memory * c) { return (__int128) c->limit - ((__int128) c->usage - c->reclaimable); }

/* One cgroup directory's limit and usage into best, where it has less room left than best. */
static void read_dir(const char * dir, const cgroup_files * files, cgroup_memory * best, char * buf) {
    char    path[PATH_BYTES];
    int64_t limit = 0, usage = 0;
    if (!join(path, dir, files->limit_file) || !read_int(path, &limit) || limit >= UNLIMITED_FROM) {
        return; /* v2's "max" is garbled to read_int: no limit */
    }
    if (!join(path, dir, files->usage_file) || !read_int(path, &usage)) {
        usage = 0;
    }
    if (!join(path, dir, "memory.stat") || !read_text(path, buf, FILE_BYTES)) {
        buf[0] = 0;
    }
    cgroup_memory here;
    here.found       = 1;
    here.limit       = limit;
    here.usage       = usage;
    here.reclaimable = min64(stat_value(buf, files->inactive_keys), usage);
    const __int128 cache = (__int128) here.reclaimable + stat_value(buf, files->active_keys);
    here.file_cache  = cache < usage ? (int64_t) cache : usage;
    if (!best->found || room(&here) < room(best)) {
        *best = here;
    }
}

/* Every directory of cgroup path under mount and of its ancestors, innermost first, the mount last; those that do
 * not exist are skipped (in a container without a cgroup namespace the path is the host's). */
static void read_hierarchy(const char * mount, const char * path, const cgroup_files * files, cgroup_memory * best,
                           char * buf) {
    char parts[PATH_BYTES];
    snprintf(parts, sizeof parts, "%s", path);
    const char * part[256];
    size_t       n = 0;
    for (char * save = NULL, *p = strtok_r(parts, "/", &save); p && n < 256; p = strtok_r(NULL, "/", &save)) {
        if (strcmp(p, ".") != 0 && strcmp(p, "..") != 0) {
            part[n++] = p;
        }
    }
    for (size_t k = n + 1; k-- > 0;) {
        char dir[PATH_BYTES];
        int  len = snprintf(dir, sizeof dir, "%s", mount);
        for (size_t i = 0; i < k && len > 0 && len < PATH_BYTES; i++) {
            len += snprintf(dir + len, sizeof dir - (size_t) len, "/%s", part[i]);
        }
        if (len > 0 && len < PATH_BYTES && is_dir(dir)) {
            read_dir(dir, files, best, buf);
        }
    }
}

/* The v1 hierarchy of the memory controller: <root>/memory, or a joint one whose name lists it. */
static int v1_mount(const char * root, char * out) {
    if (join(out, root, "memory") && is_dir(out)) {
        return 1;
    }
    DIR * d = opendir(root);
    if (!d) {
        return 0;
    }
    int found = 0;
    for (struct dirent * e; !found && (e = readdir(d)) != NULL;) {
        if (e->d_name[0] == '.' || !join(out, root, e->d_name) || !is_dir(out)) {
            continue;
        }
        char names[256];
        snprintf(names, sizeof names, "%s", e->d_name);
        for (char * save = NULL, *p = strtok_r(names, ",", &save); p; p = strtok_r(NULL, ",", &save)) {
            found = found || strcmp(p, "memory") == 0;
        }
    }
    closedir(d);
    return found;
}

/* The v2 hierarchy: the root itself (unified mode) or its unified directory (hybrid mode). */
static int v2_mount(const char * root, char * out) {
    char probe[PATH_BYTES];
    if (join(probe, root, "cgroup.controllers") && is_file(probe)) {
        snprintf(out, PATH_BYTES, "%s", root);
        return 1;
    }
    return join(out, root, "unified") && join(probe, out, "cgroup.controllers") && is_file(probe);
}

/* The binding limit of this process's cgroups, from <proc_self>/cgroup: v1's memory hierarchy where there is one
 * (hybrid mode keeps the controllers there), else v2's. */
static void read_cgroup(const char * root, const char * proc_self, cgroup_memory * best, char * buf) {
    char path[PATH_BYTES], mount[PATH_BYTES];
    if (!join(path, proc_self, "cgroup") || !read_text(path, buf, FILE_BYTES)) {
        return;
    }
    char * membership = strdup(buf);
    if (!membership) {
        return;
    }
    const char * v1_path = NULL, *v2_path = NULL;
    for (char * save = NULL, *line = strtok_r(membership, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char * c1 = strchr(line, ':');
        char * c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (!c2) {
            continue;
        }
        *c2 = 0;
        if (c1[1] == 0) {
            v2_path = c2 + 1; /* "0::/a/b" */
        }
        char * controllers = c1 + 1;
        for (char * s2 = NULL, *c = strtok_r(controllers, ",", &s2); c; c = strtok_r(NULL, ",", &s2)) {
            if (strcmp(c, "memory") == 0) {
                v1_path = c2 + 1;
            }
        }
    }
    if (v1_path && v1_mount(root, mount)) {
        read_hierarchy(mount, v1_path, &V1, best, buf);
    } else if (v2_path && v2_mount(root, mount)) {
        read_hierarchy(mount, v2_path, &V2, best, buf);
    }
    free(membership);
}

/* MemTotal and MemAvailable of a meminfo (kB); without MemAvailable (kernels before 3.14), free + buffers + cached. */
static int read_meminfo(const char * path, uint64_t * total, uint64_t * available, char * buf) {
    if (!read_text(path, buf, FILE_BYTES)) {
        return 0;
    }
    static const char * const keys[] = { "MemTotal:", "MemAvailable:", "MemFree:", "Buffers:", "Cached:" };
    uint64_t                  kb[5]  = { 0 };
    int                       seen[5] = { 0 };
    for (const char * line = buf; *line;) {
        const char * eol = strchr(line, '\n');
        const char * end = eol ? eol : line + strlen(line);
        for (int i = 0; i < 5; i++) {
            const size_t n = strlen(keys[i]);
            if ((size_t) (end - line) > n && strncmp(line, keys[i], n) == 0) {
                const char * v = line + n;
                char *       stop;
                const unsigned long long x = strtoull(v, &stop, 10);
                if (stop != v) {
                    kb[i]   = x;
                    seen[i] = 1;
                }
            }
        }
        line = eol ? eol + 1 : end;
    }
    if (!seen[0]) {
        return 0;
    }
    const uint64_t cap = ZIPMOE_SIZE_MAX >> 10;
    *total             = (kb[0] < cap ? kb[0] : cap) << 10;
    const uint64_t av  = seen[1] ? kb[1] : kb[2] + kb[3] + kb[4];
    *available         = (av < cap ? av : cap) << 10;
    return 1;
}

int64_t zipmoe_memory_read(const char * cgroup_root, const char * proc_self, const char * meminfo,
                           zipmoe_memory_reading * out) {
    if (!out) {
        return ZIPMOE_ERR_ARG;
    }
    char * buf = malloc(FILE_BYTES);
    if (!buf) {
        return ZIPMOE_ERR_NOMEM;
    }
    memset(out, 0, sizeof *out);
    if (!read_meminfo(meminfo ? meminfo : "/proc/meminfo", &out->total, &out->available, buf)) {
        free(buf);
        return ZIPMOE_ERR_IO;
    }
    cgroup_memory best = { 0 };
    read_cgroup(cgroup_root ? cgroup_root : "/sys/fs/cgroup", proc_self ? proc_self : "/proc/self", &best, buf);
    free(buf);
    if (best.found) {
        /* (clamped to what a reading can mean: no size is negative, none above ZIPMOE_SIZE_MAX) */
        const int64_t max = (int64_t) ZIPMOE_SIZE_MAX;
        out->has_cgroup         = 1;
        out->cgroup_limit       = (uint64_t) (best.limit < 0 ? 0 : best.limit);
        out->cgroup_usage       = (uint64_t) (best.usage < 0 ? 0 : min64(best.usage, max));
        out->cgroup_reclaimable = (uint64_t) (best.reclaimable < 0 ? 0 : min64(best.reclaimable, max));
        out->cgroup_file_cache  = (uint64_t) (best.file_cache < 0 ? 0 : min64(best.file_cache, max));
    }
    return ZIPMOE_OK;
}

uint64_t zipmoe_memory_margin(const zipmoe_memory_reading * r) {
    const uint64_t limit = r->has_cgroup && r->cgroup_limit < r->total ? r->cgroup_limit : r->total;
    const uint64_t share = (uint64_t) ((double) limit * MARGIN_SHARE); /* as Python's int(limit * 0.03) */
    return share > MIN_MARGIN ? share : MIN_MARGIN;
}

uint64_t zipmoe_auto_budget(const zipmoe_memory_reading * r, uint64_t model_bytes, uint64_t held) {
    __int128 headroom = r->available; /* what could be allocated were the file cache dropped */
    if (r->has_cgroup) {
        const __int128 cgroup = (__int128) r->cgroup_limit - ((__int128) r->cgroup_usage - r->cgroup_file_cache);
        headroom              = cgroup < headroom ? cgroup : headroom;
        headroom              = headroom < 0 ? 0 : headroom;
    }
    __int128 budget = (__int128) held + headroom - zipmoe_memory_margin(r);
    budget          = budget < 0 ? 0 : budget;
    return budget < (__int128) model_bytes ? (uint64_t) budget : model_bytes;
}
