#!/usr/bin/env bash
# Sourced by scripts/nvfuser_check.sh and scripts/torch210_tests.sh: the Python 3.12
# environment in .nvfuser/cpu-env (git-ignored), set up once: torch 2.10 (PyPI's default
# Linux build, CUDA 12.8, which runs on CPU too), nvFuser's wheel for it, and what the
# tests need. About 4.2 GB of downloads and 7 GB on disk, some minutes.
ENV=.nvfuser/cpu-env
TORCH_PIN=torch==2.10.0
NVFUSER_PIN=nvfuser-cu128-torch210==0.2.36.dev20260301

# A candidate counts only if it runs: pyenv's shim for python3.12 exists on PATH even
# when the selected version is another one, and then fails with exit code 127.
find_python312() {
  if [ -n "${PYTHON312:-}" ]; then echo "$PYTHON312"; return; fi
  local root candidate
  root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  for candidate in $(command -v python3.12 2>/dev/null) "$root"/versions/3.12*/bin/python3.12; do
    if [ -x "$candidate" ] && "$candidate" -c 'import venv' >/dev/null 2>&1; then
      echo "$candidate"; return
    fi
  done
  echo "nvfuser_check: no Python 3.12 found (set PYTHON312); nvFuser's wheels need it" >&2
  exit 2
}

if [ ! -f "$ENV/.ready" ]; then
  start=$(date +%s)
  "$(find_python312)" -m venv "$ENV"
  # torch pinned in every install, so that nothing upgrades it.
  "$ENV/bin/python" -m pip install --quiet --disable-pip-version-check --pre "$TORCH_PIN" "$NVFUSER_PIN"
  "$ENV/bin/python" -m pip install --quiet --disable-pip-version-check "$TORCH_PIN" \
    pytest pytest-xdist numpy "transformers>=5" "accelerate>=1.0" expecttest
  touch "$ENV/.ready"
  echo "set up $ENV in $(( $(date +%s) - start )) s"
fi
# Added since: torch's op database (tests/test_opinfo.py) imports expecttest.
if ! "$ENV/bin/python" -c "import expecttest" 2>/dev/null; then
  "$ENV/bin/python" -m pip install --quiet --disable-pip-version-check "$TORCH_PIN" expecttest
fi

