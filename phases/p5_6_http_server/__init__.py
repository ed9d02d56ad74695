"""Phase 5.6: the served engine behind an OpenAI-compatible HTTP API, with streaming. README.md has the files."""
