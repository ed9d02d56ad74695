"""Phase 5.3: phase 5.2's async engine, measured, for /health and Prometheus' /metrics. README.md has the files."""
