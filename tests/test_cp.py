"""Context parallelism on the CPU: gloo process groups of 2 and 3 ranks (torch.multiprocessing), each
rank running chunk_kda / chunk_gated_delta_rule on its slice of a packed batch under a cp_context;
every rank's output must equal its slice of the single-process result, and under autograd every
rank's gradients its slice of the single-process gradients (the shared gate parameters' summed over
the ranks). Cases: a sequence straddling two and three ranks, ranks holding only whole sequences,
empty sequences."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashkda
from flashkda.cp import build_context

from helpers import CHUNK_TOL, HAS_CUDA_KERNELS, make_inputs, rel_err

# (name, world size, sequence lengths, gdn, state_v_first, gate)
CASES = [
    ("straddles_two", 2, [100, 80], False, True, "lower_bound"),
    ("whole_sequences_only", 2, [60, 30, 90], False, False, "softplus"),
    ("straddles_three", 3, [150, 10, 20], False, True, "precomputed"),
    ("mixed_with_empty", 3, [0, 70, 50, 0, 60], True, True, "softplus"),
    ("gdn_straddles_three", 3, [5, 170, 5], True, False, "lower_bound"),
    # decays near 1: a rank's map M of 60 tokens stays far from zero, so its gradient counts
    ("weak_decay_straddles_three", 3, [150, 10, 20], False, False, "precomputed_weak"),
]


try:
    from fla.ops.cp import build_cp_context as _fla_context
except Exception:  # noqa: BLE001 - FLA not installed: flashkda's own context only
    _fla_context = None


def ctx_cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _inputs(lens, gdn, state_v_first, gate, device="cpu"):
    """CPU: fp32, D = 16 (the reference); GPU: bf16, D = 128 (the kernels)."""
    gpu = device != "cpu"
    weak = gate == "precomputed_weak"
    kw = make_inputs(lens=lens, H=2, HV=4, D=128 if gpu else 16, gdn=gdn, gate="precomputed" if weak else gate,
                     state=False, state_v_first=state_v_first, dtype=torch.bfloat16 if gpu else torch.float32,
                     device=device, seed=sum(lens) + len(lens))
    if weak:
        kw["g"] = kw["g"] * 0.01
    return kw


def _call(kw, gdn, **extra):
    fn = flashkda.chunk_gated_delta_rule if gdn else flashkda.chunk_kda
    return fn(**kw, **extra)


def _worker(rank, world, init_file, out_dir, cases, gpu=False, shared_gpu=False):
    """One rank: ``gpu`` one GPU per rank over NCCL; ``shared_gpu`` every rank on GPU 0 over gloo (the
    kernels on a machine with one GPU); else the CPU over gloo."""
    device = "cuda:0" if shared_gpu else f"cuda:{rank}" if gpu else "cpu"
    if gpu:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if gpu else "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for name, _, lens, gdn, v_first, gate in cases:
            kw = _inputs(lens, gdn, v_first, gate, device)
            ctx = build_context(kw.pop("cu_seqlens"))
            part = sum(lens) // world
            for key in ("q", "k", "v", "g", "beta"):
                kw[key] = kw[key][:, rank * part:(rank + 1) * part]
            o, ht = _call(kw, gdn, cp_context=ctx)
            assert ht is None
            fla_o = None
            if _fla_context is not None:  # FLA's own context object serves the same call
                fla_o, _ = _call(kw, gdn, cp_context=_fla_context(ctx_cu(lens).to(device), group=dist.group.WORLD))
            o, fla_o = o.cpu(), None if fla_o is None else fla_o.cpu()
            torch.save(dict(o=o, fla_o=fla_o, pre=ctx.pre_num_ranks, post=ctx.post_num_ranks,
                            cu=ctx.cu_seqlens_cpu.tolist()), os.path.join(out_dir, f"{name}_{rank}.pt"))
        # Every rank done with its collectives before any tears the group down: a rank that closes
        # its gloo pairs while another still reads them aborts that one (seen under a loaded CPU).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run_and_compare(world, cases, gpu, tol, shared_gpu=False):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, os.path.join(tmp, "init"), tmp, cases, gpu, shared_gpu), nprocs=world,
                 join=True)
        for name, _, lens, gdn, v_first, gate in cases:
            kw = _inputs(lens, gdn, v_first, gate, "cuda:0" if gpu or shared_gpu else "cpu")
            want, _ = _call(kw, gdn)
            part = sum(lens) // world
            for rank in range(world):
                got = torch.load(os.path.join(tmp, f"{name}_{rank}.pt"))
                err = rel_err(got["o"], want[:, rank * part:(rank + 1) * part])
                assert err <= tol, f"{name}, rank {rank}: error {err:.2e} (pre {got['pre']}, post {got['post']})"
                if got["fla_o"] is not None:
                    assert torch.equal(got["fla_o"], got["o"]), f"{name}, rank {rank}: FLA's context differs"


TOKEN_INPUTS = ("q", "k", "v", "g", "beta")


def _upstream(lens, HV, D, device="cpu", seed=5):
    return torch.randn(1, sum(lens), HV, D, generator=torch.Generator().manual_seed(seed)).to(device)


def _grad_worker(rank, world, init_file, out_dir, cases, shared_gpu=False):
    """One rank under gloo (on the CPU, or every rank on GPU 0): the gradients of its slice of the
    token inputs and of the shared gate parameters, from its slice of one upstream gradient of o."""
    device = "cuda:0" if shared_gpu else "cpu"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for name, _, lens, gdn, v_first, gate in cases:
            kw = _inputs(lens, gdn, v_first, gate, device)
            ctx = build_context(kw.pop("cu_seqlens"))
            part = sum(lens) // world
            names = [n for n in (*TOKEN_INPUTS, "A_log", "dt_bias") if kw.get(n) is not None]
            for n in names:
                x = kw[n][:, rank * part:(rank + 1) * part] if n in TOKEN_INPUTS else kw[n]
                kw[n] = x.detach().clone().requires_grad_()
            o, _ = _call(kw, gdn, cp_context=ctx)
            do = _upstream(lens, *kw["v"].shape[2:], device)[:, rank * part:(rank + 1) * part].to(o.dtype)
            grads = torch.autograd.grad(o, [kw[n] for n in names], do)
            torch.save({n: gr.cpu() for n, gr in zip(names, grads)}, os.path.join(out_dir, f"{name}_{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _grads_and_compare(world, cases, tol, shared_gpu=False):
    device = "cuda:0" if shared_gpu else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_grad_worker, args=(world, os.path.join(tmp, "init"), tmp, cases, shared_gpu), nprocs=world,
                 join=True)
        for name, _, lens, gdn, v_first, gate in cases:
            kw = _inputs(lens, gdn, v_first, gate, device)
            names = [n for n in (*TOKEN_INPUTS, "A_log", "dt_bias") if kw.get(n) is not None]
            for n in names:
                kw[n] = kw[n].detach().clone().requires_grad_()
            o, _ = _call(kw, gdn)
            do = _upstream(lens, *kw["v"].shape[2:], device).to(o.dtype)
            want = {n: gr.cpu() for n, gr in zip(names, torch.autograd.grad(o, [kw[n] for n in names], do))}
            part = sum(lens) // world
            got = [torch.load(os.path.join(tmp, f"{name}_{rank}.pt")) for rank in range(world)]
            for n in names:
                if n in TOKEN_INPUTS:
                    for rank in range(world):
                        err = rel_err(got[rank][n], want[n][:, rank * part:(rank + 1) * part])
                        assert err <= tol, f"{name}, rank {rank}: d{n} error {err:.2e}"
                else:  # shared by every rank: their contributions add up
                    err = rel_err(sum(g[n].float() for g in got), want[n].float())
                    assert err <= tol, f"{name}: d{n} (summed over ranks) error {err:.2e}"


@pytest.mark.parametrize("world", [2, 3])
def test_context_parallel_gradients_match_one_process(world):
    """The backward under cp_context: each rank's gradients are its slice of the single-process ones
    (sequences straddling two and three ranks, so the exchange's backward carries them back)."""
    _grads_and_compare(world, [c for c in CASES if c[1] == world], tol=1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA_KERNELS, reason="needs CUDA and the extension")
@pytest.mark.parametrize("world", [2, 3])
def test_context_parallel_gradients_kernels_on_one_gpu(world):
    """The backward under cp_context on the kernels (every rank on the one GPU, gloo), bf16, against
    the one-process kernels' gradients: the two split the bf16 products differently."""
    cases = [(n, world, lens, gdn, v_first, gate) for n, _, lens, gdn, v_first, gate in CASES
             if sum(lens) % world == 0] + [("long", world, [64 * 12 * world - 100, 100], False, True, "lower_bound")]
    _grads_and_compare(world, cases, tol=2e-2, shared_gpu=True)


@pytest.mark.parametrize("world", [2, 3])
def test_context_parallel_matches_one_process(world):
    _run_and_compare(world, [c for c in CASES if c[1] == world], gpu=False, tol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA_KERNELS, reason="needs CUDA and the extension")
@pytest.mark.parametrize("world", [2, 3])
def test_context_parallel_kernels_on_one_gpu(world):
    """Every rank on the one GPU (gloo for the all-gather): the kernels' path of every rank, bf16,
    against the one-process result on the same GPU."""
    cases = [(n, world, lens, gdn, v_first, gate) for n, _, lens, gdn, v_first, gate in CASES
             if sum(lens) % world == 0] + [("long", world, [64 * 12 * world - 100, 100], False, True, "lower_bound")]
    _run_and_compare(world, cases, gpu=False, tol=CHUNK_TOL[torch.bfloat16][0], shared_gpu=True)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2 or not HAS_CUDA_KERNELS, reason="needs 2 GPUs and the extension")
@pytest.mark.parametrize("world", [2, 3, 4])
def test_context_parallel_on_gpus(world, monkeypatch):
    """NCCL, one process per GPU, the kernels on every rank (NVLink multicast off)."""
    if world > torch.cuda.device_count():
        pytest.skip(f"needs {world} GPUs")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    cases = [(n, world, lens, gdn, v_first, gate) for n, _, lens, gdn, v_first, gate in CASES
             if sum(lens) % world == 0] + [("long", world, [64 * 60 * world - 100, 100], False, True, "lower_bound")]
    _run_and_compare(world, cases, gpu=True, tol=CHUNK_TOL[torch.bfloat16][0])


def test_context_of_each_rank():
    """build_context's fields (FLA's FLACPContext semantics) for three ranks of 60 tokens:
    lengths 150, 10, 20 (the first sequence on ranks 0-2)."""
    cu = torch.tensor([0, 150, 160, 180], dtype=torch.int32)
    want = {0: ([0, 60], 0, 2), 1: ([0, 60], 1, 1), 2: ([0, 30, 40, 60], 2, 0)}
    for rank, (local, pre, post) in want.items():
        ctx = _context_as(rank, 3, cu)
        assert ctx.cu_seqlens_cpu.tolist() == local and (ctx.pre_num_ranks, ctx.post_num_ranks) == (pre, post)
        assert ctx.is_first_rank == (pre == 0) and ctx.is_last_rank == (post == 0)


@pytest.mark.skipif(_fla_context is None, reason="needs fla-core")
@pytest.mark.parametrize("lens", [[150, 10, 20], [60, 30, 90], [0, 70, 50, 0, 60]])
def test_context_equals_fla(lens):
    """build_context gives FLA's context fields for every rank."""
    from fla.ops.cp.context import get_cp_cu_seqlens

    cu = ctx_cu(lens)
    for world in (2, 3):
        for rank in range(world):
            ours = _context_as(rank, world, cu)
            theirs = get_cp_cu_seqlens(cu, world_size=world, rank=rank)
            assert ours.cu_seqlens_cpu.tolist() == theirs.cu_seqlens_cpu.tolist()
            assert (ours.pre_num_ranks, ours.post_num_ranks, ours.is_first_rank, ours.is_last_rank) == (
                theirs.pre_num_ranks, theirs.post_num_ranks, theirs.is_first_rank, theirs.is_last_rank)


def _context_as(rank, world, cu):
    from unittest import mock

    with mock.patch.object(dist, "get_world_size", return_value=world), \
            mock.patch.object(dist, "get_rank", return_value=rank):
        return build_context(cu)


def test_context_restrictions():
    kw = make_inputs(T=60, H=2, D=16, seed=1)
    ctx = _context_as(0, 1, torch.tensor([0, 60], dtype=torch.int32))
    with pytest.raises(ValueError, match="initial_state"):
        flashkda.chunk_kda(**kw, cp_context=ctx)
    kw.pop("initial_state")
    with pytest.raises(ValueError, match="output_final_state"):
        flashkda.chunk_kda(**kw, cp_context=ctx, output_final_state=True)
    with pytest.raises(ValueError, match="multiple of the number of ranks"):
        _context_as(0, 7, torch.tensor([0, 60], dtype=torch.int32))
