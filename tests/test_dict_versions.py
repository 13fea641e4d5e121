"""Single process: the prologue checks the module tree and the Python values read from
dicts only when one of those dicts has changed since a call that passed them
(``jit/state_guards.py``, ``unless_dicts_changed``): told by dict watchers on Python 3.12+
(``core/dict_watch.py``), else by the dicts' versions. Each test makes several calls first,
so that the versions are recorded and the checks skipped, then changes the state in one
way a user can: the next call must see it (a miss, eager's result), and a change undone
must give a hit again."""

import collections
import gc
import os
import shutil
import sys
import threading

import pytest
import torch
from torch import nn
from torch._C._dynamo.guards import dict_version as raw_dict_version

import dtcompile
from dtcompile.core import dict_watch
from dtcompile.core.torch_internals import dict_version


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


def counts(jitted):
    return dtcompile.cache_misses(jitted), dtcompile.cache_hits(jitted)


def settle(jitted, model, x, calls=3):
    """Calls that pass every check, the first compiling: the versions (or the count of
    changes) are recorded."""
    for _ in range(calls):
        torch.testing.assert_close(jitted(x), model(x))


class Block(nn.Module):
    SHIFT = 0.0  # a class constant the forward reads

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)  # a library module: its attributes are read by no user code
        self.act = nn.GELU()
        self.gate = nn.Linear(4, 4, bias=False)  # an empty slot
        self.scale = 2.0
        self.table = {"f": torch.tanh}  # a dict of objects the forward reads an item of

    def forward(self, x):
        x = self.gate(self.table["f"](x))
        return self.act(self.norm(self.proj(x))) * self.scale + self.SHIFT


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_this_python_gives_dicts_versions_that_follow_changes():
    # Without versions (or dict watchers) the checks run at every call and the tests
    # below prove less. Python 3.12 keeps an empty dict's version when ``update`` fills
    # it: versions are not used there, its dict watchers tell.
    assert dict_version is not None if sys.version_info < (3, 12) else dict_watch.available


_OPTIONS = {}


class _Optioned(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.options = nn.Linear(4, 4), {}

    def forward(self, x):
        return self.lin(x) * self.options.get("scale", 1.0) + _OPTIONS.get("shift", 0.0)


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("fill", ["update", "|=", "global update"])
def test_an_empty_dict_filled_by_update_after_compiling(fill, cache):
    """``update`` of an empty dict copies the other's keys, and on Python 3.12 leaves its
    version as it was: the compiled call kept the value traced."""
    _OPTIONS.clear()
    torch.manual_seed(0)
    model = _Optioned()
    jitted, x = dtcompile.jit(model, cache=cache), torch.randn(2, 4)
    try:
        with torch.no_grad():
            torch.testing.assert_close(jitted(x), model(x), rtol=0, atol=0)
            if fill == "update":
                model.options.update({"scale": 3.0})
            elif fill == "|=":
                model.options |= {"scale": 3.0}
            else:
                _OPTIONS.update({"shift": 1.0})
            torch.testing.assert_close(jitted(x), model(x), rtol=0, atol=0)
    finally:
        _OPTIONS.clear()


def test_the_checks_are_skipped_while_the_dicts_are_unchanged():
    torch.manual_seed(0)
    model = Model().eval()
    jitted = dtcompile.jit(model)
    settle(jitted, model, torch.randn(2, 4))
    prologue = dtcompile.last_prologue(jitted)
    assert "list(map(TRAINING, MODULES))" in prologue.source  # among the checks skipped
    if dict_watch.available:  # each block of checks passed at the count of changes now
        passed = [value for name, value in prologue.globals.items() if name.startswith("PASSED_CHANGES")]
        assert len(passed) >= 2 and all(p == [dict_watch.changes.value] for p in passed)
        assert "WATCHED_DICTS" not in prologue.source
        return
    passed = [value for name, value in prologue.globals.items() if name.startswith("PASSED_VERSIONS")]
    watched = [value for name, value in prologue.globals.items() if name.startswith("WATCHED_DICTS")]
    # (two gates: the module tree's and Python values', and the order of parameters and buffers)
    assert len(passed) == len(watched) >= 1
    assert all(p == list(map(dict_version, w)) for p, w in zip(passed, watched))


def test_dict_watchers_are_used_where_python_has_them():
    # Python 3.12 tells dict changes (PyDict_AddWatcher) to a callback built with the C
    # compiler; 3.11 does not: versions are read.
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    assert dict_watch.available == (sys.version_info >= (3, 12) and compiler is not None)


def _flag_through_object_setattr(model):
    object.__setattr__(model.blocks[1].norm, "training", True)  # past nn.Module.__setattr__


def _scale_in_the_instance_dict(model):
    model.blocks[2].__dict__["scale"] = 3.0


def _scale_set(model):
    model.blocks[0].scale = -1.0


def _class_constant(model):
    Block.SHIFT = 1.5


def _constant_shadowed_on_the_instance(model):
    model.blocks[1].SHIFT = 0.5


def _submodule_in_the_table(model):
    model.blocks[1]._modules["act"] = nn.ReLU()


def _submodule_set(model):
    model.blocks[2].act = nn.Tanh()


def _hook_added(model):
    model.blocks[0].proj.register_forward_hook(lambda module, args, out: out * 3)


def _pre_hook_added_directly(model):
    model.blocks[0]._forward_pre_hooks[10**9] = lambda module, args: (args[0] * 2,)


def _bias_in_the_empty_slot(model):
    model.blocks[1].gate.bias = nn.Parameter(torch.ones(4))


def _weight_replaced_in_the_table(model):
    model.blocks[2].proj._parameters["weight"] = nn.Parameter(torch.ones(4, 4).t())  # other strides


def _buffer_added(model):
    model.blocks[0].proj.register_buffer("extra", torch.zeros(1))


def _item_of_a_dict_read_replaced(model):
    model.blocks[1].table["f"] = torch.sigmoid  # the dict changes, its holder does not


def _attribute_on_a_weight(model):
    model.blocks[0].proj.weight.tag = "quantized"  # a tensor's Python attributes: a new entry


def _weight_data_replaced(model):
    model.blocks[2].gate.weight.data = torch.ones(4, 4).t()  # no dict changes: its strides do


@pytest.mark.parametrize(
    "change",
    [
        _bias_in_the_empty_slot,
        _weight_replaced_in_the_table,
        _buffer_added,
        _item_of_a_dict_read_replaced,
        _attribute_on_a_weight,
        _weight_data_replaced,
        _flag_through_object_setattr,
        _scale_in_the_instance_dict,
        _scale_set,
        _class_constant,
        _constant_shadowed_on_the_instance,
        _submodule_in_the_table,
        _submodule_set,
        _hook_added,
        _pre_hook_added_directly,
    ],
)
def test_a_change_after_calls_that_skipped_the_checks_is_seen(change):
    torch.manual_seed(0)
    model = Model().eval()
    jitted = dtcompile.jit(model)
    x = torch.randn(2, 4)
    try:
        settle(jitted, model, x)
        change(model)
        torch.testing.assert_close(jitted(x), model(x))
        assert counts(jitted) == (2, 2)
        torch.testing.assert_close(jitted(x), model(x))  # the new state, settled
        assert counts(jitted) == (2, 3)
    finally:
        Block.SHIFT = 0.0


def test_a_change_undone_is_a_hit():
    torch.manual_seed(0)
    model = Model().eval()
    jitted = dtcompile.jit(model)
    x = torch.randn(2, 4)
    settle(jitted, model, x)
    model.blocks[0].scale = 5.0
    model.blocks[0].scale = 2.0  # a new version, the same value
    model.blocks[1].norm.train().eval()
    torch.testing.assert_close(jitted(x), model(x))
    assert counts(jitted) == (1, 3)


def test_a_hook_swapped_for_another_in_a_table_of_one():
    torch.manual_seed(0)
    model = Model().eval()
    handle = model.blocks[1].proj.register_forward_hook(lambda module, args, out: out + 1)
    jitted = dtcompile.jit(model)
    x = torch.randn(2, 4)
    settle(jitted, model, x)
    handle.remove()
    model.blocks[1].proj.register_forward_hook(lambda module, args, out: out - 1)  # still one hook
    torch.testing.assert_close(jitted(x), model(x))
    assert counts(jitted) == (2, 2)


def test_hooks_reordered_without_a_new_version():
    torch.manual_seed(0)
    model = Model().eval()
    proj = model.blocks[0].proj
    proj.register_forward_hook(lambda module, args, out: out * 2)
    second = proj.register_forward_hook(lambda module, args, out: out + 1)
    jitted = dtcompile.jit(model)
    x = torch.randn(2, 4)
    settle(jitted, model, x)
    hooks = proj._forward_hooks
    assert isinstance(hooks, collections.OrderedDict)
    before = raw_dict_version(hooks)
    hooks.move_to_end(second.id, last=False)  # (out + 1) * 2 now
    assert raw_dict_version(hooks) == before  # the order alone: no new version, checked anyway
    torch.testing.assert_close(jitted(x), model(x))
    assert counts(jitted) == (2, 2)


class Counting(nn.Module):
    """A forward that assigns an attribute: its ``__dict__`` changes at every call."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.scale = 2.0
        self.seen = False

    def forward(self, x):
        self.seen = True
        return self.proj(x) * self.scale


def test_a_module_whose_forward_assigns_is_checked_at_every_call():
    torch.manual_seed(0)
    model = Counting().eval()
    jitted = dtcompile.jit(model)
    x = torch.randn(2, 4)
    settle(jitted, model, x)
    assert counts(jitted) == (1, 2)  # no code reads ``seen`` by name: it is not guarded
    model.scale = 4.0
    torch.testing.assert_close(jitted(x), model(x))
    model.proj.train()
    torch.testing.assert_close(jitted(x), model(x))
    assert counts(jitted) == (3, 2)


class GradInside(nn.Module):
    """A forward that turns grad mode on and runs a backward (a force from an energy)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x):
        with torch.enable_grad():
            y = self.lin(x)
            (g,) = torch.autograd.grad(y.sum(), self.lin.weight)
        return g.detach() + 0


def test_a_backward_hook_added_after_compiling_a_call_without_grad_mode():
    """Called without grad mode, the forward may still run a backward inside: a backward
    hook added later changes what it computes, so the next call must see it."""
    model = GradInside()
    jitted = dtcompile.jit(model)
    x = torch.ones(1, 2)
    settle(jitted, model, x)
    model.lin.register_full_backward_pre_hook(lambda module, grad_output: (grad_output[0] * 10,))
    torch.testing.assert_close(jitted(x), model(x))
    assert counts(jitted) == (2, 2)


def test_a_compiled_model_dropped_leaves_the_dicts_another_one_watches():
    """Two compiled forms of one model watch the same dicts; dropping one must not stop the
    other from being told of changes."""
    torch.manual_seed(0)
    model = Model().eval()
    x = torch.randn(2, 4)
    first, second = dtcompile.jit(model), dtcompile.jit(model)
    settle(first, model, x)
    settle(second, model, x)
    del first
    gc.collect()
    model.blocks[0].scale = -1.0
    torch.testing.assert_close(second(x), model(x))
    assert counts(second) == (2, 2)


def test_a_compiled_model_freed_while_an_exception_unwinds():
    """Its watched dicts are released as the frame holding it goes: nothing is reported
    from inside the dicts' deallocation, and the exception reaches the caller as raised."""
    reported = []
    hook, sys.unraisablehook = sys.unraisablehook, reported.append

    def run():
        model = Model().eval()
        jitted = dtcompile.jit(model)
        settle(jitted, model, torch.randn(2, 4))
        raise KeyError("raised by the caller")

    try:
        with pytest.raises(KeyError, match="raised by the caller"):
            run()
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert reported == []


# Ways of changing what a call reads that no dict's version or watcher told (found by
# probing dict watchers on Python 3.12; the first ones gave stale results on both Pythons).


def _hook_swapped_under_its_key(model):
    hooks = model.blocks[0].proj._forward_hooks
    (key,) = hooks
    hooks[key] = lambda module, args, out: out * 5


def _hook_table_replaced(model):
    object.__setattr__(model.blocks[0].proj, "_forward_hooks", collections.OrderedDict())


def _parameter_table_replaced(model):
    proj = model.blocks[0].proj
    object.__setattr__(proj, "_parameters", {"weight": nn.Parameter(torch.ones(4, 4)), "bias": proj.bias})


def _nested_dict_replaced_then_changed(model):
    model.blocks[0].cfg["act"] = {"scale": 2.0}  # equal, a new dict: checked, not watched
    model(torch.zeros(2, 4))


class Hooked(Model):
    def __init__(self):
        super().__init__()
        self.blocks[0].proj.register_forward_hook(lambda module, args, out: out * 2)
        self.blocks[0].cfg = {"act": {"scale": 2.0}}

    def forward(self, x):
        return super().forward(x) * self.blocks[0].cfg["act"]["scale"]


@pytest.mark.parametrize(
    "change",
    [_hook_swapped_under_its_key, _hook_table_replaced, _parameter_table_replaced, _nested_dict_replaced_then_changed],
)
def test_changes_no_dict_tells_are_seen(change):
    torch.manual_seed(0)
    model = Hooked().eval()
    jitted = dtcompile.jit(model)
    x = torch.randn(2, 4)
    settle(jitted, model, x)
    change(model)
    torch.testing.assert_close(jitted(x), model(x))
    if change is _nested_dict_replaced_then_changed:
        model.blocks[0].cfg["act"]["scale"] = 3.0  # the new dict, changed in place
        torch.testing.assert_close(jitted(x), model(x))


def test_submodules_reordered():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).eval()
    jitted = dtcompile.jit(model)
    x = torch.randn(2, 4)
    settle(jitted, model, x)
    model._modules["0"] = model._modules.pop("0")  # runs last now
    torch.testing.assert_close(jitted(x), model(x))


def test_submodules_of_an_ordered_dict_table_moved_to_end():
    """An older model unpickled holds its submodules in an OrderedDict, whose order
    ``move_to_end`` changes with no new version and no watcher's notice."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(4))).eval()
    model._modules = collections.OrderedDict(model._modules)
    jitted = dtcompile.jit(model)
    x = torch.randn(2, 4)
    settle(jitted, model, x)
    model._modules.move_to_end("0")
    torch.testing.assert_close(jitted(x), model(x))


def test_a_parameters_attribute_after_it_was_replaced():
    torch.manual_seed(0)
    model = Model().eval()
    model.blocks[0].proj.weight.tag = 1.0

    def scaled(x):
        return model(x) * getattr(model.blocks[0].proj.weight, "tag", 1.0)

    jitted = dtcompile.jit(scaled)
    x = torch.randn(2, 4)
    settle(jitted, scaled, x)
    new = nn.Parameter(model.blocks[0].proj.weight.detach().clone())
    new.tag = 1.0
    model.blocks[0].proj.weight = new
    torch.testing.assert_close(jitted(x), scaled(x))
    new.tag = 3.0
    torch.testing.assert_close(jitted(x), scaled(x))
    new.__dict__ = {"tag": 4.0}  # its attribute dict replaced whole
    torch.testing.assert_close(jitted(x), scaled(x))


def test_an_attribute_added_to_a_closed_over_tensor():
    w = torch.ones(4)

    def fn(x):
        return x * w * getattr(w, "scale", 1.0)

    jitted = dtcompile.jit(fn)
    x = torch.randn(4)
    settle(jitted, fn, x)
    w.scale = 3.0
    torch.testing.assert_close(jitted(x), fn(x))


def test_calls_from_several_threads_that_compile():
    torch.manual_seed(0)
    model = Model().eval()
    jitted = dtcompile.jit(model)
    inputs = {(i, k): torch.randn(k % 4 + 1 + 10 * i, 4) for i in range(3) for k in range(8)}
    expected = {key: model(x) for key, x in inputs.items()}
    failures = []

    def worker(i):
        try:
            for k in range(8):
                torch.testing.assert_close(jitted(inputs[i, k]), expected[i, k])
        except Exception as error:  # noqa: BLE001 (reported below)
            failures.append(repr(error))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
