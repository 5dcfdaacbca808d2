"""Loads the compiled extension ``flashkda._C`` (it registers ``torch.ops.flashkda.*``) and holds
the run-time switches read from the environment at import.

* ``FLASHKDA_FORCE_REFERENCE=1``: every call uses the PyTorch reference.
* ``FLASHKDA_DEBUG=1``: checks that need the device's data (slot indices within the pool,
  ``cu_seqlens`` order on CUDA) run, synchronising, and raise instead of skipping.
* ``FLASHKDA_CHUNK_VALUE_SPLIT=0|1|2``: blocks per (sequence, head) in the chunked recurrence;
  0 (default) chooses from the number of (sequence, head) chains and SMs.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

log = logging.getLogger("flashkda")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


@dataclass
class Config:
    force_reference: bool = False
    debug: bool = False
    chunk_value_split: int = 0

    @classmethod
    def from_env(cls) -> "Config":
        split = os.environ.get("FLASHKDA_CHUNK_VALUE_SPLIT", "0").strip() or "0"
        if split not in ("0", "1", "2"):
            raise ValueError(f"flashkda: FLASHKDA_CHUNK_VALUE_SPLIT must be 0, 1 or 2, got {split!r}")
        return cls(force_reference=_env_flag("FLASHKDA_FORCE_REFERENCE"), debug=_env_flag("FLASHKDA_DEBUG"),
                   chunk_value_split=int(split))


config = Config.from_env()

try:
    from flashkda import _C  # noqa: F401  (registers torch.ops.flashkda)

    fused_recurrent_fast = _C.fused_recurrent  # a build older than this package lacks it: rebuild
    HAS_EXTENSION = True
    EXTENSION_ERROR = None
except (ImportError, AttributeError) as e:  # pure-Python install, a build for another torch, a stale build
    HAS_EXTENSION = False
    EXTENSION_ERROR = str(e)
    log.debug("flashkda: CUDA extension not available (%s); the PyTorch reference serves every call", e)

if HAS_EXTENSION:
    recurrent_fwd_op = torch.ops.flashkda.recurrent_fwd.default
    recurrent_fwd_eager = _C.recurrent_fwd

    chunk_fwd_op = torch.ops.flashkda.chunk_fwd.default
    chunk_fwd_eager = _C.chunk_fwd

    @torch.library.register_fake("flashkda::chunk_fwd")
    def _chunk_fwd_fake(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, initial_state, final_state, o, scale,
                        gate_mode, lower_bound, l2norm, beta_sigmoid, allow_neg_eigval, state_v_first, value_split):
        return None

    @torch.library.register_fake("flashkda::recurrent_fwd")
    def _recurrent_fwd_fake(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, initial_state, final_state,
                            ssm_state_indices, num_accepted_tokens, o, scale, gate_mode, lower_bound, l2norm,
                            beta_sigmoid, allow_neg_eigval, state_v_first):
        return None
