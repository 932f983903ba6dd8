"""rlt-generate on bad input: one-line errors (exit status 2) or documented behaviour; streaming output; --device."""

from __future__ import annotations

import json

import pytest
import torch

from rlt_scale.config import Config, ModelConfig, config_to_yaml
from rlt_scale.data.tokenizer import ByteTokenizer, train_bpe
from rlt_scale.export import CONFIG_FILE, WEIGHTS_FILE
from rlt_scale.cli.generate import TextStream, main
from rlt_scale.generation import Generator, SamplingConfig
from rlt_scale.model import build_model
from rlt_scale.training.sharded_state import named_weights

EOS = ByteTokenizer.eos_id


def _export(out, ctx, vocab_size: int):
    """A randomly initialised tiny model written the way rlt-export writes one."""
    from safetensors.torch import save_file

    cfg = Config(model=ModelConfig(vocab_size=vocab_size, d_model=16, n_heads=2, n_enc_layers=1, n_dec_layers=1,
                                   window=4, ffn_hidden_size=24))
    cfg.data.path = str(out / "no-data")  # the tokenizer defaults to the byte tokenizer
    torch.manual_seed(0)
    model = build_model(cfg.model, ctx.tp_group)
    out.mkdir()
    save_file({n: t.detach().contiguous() for n, t in named_weights(model).items()}, out / WEIGHTS_FILE)
    (out / CONFIG_FILE).write_text(config_to_yaml(cfg))
    return out


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory, ctx):
    return _export(tmp_path_factory.mktemp("gen") / "export", ctx, vocab_size=260)


def _run(argv) -> int:
    """main's exit status, whether it returns it or argparse exits."""
    try:
        return main([str(a) for a in argv])
    except SystemExit as stop:
        return stop.code


def _error_line(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.out == ""
    last = captured.err.strip().splitlines()[-1]
    assert last.startswith("rlt-generate: error: ") and "Traceback" not in captured.err
    return last


@pytest.fixture
def prompts(monkeypatch):
    """The prompt tensors Generator.prefill receives."""
    seen = []
    prefill = Generator.prefill

    def spy(self, prompt, *args, **kwargs):
        seen.append(prompt[0].tolist())
        return prefill(self, prompt, *args, **kwargs)

    monkeypatch.setattr(Generator, "prefill", spy)
    return seen


# ------------------------------------------------------------------ errors
def test_missing_run_directory_is_a_one_line_error(tmp_path, capsys):
    assert _run([tmp_path / "nope", "--prompt", "a"]) == 2
    line = _error_line(capsys)
    assert str(tmp_path / "nope") in line and "does not exist" in line


def test_directory_with_neither_checkpoint_nor_export_is_a_one_line_error(tmp_path, capsys):
    assert _run([tmp_path, "--prompt", "a"]) == 2
    line = _error_line(capsys)
    assert "no complete checkpoint" in line and WEIGHTS_FILE in line


def test_checkpoint_option_with_an_export_directory_is_refused(export_dir, tmp_path, capsys):
    assert _run([export_dir, "--prompt", "a", "--checkpoint", tmp_path]) == 2
    assert "--checkpoint" in _error_line(capsys)


def test_corrupt_export_is_a_one_line_error(export_dir, tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / CONFIG_FILE).write_text((export_dir / CONFIG_FILE).read_text())
    (broken / WEIGHTS_FILE).write_bytes(b"not safetensors")
    assert _run([broken, "--prompt", "a"]) == 2
    assert WEIGHTS_FILE in _error_line(capsys)


def test_unknown_tokenizer_is_a_one_line_error(export_dir, tmp_path, capsys):
    assert _run([export_dir, "--prompt", "a", "--tokenizer", tmp_path / "tok.json"]) == 2
    assert "tok.json" in _error_line(capsys)


@pytest.mark.parametrize("option, value, expected", [
    ("--max-new-tokens", "-5", ">= 0"),
    ("--top-p", "0", "(0, 1]"),
    ("--top-p", "1.5", "(0, 1]"),
    ("--temperature", "-1", ">= 0"),
    ("--temperature", "nan", ">= 0"),
    ("--top-k", "-1", ">= 0"),
])
def test_out_of_range_sampling_options_are_refused(export_dir, capsys, option, value, expected):
    assert _run([export_dir, "--prompt", "a", option, value]) == 2
    line = _error_line(capsys)
    assert f"argument {option}" in line and expected in line and repr(value) in line


def test_prompt_outside_the_model_vocabulary_is_refused(tmp_path, ctx, capsys):
    small = _export(tmp_path / "small", ctx, vocab_size=23)
    assert _run([small, "--prompt", "abc", "--tokenizer", "byte"]) == 2
    assert "outside the model's vocabulary of 23" in _error_line(capsys)


def test_undecodable_prompt_with_a_bpe_tokenizer_is_refused(export_dir, tmp_path, capsys):
    bpe = train_bpe(["def main(): return 1\n"] * 20, 259, tmp_path / "bpe.json")
    assert _run([export_dir, "--prompt", "ab\udcff\udcfecd", "--tokenizer", bpe.path]) == 2
    line = _error_line(capsys)
    assert "not valid UTF-8" in line and "0xff" in line


# ------------------------------------------------------------------ documented behaviour
def test_max_new_tokens_zero_prints_only_the_prompt(export_dir, capsys, prompts):
    assert _run([export_dir, "--prompt", "hello", "--max-new-tokens", "0"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "hello\n" and "-- 0 tokens" in captured.err
    assert _run([export_dir, "--prompt", "hello", "--max-new-tokens", "0", "--json"]) == 0
    sample = json.loads(capsys.readouterr().out)
    assert sample == {"prompt": "hello", "tokens": [], "text": "", "logprobs": []}
    assert prompts == []  # nothing to sample, so no forward pass


def test_empty_prompt_starts_a_document_from_eos(export_dir, capsys, prompts):
    assert _run([export_dir, "--prompt", "", "--max-new-tokens", "3", "--json"]) == 0
    sample = json.loads(capsys.readouterr().out)
    assert prompts == [[EOS]]
    assert sample["prompt"] == "" and 1 <= len(sample["tokens"]) <= 3


def test_undecodable_prompt_bytes_reach_the_byte_tokenizer_raw(export_dir, capsys, prompts):
    # what Python's argv holds for the shell word $'ab\xff\xfecd'
    assert _run([export_dir, "--prompt", "ab\udcff\udcfecd", "--max-new-tokens", "2"]) == 0
    assert prompts == [[0x61, 0x62, 0xFF, 0xFE, 0x63, 0x64]]
    assert capsys.readouterr().out.startswith("ab\ufffd\ufffdcd")


# ------------------------------------------------------------------ streaming
@pytest.mark.parametrize("every", [1, 5])
def test_text_is_streamed_every_n_tokens_and_equals_the_final_text(export_dir, capsys, monkeypatch, every):
    argv = [export_dir, "--prompt", "x = ", "--max-new-tokens", "24", "--temperature", "1.0", "--seed", "3"]
    assert _run(argv + ["--json"]) == 0
    sample = json.loads(capsys.readouterr().out)
    assert len(sample["tokens"]) > 8

    chunks = []
    step = Generator.step

    def watch(self, tokens, state):  # stdout written since the previous model step
        chunks.append(capsys.readouterr().out)
        return step(self, tokens, state)

    monkeypatch.setattr(Generator, "step", watch)
    assert _run(argv + ["--stream-every", str(every)]) == 0
    chunks.append(capsys.readouterr().out)
    # chunks[i] was written before the step consuming token i: tokens are printed once `every` are sampled
    assert chunks[0].startswith("x = ")
    assert all(i % every == every - 1 for i, c in enumerate(chunks[1:-1], 1) if c)
    assert sum(1 for c in chunks if c) > 4  # text arrives piece by piece, not all at the end
    assert "".join(chunks) == "x = " + sample["text"] + "\n"


def test_stream_every_changes_when_text_is_printed_not_what(export_dir, capsys):
    argv = [export_dir, "--prompt", "x = ", "--max-new-tokens", "40", "--temperature", "1.0", "--seed", "5"]
    outputs = []
    for every in ("1", "7", "16"):
        assert _run(argv + ["--stream-every", every]) == 0
        outputs.append(capsys.readouterr())
    assert len(outputs[0].out) > len("x = \n") and all(o == outputs[0] for o in outputs)
    assert _run(argv + ["--stream-every", "0"]) == 2
    assert "argument --stream-every" in _error_line(capsys)


def test_on_tokens_gets_every_returned_token_in_pieces(export_dir):
    from rlt_scale.export import load_export

    model, _ = load_export(export_dir)
    seen = []
    tokens, logprobs = Generator(model).generate(
        torch.tensor([[1, 2, 3]]), 7, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0),
        on_tokens=lambda t, lp: seen.append((t[0].tolist(), lp[0].tolist())), check_every=3)
    assert [len(t) for t, _ in seen] == [3, 3, 1]
    assert sum((t for t, _ in seen), []) == tokens[0].tolist()
    assert sum((lp for _, lp in seen), []) == logprobs[0].tolist()
    empty, empty_lp = Generator(model).generate(torch.tensor([[1]]), 0)
    assert empty.shape == empty_lp.shape == (1, 0)


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_text_stream_pieces_join_to_the_decoded_text(kind, tmp_path):
    text = "naïve café ≠ 😀 done"
    tokenizer = ByteTokenizer() if kind == "byte" else train_bpe([text] * 5, 270, tmp_path / "bpe.json")
    ids = tokenizer.encode(text) + [0xF0 if kind == "byte" else tokenizer.eos_id]  # a dangling lead byte
    stream = TextStream(tokenizer)
    pieces = [stream.push(i) for i in ids] + [stream.finish()]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces[:-2])  # no character is printed half-done


# ------------------------------------------------------------------ device
def test_device_option_is_documented_and_cpu_samples_as_the_default(export_dir, capsys, monkeypatch):
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--device {auto,cpu,cuda}" in help_text and "cuda if available, else cpu" in help_text

    used = []
    generate = Generator.generate

    def spy(self, prompt, max_new_tokens, cfg, generator, **kwargs):  # where the model, prompt and RNG live
        used.append((next(self.model.parameters()).device, prompt.device, generator.device))
        return generate(self, prompt, max_new_tokens, cfg, generator, **kwargs)

    monkeypatch.setattr(Generator, "generate", spy)
    argv = [export_dir, "--prompt", "ab", "--max-new-tokens", "6", "--temperature", "1.0", "--json"]
    assert _run(argv + ["--device", "cpu"]) == 0
    on_cpu = json.loads(capsys.readouterr().out)
    assert used == [(torch.device("cpu"),) * 3]
    if not torch.cuda.is_available():  # auto is the CPU here, and samples the same
        assert _run(argv) == 0
        assert json.loads(capsys.readouterr().out) == on_cpu


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_a_gpu_is_a_one_line_error(export_dir, capsys):
    assert _run([export_dir, "--prompt", "a", "--device", "cuda"]) == 2
    assert "no CUDA device is available" in _error_line(capsys)


def test_unknown_device_is_refused(export_dir, capsys):
    assert _run([export_dir, "--prompt", "a", "--device", "tpu"]) == 2
    assert "argument --device: invalid choice: 'tpu'" in _error_line(capsys)
