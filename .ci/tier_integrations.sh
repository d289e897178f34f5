#!/usr/bin/env bash
# CI tier "integrations": EBPO inside TRL and verl (issue 7).
#
# Builds .venv-integrations from scratch next to the repo's main .venv (which keeps
# transformers 5.24; verl 0.9.1 needs transformers < 5.11), then runs the tests marked
# `verl` or `trl`. Exits non-zero if the install fails, a test fails, or no test ran.
#
#   bash .ci/tier_integrations.sh               # build + test
#   KEEP_VENV=1 bash .ci/tier_integrations.sh   # reuse an existing .venv-integrations
#   BUILD_ONLY=1 bash .ci/tier_integrations.sh  # build and check the venv, run no test
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-integrations
PY=${PYTHON:-python3}
t0=$(date +%s)

if [[ "${KEEP_VENV:-0}" != "1" || ! -x "$VENV/bin/python" ]]; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  # torch first, alone: the local CPU wheel. Anything else first could pull a CUDA torch.
  "$VENV/bin/pip" install -q --upgrade pip
  # --no-compile: the modules a test imports compile on import (see .ci/run)
  "$VENV/bin/pip" install -q --no-compile torch==2.13.0
  # verl 0.9.1 imports cachetools, uvicorn, fastapi without declaring them; ray, tensordict and
  # omegaconf are needed by verl.trainer.ppo.core_algos. transformers resolves to < 5.11 (verl's pin).
  # jmespath: TRL's parse_response on transformers < 5.13 (the legacy response_schema parser),
  # which tests/test_env_trl.py compares ebpo_lite's tool-call parsing with.
  "$VENV/bin/pip" install -q --no-compile "verl==0.9.1" "trl>=1.16,<1.17" "peft>=0.17" \
    "transformers>=5.5.3,<5.11,!=5.6.0" cachetools uvicorn fastapi ray tensordict omegaconf \
    jmespath pytest hypothesis
  "$VENV/bin/pip" install -q --no-compile -e . --no-deps
  # verl 0.9.1's wheel installs a top-level `tests` package into site-packages; a regular package
  # there wins over this repo's tests/ folder (no __init__.py) and breaks `from tests.conftest ...`.
  rm -rf "$VENV"/lib/python3*/site-packages/tests
fi
t1=$(date +%s)
echo "tier_integrations: venv ready in $((t1 - t0)) s"
"$VENV/bin/python" -c "import torch, transformers, trl, verl; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'trl', trl.__version__, 'verl', verl.__version__)"
if [[ "${BUILD_ONLY:-0}" == "1" ]]; then exit 0; fi

# pytest exits 5 when nothing was collected: that is a failure here too.
set +e
"$VENV/bin/python" -m pytest -m "verl or trl" tests -q -p no:cacheprovider
rc=$?
set -e
t2=$(date +%s)
echo "tier_integrations: tests took $((t2 - t1)) s (rc=$rc)"
if [[ $rc -eq 5 ]]; then
  echo "tier_integrations: no tests collected" >&2
fi
exit $rc
