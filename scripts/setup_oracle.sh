#!/usr/bin/env bash
# The parity oracle (docs/testing.md, The environments): vLLM's speculators 0.9.0, installed apart from .venv (it pins
# transformers <= 5.19) into .oracle/site, without its CUDA-pulling dependencies; the oracle process uses
# .venv's python and torch with this directory first on PYTHONPATH. Idempotent; used by scripts/test.sh.
# tests/oracle/ skips when it is absent.
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=${FLEDGE_ORACLE_SITE:-.oracle/site}
PINS="speculators==0.9.0 transformers==5.19.0 hs-connectors==0.9.0 loguru==0.7.3 pydantic-settings==2.16.3
openai==2.54.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1"
want="$(echo "$PINS" | sha256sum | cut -c1-16)"
[ -f "$SITE/.fledge-oracle" ] && [ "$(cat "$SITE/.fledge-oracle")" = "$want" ] && exit 0
rm -rf "$SITE.tmp"
# shellcheck disable=SC2086
.venv/bin/pip install -q --no-deps --target "$SITE.tmp" $PINS 2>&1 | grep -v "^WARNING: Location" || true
PYTHONPATH="$SITE.tmp" .venv/bin/python -c "import speculators.models.eagle3, transformers as t; assert t.__version__ == '5.19.0'"
rm -rf "$SITE" && mkdir -p "$(dirname "$SITE")" && mv "$SITE.tmp" "$SITE"
echo "$want" > "$SITE/.fledge-oracle"
