#!/usr/bin/env bash
# Set up a virtual environment in .venv (once) and run one job in it.
#   scripts/dev.sh demo    torchrun the demo on 2 CPU ranks (Gloo)
#   scripts/dev.sh test    the whole test suite (pytest with xdist), then ruff
#   scripts/dev.sh bench   the overhead benchmark on 1 and 2 ranks
#   scripts/dev.sh setup   only the setup
# The venv sees the system's packages, so a torch already installed there (the GPU
# machine's) is used as is. Where there is none, torch==2.13.0 is installed first: a
# pin, so pip takes the CPU build from this machine's disk and never a newer CUDA one.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv --system-site-packages "$VENV"
  fi
  local py="$VENV/bin/python"
  if ! "$py" -c "import torch" 2>/dev/null; then
    "$py" -m pip install --quiet "torch==2.13.0"
  fi
  # `accelerate launch` starts CPU processes through MPI (tests/test_accelerate_launch.py).
  if ! command -v mpirun >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q openmpi-bin >/dev/null ||
      { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q openmpi-bin >/dev/null; } ||
      echo "dev.sh: could not install openmpi-bin; the accelerate launch test will fail" >&2
  fi
  local stamp="$VENV/.dtcompile-installed"
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    "$py" -m pip install --quiet --disable-pip-version-check -e ".[test]"
    touch "$stamp"
  fi
}

job=${1:-demo}
shift || true
setup
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
case "$job" in
  setup) ;;
  demo) exec "$VENV/bin/torchrun" --nproc-per-node 2 scripts/demo.py "$@" ;;
  test)
    "$VENV/bin/python" -m pytest -n "${PYTEST_WORKERS:-2}" -q -rs "$@"
    "$VENV/bin/ruff" check dtcompile tests scripts
    "$VENV/bin/ruff" format --check dtcompile tests scripts
    ;;
  bench) exec "$VENV/bin/python" scripts/bench_overhead.py "$@" ;;
  *) echo "unknown job: $job (demo, test, bench, setup)" >&2; exit 2 ;;
esac
