"""The chunked prefill kernels (chunk_prepare + chunk_recurrence) against the fp64 oracle.

Skipped without a GPU and the extension. Every case checks output and final state with the relative
L2 error, on freshly poisoned memory; NaN or an unwritten output never passes.
"""

import pytest
import torch

import flashkda
from flashkda import _ext

from helpers import (CHUNK_TOL, HAS_CUDA_KERNELS, fast_spy, kernel_family, make_inputs, public_fn, reference64,
                     rel_err)

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA_KERNELS, reason="needs CUDA and the extension")]

# bf16 operands in every product: the bound of the accuracy case (output 4.5e-3, state
# 3.5e-3) with room for the harder mixes below (GVA, masks, no l2norm). fp16 inputs keep fp16
# operands in the state products but bf16 in the intra-chunk A / M products (range).
TOL = CHUNK_TOL


def _poison_allocator(count: int = 4, numel: int = 1 << 22) -> None:
    blocks = [torch.full((numel,), float("nan"), dtype=torch.float32, device="cuda") for _ in range(count)]
    del blocks


def _check(kw, gdn=False, tol=None):
    tol_o, tol_s = tol or TOL[kw["q"].dtype]
    _poison_allocator()
    o, s = public_fn("chunk", gdn)(**kw, output_final_state=True)
    torch.cuda.synchronize()
    ref_o, ref_s = reference64({n: x for n, x in kw.items() if n != "safe_gate"}, output_final_state=True)
    eo, es = rel_err(o, ref_o), rel_err(s, ref_s)
    assert eo <= tol_o, f"output error {eo:.2e} > {tol_o:.1e}"
    assert es <= tol_s, f"state error {es:.2e} > {tol_s:.1e}"
    return eo, es


ODD_LENS = [1, 15, 16, 17, 0, 97, 64, 1100]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("state_v_first", [True, False])
@pytest.mark.parametrize("gate", ["lower_bound", "softplus", "precomputed"])
def test_kda_modes_varlen(dtype, state_v_first, gate):
    kw = make_inputs(lens=ODD_LENS, H=2, HV=4, D=128, gate=gate, dtype=dtype, device="cuda",
                     state_v_first=state_v_first, mask_prob=0.02)
    _check(kw)


def test_many_sequences_longest_first():
    """More sequences than chunk_index has threads, of lengths over many sort keys (empty ones
    included, the longest last in the batch): chunk_recurrence takes them longest first through
    ordered_spans, and every sequence must still get its own output and final state."""
    gen = torch.Generator().manual_seed(7)
    short = [0, 1, 2, 5, 16, 17, 33, 64, 65]
    lens = [short[int(i)] for i in torch.randint(len(short), (1100,), generator=gen)] + [130, 300, 520, 1100]
    kw = make_inputs(lens=lens, H=1, HV=2, D=128, dtype=torch.bfloat16, device="cuda", state_v_first=True)
    _check(kw)


@pytest.mark.parametrize("gate", ["lower_bound", "softplus", "precomputed"])
def test_gdn_modes(gate):
    kw = make_inputs(lens=[130, 1, 64, 300], H=2, HV=2, D=128, gate=gate, gdn=True, dtype=torch.bfloat16,
                     device="cuda", mask_prob=0.02)
    _check(kw, gdn=True)


@pytest.mark.parametrize("group", [1, 2, 4])
def test_gva_neg_eigval_no_l2norm(group):
    kw = make_inputs(B=2, T=150, H=2, HV=2 * group, D=128, gate="softplus", dtype=torch.bfloat16, device="cuda")
    kw.update(allow_neg_eigval=True)
    _check(kw)
    # Without the in-kernel l2 norm the caller normalises (the contract does not bound raw q, k).
    kw.update(use_qk_l2norm_in_kernel=False, scale=0.3)
    kw["q"] = torch.nn.functional.normalize(kw["q"].float(), dim=-1).to(kw["q"].dtype)
    kw["k"] = torch.nn.functional.normalize(kw["k"].float(), dim=-1).to(kw["k"].dtype)
    _check(kw)


def test_batched_states():
    """B > 1 without cu_seqlens, T not a multiple of the chunk, bf16 initial state, no state."""
    kw = make_inputs(B=3, T=130, H=2, D=128, dtype=torch.bfloat16, device="cuda", state_dtype=torch.bfloat16)
    _check(kw)
    kw.pop("initial_state")
    _check(kw)


def test_strong_decay_takes_the_exact_path():
    """Softplus gates with huge raw values: sub-chunks decay by far more than e^64 (exact diagonal)."""
    kw = make_inputs(lens=[200, 33], H=2, D=128, gate="softplus", dtype=torch.bfloat16, device="cuda")
    kw["g"] = kw["g"] + 30.0 * (torch.rand_like(kw["g"]) < 0.3)
    _check(kw)
    kw = make_inputs(lens=[200, 33], H=2, D=128, gate="precomputed", dtype=torch.bfloat16, device="cuda",
                     mask_prob=0.3)
    _check(kw)


def test_unaligned_rows_and_gate_parameter_shapes():
    """q, k, v and g as views whose rows do not start on 16 bytes (an odd storage offset, an odd row
    stride), the slices of a fused projection, and the gate parameters in FLA's shapes: the same
    result as contiguous inputs, bit for bit."""
    kw = make_inputs(lens=[17, 97], H=2, D=128, dtype=torch.bfloat16, device="cuda")
    want = flashkda.chunk_kda(**kw, output_final_state=True)

    def shifted(x):  # the same values three elements into a fresh storage
        y = torch.empty(x.numel() + 3, dtype=x.dtype, device=x.device)[3:].view(x.shape)
        return y.copy_(x)

    def wide_rows(x):  # rows of D + 4 elements (16-byte aligned would need D + 8)
        y = torch.empty(*x.shape[:-1], x.shape[-1] + 4, dtype=x.dtype, device=x.device)[..., :x.shape[-1]]
        return y.copy_(x)

    dt_bias = kw["dt_bias"].view(2, 128)  # [HV, K]
    fused = torch.stack([kw["q"], kw["k"], kw["v"]], dim=2)  # [B, T, 3, H, D]: aligned rows, kept as views
    variants = {
        "shifted": {n: shifted(kw[n]) for n in "qkvg"},
        "wide rows": {n: wide_rows(kw[n]) for n in "qkvg"},
        "fused qkv": dict(zip("qkv", fused.unbind(2))),
        "gate parameters": dict(A_log=kw["A_log"].view(1, 1, -1, 1), dt_bias=dt_bias),
        "strided gate parameter": dict(dt_bias=torch.empty(128, 2, device="cuda").t().copy_(dt_bias)),
    }
    assert variants["shifted"]["q"].data_ptr() % 16 != 0 and variants["wide rows"]["q"].stride(2) % 8 != 0
    assert not variants["strided gate parameter"]["dt_bias"].is_contiguous()
    for name, changes in variants.items():
        _poison_allocator()
        got = flashkda.chunk_kda(**{**kw, **changes}, output_final_state=True)
        for a, b, what in zip(got, want, ("output", "final state")):
            assert torch.equal(a, b), f"{name}: {what} differs from the contiguous call"


@pytest.mark.parametrize("family", ["sm80", "sm90"])
def test_issue_accuracy_case(family):
    """varlen [700, 1348], H = 4, raw g ~ N(0, 2), dt_bias ~ N(0, 1): output <= 4.5e-3, state <= 3.5e-3,
    for both kernel families (on a device without sm_90 code both run the sm_80 kernels)."""
    gen = torch.Generator().manual_seed(0)
    lens, H, D = [700, 1348], 4, 128
    T = sum(lens)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    kw = dict(q=r(1, T, H, D).bfloat16().cuda(), k=r(1, T, H, D).bfloat16().cuda(), v=r(1, T, H, D).bfloat16().cuda(),
              g=(2 * r(1, T, H, D)).bfloat16().cuda(), beta=r(1, T, H).bfloat16().cuda(),
              A_log=torch.rand(H, generator=gen).cuda(), dt_bias=r(H * D).cuda(),
              initial_state=(0.1 * r(2, H, D, D)).cuda(),
              cu_seqlens=torch.tensor([0, 700, T], dtype=torch.int32, device="cuda"),
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              lower_bound=-5.0, safe_gate=True, state_v_first=True)
    with kernel_family(family):
        _check(kw, tol=(4.5e-3, 3.5e-3))


@pytest.mark.parametrize("split", [1, 2])
def test_value_split_is_bitwise_equal(monkeypatch, split):
    kw = make_inputs(lens=[100, 3, 200], H=2, D=128, dtype=torch.bfloat16, device="cuda")
    monkeypatch.setattr(_ext.config, "chunk_value_split", 1)
    o1, s1 = flashkda.chunk_kda(**kw, output_final_state=True)
    monkeypatch.setattr(_ext.config, "chunk_value_split", split)
    o2, s2 = flashkda.chunk_kda(**kw, output_final_state=True)
    assert torch.equal(o1, o2) and torch.equal(s1, s2)


@pytest.mark.parametrize("segment", [1, 2, 3])
@pytest.mark.parametrize("case", ["varlen", "batched_kfirst_bf16_state", "gdn", "no_state"])
def test_segments_match_whole(monkeypatch, segment, case):
    """Segments of `segment` chunks run in parallel and joined by the scan of their affine state
    maps: the same operands, fp32 sums in another order, so equal to the whole-chain recurrence to
    fp32 rounding (and the bf16 roundings it flips), and within the oracle's bounds. Zero-length,
    one-token and partial-chunk sequences, sequences shorter than a segment and several segments."""
    gdn = case == "gdn"
    if case == "batched_kfirst_bf16_state":
        kw = make_inputs(B=2, T=700, H=2, D=128, dtype=torch.bfloat16, device="cuda", state_v_first=False,
                         state_dtype=torch.bfloat16)
    else:
        kw = make_inputs(lens=[0, 1, 17, 700, 64, 1348, 65], H=2, HV=2 if gdn else 4, D=128, gdn=gdn,
                         dtype=torch.bfloat16, device="cuda", state_v_first=True)
    if case == "no_state":
        kw.pop("initial_state")
    fn = public_fn("chunk", gdn)
    monkeypatch.setattr(_ext.config, "chunk_segment", 0)
    o1, s1 = fn(**kw, output_final_state=True)
    monkeypatch.setattr(_ext.config, "chunk_segment", segment)
    _poison_allocator()
    o2, s2 = fn(**kw, output_final_state=True)
    torch.cuda.synchronize()
    assert torch.isfinite(o2).all() and torch.isfinite(s2).all()
    assert rel_err(o2, o1) < 2e-3 and rel_err(s2, s1) < 2e-3
    _check(kw, gdn=gdn)


def _kernels_launched(fn):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    return out, {ev.key for ev in prof.key_averages() if ev.device_type.name == "CUDA"}


@pytest.mark.parametrize("shape,segmented", [((1, 4096 + 37, 1), True), ((8, 2048, 16), False)])
def test_auto_segments(monkeypatch, shape, segmented):
    """The default (auto) segments few long chains and leaves many chains whole: the scan kernel's
    launch is the spy, and the result equals the whole chains'."""
    B, T, H = shape
    kw = make_inputs(B=B, T=T, H=H, D=128, dtype=torch.bfloat16, device="cuda", state_v_first=True)
    monkeypatch.setattr(_ext.config, "chunk_segment", 0)
    o1, s1 = flashkda.chunk_kda(**kw, output_final_state=True)
    monkeypatch.setattr(_ext.config, "chunk_segment", -1)
    _poison_allocator()
    (o2, s2), kernels = _kernels_launched(lambda: flashkda.chunk_kda(**kw, output_final_state=True))
    assert any("chunk_recurrence" in k for k in kernels), kernels
    assert any("chunk_segment_scan" in k for k in kernels) == segmented, kernels
    assert torch.isfinite(o2).all() and torch.isfinite(s2).all()
    assert rel_err(o2, o1) < 2e-3 and rel_err(s2, s1) < 2e-3


def test_smem_shortfall_runs_the_recurrent_kernel(monkeypatch):
    """A device too small for the chunked kernels (sm_86, sm_89) gets prefill from the token-by-token
    kernel: no chunked kernel launches (the spy), and the result still meets the oracle."""
    from flashkda import api

    monkeypatch.setattr(_ext, "chunk_smem_shortfall", lambda index: "99 KB of shared memory per block")
    monkeypatch.setattr(api, "_chunk_fast", None)  # the fast entry asks the device itself
    kw = make_inputs(lens=[17, 0, 130], H=2, D=128, dtype=torch.bfloat16, device="cuda")
    _, kernels = _kernels_launched(lambda: flashkda.chunk_kda(**kw, output_final_state=True))
    assert not any("chunk_" in k for k in kernels), kernels
    assert any("decode_step" in k or "recurrent" in k for k in kernels), kernels
    _check(kw)


def _serving_prefill():
    kw = make_inputs(lens=[70, 0, 129], H=2, HV=4, D=128, dtype=torch.bfloat16, device="cuda", state=False,
                     state_v_first=True)
    kw.update(initial_state=0.1 * torch.randn(9, 4, 128, 128, device="cuda"),
              ssm_state_indices=torch.tensor([6, -1, 2], dtype=torch.int32, device="cuda"),
              has_initial_state=torch.tensor([True, True, False], device="cuda"))
    return kw


CHUNK_FAST_CASES = {
    "varlen with states, final state": lambda: dict(
        make_inputs(lens=[17, 0, 130], H=2, HV=4, D=128, dtype=torch.bfloat16, device="cuda"), output_final_state=True),
    "fp16, fixed length, K-first, no states": lambda: make_inputs(B=2, T=65, H=2, D=128, dtype=torch.float16,
                                                                  device="cuda", state=False),
    "GDN, softplus gate, host offsets": lambda: dict(
        make_inputs(lens=[1, 97], H=2, D=128, gdn=True, gate="softplus", dtype=torch.bfloat16, device="cuda"),
        cu_seqlens_cpu=torch.tensor([0, 1, 98]), output_final_state=True),
    "precomputed gate, scale, bf16 state": lambda: dict(
        make_inputs(B=1, T=200, H=2, D=128, gate="precomputed", dtype=torch.bfloat16, device="cuda",
                    state_dtype=torch.bfloat16), scale=0.05, output_final_state=True),
    "serving pool, has_initial_state": _serving_prefill,
}


@pytest.mark.parametrize("segment", [0, 2])
@pytest.mark.parametrize("case", CHUNK_FAST_CASES)
def test_chunk_fast_entry_matches_the_general_path(monkeypatch, case, segment):
    """Bit for bit: the eager fast entry fills the kernels' parameters as the general path does (with
    whole chains and with segments of two chunks, both read from the config by either path)."""
    from flashkda import api

    monkeypatch.setattr(_ext.config, "chunk_segment", segment)
    kw = CHUNK_FAST_CASES[case]()
    fn = flashkda.chunk_gated_delta_rule if kw["g"].dim() == 3 else flashkda.chunk_kda
    state = kw.get("initial_state")
    kw_general = dict(kw, initial_state=None if state is None else state.clone())
    answers = fast_spy(monkeypatch, "_chunk_fast")
    _poison_allocator()
    o, s = fn(**kw)
    assert len(answers) == 1 and isinstance(answers[0], tuple), answers
    if kw.get("ssm_state_indices") is not None:
        assert s is kw["initial_state"]
    monkeypatch.setattr(api, "_chunk_fast", None)
    _poison_allocator()
    o_general, s_general = fn(**kw_general)
    torch.cuda.synchronize()
    assert torch.isfinite(o).all() and torch.equal(o, o_general)
    assert (s is None) == (s_general is None)
    if s is not None:
        assert torch.equal(s, s_general)


def test_chunk_fast_entry_leaves_other_head_dims_to_the_general_path(monkeypatch):
    kw = make_inputs(lens=[17, 3], H=2, D=64, dtype=torch.bfloat16, device="cuda")
    answers = fast_spy(monkeypatch, "_chunk_fast")
    _check(kw)
    assert len(answers) == 1 and answers[0].startswith("v: "), answers


@pytest.mark.parametrize("gate", ["lower_bound", "precomputed"])
def test_families_agree(gate):
    """The sm_90 family runs the recurrence's products on wgmma, the sm_80 family on mma.sync: the
    same operands, fp32 accumulation in another order, so equal to fp32 rounding (and the bf16
    roundings it flips). chunk_prepare is the same kernel in both."""
    kw = make_inputs(lens=[100, 3, 200, 0, 64], H=2, HV=4, D=128, gate=gate, dtype=torch.bfloat16, device="cuda",
                     mask_prob=0.1 if gate == "precomputed" else 0.0)
    res = {}
    for family in ("sm80", "sm90"):
        with kernel_family(family):
            res[family] = flashkda.chunk_kda(**kw, output_final_state=True)
    o, s = res["sm90"]
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_err(o, res["sm80"][0]) < 2e-3 and rel_err(s, res["sm80"][1]) < 2e-3


@pytest.mark.parametrize("segment", [0, 1])
def test_cuda_graph_replay_matches_eager(monkeypatch, segment):
    """Replay with new inputs equals eager, bit for bit: whole chains, and segments (their state
    workspace comes from the caching allocator too)."""
    monkeypatch.setattr(_ext.config, "chunk_segment", segment)
    gen_kw = dict(lens=[70, 1, 130], H=2, D=128, dtype=torch.bfloat16, device="cuda", state_v_first=True)
    static = make_inputs(**gen_kw)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    box = {}

    def step():
        box["o"], box["s"] = flashkda.chunk_kda(**static, output_final_state=True)

    step()  # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        fresh = make_inputs(**gen_kw)
        for n in names:
            static[n].copy_(fresh[n])
        o_eager, s_eager = flashkda.chunk_kda(**static, output_final_state=True)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(box["o"], o_eager)
        assert torch.equal(box["s"], s_eager)


def test_torch_compile_fullgraph_matches_eager():
    kw = make_inputs(lens=[40, 90], H=2, D=128, dtype=torch.bfloat16, device="cuda", state_v_first=True)

    def prefill(q, k, v):
        o, s = flashkda.chunk_kda(q * 1.5, k, v, kw["g"], kw["beta"], A_log=kw["A_log"], dt_bias=kw["dt_bias"],
                                  initial_state=kw["initial_state"], output_final_state=True,
                                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                  use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, state_v_first=True,
                                  cu_seqlens=kw["cu_seqlens"])
        return o.float().sum(-1), s

    compiled = torch.compile(prefill, fullgraph=True)
    out_c = compiled(kw["q"], kw["k"], kw["v"])
    out_e = prefill(kw["q"], kw["k"], kw["v"])
    torch.cuda.synchronize()
    torch.testing.assert_close(out_c, out_e)


def test_more_sequences_than_grid_rows():
    """More than 65535 sequences: chunk_recurrence takes several launches (and chunk_prepare's grid
    spills into z). Bitwise equal to the two halves run apart, each within one launch."""
    gen = torch.Generator().manual_seed(3)
    choices = [0, 1, 2, 5, 17]
    lens = [choices[int(i)] for i in torch.randint(len(choices), (65535 + 700,), generator=gen)] + [130, 65]
    kw = make_inputs(lens=lens, H=1, HV=1, D=128, dtype=torch.bfloat16, device="cuda", state=False,
                     state_v_first=True, seed=3)
    kw["initial_state"] = 0.1 * torch.randn(len(lens), 1, 128, 128, device="cuda")
    _poison_allocator()
    o, s = flashkda.chunk_kda(**kw, output_final_state=True)
    torch.cuda.synchronize()
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    cu = kw["cu_seqlens"].tolist()
    half = len(lens) // 2
    for n0, n1 in ((0, half), (half, len(lens))):
        t0, t1 = cu[n0], cu[n1]
        part = {name: (x[:, t0:t1] if name in ("q", "k", "v", "g", "beta") else x) for name, x in kw.items()}
        part["initial_state"] = kw["initial_state"][n0:n1]
        part["cu_seqlens"] = kw["cu_seqlens"][n0:n1 + 1] - t0
        _poison_allocator()
        op, sp = flashkda.chunk_kda(**part, output_final_state=True)
        torch.cuda.synchronize()
        assert torch.equal(o[:, t0:t1], op) and torch.equal(s[n0:n1], sp)


@pytest.mark.slow
def test_more_chunks_than_grid_rows():
    """More than 65535 chunk slots: chunk_prepare's grid spills into z. A short sequence at each end
    of the batch (the first and the last slots) against the reference."""
    H, D, edge = 1, 128, 300
    T = (65535 + 8) * 64
    gen = torch.Generator(device="cuda").manual_seed(2)
    mk = lambda *s: torch.randn(*s, device="cuda", generator=gen, dtype=torch.bfloat16)  # noqa: E731
    kw = dict(q=mk(1, T, H, D), k=mk(1, T, H, D), v=mk(1, T, H, D), g=mk(1, T, H, D), beta=mk(1, T, H),
              A_log=torch.rand(H, device="cuda"), dt_bias=torch.randn(H * D, device="cuda"),
              initial_state=0.1 * torch.randn(3, H, D, D, device="cuda"),
              cu_seqlens=torch.tensor([0, edge, T - edge, T], dtype=torch.int32, device="cuda"),
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              lower_bound=-5.0, state_v_first=True)
    _poison_allocator()
    o, s = flashkda.chunk_kda(**kw, output_final_state=True)
    torch.cuda.synchronize()
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    for n, (bos, eos) in enumerate([(0, edge), (T - edge, T)]):
        sub = {name: (x[:, bos:eos] if name in ("q", "k", "v", "g", "beta") else x) for name, x in kw.items()}
        sub["initial_state"] = kw["initial_state"][2 * n:2 * n + 1]
        sub["cu_seqlens"] = None
        ref_o, ref_s = reference64(sub, output_final_state=True)
        assert rel_err(o[:, bos:eos], ref_o) <= TOL[torch.bfloat16][0]
        assert rel_err(s[2 * n:2 * n + 1], ref_s) <= TOL[torch.bfloat16][1]


@pytest.mark.slow
def test_64bit_offsets():
    """T·HV·V > 2^31 elements: the last sequence lies entirely past 2^31 elements of v and o."""
    H, D, tail = 16, 128, 300
    T = (1 << 20) + (1 << 16)
    if torch.cuda.get_device_properties(0).total_memory < 80 * (1 << 30):
        pytest.skip("needs about 45 GB of GPU memory")
    gen = torch.Generator(device="cuda").manual_seed(1)
    mk = lambda *s: torch.randn(*s, device="cuda", generator=gen, dtype=torch.bfloat16)  # noqa: E731
    kw = dict(q=mk(1, T, H, D), k=mk(1, T, H, D), v=mk(1, T, H, D), g=mk(1, T, H, D), beta=mk(1, T, H),
              A_log=torch.rand(H, device="cuda"), dt_bias=torch.randn(H * D, device="cuda"),
              initial_state=0.1 * torch.randn(2, H, D, D, device="cuda"),
              cu_seqlens=torch.tensor([0, T - tail, T], dtype=torch.int32, device="cuda"),
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              lower_bound=-5.0, state_v_first=True)
    assert (T - tail) * H * D > (1 << 31)
    o, s = flashkda.chunk_kda(**kw, output_final_state=True)
    torch.cuda.synchronize()
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    sub = {n: (x[:, T - tail:] if n in ("q", "k", "v", "g", "beta") else x) for n, x in kw.items()}
    sub["initial_state"] = kw["initial_state"][1:]
    sub["cu_seqlens"] = None
    ref_o, ref_s = reference64(sub, output_final_state=True)
    assert rel_err(o[:, T - tail:], ref_o) <= TOL[torch.bfloat16][0]
    assert rel_err(s[1:], ref_s) <= TOL[torch.bfloat16][1]
