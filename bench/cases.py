"""The benchmark cases and their required times, in one place (torch-free, so that
bench/report.py runs anywhere). Times are median milliseconds on an H200 (BENCHMARK_H200.md)."""

# Prefill rows: case -> (sequence lengths, heads); B = 1, D = 128.
PREFILL_ROWS = {
    "fixed_8k_H96": ([8192], 96),
    "varlen6_8k_H96": ([1300, 547, 2048, 963, 271, 3063], 96),
    "varlen_1024x8_H96": ([1024] * 8, 96),
    "fixed_8k_H64": ([8192], 64),
    "fixed_8k_H16": ([8192], 16),
    "fixed_32k_H8": ([32768], 8),
}
PREFILL_REQUIRED_MS = {"fixed_8k_H96": 1.00, "varlen6_8k_H96": 1.00, "varlen_1024x8_H96": 0.85,
                       "fixed_8k_H64": 0.75, "fixed_8k_H16": 0.45, "fixed_32k_H8": 1.00}
# Also required on every prefill row: the softplus gate within this factor of the lower-bound time,
# our GDN no slower than FLA's GDN; on the first row, the sm_80 family no slower than FLA chunk_kda.
PREFILL_SOFTPLUS_MAX_RATIO = 1.3
PREFILL_SM80_ROW = "fixed_8k_H96"
# Time against T for the plot (bench/report.py --plot).
PREFILL_SWEEP = {f"sweep_T{T}_H{H}": ([T], H) for H in (16, 32, 96) for T in (1024, 2048, 4096, 8192, 16384)}

# Decode rows: N sequences of one token, H = 32, D = 128.
DECODE_HEADS = 32
DECODE_NS = [1, 16, 64, 256, 1024]
DECODE_REQUIRED_MS = {1: 0.015, 16: 0.025, 64: 0.075, 256: 0.280, 1024: 1.120}
DECODE_BF16_POOL_REQUIRED_MS = {256: 0.15}
HOST_OVERHEAD_REQUIRED_US = 20.0


# Prefix caching on the first row: with every chunk's state returned (FLA's h, bf16) at most
# PREFIX_STATES_MAX_RATIO of the plain call, with a checkpoint every PREFIX_CHECKPOINT_TOKENS
# tokens into an fp32 pool at most PREFIX_CHECKPOINTS_MAX_RATIO.
PREFIX_ROW = "fixed_8k_H96"
PREFIX_STATES_MAX_RATIO = 1.25
PREFIX_CHECKPOINTS_MAX_RATIO = 1.05
PREFIX_CHECKPOINT_TOKENS = 1024

# FLA's own KDAForCausalLM end to end (bench/e2e_fla_model.py), with and without flashkda as its
# backend: every KDA call served, the prompt forward at most this fraction of FLA's, generate no slower.
E2E_GATES = ("lower_bound", "softplus")
E2E_PREFILL_MAX_RATIO = 0.80
# A decode call through FLA's registry: at most this much more host time than the direct call
# (bench/fla_dispatch.py).
FLA_DISPATCH_EXTRA_US = 10.0


def e2e_case(gate: str) -> str:
    return f"e2e_fla_kda_model_{gate}"


def decode_case(N: int) -> str:
    return f"decode_N{N}_H{DECODE_HEADS}"

# Training rows (bench/test_train.py): case -> (sequence lengths per batch row, batch rows, heads);
# D = 128, forward + backward of o and the final state. Required on every row: fwd_bwd_ms at most
# TRAIN_MAX_RATIO of FLA's on the same inputs, and peak memory no more than FLA's.
TRAIN_ROWS = {
    "train_T8k_H32": ([8192], 1, 32),
    "train_B4xT4k_H32": ([4096], 4, 32),
    "train_varlen8x2k_H32": ([2048] * 8, 1, 32),
    "train_T8k_H96": ([8192], 1, 96),
}
TRAIN_GDN_ROW = "train_gdn_T8k_H32"
TRAIN_MAX_RATIO = 0.6

# Context parallelism (bench/cp_bench.py): case -> sequence lengths; H = 32, D = 128, split over 1, 2
# and 4 GPUs. Required: 2 GPUs at least CP_MIN_SPEEDUP_2 x one GPU on the single long sequence.
CP_ROWS = {"cp_T1M_H32": [1 << 20], "cp_B16x64k_H32": [1 << 16] * 16}
CP_MIN_SPEEDUP_2 = 1.8
