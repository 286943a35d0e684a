/* status.c - names of status codes. */
#include "zipmoe.h"

const char * zipmoe_status_str(int64_t status) {
    switch (status) {
        case ZIPMOE_OK:                return "ok";
        case ZIPMOE_ERR_ARG:           return "invalid argument";
        case ZIPMOE_ERR_CORRUPT:       return "corrupt data (sizes, offsets or code tables are inconsistent)";
        case ZIPMOE_ERR_CHECKSUM:      return "checksum mismatch (the stored bytes were modified or damaged)";
        case ZIPMOE_ERR_NOMEM:         return "out of memory";
        case ZIPMOE_ERR_UNSUPPORTED:   return "unsupported codec, version or tensor type";
        case ZIPMOE_ERR_DST_TOO_SMALL: return "destination buffer too small";
        case ZIPMOE_ERR_CODEC:         return "codec error (the compressed stream does not decode)";
        case ZIPMOE_ERR_IO:            return "cannot read the model file";
        default:                       return status >= 0 ? "ok" : "unknown error";
    }
}
