"""flashkda: CUDA kernels for Kimi Delta Attention (KDA) and Gated DeltaNet (GDN).

Drop-in replacements for ``fla.ops.kda`` / ``fla.ops.gated_delta_rule``:

* :func:`chunk_kda`, :func:`chunk_gated_delta_rule` — prefill;
* :func:`fused_recurrent_kda`, :func:`fused_recurrent_gated_delta_rule` — decode with a serving slot pool.

The CUDA kernels serve K = V in {64, 128} with float32/bfloat16/float16 inputs on CUDA; every other
case runs the PyTorch reference (:mod:`flashkda.reference`), chosen automatically.
"""

from flashkda import varlen
from flashkda._ext import HAS_EXTENSION, config
from flashkda.api import chunk_gated_delta_rule, chunk_kda, fused_recurrent_gated_delta_rule, fused_recurrent_kda

__version__ = "0.1.0"

__all__ = [
    "chunk_kda",
    "fused_recurrent_kda",
    "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "varlen",
    "HAS_EXTENSION",
    "config",
]

# Register flashkda as a backend of FLA's kda ops when fla is installed (FLASHKDA_FLA_BACKEND=0: off).
from flashkda.integrations.fla import maybe_register_on_import as _maybe_register_fla  # noqa: E402

_maybe_register_fla()
