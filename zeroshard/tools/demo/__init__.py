"""The demo: a byte-level GPT trained on the Python standard library's own source."""
