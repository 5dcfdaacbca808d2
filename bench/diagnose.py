"""Decode diagnostics on the device: measured copy bandwidth, and per-call kernel time from CUDA
graph replays (no host overhead) for each N, next to FLA's kernel. `--ncu N` runs three calls at one
N for a profiler to capture."""

import argparse
import sys

import torch

import flashkda
from flashkda import _ext
from test_decode import NS, _bytes, _inputs

try:
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla_decode
except Exception:
    fla_decode = None


def copy_bandwidth_tbs(nbytes=2 << 30):
    x = torch.empty(nbytes // 4, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        s.record()
        y.copy_(x)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return 2 * nbytes / (times[len(times) // 2] * 1e-3) / 1e12


def graph_ms(fn, calls=20, reps=5):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = []
    for _ in range(reps):
        st.record()
        g.replay()
        en.record()
        en.synchronize()
        best.append(st.elapsed_time(en) / calls)
    best.sort()
    return best[len(best) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ncu", type=int, default=0)
    ap.add_argument("--no-fla", action="store_true", help="skip FLA's kernel (its Triton compile takes a while)")
    args = ap.parse_args()
    if args.ncu:
        kw = _inputs(args.ncu)
        out = torch.empty_like(kw["v"])
        for _ in range(3):
            flashkda.fused_recurrent_kda(**kw, out=out)
            if fla_decode is not None:
                fla_decode(**kw, inplace_final_state=True, out=out)
        torch.cuda.synchronize()
        return
    fla = None if args.no_fla else fla_decode
    bw = copy_bandwidth_tbs()
    print(f"copy bandwidth: {bw:.2f} TB/s (read + write)")
    print(f"{'N':>6} {'pool':>5} {'flashkda ms':>12} {'sm80 family ms':>15} {'fla ms':>9} {'floor ms':>9} "
          f"{'flashkda / floor':>17}")
    for N, pool in [(n, torch.float32) for n in NS] + [(256, torch.bfloat16)]:
        kw = _inputs(N, pool)
        out = torch.empty_like(kw["v"])
        ours = graph_ms(lambda: flashkda.fused_recurrent_kda(**kw, out=out))
        with _ext.kernel_family("sm80"):
            sm80 = graph_ms(lambda: flashkda.fused_recurrent_kda(**kw, out=out))
        theirs = graph_ms(lambda: fla(**kw, inplace_final_state=True, out=out)) if fla and pool == torch.float32 \
            else float("nan")
        floor = _bytes(N, pool_bytes=pool.itemsize) / (bw * 1e12) * 1e3
        print(f"{N:>6} {str(pool)[6:]:>5} {ours:>12.4f} {sm80:>15.4f} {theirs:>9.4f} {floor:>9.4f} "
              f"{floor / ours:>16.0%}")


if __name__ == "__main__":
    sys.exit(main())
