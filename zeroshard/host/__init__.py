"""Host memory at the page level: glibc's thresholds, released units' pages dropped or moved under the next
gather, a mapped file's pages given back, and the C library's calls loaded once."""
