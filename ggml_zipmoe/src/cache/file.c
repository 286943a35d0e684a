/* file.c - a store's bytes in the model file: where an expert's compressed region (or a raw expert's rows) lies in
 * the data companion, and reading, hinting and O_DIRECT spans at offsets of it. */
#define _GNU_SOURCE
#include "io.h"

#include <fcntl.h>

void cache_expert_span(const zipmoe_store * s, int64_t e, zipmoe_expert_span * span) {
    if (s->raw) {
        *span = (zipmoe_expert_span) { (uint64_t) e * s->hot_size, s->hot_size, 0 };
    } else {
        zipmoe_tensor_expert_span(s->tensor, e, span);
    }
}

void cache_raw_chunk(const zipmoe_store * s, int64_t c, uint64_t * first, uint64_t * size) {
    const uint64_t rows = (uint64_t) (s->info.chunk_n / s->info.ne[0]);
    const uint64_t r0 = (uint64_t) c * rows, r1 = r0 + rows < (uint64_t) s->info.ne[1] ? r0 + rows : (uint64_t) s->info.ne[1];
    *first = r0 * s->row_bytes;
    *size  = (r1 - r0) * s->row_bytes;
}

uint64_t cache_region_size(const zipmoe_store * s, int64_t e) {
    zipmoe_expert_span span;
    cache_expert_span(s, e, &span);
    return span.size;
}

/* Reads size bytes at offset of the data companion (publish() drops them from the page cache). */
int cache_read_cold(const zipmoe_store * s, uint64_t offset, void * buf, size_t size) {
    return zipmoe_pread_all(s->fd, s->data_offset + offset, buf, size);
}

void cache_advise(const zipmoe_store * s, uint64_t offset, uint64_t size, int advice) {
    posix_fadvise(s->fd, (off_t) (s->data_offset + offset), (off_t) size, advice);
}

/* Where in its aligned span of the file a read at offset of the data companion starts: the bytes before it that
 * an O_DIRECT read brings too. */
size_t cache_direct_pad(const zipmoe_store * s, uint64_t offset) {
    return (size_t) ((s->data_offset + offset) % ZIPMOE_DIRECT_ALIGN);
}

/* Bytes a read of [offset, offset + size) of the data companion takes in a buffer laid out for O_DIRECT: from
 * the aligned start before it to the aligned end after it. */
size_t cache_direct_span(const zipmoe_store * s, uint64_t offset, uint64_t size) {
    return zipmoe_align_up(cache_direct_pad(s, offset) + (size_t) size, ZIPMOE_DIRECT_ALIGN);
}
