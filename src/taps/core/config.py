"""Plain configuration dataclasses shared by the decoder, the CLI and the trainer, and the names
the CLI shows without loading the pipeline (torch-free)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace

# --device values (checked by the CLI when parsed and by Target.load): auto, cpu, cuda, cuda:N, mps, xpu
DEVICE_PATTERN = r"auto|(cpu|cuda|mps|xpu)(:[0-9]+)?"
STUDY_STAGES = ("target", "drafters", "eval", "report")  # taps reproduce --stages, in order (taps.study)
DEMO_OUT = "runs/demo-study"  # taps demo's default directory (taps.study.run_demo)
SEED_LIMIT = 2 ** 63  # seeds are integers in [0, SEED_LIMIT): torch.manual_seed and numpy take them all


def setting(default, help: str = "", *, flag: str | None = None, choices: Sequence[str] | None = None,
            at_least: int | None = None, metavar: str | None = None):
    """A field of a settings dataclass that is also a command-line option, declared once:
    cli/args.add_settings makes the option from the field's name, type and default and these
    (the help, the flag where it is not --FIELD-NAME, the choices, the lowest integer)."""
    return field(default=default, metadata={"option": {"help": help or None, "flag": flag, "choices": choices,
                                                        "at_least": at_least, "metavar": metavar}})



def check_at_least(settings) -> None:
    """Refuse a settings dataclass whose integer settings fall below their declared `at_least`
    (the bound the command line already puts on the option), naming the first such field: the
    same check for a library caller as for the CLI."""
    for f in fields(settings):
        option = f.metadata.get("option", {})
        low, value = option.get("at_least"), getattr(settings, f.name)
        if low is not None and value is not None and value < low:
            flag = option.get("flag") or "--" + f.name.replace("_", "-")
            raise ValueError(f"{f.name} must be >= {low}, got {value} (option {flag})")

@dataclass(frozen=True)
class TreeConfig:
    """Shape of an EAGLE-2 dynamic draft tree (docs/spec.md, "Draft trees").

    total_tokens counts the root, so a tree has at most total_tokens - 1 draft nodes;
    depth is the number of draft levels below the root; top_k the beam width and branching.
    depth must stay below total_tokens: a tree of total_tokens - 1 nodes reaches at most that
    many levels, so a deeper setting only drafts levels that are never verified.
    """

    total_tokens: int = 60
    depth: int = 5
    top_k: int = 10

    def __post_init__(self) -> None:
        for name in ("total_tokens", "depth", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{name} must be a positive integer, got {value!r} (option {flag})")
        if self.depth >= self.total_tokens:
            raise ValueError(f"depth must be below total_tokens (the root plus one node per level), got depth "
                             f"{self.depth} and total_tokens {self.total_tokens} (options --depth {self.depth}, "
                             f"--total-tokens {self.total_tokens})")


TREE_MODES = ("fixed", "auto")
FIXED_TREE = TreeConfig(60, 5, 10)  # the paper's total tokens / depth / top-k
AUTO_TREE_CAPS = TreeConfig(96, 8, 8)  # tree mode auto: the largest tree it may choose


@dataclass(frozen=True)
class SpeculationConfig:
    """How the drafters' trees are shaped, in one object for the CLI (`--tree`, `--total-tokens`,
    `--depth`, `--top-k`), study configs (`eval.tree`), `taps eval`, `taps serve` and library
    callers, so the defaults and the checks are the same wherever a run starts (vLLM keeps these
    in its SpeculativeConfig).

    mode fixed: every step drafts `tree`. mode auto: each step chooses the depth and size that
    maximise expected tokens/s from this machine's measured costs (drafter/auto_tree.py), and
    `tree` holds the caps. `of` fills what the caller left out from the mode's defaults; the
    cost-aware policy itself is built in one place, profile.tree_policy.
    """

    tree: TreeConfig = FIXED_TREE  # the shape (mode auto: its caps)
    mode: str = "fixed"  # one of TREE_MODES

    def __post_init__(self) -> None:
        if self.mode not in TREE_MODES:
            raise ValueError(f"mode must be fixed or auto, got {self.mode!r} (option --tree)")
        if not isinstance(self.tree, TreeConfig):
            raise ValueError(f"tree must be a TreeConfig, got {type(self.tree).__name__}")

    @classmethod
    def of(cls, mode: str = "fixed", total_tokens: int | None = None, depth: int | None = None,
           top_k: int | None = None) -> "SpeculationConfig":
        """The settings of `mode` with the given shape values, the others from the mode's defaults
        (fixed: the paper's 60/5/10; auto: the caps 96/8/8)."""
        if mode not in TREE_MODES:
            raise ValueError(f"mode must be fixed or auto, got {mode!r} (option --tree)")
        given = {"total_tokens": total_tokens, "depth": depth, "top_k": top_k}
        defaults = AUTO_TREE_CAPS if mode == "auto" else FIXED_TREE
        return cls(replace(defaults, **{k: v for k, v in given.items() if v is not None}), mode)

    @property
    def auto(self) -> bool:
        return self.mode == "auto"

    def describe(self) -> str:
        """One phrase for plans and summaries: `60/5/10` or `auto, caps 96/8/8`."""
        shape = f"{self.tree.total_tokens}/{self.tree.depth}/{self.tree.top_k}"
        return f"auto, caps {shape}" if self.auto else shape

    def as_config(self) -> dict:
        """The `eval.tree` mapping of a study config that reads back as these settings."""
        return {**asdict(self.tree), "mode": self.mode}


@dataclass(frozen=True)
class SamplingConfig:
    """How the target's next-token distribution is formed. temperature 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filter

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):  # nan compares false both ways
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class DecodeConfig:
    """What one call of `generate` does."""

    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    trace: bool = False  # record taps.core.trace.StepTrace per step (confidences, entropies); its cost is not timed

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
