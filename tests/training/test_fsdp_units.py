"""training.fsdp's pieces that need no process group: its arguments, the FLOPs and MFU
arithmetic, the check that --compile can work here, its data; and two short plain runs."""

from __future__ import annotations

import re
import sysconfig
import types

import pytest
import torch

from tests.training.conftest import run_main
from torch_multinode.training import fsdp
from torch_multinode.training.loop import fsdp_report
from torch_multinode.training.modeling import gpt
from torch_multinode.training.settings import compile_check

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


@pytest.mark.parametrize(
    ("name", "bf16", "fp32"),
    [
        # Names as CUDA (torch.cuda.get_device_name) and nvidia-smi report them.
        ("NVIDIA H100 80GB HBM3", 989.4, 66.9),  # SXM5
        ("NVIDIA H100 PCIe", 756.0, 51.2),  # not the SXM's
        ("NVIDIA H100 NVL", 835.5, 60.0),  # not the SXM's either
        ("NVIDIA H200", 989.4, 66.9),  # read on one in this project
        ("NVIDIA H200 NVL", 835.5, 60.0),
        ("NVIDIA A100-SXM4-80GB", 312.0, 19.5),
        ("NVIDIA A100-SXM4-40GB", 312.0, 19.5),
        ("NVIDIA A100 80GB PCIe", 312.0, 19.5),
        ("NVIDIA A100-PCIE-40GB", 312.0, 19.5),
        ("NVIDIA GeForce RTX 3090", 71.0, 35.6),
        ("NVIDIA GeForce RTX 3090 Ti", 80.0, 40.0),  # not the 3090's
        ("NVIDIA GeForce RTX 4090", 165.2, 82.6),
        ("NVIDIA GeForce RTX 4090 D", 147.1, 73.5),  # not the 4090's
        ("GeForce RTX 3090", 71.0, 35.6),  # a driver before 2021 left "NVIDIA " out
        ("  nvidia  h100  pcie ", 756.0, 51.2),  # case and spacing aside
        ("Tesla T4", None, 8.1),  # fp16 tensor cores only
        ("Tesla V100-SXM2-32GB", None, 15.7),
        # Unknown: no figure rather than another GPU's.
        ("NVIDIA RTX A1000", None, None),  # holds "A100"
        ("NVIDIA RTX A100", None, None),
        ("NVIDIA H100", None, None),  # no such name: which H100?
        ("NVIDIA H20", None, None),  # a prefix of H200
        ("NVIDIA H800 PCIe", None, None),
        ("NVIDIA B200", None, None),
        ("NVIDIA GeForce RTX 4090 Laptop GPU", None, None),
    ],
)
def test_the_peak_is_the_gpus_own_matched_by_its_exact_name(name, bf16, fp32):
    assert gpt.peak_tflops(name, "bf16") == bf16
    assert gpt.peak_tflops(name, "fp32") == fp32
    if bf16 is not None:  # fp16 and bf16 run at one rate on Ampere and later
        assert gpt.peak_tflops(name, "fp16") == bf16
    if "T4" in name:
        assert gpt.peak_tflops(name, "fp16") == 65.0


def test_an_unknown_gpu_says_so_and_reports_no_mfu(monkeypatch):
    """training.fsdp's report on a GPU the table does not know (the RTX A1000 is not an A100):
    no MFU figure in the line or the bench row, and --peak-tflops named."""
    from torch_multinode.training.loop.numerics import Numerics

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA RTX A1000")
    config = types.SimpleNamespace(run=types.SimpleNamespace(peak_tflops=None))  # none given
    env = types.SimpleNamespace(device=torch.device("cuda:0"), world_size=1)
    numerics = Numerics(torch.bfloat16, False, True, "bf16")
    row: dict = {}
    lines = fsdp_report.gpu_lines(config, env, GPT2_SMALL, numerics, 1000.0, [2**30], row)
    assert lines[1] == (
        "MFU            unknown: no bf16 peak TFLOP/s known for NVIDIA RTX A1000 (give "
        "--peak-tflops)"
    )
    assert "mfu" not in row
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    lines = fsdp_report.gpu_lines(config, env, GPT2_SMALL, numerics, 1000.0, [2**30], row)
    assert lines[1].startswith("MFU            ") and "of 312 TFLOP/s per GPU at bf16" in lines[1]
    assert row["mfu"] == pytest.approx(1000 * gpt.flops_per_token(GPT2_SMALL) / 312e12)


def test_compile_is_refused_up_front_without_a_cpp_compiler(monkeypatch):
    from torch._inductor import config as inductor

    monkeypatch.setattr(inductor.cpp, "cxx", (None, "/nonexistent/g++"))
    assert compile_check.compile_problem(torch.device("cpu")).line() == (
        "Error: --compile on CPUs needs a C++ compiler to build torch.compile's kernels, and "
        "/nonexistent/g++ does not run here (try apt-get install g++ (or CXX=<compiler>), or "
        "leave out --compile)"
    )


def test_compile_is_refused_up_front_without_pythons_headers(monkeypatch, tmp_path):
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    assert compile_check.compile_problem(torch.device("cpu")).line() == (
        f"Error: --compile needs Python's C headers, and {tmp_path}/Python.h is missing (the "
        "compiled kernels include it) (try apt-get install python3-dev (for this Python), or "
        "leave out --compile)"
    )


def test_compile_on_gpus_is_refused_without_triton_or_a_c_compiler(monkeypatch):
    import torch.utils._triton

    monkeypatch.setattr(torch.utils._triton, "has_triton", lambda: False)
    cuda = torch.device("cuda", 0)  # a device object only: nothing runs on it
    assert "needs triton" in compile_check.compile_problem(cuda).line()
    monkeypatch.setattr(torch.utils._triton, "has_triton", lambda: True)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(compile_check.shutil, "which", lambda name: None)
    assert compile_check.compile_problem(cuda).line() == (
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
