"""Loads the compiled extension ``flashkda._C`` (it registers ``torch.ops.flashkda.*``) and holds
the run-time switches read from the environment at import.

* ``FLASHKDA_FORCE_REFERENCE=1``: every call uses the PyTorch reference.
* ``FLASHKDA_DEBUG=1``: checks that need the device's data (slot indices within the pool,
  ``cu_seqlens`` order on CUDA) run, synchronising, and raise instead of skipping.
* ``FLASHKDA_CHUNK_VALUE_SPLIT=0|1|2``: blocks per (sequence, head) in the chunked recurrence;
  0 (default) chooses from the number of (sequence, head) chains and SMs.
* ``FLASHKDA_CHUNK_SEGMENT=auto|0|n``: cut each sequence's chunked recurrence into segments of n
  chunks (64 tokens each) that run in parallel and are joined by a scan of their affine state maps;
  0 runs each chain whole; ``auto`` (default, stored as -1) segments few long (sequence, head)
  chains, as under tensor parallelism, by a cost model (``auto_segment_chunks`` in chunk_plan.h).
* ``FLASHKDA_KERNEL_FAMILY=auto|sm80|sm90``: the kernel family. ``sm90`` (and ``auto``, the
  default) runs the newer decode kernels for the cases they cover (decode-sized calls of at most 8
  tokens per sequence on average, V-first state, K = V = 128, one slot per sequence, 16-byte
  aligned states): the register-streaming kernel for fp32 states on any device (16-byte aligned
  token rows), the bulk-copy kernel for bf16 states (and fp32 ones with unaligned token rows) on an
  sm_90 device with an sm_90a build; and there the chunked recurrence with bulk-copy record loads
  and warpgroup MMAs (wgmma). The sm_80 kernels serve everything else. ``sm80`` always runs the
  sm_80 kernels (cp.async, mma.sync), also on an H100 / H200. ``set_kernel_family`` changes it at
  run time.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch

log = logging.getLogger("flashkda")

#: Element types the kernels read (q, k, v, g, beta, the gate parameters); float64 takes the reference.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a contiguous copy when its last dimension is strided (the kernels read rows)."""
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


def kernel_float(x: torch.Tensor) -> torch.Tensor:
    """A tensor the kernels read in its own dtype (g, beta, the gate parameters): itself, or a float32
    copy of a float64 one, which the kernels do not read (FLA's kernels also read them in fp32)."""
    return x.float() if x.dtype == torch.float64 else x


def kernel_param(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A gate parameter as the kernels read it: contiguous (any shape of the right size; the kernels
    index it flat), in its own dtype; float64, which the kernels do not read, as a float32 copy."""
    if t is None:
        return None
    return kernel_float(t if t.is_contiguous() else t.contiguous())


def chunk_gate_beta(g: torch.Tensor, beta: torch.Tensor):
    """``(g, beta)`` as the chunked kernels' op takes them: kernel_float, a scalar gate and beta with a
    contiguous last dim (q, k, v and a per-channel g whose rows do not start on 16 bytes: the binding
    reads a copy)."""
    g = kernel_float(g)
    return (g if g.dim() == 4 else last_dim_contiguous(g)), last_dim_contiguous(kernel_float(beta))


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


#: Kernel families by name, as the extension numbers them (``KernelFamily`` in
#: csrc/flashkda/common/recurrent_params.h).
KERNEL_FAMILIES = {"auto": 0, "sm80": 80, "sm90": 90}


def _kernel_family_name(name: str, source: str) -> str:
    name = name.strip().lower() or "auto"
    if name not in KERNEL_FAMILIES:
        raise ValueError(f"flashkda: {source} must be one of {', '.join(KERNEL_FAMILIES)}, got {name!r}")
    return name


@dataclass
class Config:
    force_reference: bool = False
    debug: bool = False
    chunk_value_split: int = 0
    chunk_segment: int = -1  # -1: auto
    kernel_family: str = "auto"

    @classmethod
    def from_env(cls) -> "Config":
        split = os.environ.get("FLASHKDA_CHUNK_VALUE_SPLIT", "0").strip() or "0"
        if split not in ("0", "1", "2"):
            raise ValueError(f"flashkda: FLASHKDA_CHUNK_VALUE_SPLIT must be 0, 1 or 2, got {split!r}")
        segment = os.environ.get("FLASHKDA_CHUNK_SEGMENT", "auto").strip().lower() or "auto"
        if segment == "auto":
            segment = "-1"
        elif not segment.isdigit():
            raise ValueError(
                f"flashkda: FLASHKDA_CHUNK_SEGMENT must be auto or a number of chunks >= 0, got {segment!r}")
        family = _kernel_family_name(os.environ.get("FLASHKDA_KERNEL_FAMILY", "auto"), "FLASHKDA_KERNEL_FAMILY")
        return cls(force_reference=_env_flag("FLASHKDA_FORCE_REFERENCE"), debug=_env_flag("FLASHKDA_DEBUG"),
                   chunk_value_split=int(split), chunk_segment=int(segment), kernel_family=family)


config = Config.from_env()

try:
    from flashkda import _C  # noqa: F401  (registers torch.ops.flashkda)

    fused_recurrent_fast = _C.fused_recurrent  # a build older than this package lacks these: rebuild
    chunk_fast = _C.chunk
    HAS_EXTENSION = True
    EXTENSION_ERROR = None
except (ImportError, AttributeError) as e:  # pure-Python install, a build for another torch, a stale build
    HAS_EXTENSION = False
    EXTENSION_ERROR = str(e)
    log.debug("flashkda: CUDA extension not available (%s); the PyTorch reference serves every call", e)


#: The oldest GPU the build has kernels for: sm_80 machine code and PTX (setup.py's default
#: architectures); older GPUs run the PyTorch reference.
MIN_COMPUTE_CAPABILITY = (8, 0)
_device_shortfall: dict = {}


# torch.compile calls the per-device checks below while tracing and keeps their answers as constants
# (the device is part of what a traced graph is specialised on), so traced code takes the same path
# as eager code.
@torch.compiler.assume_constant_result
def device_shortfall(index: int):
    """Why CUDA device ``index`` cannot run the kernels, or None: a compute capability below 8.0, or
    a build with neither machine code for the device nor PTX it can compile (e.g.
    ``FLASHKDA_CUDA_ARCHS=90a`` on an A100); one query per device."""
    if index not in _device_shortfall:
        cc = tuple(torch.cuda.get_device_capability(index))
        if cc < MIN_COMPUTE_CAPABILITY:
            reason = (f"compute capability {cc[0]}.{cc[1]} (the kernels need {MIN_COMPUTE_CAPABILITY[0]}."
                      f"{MIN_COMPUTE_CAPABILITY[1]} or later)")
        else:
            image = _C.kernel_image_reason(index) if HAS_EXTENSION else None
            reason = None if image is None else f"compute capability {cc[0]}.{cc[1]}: {image}"
        if reason is not None:  # every call on this device will run the reference: said once, loudly
            log.warning("flashkda: CUDA device %d runs the PyTorch reference: %s", index, reason)
        _device_shortfall[index] = reason
    return _device_shortfall[index]


def set_kernel_family(name: str) -> None:
    """Chooses the kernel family for every later call in this process: ``"auto"``, ``"sm80"``,
    or ``"sm90"`` (see FLASHKDA_KERNEL_FAMILY above)."""
    config.kernel_family = _kernel_family_name(name, "the kernel family")
    if HAS_EXTENSION:
        _C.set_kernel_family(KERNEL_FAMILIES[config.kernel_family])


@contextlib.contextmanager
def kernel_family(name: str):
    """Runs the block with the kernel family ``name``, then restores the one before."""
    before = config.kernel_family
    set_kernel_family(name)
    try:
        yield name
    finally:
        set_kernel_family(before)


if HAS_EXTENSION:
    set_kernel_family(config.kernel_family)

    recurrent_fwd_op = torch.ops.flashkda.recurrent_fwd.default
    recurrent_fwd_eager = _C.recurrent_fwd

    chunk_fwd_op = torch.ops.flashkda.chunk_fwd.default
    chunk_fwd_eager = _C.chunk_fwd

    _smem_optin: dict = {}

    def smem_per_block_optin(index: int):
        """CUDA device ``index``'s opt-in shared memory per block (bytes), None when torch does not
        report it; one properties query per device."""
        if index not in _smem_optin:
            _smem_optin[index] = getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", None)
        return _smem_optin[index]

    _chunk_smem_shortfall: dict = {}

    @torch.compiler.assume_constant_result
    def chunk_smem_shortfall(index: int):
        """Why CUDA device ``index`` cannot run the chunked kernels (too little shared memory per
        block, e.g. sm_86 / sm_89), or None, judged by the rule that the eager fast entries apply too;
        asked once per device (every prefill call reads it)."""
        if index not in _chunk_smem_shortfall:
            have = smem_per_block_optin(index)
            _chunk_smem_shortfall[index] = None if have is None else _C.chunk_smem_reason(have)
        return _chunk_smem_shortfall[index]

    chunk_local_grad_op = torch.ops.flashkda.chunk_local_grad.default
    chunk_state_scan_op = torch.ops.flashkda.chunk_state_scan.default
    chunk_state_grad_op = torch.ops.flashkda.chunk_state_grad.default
    chunk_bwd_inputs_op = torch.ops.flashkda.chunk_bwd_inputs.default
    chunk_bwd_input_grads_op = torch.ops.flashkda.chunk_bwd_input_grads.default
    CHUNK_BWD_MAX_SUBCHUNK_SPAN = _C.chunk_bwd_max_subchunk_span()
    #: Bytes of one chunk record (per chunk entry and value head) that a forward keeps for its backward.
    CHUNK_RECORD_BYTES = _C.chunk_record_bytes()

    _chunk_bwd_shortfall: dict = {}

    @torch.compiler.assume_constant_result
    def chunk_bwd_shortfall(index: int, transitions: bool = False):
        """Why CUDA device ``index`` cannot run the chunked backward's gradients pass (in value halves
        where the whole pass's block does not fit: sm_80), or with ``transitions``, its transitions
        pass (the state maps of fp32 inputs, the whole pass's block: sm_90), or None; asked once per
        device (traced training calls read it)."""
        key = (index, transitions)
        if key not in _chunk_bwd_shortfall:
            have = smem_per_block_optin(index) or 0
            need = _C.chunk_local_grad_smem_bytes() if transitions else _C.chunk_local_grad_split_smem_bytes()
            _chunk_bwd_shortfall[key] = (
                None if have >= need else f"{have} bytes of shared memory per block (the backward's kernel: {need})")
        return _chunk_bwd_shortfall[key]

    def chunk_bwd_in_value_halves(index: int) -> bool:
        """Whether the chunked backward's gradients pass runs in value halves on CUDA device ``index``
        (the sm_80 family, or too little shared memory per block for the whole pass); read at call
        time, as the kernel family may change."""
        return _C.chunk_local_grad_in_value_halves(index)

    @torch.library.register_fake("flashkda::chunk_fwd")
    def _chunk_fwd_fake(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, initial_state, final_state, o, scale,
                        gate_mode, lower_bound, l2norm, beta_sigmoid, allow_neg_eigval, state_v_first, value_split,
                        segment_chunks, chunk_states=None, chunk_state_slots=None, ssm_state_indices=None,
                        has_initial_state=None, records=None):
        return None

    @torch.library.register_fake("flashkda::recurrent_fwd")
    def _recurrent_fwd_fake(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, initial_state, final_state,
                            ssm_state_indices, num_accepted_tokens, o, scale, gate_mode, lower_bound, l2norm,
                            beta_sigmoid, allow_neg_eigval, state_v_first):
        return None
