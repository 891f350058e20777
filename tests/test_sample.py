"""`elixir-ray sample`: text from a checkpoint's model, with the tokenizer its data was made with."""

import pytest
import torch

from elixir_ray.api import as_config
from elixir_ray.checkpoint import save_checkpoint
from elixir_ray.cli import main
from elixir_ray.data.tokenizer import ByteTokenizer
from elixir_ray.errors import ConfigError
from elixir_ray.model.factory import init_reference_model
from elixir_ray.sample import sample

from conftest import tiny_config


def _checkpoint(tmp_path, model=None, **extra):
    cfg = as_config({**tiny_config("unused.arrow", tmp_path), "model": model or {"n_layers": 2, "seq_len": 16}})
    model = init_reference_model(cfg)
    tensors = {f"model/{k}": v.detach().numpy() for k, v in model.state_dict().items()}
    root = str(tmp_path / "ck")
    save_checkpoint(root, 3, tensors, {"samples_consumed": 24, "config": cfg.to_dict(), **extra})
    return root, model.eval()


def test_greedy_text_is_the_models_likeliest_tokens_over_a_sliding_window(tmp_path):
    root, model = _checkpoint(tmp_path)
    out = sample(root, "def ", max_tokens=20, temperature=0, device="cpu")
    context = [256] + list(b"def ")
    expected = []
    with torch.no_grad():
        for _ in range(20):
            logits = model.logits(torch.tensor([context[-16:]]))[0, -1]
            logits[257:] = float("-inf")  # the tiny GPT's rows past the byte tokenizer's ids
            nxt = int(logits.argmax())
            if nxt == 256:
                break
            expected.append(nxt)
            context.append(nxt)
    assert out.step == 3 and out.prompt == "def " and out.tokens == len(expected) > 0
    assert out.text == ByteTokenizer().decode(expected) and out.ended == (len(expected) < 20)


def test_sampling_is_seeded(tmp_path):
    root, _ = _checkpoint(tmp_path)
    a, b, c = (sample(root, "x", max_tokens=30, temperature=1.0, top_k=None, seed=s, device="cpu") for s in (1, 1, 2))
    assert a.text == b.text and a.text != c.text
    for kw, match in [({"max_tokens": 0}, "at least 1 token"), ({"temperature": -1.0}, "use 0"),
                      ({"top_k": 0}, "keep at least 1")]:
        with pytest.raises(ConfigError, match=match):
            sample(root, **kw)


def test_the_tokenizer_must_be_the_one_the_data_was_made_with(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {chr(c): i for i, c in enumerate(range(97, 123))} | {"[UNK]": 26, "</s>": 27}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", behavior="isolated")
    tok.save(str(tmp_path / "tokenizer.json"))
    from elixir_ray.data.tokenizer import load_tokenizer

    identity = load_tokenizer(str(tmp_path / "tokenizer.json")).identity
    root, _ = _checkpoint(tmp_path, tokenizer=identity)
    with pytest.raises(ConfigError, match=r"trained on tokens of tokenizers:sha256:\w+: name that tokenizer with "
                                          r"--tokenizer"):
        sample(root)
    with pytest.raises(ConfigError, match=r"gives tokenizers:sha256:\w+, but the checkpoint was trained on tokens of"):
        sample(root, tokenizer=str(tmp_path / "tokenizer.json"), eos_token="[UNK]")
    out = sample(root, "abc", max_tokens=8, tokenizer=str(tmp_path / "tokenizer.json"), device="cpu")
    # the tiny GPT has 257 rows: only the tokenizer's 28 ids may come out
    words = out.text.split()  # this tokenizer decodes each id to one word
    assert out.prompt == "abc" and len(words) == out.tokens > 0 and set(words) <= set(vocab)
    assert main(["sample", root, "--prompt", "ab", "--tokens", "4", "--tokenizer", str(tmp_path / "tokenizer.json"),
                 "--device", "cpu"]) == 0
    shown = capsys.readouterr()
    assert shown.out.startswith("ab") and "(step 3): " in shown.err


def test_the_command_prints_the_prompt_and_its_continuation(tmp_path, capsys):
    root, _ = _checkpoint(tmp_path)
    assert main(["sample", root, "--prompt", "import ", "--tokens", "5", "--temperature", "0", "--device", "cpu"]) == 0
    shown = capsys.readouterr()
    expected = sample(root, "import ", max_tokens=5, temperature=0, device="cpu")
    assert shown.out == "import " + expected.text + "\n"
    assert f"step-00000003 (step 3): {expected.tokens} token(s)" in shown.err
    assert main(["sample", str(tmp_path / "nothing")]) == 2
    assert "no valid checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["sample", root, "--tokens", "0"])


def test_a_hugging_face_checkpoint_is_sampled_through_its_own_forward(tmp_path):
    pytest.importorskip("transformers")
    fields = dict(model_type="gpt2", n_embd=32, n_layer=1, n_head=2, vocab_size=300, n_positions=16)
    root, model = _checkpoint(tmp_path, model={"seq_len": 16, "hf": fields})
    out = sample(root, "ab", max_tokens=30, temperature=0, device="cpu")
    context = [256, 97, 98]
    with torch.no_grad():
        for _ in range(out.tokens):
            logits = model(input_ids=torch.tensor([context[-16:]])).logits[0, -1]
            context.append(int(logits[:257].argmax()))  # ids past the byte tokenizer's are never written
    assert out.text == ByteTokenizer().decode(context[3:]) and out.tokens > 16  # past one window
