"""``scripts/train.py --dp 2 --tp 2``: FSDP2 over dp with TP over tp on 4 Gloo ranks, the
compiled losses eager's, and rank 0's printed program showing the collectives."""

import re

from test_scripts import _torchrun


def test_train_script_with_fsdp_and_tp_on_a_2x2_mesh():
    out = _torchrun("train.py", "--steps", "3", "--layers", "1", "--dp", "2", "--tp", "2", "--trace", ranks=4)
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit() and len(line.split()) == 4]
    assert len(rows) == 3
    for _, eager, compiled, _ in rows:
        assert abs(float(eager) - float(compiled)) <= 1e-4 * abs(float(eager))
    assert "compiled 1 time(s)" in out
    forward, backward = out.split("def backward(")
    # torch 2.13's collectives executor runs the dp all-gather as all_gather_single, 2.10's as
    # all_gather_into_tensor.
    assert re.search(r"all_gather_(single|into_tensor)\(", forward) and "mesh dim dp" in forward
    # Started by the collectives executor (2.10's name: reduce_scatter_tensor), waited late.
    assert re.search(r"dist\.reduce_scatter_(single|tensor)\(.*op=dist\.ReduceOp\.AVG", backward)
