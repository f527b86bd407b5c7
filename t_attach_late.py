import sys, warnings; sys.path.insert(0, "/tmp/review_A"); warnings.filterwarnings("ignore")
import torch, hookplug
from torch._dynamo.utils import counters
from small_tf import *
def go(compiled, inplace):
    torch._dynamo.reset(); counters.clear()
    m = make()
    if compiled and inplace: m.compile(backend="aot_eager"); f = m
    elif compiled: f = torch.compile(m, backend="aot_eager")
    else: f = m
    it = list(batches())
    for ids in it[:2]: lossf(f(ids), ids).backward()
    s = hookplug.attach(m, "Linear", plugins=("stats", {"sites": ("output", "grad")}))
    for ids in it[2:4]: lossf(f(ids), ids).backward(); s.step()
    r = {k: {kk: got(vv) for kk, vv in v.items()} for k, v in s["stats"].results().items()}
    s.remove()
    for ids in it[4:]: lossf(f(ids), ids).backward()
    return r, dict(counters["stats"]), sum(counters["graph_break"].values())
from common import got
E, _, _ = go(False, False)
for inplace in (False, True):
    C, cnt, br = go(True, inplace)
    bad = [(m_, s_) for m_ in E for s_ in E[m_] if m_ not in C or s_ not in C[m_] or C[m_][s_]["numel"] != E[m_][s_]["numel"] or abs(C[m_][s_]["mean"] - E[m_][s_]["mean"]) > 1e-5 * E[m_][s_]["std"]]
    print("inplace" if inplace else "torch.compile", cnt, "breaks", br, "mismatch", bad[:5], "n sites", sum(len(v) for v in E.values()))
