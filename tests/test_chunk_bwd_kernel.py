"""The chunked backward's kernels: both passes of ``chunk_local_grad``, both scans of
``chunk_state_scan`` and the per-token passes (``chunk_bwd_inputs``, ``chunk_bwd_input_grads``)
against PyTorch references of the same math (on the GPU), and the backward built on them
(``flashkda.autograd``: chunk layout, scans, GVA, the per-token glue) against the PyTorch backward,
on the CPU with the references standing in for the kernels."""

from __future__ import annotations

import pytest
import torch

from flashkda import _constants as C
from flashkda import _ext
from flashkda import autograd as ag
from flashkda.reference import preprocess
from helpers import GRAD_INPUTS, HAS_CUDA_KERNELS, make_inputs, rel_err

CHUNK = ag._CHUNK


def _chunk_index(bos: torch.Tensor, length: torch.Tensor, rows: int) -> torch.Tensor:
    """[chunks, CHUNK] token row of every chunk position, ``rows`` (a zero row) past its length."""
    pos = torch.arange(CHUNK, device=bos.device)
    return torch.where(pos[None] < length[:, None].long(), bos[:, None] + pos[None], rows)


def local_grad_reference(q, k, v, g, beta, dO, bos, length, pass_, states=None, dstates=None, every_token=False,
                         overwrite_inputs=False, qk_rnorm=None, scale=1.0, l2norm=False, qk_dtype=None):
    """What ``torch.ops.flashkda.chunk_local_grad`` computes, from flashkda.autograd's chunk math (a
    scalar gate ``[rows, HV]`` for every key channel, its gradient summed over them); with
    ``overwrite_inputs``, dq, dk (unless ``qk_dtype``), dg and dbeta written into q, k, g and beta, as
    the op does; with ``qk_dtype``, dq and dk those of the raw q and k (through ``scale`` and, with
    ``l2norm``, the l2 norm of the rows whose 1 / norms are ``qk_rnorm``) in that dtype."""
    if qk_dtype is not None:
        out = local_grad_reference(q, k, v, g, beta, dO, bos, length, pass_, states, dstates, every_token)
        raw = []
        for i, (x, dx) in enumerate(zip((q, k), out[:2])):
            dy = dx * (1.0 if i else scale)
            if l2norm:
                dy = ag._l2norm_grad_of(x / (1.0 if i else scale), qk_rnorm[..., i:i + 1], dy)
            raw.append(dy.to(qk_dtype))
        if overwrite_inputs:
            for x, d in zip((g, beta), out[3:]):
                x.copy_(d)
            out[3:] = [g, beta]
        return raw + out[2:]
    if overwrite_inputs:
        assert pass_ == 1 and every_token, "the op refuses overwrite_inputs here"
        out = local_grad_reference(q, k, v, g, beta, dO, bos, length, pass_, states, dstates, every_token)
        for x, d in zip((q, k, g, beta), [out[i] for i in (0, 1, 3, 4)]):
            x.copy_(d)
        return [q, k, out[2], g, beta]
    rows, HV, K = q.shape
    v, dO = v.to(q.dtype), dO.to(q.dtype)  # the op takes them in any float dtype
    scalar_gate = g.dim() == 2
    if scalar_gate:
        g = g[..., None].expand(rows, HV, K)
    idx = _chunk_index(bos, length, rows)

    def chunks(x):  # [rows, HV, D] -> [chunks, HV, CHUNK, D]
        flat = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
        return flat[idx].permute(0, 2, 1, 3)

    def tokens(x):  # the inverse, tokens in no chunk zero
        out = x.new_zeros(rows + 1, HV, x.shape[-1])
        out.index_add_(0, idx.reshape(-1), x.permute(0, 2, 1, 3).reshape(-1, HV, x.shape[-1]))
        return out[:-1]

    qc, kc, vc, gc, dOc = (chunks(x) for x in (q, k, v, g, dO))
    bc = chunks(beta[..., None])[..., 0]
    dec = ag._decays(gc, pivot=False)
    loc = ag._chunk_local(qc, kc, vc, bc, dec)
    if pass_ == 0:
        D = torch.diag_embed(loc.decay) - loc.kd.transpose(-1, -2) @ loc.w
        return [D, loc.kd.transpose(-1, -2) @ loc.u, (loc.qg - loc.M @ loc.w).transpose(-1, -2) @ dOc]
    grads = ag._chunk_local_backward(loc, dec, qc, kc, vc, bc, states, dOc, dstates)
    dg = tokens(grads[3].sum(-1, keepdim=True))[..., 0] if scalar_gate else tokens(grads[3])
    return [tokens(x) for x in grads[:3]] + [dg, tokens(grads[4][..., None])[..., 0]]


def state_scan_reference(maps, offsets, start, seq_first, seq_chunks, reverse):
    """What ``torch.ops.flashkda.chunk_state_scan`` computes (chunk_bwd_params.h): sequence n's
    chunks are ``seq_chunks[n]`` entries from ``seq_first[n]``; entries of no sequence stay zero."""
    out = torch.zeros_like(maps)
    first_grad = start.clone()
    for n, (f, J) in enumerate(zip(seq_first.tolist(), seq_chunks.tolist())):
        if J == 0:
            continue
        if not reverse:
            out[f] = start[n]
            for j in range(J - 1):
                out[f + j + 1] = maps[f + j] @ out[f + j] + offsets[f + j]
            continue
        out[f + J - 1] = start[n]
        for j in range(J - 1, 0, -1):
            out[f + j - 1] = maps[f + j].transpose(-1, -2) @ out[f + j] + offsets[f + j]
        first_grad[n] = maps[f].transpose(-1, -2) @ out[f] + offsets[f]
    return [out, first_grad] if reverse else [out]


def _ref_options(scale, gate_mode, lower_bound, l2norm, beta_sigmoid, allow_neg_eigval) -> ag.ChunkOptions:
    return ag.ChunkOptions(scale, l2norm, gate_mode != C.GATE_PRECOMPUTED,
                           lower_bound if gate_mode == C.GATE_LOWER_BOUND else None, beta_sigmoid, allow_neg_eigval,
                           False, None, None)


def token_inputs_reference(q, k, v, g, beta, A_log, dt_bias, *flags_qk):
    """What ``torch.ops.flashkda.chunk_bwd_inputs`` computes (chunk_bwd_params.h), in fp32: the six
    flags, then ``qk`` (default True; False: q̂, k̂ and the 1 / norms empty)."""
    flags, qk = flags_qk[:6], (flags_qk[6] if len(flags_qk) > 6 else True)
    if not qk:
        out = token_inputs_reference(q, k, v, g, beta, A_log, dt_bias, *flags)
        return [out[0].new_empty(0), out[1].new_empty(0), out[2], out[3], out[4].new_empty(0)]
    o = _ref_options(*flags)
    qp, kp, gp, bp = preprocess(q, k, g, beta, scale=o.scale, use_qk_l2norm_in_kernel=o.use_qk_l2norm_in_kernel,
                                use_gate_in_kernel=o.use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                                lower_bound=o.lower_bound, use_beta_sigmoid_in_kernel=o.use_beta_sigmoid_in_kernel,
                                allow_neg_eigval=o.allow_neg_eigval, dtype=torch.float32)
    group = v.shape[2] // q.shape[2]  # a scalar gate's ĝ: [B, T, HV]
    rnorm = torch.stack([torch.rsqrt((x.float() ** 2).sum(-1) + C.L2NORM_EPS) for x in (q, k)], -1)
    return [qp.repeat_interleave(group, 2), kp.repeat_interleave(group, 2), gp.contiguous(), bp,
            rnorm.repeat_interleave(group, 2)]


def token_grads_reference(q, k, v, g, beta, A_log, dt_bias, dq, dk, dg, dbeta, *flags):
    """What ``torch.ops.flashkda.chunk_bwd_input_grads`` computes: the gradients in the inputs'
    dtypes, the gate parameters' sums as one tile each; without dq and dk, empty ones for them."""
    o = _ref_options(*flags)
    B, T, H, K = q.shape
    if dq is None:
        zeros = dg.new_zeros(B, T, v.shape[2], K, dtype=torch.float32)
        out = token_grads_reference(q, k, v, g, beta, A_log, dt_bias, zeros, zeros, dg, dbeta, *flags)
        return [q.new_empty(0), k.new_empty(0)] + out[2:]
    dq, dk = (x.view(B, T, H, v.shape[2] // H, K).sum(3) for x in (dq, dk))
    A_log, dt_bias = (A_log, dt_bias) if o.use_gate_in_kernel else (None, None)
    dq, dk, dg, dbeta, dA, ddt = ag._preprocess_grads(o, q, k, g, beta, A_log, dt_bias, dq, dk, dg, dbeta)
    HV = v.shape[2]
    dA = dq.new_empty(0, HV, dtype=torch.float32) if dA is None else dA.reshape(1, HV)
    ddt = dq.new_empty(0, HV * (1 if g.dim() == 3 else K), dtype=torch.float32) if ddt is None else ddt.reshape(1, -1)
    return [dq.to(q.dtype), dk.to(k.dtype), dg.to(g.dtype), dbeta.to(beta.dtype), dA, ddt]


def _problem(lens, HV, K, device, dtype, seed, decay=5.0):
    """Preprocessed inputs as the backward hands them to the kernel: unit-norm q̂ (scaled) and k̂,
    log decays in [-decay, 0], β in (0, 1); the kernel's chunks of the sequences ``lens``."""
    gen = torch.Generator().manual_seed(seed)
    rows = sum(lens)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = torch.nn.functional.normalize(rnd(rows, HV, K), dim=-1) * K ** -0.5
    k = torch.nn.functional.normalize(rnd(rows, HV, K), dim=-1)
    g = -decay * torch.rand(rows, HV, K, generator=gen, dtype=torch.float64)
    beta = torch.rand(rows, HV, generator=gen, dtype=torch.float64)
    v, dO = rnd(rows, HV, K), rnd(rows, HV, K)
    bos, length, _, _, _, C = ag._kernel_chunks(1, rows, torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]),
                                                device)
    tensors = [x.to(device, dtype) for x in (q, k, v, g, beta, dO)]
    return tensors, bos, length, C


KERNEL_GLUE_CASES = {
    "varlen_gva_vfirst": dict(lens=[1, 17, 0, 97, 130], HV=4, gate="lower_bound", state_v_first=True),
    "fixed_b2": dict(B=2, T=150, gate="softplus"),
    "gdn_varlen": dict(lens=[64, 65, 3], gate="precomputed", gdn=True),
    "empty_only": dict(lens=[0, 0], gate="lower_bound"),
}


def boundary_states_reference(opts, flags, q, k, v, g, beta, gate_A, gate_dt, S0, dS, do, records):
    """What ``ag._chunked_boundary_states`` hands the backward, from the references: the chunk maps
    of the preprocessed inputs and both scans, in the backward's chunk layout (the forward kernels'
    dense chunk states)."""

    def boundary_states(entries):
        qp, kp, gp, bp, _ = token_inputs_reference(q, k, v, g, beta, gate_A, gate_dt, *flags)
        B, T, HV, K = qp.shape
        rows = B * T
        f32 = torch.float32
        dO = torch.zeros(rows, HV, v.shape[-1], dtype=f32) if do is None else do.reshape(rows, HV, -1).to(f32)
        bos, length, first, count, N, _ = ag._kernel_chunks(B, T, opts.cu_seqlens, q.device)
        flat = [x.reshape(rows, HV, -1).to(f32) for x in (qp, kp, v)] + [gp.reshape(rows, HV, *gp.shape[3:]).to(f32)]
        maps, offsets, Y = local_grad_reference(*flat, bp.reshape(rows, HV).to(f32), dO, bos, length, 0)
        (states,) = state_scan_reference(maps, offsets, S0, first, count, False)
        nexts, dS0 = state_scan_reference(maps, Y, dS, first, count, True)
        assert states.shape[0] == entries
        return ag.Boundary(states.to(ag._BOUNDARY_STATE_DTYPE), nexts.to(ag._BOUNDARY_STATE_DTYPE), dS0)

    return boundary_states


@pytest.mark.parametrize("boundary", ["scans", "forward_kernels", "forward_kernels_torch_pass"])
@pytest.mark.parametrize("tokens", [False, True], ids=["torch_tokens", "kernel_tokens"])
@pytest.mark.parametrize("case", list(KERNEL_GLUE_CASES))
def test_kernel_backward_equals_torch_backward(monkeypatch, case, tokens, boundary):
    """The backward on the kernel pass (here its reference) gives the PyTorch backward's gradients
    (chunk layout, scans, GVA, GDN, state layouts, sequences without tokens), with the per-token
    work in PyTorch or on its kernels' path (their references: the glue around them), and the
    states at chunk boundaries from the scans or from the forward kernels (their reference); and
    where the gradients pass has no room on the device (sm_80), the PyTorch path on the forward
    kernels' boundary states instead of its own scans."""
    from test_autograd import _through_chunk_function, _upstream

    monkeypatch.setattr(_ext, "chunk_local_grad_op", local_grad_reference, raising=False)
    monkeypatch.setattr(_ext, "chunk_bwd_in_value_halves", lambda index: False, raising=False)
    monkeypatch.setattr(_ext, "chunk_state_scan_op", state_scan_reference, raising=False)
    monkeypatch.setattr(_ext, "chunk_bwd_inputs_op", token_inputs_reference, raising=False)
    monkeypatch.setattr(_ext, "chunk_bwd_input_grads_op", token_grads_reference, raising=False)
    monkeypatch.setattr(ag, "_token_kernels_serve", lambda *a: tokens)
    monkeypatch.setattr(ag, "_chunked_boundary_states",
                        boundary_states_reference if boundary.startswith("forward_kernels") else lambda *a: None)
    monkeypatch.setattr(ag, "_BOUNDARY_STATE_DTYPE", torch.float32)  # the glue, not the rounding
    kw = make_inputs(H=2, D=16, dtype=torch.float64, **KERNEL_GLUE_CASES[case], seed=3)
    do, dht = (x.double() for x in _upstream(kw))
    calls = []
    monkeypatch.setattr(ag, "_device_shortfall", lambda *a: "the PyTorch backward")
    want = _through_chunk_function(kw, do, dht)
    monkeypatch.setattr(ag, "_device_shortfall", lambda *a: calls.append(1))
    monkeypatch.setattr(ag, "_gate_shortfall", lambda *a: None)
    no_room = boundary == "forward_kernels_torch_pass"
    monkeypatch.setattr(_ext, "chunk_bwd_shortfall", lambda index, transitions=False: "no room" if no_room else None, raising=False)
    if no_room:
        monkeypatch.setattr(ag, "_kernel_backward", lambda *a: pytest.fail("the gradients pass ran"))
        if kw["q"].shape[1]:  # (no token: nothing to take from the kernels)
            monkeypatch.setattr(ag, "_state_scan", lambda *a: pytest.fail("the PyTorch path scanned"))
    got = _through_chunk_function(kw, do, dht)
    assert calls, "the kernel path was not taken"
    for name, a, b in zip(GRAD_INPUTS, got, want):
        if b is not None:
            assert rel_err(a, b) <= 1e-5, f"d{name}: {rel_err(a, b):.2e}"  # both fp32 inside


@pytest.mark.parametrize("shape", [(1, 40, 3), (2, 40, 3, 8), (1, 9, 2)], ids=["gdn", "kda", "short"])
def test_spans_within(shape):
    """The kernel path's gate check: any 16 consecutive tokens (all tokens when fewer) summing
    below -span refuse it, however the gate is shaped (a scalar gate checked per head)."""
    gate = torch.full(shape, -4.0)
    span = 4.0 * min(16, shape[1])
    assert ag._spans_within(gate, span)
    gate[(0, shape[1] // 2) + (shape[2] - 1,) * (len(shape) - 2)] -= 0.5  # one token, one head
    assert not ag._spans_within(gate, span)
    assert ag._spans_within(gate, span + 0.5)


def test_kernel_chunks_layout():
    """Every sequence's chunks are consecutive (empty sequences have none), their count and first
    known on the device only; the layout has T // 64 + N entries, the ones past the last chunk
    empty."""
    bos, length, first, count, N, C = ag._kernel_chunks(1, 300, torch.tensor([0, 70, 70, 300]), "cpu")
    assert (N, C) == (3, 300 // 64 + 3)
    assert first.tolist() == [0, 2, 2] and count.tolist() == [2, 0, 4]
    assert bos[:6].tolist() == [0, 64, 70, 134, 198, 262]
    assert length.tolist() == [64, 6, 64, 64, 64, 38, 0]
    bos, length, first, count, N, C = ag._kernel_chunks(2, 130, None, "cpu")  # fixed length: exact
    assert (N, C) == (2, 6) and bos.tolist() == [0, 64, 128, 130, 194, 258] and length.tolist() == [64, 64, 2] * 2
    _, length, first, count, N, C = ag._kernel_chunks(1, 65, torch.tensor([0, 0, 64, 65, 65]), "cpu")
    assert first.tolist() == [0, 0, 1, 2] and count.tolist() == [0, 1, 1, 0] and length.tolist() == [64, 1, 0, 0, 0]


cuda = pytest.mark.skipif(not HAS_CUDA_KERNELS, reason="needs CUDA and the extension")


@cuda
@pytest.mark.cuda
def test_dense_chunk_layout_is_kept():
    """Without cu_seqlens the chunk layout of (B, T) is built once and kept; it equals the layout
    built with ops on the device."""
    for B, T in ((1, 8192), (2, 150), (3, 64), (1, 1)):
        kept = ag._kernel_chunks(B, T, None, "cuda")
        assert ag._kernel_chunks(B, T, None, "cuda") is kept
        for a, b in zip(kept, ag._build_chunks(B, T, None, torch.device("cuda"))):
            assert (torch.equal(a, b) and a.dtype == b.dtype) if isinstance(a, torch.Tensor) else a == b


#: bf16 operands on the tensor cores, fp32 accumulation: relative L2 error of each output.
KERNEL_TOL = 1e-2


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("family", ["auto", "sm80"])
@pytest.mark.parametrize("scalar_gate", [False, True], ids=["kda", "gdn"])
@pytest.mark.parametrize("decay", [5.0, 0.05], ids=["strong", "weak"])
def test_kernel_passes_match_reference(decay, scalar_gate, family):
    """Both passes of the kernel against the fp64 reference of the same math, on varlen chunks
    (1, 17, 0, 97, 130, 64 tokens; GVA-like heads), log decays down to -5 a token (the widest span
    the kernel takes, 80 over 16 tokens) and weak ones, per key channel or one per token and head
    (a scalar gate, whose gradient the kernel sums over the channels); the gradients pass whole
    (sm_90) and in value halves (the sm_80 family: two blocks add their shares)."""
    if _ext.chunk_bwd_shortfall(torch.cuda.current_device(), transitions=True) is not None:
        pytest.skip(_ext.chunk_bwd_shortfall(torch.cuda.current_device(), transitions=True))
    with _ext.kernel_family(family):
        _kernel_passes_match_reference(decay, scalar_gate)


def _kernel_passes_match_reference(decay, scalar_gate):
    K = 128
    (q, k, v, g, beta, dO), bos, length, chunks = _problem([1, 17, 0, 97, 130, 64], 3, K, "cuda", torch.float32,
                                                             seed=11, decay=decay)
    if scalar_gate:
        g = g[..., 0].contiguous()
    ref_in = [x.double().cpu() for x in (q, k, v, g, beta, dO)]
    bos_c, len_c = bos.cpu(), length.cpu()
    for poison in range(2):  # fresh outputs every call; run twice so stale memory cannot pass
        got = _ext.chunk_local_grad_op(q, k, v, g, beta, dO, bos, length, 0)
        want = local_grad_reference(*ref_in, bos_c, len_c, 0)
        for name, a, b in zip("DBY", got, want):
            assert rel_err(a, b) <= KERNEL_TOL, f"{name}: {rel_err(a, b):.2e}"
    gen = torch.Generator().manual_seed(5)
    # The pass reads bf16 states (fp32 ones are rounded by the op): the reference gets those values.
    S = (0.3 * torch.randn(chunks, 3, K, K, generator=gen, dtype=torch.float64)).bfloat16().double()
    dS = torch.randn(chunks, 3, K, K, generator=gen, dtype=torch.float64).bfloat16().double()
    got = _ext.chunk_local_grad_op(q, k, v, g, beta, dO, bos, length, 1, S.float().cuda(), dS.bfloat16().cuda())
    want = local_grad_reference(*ref_in, bos_c, len_c, 1, S, dS)
    for name, a, b in zip(["dq", "dk", "dv", "dg", "dbeta"], got, want):
        assert rel_err(a, b) <= KERNEL_TOL, f"{name}: {rel_err(a, b):.2e}"
    # Over its inputs (every token lies in a chunk here): the same gradients, in the storage of q, k, g
    # and beta (equal up to the order of the shared-memory sums of dg and dbeta); the pass in value
    # halves adds into zeros and refuses.
    over_in = [x.clone() for x in (q, k, g, beta)]
    args = (over_in[0], over_in[1], v, over_in[2], over_in[3], dO, bos, length, 1, S.float().cuda(),
            dS.bfloat16().cuda(), True, True)
    if _ext.chunk_bwd_in_value_halves(q.get_device()):
        with pytest.raises(RuntimeError, match="overwrite_inputs"):
            _ext.chunk_local_grad_op(*args)
    else:
        over = _ext.chunk_local_grad_op(*args)
        for name, a, b, x in zip(["dq", "dk", "dg", "dbeta"], [over[i] for i in (0, 1, 3, 4)],
                                 [got[i] for i in (0, 1, 3, 4)], over_in):
            assert a.data_ptr() == x.data_ptr(), f"{name} not written over its input"
            assert rel_err(a, b) <= 1e-5, f"{name} over its input: {rel_err(a, b):.2e}"
        assert torch.equal(over[2], got[2])
    # The raw q's and k's gradients (qk_dtype): through the scale and, with the l2 norm, the rows'
    # 1 / norms; the other gradients as before (and over g and beta only with overwrite_inputs).
    rnorm = 0.5 + torch.rand(q.shape[0], 3, 2, generator=gen, dtype=torch.float64)
    for l2norm, dtype in [(True, torch.bfloat16), (False, torch.float16), (True, torch.float32)]:
        args = (q, k, v, g, beta, dO, bos, length, 1, S.float().cuda(), dS.bfloat16().cuda(), True, False,
                rnorm.float().cuda(), K ** -0.5, l2norm, dtype)
        if _ext.chunk_bwd_in_value_halves(q.get_device()):
            with pytest.raises(RuntimeError, match="qk_dtype"):
                _ext.chunk_local_grad_op(*args)
            break
        raw = _ext.chunk_local_grad_op(*args)
        want_raw = local_grad_reference(*ref_in, bos_c, len_c, 1, S, dS, True, False, rnorm, K ** -0.5, l2norm,
                                        torch.float64)
        for name, a, b in zip(["dq", "dk"], raw[:2], want_raw[:2]):
            assert a.dtype == dtype, name
            assert rel_err(a, b) <= KERNEL_TOL, f"raw {name} ({dtype}, l2norm {l2norm}): {rel_err(a, b):.2e}"
        for name, a, b in zip(["dv", "dg", "dbeta"], raw[2:], got[2:]):
            assert rel_err(a, b) <= 1e-5, f"{name} beside the raw gradients: {rel_err(a, b):.2e}"
    # 16-bit v: dv comes in v's dtype, the fp32 one rounded once (dv = Tᵀ dU does not read v)
    for dtype in (torch.bfloat16, torch.float16):
        got16 = _ext.chunk_local_grad_op(q, k, v.to(dtype), g, beta, dO, bos, length, 1, S.float().cuda(),
                                         dS.bfloat16().cuda())
        assert got16[2].dtype == dtype and got[2].dtype == torch.float32
        assert torch.equal(got16[2], got[2].to(dtype)), f"dv in {dtype}"


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("counts", [[1], [2, 0, 1], [37, 3, 0, 12]], ids=["one", "short", "long"])
def test_state_scan_matches_reference(counts, reverse):
    """Both scans against fp64 on sequences of the given chunk counts (0: an empty sequence, whose
    start passes through), two spare entries past the last chunk, 3 value heads; maps like the
    chunks' (eigenvalues within the unit disc: decay on the diagonal, a small product off it)."""
    gen = torch.Generator().manual_seed(sum(counts))
    K, HV = 128, 3
    C = sum(counts) + 2
    maps = torch.diag_embed(torch.rand(C, HV, K, generator=gen, dtype=torch.float64)) \
        - 0.02 * torch.randn(C, HV, K, K, generator=gen, dtype=torch.float64)
    offsets = torch.randn(C, HV, K, K, generator=gen, dtype=torch.float64)
    start = torch.randn(len(counts), HV, K, K, generator=gen, dtype=torch.float64)
    first = torch.tensor(counts).cumsum(0) - torch.tensor(counts)
    count = torch.tensor(counts, dtype=torch.int32)
    got = _ext.chunk_state_scan_op(maps.float().cuda(), offsets.float().cuda(), start.float().cuda(),
                                   first.cuda(), count.cuda(), reverse)
    want = state_scan_reference(maps, offsets, start, first, count, reverse)
    assert len(got) == len(want)
    written = sum(counts)  # the spare entries are not written
    assert rel_err(got[0][:written], want[0][:written]) <= 1e-5
    if reverse:
        assert rel_err(got[1], want[1]) <= 1e-5


# The per-token passes: (gate mode, lower bound, l2norm, beta sigmoid, allow_neg_eigval, scalar gate,
# H, HV, q/k dtype, g dtype, beta dtype, gate parameter dtype, with A_log, with dt_bias).
TOKEN_CASES = {
    "lower_bound_gva": (C.GATE_LOWER_BOUND, -5.0, True, True, False, False, 2, 4, torch.bfloat16, torch.float32,
                        torch.bfloat16, torch.float32, True, True),
    "softplus_fp16_neg": (C.GATE_SOFTPLUS, 0.0, False, True, True, False, 3, 3, torch.float16, torch.float16,
                          torch.float16, torch.bfloat16, True, False),
    "lower_bound_no_A": (C.GATE_LOWER_BOUND, -3.0, True, False, False, False, 2, 2, torch.bfloat16, torch.bfloat16,
                         torch.float32, torch.float32, False, True),
    "gdn_precomputed": (C.GATE_PRECOMPUTED, 0.0, True, False, False, True, 3, 3, torch.bfloat16, torch.float32,
                        torch.bfloat16, torch.float32, False, False),
    "gdn_softplus_gva": (C.GATE_SOFTPLUS, 0.0, True, True, False, True, 1, 2, torch.float32, torch.float32,
                         torch.float32, torch.float32, True, True),
    # more value heads than a scalar gate's block takes side by side (32), not a multiple of them
    "gdn_lower_bound_40_heads": (C.GATE_LOWER_BOUND, -4.0, True, True, False, True, 5, 40, torch.bfloat16,
                                 torch.bfloat16, torch.float32, torch.float32, True, True),
}


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("case", list(TOKEN_CASES))
def test_token_passes_match_reference(case):
    """``chunk_bwd_inputs`` and ``chunk_bwd_input_grads`` against their fp32 PyTorch references
    (B = 2, T = 97: a partial tile; q a strided view), every gate mode, GVA, scalar gates, mixed
    dtypes; outputs in the inputs' dtypes compared at their rounding, fp32 ones (the preprocessed
    inputs, the gate parameters' sums) at fp32's."""
    mode, lb, l2norm, beta_sigmoid, neg, scalar, H, HV, dt, gdt, bdt, pdt, with_A, with_dt = TOKEN_CASES[case]
    gen = torch.Generator().manual_seed(7)
    B, T, K = 2, 97, 128

    def rnd(*shape, dtype=torch.float32, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to("cuda", dtype)

    q = rnd(B, T, 2 * H, K, dtype=dt)[:, :, ::2]  # strided over heads
    k, v = rnd(B, T, H, K, dtype=dt), rnd(B, T, HV, K, dtype=dt)
    g = rnd(B, T, HV, dtype=gdt) if scalar else rnd(B, T, HV, K, dtype=gdt, scale=2.0)
    if mode == C.GATE_PRECOMPUTED:
        g = -g.abs()
    beta = rnd(B, T, HV, dtype=bdt)
    A_log = rnd(HV, dtype=pdt, scale=0.5) if with_A else None
    dt_bias = (rnd(HV, dtype=pdt) if scalar else rnd(HV * K, dtype=pdt)) if with_dt else None
    flags = (K ** -0.5, mode, lb, l2norm, beta_sigmoid, neg)
    raw = (q, k, v, g, beta, A_log, dt_bias)
    want = token_inputs_reference(*raw, *flags)
    _ext.chunk_bwd_inputs_op(*(x if x is None else -x for x in raw[:5]), A_log, dt_bias, *flags)  # leaves stale
    got = _ext.chunk_bwd_inputs_op(*raw, *flags)  # memory for a missed write to show
    names = ["q_hat", "k_hat", "g_hat", "beta_hat"] + (["rnorm"] if l2norm else [])  # (r: only with the l2 norm)
    assert len(got) == 5
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape and a.dtype == torch.float32, name
        assert rel_err(a, b) <= 1e-5, f"{name}: {rel_err(a, b):.2e}"
    # Without q̂ and k̂ (a gradients pass that takes the raw q and k): ĝ and β̂ alone, the same.
    part = _ext.chunk_bwd_inputs_op(*raw, *flags, False)
    assert part[0].numel() == 0 and part[1].numel() == 0 and part[4].numel() == 0
    assert torch.equal(part[2], got[2]) and torch.equal(part[3], got[3])
    dhat = [rnd(B, T, HV, K), rnd(B, T, HV, K), rnd(B, T, HV) if scalar else rnd(B, T, HV, K), rnd(B, T, HV)]
    want = token_grads_reference(*raw, *dhat, *flags)
    _ext.chunk_bwd_input_grads_op(*raw, *(-x for x in dhat), *flags)
    got = _ext.chunk_bwd_input_grads_op(*raw, *dhat, *flags)
    for name, a, b in zip(["dq", "dk", "dg", "dbeta", "dA_log", "ddt_bias"], got[:4] + [x.sum(0) for x in got[4:]],
                          want[:4] + [x.sum(0) for x in want[4:]]):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{name}: {a.dtype} {list(a.shape)}"
        tol = 1e-5 if a.dtype == torch.float32 else 4e-3  # 16-bit outputs: their rounding (2^-8)
        assert rel_err(a, b) <= tol, f"{name}: {rel_err(a, b):.2e}"
    # Without dq̂ and dk̂ (the gradients pass wrote dq and dk): the rest alone, dq and dk empty.
    rest = _ext.chunk_bwd_input_grads_op(*raw, None, None, *dhat[2:], *flags)
    assert rest[0].numel() == 0 and rest[1].numel() == 0
    for name, a, b in zip(["dg", "dbeta", "dA_log", "ddt_bias"], rest[2:], got[2:]):
        assert torch.equal(a, b), name


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("l2norm", [True, False], ids=["l2norm", "plain"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gradients_pass_takes_the_raw_qk(dtype, l2norm):
    """A scalar gate's gradients pass on the raw 16-bit q and k, which it takes through the l2 norm
    and the scale itself, writes what it writes on chunk_bwd_inputs' fp32 q̂, k̂ and 1 / norms: the
    same rows, sums and roundings, so dq, dk and dv to the bit (dg and dβ up to the order of their
    shared-memory sums); varlen chunks of 1, 17, 0, 97 and 130 tokens."""
    index = torch.cuda.current_device()
    if _ext.chunk_bwd_shortfall(index) is not None or _ext.chunk_bwd_in_value_halves(index):
        pytest.skip("the whole gradients pass does not run on this GPU")
    gen = torch.Generator().manual_seed(3)
    lens, H, K = [1, 17, 0, 97, 130], 3, 128
    T, rows = sum(lens), sum(lens)

    def rnd(*shape, dtype=torch.float32, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to("cuda", dtype)

    # rows of about unit norm: without the l2 norm, N(0, 1) rows (norm 11) overflow fp16's gradients
    q, k = (rnd(1, T, H, K, dtype=dtype, scale=K ** -0.5) for _ in range(2))
    v = rnd(1, T, H, K, dtype=dtype)
    g = -0.2 * rnd(1, T, H).abs()
    beta = torch.rand(1, T, H, generator=gen).cuda()
    flags = (K ** -0.5, C.GATE_PRECOMPUTED, 0.0, l2norm, False, False)
    raw = (q, k, v, g, beta, None, None)
    qp, kp, gp, bp, rnorm = _ext.chunk_bwd_inputs_op(*raw, *flags)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    bos, length, _, _, _, chunks = ag._kernel_chunks(1, T, cu, q.device)
    S = rnd(chunks, H, K, K, dtype=torch.bfloat16, scale=0.3)
    dS = rnd(chunks, H, K, K, dtype=torch.bfloat16)
    dO = rnd(rows, H, K, dtype=torch.bfloat16)
    rest = (v.view(rows, H, K), gp.view(rows, H), bp.view(rows, H), dO, bos, length, 1, S, dS, False, False)
    want = _ext.chunk_local_grad_op(qp.view(rows, H, K), kp.view(rows, H, K), *rest, rnorm.view(rows, H, 2),
                                    K ** -0.5, l2norm, dtype)
    for poison in (-1.0, 1.0):  # the raw path twice, on other values first: stale memory cannot pass
        got = _ext.chunk_local_grad_op(poison * q.view(rows, H, K), poison * k.view(rows, H, K), *rest, None,
                                       K ** -0.5, l2norm, dtype)
    for name, a, b in zip(["dq", "dk", "dv", "dg", "dbeta"], got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.isfinite(a).all(), name
        if name in ("dg", "dbeta"):
            assert rel_err(a, b) <= 1e-5, f"{name}: {rel_err(a, b):.2e}"
        else:
            assert torch.equal(a, b), f"{name}: {rel_err(a, b):.2e}"
    with pytest.raises(RuntimeError, match="raw inputs"):  # the raw q and k without qk_dtype
        _ext.chunk_local_grad_op(q.view(rows, H, K), k.view(rows, H, K), *rest)


# chunk_state_grad's cases: make_inputs arguments.
STATE_GRAD_CASES = {
    "kda_gva_bf16_varlen": dict(lens=[1, 17, 0, 97, 1030, 64], H=2, HV=4, gate="lower_bound", dtype=torch.bfloat16),
    "kda_softplus_bf16_b2": dict(B=2, T=200, H=2, gate="softplus", dtype=torch.bfloat16),
    "gdn_fp16_varlen": dict(lens=[130, 3, 64], H=2, gate="precomputed", gdn=True, dtype=torch.float16),
    "gdn_bf16_precomputed_varlen": dict(lens=[130, 3, 64], H=2, gate="precomputed", gdn=True, dtype=torch.bfloat16),
    "gdn_fp16_softplus_varlen": dict(lens=[130, 3, 64], H=2, gate="softplus", gdn=True, dtype=torch.float16),
    "kda_fp16_precomputed_varlen": dict(lens=[130, 3, 64], H=2, gate="precomputed", dtype=torch.float16),
    # Two chains of 100 chunks on average: the forward runs in segments (chunk_plan.h), whose
    # output pass writes the states; the backward walk runs whole chains on the same records.
    "kda_segmented_forward": dict(lens=[12763, 37], H=1, gate="lower_bound", dtype=torch.bfloat16),
}


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("family", ["auto", "sm80"])
@pytest.mark.parametrize("kept", [False, True], ids=["forward_again", "kept_records"])
@pytest.mark.parametrize("case", list(STATE_GRAD_CASES))
def test_chunk_state_grad_matches_reference(case, kept, family):
    """``chunk_state_grad`` (the forward kernels' states at chunk starts, then the backward walk on
    their records; ``kept``: on the states and records of an earlier ``chunk_fwd``, with no forward
    again) against fp64 scans of the chunk maps from the preprocessed inputs: the states, the
    gradients of the states after every chunk and the initial state's gradient, in the backward's
    chunk layout (pools and records poisoned with NaN; entries of no chunk are not compared). Both
    variants of the kernels: bulk copies and warpgroup MMAs on sm_90 (``auto``), cp.async and
    mma.sync (the sm_80 family, forced)."""
    kw = make_inputs(D=128, device="cuda", seed=17, **STATE_GRAD_CASES[case])
    q, k, v, g, beta = (kw[n] for n in ("q", "k", "v", "g", "beta"))
    B, T, HV, K = v.shape
    gate_in = kw.get("use_gate_in_kernel", False)
    flags = (K ** -0.5, C.gate_mode(gate_in, kw.get("lower_bound")), kw.get("lower_bound") or 0.0, True, True, False)
    A_log, dt_bias = (kw["A_log"], kw["dt_bias"]) if gate_in else (None, None)
    gen = torch.Generator().manual_seed(3)
    N = B if kw.get("cu_seqlens") is None else len(kw["cu_seqlens"]) - 1
    do = torch.randn(B, T, HV, K, generator=gen).to("cuda", v.dtype)
    dht = torch.randn(N, HV, K, K, generator=gen).cuda()
    S0 = kw["initial_state"].float()
    cu = kw.get("cu_seqlens")
    bos, length, first, count, N, chunks = ag._kernel_chunks(B, T, cu, "cuda")
    states, nexts = (torch.full((chunks, HV, K, K), float("nan"), device="cuda", dtype=ag._BOUNDARY_STATE_DTYPE)
                     for _ in range(2))
    records = None
    if kept:
        records = torch.full((chunks * HV * _ext.CHUNK_RECORD_BYTES,), 0xFF, dtype=torch.uint8, device="cuda")
    with _ext.kernel_family(family):
        if kept:
            _ext.chunk_fwd_op(q, k, v, g, beta, A_log, dt_bias, cu, S0, None, torch.empty_like(v), *flags, False, 0, -1,
                              states, None, None, None, records)
        dS0 = _ext.chunk_state_grad_op(q, k, v, g, beta, A_log, dt_bias, cu, S0, *flags, do, dht, states, nexts,
                                       records)

    qp, kp, gp, bp = (x.double().cpu() for x in token_inputs_reference(q, k, v, g, beta, A_log, dt_bias, *flags)[:4])
    rows = B * T
    gate = gp.reshape(rows, HV, -1) if gp.dim() == 4 else gp.reshape(rows, HV)  # a scalar gate stays [rows, HV]
    flat = [x.reshape(rows, HV, -1) for x in (qp, kp, v.double().cpu())] + [gate, do.double().cpu().reshape(rows, HV, -1)]
    bos_c, len_c, first_c, count_c = (x.cpu() for x in (bos, length, first, count))
    maps, offsets, Y = local_grad_reference(*flat[:4], bp.reshape(rows, HV), flat[4], bos_c, len_c, 0)
    (want_states,) = state_scan_reference(maps, offsets, S0.double().cpu(), first_c, count_c, False)
    want_nexts, want_dS0 = state_scan_reference(maps, Y, dht.double().cpu(), first_c, count_c, True)
    used = int(count_c.sum())
    for name, a, b in (("states", states[:used], want_states[:used]), ("dstates", nexts[:used], want_nexts[:used]),
                       ("dS0", dS0, want_dS0)):
        per_entry = [f"{rel_err(a[j], b[j]):.1e}" for j in range(a.shape[0])] if a.dim() == 4 else []
        assert rel_err(a, b) <= KERNEL_TOL, f"{name}: {rel_err(a, b):.2e}; per entry {per_entry}"
