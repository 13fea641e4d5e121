"""The state of torch's objects that is the user's (an optimizer's param_groups, a
scheduler's counters, a GradScaler's scale, a distribution's parameters), read inside a
compiled call, is guarded like a config's: a change between calls is seen."""

import pytest
import torch

import dtcompile

CACHES = ["constant values", "symbolic values"]


class SubclassedSGD(torch.optim.SGD):
    pass


def _descent(compiled: bool, cache: str, optimizer_class, change: str) -> list:
    weight = torch.nn.Parameter(torch.ones(4))
    optimizer = optimizer_class([weight], lr=0.5)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)

    @torch.no_grad()
    def update():
        weight.add_(weight.grad, alpha=-optimizer.param_groups[0]["lr"])

    step = dtcompile.jit(update, cache=cache) if compiled else update
    weights = []
    for _ in range(4):
        (weight * weight * 0.1).sum().backward()
        step()
        if change == "scheduler":
            scheduler.step()
        elif change == "by hand":
            optimizer.param_groups[0]["lr"] *= 0.5
        else:  # a state dict loaded: new groups, the learning rate a quarter
            state = optimizer.state_dict()
            state["param_groups"][0]["lr"] /= 4
            optimizer.load_state_dict(state)
        optimizer.zero_grad(set_to_none=False)  # (the same .grad tensor at each call)
        weights.append(weight.detach().clone())
    return weights


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("optimizer_class", [torch.optim.SGD, torch.optim.AdamW, SubclassedSGD])
@pytest.mark.parametrize("change", ["scheduler", "by hand", "state dict loaded"])
def test_an_optimizers_learning_rate_read_inside_is_read_at_each_change(cache, optimizer_class, change):
    expected = _descent(False, cache, optimizer_class, change)
    got = _descent(True, cache, optimizer_class, change)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


@pytest.mark.parametrize("cache", CACHES)
def test_a_schedulers_counters_read_inside(cache):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)

    def last_lr_and_epoch(x):
        return x * scheduler.get_last_lr()[0] * scheduler.last_epoch

    jitted = dtcompile.jit(last_lr_and_epoch, cache=cache)
    for _ in range(3):
        x = torch.ones(2)
        assert torch.equal(jitted(x), last_lr_and_epoch(x))
        optimizer.step()
        scheduler.step()


@pytest.mark.parametrize("cache", CACHES)
def test_a_distributions_parameters_and_a_scalers_scale(cache):
    normal = torch.distributions.Normal(torch.zeros(3), torch.ones(3))

    def log_prob(x):
        return normal.log_prob(x)

    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)

    def scaled(x):
        return x * 2 if scaler._scale is None else x * scaler._scale

    x = torch.randn(3)
    jitted, jitted_scaled = dtcompile.jit(log_prob, cache=cache), dtcompile.jit(scaled, cache=cache)
    for change in (
        lambda: None,
        lambda: setattr(normal, "loc", torch.ones(3)),  # another tensor in its place
        lambda: normal.scale.mul_(2),  # the same tensor, changed (read at run time)
        lambda: scaler._lazy_init_scale_growth_tracker(torch.device("cpu")),
        lambda: scaler.update(8.0),
    ):
        change()
        torch.testing.assert_close(jitted(x), log_prob(x), rtol=0, atol=0)
        torch.testing.assert_close(jitted_scaled(x), scaled(x), rtol=0, atol=0)


@pytest.mark.parametrize("cache", CACHES)
def test_a_scalers_scale_made_inside_is_refused_and_put_back(cache):
    """``GradScaler.scale`` first called inside makes the scaler's scale tensor there (a
    change to an object the call closes over): refused, as the user's own would be, and
    the scaler is left as it was (no traced tensor in it)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)

    def scaled_loss(x):
        return scaler.scale((x * 2).sum())

    with pytest.raises(dtcompile.TracingError, match="changed 'scaler'"):
        dtcompile.jit(scaled_loss, cache=cache)(torch.ones(3))
    assert scaler._scale is None
    assert scaled_loss(torch.ones(3)).item() == 24.0
    torch.testing.assert_close(dtcompile.jit(scaled_loss, cache=cache)(torch.ones(3)), scaled_loss(torch.ones(3)))


def _scaled_losses(compiled: bool, cache: str) -> tuple[list, object]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1)

    def scaled_loss(x):
        return scaler.scale(model(x).pow(2).mean())

    loss_fn = dtcompile.jit(scaled_loss, cache=cache) if compiled else scaled_loss
    scaler.scale(torch.ones(()))  # (its scale tensor made before the compiled call)
    losses = []
    for step in range(5):
        loss = loss_fn(torch.full((2, 4), float(step)))
        loss.backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, loss_fn


@pytest.mark.parametrize("cache", CACHES)
def test_a_scalers_steps_do_not_compile_the_loss_anew(cache):
    """``update()`` replaces the scaler's per-optimizer stages at each step, which only its
    own step methods read: a loss scaled inside compiles once, and its values are eager's."""
    expected, _ = _scaled_losses(False, cache)
    got, loss_fn = _scaled_losses(True, cache)
    assert got == expected
    assert dtcompile.cache_misses(loss_fn) == 1


class _HoldsItsOptimizer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.optimizer = torch.optim.SGD(self.parameters(), lr=0.5)  # (never read by forward)

    def forward(self, x):
        return self.lin(x) * OPTIMIZER.param_groups[0]["lr"]


OPTIMIZER = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.5)


@pytest.mark.parametrize("cache", CACHES)
def test_an_optimizer_over_the_calls_parameters_can_be_reached(cache):
    """A module holding its optimizer (whose groups hold the module's parameters), and a
    forward reading a global optimizer's learning rate: compiled, and the rate's changes seen."""
    model = _HoldsItsOptimizer()
    jitted, x = dtcompile.jit(model, cache=cache), torch.ones(2, 3)
    for lr in (0.5, 0.25, 0.25):
        OPTIMIZER.param_groups[0]["lr"] = lr
        torch.testing.assert_close(jitted(x), model(x), rtol=0, atol=0)
    assert dtcompile.cache_misses(jitted) == 2
    OPTIMIZER.param_groups[0]["lr"] = 0.5


def _optimizer_reads(compiled: bool, cache: str, change: str) -> list:
    w = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.Adam([w], lr=0.5)

    def read(x):
        state = optimizer.state.get(w, {})
        groups = optimizer.param_groups
        return (
            x * len(optimizer.state)
            + x * sum(g["lr"] for g in groups)
            + x * float(len(groups))
            + (x * state["exp_avg"].sum() if "exp_avg" in state else x)
        )

    run = dtcompile.jit(read, cache=cache) if compiled else read
    results = []
    for step in range(3):
        results.append(run(torch.ones(2)))
        w.grad = torch.full((3,), float(step + 1))
        optimizer.step()  # (its state made at the first step)
        if change == "group added":
            optimizer.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))], "lr": 0.25 * (step + 1)})
        elif change == "group replaced":
            optimizer.param_groups[0] = dict(optimizer.param_groups[0], lr=optimizer.param_groups[0]["lr"] / 4)
    return results


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("change", ["steps only", "group added", "group replaced"])
def test_an_optimizers_state_and_groups_read_inside(cache, change):
    """Its per-parameter state (made at the first step; the call's tensor's own), its
    groups added or replaced: read as eager reads them, a parameter of the call among them."""
    for got, want in zip(_optimizer_reads(True, cache, change), _optimizer_reads(False, cache, change)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize(
    "make",
    [
        lambda w: torch.optim.SGD([w], lr=0.1),
        lambda w: torch.optim.lr_scheduler.StepLR(torch.optim.SGD([w], lr=0.1), 1),
        lambda w: torch.amp.GradScaler("cpu"),
    ],
    ids=["optimizer", "scheduler", "scaler"],
)
def test_such_an_object_passed_as_an_argument_is_refused_by_name(make):
    weight = torch.nn.Parameter(torch.ones(4))
    thing = make(weight)
    compiled = dtcompile.jit(lambda w, state, x: (w * x).sum())
    with pytest.raises(
        dtcompile.UnsupportedInputError, match=rf"args\[1\] is a {type(thing).__name__} .*Close over it"
    ):
        compiled(weight, thing, torch.ones(4))
