"""Numerical constants of the contract and kernel limits, defined once.

The CUDA side reads the same values from ``csrc/flashkda/common/constants.h``; ``tests/test_api.py``
(``test_cuda_constants_match_python``) checks that the two agree.
"""

#: ``q / sqrt(sum(q^2) + L2NORM_EPS)`` in ``use_qk_l2norm_in_kernel``.
L2NORM_EPS = 1e-6
#: ``softplus(x) = x`` above this threshold, ``log1p(exp(x))`` below it.
SOFTPLUS_THRESHOLD = 20.0
#: Tokens per chunk of the PyTorch reference's chunked core.
REFERENCE_CHUNK = 32
#: Head dimensions (K == V) served by the CUDA kernels; anything else uses the reference.
KERNEL_HEAD_DIMS = (64, 128)
#: Range allowed for ``lower_bound``.
LOWER_BOUND_MIN = -5.0
#: Head dimension (K == V) of the chunked prefill kernels (``chunk::kHeadDim`` in
#: csrc/flashkda/prefill/chunk_params.h); other kernel head dims run prefill on the recurrent kernel.
CHUNK_HEAD_DIM = 128
#: Tokens per chunk of the chunked kernels (``chunk::kChunk``): the states of
#: ``return_intermediate_states`` and of prefill checkpoints are those at multiples of it.
CHUNK_STATE_TOKENS = 64

#: How the log decay is obtained from g (csrc/flashkda/common/recurrent_params.h, GateMode): g as
#: given, ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``, ``-exp(A_log) * softplus(g + dt_bias)``.
GATE_PRECOMPUTED, GATE_LOWER_BOUND, GATE_SOFTPLUS = 0, 1, 2


def gate_mode(use_gate_in_kernel: bool, lower_bound) -> int:
    """The gate mode of a call's ``use_gate_in_kernel`` and ``lower_bound``."""
    if not use_gate_in_kernel:
        return GATE_PRECOMPUTED
    return GATE_SOFTPLUS if lower_bound is None else GATE_LOWER_BOUND
