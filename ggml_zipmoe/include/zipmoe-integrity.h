/*
 * zipmoe-integrity.h - whole-file integrity of a zipmoe GGUF (docs/FORMAT.md, "Integrity record").
 *
 * A zipmoe GGUF carries a `zipmoe.integrity` key: checksums of its metadata (every byte before the tensor
 * data: the header, every key/value pair, every tensor info) and of every tensor that is not a data companion
 * (the expert chunks have their own checksums, verified on every decode). A loader verifies it once, before it
 * uses anything the metadata says, so a damaged file is refused instead of computing wrong logits.
 *
 * Exported by libggml-zipmoe; kept out of zipmoe.h because only loaders (llama.cpp's, through patches/0001)
 * call it. Checksums detect damage (bad disks, truncated or garbled downloads), not tampering: whoever can
 * write the file can rewrite its checksums too (see SECURITY.md).
 */
#ifndef ZIPMOE_INTEGRITY_H
#define ZIPMOE_INTEGRITY_H

#include "zipmoe.h"

#ifdef __cplusplus
extern "C" {
#endif

#define ZIPMOE_INTEGRITY_KEY     "zipmoe.integrity"
#define ZIPMOE_INTEGRITY_MAGIC   0x31544E4945504D5AULL /* the bytes "ZMPEINT1" */
#define ZIPMOE_INTEGRITY_VERSION 1
#define ZIPMOE_INTEGRITY_BLOCK   ((size_t) 1 << 20)    /* the chained hash's block size */

/* What the record says about one tensor. */
enum {
    ZIPMOE_INTEGRITY_HASHED    = 1, /* its bytes are hashed (dense tensors, indexes, the source header) */
    ZIPMOE_INTEGRITY_COMPANION = 2, /* an expert data companion: its chunks carry checksums of their own */
};

/* One tensor of the file, in tensor-info order. */
typedef struct {
    const char * name;
    uint64_t     offset; /* from the start of the data section */
    uint64_t     size;   /* bytes */
} zipmoe_integrity_tensor;

/* The chained hash of docs/FORMAT.md: h = 0, then h = XXH3_64(block, seed = h) for each 1 MiB block. */
ZIPMOE_API uint64_t zipmoe_integrity_hash(const void * data, size_t size, uint64_t h);

/* Verifies the record (record_len uint64 elements, as read from the key) against the file open as fd:
 * the metadata bytes [0, data_start) and every tensor of tensors[n_tensors] (all the file's tensors, in
 * tensor-info order; offsets from data_start). Reads with pread, at most 1 MiB at a time, and never past the
 * file's end. Returns ZIPMOE_OK, or an error with a one-line message in msg that names what is damaged:
 * ZIPMOE_ERR_CHECKSUM for bytes that do not match their checksum, ZIPMOE_ERR_CORRUPT for a malformed record
 * or a file that does not match it, ZIPMOE_ERR_UNSUPPORTED for a record version this build cannot read. */
ZIPMOE_API int64_t zipmoe_integrity_verify(int fd, const uint64_t * record, size_t record_len, uint64_t data_start,
                                           const zipmoe_integrity_tensor * tensors, size_t n_tensors,
                                           char * msg, size_t msg_size);

#ifdef __cplusplus
}
#endif

#endif /* ZIPMOE_INTEGRITY_H */
