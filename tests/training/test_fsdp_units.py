"""training.fsdp's pieces that need no process group: its arguments, the FLOPs and MFU
arithmetic, the check that --compile can work here, its data; and two short plain runs."""

from __future__ import annotations

import re
import sysconfig

import pytest
import torch

from tests.training.conftest import run_main
from torch_multinode.training import fsdp
from torch_multinode.training.modeling import gpt

GPT2_SMALL = gpt.Shape(layers=12, width=768, heads=12, seq_len=1024, vocab_size=50257)


@pytest.mark.parametrize(
    "argv, error",
    [
        (["--width", "30"], "--width 30 does not split into 4 heads (30 % 4 = 2) (try --width 28)"),
        (["--layers", "0"], "--layers must be at least 1, got 0"),
        (["--vocab-size", "1"], "--vocab-size must be at least 2, got 1"),
        (["--grad-clip", "-1"], "--grad-clip must be at least 0, got -1.0"),
        (["--noise", "1.5"], "--noise is a probability, at most 1, got 1.5"),
        (["--lr", "nan"], "--lr must be a finite number, got nan"),
        (["--peak-tflops", "0"], "--peak-tflops must be positive, got 0.0"),
        (
            ["--strategy", "zero3"],
            "argument --strategy: invalid choice: 'zero3' (choose from 'fsdp', 'ddp') (try --help)",
        ),
        # Checked on the rank: the controller may have no GPU while the nodes do.
        (
            ["--precision", "bf16"],
            "--precision bf16 needs a GPU; this run is on CPU (try --precision fp32)",
        ),
    ],
)
def test_bad_arguments_are_one_error_line_and_exit_2(argv, error, capsys):
    code, out, err = run_main(fsdp.main, argv, capsys)
    assert (code, out, err.splitlines()) == (2, "", [f"Error: {error}"])


def test_a_missing_data_file_is_one_error_line_and_exit_2(python_module, tmp_path):
    run = python_module("training.fsdp", "--data", "missing.txt")
    assert run.returncode == 2, run.explain()
    assert run.stderr.splitlines() == ["Error: --data missing.txt does not exist on this node"]


def test_a_text_file_is_learnt_character_by_character(python_module, tmp_path):
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    run = python_module(
        "training.fsdp",
        *("--data", "text.txt", "--layers", "2", "--width", "32", "--seq-len", "16"),
        *("--global-batch-size", "8", "--lr", "0.01", "--steps", "20", "--log-every", "1"),
        *("--export", "model.pt"),
    )
    assert run.returncode == 0, run.explain()
    assert run.lines("data     ") == ["data     text.txt: 1,800 characters, vocabulary 28"]
    losses = [float(x) for x in re.findall(r"^step +\d+/20  loss ([\d.]+)", run.stdout, re.M)]
    assert len(losses) == 20 and losses[0] > 3.0 and losses[-1] < losses[0] - 1.0
    assert run.lines("world    ") == ["world    1 process (a group of one), cpu"]
    sidecar = (tmp_path / "model.pt.json").read_text()
    assert '"characters": " .abcdefghijklmnopqrstuvwxyz"' in sidecar


def test_model_flops_per_token_count_six_per_matmul_weight_plus_attention():
    # GPT-2 small, untied: 12 blocks of 12 w^2 matmul weights and a 768 x 50257 head.
    assert gpt.matmul_parameters(GPT2_SMALL) == 12 * 12 * 768**2 + 768 * 50257 == 123_532_032
    # PaLM's 6N + 12 L T w: 741,192,192 + 113,246,208
    assert gpt.flops_per_token(GPT2_SMALL) == 854_438_400
    # The count matches the model it describes (embeddings, biases and norms aside).
    model = gpt.GPT(gpt.Shape(layers=2, width=32, heads=4, seq_len=16, vocab_size=64))
    weights = sum(
        module.weight.numel() for module in model.modules() if isinstance(module, torch.nn.Linear)
    )
    assert weights == gpt.matmul_parameters(model.shape)


def test_mfu_is_the_models_flops_per_second_over_the_peak():
    # 100,000 tokens/s on one GPU of GPT-2 small: 85.44 TFLOP/s, of an A100's 312 in bf16.
    assert gpt.mfu(100_000, GPT2_SMALL, 312.0) == pytest.approx(85.44384 / 312, rel=1e-9)
    assert gpt.peak_tflops("NVIDIA GeForce RTX 3090", "bf16") == 71.0
    assert gpt.peak_tflops("NVIDIA GeForce RTX 4090", "fp32") == 82.6
    assert gpt.peak_tflops("NVIDIA A100-SXM4-80GB", "bf16") == 312.0
    assert gpt.peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0  # not the SXM's
    assert gpt.peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert gpt.peak_tflops("NVIDIA H200", "bf16") == 989.4
    assert gpt.peak_tflops("Tesla T4", "bf16") is None


def test_compile_is_refused_up_front_without_a_cpp_compiler(monkeypatch):
    from torch._inductor import config as inductor

    monkeypatch.setattr(inductor.cpp, "cxx", (None, "/nonexistent/g++"))
    assert fsdp.compile_problem(torch.device("cpu")).line() == (
        "Error: --compile on CPUs needs a C++ compiler to build torch.compile's kernels, and "
        "/nonexistent/g++ does not run here (try apt-get install g++ (or CXX=<compiler>), or "
        "leave out --compile)"
    )


def test_compile_is_refused_up_front_without_pythons_headers(monkeypatch, tmp_path):
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    assert fsdp.compile_problem(torch.device("cpu")).line() == (
        f"Error: --compile needs Python's C headers, and {tmp_path}/Python.h is missing (the "
        "compiled kernels include it) (try apt-get install python3-dev (for this Python), or "
        "leave out --compile)"
    )


def test_compile_on_gpus_is_refused_without_triton_or_a_c_compiler(monkeypatch):
    import torch.utils._triton

    monkeypatch.setattr(torch.utils._triton, "has_triton", lambda: False)
    cuda = torch.device("cuda", 0)  # a device object only: nothing runs on it
    assert "needs triton" in fsdp.compile_problem(cuda).line()
    monkeypatch.setattr(torch.utils._triton, "has_triton", lambda: True)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(fsdp.shutil, "which", lambda name: None)
    assert fsdp.compile_problem(cuda).line() == (
        "Error: --compile on GPUs needs a C compiler for triton's launcher ($CC, gcc or clang); "
        "none is installed here (try apt-get install gcc, or leave out --compile)"
    )


def test_every_batch_is_a_function_of_the_seed_and_the_step():
    chains = gpt.TokenChains(vocab_size=64, seq_len=16, noise=0.1, seed=3)
    again = gpt.TokenChains(vocab_size=64, seq_len=16, noise=0.1, seed=3)
    assert torch.equal(chains.batch(7, 8), again.batch(7, 8))
    assert not torch.equal(chains.batch(7, 8), chains.batch(8, 8))
    whole = chains.batch(7, 8)
    halves = [gpt.rank_slice(whole, rank, 2) for rank in (0, 1)]
    assert torch.equal(torch.cat(halves), whole)
    # The chain's structure: about 1 - noise of the tokens follow their successor.
    follows = (chains.successor[whole[:, :-1]] == whole[:, 1:]).float().mean()
    assert 0.8 < follows < 0.97
    # -(q ln q + 63 r ln r), q = 0.9 + 0.1/64 (the successor), r = 0.1/64 (each other token)
    assert chains.loss_floor() == pytest.approx(0.72948, abs=1e-5)
