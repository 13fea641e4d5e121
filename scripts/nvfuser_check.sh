#!/usr/bin/env bash
# nvFuser's own frontend on CPU: every fusion program the executor forms, built and
# validated by nvFuser itself (no GPU needed to build a definition; running one does).
#   scripts/nvfuser_check.sh              record (2.), then build (3.)
#   scripts/nvfuser_check.sh --recorded   build what a test run already recorded in
#                                         .nvfuser/programs (.ci/run does this)
# 1. Once: a Python 3.12 environment in .nvfuser/cpu-env (git-ignored) with torch 2.10 and
#    nvFuser's wheel for it (nvFuser publishes no wheels for Python 3.11 or torch 2.13):
#    scripts/py312_env.sh.
# 2. The project's own environment (.venv, torch 2.13) runs the fusion tests and
#    scripts/nvfuser_collect.py on 2 Gloo ranks with DTCOMPILE_FUSION_RECORD set: every
#    program the executor forms (op-info table forward and with gradients, the MLP and the
#    Llama-style block over sequence lengths, a Hugging Face Llama decoding; constant and
#    symbolic sizes) is written as JSON lines.
# 3. The 3.12 environment builds each distinct program with dtcompile's nvfuser_direct
#    backend, validates it and checks the dtype, rank and kind nvFuser infers for every
#    value (scripts/nvfuser_build.py). Non-zero exit on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
PROGRAMS=.nvfuser/programs

source scripts/py312_env.sh

bash scripts/dev.sh setup
export DTCOMPILE_FUSION_RECORD="$PWD/$PROGRAMS" OMP_NUM_THREADS=1
if [ "${1:-}" != "--recorded" ]; then
  rm -rf "$PROGRAMS"
  .venv/bin/python -m pytest -q -n "${PYTEST_WORKERS:-2}" -p no:cacheprovider \
    tests/test_nvfuser.py tests/distributed/test_nvfuser_ranks.py
fi
.venv/bin/torchrun --nproc-per-node 2 scripts/nvfuser_collect.py
unset DTCOMPILE_FUSION_RECORD
PYTHONPATH="$PWD" "$ENV/bin/python" scripts/nvfuser_build.py "$PROGRAMS"
