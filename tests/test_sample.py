"""`elixir-ray sample`: text from a checkpoint's model, with the tokenizer its data was made with."""

import pytest
import torch

from elixir_ray.run.resolved import as_config
from elixir_ray.checkpoint import save_checkpoint
from elixir_ray.cli import main
from elixir_ray.data.tokenizer import ByteTokenizer, load_tokenizer
from elixir_ray.errors import ConfigError
from elixir_ray.model.factory import init_reference_model
from elixir_ray.generate import load_checkpoint_model, sample

from conftest import tiny_config


def _checkpoint(tmp_path, model=None, **extra):
    cfg = as_config({**tiny_config("unused.arrow", tmp_path), "model": model or {"n_layers": 2, "seq_len": 16}})
    model = init_reference_model(cfg)
    tensors = {f"model/{k}": v.detach().numpy() for k, v in model.state_dict().items()}
    root = str(tmp_path / "ck")
    save_checkpoint(root, 3, tensors, {"samples_consumed": 24, "config": cfg.to_dict(), "tokenizer": "bytes", **extra})
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


def _word_level(tmp_path):
    """A tokenizer.json of one id per letter (and [UNK], </s>): (its path, its vocabulary)."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {chr(c): i for i, c in enumerate(range(97, 123))} | {"[UNK]": 26, "</s>": 27}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", behavior="isolated")
    tok.save(str(tmp_path / "tokenizer.json"))
    return str(tmp_path / "tokenizer.json"), vocab


def test_the_tokenizer_must_be_the_one_the_data_was_made_with(tmp_path, capsys):
    _, vocab = _word_level(tmp_path)
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


def test_a_rotary_model_gets_the_frequencies_its_state_dict_leaves_out(tmp_path):
    """Llama's rotary frequencies are a non-persistent buffer: loaded weights alone left them as
    whatever memory held."""
    pytest.importorskip("transformers")
    fields = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=257, max_position_embeddings=64)
    root, model = _checkpoint(tmp_path, model={"seq_len": 16, "hf": fields})
    _, _, _, loaded = load_checkpoint_model(root, torch.device("cpu"))
    ids = torch.tensor([[256, 1, 2, 3, 4, 5]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_a_sentencepiece_style_continuation_keeps_its_first_space(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, normalizers

    vocab = {"[UNK]": 0, "</s>": 1, "▁The": 2, "▁cat": 3, "▁sat": 4}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace(prepend_scheme="never")
    tok.decoder = decoders.Metaspace()
    tok.save(str(tmp_path / "tokenizer.json"))
    identity = load_tokenizer(str(tmp_path / "tokenizer.json")).identity
    root, _ = _checkpoint(tmp_path, tokenizer=identity)
    out = sample(root, "The cat", max_tokens=3, tokenizer=str(tmp_path / "tokenizer.json"), device="cpu")
    assert out.tokens > 0 and out.text.startswith(" "), out.text  # " sat", not "sat" run into "cat"


def test_older_checkpoints_are_sampled_with_what_they_say(tmp_path, tiny_dataset):
    cfg = as_config({**tiny_config(tiny_dataset, tmp_path), "model": {"n_layers": 2, "seq_len": 16}})
    model = init_reference_model(cfg)
    tensors = {f"model/{k}": v.detach().numpy() for k, v in model.state_dict().items()}
    old_config = {**cfg.to_dict(), "eval": {"batches": 4}}  # a key a later version dropped: not the model's
    save_checkpoint(str(tmp_path / "a"), 1, tensors, {"samples_consumed": 0, "config": old_config})
    # no tokenizer field: from before datasets came from other tokenizers, so bytes
    assert sample(str(tmp_path / "a"), max_tokens=2, device="cpu").step == 1
    with pytest.raises(ConfigError, match=r"gives tokenizers:sha256:\w+, but the checkpoint was trained on tokens of "
                                          r"bytes"):
        sample(str(tmp_path / "a"), tokenizer=_word_level(tmp_path)[0], device="cpu")
    bad = {**cfg.to_dict(), "model": {**cfg.to_dict()["model"], "n_layer": 2}}
    save_checkpoint(str(tmp_path / "c"), 1, tensors, {"samples_consumed": 0, "config": bad})
    with pytest.raises(ConfigError, match=r"checkpoint .*step-00000001': its run config's model section: .*n_layer"):
        sample(str(tmp_path / "c"), device="cpu")
    # the tokenizer is checked before the model is built: a wrong one is what this checkpoint is told
    with pytest.raises(ConfigError, match=r"trained on tokens of bytes"):
        sample(str(tmp_path / "c"), tokenizer=_word_level(tmp_path)[0], device="cpu")


def test_devices_and_temperatures_that_cannot_sample_are_refused(tmp_path):
    root, _ = _checkpoint(tmp_path)
    for device, match in [("bogus", "is not a device"), ("cuda:7", "CUDA device")]:
        with pytest.raises(ConfigError, match=match):
            sample(root, device=device)
    for t in (float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="--temperature"):
            sample(root, temperature=t, device="cpu")
    assert sample(root, "a", max_tokens=5, temperature=1e-30, device="cpu").text == \
        sample(root, "a", max_tokens=5, temperature=0, device="cpu").text  # the likeliest, no NaN
    with pytest.raises(ConfigError, match="--eos-token is for a --tokenizer file"):
        sample(root, eos_token="</s>", device="cpu")
