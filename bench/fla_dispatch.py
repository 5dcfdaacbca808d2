"""Host time of a decode call that reaches flashkda through FLA's backend registry, against the
same call made to flashkda directly, with the shares of flashkda's verifier and adapter.

Two calls, each with bf16 q/k/v/g/beta, K = V = 128, gate, l2norm and beta sigmoid in the kernel:

* ``serving``: FLA's serving entry ``fused_recurrent_kda_fwd`` with an fp32 V-first pool, int32
  slot indices and ``out`` (what vLLM / SGLang call), N = 1, H = 32, fp32 gate parameters;
* ``model``: FLA's public ``fused_recurrent_kda`` as ``fla.layers.kda`` calls it in decode: a model
  cast to bf16 (bf16 ``A_log [HV]`` and ``dt_bias [HV*K]``), four sequences of one token packed with
  ``cu_seqlens``, a new fp32 final state, H = 16.

Each figure is host µs per call: 200 eager calls issued back to back without synchronising (the GPU
work queues; common.host_overhead_us), the best of 5 such rounds. "Through FLA" is FLA's dispatched
``fused_recurrent_kda_fwd``; "through FLA" minus "direct" is what the registry path costs (bound
cases.FLA_DISPATCH_EXTRA_US). The adapter (the backend's implementation, which FLA calls without a
verifier) is timed alone beside it; "through FLA" minus the adapter is FLA's dispatcher. For
``model``, FLA's public ``fused_recurrent_kda`` (what the layer calls) is timed too: what it adds over the dispatched function is FLA's wrapper (``input_guard``: contiguity and
device context), paid with or without a backend. FLA alone (its Triton kernel, backend off) is
printed for scale.

    python bench/fla_dispatch.py [--json PATH]
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from cases import FLA_DISPATCH_EXTRA_US  # noqa: E402
from common import host_overhead_us  # noqa: E402

import flashkda  # noqa: E402
from flashkda.integrations import fla as integ  # noqa: E402

D = 128


def serving_call(dev="cuda"):
    from test_decode import _inputs  # the decode benchmark's case

    kw = _inputs(1, seed=1)
    kw["out"] = torch.empty_like(kw["v"])
    fla_kw = dict(kw, inplace_final_state=True)
    return kw, fla_kw


def model_call(N=4, H=16, dev="cuda"):
    gen = torch.Generator(device=dev).manual_seed(2)
    bf = torch.bfloat16

    def rnd(*shape):
        return torch.randn(*shape, device=dev, generator=gen).to(bf)

    kw = dict(q=rnd(1, N, H, D), k=rnd(1, N, H, D), v=rnd(1, N, H, D), g=rnd(1, N, H, D), beta=rnd(1, N, H),
              A_log=torch.rand(H, device=dev, generator=gen).to(bf), dt_bias=rnd(H * D),
              initial_state=0.1 * torch.randn(N, H, D, D, device=dev, generator=gen), output_final_state=True,
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              lower_bound=-5.0, state_v_first=True,
              cu_seqlens=torch.arange(N + 1, device=dev, dtype=torch.int32))
    return kw, dict(kw)


def best_us(fn, rounds=5):
    return min(host_overhead_us(fn, calls=200) for _ in range(rounds))


def set_backend(on: bool):
    os.environ[integ.ENV_VAR] = "1" if on else "0"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="append the records to this JSON list")
    args = parser.parse_args()
    from fla.ops.kda import fused_recurrent_kda as fla_public
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla_fwd

    assert integ.register(), "flashkda is not registered as an FLA backend"
    served = []
    op_backend = integ.registered_backends()[1]  # what FLA calls when it picks flashkda

    def spy(*a, **k):
        served.append(1)
        return integ.fused_recurrent_kda_fwd(*a, **k)

    rows = []
    for case, make in (("serving", serving_call), ("model", model_call)):
        kw, fla_kw = make()
        public = case == "model"
        fwd_kw = dict(fla_kw, inplace_final_state=False) if public else fla_kw
        with torch.inference_mode():
            set_backend(True)
            op_backend.fused_recurrent_kda_fwd = spy
            (fla_public if public else fla_fwd)(**fla_kw)
            del op_backend.fused_recurrent_kda_fwd  # the class's again
            assert served, f"{case}: FLA's registry did not hand the call to flashkda"
            served.clear()
            ok, reason = integ.fused_recurrent_kda_fwd_verifier(**fwd_kw)  # the kernels serve it
            assert ok, reason
            direct = best_us(lambda: flashkda.fused_recurrent_kda(**kw))
            through = best_us(lambda: fla_fwd(**fwd_kw))
            adapter = best_us(lambda: integ.fused_recurrent_kda_fwd(**fwd_kw))
            wrapper = best_us(lambda: fla_public(**fla_kw)) - through if public else None
            set_backend(False)
            fla_alone = best_us(lambda: (fla_public if public else fla_fwd)(**fla_kw))
            set_backend(True)
        extra = through - direct
        dispatcher = through - adapter
        rows.append((case, direct, through, extra, dispatcher, adapter, wrapper, fla_alone))
        extra_fields = {} if wrapper is None else {"fla_public_wrapper_us": round(wrapper, 2)}
        common.record(f"fla_dispatch_{case}", "flashkda_backend", 0.0, 0.0, direct_us=round(direct, 2),
                      through_fla_us=round(through, 2), extra_us=round(extra, 2),
                      fla_dispatcher_us=round(dispatcher, 2),
                      adapter_us=round(adapter, 2), fla_alone_us=round(fla_alone, 2), **extra_fields,
                      source="bench/fla_dispatch.py (host µs per call, best of 5 rounds of 200 eager calls)")
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(common.RESULTS, f, indent=1)
    print(f"\nhost µs per call | direct | through FLA | extra (≤ {FLA_DISPATCH_EXTRA_US:g}) | FLA's dispatcher "
          "| adapter | FLA's public wrapper | FLA alone")
    for case, direct, through, extra, dispatcher, adapter, wrapper, fla_alone in rows:
        met = "met" if extra <= FLA_DISPATCH_EXTRA_US else "MISSED"
        wrapper = "—" if wrapper is None else f"{wrapper:.2f}"
        print(f"{case:<16} | {direct:6.2f} | {through:11.2f} | {extra:6.2f} {met:<6} | {dispatcher:16.2f} | "
              f"{adapter:7.2f} | {wrapper:>20} | {fla_alone:9.2f}")


if __name__ == "__main__":
    main()
