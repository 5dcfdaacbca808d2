"""Prefill microbenchmarks (chunked prefill), set up as BENCHMARK_H200.md's Prefill section describes.

B = 1, K = V = 128, bf16 q/k/v/g/beta (raw: l2norm, gate and beta sigmoid in the kernel), lower-bound
gate -5 with A_log [H] and dt_bias [H, K], safe_gate, fp32 V-first initial and final state,
inference mode. FLA's chunk_kda and chunk_gated_delta_rule (the scalar-gate baseline) run in the
same process when importable; the floor is the bytes that must move over the copy bandwidth.
Records: impl flashkda, flashkda_softplus (unbounded gate), flashkda_gdn (scalar gate), flashkda_sm80
(the sm_80 kernel family forced), fla_chunk_kda, fla_chunk_gdn; cases named as in bench/cases.py, plus
sweep_T{T}_H{H} for the plot of time against T.
"""

import pytest
import torch

import flashkda
from flashkda._constants import CHUNK_STATE_TOKENS as CHUNK
from cases import PREFILL_ROWS, PREFILL_SWEEP, PREFIX_CHECKPOINT_TOKENS, PREFIX_ROW
from common import cuda_median_ms, floor_ms, kernel_family, record

D = 128
ROWS = PREFILL_ROWS
SWEEP = PREFILL_SWEEP

try:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn
    from fla.ops.kda import chunk_kda as fla_kda
except Exception:  # fla not installed (or no triton): baselines skipped
    fla_kda = fla_gdn = None


def _inputs(lens, H, seed=0, device="cuda"):
    gen = torch.Generator(device=device).manual_seed(seed)
    T = sum(lens)
    bf = torch.bfloat16

    def rnd(*shape):
        return torch.randn(*shape, device=device, generator=gen).to(bf)

    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return dict(
        q=rnd(1, T, H, D), k=rnd(1, T, H, D), v=rnd(1, T, H, D), g=rnd(1, T, H, D), beta=rnd(1, T, H),
        A_log=torch.rand(H, device=device, generator=gen), dt_bias=torch.rand(H, D, device=device, generator=gen),
        initial_state=0.1 * torch.randn(len(lens), H, D, D, device=device, generator=gen),
        cu_seqlens=cu if len(lens) > 1 else None, cu_seqlens_cpu=cu.cpu() if len(lens) > 1 else None,
    )


KDA_FLAGS = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                 use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0, state_v_first=True)


def _floor(lens, H, gdn=False):
    T, N = sum(lens), len(lens)
    tokens = T * H * D * 2 * (4 if gdn else 5) + T * H * (6 if gdn else 2)  # q k v o, g bf16 (KDA); beta, g fp32 (GDN)
    return floor_ms(tokens + 2 * N * H * D * D * 4)


def _calls(lens, H):
    return 20 if sum(lens) * H > 8192 * 32 else 50


def _gdn_inputs(kw):
    g = torch.nn.functional.logsigmoid(torch.randn(kw["q"].shape[:3], device="cuda"))
    return dict(q=kw["q"], k=kw["k"], v=kw["v"], g=g, beta=kw["beta"].float().sigmoid().to(kw["beta"].dtype),
                initial_state=kw["initial_state"], output_final_state=True, use_qk_l2norm_in_kernel=True,
                state_v_first=True, cu_seqlens=kw["cu_seqlens"])


IMPLS = ["flashkda", "flashkda_softplus", "flashkda_gdn", "flashkda_sm80", "fla_chunk_kda", "fla_chunk_gdn"]


def _run(case, lens, H, impl, benchmark):
    kw = _inputs(lens, H)
    if impl == "flashkda":
        fn = lambda: flashkda.chunk_kda(**kw, **KDA_FLAGS)  # noqa: E731
    elif impl == "flashkda_sm80":
        def fn():
            with kernel_family("sm80"):
                flashkda.chunk_kda(**kw, **KDA_FLAGS)
    elif impl == "flashkda_softplus":
        flags = dict(KDA_FLAGS, lower_bound=None, safe_gate=False)
        fn = lambda: flashkda.chunk_kda(**kw, **flags)  # noqa: E731
    elif impl == "flashkda_gdn":
        gk = _gdn_inputs(kw)
        fn = lambda: flashkda.chunk_gated_delta_rule(**gk)  # noqa: E731
    elif impl == "fla_chunk_kda":
        if fla_kda is None:
            pytest.skip("fla not importable")
        fla_kw = dict(kw, dt_bias=kw["dt_bias"].reshape(-1))
        fn = lambda: fla_kda(**fla_kw, **KDA_FLAGS)  # noqa: E731
    else:
        if fla_gdn is None:
            pytest.skip("fla not importable")
        gk = _gdn_inputs(kw)
        fn = lambda: fla_gdn(**gk)  # noqa: E731
    with torch.inference_mode():
        ms = cuda_median_ms(fn, calls=_calls(lens, H))
        rec = record(case, impl, ms, _floor(lens, H, gdn=impl.endswith("gdn")))
        benchmark.extra_info.update(rec)
        benchmark.pedantic(lambda: (fn(), torch.cuda.synchronize()), rounds=3, iterations=1)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(ROWS))
def test_prefill(benchmark, case, impl):
    lens, H = ROWS[case]
    _run(case, lens, H, impl, benchmark)


PREFIX_IMPLS = ["flashkda", "fla_chunk_kda"]


def checkpoint_kwargs(N, chunks, H, every, dtype=torch.float32, index_dtype=torch.int32, none=False):
    """checkpoint_pool / checkpoint_slots for a checkpoint every `every` chunks of every sequence
    (chunk j = every, 2 every, ... into slots 1, 2, ...; none=True: a slot table naming no slot)."""
    slots = torch.full((N, chunks), -1, dtype=index_dtype)
    if not none:
        slots[:, every::every] = torch.arange(1, (chunks - 1) // every + 1, dtype=index_dtype)
    return dict(checkpoint_pool=torch.zeros(chunks // every + 1, H, D, D, device="cuda", dtype=dtype),
                checkpoint_slots=slots.cuda())


def prefix_state_bytes(kind, chunks, H):
    """Bytes the states at chunk starts add: every chunk's bf16 state, or the fp32 checkpoints."""
    every = PREFIX_CHECKPOINT_TOKENS // CHUNK
    return chunks * H * D * D * 2 if kind == "intermediate_states" else (chunks - 1) // every * H * D * D * 4


@pytest.mark.parametrize("impl", PREFIX_IMPLS)
@pytest.mark.parametrize("kind", ["intermediate_states", "checkpoints"])
def test_prefill_prefix_states(benchmark, kind, impl):
    """PREFIX_ROW keeping the states at chunk starts: every chunk's (return_intermediate_states, bf16
    h) or one every PREFIX_CHECKPOINT_TOKENS tokens into an fp32 pool (flashkda only; FLA has no such
    form). plain_ms: the same call without them, timed just before."""
    lens, H = ROWS[PREFIX_ROW]
    if impl == "fla_chunk_kda" and (fla_kda is None or kind == "checkpoints"):
        pytest.skip("fla not importable" if fla_kda is None else "FLA has no checkpoint pool")
    kw = _inputs(lens, H)
    chunks = -(-sum(lens) // CHUNK)
    extra = dict(return_intermediate_states=True) if kind == "intermediate_states" else \
        checkpoint_kwargs(len(lens), chunks, H, PREFIX_CHECKPOINT_TOKENS // CHUNK)
    if impl == "flashkda":
        plain_fn = lambda: flashkda.chunk_kda(**kw, **KDA_FLAGS)  # noqa: E731
        fn = lambda: flashkda.chunk_kda(**kw, **KDA_FLAGS, **extra)  # noqa: E731
    else:
        fla_kw = dict(kw, dt_bias=kw["dt_bias"].reshape(-1))
        plain_fn = lambda: fla_kda(**fla_kw, **KDA_FLAGS)  # noqa: E731
        fn = lambda: fla_kda(**fla_kw, **KDA_FLAGS, **extra)  # noqa: E731
    h_bytes = prefix_state_bytes(kind, chunks, H)
    with torch.inference_mode():
        plain = cuda_median_ms(plain_fn, calls=_calls(lens, H))
        ms = cuda_median_ms(fn, calls=_calls(lens, H))
        rec = record(f"{PREFIX_ROW}_{kind}", impl, ms, _floor(lens, H) + floor_ms(h_bytes), plain_ms=round(plain, 5))
        benchmark.extra_info.update(rec)
        benchmark.pedantic(lambda: (fn(), torch.cuda.synchronize()), rounds=3, iterations=1)


@pytest.mark.sweep
@pytest.mark.parametrize("impl", ["flashkda", "fla_chunk_kda", "fla_chunk_gdn"])
@pytest.mark.parametrize("case", list(SWEEP))
def test_prefill_sweep(benchmark, case, impl):
    lens, H = SWEEP[case]
    _run(case, lens, H, impl, benchmark)
