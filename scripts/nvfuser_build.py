"""Build the fusion programs the executor formed with nvFuser's own frontend, and check them.

Runs in the Python 3.12 environment that ``scripts/nvfuser_check.sh`` makes (torch 2.10
and ``nvfuser_direct``, which builds and validates definitions without a GPU). Reads the
programs recorded as JSON lines (``DTCOMPILE_FUSION_RECORD``), and for each distinct one:

1. defines it with dtcompile's ``nvfuser_direct`` backend (``define``), as a GPU run would;
2. runs nvFuser's ``validate_definition()``;
3. checks that what nvFuser infers for every value, a tensor's dtype and rank or a
   number's type, is what the program records.

Prints each failure with the program and the failing op, and exits 1 if any.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

from dtcompile.executors.fusion.nvfuser_direct import data_type, define
from dtcompile.executors.fusion.program import NumberInput, program_from_data, value_kinds

# The first letter of a scalar's name in nvFuser's printing, by its type.
_SCALAR_PREFIX = {"int": "i", "float": "d", "bool": "b"}


def load(folder: Path) -> dict[str, dict]:
    """Every distinct program in the folder's JSON lines, by its text."""
    programs: dict[str, dict] = {}
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            data = json.loads(line)
            programs.setdefault(program_from_data(data).text(), data)
    return programs


def mismatches(program, env: dict) -> list[str]:
    """Values whose dtype, rank or kind nvFuser infers otherwise than the program says."""
    found = []
    numbers = {i.name: i.kind for i in program.inputs if isinstance(i, NumberInput)}
    for name, (dtype, rank) in value_kinds(program).items():
        value = env[name]
        if dtype is None:
            if value.is_tensor():
                found.append(f"{name}: nvFuser made a tensor where the program has a number")
            elif name in numbers and not str(value).startswith(_SCALAR_PREFIX[numbers[name]]):
                found.append(f"{name}: nvFuser's scalar {value} is not a {numbers[name]}")
            continue
        if not value.is_tensor():
            found.append(f"{name}: nvFuser made a number where the program has a {dtype} tensor of rank {rank}")
        elif value.ndim != rank or value.dtype() != data_type(dtype):
            found.append(
                f"{name}: nvFuser infers {value.dtype()} of rank {value.ndim}, the program {dtype} of rank {rank}"
            )
    return found


def build(data: dict) -> list[str]:
    """What went wrong building one program (nothing when it built and checks)."""
    from nvfuser_direct import FusionDefinition

    program = program_from_data(data)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed), FusionDefinition() as fd:
            # (its __exit__ prints the error it passes on)
            env = define(fd, program)
        fd.validate_definition()
    except Exception as error:
        failing = _failing_op(program, error)
        return [f"{type(error).__name__}: {' '.join(str(error).split())[:500]}{failing}"]
    return mismatches(program, env)


def _failing_op(program, error) -> str:
    """The op being defined when ``error`` was raised, from the traceback's frames."""
    tb = error.__traceback__
    while tb is not None:
        op = tb.tb_frame.f_locals.get("op") if tb.tb_frame.f_code.co_name == "define" else None
        if op is not None and hasattr(op, "primitive"):
            return f"\n    at: {op}"
        tb = tb.tb_next
    return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="the folder of recorded programs (JSON lines)")
    args = parser.parse_args()
    programs = load(args.folder)
    if not programs:
        print(f"no programs recorded in {args.folder}", file=sys.stderr)
        return 1
    failures = 0
    for text, data in programs.items():
        problems = build(data)
        if problems:
            failures += 1
            print(f"--- program {failures}:\n{text}\n" + "\n".join(f"  {p}" for p in problems) + "\n")
    print(f"nvFuser frontend: {len(programs) - failures} of {len(programs)} distinct programs built and validated")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
