"""The GPT-style decoder training.fsdp trains, the token data it learns, and the arithmetic of
model FLOPs utilisation.

The model is an ordinary nn.Module (pre-norm blocks of causal self-attention and an MLP, learnt
position embeddings, an untied output head): an exported state_dict loads into it in a process
without torch.distributed. Every batch is a pure function of (seed, step): rank r takes the
r-th slice of the step's global batch, so one process and any number of ranks see the same
global batches, and a resumed run, at any world size, continues the same stream.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from torch_multinode.cluster.errors import UserError
from torch_multinode.training.loop.data import _generator

INIT_STD = 0.02  # GPT-2's
MLP_RATIO = 4


@dataclass(frozen=True)
class Shape:
    """The model's sizes."""

    layers: int
    width: int
    heads: int
    seq_len: int
    vocab_size: int

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, shape: Shape):
        super().__init__()
        width = shape.width
        self.heads = shape.heads
        self.attn_norm = nn.LayerNorm(width)
        # No biases in the linear layers (as PaLM and LLaMA): a key's bias would not change the
        # attention at all, and a parameter whose true gradient is zero only moves by AdamW's
        # normalised rounding noise.
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)
        self.mlp_norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, MLP_RATIO * width, bias=False)
        self.out = nn.Linear(MLP_RATIO * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.out(F.gelu(self.fc(self.mlp_norm(x))))


class GPT(nn.Module):
    def __init__(self, shape: Shape, *, activation_checkpointing: bool = False):
        super().__init__()
        self.shape = shape
        self.activation_checkpointing = activation_checkpointing
        self.tokens = nn.Embedding(shape.vocab_size, shape.width)
        self.positions = nn.Embedding(shape.seq_len, shape.width)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.norm = nn.LayerNorm(shape.width)
        self.head = nn.Linear(shape.width, shape.vocab_size, bias=False)
        for name, parameter in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(parameter)
            elif parameter.dim() > 1:
                # GPT-2: the projections into the residual stream scaled by depth
                residual = name.endswith(("proj.weight", "out.weight"))
                std = INIT_STD / math.sqrt(2 * shape.layers) if residual else INIT_STD
                nn.init.normal_(parameter, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (batch, length, vocab) for tokens (batch, length), length <= seq_len."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tokens(tokens) + self.positions(positions)
        for block in self.blocks:
            if self.activation_checkpointing and torch.is_grad_enabled():
                # The block's activations are dropped after forward and recomputed in backward.
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.norm(x))


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of sequences (batch, seq_len + 1)."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


# -- data --------------------------------------------------------------------------------------


class TokenChains:
    """Synthetic sequences with structure to learn: every token has a fixed successor (a
    permutation drawn from the seed) that follows it with probability 1 - noise; otherwise a
    uniformly random token follows. The best possible loss is the entropy of that choice."""

    def __init__(self, vocab_size: int, seq_len: int, noise: float, seed: int):
        self.vocab_size, self.seq_len, self.noise, self.seed = vocab_size, seq_len, noise, seed
        self.successor = torch.randperm(vocab_size, generator=_generator(seed, "successor"))

    def batch(self, step: int, count: int) -> torch.Tensor:
        """Step `step`'s global batch: `count` sequences of seq_len + 1 tokens."""
        generator = _generator(self.seed, "chains", step)
        length = self.seq_len + 1
        tokens = torch.empty(count, length, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab_size, (count,), generator=generator)
        jump = torch.rand(count, length, generator=generator) < self.noise
        random = torch.randint(self.vocab_size, (count, length), generator=generator)
        for position in range(1, length):
            follows = self.successor[tokens[:, position - 1]]
            tokens[:, position] = torch.where(jump[:, position], random[:, position], follows)
        return tokens

    def loss_floor(self) -> float:
        """The entropy (nats) of the next token given the previous one."""
        stay = 1 - self.noise + self.noise / self.vocab_size
        other = self.noise / self.vocab_size
        terms = [stay * math.log(stay)] if stay > 0 else []
        if other > 0:
            terms.append((self.vocab_size - 1) * other * math.log(other))
        return -sum(terms)

    def fingerprint(self) -> str:
        """What every rank must agree on: the chains come from the seed alone."""
        return "synthetic"

    def describe(self) -> str:
        return (
            f"synthetic token chains, vocabulary {self.vocab_size}, noise {self.noise:g} "
            f"(loss floor {self.loss_floor():.3f})"
        )


class CharacterText:
    """A text file as characters: each step's sequences start at random offsets."""

    def __init__(self, path: Path, seq_len: int, seed: int):
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UserError(f"--data {path} does not exist on this node") from None
        except OSError as error:
            raise UserError(f"cannot read --data {path}: {error.strerror}") from None
        except UnicodeDecodeError as error:
            raise UserError(f"--data {path} is not UTF-8 text: {error.reason}") from None
        if len(text) < seq_len + 2:
            raise UserError(
                f"--data {path} holds {len(text)} characters, too few for sequences of "
                f"--seq-len {seq_len} (at least {seq_len + 2})"
            )
        self.path, self.seq_len, self.seed = path, seq_len, seed
        self.characters = "".join(sorted(set(text)))
        index = {character: number for number, character in enumerate(self.characters)}
        self.ids = torch.tensor([index[character] for character in text], dtype=torch.long)
        self.vocab_size = max(2, len(self.characters))
        self.digest = hashlib.sha256(text.encode("utf-8")).hexdigest()

    def fingerprint(self) -> str:
        """What every rank must agree on: the text."""
        return f"{len(self.ids):,} characters, sha256 {self.digest[:12]}"

    def batch(self, step: int, count: int) -> torch.Tensor:
        generator = _generator(self.seed, "text", step)
        starts = torch.randint(len(self.ids) - self.seq_len, (count,), generator=generator)
        return torch.stack([self.ids[start : start + self.seq_len + 1] for start in starts])

    def describe(self) -> str:
        return f"{self.path}: {len(self.ids):,} characters, vocabulary {len(self.characters)}"


def build_data(config) -> TokenChains | CharacterText:
    """The token source of an FSDPConfig."""
    model, data = config.model, config.data
    if data.data:
        return CharacterText(Path(data.data), model.seq_len, config.run.seed)
    return TokenChains(model.vocab_size, model.seq_len, data.noise, config.run.seed)


def rank_slice(tokens: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's part of a global batch: the rank-th of world_size slices, equal, or one row
    apart where the batch does not split evenly (a job continued on fewer ranks than planned)."""
    count = tokens.shape[0]
    return tokens[rank * count // world_size : (rank + 1) * count // world_size]


# -- model FLOPs utilisation -------------------------------------------------------------------

# Dense peak TFLOP/s per GPU (no 2:4 sparsity), per precision: bf16 and fp16 are the tensor
# cores' rate with fp32 accumulation (autocast's and FSDP2's), fp32 the CUDA cores' (PyTorch
# keeps TF32 off for matmuls by default); None where the GPU has no such path (Volta and Turing
# have no bf16 tensor cores). Keyed by the name CUDA reports (torch.cuda.get_device_name, as
# nvidia-smi shows it), normalised (normal_name), and matched exactly: a substring would give
# the RTX A1000 the A100's 312 and the H100 NVL the SXM part's figures. From NVIDIA's own
# figures: the V100 and A100 datasheets, the H100 whitepaper (SXM5 and PCIe at their boost
# clocks), the H100 NVL, H200 and H200 NVL datasheets (their sparse figures halved), the Turing
# (T4), GA102 (RTX 3090) and AD102 (RTX 4090) whitepapers. The RTX 3090 Ti and 4090 D are in no
# whitepaper: their rates are NVIDIA's published shader TFLOP/s and SM counts at the
# whitepapers' per-SM tensor rate (GeForce: fp32 accumulation at half the fp16 rate).
PEAK_TFLOPS: dict[str, dict[str, float | None]] = {
    # Volta, Turing: fp16 tensor cores only
    "Tesla V100-SXM2-16GB": {"bf16": None, "fp16": 125.0, "fp32": 15.7},
    "Tesla V100-SXM2-32GB": {"bf16": None, "fp16": 125.0, "fp32": 15.7},
    "Tesla V100-PCIE-16GB": {"bf16": None, "fp16": 112.0, "fp32": 14.0},
    "Tesla V100-PCIE-32GB": {"bf16": None, "fp16": 112.0, "fp32": 14.0},
    "Tesla T4": {"bf16": None, "fp16": 65.0, "fp32": 8.1},
    # Ampere
    "NVIDIA A100-SXM4-40GB": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "NVIDIA A100-SXM4-80GB": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "NVIDIA A100-PCIE-40GB": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "NVIDIA A100 80GB PCIe": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "NVIDIA GeForce RTX 3090": {"bf16": 71.0, "fp16": 71.0, "fp32": 35.6},
    "NVIDIA GeForce RTX 3090 Ti": {"bf16": 80.0, "fp16": 80.0, "fp32": 40.0},
    # Ada
    "NVIDIA GeForce RTX 4090": {"bf16": 165.2, "fp16": 165.2, "fp32": 82.6},
    "NVIDIA GeForce RTX 4090 D": {"bf16": 147.1, "fp16": 147.1, "fp32": 73.5},
    # Hopper
    "NVIDIA H100 80GB HBM3": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},  # SXM5
    "NVIDIA H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.2},
    "NVIDIA H100 NVL": {"bf16": 835.5, "fp16": 835.5, "fp32": 60.0},
    # The H100 SXM5's compute with more memory (CUDA's name read on one in this project).
    "NVIDIA H200": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},
    "NVIDIA H200 NVL": {"bf16": 835.5, "fp16": 835.5, "fp32": 60.0},
}


def normal_name(device_name: str) -> str:
    """A GPU's name as the peak table keys it: case and spacing aside, and the "NVIDIA " that
    drivers before 2021 left out of GeForce names ("GeForce RTX 3090")."""
    name = " ".join(device_name.split()).casefold()
    return name if name.startswith(("nvidia ", "tesla ")) else f"nvidia {name}"


_PEAKS = {normal_name(name): peaks for name, peaks in PEAK_TFLOPS.items()}


def matmul_parameters(shape: Shape) -> int:
    """Weights that multiply activations: per block qkv (3 w^2), projection (w^2) and MLP
    (8 w^2), and the output head; not the embeddings (looked up), biases or norms."""
    return shape.layers * (4 + 2 * MLP_RATIO) * shape.width**2 + shape.width * shape.vocab_size


def flops_per_token(shape: Shape) -> int:
    """Training FLOPs per token, forward and backward, as PaLM counts model FLOPs (Chowdhery et
    al. 2022, appendix B): 6 per matmul parameter, plus 12 * layers * seq_len * width for the
    attention scores and their weighted sum (causal masking not discounted). Activation
    checkpointing's recomputation is not counted: it is not the model's work."""
    return 6 * matmul_parameters(shape) + 12 * shape.layers * shape.seq_len * shape.width


def peak_tflops(device_name: str, precision: str) -> float | None:
    """The table's dense peak for exactly this GPU at `precision` (bf16, fp16 or fp32), or None
    where the table does not know the GPU, or it has no such path."""
    return _PEAKS.get(normal_name(device_name), {}).get(precision)


def mfu(tokens_per_second_per_gpu: float, shape: Shape, peak: float) -> float:
    """Model FLOPs utilisation: the model's FLOPs per second on one GPU over its peak
    (TFLOP/s)."""
    return tokens_per_second_per_gpu * flops_per_token(shape) / (peak * 1e12)
