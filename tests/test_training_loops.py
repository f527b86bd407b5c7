"""Right numbers inside real training loops (issue 12): phases, explicit global steps,
activation checkpointing, NaN provenance without host syncs, the raise option, and real
Lightning and 🤗 Trainer runs on CPU with tiny models."""
from __future__ import annotations

import contextlib
import copy
import json
import math
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import hookplug


from conftest import RecordSink as Collect  # noqa: E402


# -- models --------------------------------------------------------------------------------------

class PoisonLinear(nn.Linear):
    """A Linear whose output gets ``poison`` added (0 or NaN): the planted forward NaN."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.register_buffer("poison", torch.zeros(()))

    def forward(self, x):
        return super().forward(x) + self.poison


class _NanGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


class TenNet(nn.Module):
    """Ten Linear modules in a chain. ``plant_grad=k``: the gradient reaching layer k's
    output becomes NaN (an op right after layer k); the forward stays finite."""

    def __init__(self, width=8):
        super().__init__()
        self.layers = nn.ModuleList(PoisonLinear(width, width) for _ in range(10))
        self.plant_grad = None

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == self.plant_grad:
                x = _NanGrad.apply(x)
        return x


class NoSync(TorchDispatchMode):
    """Fails on any op that reads a device value on the host (``.item()``, ``bool(t)``,
    ``.tolist()``, a device-to-host copy) while active."""

    BAD = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default}

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if func in self.BAD:
            raise AssertionError(f"host sync on the hot path: {func}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_host_reads(monkeypatch):
    """Inside: the dispatch mode above, and Tensor methods that read values on the host
    raise (they would sync a device)."""
    def refuse(name):
        def method(self, *a, **k):
            raise AssertionError(f"Tensor.{name}() on the hot path")
        return method

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__"):
            m.setattr(torch.Tensor, name, refuse(name))
        mode = NoSync()
        with mode:
            yield mode
        assert mode.ops > 0  # the mode did see the step's ops


# -- phases ---------------------------------------------------------------------------------------

def test_eval_between_steps_is_kept_apart_and_tagged():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    sink = Collect()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hookplug.attach(model, "Linear", plugins="stats", sink=sink, flush_every=1) as s:
        for step in range(3):
            model.train()
            model(torch.randn(5, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            model.eval()
            with torch.no_grad():
                model(torch.randn(3, 4))
            with torch.inference_mode():
                model.train()  # train mode, but under inference_mode: still eval
                model(torch.randn(2, 4))
            s.step()
        train, ev = s["stats"].results(phase="train"), s["stats"].results(phase="eval")
        both = s["stats"].results()
    by = {(r["step"], r["module"], r["phase"]): r for r in sink.records}
    assert len(by) == len(sink.records) == 3 * 2 * 2
    for step in range(3):
        assert by[(step, "0", "train")]["numel"] == 5 * 8
        assert by[(step, "0", "eval")]["numel"] == (3 + 2) * 8
    assert int(train["0"]["output"].numel) == 3 * 5 * 8
    assert int(ev["0"]["output"].numel) == 3 * 5 * 8
    assert int(both["0"]["output"].numel) == 3 * 10 * 8


def test_explicit_global_step_and_resume_continue_numbering():
    model = nn.Sequential(nn.Linear(4, 4))
    sink = Collect()
    with hookplug.attach(model, "Linear", plugins="stats", sink=sink, flush_every=2) as s:
        for _ in range(2):
            model(torch.randn(2, 4))
            s.flush()  # flushing per micro-batch never duplicates a step
            model(torch.randn(2, 4))
            s.step()
    assert [r["step"] for r in sink.records] == [0, 1]
    # a resumed run: the trainer's global step 100 labels the step that just ended
    sink2 = Collect()
    with hookplug.attach(model, "Linear", plugins="stats", sink=sink2, flush_every=1) as s:
        model(torch.randn(2, 4))
        s.step(step=100)
        for _ in range(2):
            model(torch.randn(2, 4))
            s.step()
        assert s.step_index == 103
    assert [r["step"] for r in sink2.records] == [100, 101, 102]
    assert all(r["numel"] == 8 for r in sink2.records)  # one call each: never merged twice
    with pytest.raises(ValueError):
        hookplug.attach(model, "Linear", plugins="stats").step(step=-1)


def test_a_step_numbered_at_or_before_one_that_ended_warns_once():
    """A per-epoch batch index passed as ``step=`` repeats numbers: records of different
    steps would share them silently."""
    model = nn.Sequential(nn.Linear(4, 4))
    sink = Collect()
    with hookplug.attach(model, "Linear", plugins="stats", sink=sink, flush_every=1) as s:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for i in (0, 1, 5):  # growing, with gaps: no warning
                model(torch.randn(2, 4))
                s.step(step=i)
        for epoch in range(2):
            for i in range(2):
                model(torch.randn(2, 4))
                if epoch == 0 and i == 0:
                    with pytest.warns(RuntimeWarning, match=r"step\(step=0\) ends a step numbered at "
                                      r"or before one that already ended \(5\)"):
                        s.step(step=i)
                else:
                    with warnings.catch_warnings():
                        warnings.simplefilter("error")  # once per session
                        s.step(step=i)
    assert [r["step"] for r in sink.records] == [0, 1, 5, 0, 1, 0, 1]


def test_next_step_numbers_the_step_starting_and_samples_by_it():
    """``step(step=L, next_step=N)``: the step ending is labelled L, the one starting is
    numbered N (a trainer counting batches while stepping every k of them), and sampled by N."""
    model = nn.Sequential(nn.Linear(4, 4))
    sink = Collect()
    with hookplug.attach(model, "Linear", plugins="stats", sink=sink, flush_every=1, every=4) as s:
        for first in (0, 2, 4, 6):
            model(torch.randn(2, 4))
            s.step(step=first, next_step=first + 2)
        assert s.step_index == 8
        with pytest.raises(ValueError, match=r"next_step=\.\.\.\) expects a number after the step ending \(8\), got 8"):
            s.step(next_step=8)
        for bad in (-1, True, 2.0):
            with pytest.raises(ValueError, match="next_step=...\\) expects an int >= 0"):
                s.step(next_step=bad)
        assert s.step_index == 8  # refused calls end no step
    assert [r["step"] for r in sink.records] == [0, 4]


# -- activation checkpointing ---------------------------------------------------------------------

class Blocks(nn.Module):
    def __init__(self, use_ckpt=None):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 6)) for _ in range(3))
        self.use_ckpt = use_ckpt  # None: plain; True/False: checkpoint(use_reentrant=...)

    def forward(self, x):
        for b in self.blocks:
            if self.use_ckpt is None:
                x = b(x)
            else:
                x = checkpoint(b, x, use_reentrant=self.use_ckpt)
        return x


def _run_blocks(use_ckpt):
    model = Blocks(use_ckpt)
    plugins = [("stats", {"sites": ("output", "grad")}), ("capture", {"keep": "all", "grads": True}),
               "flops"]
    with hookplug.attach(model, "Linear", plugins=plugins) as s:
        for _ in range(2):
            x = torch.randn(4, 6, requires_grad=True)
            model(x).square().sum().backward()
            s.step()
        stats = {(m, p): int(st.numel) for m, d in s["stats"].results().items() for p, st in d.items()}
        captured = {m: len(v) for m, v in s["capture"].features.items()}
        grads = {m: len([g for g in v if g is not None]) for m, v in s["capture"].grads.items()}
        flops = {m: r["flops"] for m, r in s["flops"].results().items()}
        flops.update({(m, "backward"): r["backward_flops"] for m, r in s["flops"].results().items()})
        out = s["stats"].results()["blocks.2.2"]["output"]
        maxes = (float(out.max), float(out.mean))
    return stats, captured, grads, flops, maxes


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_recompute_is_not_counted_twice(use_reentrant):
    plain = _run_blocks(None)
    ckpt = _run_blocks(use_reentrant)
    stats, captured, grads, flops, maxes = ckpt
    assert stats == plain[0] and len(stats) == 12  # 6 Linear x (output, grad)
    assert all(n == 2 * 4 * 6 for n in stats.values())
    assert captured == plain[1] and set(captured.values()) == {2}
    forward = {k: v for k, v in flops.items() if not isinstance(k, tuple)}
    assert forward == {k: v for k, v in plain[3].items() if not isinstance(k, tuple)}
    assert all(f > 0 for f in plain[3].values())
    assert maxes == pytest.approx(plain[4])
    backward = {k: v for k, v in flops.items() if isinstance(k, tuple)}
    plain_backward = {k: v for k, v in plain[3].items() if isinstance(k, tuple)}
    # backward FLOPs: the plain ones plus each recomputed module's forward (README); the
    # non-reentrant recompute stops early, after the GELU the second Linear saved
    recomputed = {(m, "backward"): forward[m] if use_reentrant or m.endswith(".0") else 0
                  for m in forward}
    assert backward == {k: plain_backward[k] + recomputed[k] for k in plain_backward}
    assert sum(recomputed.values()) > 0
    if not use_reentrant:
        assert grads == plain[2] and set(grads.values()) == {2}


def test_checkpoint_reentrant_capture_grads_match_their_calls():
    plain, ckpt = _run_blocks(None), _run_blocks(True)
    assert ckpt[2] == plain[2] and set(ckpt[2].values()) == {2}


class GradContexts(hookplug.Plugin):
    """Records ``(module, call_index, step, phase, |grad|)`` for every output-gradient hook."""

    name = "ctx"

    def __init__(self):
        self.seen = []

    @hookplug.hookimpl
    def hookplug_output_grad(self, ctx, grad):
        self.seen.append((ctx.name, ctx.call_index, ctx.step, ctx.phase,
                          round(float(grad.abs().sum()), 4)))


class SharedAcrossCheckpoints(nn.Module):
    """``shared`` runs in every checkpoint segment (three calls per forward), and each segment
    has its own Linear: backward recomputes the segments last to first."""

    def __init__(self, use_reentrant=None):
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(6, 6)
        self.own = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.use_reentrant = use_reentrant

    def segment(self, own, x):
        return own(torch.tanh(self.shared(x)))

    def forward(self, x):
        for own in self.own:
            if self.use_reentrant is None:
                x = self.segment(own, x)
            else:
                x = checkpoint(self.segment, own, x, use_reentrant=self.use_reentrant)
        return x


def _shared_grads_and_contexts(use_reentrant, selector):
    """Two steps of two accumulated micro-batches: the captured grads per call, and the
    (call_index, step, phase) every grad hook saw, per module."""
    model = SharedAcrossCheckpoints(use_reentrant)
    contexts = GradContexts()
    with hookplug.attach(model, selector, plugins=[("capture", {"keep": "all", "grads": True}),
                                                   contexts]) as s:
        torch.manual_seed(1)
        for _ in range(2):
            for _ in range(2):
                x = torch.randn(4, 6, requires_grad=True)
                model(x).square().sum().backward()
            s.step()
        grads = {m: [g.clone() for g in v] for m, v in s["capture"].grads.items()}
    seen = {}
    for name, call, step, phase, _ in contexts.seen:
        seen.setdefault(name, []).append((call, step, phase))
    return grads, {m: sorted(v) for m, v in seen.items()}


@pytest.mark.parametrize("selector", ["Linear", "*:shared"])  # shared alone per segment
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint_grads_of_a_module_shared_by_segments_reach_their_own_call(use_reentrant,
                                                                              selector):
    plain_grads, plain_seen = _shared_grads_and_contexts(None, selector)
    grads, seen = _shared_grads_and_contexts(use_reentrant, selector)
    assert seen == plain_seen  # every grad hook saw the call index and step of its own call
    assert [c for c, _, _ in plain_seen["shared"]] == list(range(12))  # 3 calls x 4 forwards
    hooked = {"shared", "own.0", "own.1", "own.2"} if selector == "Linear" else {"shared"}
    assert set(grads) == set(plain_grads) == hooked
    for name, expected in plain_grads.items():
        assert len(grads[name]) == len(expected) == (12 if name == "shared" else 4)
        for got, want in zip(grads[name], expected):
            torch.testing.assert_close(got, want)


class FrozenNormSegments(nn.Module):
    """Two checkpointed segments, each a Linear and a BatchNorm1d frozen in eval mode (as
    detection backbones freeze theirs) inside a model that trains."""

    def __init__(self, use_reentrant=None):
        super().__init__()
        torch.manual_seed(0)
        self.segs = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Tanh())
                                  for _ in range(2))
        self.use_reentrant = use_reentrant

    def train(self, mode=True):
        super().train(mode)
        for seg in self.segs:
            seg[1].eval()
        return self

    def forward(self, x):
        for seg in self.segs:
            x = seg(x) if self.use_reentrant is None else checkpoint(
                seg, x, use_reentrant=self.use_reentrant)
        return x


def test_reentrant_checkpoint_with_frozen_norms_and_validation_between_steps():
    """Calls of eval-mode submodules inside a training model are part of a recompute's
    sequence; a validation forward (model.eval(), no_grad) is not remembered."""
    def run(mode):
        model, contexts = FrozenNormSegments(mode), GradContexts()
        torch.manual_seed(1)
        with hookplug.attach(model, "Linear|BatchNorm1d", plugins=contexts) as s:
            for _ in range(2):
                model.eval()
                with torch.no_grad():
                    model(torch.randn(4, 6))
                assert not s._recompute._nodes  # nothing kept for a validation forward
                model.train()
                model(torch.randn(4, 6, requires_grad=True)).sum().backward()
                s.step()
        return sorted(contexts.seen)

    plain = run(None)
    # the frozen norms run in the training step: phase "train" (the model's mode)
    assert len(plain) == 8 and {p for _, _, _, p, _ in plain} == {"train"}
    assert [c for n, c, *_ in plain if n == "segs.0.0"] == [1, 3]  # validation calls count
    assert run(True) == plain


def test_reentrant_recompute_that_matches_nothing_keeps_call_index_minus_one():
    """A checkpointed function whose first forward was not seen (attached in between) is not
    tied to a wrong call, although other calls were remembered."""
    model, contexts = SharedAcrossCheckpoints(True), GradContexts()
    x = torch.randn(4, 6, requires_grad=True)
    out = model(x).square().sum()  # forward before attach
    with hookplug.attach(model, "Linear", plugins=contexts) as s:
        kept = model(torch.randn(4, 6, requires_grad=True))  # seen, never backpropagated
        assert s._recompute._nodes
        out.backward()
        del kept
    assert contexts.seen and {c for _, c, *_ in contexts.seen} == {-1}


class Ckpt(nn.Module):
    """``lin`` under a reentrant checkpoint, optionally inside an outer one with ``pre``."""

    def __init__(self, nested=False):
        super().__init__()
        torch.manual_seed(0)
        self.pre, self.lin = nn.Linear(6, 6), nn.Linear(6, 6)
        self.nested = nested

    def inner(self, x):
        return checkpoint(self.lin, x, use_reentrant=True)

    def forward(self, x):
        if self.nested:
            return checkpoint(lambda t: self.inner(self.pre(t).tanh()), x, use_reentrant=True)
        return self.inner(self.pre(x).tanh())


def _contexts(model, run):
    """``run(model, session)`` under a session recording every grad hook's context."""
    contexts = GradContexts()
    with hookplug.attach(model, "Linear", plugins=contexts) as s:
        run(model, s)
    return sorted(contexts.seen)


def _two_forwards_then_two_backwards(model, s):
    x = torch.randn(4, 6, requires_grad=True)
    first, second = model(x).sum(), (model(x) * 10).sum()
    first.backward()  # backward in forward order: the first pass's calls are not the latest
    second.backward()


def _no_grad_pass_between(model, s):
    x = torch.randn(4, 6, requires_grad=True)
    out = model(x).sum()
    with torch.no_grad():  # e.g. a target pass of the same model, in training mode
        model(x)
    out.backward()


def _retain_graph_twice(model, s):
    out = model(torch.randn(4, 6, requires_grad=True)).sum()
    out.backward(retain_graph=True)
    out.backward()


class _Unwrapped(nn.Module):
    """Runs a :class:`Ckpt`'s modules without checkpointing."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x):
        return self.m.lin(self.m.pre(x).tanh())


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("run", [_two_forwards_then_two_backwards, _no_grad_pass_between,
                                 _retain_graph_twice])
def test_reentrant_checkpoint_grads_match_plain_in_unusual_orders(run, nested):
    """Every grad hook sees the context of its own call: backward in forward order, a no-grad
    pass between forward and backward, a graph backpropagated twice, nested checkpoints."""
    torch.manual_seed(3)
    plain = _contexts(Ckpt(nested), lambda m, s: run(_Unwrapped(m), s))
    torch.manual_seed(3)
    ckpt = _contexts(Ckpt(nested), run)
    assert len(plain) >= 2 and min(c for _, c, *_ in plain) >= 0
    assert ckpt == plain


def test_remembered_calls_go_with_the_graph():
    """Nothing is held for a graph that is gone, even if step() is never called."""
    import gc

    model = Ckpt(nested=True)
    with hookplug.attach(model, "Linear", plugins=("stats", {"sites": ("output", "grad")})) as s:
        for _ in range(20):
            model(torch.randn(4, 6, requires_grad=True)).sum().backward()
        gc.collect()
        assert len(s._recompute._nodes) == 0


class TwoOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return y, {"twice": y * 2}


class CheckpointsTwoOutputs(nn.Module):
    def __init__(self, use_reentrant=None):
        super().__init__()
        torch.manual_seed(0)
        self.two = TwoOutputs()
        self.use_reentrant = use_reentrant

    def segment(self, x):
        y, d = self.two(x)
        return y + d["twice"].tanh()

    def forward(self, x):
        if self.use_reentrant is None:
            return self.segment(x)
        return checkpoint(self.segment, x, use_reentrant=self.use_reentrant)


@pytest.mark.parametrize("keep", ["all", "last"])
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint_capture_grads_of_a_structured_output_equal_plain(use_reentrant, keep):
    def run(mode):
        model = CheckpointsTwoOutputs(mode)
        with hookplug.attach(model, "TwoOutputs",
                             plugins=("capture", {"keep": keep, "grads": True})) as s:
            torch.manual_seed(1)
            for _ in range(2):
                model(torch.randn(2, 4, requires_grad=True)).square().sum().backward()
                s.step()
            grads = s["capture"].grads["two"]
            return grads if keep == "all" else [grads]

    plain, ckpt = run(None), run(use_reentrant)
    assert len(plain) == len(ckpt) == (2 if keep == "all" else 1)
    for want, got in zip(plain, ckpt):
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1]["twice"], want[1]["twice"])


def test_hf_gpt2_reentrant_gradient_checkpointing_grads_match_plain():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2,
                                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

    def run(reentrant):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config)
        model.train()
        if reentrant:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": True})
            model.enable_input_require_grads()
        with hookplug.attach(model, "Conv1D", plugins=("capture", {"keep": "all", "grads": True})) as s:
            ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
            for _ in range(2):
                model(input_ids=ids, labels=ids).loss.backward()
                s.step()
            return {m: [g.clone() for g in v] for m, v in s["capture"].grads.items()}

    plain, ckpt = run(False), run(True)
    assert set(ckpt) == set(plain) and len(plain) == 8  # 2 layers x (c_attn, c_proj, c_fc, mlp c_proj)
    for name, expected in plain.items():
        assert len(ckpt[name]) == len(expected) == 2, name
        for got, want in zip(ckpt[name], expected):
            torch.testing.assert_close(got, want)


# -- NaN provenance ---------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["forward", "backward"])
def test_planted_nan_is_reported_as_that_module_without_sync(case, monkeypatch):
    torch.manual_seed(0)
    model = TenNet()
    sink = Collect()
    planted = 6
    with hookplug.attach(model, "Linear", plugins=("stats", {"sites": ("output", "grad")}),
                         sink=sink) as s:
        for step in range(3):
            bad = step == 1
            if case == "forward":
                model.layers[planted].poison.fill_(math.nan if bad else 0.0)
            else:
                model.plant_grad = planted if bad else None
            x = torch.randn(4, 8)
            with no_host_reads(monkeypatch):  # the step itself: forward, backward
                model(x).sum().backward()
            s.step()
        s.flush()
    assert s.nonfinite == [{"step": 1, "module": f"layers.{planted}",
                            "site": "output" if case == "forward" else "grad",
                            "phase": "train", "rank": 0}]
    marked = [r for r in sink.records if r["first_nonfinite"]]
    assert [(r["step"], r["module"]) for r in marked] == [(1, f"layers.{planted}")]
    bad_records = [r for r in sink.records if r["nan_count"] > 0]
    assert {r["step"] for r in bad_records} == {1}
    if case == "forward":  # everything after the planted layer is NaN too: the clock decides
        assert {r["module"] for r in bad_records if r["site"] == "output"} == {
            f"layers.{i}" for i in range(planted, 10)}
    else:  # the forward is finite; the grads of the layers before it are NaN too
        assert not [r for r in bad_records if r["site"] == "output"]
        assert {r["module"] for r in bad_records} == {f"layers.{i}" for i in range(planted + 1)}


def test_nonfinite_raise_names_module_site_phase_and_step():
    torch.manual_seed(0)
    model = TenNet()
    with pytest.raises(ValueError, match="nonfinite"):
        hookplug.attach(model, "Linear", plugins=("stats", {"nonfinite": "explode"}))
    s = hookplug.attach(model, "Linear", plugins=("stats", {"sites": ("output", "grad"),
                                                             "nonfinite": "raise"}))
    try:
        model(torch.randn(2, 8)).sum().backward()
        s.step(step=41)  # a clean step: no error
        model.plant_grad = 3
        model(torch.randn(2, 8)).sum().backward()
        with pytest.raises(FloatingPointError, match=r"step 42.*'layers\.3', grad \(train\)"):
            s.step()
        model.plant_grad = None
        model(torch.randn(2, 8)).sum().backward()
        s.step()  # the next clean step raises nothing
        model.layers[8].poison.fill_(math.inf)
        model.eval()
        with torch.no_grad():
            model(torch.randn(2, 8))
        with pytest.raises(FloatingPointError, match=r"step 44.*'layers\.8', output \(eval\)"):
            s.step()
    finally:
        s.remove()



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nonfinite_raise_on_cuda_comes_one_step_later_without_sync(monkeypatch):
    torch.manual_seed(0)
    model = TenNet().cuda()
    s = hookplug.attach(model, "Linear", plugins=("stats", {"sites": ("output", "grad"),
                                                             "nonfinite": "raise"}))
    try:
        model.layers[2].poison.fill_(math.nan)
        with no_host_reads(monkeypatch):
            model(torch.randn(2, 8, device="cuda")).sum().backward()
        s.step()  # the copy of step 0's first_bad column starts here: nothing is read yet
        model.layers[2].poison.fill_(0.0)
        with no_host_reads(monkeypatch):
            model(torch.randn(2, 8, device="cuda")).sum().backward()
        torch.cuda.synchronize()  # the test's own wait, so the copy has surely landed
        with pytest.raises(FloatingPointError, match=r"step 0.*'layers\.2', output \(train\)"):
            s.step()
    finally:
        s.remove()

# -- real trainers -----------------------------------------------------------------------------------

def test_lightning_trainer_steps_phases_and_tensorboard(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    pytest.importorskip("tensorboard")
    from lightning.pytorch.loggers import Logger, TensorBoardLogger
    from lightning.pytorch.utilities import rank_zero_only
    from torch.utils.data import DataLoader, TensorDataset

    from hookplug.integrations.lightning import HookplugCallback

    class StepLogger(Logger):
        """What Lightning logs, and at which step."""

        def __init__(self):
            super().__init__()
            self.steps = {}

        name, version = "steps", 0

        @rank_zero_only
        def log_metrics(self, metrics, step=None):
            for k in metrics:
                self.steps.setdefault(k, set()).add(step)

        def log_hyperparams(self, params, *a, **k):
            pass

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

        def training_step(self, batch, idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, idx):
            x, y = batch
            self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    sink = Collect()
    cb = HookplugCallback("Linear", ["stats"], sink=[sink, "tensorboard"], flush_every=1)
    steps, tb = StepLogger(), TensorBoardLogger(str(tmp_path), name="tb", version=0)
    trainer = pl.Trainer(max_steps=6, accumulate_grad_batches=2, val_check_interval=4,
                         check_val_every_n_epoch=None, limit_val_batches=2,
                         num_sanity_val_steps=2, log_every_n_steps=1, logger=[steps, tb],
                         callbacks=[cb], enable_progress_bar=False, enable_checkpointing=False,
                         enable_model_summary=False, accelerator="cpu", devices=1)
    trainer.fit(Tiny(), DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))
    assert trainer.global_step == 6 and cb.session.removed
    train = [r for r in sink.records if r["phase"] == "train"]
    ev = [r for r in sink.records if r["phase"] == "eval"]
    # one record per optimizer step and module, numbered as Lightning logs the step
    assert sorted(r["step"] for r in train if r["module"] == "net.0") == sorted(steps.steps["train_loss"])
    assert sorted(steps.steps["train_loss"]) == [0, 1, 2, 3, 4, 5]
    assert all(r["numel"] == 2 * 4 * 8 for r in train if r["module"] == "net.0")  # 2 micro-batches
    # validation (every 4 batches = 2 optimizer steps) is apart, with Lightning's step; the
    # sanity check runs before training starts and is not recorded
    assert sorted({r["step"] for r in ev}) == sorted(steps.steps["val_loss"]) == [1, 3, 5]
    assert all(r["numel"] == 2 * 4 * 8 for r in ev if r["module"] == "net.0")
    # the "tensorboard" sink wrote through the TensorBoardLogger's own writer
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(tb.log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train_loss", "hookplug/max/net.0/output", "hookplug_eval/max/net.0/output"} <= tags
    assert [e.step for e in acc.Scalars("hookplug/max/net.2/output")] == [0, 1, 2, 3, 4, 5]


def test_trainer_writer_reaches_a_tensorboard_sink_named_in_the_config_file(tmp_path):
    """The callbacks' ``"tensorboard"`` sink without a path writes through the trainer's
    writer also when it comes from ``config=`` (a file or a dict); a path keeps its own."""
    from hookplug.integrations import _attach_kwargs_with_writer

    writer = object()
    cfg = tmp_path / "t.toml"
    cfg.write_text('select = "Linear"\nflush_every = 2\n[plugins.stats]\nbins = 0\n'
                   '[sinks.tensorboard]\nstats = ["max"]\n[sinks.jsonl]\npath = "runs/x"\n')
    got = _attach_kwargs_with_writer({"config": str(cfg)}, writer)
    assert got["sink"] == {"tensorboard": {"stats": ["max"], "writer": writer},
                           "jsonl": {"path": str(tmp_path / "runs" / "x")}}  # next to the file
    as_dict = {"select": "Linear", "sinks": {"tensorboard": {}}}
    assert _attach_kwargs_with_writer({"config": as_dict}, writer)["sink"] == {"tensorboard": {"writer": writer}}
    own = {"config": {"sinks": {"tensorboard": {"path": str(tmp_path)}}}}
    assert "sink" not in _attach_kwargs_with_writer(own, writer)  # the file's path stands
    assert _attach_kwargs_with_writer({"sink": "tensorboard"}, writer)["sink"] == ("tensorboard", {"writer": writer})
    assert _attach_kwargs_with_writer({"config": str(cfg)}, None) == {"config": str(cfg)}


def test_the_trainer_writer_of_a_tensorboard_logger_subclass(tmp_path):
    """A subclass of Lightning's ``TensorBoardLogger`` gives its writer to the sink too (it
    went unnoticed: the sink wrote under ./runs)."""
    pytest.importorskip("lightning.pytorch")
    pytest.importorskip("tensorboard")
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    from hookplug.integrations.lightning import _tensorboard_writer

    class MyLogger(TensorBoardLogger):
        pass

    class Trainer:
        loggers = [CSVLogger(str(tmp_path)), MyLogger(str(tmp_path))]

    assert _tensorboard_writer(Trainer()) is Trainer.loggers[1].experiment


@pytest.mark.parametrize("kwargs, error, match", [
    ({}, hookplug.PluginError, "plugins= is required"),
    ({"plugins": ["statz"]}, hookplug.PluginError, "Did you mean 'stats'"),
    ({"plugins": [("stats", {"bins": "x"})]}, hookplug.PluginError, "option 'bins'"),
    ({"plugins": "stats", "flush_every": 0}, ValueError, "flush_every must be"),
    ({"plugins": "stats", "sink": "jsonx"}, hookplug.PluginError, "Did you mean 'jsonl'"),
    ({"plugins": "stats", "evry": 2}, TypeError, "unexpected keyword argument 'evry'"),
    ({"plugins": "stats", "start_step": 3}, TypeError, "not a callback option"),
    ({"selector": "Linear,", "plugins": "stats"}, hookplug.SelectorError, "empty term"),
    ({"selector": {"Linear|": "stats"}}, hookplug.SelectorError, "empty class name"),
])
@pytest.mark.parametrize("which", ["lightning", "transformers"])
def test_callback_arguments_are_checked_when_it_is_made(which, kwargs, error, match):
    """Not at the first batch, after the trainer's setup and sanity check; the error names
    the callback."""
    if which == "lightning":
        pytest.importorskip("lightning.pytorch")
        from hookplug.integrations.lightning import HookplugCallback as cls
    else:
        pytest.importorskip("transformers")
        from hookplug.integrations.transformers import HookplugTrainerCallback as cls
    kwargs = dict(kwargs)
    with pytest.raises(error, match=match) as info:
        cls(kwargs.pop("selector", "Linear"), **kwargs)
    assert str(info.value).startswith(cls.__name__)
    cls("Linear", "stats", every=2, sink="jsonl", flush_every=4)  # (fine ones pass)


def test_lightning_wandb_logger_and_the_wandb_sink_share_one_run(tmp_path, monkeypatch):
    """``sink="wandb"`` logs into the run of the trainer's ``WandbLogger`` (offline), one row
    per optimizer step labelled with Lightning's step, and leaves that run open."""
    pl = pytest.importorskip("lightning.pytorch")
    wandb = pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger
    from torch.utils.data import DataLoader, TensorDataset

    from hookplug.integrations.lightning import HookplugCallback

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

        def training_step(self, batch, idx):
            loss = nn.functional.mse_loss(self.net(batch[0]), batch[1])
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    logger = WandbLogger(project="hookplug-test", save_dir=str(tmp_path), offline=True)
    rows = []
    sink = Collect()
    cb = HookplugCallback("Linear", ["stats"], sink=[sink, ("wandb", {"stats": ("max",)})],
                          flush_every=2)
    trainer = pl.Trainer(max_steps=4, logger=logger, callbacks=[cb], log_every_n_steps=1,
                         enable_progress_bar=False, enable_checkpointing=False,
                         enable_model_summary=False, accelerator="cpu", devices=1)
    run = logger.experiment
    log = run.log
    run.log = lambda data, *a, **k: (rows.append(dict(data)), log(data, *a, **k))[1]
    try:
        data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
        trainer.fit(Tiny(), DataLoader(data, batch_size=4))
        mine = [r for r in rows if "hookplug/step" in r]
        assert [r["hookplug/step"] for r in mine] == [0, 1, 2, 3]
        for r in sink.records:
            row = mine[r["step"]]
            assert row[f"hookplug/max/{r['module']}/output"] == r["max"]
        assert any("train_loss" in r for r in rows)  # Lightning's own rows, same run
        assert wandb.run is run  # not finished by the sink
    finally:
        run.finish()


@pytest.mark.parametrize("checkpointing", [None, "reentrant", "non-reentrant"])
def test_transformers_trainer_steps_and_eval_phase(tmp_path, checkpointing):
    """Also with the Trainer's gradient checkpointing: the recompute adds nothing, and the
    output gradients are measured once per call."""
    transformers = pytest.importorskip("transformers")
    from hookplug.integrations.transformers import HookplugTrainerCallback

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2,
                                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)  # from config: no weights downloaded

    class Data(torch.utils.data.Dataset):
        def __init__(self, n):
            g = torch.Generator().manual_seed(n)
            self.ids = torch.randint(0, 64, (n, 12), generator=g)

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    sink = Collect()
    cb = HookplugTrainerCallback("Conv1D|Linear", [("stats", {"sites": ("output", "grad")})],
                                 sink=sink, flush_every=1)
    ckpt = {} if checkpointing is None else {
        "gradient_checkpointing": True,
        "gradient_checkpointing_kwargs": {"use_reentrant": checkpointing == "reentrant"}}
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, per_device_eval_batch_size=4, eval_strategy="steps",
        eval_steps=4, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
        disable_tqdm=True, learning_rate=1e-3, **ckpt)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Data(64),
                                   eval_dataset=Data(8), callbacks=[cb])
    trainer.train()
    assert trainer.state.global_step == 8 and cb.session.removed
    logged = {e["step"] for e in trainer.state.log_history if "loss" in e}
    logged_eval = {e["step"] for e in trainer.state.log_history if "eval_loss" in e}
    assert logged == set(range(1, 9)) and logged_eval == {4, 8}
    first = next(iter(cb.session.modules))
    mine = [r for r in sink.records if r["module"] == first]
    train = [r for r in mine if r["phase"] == "train" and r["site"] == "output"]
    grads = [r for r in mine if r["phase"] == "train" and r["site"] == "grad"]
    ev = [r for r in mine if r["phase"] == "eval"]
    assert sorted(r["step"] for r in train) == sorted(r["step"] for r in grads) == sorted(logged)
    assert sorted(r["step"] for r in ev) == sorted(logged_eval)  # one record per optimizer step
    assert {r["site"] for r in ev} == {"output"}  # no backward in evaluation
    # a step holds its 2 micro-batches of 4 sequences; an eval holds its 8 sequences
    assert {r["numel"] for r in train} == {r["numel"] for r in grads} == {r["numel"] for r in ev} \
        == {8 * 12 * 3 * 16}  # c_attn


def test_integrations_are_imported_lazily():
    import subprocess
    import sys

    code = ("import sys, hookplug, hookplug.integrations as i; "
            "assert not {'lightning', 'pytorch_lightning', 'transformers'} & set(sys.modules); "
            "assert i.__all__ == ['lightning', 'transformers']")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- where a session starts, trainers failing, manual optimization -------------------------

def _hookplug_hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
               for m in model.modules())


def test_start_step_numbers_the_first_step_for_sampling():
    """``every=N`` samples by step number from the very first step: a loop resumed at global
    step 5 records 6 and 9 with every=3 (not 5, which used to be taken as step 0)."""
    model = nn.Sequential(nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for start, want in ((5, [6, 9]), (6, [6, 9]), (0, [0, 3, 6, 9])):
        sink = Collect()
        with hookplug.attach(model, "Linear", plugins=["stats", "params"], every=3, sink=sink,
                             flush_every=1, start_step=start) as s:
            assert s.step_index == start and s.sampled == (start % 3 == 0)
            for gstep in range(start, 11):
                model(torch.randn(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
                s.step(step=gstep)
        stats = sorted({r["step"] for r in sink.records if "calls" in r and r["site"] == "output"})
        params = sorted({r["step"] for r in sink.records if r["site"] in ("weight", "update")})
        assert stats == want and params == want, (start, stats, params)
    for bad in (-1, 1.0, True):
        with pytest.raises(ValueError, match="start_step"):
            hookplug.attach(model, "Linear", plugins="stats", start_step=bad)


def _tiny_gpt2(transformers):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=1, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)  # from config: no weights downloaded


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(n)
        self.ids = torch.randint(0, 32, (n, 8), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _hf_args(transformers, tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4,
                per_device_eval_batch_size=4, report_to=[], use_cpu=True, save_strategy="no",
                disable_tqdm=True, logging_strategy="no")
    return transformers.TrainingArguments(**{**base, **kw})


@pytest.mark.parametrize("how", ["callback_raises", "nonfinite_raise", "add_callback"])
def test_transformers_trainer_raising_removes_the_session_and_flushes(tmp_path, how):
    """``train()`` raising (another callback, hookplug's own ``nonfinite="raise"``) leaves no
    hook on the model; the telemetry so far is flushed and the error reaches the caller as it
    was raised."""
    transformers = pytest.importorskip("transformers")
    from hookplug.integrations.transformers import HookplugTrainerCallback

    model = _tiny_gpt2(transformers)
    plugins = ["stats"]
    if how == "nonfinite_raise":
        plugins = [("stats", {"nonfinite": "raise"})]
        with torch.no_grad():
            model.lm_head.weight[0, 0] = float("inf")  # tied to the embedding: step 1 is non-finite

    class Boom(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 3:
                raise RuntimeError("boom at step 3")

    sink = Collect()
    cb = HookplugTrainerCallback("Linear", plugins, sink=sink, flush_every=10)
    callbacks = [cb, Boom()] if how != "nonfinite_raise" else [cb]
    trainer = transformers.Trainer(model=model, args=_hf_args(transformers, tmp_path, max_steps=6),
                                   train_dataset=_Tokens(40),
                                   callbacks=None if how == "add_callback" else callbacks)
    if how == "add_callback":  # after the Trainer is made: no on_init_end for it
        for c in callbacks:
            trainer.add_callback(c)
    error = FloatingPointError if how == "nonfinite_raise" else RuntimeError
    with pytest.raises(error, match="lm_head" if how == "nonfinite_raise" else "boom at step 3"):
        trainer.train()
    assert cb.session.removed and _hookplug_hooks(model) == 0
    steps = sorted({r["step"] for r in sink.records})
    if how == "nonfinite_raise":
        assert steps == [1] and cb.session.nonfinite == [
            {"step": 1, "module": "lm_head", "site": "output", "phase": "train", "rank": 0}]
    else:
        assert steps == [1, 2, 3]
        assert {r["numel"] for r in sink.records} == {4 * 8 * 32}
    seen = {k: int(v["output"].numel) for k, v in cb.session["stats"].results().items()}
    with torch.no_grad():
        model(torch.randint(0, 32, (2, 8)))  # later use of the model adds nothing
    assert {k: int(v["output"].numel) for k, v in cb.session["stats"].results().items()} == seen


def test_transformers_callback_as_a_context_manager_removes_the_session():
    pytest.importorskip("transformers")
    from hookplug.integrations.transformers import HookplugTrainerCallback

    m = nn.Sequential(nn.Linear(3, 3))
    cb = HookplugTrainerCallback("Linear", ["stats"])
    with pytest.raises(KeyError):
        with cb:
            cb.on_train_begin(None, None, None, model=m)
            assert _hookplug_hooks(m) > 0
            raise KeyError("stop")
    assert cb.session.removed and _hookplug_hooks(m) == 0
    with pytest.raises(TypeError, match="start_step"):
        HookplugTrainerCallback("Linear", ["stats"], start_step=3)


@pytest.mark.parametrize("eval_on_start", [False, True])
def test_transformers_every_and_eval_on_start_follow_the_trainer_steps(tmp_path, eval_on_start):
    """``every=2`` samples the Trainer's steps 2, 4 (step 1, the session's first, is not
    taken); ``eval_on_start=True`` records the evaluation before training at step 0, where the
    Trainer logs it. Every evaluation is recorded, also the one after step 5, which
    ``every=2`` does not sample (it was dropped: the evaluation ran with the step's
    sampling)."""
    transformers = pytest.importorskip("transformers")
    from hookplug.integrations.transformers import HookplugTrainerCallback

    evaluated = []

    class Evals(transformers.TrainerCallback):
        def on_evaluate(self, args, state, control, **kw):
            evaluated.append(state.global_step)

    results = {}
    for every in (1, 2):
        sink = Collect()
        cb = HookplugTrainerCallback("Linear", ["stats", ("params", {"params": "*.weight", "bins": 0})],
                                     sink=sink, flush_every=1, every=every)
        evaluated.clear()
        args = _hf_args(transformers, tmp_path, max_steps=5, eval_strategy="steps", eval_steps=2,
                        eval_on_start=eval_on_start)
        transformers.Trainer(model=_tiny_gpt2(transformers), args=args, train_dataset=_Tokens(40),
                             eval_dataset=_Tokens(8), callbacks=[cb, Evals()]).train()
        stats = [r for r in sink.records if not r["module"].endswith(".weight")]
        results[every] = (sorted(r["step"] for r in stats if r["phase"] == "train"),
                          sorted(r["step"] for r in stats if r["phase"] == "eval"),
                          {r["numel"] for r in stats if r["phase"] == "eval"},
                          # (the evaluation before training got weight and update=0 records)
                          sorted({r["step"] for r in sink.records if r["module"].endswith(".weight")}))
    evals = [0, 2, 4, 5] if eval_on_start else [2, 4, 5]
    assert evaluated == evals
    assert results[1] == ([1, 2, 3, 4, 5], evals, {8 * 8 * 32}, [1, 2, 3, 4, 5])  # one eval run each
    assert results[2] == ([2, 4], evals, {8 * 8 * 32}, [2, 4])


def test_transformers_every_n_records_each_epoch_evaluation(tmp_path):
    """``eval_strategy="epoch"``: the Trainer evaluates after steps 3 and 6 (3 steps an
    epoch), which ``every=4`` does not sample; both evaluations are recorded (they were
    dropped). The flow callback decides at the epoch's end, seen in ``on_epoch_end``."""
    transformers = pytest.importorskip("transformers")
    from hookplug.integrations.transformers import HookplugTrainerCallback

    sink = Collect()
    cb = HookplugTrainerCallback("Linear", ["stats"], sink=sink, flush_every=1, every=4)
    args = _hf_args(transformers, tmp_path, num_train_epochs=2, eval_strategy="epoch")
    transformers.Trainer(model=_tiny_gpt2(transformers), args=args, train_dataset=_Tokens(12),
                         eval_dataset=_Tokens(8), callbacks=[cb]).train()
    steps = {phase: sorted({r["step"] for r in sink.records if r["phase"] == phase}) for phase in ("train", "eval")}
    assert steps == {"train": [4], "eval": [3, 6]}
    assert {r["numel"] for r in sink.records if r["phase"] == "eval"} == {8 * 8 * 32}


def _lightning_step_logger(pl, key):
    from lightning.pytorch.loggers import Logger

    class Steps(Logger):
        name, version = "steps", 0

        def __init__(self):
            super().__init__()
            self.steps = []

        def log_metrics(self, metrics, step=None):
            if key in metrics:
                self.steps.append(step)

        def log_hyperparams(self, *a, **k):
            pass

    return Steps()


def _lightning_gan(pl):
    class GAN(pl.LightningModule):
        """Manual optimization, two optimizers: ``global_step`` advances by 2 per batch."""

        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.automatic_optimization = False
            self.g, self.d = nn.Linear(8, 8), nn.Linear(8, 1)

        def training_step(self, batch, idx):
            (x,) = batch
            opt_g, opt_d = self.optimizers()
            loss_d = self.d(x).mean() - self.d(self.g(x).detach()).mean()
            opt_d.zero_grad()
            self.manual_backward(loss_d)
            opt_d.step()
            loss_g = -self.d(self.g(x)).mean()
            opt_g.zero_grad()
            self.manual_backward(loss_g)
            opt_g.step()
            self.log("loss_g", loss_g)

        def configure_optimizers(self):
            return (torch.optim.SGD(self.g.parameters(), lr=0.01),
                    torch.optim.SGD(self.d.parameters(), lr=0.01))

    return GAN()


def _lightning_regression(pl):
    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))

        def training_step(self, batch, idx):
            (x,) = batch
            loss = self.net(x).pow(2).mean()
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Tiny()


_LIGHTNING_QUIET = dict(enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                        devices=1, log_every_n_steps=1)


def test_lightning_manual_optimization_two_optimizers_steps_as_logged():
    pl = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader, TensorDataset

    from hookplug.integrations.lightning import HookplugCallback

    sink = Collect()
    cb = HookplugCallback("Linear", ["stats"], sink=sink, flush_every=2)
    logger = _lightning_step_logger(pl, "loss_g")
    trainer = pl.Trainer(max_epochs=1, limit_train_batches=4, callbacks=[cb], logger=logger,
                         enable_checkpointing=False, **_LIGHTNING_QUIET)
    trainer.fit(_lightning_gan(pl), DataLoader(TensorDataset(torch.randn(16, 8)), batch_size=4))
    assert trainer.global_step == 8 and logger.steps == [0, 1, 2, 3]
    assert sorted(r["step"] for r in sink.records if r["module"] == "g") == [0, 1, 2, 3]
    # one batch per step: g runs twice on 4 samples
    assert {r["numel"] for r in sink.records if r["module"] == "g"} == {2 * 4 * 8}


@pytest.mark.parametrize("manual", [False, True])
def test_lightning_resumed_run_samples_by_the_logged_step(tmp_path, manual):
    """A run resumed from a mid-epoch checkpoint with ``every=2`` records the logged steps
    that are even, from the first one on (its first step is 3: not sampled)."""
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from hookplug.integrations.lightning import HookplugCallback

    make = _lightning_gan if manual else _lightning_regression
    key = "loss_g" if manual else "loss"
    per_batch = 2 if manual else 1  # global steps per batch
    data = DataLoader(TensorDataset(torch.randn(40, 8)), batch_size=4)
    ck = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=3 * per_batch,
                         save_top_k=-1)
    pl.Trainer(max_steps=3 * per_batch, callbacks=[ck], logger=False, **_LIGHTNING_QUIET).fit(
        make(pl), data)
    (path,) = (tmp_path / "ck").iterdir()
    sink = Collect()
    cb = HookplugCallback("Linear", ["stats"], sink=sink, flush_every=1, every=2)
    logger = _lightning_step_logger(pl, key)
    pl.Trainer(max_steps=8 * per_batch, callbacks=[cb], logger=logger, enable_checkpointing=False,
               **_LIGHTNING_QUIET).fit(make(pl), data, ckpt_path=str(path))
    assert logger.steps == [3, 4, 5, 6, 7]
    assert sorted({r["step"] for r in sink.records}) == [4, 6]


@pytest.mark.parametrize("manual", [False, True])
def test_lightning_resumed_from_a_validation_checkpoint_samples_by_the_logged_step(tmp_path, manual):
    """A checkpoint ``ModelCheckpoint`` saves when a mid-epoch validation ends holds
    Lightning's logging count one short (the epoch loop adds the one in the first iteration
    of the resumed run, which skips the validation already run): resumed with ``every=2``,
    the first step (logged 4) is sampled by its own number. Under manual optimization it was
    numbered 3 at attach: step 4 was left out."""
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from hookplug.integrations.lightning import HookplugCallback

    def make(pl):
        model = (_lightning_gan if manual else _lightning_regression)(pl)
        type(model).validation_step = lambda self, batch, idx: None  # a class of its own
        return model

    key = "loss_g" if manual else "loss"
    per_batch = 2 if manual else 1  # global steps per batch
    data = DataLoader(TensorDataset(torch.randn(40, 8)), batch_size=4)
    val = DataLoader(TensorDataset(torch.randn(8, 8)), batch_size=4)
    ck = ModelCheckpoint(dirpath=str(tmp_path / "ck"), save_top_k=-1)  # saved at validation end
    common = dict(val_check_interval=4, limit_val_batches=1, num_sanity_val_steps=0, **_LIGHTNING_QUIET)
    pl.Trainer(max_steps=4 * per_batch, callbacks=[ck], logger=False, **common).fit(make(pl), data, val)
    (path,) = (tmp_path / "ck").iterdir()
    sink = Collect()
    cb = HookplugCallback("Linear", ["stats"], sink=sink, flush_every=1, every=2)
    logger = _lightning_step_logger(pl, key)
    pl.Trainer(max_steps=8 * per_batch, callbacks=[cb], logger=logger, enable_checkpointing=False,
               **common).fit(make(pl), data, val, ckpt_path=str(path))
    assert logger.steps == [4, 5, 6, 7]
    assert sorted({r["step"] for r in sink.records if r["phase"] == "train"}) == [4, 6]


def test_lightning_manual_optimization_stepping_every_k_batches_samples_by_its_labels():
    """Manual optimization stepping every 2 batches: Lightning's logging count advances per
    batch, so a step was labelled by the batch that stepped (1, 3, 5, 7) while sampled by
    the label before plus one (0, 2, 4, 6): ``every=4`` recorded steps 1 and 5. Each step is
    now numbered, sampled and labelled by its first batch's logging step."""
    pl = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader, TensorDataset

    from hookplug.integrations.lightning import HookplugCallback

    class Accumulating(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.automatic_optimization = False
            self.net = nn.Linear(8, 1)

        def training_step(self, batch, idx):
            (x,) = batch
            loss = self.net(x).pow(2).mean()
            self.manual_backward(loss / 2)
            if idx % 2 == 1:
                opt = self.optimizers()
                opt.step()
                opt.zero_grad()
            self.log("loss", loss)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    sink = Collect()
    cb = HookplugCallback("Linear", ["stats"], sink=sink, flush_every=1, every=4)
    logger = _lightning_step_logger(pl, "loss")
    data = DataLoader(TensorDataset(torch.randn(32, 8)), batch_size=4)
    pl.Trainer(max_epochs=1, callbacks=[cb], logger=logger, enable_checkpointing=False,
               **_LIGHTNING_QUIET).fit(Accumulating(), data)
    assert logger.steps == list(range(8))
    assert sorted({r["step"] for r in sink.records}) == [0, 4]
    assert {r["calls"] for r in sink.records} == {2}  # both batches of the step


def test_lightning_compiled_submodule_second_fit_compiles_nothing(fresh_python):
    """Lightning's recipe ``self.net = torch.compile(self.net)``, the sanity check on, fit
    twice (a fresh process: dynamo's hook guards not switched on yet). The callback switches
    the guards on when it is made, so the sanity check's graph is kept when training
    attaches, and the second fit (sanity check, a new session, validation) runs the graphs
    of the first: nothing compiles. Before, the first attach dropped the sanity check's
    code and the second fit compiled it again."""
    pytest.importorskip("lightning.pytorch")
    last = fresh_python(
        "import warnings, torch, torch.nn as nn\n"
        "import lightning.pytorch as pl\n"
        "from hookplug.integrations.lightning import HookplugCallback\n"
        "warnings.simplefilter('ignore')\n"
        "graphs = [0]\n"
        "def backend(gm, inputs):\n"
        "    graphs[0] += 1\n"
        "    return gm.forward\n"
        "class M(pl.LightningModule):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.net = torch.compile(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)),\n"
        "                                 backend=backend)\n"
        "    def training_step(self, b, i):\n"
        "        return nn.functional.mse_loss(self.net(b[0]), b[1])\n"
        "    def validation_step(self, b, i):\n"
        "        self.log('val', nn.functional.mse_loss(self.net(b[0]), b[1]))\n"
        "    def configure_optimizers(self):\n"
        "        return torch.optim.SGD(self.parameters(), lr=0.1)\n"
        "g = torch.Generator().manual_seed(0)\n"
        "data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g))\n"
        "dl = lambda: torch.utils.data.DataLoader(data, batch_size=4)\n"
        "cb = HookplugCallback('Linear', [('stats', {'sites': ('output', 'grad')})])\n"
        "trainer = pl.Trainer(max_steps=4, accelerator='cpu', logger=False, enable_checkpointing=False,\n"
        "                     enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],\n"
        "                     val_check_interval=2, limit_val_batches=2, num_sanity_val_steps=2)\n"
        "model = M()\n"
        "trainer.fit(model, dl(), dl())\n"
        "first = graphs[0]\n"
        "assert sorted(cb.session.results()['stats']) == ['net.0', 'net.2']\n"
        "trainer.fit_loop.epoch_loop.max_steps = 8\n"
        "trainer.fit(model, dl(), dl())\n"
        "assert cb.session.removed and trainer.global_step == 8\n"
        "print([first, graphs[0]])\n")
    first, second = json.loads(last)
    assert second == first  # the second fit compiled nothing


def test_transformers_callback_measures_a_skipped_steps_gradients_before_the_trainer_zeroes_them():
    """The Trainer zeroes the gradients between ``optimizer.step()`` and ``on_step_end``: a
    step GradScaler skipped (no optimizer hook runs) has its inf/NaN gradients measured at
    ``on_optimizer_step`` (they were gone by the time the step ended: no grad record)."""
    pytest.importorskip("transformers")
    from types import SimpleNamespace

    from hookplug.integrations.transformers import HookplugTrainerCallback

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = Collect()
    cb = HookplugTrainerCallback("Linear", [("params", {"bins": 0})], sink=sink)
    args, state, control = SimpleNamespace(eval_on_start=False), SimpleNamespace(global_step=0), None
    cb.on_train_begin(args, state, control, model=model)
    for step in range(2):  # the Trainer's order of calls around one optimizer step
        cb.on_step_begin(args, state, control)
        loss = model(torch.randn(3, 4)).sum()
        (loss * (math.inf if step == 1 else 1.0)).backward()
        if step == 0:
            opt.step()  # step 1 is skipped, as GradScaler skips a step with inf/NaN gradients
        cb.on_optimizer_step(args, state, control)
        model.zero_grad()
        state.global_step += 1
        cb.on_step_end(args, state, control)
    cb.on_train_end(args, state, control)
    grads = {r["step"]: r for r in sink.records if r["module"] == "0.weight" and r["site"] == "grad"}
    assert set(grads) == {1, 2}
    assert grads[1]["nan_count"] + grads[1]["inf_count"] == 0
    assert grads[2]["nan_count"] + grads[2]["inf_count"] == grads[2]["numel"] > 0


# -- mixed precision: autocast and GradScaler ----------------------------------------------------

def _amp_loop(model, x, steps, overflow, plugins=None):
    """float16 autocast steps with a ``GradScaler`` (the loss times 1e9 at step ``overflow``:
    an inf gradient, the step skipped). Without ``plugins``: plain torch hooks on every Linear
    give, per step, float64 copies of its outputs and output gradients, and the gradient the
    optimizer was given (or left, on the skipped step). Returns that, the session's records
    and the weights after the loop."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = Collect()
    ref = {"output": [], "grad": [], "param": [], "scale": []}
    handles = []
    if plugins is None:
        def fwd(name):
            def hook(_m, _a, out):
                ref["output"][-1].setdefault(name, []).append(out.detach().double())
                out.register_hook(lambda g: ref["grad"][-1].setdefault(name, []).append(g.double()))
            return hook
        handles = [m.register_forward_hook(fwd(n)) for n, m in model.named_modules()
                   if isinstance(m, nn.Linear)]
        handles.append(opt.register_step_pre_hook(lambda *_: ref["param"].__setitem__(
            -1, {n: p.grad.double() for n, p in model.named_parameters()})))
    session = (hookplug.attach(model, "Linear", plugins=plugins, sink=sink, flush_every=1)
               if plugins is not None else contextlib.nullcontext())
    with session as s:
        for step in range(steps):
            for k in ref:
                ref[k].append({})
            ref["scale"][-1] = scaler.get_scale()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().square().mean() * (1e9 if step == overflow else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if not ref["param"][-1]:  # skipped: what the step left (unscaled by scaler.step)
                ref["param"][-1] = {n: p.grad.double() for n, p in model.named_parameters()}
            if s is not None:
                s.step()
            opt.zero_grad()
    for h in handles:
        h.remove()
    return ref, sink.records, [p.detach().clone() for p in model.parameters()]


def _assert_stats_of(r, values, what):
    x = torch.cat([v.reshape(-1) for v in values])
    finite = x[x.isfinite()]
    assert r["numel"] == x.numel(), what
    assert r["nan_count"] == int(x.isnan().sum()) and r["inf_count"] == int(x.isinf().sum()), what
    if finite.numel():
        assert r["min"] == float(finite.min()) and r["max"] == float(finite.max()), what
        assert r["l2"] == pytest.approx(float(finite.norm()), rel=1e-5), what


def test_grad_scaler_loop_stats_and_params_against_plain_torch():
    """float16 autocast with a GradScaler, one step overflowing (skipped, its scale halved):
    the steps are those without hooks; ``stats`` measures the float16 outputs and the
    *scaled* output gradients as backward computed them (the skipped step's inf/NaN counted);
    ``params``' grad site is the *unscaled* gradient the optimizer used, and on the skipped
    step the unscaled gradient ``scaler.step`` left (its inf/NaN counted)."""
    from hookplug.models import MLP

    torch.manual_seed(0)
    base = MLP()
    x = torch.randn(6, 32)
    ref, _, want_w = _amp_loop(copy.deepcopy(base), x, 3, overflow=1)
    plugins = [("stats", {"sites": ("output", "grad")}), ("params", {"sites": ("grad",)})]
    _, records, got_w = _amp_loop(copy.deepcopy(base), x, 3, overflow=1, plugins=plugins)
    assert all(torch.equal(a, b) for a, b in zip(got_w, want_w))
    assert ref["scale"] == [2.0**12, 2.0**13, 2.0**12]  # step 1 skipped, the scale backed off
    rec = {(r["step"], r["module"], r["site"]): r for r in records}
    bad = 0
    for step in range(3):
        for site in ("output", "grad"):
            for name, values in ref[site][step].items():
                assert values[0].dtype == torch.float64
                _assert_stats_of(rec[(step, name, site)], values, (step, name, site))
                bad += sum(int((~v.isfinite()).sum()) for v in values) if site == "grad" else 0
        for name, g in ref["param"][step].items():
            _assert_stats_of(rec[(step, name, "grad")], [g], (step, name, "param grad"))
    assert bad > 0  # the overflow reached the grad site
    assert any(rec[(1, n, "grad")]["inf_count"] + rec[(1, n, "grad")]["nan_count"] > 0
               for n in ref["param"][1])


def test_lightning_fabric_setup_model_is_named_as_the_model():
    """``fabric.setup(model)`` returns a ``_FabricModule`` holding the model as
    ``_forward_module``: attached to it, modules and parameters are named as in the model
    (they were ``_forward_module.0``, ``_forward_module.0.weight``), and measured right."""
    L = pytest.importorskip("lightning")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    fabric = L.Fabric(accelerator="cpu", devices=1)
    fm, fo = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(4, 8)
    with hookplug.attach(fm, "Linear", plugins=["stats", "params"]) as s:
        y = fm(x)
        fabric.backward(y.sum())
        g = model[2].weight.grad.clone()
        fo.step()
        assert set(s["stats"].results()) == {"0", "2"}
        assert set(s["params"].results()) == {"0.weight", "0.bias", "2.weight", "2.bias"}
        assert s["stats"].results()["2"]["output"].numel == y.numel()
        got = s["params"].results()["2.weight"]["grad"].l2
        assert math.isclose(float(got), float(g.double().norm()), rel_tol=1e-6)


def test_lightning_every_n_records_each_validation_after_an_unsampled_step():
    """``every=4`` with a validation every 4 batches: Lightning validates after steps 3 and
    7, which ``every=4`` does not sample; each validation is recorded (``phase="eval"``,
    the step it follows, both of its batches), the training steps by the rule (0, 4). The
    validations were dropped (they ran with their step's sampling: no eval record at all)."""
    pl = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader, TensorDataset

    from hookplug.integrations.lightning import HookplugCallback

    model = _lightning_regression(pl)
    type(model).validation_step = lambda self, batch, idx: self.net(batch[0]).sum()
    sink = Collect()
    cb = HookplugCallback("Linear", ["stats", "flops"], sink=sink, flush_every=1, every=4)
    pl.Trainer(max_steps=8, val_check_interval=4, limit_val_batches=2, num_sanity_val_steps=0,
               callbacks=[cb], logger=False, enable_checkpointing=False, **_LIGHTNING_QUIET).fit(
        model, DataLoader(TensorDataset(torch.randn(40, 8)), batch_size=4),
        DataLoader(TensorDataset(torch.randn(16, 8)), batch_size=4))
    steps = {phase: sorted({r["step"] for r in sink.records if r["phase"] == phase}) for phase in ("train", "eval")}
    assert steps == {"train": [0, 4], "eval": [3, 7]}
    assert {r["numel"] for r in sink.records if r["phase"] == "eval" and r["module"] == "net.0"} == {2 * 4 * 8}
    # flops counted the two sampled training steps and both validations (forward only),
    # apart: the training FLOPs without the validation passes
    per_sample, flops = 2 * 8 * 8, cb.session["flops"]
    assert flops.results(phase="train")["net.0"]["flops"] == 2 * 4 * per_sample
    assert flops.results(phase="eval")["net.0"]["flops"] == 2 * 2 * 4 * per_sample
    assert flops.results()["net.0"]["flops"] == (2 * 4 + 2 * 2 * 4) * per_sample
