"""FLA's own KDAForCausalLM with flashkda as its KDA backend (GPU; skipped without fla-core, transformers
or flashkda's CUDA extension).

A small random bf16 model, a left-padded batch that FLA's layer unpads to cu_seqlens, both gates:
every KDA call of the prompt forward and of a short greedy generate reaches flashkda, and flashkda's
prompt logits are as close to an fp64 KDA run of the same model as FLA's own are.
"""

import contextlib

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("fla.models")

import fla.layers.kda as fla_layer  # noqa: E402
from fla.models import KDAConfig, KDAForCausalLM  # noqa: E402

from flashkda.integrations import fla as integ  # noqa: E402
from flashkda.reference import kda_reference  # noqa: E402

from helpers import HAS_CUDA_KERNELS, rel_err  # noqa: E402

pytestmark = [pytest.mark.skipif(not HAS_CUDA_KERNELS, reason="needs CUDA and flashkda's extension"),
              pytest.mark.fla_compile]

GATES = {"lower_bound": dict(safe_gate=True, lower_bound=-5.0), "softplus": {}}
LENS = (150, 97, 1)
VOCAB = 512


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("FLA_FLASH_KDA", "0")  # FLA's adapter of the flash_kda package stays out of the way
    monkeypatch.delenv("FLA_FLASHKDA", raising=False)
    monkeypatch.setenv(integ.ENV_VAR, "1")
    assert integ.register()


def _model(gate):
    config = KDAConfig(hidden_size=256, num_heads=2, head_dim=128, num_hidden_layers=2, vocab_size=VOCAB,
                       **GATES[gate])
    torch.manual_seed(0)
    return KDAForCausalLM(config).to(torch.bfloat16).cuda().eval()


def _batch():
    gen = torch.Generator().manual_seed(1)
    L = max(LENS)
    ids = torch.zeros(len(LENS), L, dtype=torch.long)
    mask = torch.zeros(len(LENS), L, dtype=torch.long)
    for b, n in enumerate(LENS):  # left padding
        ids[b, L - n:] = torch.randint(3, VOCAB, (n,), generator=gen)
        mask[b, L - n:] = 1
    return ids.cuda(), mask.cuda()


@contextlib.contextmanager
def _spy(monkeypatch):
    """Counts the layer's KDA calls (total), those that reached flashkda's backend (served), per entry
    point, and those the backend handed back to FLA's kernel (handed_back)."""
    counts = {"total": [], "served": [], "handed_back": []}
    with monkeypatch.context() as m:
        chunk_backend, op_backend, _ = integ.registered_backends()
        for module, names, key in ((fla_layer, ("chunk_kda", "fused_recurrent_kda"), "total"),
                                   (chunk_backend, ("chunk_kda",), "served"),
                                   (op_backend, ("fused_recurrent_kda_fwd",), "served"),
                                   (integ, ("_fla_fallback",), "handed_back")):
            for name in names:
                def spy(*args, _orig=getattr(module, name), _name=name, _key=key, **kwargs):
                    counts[_key].append(_name)
                    return _orig(*args, **kwargs)

                m.setattr(module, name, spy)
        yield counts


def _kda64(q, k, v, g, beta, *, A_log=None, dt_bias=None, initial_state=None, output_final_state=False,
           safe_gate=False, **kw):
    """The layer's chunk_kda / fused_recurrent_kda computed by flashkda's recurrence in fp64."""
    d = lambda x: None if x is None else x.double()  # noqa: E731
    o, ht = kda_reference(d(q), d(k), d(v), d(g), d(beta), A_log=d(A_log), dt_bias=d(dt_bias),
                          initial_state=d(initial_state), output_final_state=output_final_state, core="recurrent",
                          **kw)
    return o.to(v.dtype), None if ht is None else ht.float()


def _logits(model, ids, mask):
    return model(ids, attention_mask=mask, use_cache=True).logits[mask.bool()].float()  # valid positions only


@pytest.mark.parametrize("gate", list(GATES))
def test_model_prefill_and_generate_served_and_accurate(monkeypatch, gate):
    model = _model(gate)
    ids, mask = _batch()
    with torch.inference_mode():
        with _spy(monkeypatch) as counts:
            ours = _logits(model, ids, mask)
            out = model.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                                 pad_token_id=0)
        assert out.shape == (len(LENS), max(LENS) + 4)
        for name, served_name in (("chunk_kda", "chunk_kda"), ("fused_recurrent_kda", "fused_recurrent_kda_fwd")):
            total, served = counts["total"].count(name), counts["served"].count(served_name)
            assert total > 0 and served == total, (name, served, total)
        assert not counts["handed_back"]

        monkeypatch.setenv(integ.ENV_VAR, "0")
        with _spy(monkeypatch) as counts:
            fla = _logits(model, ids, mask)
        assert counts["total"] and not counts["served"]

        monkeypatch.setattr(fla_layer, "chunk_kda", _kda64)
        monkeypatch.setattr(fla_layer, "fused_recurrent_kda", _kda64)
        ref = _logits(model, ids, mask)

    assert ours.shape == fla.shape == ref.shape == (sum(LENS), VOCAB)
    for x in (ours, fla, ref):
        assert torch.isfinite(x).all()
    err_ours, err_fla = rel_err(ours, ref), rel_err(fla, ref)
    assert err_ours <= 1.1 * err_fla + 1e-3, (err_ours, err_fla)
    top1 = ref.argmax(-1)
    agree_ours, agree_fla = int((ours.argmax(-1) == top1).sum()), int((fla.argmax(-1) == top1).sum())
    assert agree_ours >= agree_fla - 2, (agree_ours, agree_fla, sum(LENS))


def test_model_trains_on_flashkda(monkeypatch):
    """bench/train_fla_model.py's runs: FLA's KDAForCausalLM (4 layers, hidden 2048, 16 heads x 128,
    packed 8 x 2048 tokens, 30 AdamW steps on bf16) trained with FLA's kernels (two data orders) and
    through flashkda's backend from the same seed, with no switch set: every KDA call of a profiled step runs flashkda's
    kernels and none of FLA's, and the final loss is within FLA's own spread over data orders."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from train_fla_model import train

    monkeypatch.delenv(integ.TRAINING_ENV_VAR, raising=False)  # served by default: a lower-bound gate
    fla0, fla1 = train("0", 0, 30, 4, "lower_bound"), train("0", 1, 30, 4, "lower_bound")
    ours = train("1", 0, 30, 4, "lower_bound")
    assert fla0["calls_served"] == 0 and fla0["fla_kda_kernels"] > 0
    assert ours["calls_served"] == ours["calls_total"] and ours["fla_kda_kernels"] == 0
    for r in (fla0, fla1, ours):
        assert all(torch.isfinite(torch.tensor(r["losses"])))
    assert ours["losses"][-1] < ours["losses"][0]
    spread = abs(fla0["final_loss"] - fla1["final_loss"])
    assert abs(ours["final_loss"] - fla0["final_loss"]) <= spread, (ours["final_loss"], fla0["final_loss"], spread)
