import re
import sys
import warnings

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import hookplug
from hookplug import SelectorError, select
from hookplug.models import resnet34_like, tiny_transformer


@pytest.fixture(scope="module")
def resnet():
    return resnet34_like()


@pytest.fixture(scope="module")
def transformer():
    return tiny_transformer(depth=3)


def names(model, sel, **kw):
    return [n for n, _ in select(model, sel, **kw)]


def by_hand(model, pred):
    return [n for n, m in model.named_modules() if pred(n, m)]


def test_class_name_matches_class_and_order(resnet):
    got = names(resnet, "Conv2d:*")
    assert got == by_hand(resnet, lambda n, m: isinstance(m, nn.Conv2d))
    assert len(got) == 36
    assert names(resnet, "Conv2d") == got


def test_base_class_name_matches_subclasses():
    class MyConv(nn.Conv2d):
        pass

    m = nn.Sequential(MyConv(1, 1, 1), nn.Conv2d(1, 1, 1), nn.ReLU())
    assert names(m, "Conv2d") == ["0", "1"]
    assert names(m, "MyConv") == ["0"]
    assert names(m, "_ConvNd") == ["0", "1"]


def test_glob_dot_is_literal_and_star_spans_dots(resnet):
    got = names(resnet, "*:layer1.*")
    assert got == by_hand(resnet, lambda n, m: n.startswith("layer1."))
    m = nn.ModuleDict({"axb": nn.ReLU(), "a": nn.ModuleDict({"b": nn.ReLU()})})
    assert names(m, "*:a.b") == ["a.b"]  # '.' is literal: 'axb' is not matched
    assert names(m, "*:a?b") == ["axb", "a.b"]
    assert names(resnet, "Conv2d:layer2.0.conv?") == ["layer2.0.conv1", "layer2.0.conv2"]


def test_alternation(resnet):
    got = names(resnet, "Conv2d|Linear:*")
    assert got == by_hand(resnet, lambda n, m: isinstance(m, (nn.Conv2d, nn.Linear)))
    assert "fc" in got


def test_regex_full_match(transformer):
    got = names(transformer, r"Linear:re:layers\.\d+\.(query|key)")
    want = by_hand(transformer, lambda n, m: isinstance(m, nn.Linear) and re.fullmatch(r"layers\.\d+\.(query|key)", n))
    assert got == want and len(got) == 6
    # full match: a prefix alone does not match
    assert names(transformer, r"*:re:layers\.\d") == ["layers.0", "layers.1", "layers.2"]


def test_regex_with_comma_inside_braces(transformer):
    got = names(transformer, r"Linear:re:layers\.[0-9]{1,2}\.ff1, Embedding")
    assert got == ["embed", "layers.0.ff1", "layers.1.ff1", "layers.2.ff1"]


def test_dotted_class_path(transformer):
    assert names(transformer, "torch.nn.Linear:*") == names(transformer, "Linear")
    assert names(transformer, "torch.nn.modules.linear.Linear") == names(transformer, "Linear")
    enc = names(transformer, "hookplug.models.EncoderLayer")
    assert enc == ["layers.0", "layers.1", "layers.2"]


def test_union_and_exclusion(resnet):
    got = names(resnet, "Conv2d, Linear, -*:layer4.*, -*:conv1")
    want = by_hand(resnet, lambda n, m: isinstance(m, (nn.Conv2d, nn.Linear))
                   and not n.startswith("layer4.") and n != "conv1")
    assert got == want
    # exclusion applies to the union so far; later terms add back
    assert "conv1" in names(resnet, "Conv2d, -*:conv1, *:conv1")


def test_root_only_when_named(resnet):
    assert "" not in names(resnet, "*")
    assert names(resnet, "*:") == [""]
    assert names(resnet, "ResNetLike:") == [""]


def test_root_with_class_mismatch_warns(resnet):
    with pytest.warns(UserWarning, match="matched no module"):
        assert names(resnet, "Conv2d:") == []


@pytest.mark.parametrize("sel, col, msg", [
    ("Conv2d,", 7, "empty term"),
    ("Conv2d|:*", 7, "empty class name"),
    ("Conv-2d", 4, "expected a class name"),
    ("Linear:re:(ab", 10, "invalid regular expression"),
    ("-Linear", 1, "cannot start with '-'"),
    ("", 0, "empty selector"),
    ("*|Linear", 0, "cannot be combined"),
])
def test_malformed_selectors_mark_the_column(resnet, sel, col, msg):
    with pytest.raises(SelectorError) as info:
        select(resnet, sel)
    err = info.value
    assert isinstance(err, ValueError)
    assert msg in str(err)
    assert err.column == col
    lines = str(err).splitlines()
    assert lines[1] == "  " + sel
    assert lines[2] == " " * (col + 2) + "^"


def test_unknown_class_suggests_close_match(resnet):
    with pytest.raises(SelectorError, match="did you mean 'Conv2d'"):
        select(resnet, "Conv2D")
    with pytest.raises(SelectorError, match="BatchNorm2d"):
        select(resnet, "BatchNorm2")
    with pytest.raises(SelectorError, match="module 'nosuchpkg' is not imported"):
        select(resnet, "nosuchpkg.Conv2d")


def test_known_torch_class_absent_from_model_warns_not_raises(resnet):
    with pytest.warns(UserWarning, match="matched no module"):
        assert select(resnet, "LSTM") == []


def test_strict_raises_on_empty_match(resnet):
    with pytest.raises(SelectorError, match="matched no module"):
        select(resnet, "*:nothing.here", strict=True)


def test_non_string_and_non_module_inputs(resnet):
    with pytest.raises(TypeError, match="selector must be a str"):
        select(resnet, 3)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        select("not a model", "*")


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("Conv2dLinear*:|,-.re[](){}\\ ?_0123456789")), max_size=30))
def test_fuzz_only_result_or_selector_error(sel):
    model = nn.Sequential(nn.Conv2d(1, 1, 1), nn.Sequential(nn.Linear(1, 1)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            out = select(model, sel)
        except SelectorError:
            return
    assert isinstance(out, list)
    assert all(isinstance(n, str) and isinstance(m, nn.Module) for n, m in out)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40))
def test_fuzz_arbitrary_unicode(sel):
    model = nn.Sequential(nn.Linear(1, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            hookplug.select(model, sel)
        except SelectorError:
            pass


def test_regex_character_class_and_space_before_re():
    m = nn.ModuleDict({"fc1": nn.Linear(1, 1), "fc(1": nn.Linear(1, 1), "head": nn.Linear(1, 1)})
    assert names(m, "Linear:re:fc[(,]1, *:head") == ["fc(1", "head"]
    assert names(m, "Linear: re:fc1 , *:head") == ["fc1", "head"]


def test_wrappers_are_looked_through():
    m = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    assert names(torch.compile(m), "Linear") == ["0", "2"]
    assert names(nn.DataParallel(m), "*:0") == ["0"]


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(3, 3) for _ in range(4)])
        self.table = nn.ParameterList([nn.Parameter(torch.ones(2))])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_container_never_called_warns_and_names_its_children():
    """``*:layers`` picks the ModuleList itself, which no forward calls: every plugin records
    nothing for it. The warning says so and what to write."""
    m = _Stack()
    with pytest.warns(UserWarning, match=r"matched only 'layers' \(ModuleList\).*hooks on their calls "
                                         r"never run.*'\*:layers\.\*'"):
        assert names(m, "*:layers") == ["layers"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(names(m, "*")) == 6  # with callable modules: no warning
        assert names(m, "*:layers.*") == [f"layers.{i}" for i in range(4)]
    with pytest.warns(UserWarning, match="'layers'"):
        with hookplug.attach(m, "*:layers", plugins="flops") as s:
            m(torch.randn(2, 3))
    assert s["flops"].results()["layers"]["flops"] == 0
    # params and gradclamp's params= take the children's parameters: no warning for them alone
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for plugins in ("params", ("gradclamp", {"min": 0, "max": 0, "params": "*"})):
            m.zero_grad(set_to_none=True)
            with hookplug.attach(m, "*:layers", plugins=plugins) as s:
                m(torch.randn(2, 3)).sum().backward()
        assert all(not p.grad.any() for p in m.layers.parameters())  # zeroed through the container
    with pytest.warns(UserWarning, match="'layers'"):  # beside one that needs calls: it warns
        hookplug.attach(m, "*:layers", plugins=["stats", "params"]).remove()


def test_glob_character_class_may_hold_a_comma_and_class_names_any_identifier():
    m = _Stack()
    assert names(m, "*:layers.[1,3]") == ["layers.1", "layers.3"]
    assert names(m, "*:layers.[!1,3], Linear:layers.0") == ["layers.0", "layers.2"]
    with pytest.warns(UserWarning, match="matched no module"):  # an open '[' is literal
        assert names(m, "*:layers.[1") == []

    class Блок(nn.Linear):
        pass

    m.add_module("b", Блок(2, 2))
    assert names(m, "Блок") == ["b"]


def test_torchscript_modules_select_and_attach_refuses_them_by_name():
    scripted = torch.jit.script(nn.Sequential(nn.Linear(3, 3)))
    assert names(scripted, "*:") == [""] and names(scripted, "*") == ["0"]
    with pytest.raises(TypeError, match=r"module '<root>' is a TorchScript module.*before "
                                        r"torch\.jit\.script"):
        hookplug.attach(scripted, "*:", plugins="stats")
    m = nn.Sequential(nn.Linear(3, 3), torch.jit.script(nn.Linear(3, 3)))
    with pytest.raises(TypeError, match=r"module '1' is a TorchScript module.*-\*:1"):
        hookplug.attach(m, "*", plugins="stats")
    assert not m[0]._forward_hooks and not m[0]._forward_pre_hooks
    with hookplug.attach(m, "*, -*:1", plugins="stats") as s:
        m(torch.randn(2, 3))
    assert list(s["stats"].results()) == ["0"]


def test_a_module_reachable_by_two_names_is_selected_by_either():
    """``self.dec = self.enc``: ``named_modules()`` gives the first name only, so ``*:dec``
    matched nothing. Any name selects it (and removes it); records use the first."""
    shared = nn.Sequential(nn.Linear(3, 3))
    m = nn.Module()
    m.enc, m.dec, m.head = shared, shared, nn.Linear(3, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert names(m, "*:dec") == ["enc"]
        assert names(m, "Linear:dec.*") == ["enc.0"]
        assert names(m, "*, -*:dec*") == ["head"]


def test_regex_ignores_spaces_around_it_as_every_other_part_does():
    """``re: fc1`` is the regex ``fc1``: spaces around a selector's parts (``A | B``,
    ``A , B``, ``Linear: re:...``, a trailing one) are never part of them, so the spaces
    after ``re:`` are not either (a leading space was kept: ``" fc1"`` matched nothing). An
    escaped space (``\\ ``) at either end is the regex's own."""
    m = nn.ModuleDict({"fc1": nn.Linear(1, 1), "fc(1": nn.Linear(1, 1), "head": nn.Linear(1, 1),
                       " x": nn.Linear(1, 1), "x ": nn.Linear(1, 1)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing "matched no module"
        assert names(m, "Linear:re: fc1") == ["fc1"]
        assert names(m, "Linear : re:  fc[(,]1  , *:head") == ["fc(1", "head"]
        assert names(m, "Linear:re:\tfc.*\t") == ["fc1", "fc(1"]
        assert names(m, r"*:re:\ x") == [" x"]
        assert names(m, r"*:re:x\ ") == ["x "]
        assert names(m, r"*:re: x\  ") == ["x "]
    # an error in the regex points at its own column, past the spaces
    with pytest.raises(SelectorError) as e:
        select(m, "*:re:   fc(1")
    assert e.value.column == len("*:re:   fc")  # re's "missing )" is reported at the "("


@pytest.fixture
def lazy_package(tmp_path, monkeypatch):
    """``hp_lazy_pkg``, a package exporting ``Block`` (from ``_impl``) and ``Other`` (from
    ``_other``) lazily through a module ``__getattr__``, as transformers' ``_LazyModule``
    does; the ``__getattr__`` leaves a marker file when it runs."""
    import textwrap

    marker = tmp_path / "getattr_ran.txt"
    pkg = tmp_path / "hp_lazy_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(f"""
        import importlib, pathlib
        _EXPORTS = {{"Block": "._impl", "Other": "._other"}}
        __all__ = list(_EXPORTS)

        def __getattr__(name):
            if name not in _EXPORTS:
                raise AttributeError(name)
            pathlib.Path({str(marker)!r}).write_text(name)
            return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    """))
    for sub, cls in (("_impl", "Block"), ("_other", "Other"), ("_dup", "Block")):
        (pkg / f"{sub}.py").write_text(f"import torch.nn as nn\n\nclass {cls}(nn.Linear):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("hp_lazy_pkg", "hp_lazy_pkg._impl", "hp_lazy_pkg._other", "hp_lazy_pkg._dup"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield marker
    for name in ("hp_lazy_pkg", "hp_lazy_pkg._impl", "hp_lazy_pkg._other", "hp_lazy_pkg._dup"):
        sys.modules.pop(name, None)


def test_dotted_class_exported_lazily_resolves_to_the_models_class(lazy_package):
    """``pkg.Block`` where ``pkg`` exports ``Block`` lazily (not yet accessed, so not among
    the package's attributes) and the model holds ``pkg._impl.Block`` (made through its
    submodule, as ``AutoModel`` makes a ``transformers.GPT2Model``): the model's class, found
    without running the package's ``__getattr__`` (a selector never imports). Before:
    "module 'hp_lazy_pkg' has no class 'Block'"."""
    from hp_lazy_pkg._impl import Block

    model = nn.Sequential(Block(1, 1), nn.Linear(1, 1))
    assert names(model, "hp_lazy_pkg.Block") == ["0"]
    assert names(model, "hp_lazy_pkg._impl.Block") == ["0"]
    assert not lazy_package.exists(), "the selector ran the package's __getattr__"


def test_dotted_class_exported_lazily_and_not_in_the_model_says_what_was_tried(lazy_package):
    from hp_lazy_pkg._impl import Block

    model = nn.Sequential(Block(1, 1))
    with pytest.raises(SelectorError) as info:
        select(model, "hp_lazy_pkg.Other")
    msg = str(info.value)
    assert "lazily" in msg and "never imports" in msg, msg
    assert "from hp_lazy_pkg import Other" in msg, msg  # the fix
    assert "neither the model nor a module inside 'hp_lazy_pkg' already imported" in msg, msg
    assert not lazy_package.exists() and "hp_lazy_pkg._other" not in sys.modules
    # once imported as the message says, it resolves (and matches nothing here: a warning)
    from hp_lazy_pkg import Other  # noqa: F401
    with pytest.warns(UserWarning, match="matched no module"):
        assert names(model, "hp_lazy_pkg.Other") == []


def test_transformers_class_by_its_top_level_name():
    """``transformers.GPT2Model`` on a GPT-2 made from a config (``_LazyModule``)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt2 import modeling_gpt2

    cfg = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8,
                                  bos_token_id=0, eos_token_id=0)
    model = modeling_gpt2.GPT2LMHeadModel(cfg)
    assert names(model, "transformers.GPT2Model:*") == ["transformer"]
    assert names(model, "transformers.models.gpt2.modeling_gpt2.GPT2Block") == ["transformer.h.0"]
    # not a name the package exports (getattr raises): no class, as for any module
    with pytest.raises(SelectorError, match=r"module 'transformers.models.gpt2' has no class 'GPT2Block'"):
        select(model, "transformers.models.gpt2.GPT2Block")


def test_a_name_a_lazy_package_does_not_export_is_no_class():
    """torch has a module ``__getattr__`` but exports no ``Dropout``: ``torch.Dropout`` is an
    error, as before lazily exported names were looked up (it selected ``nn.Dropout``)."""
    model = nn.Sequential(nn.Dropout(), nn.Linear(2, 2))
    for text in ("torch.Dropout", "torch.Linear"):
        with pytest.raises(SelectorError, match=rf"module 'torch' has no class '{text[6:]}'"):
            select(model, text)


def test_dotted_class_exported_lazily_with_two_candidates_is_ambiguous(lazy_package):
    """Two modules of the package define a ``Block`` and the model holds both: which one
    the package exports cannot be told without running its ``__getattr__``."""
    from hp_lazy_pkg import _dup, _impl

    model = nn.Sequential(_impl.Block(1, 1), _dup.Block(1, 1))
    with pytest.raises(SelectorError, match="ambiguous") as info:
        select(model, "hp_lazy_pkg.Block")
    assert "'hp_lazy_pkg._dup.Block', 'hp_lazy_pkg._impl.Block'" in str(info.value)
    assert names(model, "hp_lazy_pkg._dup.Block") == ["1"]  # the full path names one
    # a model holding one of them: that one
    assert names(nn.Sequential(nn.ReLU(), _dup.Block(1, 1)), "hp_lazy_pkg.Block") == ["1"]
    assert not lazy_package.exists()


@pytest.mark.parametrize("sel, term, hint", [
    ("Conv2d, *:fcc", "*:fcc", "did you mean 'fc'"),  # a typo in an added name
    ("Conv2d, -*:layer1.0.conv", "-*:layer1.0.conv", "'layer1.0.conv1'"),  # in a removal
    ("Conv2d, Linear:layer1.*, -*:fc", "Linear:layer1.*", "its names match are of other classes"),
    ("Conv2d, ResNetLike", "ResNetLike", "it is selected with 'ResNetLike:'"),  # '*' skips the root
])
def test_a_term_matching_no_module_warns(resnet, sel, term, hint):
    """One term of several that matches nothing (the others do) was silent: a typo in a
    name went unnoticed. A warning (not an error, also under ``strict=True``: the selection
    is not empty)."""
    with pytest.warns(UserWarning, match=re.escape(f"its term {term!r} matches no module")) as rec:
        assert names(resnet, sel, strict=True) == names(resnet, "Conv2d")
    assert hint in str(rec[0].message), str(rec[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        names(resnet, "Conv2d, *:fc")  # every term matches: no warning
        names(resnet, "Conv2d, -*:fc, -*:fc.*")  # a subtree's removal where it has no children
        names(nn.Sequential(), "*, *:")  # '*' on a model that is one module


@pytest.mark.parametrize("sel, hint", [
    ("*:layer1.0.cnv1", "; did you mean 'layer1.0.conv1'"),  # the most common typo, alone
    ("ResNetLike", "; '*' never names the root: it is selected with 'ResNetLike:'"),
    ("Conv2d:layer1.0.conv1|layer1.0.conv2",
     "; '|' separates class names only: for either name write "
     "'Conv2d:layer1.0.conv1, Conv2d:layer1.0.conv2' or 'Conv2d:re:layer1.0.conv1|layer1.0.conv2'"),
])
def test_a_selector_of_one_term_matching_nothing_gets_the_terms_hint(resnet, sel, hint):
    """A one-term selector matching nothing said only "matched no module"; the same term
    among others got a hint (a close name, the root, ``|`` written between names). Now the
    one message has it, as a warning and under ``strict=True``; with several terms matching
    nothing, the one message has each term's hint."""
    with pytest.warns(UserWarning, match=re.escape(f"selector {sel!r} matched no module of ResNetLike{hint}")):
        assert names(resnet, sel) == []
    with pytest.raises(SelectorError, match=re.escape(hint)):
        names(resnet, sel, strict=True)
    with pytest.warns(UserWarning) as rec:
        assert names(resnet, f"{sel}, *:nothin") == []
    assert len(rec) == 1, [str(r.message) for r in rec]
    assert f"its term {sel!r}: {hint[2:]}" in str(rec[0].message)
    assert "its term '*:nothin': did you mean 'layer1.0.conv1'" not in str(rec[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(SelectorError, match=re.escape(f"its term {sel!r}: {hint[2:]}")):  # (no warning first)
            names(resnet, f"{sel}, Conv3d", strict=True)


def test_the_bar_hint_keeps_an_exclusion_and_offers_no_regex_for_globs(resnet):
    """``-*:a|b`` is removed with ``-*:a, -*:b`` (the hint wrote ``*:a, *:b``, which adds
    them); ``layer?|fc`` has glob characters, which a regex reads otherwise: no ``re:``."""
    with pytest.warns(UserWarning, match=re.escape(
            "for either name write '-*:layer1.0.conv1, -*:fc9' or '-*:re:layer1.0.conv1|fc9'")):
        names(resnet, "Conv2d, -*:layer1.0.conv1|fc9")
    with pytest.warns(UserWarning) as rec:
        names(resnet, "*:layer?|fc9")
    assert "write '*:layer?, *:fc9'" in str(rec[0].message) and ":re:" not in str(rec[0].message)


def test_any_whitespace_before_re_starts_the_regex():
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(12)])
    for sel in ("*: re:1\\d{0,1}", "*:\tre:1\\d{0,1}", "Linear:\n    re:1\\d{0,1}"):
        assert names(model, sel) == ["1", "10", "11"], sel


@pytest.mark.parametrize("sel, hint", [
    ("layer1", "'layer1' is a module name here: a name is written after a colon, '*:layer1'"),
    # dotted names and globs do not parse as a class: the hint was missing there
    ("layer1.0", "'layer1.0' is a module name here: a name is written after a colon, '*:layer1.0'"),
    ("Conv2d,layer1.*", "'layer1.*' is a module name here: a name is written after a colon, '*:layer1.*'"),
    ("Conv2d,-layer1.0", "a name is written after a colon, '-*:layer1.0'"),
    ("re:layer1", "a regex over names is written after a colon: '*:re:...'"),
    ("conv2D", "did you mean 'Conv2d'"),  # case: difflib alone missed it
    ("RELU", "did you mean 'ReLU'"),
])
def test_a_class_part_that_is_a_name_or_in_another_case_says_so(resnet, sel, hint):
    with pytest.raises(SelectorError) as info:
        select(resnet, sel)
    assert hint in info.value.reason, info.value.reason


class ElsewhereBlock(nn.Module):
    """A class the test models do not use (as transformers' ``Conv1D`` is to a BERT)."""


def test_a_class_of_another_imported_model_matches_nothing_a_typo_is_refused(resnet):
    """One selector for several models (``Linear|Conv1D`` for GPT-2 and BERT): a class name
    an imported module has matches nothing in a model without it (it was refused); a name
    no module has is still refused with its suggestion."""
    assert names(resnet, "Linear|ElsewhereBlock") == names(resnet, "Linear")
    with pytest.raises(SelectorError, match="did you mean 'Linear'"):
        select(resnet, "Linear|Linaer")
