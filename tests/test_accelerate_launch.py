"""``accelerate launch`` (Accelerate's own launcher, which starts CPU processes through
MPI) runs ``scripts/train.py --dp 2 --tp 2``: FSDP2 with TP on 4 processes that
Accelerate set up with Gloo, the compiled losses eager's, one compilation.

Accelerate passes OpenMPI ``--bind-to socket``; on a machine with fewer cores than
processes (CI's 2) OpenMPI then refuses to start them, so there an ``mpirun`` first on
the PATH passes ``--bind-to none`` instead. ``scripts/dev.sh setup`` installs OpenMPI
(Debian's ``openmpi-bin``) where it can.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
ACCELERATE = Path(sys.executable).parent / "accelerate"
PROCESSES = 4

UNBOUND_MPIRUN = """#!/bin/bash
# Accelerate's --bind-to socket, replaced: OpenMPI refuses more processes than cores.
args=(); prev=
for a in "$@"; do [ "$prev" = --bind-to ] && a=none; args+=("$a"); prev=$a; done
exec {mpirun} "${{args[@]}}"
"""


def test_train_script_under_accelerate_launch_on_a_2x2_mesh(tmp_path):
    mpirun = shutil.which("mpirun")
    assert mpirun, "accelerate launch needs MPI's mpirun (Debian: openmpi-bin; scripts/dev.sh setup installs it)"
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"localhost slots={PROCESSES}\n")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    }
    if (os.cpu_count() or 1) < PROCESSES:
        shim = tmp_path / "bin" / "mpirun"
        shim.parent.mkdir()
        shim.write_text(UNBOUND_MPIRUN.format(mpirun=mpirun))
        shim.chmod(0o755)
        env["PATH"] = f"{shim.parent}{os.pathsep}{env['PATH']}"
    done = subprocess.run(
        [
            str(ACCELERATE), "launch", "--cpu", "--num_processes", str(PROCESSES), "--num_machines", "1",
            "--mpirun_hostfile", str(hostfile),
            str(SCRIPTS / "train.py"), "--accelerate", "--dp", "2", "--tp", "2", "--steps", "3", "--layers", "1",
        ],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, f"accelerate launch failed:\n{out[-3000:]}\n{done.stderr[-3000:]}"
    assert f"processes set up by Accelerate: DistributedType.MULTI_CPU, {PROCESSES} processes, backend gloo" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit() and len(line.split()) == 4]
    assert len(rows) == 3
    for _, eager, compiled, _ in rows:
        assert abs(float(eager) - float(compiled)) <= 1e-4 * abs(float(eager))
    assert "compiled 1 time(s)" in out
