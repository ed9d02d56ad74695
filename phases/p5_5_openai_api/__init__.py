"""Phase 5.5: OpenAI's wire format, the request bodies checked and the answers shaped. README.md has the files."""
