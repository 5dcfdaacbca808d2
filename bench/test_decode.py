"""Decode microbenchmarks (serving-grade decode). One token per sequence, H = 32, K = V = 128,
bf16 q/k/v/g/beta, fp32 V-first pool with 8 spare slots and shuffled slot indices, lower-bound gate
-5 with A_log/dt_bias, l2norm and beta sigmoid in the kernel; in place; median of CUDA-event times."""

import pytest
import torch

import flashkda
from cases import DECODE_HEADS, DECODE_NS
from common import cuda_median_ms, floor_ms, host_overhead_us, record

D, SPARE = 128, 8
H, NS = DECODE_HEADS, DECODE_NS

try:
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla_decode
except Exception:  # fla not installed (or no triton): baseline skipped
    fla_decode = None


def _inputs(N, pool_dtype=torch.float32, gdn=False, seed=0, dev="cuda"):
    gen = torch.Generator(device=dev).manual_seed(seed)
    bf = torch.bfloat16

    def rnd(*shape):
        return torch.randn(*shape, device=dev, generator=gen).to(bf)

    g = rnd(N, 1, H) if gdn else rnd(N, 1, H, D)
    return dict(
        q=rnd(N, 1, H, D), k=rnd(N, 1, H, D), v=rnd(N, 1, H, D), g=g, beta=rnd(N, 1, H),
        A_log=torch.rand(H, device=dev, generator=gen),
        dt_bias=torch.rand(H if gdn else H * D, device=dev, generator=gen),
        initial_state=(0.1 * torch.randn(N + SPARE, H, D, D, device=dev, generator=gen)).to(pool_dtype),
        ssm_state_indices=torch.randperm(N + SPARE, device=dev, generator=gen)[:N].to(torch.int32),
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
        lower_bound=-5.0, state_v_first=True,
    )


def _bytes(N, pool_bytes=4, gdn=False):
    state = 2 * N * H * D * D * pool_bytes
    tokens = N * H * D * 2 * (4 if not gdn else 3) + N * H * 2 * (2 if gdn else 1) + N * H * D * 2  # q k v (g) o
    return state + tokens


CASES = [("flashkda", torch.float32, False), ("flashkda_bf16pool", torch.bfloat16, False),
         ("flashkda_gdn", torch.float32, True)]


@pytest.mark.parametrize("N", NS)
@pytest.mark.parametrize("impl,pool_dtype,gdn", CASES, ids=[c[0] for c in CASES])
def test_decode(benchmark, N, impl, pool_dtype, gdn):
    kw = _inputs(N, pool_dtype, gdn)
    out = torch.empty_like(kw["v"])
    fn = flashkda.fused_recurrent_gated_delta_rule if gdn else flashkda.fused_recurrent_kda

    def call():
        fn(**kw, out=out)

    ms = cuda_median_ms(call, calls=100)
    fl = floor_ms(_bytes(N, pool_dtype.itemsize, gdn))
    extra = {}
    if impl == "flashkda":
        extra["host_overhead_us"] = round(host_overhead_us(call), 2)
    rec = record(f"decode_N{N}_H{H}", impl, ms, fl, **extra)
    benchmark.extra_info.update(rec)
    benchmark.pedantic(lambda: (call(), torch.cuda.synchronize()), rounds=20, iterations=1)


@pytest.mark.skipif(fla_decode is None, reason="fla not importable")
@pytest.mark.parametrize("N", NS)
def test_decode_fla(benchmark, N):
    kw = _inputs(N)
    out = torch.empty_like(kw["v"])

    def call():
        fla_decode(**kw, inplace_final_state=True, out=out)

    ms = cuda_median_ms(call, calls=100)
    rec = record(f"decode_N{N}_H{H}", "fla_fused_recurrent_kda", ms, floor_ms(_bytes(N)))
    benchmark.extra_info.update(rec)
    benchmark.pedantic(lambda: (call(), torch.cuda.synchronize()), rounds=20, iterations=1)
