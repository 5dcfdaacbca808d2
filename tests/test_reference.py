"""The PyTorch reference: chunked core against the plain recurrence, known answers, serving mode."""

import pytest
import torch

from flashkda.reference import kda_reference, preprocess

from helpers import GATES, as_fp64_cpu, make_inputs, rel_err


def _both_cores(kw, **extra):
    kw64 = as_fp64_cpu(kw)
    a = kda_reference(**kw64, core="chunk", **extra)
    b = kda_reference(**kw64, core="recurrent", **extra)
    return a, b


@pytest.mark.parametrize("gate", list(GATES))
@pytest.mark.parametrize("gdn", [False, True])
@pytest.mark.parametrize("state_v_first", [False, True])
def test_chunk_matches_recurrent(gate, gdn, state_v_first):
    kw = make_inputs(lens=[1, 17, 0, 40, 33], H=2, HV=4, D=16, gate=gate, gdn=gdn, state_v_first=state_v_first,
                     mask_prob=0.05)
    (o1, s1), (o2, s2) = _both_cores(kw, output_final_state=True)
    assert rel_err(o1, o2) < 1e-10
    assert rel_err(s1, s2) < 1e-10


@pytest.mark.parametrize("allow_neg", [False, True])
@pytest.mark.parametrize("l2norm", [False, True])
def test_chunk_matches_recurrent_batched(allow_neg, l2norm):
    kw = make_inputs(B=3, T=37, H=1, HV=2, D=8, gate="softplus", seed=3)
    kw.update(allow_neg_eigval=allow_neg, use_qk_l2norm_in_kernel=l2norm, scale=0.3)
    (o1, s1), (o2, s2) = _both_cores(kw, output_final_state=True)
    assert rel_err(o1, o2) < 1e-10 and rel_err(s1, s2) < 1e-10


def test_unbounded_gate_stays_finite():
    """Softplus gates of huge raw values and -1e4 masks: decays of exp(-1e4), no inf or NaN."""
    kw = make_inputs(T=70, H=1, D=8, gate="softplus", seed=1)
    kw["g"] = kw["g"] * 1000.0
    (o1, s1), (o2, s2) = _both_cores(kw, output_final_state=True)
    assert torch.isfinite(o1).all() and torch.isfinite(s1).all()
    assert rel_err(o1, o2) < 1e-10
    kw = make_inputs(T=70, H=1, D=8, gate="precomputed", mask_prob=0.3, seed=2)
    (o1, _), (o2, _) = _both_cores(kw)
    assert torch.isfinite(o1).all() and rel_err(o1, o2) < 1e-10


def test_one_token_known_answer():
    """T = 1 by hand: S = e^g ⊙ S0 + k ⊗ beta (v − (e^g ⊙ S0)ᵀ k), o = Sᵀ q."""
    torch.manual_seed(0)
    K, V = 4, 3
    q, k = torch.randn(K, dtype=torch.float64), torch.randn(K, dtype=torch.float64)
    v = torch.randn(V, dtype=torch.float64)
    g = -torch.rand(K, dtype=torch.float64)
    beta = torch.tensor(0.7, dtype=torch.float64)
    S0 = torch.randn(K, V, dtype=torch.float64)
    Sd = g.exp()[:, None] * S0
    S = Sd + torch.outer(k, beta * (v - Sd.T @ k))
    o = S.T @ q
    out, st = kda_reference(q.view(1, 1, 1, K), k.view(1, 1, 1, K), v.view(1, 1, 1, V), g.view(1, 1, 1, K),
                            beta.view(1, 1, 1), scale=1.0, initial_state=S0.view(1, 1, K, V),
                            output_final_state=True)
    torch.testing.assert_close(out.view(V), o)
    torch.testing.assert_close(st.view(K, V), S)


def test_preprocess_formulas():
    g = torch.tensor([[[[-30.0, 0.0, 25.0]]]], dtype=torch.float64)
    A_log = torch.tensor([0.5], dtype=torch.float64)
    bias = torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64)
    one = torch.ones(1, 1, 1, 3, dtype=torch.float64)
    b = torch.zeros(1, 1, 1, dtype=torch.float64)
    _, _, lb, beta = preprocess(one, one, g, b, scale=1.0, use_gate_in_kernel=True, A_log=A_log, dt_bias=bias,
                                lower_bound=-5.0, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                                dtype=torch.float64)
    torch.testing.assert_close(lb, -5.0 * torch.sigmoid(A_log.exp() * (g + bias)))
    assert float(beta) == 1.0  # 2 * sigmoid(0)
    _, _, sp, _ = preprocess(one, one, g, b, scale=1.0, use_gate_in_kernel=True, A_log=A_log, dt_bias=bias,
                             dtype=torch.float64)
    x = (g + bias).view(-1)
    want = -A_log.exp() * torch.where(x > 20, x, torch.log1p(torch.exp(x)))
    torch.testing.assert_close(sp.view(-1), want)
    q, _, _, _ = preprocess(3 * one, one, g, b, scale=0.5, use_qk_l2norm_in_kernel=True, dtype=torch.float64)
    torch.testing.assert_close(q, 0.5 * 3 * one / (27 + 1e-6) ** 0.5)


def test_zero_length_sequences_pass_state_through():
    kw = make_inputs(lens=[0, 5, 0], H=1, D=8, seed=4)
    o, s = kda_reference(**as_fp64_cpu(kw), output_final_state=True)
    h0 = kw["initial_state"].double()
    torch.testing.assert_close(s[0], h0[0])
    torch.testing.assert_close(s[2], h0[2])
    assert not torch.equal(s[1], h0[1])


@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("pool_dtype", [torch.float64, torch.bfloat16])
def test_serving_slots_match_plain_calls(state_v_first, pool_dtype):
    """[N] indices: each sequence reads and writes its slot; padding and unnamed slots are untouched."""
    lens = [3, 1, 0, 2]
    kw = make_inputs(lens=lens, H=1, HV=2, D=8, state=False, state_v_first=state_v_first, seed=5)
    kw = as_fp64_cpu(kw)
    pool = torch.randn(7, 2, 8, 8, dtype=torch.float64).to(pool_dtype)
    idx = torch.tensor([5, -1, 2, 0])
    before = pool.clone()
    o, ret = kda_reference(**kw, initial_state=pool, ssm_state_indices=idx, core="recurrent")
    assert ret is pool
    for slot in (1, 2, 3, 4, 6):  # unnamed, padding-free zero-length (2), never named
        assert torch.equal(pool[slot], before[slot])
    plain_o, plain_s = kda_reference(**kw, initial_state=before[[5, 1, 2, 0]].double(), output_final_state=True,
                                     core="recurrent")
    tol = 1e-12 if pool_dtype == torch.float64 else 1e-2
    assert rel_err(pool[5], plain_s[0]) < tol and rel_err(pool[0], plain_s[3]) < tol
    cu = kw["cu_seqlens"]
    assert torch.count_nonzero(o[0, cu[1]:cu[2]]) == 0  # padding sequence: zero output
    assert rel_err(o[0, :cu[1]], plain_o[0, :cu[1]]) < tol


def test_serving_per_token_slots_and_accepted_tokens():
    """[N, T] indices: state after token t goes to idx[n, t]; the read slot follows num_accepted_tokens."""
    kw = as_fp64_cpu(make_inputs(B=2, T=3, H=1, D=8, state=False, seed=6))
    pool = torch.randn(10, 1, 8, 8, dtype=torch.float64)
    idx = torch.tensor([[1, 2, 3], [4, 5, -1]])
    acc = torch.tensor([2, 1])
    start = pool.clone()
    o, _ = kda_reference(**kw, initial_state=pool, ssm_state_indices=idx, num_accepted_tokens=acc, core="chunk")
    # Sequence 0 starts from slot idx[0, 1] = 2; sequence 1 from idx[1, 0] = 4.
    for n, first in ((0, 2), (1, 4)):
        sub = {name: (x[n:n + 1] if isinstance(x, torch.Tensor) and x.dim() >= 3 else x) for name, x in kw.items()}
        T = 3 if n == 0 else 2
        for t in range(T):
            step = {name: (x[:, t:t + 1] if isinstance(x, torch.Tensor) and x.dim() >= 3 else x)
                    for name, x in sub.items()}
            ref_o, ref_s = kda_reference(**step, initial_state=(start[first] if t == 0 else ref_s[0])[None],
                                         output_final_state=True, core="recurrent")
            torch.testing.assert_close(o[n, t], ref_o[0, 0])
            torch.testing.assert_close(pool[idx[n, t]], ref_s[0])
    assert torch.count_nonzero(o[1, 2]) == 0  # padding token
    for slot in (0, 6, 7, 8, 9):
        assert torch.equal(pool[slot], start[slot])
