#!/usr/bin/env bash
# Re-measure every demo, one at a time, on the packaged model with the CPU defaults, as
# reference runs: results/*.{json,md,png}, the files the READMEs quote (a plain
# `python -m common <demo>` writes to runs/ instead, which git ignores). Run it on an
# otherwise idle machine, then: python scripts/sync_readme_tables.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
demos=${*:-$($PY -m common --list | awk '{print $1}')}
for d in $demos; do
  echo "=== $d ($(date -u +%H:%M:%S), load $(cut -d' ' -f1 /proc/loadavg))"
  $PY -m common "$d" --reference
done
