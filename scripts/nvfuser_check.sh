#!/usr/bin/env bash
# nvFuser's own frontend on CPU: every fusion program the executor forms, built and
# validated by nvFuser itself (no GPU needed to build a definition; running one does).
#   scripts/nvfuser_check.sh              record (2.), then build (3.)
#   scripts/nvfuser_check.sh --recorded   build what a test run already recorded in
#                                         .nvfuser/programs (.ci/run does this)
# 1. Once: a Python 3.12 environment in .nvfuser/cpu-env (git-ignored) with torch 2.10 and
#    nvFuser's wheel for it (nvFuser publishes no wheels for Python 3.11 or torch 2.13):
#    about 4.2 GB of downloads and 7 GB on disk, some minutes.
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
ENV=.nvfuser/cpu-env
PROGRAMS=.nvfuser/programs
TORCH_PIN=torch==2.10.0
NVFUSER_PIN=nvfuser-cu128-torch210==0.2.36.dev20260301

find_python312() {
  if [ -n "${PYTHON312:-}" ]; then echo "$PYTHON312"; return; fi
  if command -v python3.12 >/dev/null 2>&1; then command -v python3.12; return; fi
  local root
  root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  for candidate in "$root"/versions/3.12*/bin/python3.12; do
    if [ -x "$candidate" ]; then echo "$candidate"; return; fi
  done
  echo "nvfuser_check: no Python 3.12 found (set PYTHON312); nvFuser's wheels need it" >&2
  exit 2
}

if [ ! -f "$ENV/.ready" ]; then
  start=$(date +%s)
  "$(find_python312)" -m venv "$ENV"
  "$ENV/bin/python" -m pip install --quiet --disable-pip-version-check --pre "$TORCH_PIN" "$NVFUSER_PIN"
  touch "$ENV/.ready"
  echo "nvfuser_check: set up $ENV in $(( $(date +%s) - start )) s"
fi

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
