"""State pools as serving engines lay them out: one slot pitched across all layers, so that a layer's
pool is a view ``[slots, HV, ·, ·]`` whose slot stride is larger than a slot. Every entry that reads
or writes a pool in place (decode with slot indices, pool-indexed prefill, prefill checkpoints)
takes such a view: its results equal those on a dense pool, and the other layers' bytes stay
bit-identical. On the CPU the reference serves; on a GPU the kernels (every decode kernel family,
the chunked prefill)."""

import pytest
import torch

import flashkda
from helpers import HAS_CUDA_KERNELS, make_inputs

LAYERS, LAYER = 3, 1  # the view is layer 1 of 3


def _pitched(dense: torch.Tensor) -> tuple:
    """A [slots, LAYERS, HV, ·, ·] buffer of random bytes whose layer LAYER holds ``dense``: (the
    buffer, its layer view, a copy of the buffer)."""
    slots = dense.shape[0]
    buf = torch.randn(slots, LAYERS, *dense.shape[1:], device=dense.device).to(dense.dtype)
    buf[:, LAYER] = dense
    return buf, buf[:, LAYER], buf.clone()


def _check(buf, before, dense_after, what):
    view = buf[:, LAYER]
    assert torch.equal(view, dense_after), f"{what}: the pitched pool differs from the dense one"
    others = [layer for layer in range(LAYERS) if layer != LAYER]
    assert torch.equal(buf[:, others], before[:, others]), f"{what}: another layer's bytes changed"


DECODE_CASES = {
    # (token dtype, pool dtype, tokens per sequence, V-first)
    "fp32_pool": (torch.float32, torch.float32, 1, True),
    "bf16_pool_one_token": (torch.bfloat16, torch.bfloat16, 1, True),
    "bf16_pool_two_tokens": (torch.bfloat16, torch.bfloat16, 2, True),
    "k_first": (torch.float32, torch.float32, 1, False),
}


def _decode(device, case):
    token_dtype, pool_dtype, T, v_first = DECODE_CASES[case]
    N, H, slots = 12, 2, 20
    D = 128 if device == "cuda" else 16
    kw = make_inputs(B=N, T=T, H=H, D=D, dtype=token_dtype, device=device, state=False, state_v_first=v_first,
                     seed=3)
    idx = torch.randperm(slots)[:N].to(torch.int32).to(device)
    idx[::5] = -1  # padding
    dense = (0.1 * torch.randn(slots, H, D, D)).to(device, pool_dtype)
    buf, view, before = _pitched(dense)
    o_dense, _ = flashkda.fused_recurrent_kda(**kw, initial_state=dense, ssm_state_indices=idx)
    o_view, ret = flashkda.fused_recurrent_kda(**kw, initial_state=view, ssm_state_indices=idx)
    assert ret.data_ptr() == view.data_ptr()
    assert torch.equal(o_view, o_dense), f"{case}: outputs differ"
    _check(buf, before, dense, case)


def _prefill(device):
    lens = [70, 0, 150, 5]
    D = 128 if device == "cuda" else 16
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    kw = make_inputs(lens=lens, H=2, D=D, dtype=dtype, device=device, state=False, state_v_first=True, seed=4)
    slots = 9
    idx = torch.tensor([4, -1, 0, 7], dtype=torch.int32, device=device)
    dense = (0.1 * torch.randn(slots, 2, D, D)).to(device)
    buf, view, before = _pitched(dense)
    o_dense, _ = flashkda.chunk_kda(**kw, initial_state=dense, ssm_state_indices=idx)
    o_view, _ = flashkda.chunk_kda(**kw, initial_state=view, ssm_state_indices=idx)
    assert torch.equal(o_view, o_dense), "pool prefill: outputs differ"
    _check(buf, before, dense, "pool prefill")
    # checkpoints into a pitched pool (a plain prefill, chunk j of sequence n to slot cks[n, j])
    cks = torch.tensor([[1, 2, -1], [-1, -1, -1], [3, 5, 6], [8, -1, -1]], dtype=torch.int32, device=device)
    dense = torch.zeros(slots, 2, D, D, device=device)
    buf, view, before = _pitched(dense)
    flashkda.chunk_kda(**kw, checkpoint_pool=dense, checkpoint_slots=cks)
    flashkda.chunk_kda(**kw, checkpoint_pool=view, checkpoint_slots=cks)
    _check(buf, before, dense, "checkpoints")


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_pitched_pool_decode_cpu(case):
    _decode("cpu", case)


def test_pitched_pool_prefill_cpu():
    _prefill("cpu")


def test_pool_layout_is_checked():
    """A pool whose slots are not dense, or whose slot stride is not a multiple of 16 bytes, is
    refused with the argument named (it is updated in place: a copy would lose the update)."""
    kw = make_inputs(B=2, T=1, H=2, D=16, state=False, state_v_first=True, seed=5)
    idx = torch.tensor([0, 1], dtype=torch.int32)
    transposed = torch.zeros(3, 2, 16, 16).transpose(-1, -2)
    with pytest.raises(ValueError, match="initial_state"):
        flashkda.fused_recurrent_kda(**kw, initial_state=transposed, ssm_state_indices=idx)
    odd = torch.zeros(3 * 2 * 16 * 16 + 3 * 3)[: 3 * (2 * 16 * 16 + 3)].view(3, 2 * 16 * 16 + 3)[:, :512].view(3, 2, 16, 16)
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        flashkda.fused_recurrent_kda(**kw, initial_state=odd, ssm_state_indices=idx)


cuda = pytest.mark.skipif(not HAS_CUDA_KERNELS, reason="needs CUDA and the extension")


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_pitched_pool_decode_cuda(case):
    _decode("cuda", case)


@cuda
@pytest.mark.cuda
def test_pitched_pool_prefill_cuda():
    _prefill("cuda")
