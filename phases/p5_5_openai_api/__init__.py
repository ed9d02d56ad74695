"""Phase 5.5 adds OpenAI's wire format to phase 5.4's engine: the request bodies a client sends, checked before the engine sees them, and the answers and stream chunks it reads back.

Files, in reading order:
- protocol.py  the request and response bodies (pydantic): the bounds a client reads in /openapi.json,
               the fields refused rather than ignored, OpenAI's error body
- errors.py    `APIError` and the handlers that give every refusal (a bad body, a bad path, a crash)
               OpenAI's error shape
- formats.py   what /v1/completions and /v1/chat/completions answers and stream chunks look like
- README.md    the idea, its files, how to run it; its tables: docs/measurements/p5_5_openai_api.md
"""
