"""One typed config per workload: dataclass sections whose fields carry their own documentation.

Precedence, lowest to highest: the defaults written here, then the YAML file given with
`--config` (one mapping per section, e.g. `optim: {lr: 0.05}`), then command-line flags.
Every field is a flag named after it (`global_batch_size` -> `--global-batch-size`), so field
names are unique across the sections of one config.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from torch_multinode.cluster.errors import UserError, printable, shown
from torch_multinode.training.settings.console import ArgumentParser

T = TypeVar("T")

DATASETS = ("synthetic", "cifar10", "imagefolder")
MODELS = ("tiny", "resnet18", "resnet50")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")
COMM_HOOK_CHOICES = (*COMM_HOOKS, "auto")  # auto: timed at start (training.distributed.levers)
SCHEDULES = ("cosine", "constant")
TEST_HOOK = "test hook:"  # a setting whose help starts so is for the tests: hidden from --help
STOP_EXIT_CODE = 75  # --stop-after-step: EX_TEMPFAIL, "try again", which is what resume does


def doc(text: str, default: Any = None, *, choices: tuple[str, ...] | None = None) -> Any:
    """A field documented by `text`, which --help shows."""
    return field(default=default, metadata={"help": text, "choices": choices})


@dataclass
class DataConfig:
    """What the model is trained on."""

    dataset: str = doc(
        "synthetic (built in, learnable), cifar10 (python pickle batches in --data-dir) or "
        "imagefolder (--data-dir with train/ and val/, one folder per class)",
        choices=DATASETS,
        default="synthetic",
    )
    data_dir: str | None = doc("where cifar10 or imagefolder data lives on every node")
    image_size: int = doc("side in pixels of the square images the model sees", default=32)
    num_classes: int = doc("synthetic: number of classes (the others count theirs)", default=10)
    train_samples: int = doc("synthetic: size of the training split", default=4096)
    val_samples: int = doc("synthetic: size of the validation split", default=1024)
    noise: float = doc(
        "synthetic: std of the gaussian noise on each class pattern (higher is harder)",
        default=2.0,
    )
    augment: bool = doc(
        "cifar10/imagefolder: random crop and flip on the train split", default=True
    )
    workers: int = doc(
        "DataLoader worker processes per rank (0 loads in the main process)", default=1
    )


@dataclass
class ModelConfig:
    """The network and the numerics it runs in."""

    model: str = doc(
        "resnet18 or resnet50 (torchvision), or tiny: a small CNN without BatchNorm for tests",
        choices=MODELS,
        default="resnet18",
    )
    sync_bn: bool = doc("convert BatchNorm to SyncBatchNorm (GPU only)", default=False)
    precision: str = doc(
        "auto is bf16 autocast on GPUs that support it and fp32 otherwise; fp16 adds a "
        "GradScaler; bf16 and fp16 need a GPU",
        choices=PRECISIONS,
        default="auto",
    )


@dataclass
class OptimConfig:
    """Batch and optimizer: SGD with momentum, learning rate warmed up linearly, then decayed."""

    global_batch_size: int = doc("samples per step over all ranks; split evenly", default=64)
    lr: float = doc("learning rate", default=0.05)
    momentum: float = doc("SGD momentum", default=0.9)
    weight_decay: float = doc("L2 weight decay", default=5e-4)
    warmup_steps: int = doc("steps over which the learning rate ramps up linearly", default=10)
    schedule: str = doc(
        "after warmup: cosine decay to zero at the last step, or constant",
        choices=SCHEDULES,
        default="cosine",
    )


@dataclass
class DDPConfig:
    """DistributedDataParallel knobs, passed through to torch."""

    bucket_cap_mb: float = doc("gradient bucket size in MB", default=25.0)
    gradient_as_bucket_view: bool = doc(
        "let gradients alias the communication buckets (saves one copy of the gradients)",
        default=False,
    )
    static_graph: bool = doc(
        "promise the set of used parameters never changes between steps", default=False
    )
    comm_hook: str = doc(
        "gradient compression for the all-reduce: none, fp16, bf16 or powersgd; auto times "
        "each for a few steps at start on the real model and link (or reuses a measurement of "
        "the same setup from the run dir, up to a day old) and keeps the fastest",
        choices=COMM_HOOK_CHOICES,
        default="none",
    )
    powersgd_rank: int = doc("powersgd: matrix approximation rank", default=1)
    powersgd_start_step: int = doc(
        "powersgd: plain all-reduce before this step (at least 2)", default=10
    )


@dataclass
class CheckpointConfig:
    """Checkpoints on node-local disks: no shared filesystem is assumed."""

    checkpoint_dir: str | None = doc(
        "node-local directory every rank writes its own checkpoint files to; unset: none"
    )
    checkpoint_every: int = doc("steps between checkpoints (the last step is always saved)", 50)
    keep: int = doc("checkpoints kept per rank, newest first", default=3)
    resume: bool | None = doc(
        "resume from the newest step every rank has; default: resume when the directory "
        "holds checkpoints; --no-resume deletes this rank's checkpoints there and starts over"
    )
    stop_after_step: int | None = doc(
        f"test hook: exit with code {STOP_EXIT_CODE} once this step is done and checkpointed"
    )
    checkpoint_pause_step: int | None = doc(
        "test hook: the checkpoint of this step pauses 120 s between its complete temp file "
        "and the rename (a write to interrupt)"
    )
    checkpoint_pause_rank: int | None = doc(
        "test hook: only this rank pauses in --checkpoint-pause-step (default: every rank; "
        "with FT=1 the job's rank, counted across the groups)"
    )


@dataclass
class RunConfig:
    """Length, seed, logging and outputs."""

    steps: int = doc("optimizer steps to train for", default=60)
    epochs: int | None = doc("train for this many passes over the train split instead of --steps")
    seed: int = doc("seed for weights, data order and synthetic data; same on every rank", 0)
    log_every: int = doc("steps between progress lines", default=5)
    run_dir: str | None = doc(
        "where TensorBoard scalars and profiler traces go; default .runs/<workload>-<run id>"
    )
    tensorboard: bool = doc("write TensorBoard scalars when tensorboard is installed", True)
    profile: bool = doc("record torch.profiler traces of a few steps into <run dir>/profile", False)
    out: str | None = doc("rank 0 writes the final model state_dict here (torch.save)")
    step_delay: float = doc(
        "test hook: seconds every rank sleeps after each step (a slow job to interrupt)", 0.0
    )
    step_delay_rank: int | None = doc(
        "test hook: only this rank sleeps --step-delay (default: every rank; a rank of the "
        "planned world that no longer runs, in a job continued on fewer nodes: none)"
    )
    collective_timeout: float = doc(
        "seconds a collective waits for the other ranks before the job fails (a node or the "
        "network between the nodes lost), from the first step on; torch's own is 10 min for "
        "NCCL, 30 for gloo",
        300.0,
    )
    slow_rank_factor: float = doc(
        "every --log-every steps, warn about a rank whose own time per step (everything but "
        "waiting for the others) exceeds this many times the other ranks' median; 0: never "
        "(nor is the time in collectives measured, from which the launcher names a slow link)",
        1.5,
    )


@dataclass
class TrainConfig:
    """Everything `python -m training.ddp` takes."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)


@dataclass
class ManualDPConfig:
    """Everything `python -m training.manual_dp` takes."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)


def _field_type(hint: Any) -> tuple[type, bool]:
    """(the concrete type, whether None is allowed) of a field annotation."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return args[0], True
    return hint, False


def _sections(config_type: type) -> list[tuple[str, type]]:
    hints = typing.get_type_hints(config_type)
    return [(item.name, hints[item.name]) for item in dataclasses.fields(config_type)]


def _leaves(section_type: type) -> list[tuple[dataclasses.Field, type, bool]]:
    hints = typing.get_type_hints(section_type)
    return [(item, *_field_type(hints[item.name])) for item in dataclasses.fields(section_type)]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _shown(default: Any) -> str:
    if default is None:
        return "unset"
    if isinstance(default, bool):
        return "on" if default else "off"
    return str(default)


def _metavar(item: dataclasses.Field, kind: type) -> str | None:
    if item.metadata["choices"]:
        return None
    if kind is int:
        return "N"
    if kind is float:
        return item.name.split("_")[-1].upper()
    return "DIR" if item.name.endswith("dir") else "PATH"


def build_parser(
    config_type: type, *, prog: str | None = None, description: str = "", epilog: str = ""
):
    parser = ArgumentParser(
        prog=prog,
        description=description,
        epilog=epilog,
        # Only flags actually given appear in the namespace, which is what lets them win over
        # the file without mistaking a default for an explicit choice.
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--config", metavar="YAML", help="settings file; flags given here override it"
    )
    seen: set[str] = set()
    for section, section_type in _sections(config_type):
        group = parser.add_argument_group(section, section_type.__doc__)
        for item, kind, _ in _leaves(section_type):
            if item.name in seen:
                raise AssertionError(f"field {item.name} appears in two sections")
            seen.add(item.name)
            text = f"{item.metadata['help']} (default: {_shown(item.default)})"
            if item.metadata["help"].startswith(TEST_HOOK):
                text = argparse.SUPPRESS  # accepted, but not offered to users in --help
            if kind is bool:
                group.add_argument(
                    _flag(item.name),
                    dest=item.name,
                    action=argparse.BooleanOptionalAction,
                    help=text,
                )
            else:
                group.add_argument(
                    _flag(item.name),
                    dest=item.name,
                    type=kind,
                    choices=item.metadata["choices"],
                    help=text,
                    metavar=_metavar(item, kind),
                )
    return parser


def _check_value(where: str, value: Any, kind: type, optional: bool) -> Any:
    if value is None and optional:
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            raise UserError(f"{where}: {shown(value)} is too large for a float") from None
    if kind is str and isinstance(value, str) and "\x00" in value:
        # Only YAML's "\0" makes one; every path or name with it fails later, on every rank.
        raise UserError(f"{where}: {shown(value)} holds a NUL character")
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    raise UserError(f"{where} must be {kind.__name__}, got {shown(value)}")


def _name(key: Any) -> str:
    """A key of the file as an error line shows it."""
    return printable(key) if isinstance(key, str) else shown(key)


def load_file(config_type: type, path: Path) -> dict[str, dict[str, Any]]:
    """The file's settings, checked against the config's sections and field types."""
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError as error:
        raise UserError(f"cannot read config file {path}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise UserError(f"config file {path} is not UTF-8 text: {error.reason}") from None
    except yaml.YAMLError as error:
        # One line: where and what, not PyYAML's several lines of context.
        mark = getattr(error, "problem_mark", None)
        at = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise UserError(f"{path} is not valid YAML{at}: {problem}") from None
    except RecursionError:  # PyYAML composes nested collections recursively
        raise UserError(f"{path} is nested too deeply to be a config file") from None
    except ValueError as error:  # a date like 2024-02-30, an int of over 4300 digits
        raise UserError(
            f"{path} holds a value YAML cannot read: {str(error).split(';')[0]}"
        ) from None
    if not isinstance(raw, dict):
        raise UserError(f"{path} must hold a mapping of sections, got {type(raw).__name__}")
    sections = dict(_sections(config_type))
    settings: dict[str, dict[str, Any]] = {}
    for section, values in raw.items():
        if section not in sections:
            raise UserError(
                f"{path}: unknown section {shown(section)}", hint=f"one of {', '.join(sections)}"
            )
        if not isinstance(values, dict):
            raise UserError(f"{path}: section {section} must be a mapping")
        leaves = {leaf[0].name: leaf for leaf in _leaves(sections[section])}
        for name, value in values.items():
            if name not in leaves:
                raise UserError(
                    f"{path}: unknown setting {section}.{_name(name)}",
                    hint=f"one of {', '.join(leaves)}",
                )
            item, kind, optional = leaves[name]
            checked = _check_value(f"{path}: {section}.{name}", value, kind, optional)
            allowed = item.metadata["choices"]
            if allowed and checked not in allowed:
                raise UserError(
                    f"{path}: {section}.{name} is {shown(checked)}, not one of {', '.join(allowed)}"
                )
            settings.setdefault(section, {})[name] = checked
    return settings


def parse(config_type: type[T], argv: list[str] | None, **parser_kwargs) -> T:
    """Defaults, overridden by the --config file, overridden by flags."""
    return parse_given(config_type, argv, **parser_kwargs)[0]


def parse_given(
    config_type: type[T], argv: list[str] | None, **parser_kwargs
) -> tuple[T, frozenset[str]]:
    """parse's config, and the names of the fields the user set (by flag or in the file): the
    others hold their defaults."""
    given = vars(build_parser(config_type, **parser_kwargs).parse_args(argv))
    file_settings = load_file(config_type, Path(given.pop("config"))) if "config" in given else {}
    sections = {}
    chosen: set[str] = set()
    for section, section_type in _sections(config_type):
        values = dict(file_settings.get(section, {}))
        names = {item.name for item in dataclasses.fields(section_type)}
        values.update({name: value for name, value in given.items() if name in names})
        chosen.update(values)
        sections[section] = section_type(**values)
    return config_type(**sections), frozenset(chosen)


def batch_fits(global_batch: int, world_size: int) -> None:
    """A global batch the user chose must split evenly over the ranks."""
    if global_batch % world_size:
        raise UserError(
            f"global batch {global_batch} is not divisible by world size {world_size}",
            hint=f"--global-batch-size {max(1, global_batch // world_size) * world_size}",
        )


def fit_batch(optim, given: bool, world_size: int | None) -> None:
    """The global batch made to fit `world_size` ranks (None: not known yet, left as it is): a
    default one rounded down to a multiple of it, at least one per rank, so that every
    workload's defaults run on any number of nodes and processes; one the user chose (`given`)
    refused where it does not split evenly."""
    if world_size is None or world_size < 1:
        return
    if given:
        batch_fits(optim.global_batch_size, world_size)
    else:
        optim.global_batch_size = max(1, optim.global_batch_size // world_size) * world_size


def check(config) -> None:
    """The settings that are wrong whatever the cluster looks like."""
    positive = {
        "--steps": config.run.steps,
        "--epochs": 1 if config.run.epochs is None else config.run.epochs,
        "--global-batch-size": config.optim.global_batch_size,
        "--image-size": config.data.image_size,
        "--log-every": config.run.log_every,
        "--checkpoint-every": config.checkpoint.checkpoint_every,
        "--keep": config.checkpoint.keep,
        "--train-samples": config.data.train_samples,
        "--val-samples": config.data.val_samples,
    }
    ddp = getattr(config, "ddp", None)
    if ddp is not None:
        positive.update(
            {"--bucket-cap-mb": ddp.bucket_cap_mb, "--powersgd-rank": ddp.powersgd_rank}
        )
        if ddp.powersgd_start_step < 2:
            raise UserError("--powersgd-start-step must be at least 2 (torch's PowerSGD needs it)")
        if ddp.comm_hook == "powersgd" and config.model.precision == "fp16":
            # fp16's loss scale overflows now and then by design (GradScaler then skips the
            # step), but PowerSGD's error feedback has already kept inf - inf: every later
            # gradient is NaN, every step skipped, and the run stops learning without a word.
            raise UserError(
                "--comm-hook powersgd cannot go with --precision fp16: an overflowing step "
                "leaves NaN in PowerSGD's error feedback, and every step after it is skipped",
                hint="--precision bf16 (no loss scaling), or --comm-hook fp16 or bf16",
            )
    # float() takes 'nan' and 'inf' from a flag or the file; neither trains anything.
    for section in dataclasses.fields(config):
        values = getattr(config, section.name)
        for item, kind, _ in _leaves(type(values)):
            value = getattr(values, item.name)
            if kind is float and value is not None and not math.isfinite(value):
                raise UserError(f"{_flag(item.name)} must be a finite number, got {value}")
    for flag, value in positive.items():
        if value <= 0:
            raise UserError(f"{flag} must be positive, got {shown(value)}")
    not_negative = {
        "--lr": config.optim.lr,  # torch.optim.SGD refuses negative ones, on every rank
        "--momentum": config.optim.momentum,
        "--weight-decay": config.optim.weight_decay,
        "--noise": config.data.noise,
        "--step-delay": config.run.step_delay,  # time.sleep refuses a negative delay
    }
    for flag, value in not_negative.items():
        if value < 0:
            raise UserError(f"{flag} must be 0 or more, got {value}")
    if not -(2**63) <= config.run.seed < 2**64:
        raise UserError(
            f"--seed {shown(config.run.seed)} is outside what torch.manual_seed takes "
            "(-2**63 to 2**64-1)"
        )
    if config.data.workers < 0:
        raise UserError(f"--workers must be 0 or more, got {shown(config.data.workers)}")
    if config.data.num_classes < 2:
        raise UserError(f"--num-classes must be at least 2, got {shown(config.data.num_classes)}")
    if config.model.sync_bn and ddp is None:
        raise UserError("--sync-bn needs DDP: SyncBatchNorm synchronises through it")
    if not 0 < config.run.collective_timeout <= 86400:
        raise UserError(
            f"--collective-timeout must be above 0 and at most 86400 s, got "
            f"{config.run.collective_timeout}"
        )
    if config.run.slow_rank_factor < 0:
        raise UserError(f"--slow-rank-factor must be 0 or more, got {config.run.slow_rank_factor}")


def check_on_rank(config) -> None:
    """What only the machine a rank runs on can tell (the launcher's machine may have no GPU
    while the nodes do)."""
    import torch  # not at the top: the launcher parses configs on the controller without torch

    if config.model.sync_bn and not torch.cuda.is_available():
        raise UserError("--sync-bn needs GPUs: torch's SyncBatchNorm only runs on CUDA")
