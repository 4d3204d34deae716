"""Every kernel that takes the score's description (mha/score.hpp) gives the same answer within the suite's
rule: the reference and fused kernels of scaled_dot_product_attention and decode_attention over a paged
cache, on hypothesis-drawn combinations of causal, window, ALiBi, softcap, sinks and grouped heads, each
against the float64 truth of test_sinks.py (torch, written from the formulas). The ring takes the same
combinations in distributed_ring_worker.py (test_distributed.py runs it on 1 to 4 ranks).

Legend: h query heads, h_kv key/value heads, L new queries, S keys (the cache's positions), d head width.
"""
import numpy as np
import torch
from hypothesis import given, strategies as st

import mha
from test_properties import hypothesis_settings
from test_sinks import reference


@st.composite
def scores(draw):
    h_kv = draw(st.sampled_from([1, 2]))
    h = h_kv * draw(st.sampled_from([1, 2]))
    L = draw(st.integers(1, 6))
    S = draw(st.integers(L, 90))
    score = dict(causal=draw(st.booleans()))
    if draw(st.booleans()):  # extents >= 0 or unbounded: every query sees at least its own position
        score["window"] = (draw(st.sampled_from([-1, 0, 3, 17])), draw(st.sampled_from([-1, 0, 2])))
    if draw(st.booleans()):
        score["alibi"] = list(np.linspace(0.02, 0.4, h))
    if draw(st.booleans()):
        score["softcap"] = draw(st.sampled_from([0.7, 8.0]))
    sinks = draw(st.none() | st.sampled_from([0.5, 3.0]))
    return dict(h=h, h_kv=h_kv, L=L, S=S, d=draw(st.sampled_from([8, 16])), seed=draw(st.integers(0, 2**31)),
                sinks=sinks, score=score)


def library_score(score):
    out = dict(is_causal=score["causal"], window=score.get("window"), softcap=score.get("softcap", 0.0))
    if "alibi" in score:
        out["alibi_slopes"] = np.asarray(score["alibi"], np.float32)
    return out


@hypothesis_settings(120)
@given(c=scores())
def test_reference_fused_and_decode_kernels_agree_with_the_float64_truth(c):
    rng = np.random.default_rng(c["seed"])
    h, h_kv, L, S, d = c["h"], c["h_kv"], c["L"], c["S"], c["d"]
    q = rng.standard_normal((1, h, L, d)).astype(np.float32)
    k = rng.standard_normal((1, h_kv, S, d)).astype(np.float32)
    v = rng.standard_normal((1, h_kv, S, d)).astype(np.float32)
    sinks = None if c["sinks"] is None else (rng.standard_normal(h) * c["sinks"]).astype(np.float32)
    no_sink = np.full(h, -np.inf)  # the truth's form of "no sink"
    truth = reference(q, k, v, no_sink if sinks is None else sinks, **c["score"])[0]
    plain32 = reference(q, k, v, no_sink if sinks is None else sinks, dtype=torch.float32, **c["score"])[0]
    bound = 2 * np.abs(plain32 - truth).max() + 1e-6 * max(1.0, np.abs(truth).max())
    opts = dict(library_score(c["score"]), sinks=sinks)

    got = {kernel: mha.scaled_dot_product_attention(q, k, v, kernel=kernel, **opts) for kernel in ("flash", "reference")}
    cache = mha.PagedKVCache(h_kv, d, page_size=int(rng.choice([1, 4, 16])), capacity_tokens=S + 16)
    sequence = cache.add_sequence()
    cache.append(sequence, k[0].transpose(1, 0, 2), v[0].transpose(1, 0, 2))  # [S, h_kv, d]
    decoded = mha.decode_attention(q[0].transpose(1, 0, 2)[None], cache, [sequence], **opts)  # [1, L, h, d]
    got["decode"] = decoded[0].transpose(1, 0, 2)[None]
    for kernel, out in got.items():
        err = np.abs(out.astype(np.float64) - truth).max()
        assert err <= bound, f"{kernel}: max|ours - fp64| = {err:.3g} > {bound:.3g} ({c})"
