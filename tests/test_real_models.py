"""Real models, every submodule hooked (selector ``"*"``) with stats (outputs and output
gradients), capture (outputs and gradients of every call) and flops together, in one
training step, against what plain torch computes:

- the loss and every parameter gradient are bitwise those of the model without hooks;
- stats equal a float64 reference built from plain torch hooks (counts, min and max exact,
  mean and std to float64 rounding), for every module and every tensor of its outputs;
- captured outputs and gradients equal what plain torch hooks see, call by call;
- forward FLOPs per module equal ``torch.utils.flop_counter.FlopCounterMode``;
- after the session no hook is left on any module.

torchvision and timm models run where torchvision imports (the torch 2.14.1 stage of CI);
🤗 transformers models are built from small configs. No weights are downloaded.
"""
from __future__ import annotations

import contextlib
import copy
import math
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

import hookplug
from hookplug.structures import iter_tensors, map_tensors


# -- the models ------------------------------------------------------------------------------------

def _torchvision():
    try:
        import torchvision
    except Exception as exc:  # noqa: BLE001 - PyPI torchvision does not import beside torch 2.13 CPU
        pytest.skip(f"torchvision does not import here: {exc}")
    return torchvision


def _transformers():
    return pytest.importorskip("transformers")


def _images(n=2, size=64):
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(1))


def _tokens(n=2, length=12, vocab=100):
    return torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(2))


def tv(name, size=64, **kw):
    def make():
        factory = _torchvision().models
        for part in name.split("."):
            factory = getattr(factory, part)
        return factory(**kw), (_images(size=size),), {}
    return make


def timm_model(name, size=64, **kw):
    def make():
        timm = pytest.importorskip("timm")
        return (timm.create_model(name, pretrained=False, num_classes=10, **kw),
                (_images(size=size),), {})
    return make


def tv_vit():
    model = _torchvision().models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                              hidden_dim=32, mlp_dim=64, num_classes=10)
    return model, (_images(size=32),), {}


def hf_causal(config_name, model_name, **extra):
    def make():
        tr = _transformers()
        config = getattr(tr, config_name)(vocab_size=100, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=64,
                                          use_cache=False, **extra)
        ids = _tokens()
        return getattr(tr, model_name)(config), (), {"input_ids": ids, "labels": ids}
    return make


def hf_gpt2():
    tr = _transformers()
    config = tr.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                           use_cache=False)
    ids = _tokens()
    return tr.GPT2LMHeadModel(config), (), {"input_ids": ids, "labels": ids}


def hf_bert():
    tr = _transformers()
    config = tr.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=2, intermediate_size=64, num_labels=3)
    labels = torch.tensor([0, 2])
    return tr.BertForSequenceClassification(config), (), {"input_ids": _tokens(), "labels": labels}


def hf_t5():
    tr = _transformers()
    config = tr.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                         use_cache=False, decoder_start_token_id=0, pad_token_id=0)
    ids = _tokens()
    return tr.T5ForConditionalGeneration(config), (), {"input_ids": ids, "labels": ids[:, :7].contiguous()}


def hf_vit():
    tr = _transformers()
    config = tr.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=2, intermediate_size=64, num_labels=10)
    return (tr.ViTForImageClassification(config), (),
            {"pixel_values": _images(size=32), "labels": torch.tensor([1, 7])})


MODELS = {
    "torchvision.resnet50": tv("resnet50", num_classes=10),
    "torchvision.mobilenet_v3_small": tv("mobilenet_v3_small", num_classes=10),  # in-place hardswish, SE
    "torchvision.efficientnet_b0": tv("efficientnet_b0", num_classes=10),  # stochastic depth
    "torchvision.convnext_tiny": tv("convnext_tiny", num_classes=10),  # permutes, LayerNorm2d
    "torchvision.densenet121": tv("densenet121", num_classes=10),  # concatenations
    "torchvision.squeezenet1_1": tv("squeezenet1_1", num_classes=10),  # ReLU(inplace) after Conv2d
    "torchvision.shufflenet_v2_x0_5": tv("shufflenet_v2_x0_5", num_classes=10),  # channel shuffle
    "torchvision.googlenet": tv("googlenet", size=96, num_classes=10, aux_logits=True,
                                init_weights=True),  # a namedtuple output in training
    "torchvision.lraspp_mobilenet_v3_large": tv("segmentation.lraspp_mobilenet_v3_large",
                                                num_classes=4, weights_backbone=None),  # a dict
    "torchvision.vit": tv_vit,
    "timm.vit_tiny": timm_model("vit_tiny_patch16_224", size=32, img_size=32, patch_size=8),
    "timm.convnext_atto": timm_model("convnext_atto"),
    "timm.efficientnet_b0": timm_model("efficientnet_b0"),  # BatchNormAct2d, drop path
    "timm.mobilevitv2_050": timm_model("mobilevitv2_050"),  # attention inside a CNN
    "timm.regnety_002": timm_model("regnety_002"),
    "transformers.gpt2": hf_gpt2,
    "transformers.bert": hf_bert,
    "transformers.t5": hf_t5,  # encoder-decoder; the shared embedding is called twice
    "transformers.llama": hf_causal("LlamaConfig", "LlamaForCausalLM"),
    "transformers.mixtral": hf_causal("MixtralConfig", "MixtralForCausalLM", num_local_experts=4,
                                      num_experts_per_tok=2),  # experts see varying tokens
    "transformers.vit": hf_vit,
}


# -- plain torch: the reference ------------------------------------------------------------------

def _floats(output):
    """``(path, tensor)`` of the floating dense tensors of an output (what stats measures)."""
    return [(p, t) for p, t in iter_tensors(output)
            if t.is_floating_point() and t.layout == torch.strided and not t.is_nested]


def _loss(out):
    """The training loss: the model's own (HF ``loss``) or the mean square of its outputs."""
    if isinstance(out, dict) and out.get("loss") is not None:
        return out["loss"]
    return sum(t.float().square().mean() for _, t in _floats(out) if t.requires_grad)


def _autocast(amp):
    return torch.autocast("cpu", dtype=amp) if amp is not None else contextlib.nullcontext()


def _step(model, args, kwargs, amp=None):
    torch.manual_seed(0)  # dropout, stochastic depth: the same draws in every run
    with _autocast(amp):
        out = model(*args, **kwargs)
        loss = _loss(out)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _reference(model, args, kwargs, amp=None):
    """One step with plain torch hooks on every submodule: per module and call, the float64
    copy of each output tensor (read when the module returns, as hookplug's hooks read it)
    and of the gradient that reaches it."""
    outs, grads, handles = {}, {}, []

    def hook(name):
        def fwd(module, _args, _kwargs, output):
            # an output that is one of the inputs (or a leaf) gets a view of its own, so its
            # gradient is the one through this module (register_full_backward_hook's
            # grad_output), as hookplug documents
            inputs = {id(x) for _, x in iter_tensors((_args, _kwargs))}
            shared = {id(t) for _, t in iter_tensors(output)
                      if t.requires_grad and (t.grad_fn is None or id(t) in inputs)}
            if shared:
                output = map_tensors(lambda _, t: t.view_as(t) if id(t) in shared else t, output)
            call = len(outs.setdefault(name, []))
            outs[name].append({p: _f64(t) for p, t in _floats(output)})
            for p, t in _floats(output):
                if t.requires_grad and t.grad_fn is not None:
                    t.register_hook(lambda g, c=call, gp="grad" + p[len("output"):]: grads.setdefault(
                        name, {}).setdefault(c, {}).__setitem__(gp, _f64(g)))
            return output if shared else None
        return fwd

    for name, module in model.named_modules():
        if name:  # the selector "*": every submodule, not the root
            handles.append(module.register_forward_hook(hook(name), with_kwargs=True))
    try:
        loss, param_grads = _step(model, args, kwargs, amp)
    finally:
        for h in handles:
            h.remove()
    return loss, param_grads, outs, grads


def _hook_dicts(module):
    return [d for d in (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
                        module._backward_pre_hooks, getattr(module, "_forward_hooks_with_kwargs", {}),
                        getattr(module, "_forward_pre_hooks_with_kwargs", {})) if d]


def _f64(t):
    """A float64 copy of ``t`` that remembers ``t``'s dtype (``src_dtype``)."""
    c = t.detach().to(torch.float64, copy=True)
    c.src_dtype = t.dtype
    return c


def _exact(got, want, what):
    assert got.dtype == want.src_dtype, f"{what}: dtype {got.dtype} != {want.src_dtype}"
    got = got.detach().to(torch.float64)
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(got.isnan(), want.isnan()), what
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want)), what


def _check_stats(st, values, what):
    x = torch.cat([v.reshape(-1) for v in values])
    finite = x[x.isfinite()]
    d = st.to_dict()
    assert d["numel"] == x.numel(), what
    assert d["nan_count"] == int(x.isnan().sum()), what
    assert d["inf_count"] == int(x.isinf().sum()), what
    assert d["zero_count"] == int((x == 0).sum()), what
    assert sum(d["hist_counts"]) == x.numel() - d["nan_count"], what
    if finite.numel() == 0:
        assert math.isnan(d["mean"]), what
        return
    assert d["min"] == float(finite.min()) and d["max"] == float(finite.max()), what
    # The CPU op sums each block of 2048 float32 elements in float32 SIMD lanes (deviations
    # from a shift: the previous block's mean, or a mean sampled over the block), then merges
    # blocks in float64. Largest error over the 7347 outputs and gradients of these models
    # (AVX2): 5.1e-7 x std for the mean, 1.3e-6 relative for the std.
    std = float(finite.std(correction=0))
    assert d["mean"] == pytest.approx(float(finite.mean()), rel=5e-6, abs=5e-6 * std), what
    assert d["std"] == pytest.approx(std, rel=5e-6, abs=1e-300), what


def _flops_by_module(model, args, kwargs, amp=None):
    torch.manual_seed(0)
    with FlopCounterMode(display=False) as fcm, _autocast(amp):
        model(*args, **kwargs)
    root = type(model).__name__
    return {k[len(root) + 1:]: sum(v.values()) for k, v in fcm.get_flop_counts().items()
            if k.startswith(root + ".")}


# -- the test ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_id", list(MODELS))
def test_real_model_all_modules_exact_against_plain_torch(model_id):
    _check_model(model_id)


@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("model_id", ["torchvision.mobilenet_v3_small", "transformers.gpt2",
                                      "transformers.llama"])
def test_real_model_under_autocast_exact_against_plain_torch(model_id, amp):
    """The same step under ``torch.autocast("cpu", dtype=amp)``: stats of the 16-bit
    outputs and gradients equal the float64 reference, captures equal (dtype kept), FLOPs
    equal ``FlopCounterMode`` under autocast, the step is bitwise the plain one."""
    _check_model(model_id, amp)


def _check_model(model_id, amp=None):
    torch.manual_seed(0)
    base, args, kwargs = MODELS[model_id]()
    base.train()
    ref_loss, ref_param_grads, ref_outs, ref_grads = _reference(copy.deepcopy(base), args, kwargs,
                                                                amp)
    fcm = _flops_by_module(copy.deepcopy(base), args, kwargs, amp)

    model = copy.deepcopy(base)
    plugins = [("stats", {"sites": ("output", "grad")}),
               ("capture", {"keep": "all", "grads": True}),
               ("flops", {"extra_formulas": False})]  # what FlopCounterMode counts
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. capture naming HF cache objects
        with hookplug.attach(model, "*", plugins=plugins) as s:
            loss, param_grads = _step(model, args, kwargs, amp)
            s.step()
            stats = s["stats"].results()
            features, captured_grads = s["capture"].features, s["capture"].grads
            flops = s["flops"].results()

    # hooks observe only: the step is bitwise the plain one
    assert torch.equal(loss, ref_loss)
    assert param_grads.keys() == ref_param_grads.keys()
    for name, g in ref_param_grads.items():
        assert torch.equal(param_grads[name], g), name

    # stats: every module and output tensor, every gradient that arrived
    expected = {}
    for name, calls in ref_outs.items():
        for call in calls:
            for path, v in call.items():
                expected.setdefault(name, {}).setdefault(path, []).append(v)
    for name, by_call in ref_grads.items():
        for call in by_call.values():
            for path, v in call.items():
                expected.setdefault(name, {}).setdefault(path, []).append(v)
    assert set(stats) == set(expected), set(stats) ^ set(expected)
    for name, paths in expected.items():
        assert set(stats[name]) == set(paths), (name, set(stats[name]) ^ set(paths))
        for path, values in paths.items():
            _check_stats(stats[name][path], values, f"{model_id}: {name} {path}")

    # capture: every call's output, and the gradient of every call that got one, in call order
    assert set(features) == set(ref_outs)
    for name, calls in ref_outs.items():
        assert len(features[name]) == len(calls), name
        for i, (value, want) in enumerate(zip(features[name], calls)):
            got = dict(_floats(value))
            for path, v in want.items():
                _exact(got[path], v, f"{model_id}: features {name} call {i} {path}")
    assert set(captured_grads) == set(ref_grads)
    for name, by_call in ref_grads.items():
        calls = [by_call[c] for c in sorted(by_call)]
        assert len(captured_grads[name]) == len(calls), name
        for value, want in zip(captured_grads[name], calls):
            got = {"grad" + p[len("output"):]: t for p, t in iter_tensors(value)}
            for path, v in want.items():
                _exact(got[path], v, f"{model_id}: grads {name} {path}")

    # flops: the forward of every module as FlopCounterMode counts it
    for name, r in flops.items():
        assert r["flops"] == fcm.get(name, 0), (model_id, name)
    assert set(fcm) <= set(flops)
    assert sum(fcm.values()) > 0

    # nothing left behind
    left = {n: len(_hook_dicts(m)) for n, m in model.named_modules() if _hook_dicts(m)}
    assert not left, left
    again, again_grads = _step(model.zero_grad(set_to_none=True) or model, args, kwargs, amp)
    assert torch.equal(again, ref_loss)


# -- 🤗 generate(): KV cache, greedy and beam search ---------------------------------------------------

def _tiny_lm(kind):
    tr = _transformers()
    torch.manual_seed(0)
    if kind == "gpt2":  # GPT-2's projections are transformers' Conv1D
        config = tr.GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2,
                               attn_implementation="eager")
        return tr.GPT2LMHeadModel(config).eval(), "Conv1D|Linear"
    config = tr.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                            attn_implementation="eager")
    return tr.LlamaForCausalLM(config).eval(), "Linear"


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("beams", [1, 3])
def test_generate_with_kv_cache_is_observed_call_by_call(kind, beams):
    """``model.generate`` (KV cache, several new tokens, greedy or beam search) with stats,
    capture and flops on the projections, the attention modules, or every module and the
    root: the same tokens; capture holds every call (one per decoding step) as plain hooks
    see it; stats equal a float64 reference over those calls; flops per module equal
    FlopCounterMode over the same generate; ``session.step()`` between two generate calls
    adds the second; ``remove()`` leaves the hook dicts as they were and holds nothing."""
    import gc
    import weakref

    model, projections = _tiny_lm(kind)
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(3))
    kw = {"max_new_tokens": 4, "use_cache": True, "do_sample": False, "num_beams": beams, "pad_token_id": 0}
    want = model.generate(ids, **kw)
    before = {n: [dict(d) for d in _hook_dicts(m)] for n, m in model.named_modules()}
    with FlopCounterMode(display=False) as fcm:
        model.generate(ids, **kw)
    root = type(model).__name__
    want_flops = {k[len(root) + 1:]: sum(v.values()) for k, v in fcm.get_flop_counts().items()
                  if k.startswith(root + ".")}
    want_flops[""] = fcm.get_total_flops()
    modules = dict(model.named_modules())
    for selector in (projections, "*:re:.*attn.*", "*, *:"):
        names = [n for n, _ in hookplug.select(model, selector)]
        seen, handles = {}, []
        for n in names:
            handles.append(modules[n].register_forward_hook(lambda m, a, o, n=n: seen.setdefault(n, []).append(
                {p: _f64(t) for p, t in _floats(o)})))
        assert torch.equal(model.generate(ids, **kw), want)
        for h in handles:
            h.remove()
        assert all(len(seen[n]) == len(seen[names[0]]) > 1 for n in seen)  # prefill + decoding steps

        plugins = ["stats", ("capture", {"keep": "all"}), ("flops", {"extra_formulas": False})]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # capture naming the HF cache in the model's output
            s = hookplug.attach(model, selector, plugins=plugins)
            assert torch.equal(model.generate(ids, **kw), want), selector
        stats, features, flops = s["stats"].results(), s["capture"].features, s["flops"].results()
        assert set(features) == set(seen), selector
        for n, calls in seen.items():
            assert len(features[n]) == len(calls), (selector, n)
            for i, (value, call) in enumerate(zip(features[n], calls)):
                got = dict(_floats(value))
                for path, v in call.items():
                    _exact(got[path], v, f"{kind}: features {n} call {i} {path}")
            by_path = {}
            for call in calls:
                for path, v in call.items():
                    by_path.setdefault(path, []).append(v)
            assert set(stats[n]) == set(by_path), (selector, n)
            for path, values in by_path.items():
                _check_stats(stats[n][path], values, f"{kind}: {n} {path}")
                assert int(stats[n][path].calls) == len(values)
        for n in names:
            assert flops.get(n, {"flops": 0})["flops"] == want_flops.get(n, 0), (selector, n)

        s.step()  # a second request in the next step
        assert torch.equal(model.generate(ids, **kw), want)
        n = next(iter(seen))
        assert len(s["capture"].features[n]) == 2 * len(seen[n])
        assert int(s["stats"].results()[n]["output"].calls) == 2 * len(seen[n])
        ref = weakref.ref(s["capture"])
        s.remove()
        del s
        gc.collect()
        assert ref() is None  # the captures are freed with the session
        assert {n: [dict(d) for d in _hook_dicts(m)] for n, m in model.named_modules()} == before
    assert torch.equal(model.generate(ids, **kw), want)


def test_generate_serving_loop_under_inference_mode_samples_every_nth_request():
    """A serving loop: stats with ``every=2`` on a Llama's Linears, ``generate`` per request
    under ``torch.inference_mode()``, ``session.step()`` after each: the same tokens; the
    sampled requests' records (phase ``"eval"``) equal a float64 reference over their
    decoding calls, the others give none."""
    from _gloo import Dump

    model, _ = _tiny_lm("llama")
    g = torch.Generator().manual_seed(4)
    requests = [torch.randint(0, 64, (1 + i % 2, 3 + i), generator=g) for i in range(5)]
    kw = {"max_new_tokens": 3, "use_cache": True, "do_sample": False, "pad_token_id": 0}
    modules = dict(hookplug.select(model, "Linear"))
    plain = []
    for ids in requests:
        seen = {}
        handles = [m.register_forward_hook(lambda m, a, o, n=n: seen.setdefault(n, []).append(
            o.detach().to(torch.float64, copy=True))) for n, m in modules.items()]
        with torch.inference_mode():
            plain.append((model.generate(ids, **kw), seen))
        for h in handles:
            h.remove()
    sink = Dump()
    with hookplug.attach(model, "Linear", plugins="stats", every=2, sink=sink, flush_every=2) as s:
        for ids, (tokens, _) in zip(requests, plain):
            with torch.inference_mode():
                assert torch.equal(model.generate(ids, **kw), tokens)
            s.step()
    records = {(r["step"], r["module"]): r for r in sink.records}
    assert {r["phase"] for r in sink.records} == {"eval"}
    assert {step for step, _ in records} == {0, 2, 4}
    for step in (0, 2, 4):
        for n, calls in plain[step][1].items():
            r = records[(step, n)]
            x = torch.cat([c.reshape(-1) for c in calls])
            assert (r["numel"], r["calls"], r["min"], r["max"]) == (x.numel(), len(calls), float(x.min()), float(x.max()))
            std = float(x.std(correction=0))
            assert r["mean"] == pytest.approx(float(x.mean()), rel=5e-6, abs=5e-6 * std)
            assert r["std"] == pytest.approx(std, rel=5e-6)
