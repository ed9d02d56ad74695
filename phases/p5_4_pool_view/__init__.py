"""Phase 5.4: the KV pool step by step, for a page that draws it, and vLLM's KV events. README.md has the files."""
