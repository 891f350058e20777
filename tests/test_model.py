import pytest
import torch

from elixir_ray.model.gpt import GPT, GPTConfig, build_gpt
from elixir_ray.model.sizes import MODEL_SIZES, gpt_param_count


@pytest.mark.parametrize("size", list(MODEL_SIZES))
def test_named_sizes_build_on_meta(size):
    model = build_gpt(MODEL_SIZES[size], device="meta")
    assert model.num_parameters() == gpt_param_count(**MODEL_SIZES[size])
    assert model.head.weight is model.wte.weight


def test_headline_sizes():
    billions = {s: gpt_param_count(**MODEL_SIZES[s]) / 1e9 for s in ("gpt-1.5b", "gpt-4b", "gpt-10b")}
    assert billions["gpt-1.5b"] == pytest.approx(1.56, abs=0.01)
    assert billions["gpt-4b"] == pytest.approx(4.24, abs=0.01)
    assert billions["gpt-10b"] >= 10.0
    assert 0.5e6 < gpt_param_count(**MODEL_SIZES["tiny"]) < 1.5e6


def test_activation_checkpointing_gives_same_loss_and_grads():
    torch.manual_seed(0)
    cfg = GPTConfig(d_model=32, n_layers=2, n_heads=2, vocab_size=50, seq_len=16)
    plain = GPT(cfg)
    ckpt = GPT(GPTConfig(**{**cfg.__dict__, "activation_checkpointing": True}))
    ckpt.load_state_dict(plain.state_dict())
    batch = torch.randint(0, 50, (3, 17))
    l1, l2 = plain(batch), ckpt(batch)
    l1.backward()
    l2.backward()
    assert torch.allclose(l1, l2)
    for (n, p1), p2 in zip(plain.named_parameters(), ckpt.parameters()):
        assert torch.allclose(p1.grad, p2.grad, atol=1e-6), n


def test_loss_starts_near_uniform():
    torch.manual_seed(0)
    model = GPT(GPTConfig(d_model=32, n_layers=2, n_heads=2, vocab_size=257, seq_len=16))
    loss = model(torch.randint(0, 257, (4, 17)))
    assert abs(loss.item() - torch.log(torch.tensor(257.0)).item()) < 0.3
