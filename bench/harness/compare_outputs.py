"""Relative L2 difference of each gradient between two dumps of local_grad_harness.cu (argv[4]):
dq, dk, dv [T, HV, 128], dg ([T, HV, 128], or [T, HV] for a scalar gate) and dβ [T, HV], fp32, in
that order. A variant that only reorders work or changes roundings shows differences of the order
of bf16's (1e-3 or less); NaN or a large difference is a broken variant.

    python3 bench/harness/compare_outputs.py base.bin variant.bin T HV [GATE]

GATE: the harness's gate argument (`channel` by default; one starting with `scalar` sizes dg per
token and head).
"""

import sys

import numpy as np


def main() -> None:
    a, b = (np.fromfile(path, dtype=np.float32) for path in sys.argv[1:3])
    T, HV = int(sys.argv[3]), int(sys.argv[4])
    scalar_gate = len(sys.argv) > 5 and sys.argv[5].startswith("scalar")
    sizes = {"dq": T * HV * 128, "dk": T * HV * 128, "dv": T * HV * 128, "dg": T * HV * (1 if scalar_gate else 128),
             "dbeta": T * HV}
    if a.size != sum(sizes.values()) or b.size != a.size:
        sys.exit(f"dumps of {a.size} and {b.size} floats, expected {sum(sizes.values())} (T, HV, gate as the harness's)")
    at, worst = 0, 0.0
    parts = []
    for name, n in sizes.items():
        x, y = a[at:at + n].astype(np.float64), b[at:at + n].astype(np.float64)
        at += n
        err = float(np.linalg.norm(x - y) / max(np.linalg.norm(x), 1e-30)) if np.isfinite(y).all() else float("nan")
        worst = max(worst, err) if err == err else float("nan")
        parts.append(f"{name} {err:.1e}")
    print("  ".join(parts))
    sys.exit(0 if worst == worst and worst < 5e-3 else 1)


if __name__ == "__main__":
    main()
