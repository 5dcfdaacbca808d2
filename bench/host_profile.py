"""Where the host time of one eager decode call goes (N = 1, H = 32): the whole call, validation
alone, the direct binding and the registered op. Each figure: back-to-back calls without
synchronising, per call (µs)."""

import torch

import flashkda
from common import host_overhead_us as per_call_us
from flashkda import _ext, api
from test_decode import _inputs


def main():
    kw = _inputs(1)
    out = torch.empty_like(kw["v"])
    names = ("q", "k", "v", "g", "beta")
    args = [kw[n] for n in names]
    pool, idx = kw["initial_state"], kw["ssm_state_indices"]
    fixed = (kw["A_log"], kw["dt_bias"], None, None, pool, idx, None, out, 128 ** -0.5, api.GATE_LOWER_BOUND, -5.0,
             True, True, False, True)
    rows = [
        ("fused_recurrent_kda(out=...)", lambda: flashkda.fused_recurrent_kda(**kw, out=out)),
        ("validation only", lambda: api._validate(
            "x", *args, scalar_gate=False, scale=None, initial_state=pool, cu_seqlens=None, cu_seqlens_cpu=None,
            use_gate_in_kernel=True, A_log=kw["A_log"], dt_bias=kw["dt_bias"], lower_bound=-5.0,
            use_beta_sigmoid_in_kernel=True, allow_neg_eigval=False, state_v_first=True,
            ssm_state_indices=idx, num_accepted_tokens=None, out=out)),
        ("direct binding (_C.recurrent_fwd)", lambda: _ext.recurrent_fwd_eager(*args, *fixed)),
        ("registered op (torch.ops)", lambda: _ext.recurrent_fwd_op(*args, *fixed)),
    ]
    for name, fn in rows:
        print(f"host µs per call  {name:<36} {per_call_us(fn, calls=2000):7.2f}")


if __name__ == "__main__":
    main()
