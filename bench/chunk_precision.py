"""Precision study for the chunked prefill kernels (CPU, PyTorch): the chunked algorithm with the
rounding a tensor-core kernel applies — bf16 operands for every matrix product, fp32 accumulation —
against the fp64 token-by-token recurrence, on the prefill's accuracy case (tests/test_cuda_chunk.py).

Choices compared: chunk size (16 / 32 / 64 tokens, gate references per 16-token sub-chunk), the
state operand of the state products (bf16 like the other operands, or kept fp32), the precision of
the inverse (I + A)^-1 (fp32, or rounded to bf16 before it multiplies), and the corrected values
U = (I + A)^-1 β (V − K S) as an operand of the output and state products (bf16, or fp32 — e.g. a
bf16 hi/lo split or tf32). The state itself is always carried in fp32 between chunks.

    python bench/chunk_precision.py [--segments]

--segments: the sequence split into segments whose recurrences run in parallel and are joined by a
scan of their affine transitions (the few-chains case), against the plain chunked order.
"""

from __future__ import annotations

import torch

from flashkda.reference import kda_reference, preprocess

SUB = 16  # gate reference interval: exp(±(Γ − Γ_ref)) stays within 16 · |lower_bound| of 1


def bf(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def chunked(q, k, v, g, beta, S, C: int, state_op_bf16: bool, inverse_bf16: bool, bounded: bool,
            u_bf16: bool = True):
    """One sequence: q, k [T, H, K], v [T, H, V], g [T, H, K] log decay, beta [T, H], S [H, K, V]
    (all fp32). Returns o [T, H, V] and the final S.

    bounded (lower-bound gate): the intra-chunk products are two bf16 operands referenced to the
    sub-chunk of i. Otherwise (unbounded gate) exp(Γ_i − Γ_j) is formed pairwise in fp32 and
    multiplies bf16 k and q elementwise (CUDA-core work in a kernel)."""
    T = q.shape[0]
    o = torch.empty_like(v)
    rnd_s = bf if state_op_bf16 else (lambda x: x)
    for s in range(0, T, C):
        e = min(s + C, T)
        n = e - s
        qc, kc, vc, bc = (x[s:e].transpose(0, 1) for x in (q, k, v, beta))  # [H, n, ...]
        gam = g[s:e].transpose(0, 1).cumsum(1)  # [H, n, K]
        ref = gam[:, (torch.arange(n) // SUB) * SUB]  # Γ at the start of each token's sub-chunk
        # A[i, j] = Σ k_i k_j e^{Γ_i − Γ_j} for j < i, as the product of two bf16 operands referenced to
        # the sub-chunk of i: (k_i e^{Γ_i − Γ_r(i)}) · (k_j e^{Γ_r(i) − Γ_j}).
        lower = torch.ones(n, n, dtype=torch.bool).tril(-1)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        if bounded:
            left_k = bf(kc * (gam - ref).exp())
            left_q = bf(qc * (gam - ref).exp())
            # [H, i, j, K]; entries with j beyond i's sub-chunk may overflow and are masked below
            right = bf(kc[:, None] * (ref[:, :, None] - gam[:, None]).exp()).nan_to_num(posinf=0.0)
            a_kk = torch.einsum("hik,hijk->hij", left_k, right)
            a_qk = torch.einsum("hik,hijk->hij", left_q, right)
        else:
            diff = gam[:, :, None] - gam[:, None]  # [H, i, j, K]
            decay = torch.where(causal[None, :, :, None], diff, float("-inf")).exp()
            a_kk = torch.einsum("hik,hjk,hijk->hij", bf(kc), bf(kc), decay)
            a_qk = torch.einsum("hik,hjk,hijk->hij", bf(qc), bf(kc), decay)
        a_kk = torch.where(lower, a_kk, 0.0)
        a_qk = torch.where(causal, a_qk, 0.0)
        lhs = torch.eye(n) + bc[..., None] * a_kk
        inv = torch.linalg.solve_triangular(lhs, torch.eye(n).expand_as(lhs), upper=False, unitriangular=True)
        if inverse_bf16:
            inv = bf(inv)
        k_dec = bf(kc * gam.exp())  # k_i e^{Γ_i}
        w = bf(inv @ (bc[..., None] * k_dec))  # WY form: U = T β V − W S
        u = inv @ bf(bc[..., None] * vc) - w @ rnd_s(S)
        if u_bf16:
            u = bf(u)
        q_dec = bf(qc * gam.exp())
        o[s:e] = (q_dec @ rnd_s(S) + bf(a_qk) @ u).transpose(0, 1)
        k_tail = bf(kc * (gam[:, -1:] - gam).exp())
        S = S * gam[:, -1].exp()[..., None] + k_tail.transpose(1, 2) @ u
    return o, S


def segmented(q, k, v, g, beta, S, C: int, seg_chunks: int, bounded: bool):
    """The same sequence split into segments of seg_chunks chunks whose recurrences run in parallel
    (the few-chains case): per segment the local final state Q (from S = 0) and the transition P
    (the same recurrence with v = 0 from S = I, so that S_end = P S_start + Q), then the segment start
    states by the scan S_{s+1} = P_s S_s + Q_s in fp32, then each segment again from its start state
    for the output. All products as in chunked() (bf16 operands, fp32 accumulation)."""
    T, H, K = q.shape
    L = C * seg_chunks
    bounds = [(s, min(s + L, T)) for s in range(0, T, L)]
    eye = torch.eye(K).expand(H, K, K).contiguous()
    locals_ = []
    for s, e in bounds:
        args = (q[s:e], k[s:e])
        _, Q = chunked(*args, v[s:e], g[s:e], beta[s:e], torch.zeros_like(S), C, True, True, bounded)
        _, P = chunked(*args, torch.zeros(e - s, H, K), g[s:e], beta[s:e], eye, C, True, True, bounded)
        locals_.append((P, Q))
    o = torch.empty_like(v)
    for (s, e), (P, Q) in zip(bounds, locals_):
        o[s:e], _ = chunked(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], S, C, True, True, bounded)
        S = P @ S + Q
    return o, S


def case(seed: int, gate: str):
    gen = torch.Generator().manual_seed(seed)
    lens, H, D = [700, 1348], 4, 128
    T = sum(lens)
    r = lambda *s, sc=1.0: (sc * torch.randn(*s, generator=gen))  # noqa: E731
    kw = dict(q=r(1, T, H, D).bfloat16(), k=r(1, T, H, D).bfloat16(), v=r(1, T, H, D).bfloat16(),
              g=r(1, T, H, D, sc=2.0).bfloat16(), beta=r(1, T, H).bfloat16(),
              A_log=torch.rand(H, generator=gen), dt_bias=r(H * D), initial_state=0.1 * r(2, H, D, D),
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              lower_bound=-5.0 if gate == "lower_bound" else None)
    cu = torch.tensor([0, lens[0], T])
    return kw, cu


def prepared(gate: str):
    """The accuracy case for one gate: its fp64 reference, the preprocessed inputs, and a function that
    runs a chunked variant on each sequence and returns the output and final-state errors."""
    kw, cu = case(0, gate)
    d = {n: (x.double() if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    ref_o, ref_s = kda_reference(**d, cu_seqlens=cu, output_final_state=True, core="recurrent")
    qp, kp, gp, bp = preprocess(kw["q"], kw["k"], kw["g"], kw["beta"], scale=128 ** -0.5,
                                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=kw["A_log"],
                                dt_bias=kw["dt_bias"], lower_bound=kw["lower_bound"], use_beta_sigmoid_in_kernel=True)

    def errors(run):  # run(q, k, v, g, beta, S) -> (o, S) for one sequence
        outs, states = [], []
        for n in range(2):
            sl = slice(int(cu[n]), int(cu[n + 1]))
            o, s = run(qp[0, sl], kp[0, sl], kw["v"][0, sl].float(), gp[0, sl], bp[0, sl],
                       kw["initial_state"][n].clone())
            outs.append(o.bfloat16())
            states.append(s)
        o, s = torch.cat(outs)[None].double(), torch.stack(states).double()
        return float((o - ref_o).norm() / ref_o.norm()), float((s - ref_s).norm() / ref_s.norm())

    return errors


def main():
    print(f"{'gate':<12}{'chunk':>6}{'state op':>10}{'inverse':>9}{'U op':>6}{'out err':>10}{'state err':>11}")
    for gate in ("lower_bound", "softplus"):
        errors = prepared(gate)
        bounded = gate == "lower_bound"
        variants = [(C, True, True, True) for C in (16, 32, 64)] + [(C, True, True, False) for C in (16, 64)] + [
            (64, False, False, False)]
        for C, state_bf16, inv_bf16, u_bf16 in variants:
            eo, es = errors(lambda *a: chunked(*a, C, state_bf16, inv_bf16, bounded=bounded, u_bf16=u_bf16))
            print(f"{gate:<12}{C:>6}{'bf16' if state_bf16 else 'fp32':>10}{'bf16' if inv_bf16 else 'fp32':>9}"
                  f"{'bf16' if u_bf16 else 'fp32':>6}"
                  f"{eo:>10.2e}{es:>11.2e}")


def main_segments():
    print(f"{'gate':<12}{'chunks/segment':>15}{'out err':>10}{'state err':>11}   (chunk 64, bf16 operands)")
    for gate in ("lower_bound", "softplus"):
        errors = prepared(gate)
        bounded = gate == "lower_bound"
        for seg in (0, 8, 4, 1):
            eo, es = errors(lambda *a: chunked(*a, 64, True, True, bounded) if seg == 0
                            else segmented(*a, 64, seg, bounded))
            print(f"{gate:<12}{seg if seg else 'none':>15}{eo:>10.2e}{es:>11.2e}")


if __name__ == "__main__":
    import sys

    if "--segments" in sys.argv:
        main_segments()
    else:
        main()
