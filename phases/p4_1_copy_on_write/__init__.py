"""Phase 4.1: sequences share KV blocks by reference count, and a shared block is copied only when written
(copy-on-write), so n samples of one prompt store its K/V once."""
