#!/usr/bin/env bash
# The one-process tests on a second torch release: torch 2.10 under Python 3.12, in the
# environment nvFuser's frontend check uses (scripts/py312_env.sh; CI runs both). The
# multi-process suite runs on torch 2.13 only (see README, Status).
#   scripts/torch210_tests.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/py312_env.sh
PYTHONPATH="$PWD" OMP_NUM_THREADS=1 "$ENV/bin/python" -m pytest -q -p no:cacheprovider \
  -n "${PYTEST_WORKERS:-2}" tests --ignore=tests/distributed \
  --ignore=tests/test_scripts.py \
  --deselect "tests/test_fake_pg.py::test_2d_mesh_redistributions[37]" \
  --deselect "tests/test_fake_pg.py::test_moe_on_an_8x8_mesh_holds_eagers_collectives" "$@"
# Deselected: eager DTensor itself fails there on torch 2.10 (rank 37 of a fake 8x8 world
# cannot resolve a subgroup by name); dtcompile is compared with eager, so nothing to test.
# The MoE block is not supported on torch 2.10: its meta function of copy_ guards on a size
# read from data (u0 % 8 == 0), which 2.13's does not (docs/design.md, "What is not built yet").
