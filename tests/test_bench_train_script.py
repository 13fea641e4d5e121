"""``scripts/bench_train.py`` runs (tiny sizes, a few steps): the modes' first-step losses
agree and each mode gets a row with a peak memory. No timing is asserted."""

from test_scripts import _torchrun


def test_bench_train_script_runs_on_2_dp_ranks():
    out = _torchrun(
        "bench_train.py",
        *("--dp", "2", "--tp", "1", "--modes", "eager", "dtcompile", "--header"),
        *("--vocab", "64", "--dim", "32", "--layers", "1", "--calls", "1", "--warmup", "0"),
    )
    rows = {line.split()[2]: line.split() for line in out.splitlines() if line.startswith("2 dp ")}
    assert set(rows) == {"eager", "dtcompile"}
    for row in rows.values():
        assert float(row[5]) > 0  # peak MiB
    agree = next(line for line in out.splitlines() if "first-step losses agree to" in line)
    assert float(agree.split("agree to ")[1].split()[0]) < 1e-5
