#!/usr/bin/env bash
# The nvFuser executor on a machine with one NVIDIA GPU and no network (under 8 minutes).
#
# First, where PyPI is reachable, prepare nvFuser's wheel (repacked to fit; not committed):
#     ../shared/tools/make-nvfuser-wheel.sh wheels
# Then, on the GPU machine, from the repository root, with wheels/ beside it:
#     scripts/gpu_check.sh [gpu_check.py flags]
# It installs the wheel into .nvfuser/ (git-ignored), links the CUDA libraries torch ships,
# runs the cuda-marked tests; then, on a 1-rank NCCL mesh, the collection CI builds on CPU
# (scripts/nvfuser_collect.py: the Llama-style block and a Hugging Face Llama decoding,
# constant and symbolic sizes), now run by nvFuser on CUDA against eager; then
# scripts/gpu_check.py: the op-info table with the nvFuser executor, the block forward and
# forward+backward against eager, and the time per call of eager, the torch executor,
# nvFuser and torch.compile.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TARGET=.nvfuser

"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU: nothing to check')"
shopt -s nullglob
wheels=(wheels/nvfuser_*.whl)
if [ ${#wheels[@]} -ne 1 ]; then
  echo "expected one nvFuser wheel in wheels/, found ${#wheels[@]}: run ../shared/tools/make-nvfuser-wheel.sh wheels where PyPI is reachable" >&2
  exit 2
fi
if [ ! -d "$TARGET/nvfuser_direct" ]; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$TARGET" "${wheels[0]}"
fi
# The repacked libraries find libnvrtc at $ORIGIN/../../nvidia/cu13/lib: the nvidia/ folder beside torch.
nvidia=$("$PYTHON" -c "import os, torch; print(os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), 'nvidia'))")
ln -sfn "$nvidia" "$TARGET/nvidia"
export PYTHONPATH="$PWD/$TARGET:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NVFUSER_MASTER_PORT=${NVFUSER_MASTER_PORT:-29611}  # avoids the one symbol torch 2.11 lacks
export PYTHONUNBUFFERED=1

"$PYTHON" -c "import nvfuser_direct; print('nvfuser_direct', getattr(nvfuser_direct, '__version__', '?'), 'imports')"
timeout 120 "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/test_nvfuser.py
timeout 150 "$PYTHON" -m torch.distributed.run --nproc-per-node 1 scripts/nvfuser_collect.py --device cuda --backend nvfuser_direct
timeout 330 "$PYTHON" -m torch.distributed.run --nproc-per-node 1 scripts/gpu_check.py "$@"
