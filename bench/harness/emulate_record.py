"""fp64 emulation of the chunked kernels' 16-bit roundings, for record-format what-ifs on the CPU.

Runs the prefill's accuracy case (varlen [700, 1348], H = 4, lower-bound gate -5 with A_log and
dt_bias, l2norm and beta sigmoid in the kernel, bf16 inputs) through the chunk algorithm of
chunk_prepare / chunk_recurrence in fp64, rounding to bf16 exactly where the kernels store or feed a
16-bit operand: the pivoted row and column operands of the A / M products (with the off-diagonal
per-channel factor applied to the column operand), M, T, w, q e^Γ, k e^Γ, k e^{Γ_C−Γ}, the state
and U as MMA operands. It prints the output and final-state errors against the fp64 recurrent
reference, as `bench/prefill_quick.py accuracy` does on the GPU.

    PYTHONPATH=.:tests python bench/harness/emulate_record.py [--record t,tv]

`--record t` is the kernels' record (T, the recurrence forms T v). On the H200 the kernels measured
4.07e-3 / 3.22e-3 (output / state) on this case, and this emulation gives the same figures.
`--record tv` stores T v rounded to bf16 instead: predicted 4.10e-3 / 3.33e-3, and a build of that
format measured 4.10e-3 / 3.33e-3 (BENCHMARK_H200.md, twenty-second session). Add a format here
before building it when the question is whether it keeps the accuracy bounds.
"""

from __future__ import annotations

import argparse

import torch

from flashkda.reference import preprocess
from helpers import reference64, rel_err

CHUNK, SUB = 64, 16  # chunk_params.h kChunk, kSubChunk


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float64)


def chunk_emulated(q, k, v, g, beta, S, record: str):
    """One sequence. q, k, g: [T, H, K] preprocessed, fp64; v: [T, H, V]; beta: [T, H];
    S: [H, K, V] key-first. Returns (o [T, H, V], S)."""
    T, H = q.shape[0], q.shape[1]
    o = torch.empty_like(v)
    low = torch.ones(CHUNK, CHUNK, dtype=torch.bool).tril()
    eye = torch.eye(CHUNK, dtype=torch.float64)
    for s in range(0, T, CHUNK):
        e = min(s + CHUNK, T)
        pad = CHUNK - (e - s)

        def chunk_of(x):
            x = x[s:e]
            return torch.cat([x, x.new_zeros((pad,) + x.shape[1:])]) if pad else x

        qc, kc, vc, bc, gc = (chunk_of(x) for x in (q, k, v, beta, g))
        gam = gc.cumsum(0)  # Γ from the chunk start, [64, H, K]
        qd, kt, kd = bf16(qc * gam.exp()), bf16(kc * gam.exp()), bf16(kc * (gam[-1] - gam).exp())
        # Pivoted operands per sub-chunk: γ from the sub-chunk start, pivot h = τ / 2.
        sub = gc.reshape(CHUNK // SUB, SUB, *gc.shape[1:])
        tau = sub.sum(1)
        h = tau / 2
        gs = sub.cumsum(1).reshape(CHUNK, *gc.shape[1:])
        hh = h.repeat_interleave(SUB, 0)
        ki, qi, kj = bf16(kc * (gs - hh).exp()), bf16(qc * (gs - hh).exp()), bf16(kc * (hh - gs).exp())
        A = torch.zeros(H, CHUNK, CHUNK, dtype=torch.float64)
        M = torch.zeros_like(A)
        for a in range(CHUNK // SUB):
            for b in range(a + 1):
                ra, cb = slice(SUB * a, SUB * a + SUB), slice(SUB * b, SUB * b + SUB)
                col = kj[cb]
                if b < a:  # the block's per-channel factor, on the column operand
                    between = sum((tau[m] for m in range(b + 1, a)), torch.zeros_like(tau[0]))
                    col = bf16(col * (h[a] + between + tau[b] - h[b]).exp())
                A[:, ra, cb] = torch.einsum("ihk,jhk->hij", ki[ra], col)
                M[:, ra, cb] = torch.einsum("ihk,jhk->hij", qi[ra], col)
        A = torch.where(low.tril(-1), A, 0.0) * bc.T[:, :, None]
        M = bf16(torch.where(low, M, 0.0))
        Tm = bf16(torch.linalg.solve_triangular(eye + A, torch.diag_embed(bc.T), upper=False, unitriangular=True))
        w = bf16(torch.einsum("hij,jhk->hik", Tm, kt))
        Tv = torch.einsum("hij,jhv->hiv", Tm, vc)
        if record == "tv":
            Tv = bf16(Tv)
        Sb = bf16(S)
        U = bf16(Tv - w @ Sb)
        O = torch.einsum("ihk,hkv->hiv", qd, Sb) + M @ U
        o[s:e] = bf16(O.permute(1, 0, 2))[: e - s]
        S = S * gam[-1].exp()[..., None] + torch.einsum("ihk,hiv->hkv", kd, U)
    return o, S


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--record", default="t,tv", help="comma-separated formats: t (the kernels'), tv")
    args = ap.parse_args()
    torch.set_default_dtype(torch.float64)
    gen = torch.Generator().manual_seed(0)
    lens, D, H = [700, 1348], 128, 4
    T = sum(lens)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float32)  # noqa: E731
    dt = torch.bfloat16
    kw = dict(q=r(1, T, H, D).to(dt), k=r(1, T, H, D).to(dt), v=r(1, T, H, D).to(dt),
              g=(2 * r(1, T, H, D)).to(dt), beta=r(1, T, H).to(dt),
              A_log=torch.rand(H, generator=gen, dtype=torch.float32), dt_bias=r(H * D),
              initial_state=0.1 * r(2, H, D, D), cu_seqlens=torch.tensor([0, lens[0], T], dtype=torch.int32),
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              lower_bound=-5.0, state_v_first=True)
    ro, rs = reference64(kw, output_final_state=True)
    q, k, g, beta = preprocess(kw["q"], kw["k"], kw["g"], kw["beta"], scale=D ** -0.5, use_qk_l2norm_in_kernel=True,
                               use_gate_in_kernel=True, A_log=kw["A_log"], dt_bias=kw["dt_bias"], lower_bound=-5.0,
                               use_beta_sigmoid_in_kernel=True, dtype=torch.float64)
    v = kw["v"].double()
    for record in args.record.split(","):
        outs, states = [], []
        for n, (b, e) in enumerate(zip([0, lens[0]], [lens[0], T])):
            S0 = kw["initial_state"][n].double().transpose(-1, -2)  # V-first -> key-first
            o, S = chunk_emulated(q[0, b:e], k[0, b:e], v[0, b:e], g[0, b:e], beta[0, b:e], S0, record)
            outs.append(o)
            states.append(S.transpose(-1, -2))
        o, s = torch.cat(outs)[None], torch.stack(states)
        print(f"record {record:3s} output {rel_err(o, ro):.2e}  state {rel_err(s, rs):.2e}", flush=True)


if __name__ == "__main__":
    main()
