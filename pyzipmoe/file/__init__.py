"""zipmoe's files: the GGUF reader, zipmoe's metadata and expert index, the codec wrapper, the writer (convert) and
its inverse (verify, unpack), the integrity record, and trained weights read for benchmarks."""
