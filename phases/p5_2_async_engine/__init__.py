"""Phase 5.2: one engine thread steps phase 5.1's engine for many asyncio clients. README.md has the files."""
