"""Where the host time of one eager decode call, and of one small prefill call, goes. The decode
call: bench/test_decode.py's case at N = 1 (H = 32, K = V = 128, bf16 q/k/v/g/beta, fp32 V-first
pool of N + 8 slots, int32 slot indices, lower-bound gate -5 with A_log/dt_bias, l2norm and beta
sigmoid in the kernel, out= given).

On a CUDA device: host µs per call, from 200 eager calls issued back to back without
synchronising (fewer than the launch queue holds, so the GPU's pace does not show), for the whole
call, its parts and the other ways in; then the CUDA-event time of one eager call, which includes
the time the GPU waits for the host (the decode benchmark's N = 1 figure). Then the same for one
eager prefill call, bench/test_prefill.py's chunk_kda at T = 1024, H = 16 (the smallest point of its
T sweep): the whole call, its fast entry alone, and the general path with its Python part and its
binding alone (100 calls).

``--cpu`` (no device needed): the checks alone, on CPU tensors of the same shapes. The fast entry
runs every check and declines at the last one (the device); the public wrapper is timed with the
entry stubbed out, and the general path with its kernel dispatch forced and the binding stubbed
out. Each figure: the best of 7 rounds of 2000 calls.
"""

import argparse
import time
from contextlib import ExitStack, contextmanager
from unittest import mock

import torch

import flashkda
from flashkda import _constants as C
from flashkda import _ext, api
from test_decode import _inputs
from test_prefill import KDA_FLAGS
from test_prefill import _inputs as prefill_inputs

#: bench/test_prefill.py's call at the smallest point of its T sweep, where the host's time shows.
PREFILL_T, PREFILL_H = 1024, 16

NAMES = ("q", "k", "v", "g", "beta")


def fast_args(call, entry="_fast"):
    """The arguments that ``call()``, a public call, passes to its fast entry (``api._fast`` for
    fused_recurrent_*, ``api._chunk_fast`` for chunk_*)."""
    seen = []
    with mock.patch.object(api, entry, lambda *args: seen.append(args) or ()):
        call()
    return seen[0]


def binding_args(kw, out):
    """The prepared arguments that the general path passes to ``_C.recurrent_fwd`` for the same call."""
    return (*(kw[n] for n in NAMES), kw["A_log"], kw["dt_bias"], None, None, kw["initial_state"],
            kw["ssm_state_indices"], None, out, 128 ** -0.5, C.GATE_LOWER_BOUND, -5.0, True, True, False, True)


def validate(kw, out):
    return api._validate(
        "fused_recurrent_kda", *(kw[n] for n in NAMES), scalar_gate=False, scale=None,
        initial_state=kw["initial_state"], cu_seqlens=None, cu_seqlens_cpu=None, use_gate_in_kernel=True,
        A_log=kw["A_log"], dt_bias=kw["dt_bias"], lower_bound=-5.0, use_beta_sigmoid_in_kernel=True,
        allow_neg_eigval=False, state_v_first=True, ssm_state_indices=kw["ssm_state_indices"],
        num_accepted_tokens=None, out=out)


def cpu_per_call_us(fn, calls=2000, rounds=7):
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - t0)
    return best / calls * 1e6


def report(name, value, unit="host µs per call"):
    print(f"{unit:<18} {name:<64} {value:7.2f}", flush=True)


@contextmanager
def patched(patches):
    """patches: (object, attribute, value) triples in force inside the block."""
    with ExitStack() as stack:
        for target, attr, value in patches:
            stack.enter_context(mock.patch.object(target, attr, value, create=True))
        yield


def measure(rows, per_call_us):
    """rows: (name, fn, patches); each fn timed with its patches in force."""
    for name, fn, patches in rows:
        with patched(patches):
            report(name, per_call_us(fn))


def main_cuda():
    from common import cuda_median_ms, host_overhead_us

    kw, kw0, gdn_kw = _inputs(1), _inputs(0), _inputs(1, gdn=True)
    out, out0, gdn_out = (torch.empty_like(x["v"]) for x in (kw, kw0, gdn_kw))

    def kda():
        flashkda.fused_recurrent_kda(**kw, out=out)

    def gdn():
        flashkda.fused_recurrent_gated_delta_rule(**gdn_kw, out=gdn_out)

    fast = _ext.fused_recurrent_fast
    fa = fast_args(kda)
    fa0 = fast_args(lambda: flashkda.fused_recurrent_kda(**kw0, out=out0))
    answer = fast(*fa)
    assert isinstance(answer, tuple), f"the decode call must take the fast entry, it answered {answer!r}"
    ba = binding_args(kw, out)
    general = [(api, "_fast", None)]
    rows = [
        ("fused_recurrent_kda(out=...)", kda, []),
        ("fused_recurrent_gated_delta_rule(out=...)", gdn, []),
        ("  fast entry _C.fused_recurrent", lambda: fast(*fa), []),
        ("  fast entry, N = 0 (every check, guard and stream, no launch)", lambda: fast(*fa0), []),
        ("general path: whole call (fast entry off)", kda, general),
        ("  api._validate", lambda: validate(kw, out), []),
        ("  direct binding _C.recurrent_fwd (prepared arguments)", lambda: _ext.recurrent_fwd_eager(*ba), []),
        ("registered op torch.ops.flashkda.recurrent_fwd", lambda: _ext.recurrent_fwd_op(*ba), []),
    ]
    measure(rows, lambda fn: host_overhead_us(fn, calls=200))
    for name, fn, patches in (("fused_recurrent_kda(out=...)", kda, []),
                              ("fused_recurrent_gated_delta_rule(out=...)", gdn, []),
                              ("general path (fast entry off)", kda, general)):
        with patched(patches):
            report(name, cuda_median_ms(fn, calls=100) * 1e3, "CUDA-event µs")

    pk = prefill_inputs([PREFILL_T], PREFILL_H)
    prefill_name = f"chunk_kda T = {PREFILL_T}, H = {PREFILL_H}"

    def prefill():
        flashkda.chunk_kda(**pk, **KDA_FLAGS)

    fast_chunk_args = fast_args(prefill, "_chunk_fast")
    general_chunk = [(api, "_chunk_fast", None)]
    seen = []
    with patched(general_chunk), mock.patch.object(_ext, "chunk_fwd_eager", lambda *args: seen.append(args)):
        prefill()
    chunk_args = seen.pop()
    answer = _ext.chunk_fast(*fast_chunk_args)
    assert isinstance(answer, tuple), f"the prefill call must take the fast entry, it answered {answer!r}"
    # 100 calls: two launches each, well inside the launch queue
    measure([
        (prefill_name, prefill, []),
        ("  fast entry _C.chunk", lambda: _ext.chunk_fast(*fast_chunk_args), []),
        ("general path: whole call (fast entry off)", prefill, general_chunk),
        ("  Python part (binding stubbed)", prefill, general_chunk + [(_ext, "chunk_fwd_eager", lambda *args: None)]),
        ("  binding _C.chunk_fwd (prepared arguments)", lambda: _ext.chunk_fwd_eager(*chunk_args), []),
    ], lambda fn: host_overhead_us(fn, calls=100))
    for name, patches in ((prefill_name, []), ("general path (fast entry off)", general_chunk)):
        with patched(patches):
            report(name, cuda_median_ms(prefill, calls=100) * 1e3, "CUDA-event µs")


def main_cpu():
    kw = _inputs(1, dev="cpu")
    out = torch.empty_like(kw["v"])
    pk = prefill_inputs([PREFILL_T], PREFILL_H, device="cpu")

    def kda():
        flashkda.fused_recurrent_kda(**kw, out=out)

    rows = []
    if _ext.HAS_EXTENSION:
        fa = fast_args(kda)
        answer = _ext.fused_recurrent_fast(*fa)
        assert answer == "q: not on a CUDA device", f"a check before the device one failed: {answer!r}"
        rows.append(("fast entry _C.fused_recurrent: every check, declines at the device",
                     lambda: _ext.fused_recurrent_fast(*fa), []))
    done = (out, kw["initial_state"])
    rows += [
        ("public wrapper, fast entry stubbed (a Python lambda)", kda, [(api, "_fast", lambda *args: done)]),
        ("general path: api._validate", lambda: validate(kw, out), []),
        ("general path: whole call, kernel dispatch forced, binding stubbed", kda,
         [(api, "_fast", None), (api, "_kernel_unsupported", lambda *args: None),
          (_ext, "recurrent_fwd_eager", lambda *args: None)]),
        ("  of which the slot range check (CPU indices only)", lambda: int(kw["ssm_state_indices"].max()), []),
        (f"chunk_kda T = {PREFILL_T}, H = {PREFILL_H}: general path, kernel dispatch forced, binding stubbed",
         lambda: flashkda.chunk_kda(**pk, **KDA_FLAGS),
         [(api, "_chunk_fast", None), (api, "_kernel_unsupported", lambda *args: None),
          (_ext, "chunk_fwd_eager", lambda *args: None)]),
    ]
    if _ext.HAS_EXTENSION:
        ca = fast_args(lambda: flashkda.chunk_kda(**pk, **KDA_FLAGS), "_chunk_fast")
        answer = _ext.chunk_fast(*ca)
        assert answer == "q: not on a CUDA device", f"a check before the device one failed: {answer!r}"
        rows.append((f"chunk_kda T = {PREFILL_T}, H = {PREFILL_H}: fast entry _C.chunk, declines at the device",
                     lambda: _ext.chunk_fast(*ca), []))
    measure(rows, cpu_per_call_us)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="CPU stand-ins: the checks alone")
    args = parser.parse_args()
    main_cpu() if args.cpu or not torch.cuda.is_available() else main_cuda()
