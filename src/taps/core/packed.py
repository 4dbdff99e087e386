"""Linear layers whose weights are packed once for the CPU's matmul library (oneDNN), so no
forward repacks them.

Why: on a CPU, `F.linear` hands oneDNN a plain [out, in] weight, and oneDNN reorders it into its
blocked layout on every call. For a decoding step's few rows that reorder is most of a layer's
cost. Packed once, SmolLM2's forwards on a 2-core AMD EPYC (bf16, one thread, after 128 tokens)
took 38.5 / 54.3 ms for 1 / 16 tokens against 56.4 / 79.3 ms, with bit-identical logits; float32
55.9 / 89.8 against 63.5 / 134.4 (docs/long-context.md, session 35). This is what PyTorch's own
compiler does for frozen CPU models (weight prepacking); done here per module, the model stays
the library's and eager.

`pack_linears(model)` turns each `nn.Linear` of a CPU model into a `PackedLinear` in place (the
same object, parameters and ties kept: its dense `weight` stays what every reader reads). The packed
copy serves inference forwards (no gradient wanted) on the CPU in the weight's dtype; anything else
(training through a frozen LM head, another device) runs `F.linear` as before. Its products equal
F.linear's in bf16 on SmolLM2 and differ by rounding in float32 (logits within 6e-5): plain and
speculative decoding both multiply by it, so greedy identity does not depend on it. A weight
changed in place, moved or cast is repacked at its next use (the check is its storage, dtype and
version counter), so a packed copy does not go stale. The one
case it cannot see: a weight made in inference mode has no version counter, so an in-place change
to it (possible only inside inference mode) is not noticed; nothing in TAPS changes weights there.

Sibling layers that multiply the same input (an attention's q / k / v projections, an MLP's gate
and up projections) share one packed copy of their weights stacked: the first of them called on
an input multiplies it by all of them in one call, and the others take their columns of that
product (`SiblingGroup`). One wide multiplication runs faster than two or three narrow ones, the
most at two threads, where a narrow one splits poorly across the cores: SmolLM2's 210 projections
in bf16 took 15.3 / 24.1 ms for 1 / 16 rows at one thread against 17.5 / 26.1 as separate layers,
12.4 / 16.8 at two threads against 15.6 / 20.2, with bit-identical products (docs/long-context.md,
session 40). A sibling called on an input that is not the one the group last multiplied, or
twice on it, multiplies again; an input changed in place between the siblings' calls inside
inference mode is not noticed (as above: nothing in TAPS or the model files does that).

The packed copy costs the weights' memory once more: packing is skipped, with one log line, when
that would take more than half of the memory the system has free.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

log = logging.getLogger(__name__)

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def available() -> bool:
    """Whether this PyTorch build has oneDNN's packed linear (every x86 and Arm CPU build does)."""
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise"))


def _free_bytes() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _weight_key(weight: Tensor) -> tuple:
    """What changes when a weight is changed in place, moved or cast (its packed copy is then stale)."""
    return weight.data_ptr(), weight.dtype, None if weight.is_inference() else weight._version


def _multiply(rows: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:  # [M, in] -> [M, out]
    return torch.ops.mkldnn._linear_pointwise(rows.contiguous(), weight, bias, "none", [], "")


class PackedLinear(nn.Linear):
    """An `nn.Linear` that multiplies by a oneDNN-packed copy of its weight when it can (module
    docstring). Never constructed directly: `pack_linears` converts existing modules."""

    _packed: Tensor | None
    _packed_key: tuple | None
    _group: SiblingGroup | None  # siblings multiplying the same input: their stacked packed copy
    _sibling: int  # this layer's place in _group (its columns of the product)

    def packed_weight(self) -> Tensor:  # opaque oneDNN tensor, [out, in] logically
        key = _weight_key(self.weight)
        if self._packed_key != key:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
            self._packed_key = key
        return self._packed

    def __getstate__(self) -> dict:  # a copy (deepcopy, pickle) repacks at its first use: the opaque
        state = super().__getstate__()  # oneDNN tensor has no storage to copy
        return {**state, "_packed": None, "_packed_key": None}

    def forward(self, x: Tensor) -> Tensor:  # [..., in] -> [..., out]
        # on every call of every layer, so the cheapest checks that keep it exact: an inference
        # forward (no gradient wanted) on the CPU in a packed dtype that is the weight's
        weight = self.weight
        if (x.dtype is not weight.dtype or x.dtype not in PACKED_DTYPES or x.device.type != "cpu"
                or weight.device.type != "cpu" or not x.numel()
                or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
            return F.linear(x, weight, self.bias)
        rows = x.reshape(-1, self.in_features)  # [M, in]
        if self._group is not None:
            out = self._group.columns(self._sibling, x, rows)  # [M, out], a view of the siblings' product
        else:
            out = _multiply(rows, self.packed_weight(), None if self.bias is None else self.bias.detach())
        return out.view(*x.shape[:-1], self.out_features)  # [..., out]


class SiblingGroup:
    """Packed linear layers that multiply the same input, multiplied by their stacked weights in
    one call (module docstring). The product of the last input waits for the siblings that have not
    taken their columns yet; it is dropped once all have, so it keeps neither input nor product alive."""

    def __init__(self, members: list[PackedLinear]):
        self.members = members
        self.sizes = [m.out_features for m in members]
        self._packed: Tensor | None = None
        self._bias: Tensor | None = None
        self._packed_key: tuple | None = None
        self._last: tuple | None = None  # (input, its product split by member, members still to take theirs)

    def packed_weight(self) -> Tensor | None:  # opaque oneDNN tensor, [sum of outs, in] logically
        """None while the members' weights (or biases) differ in dtype or device (one of them cast or
        moved alone): each member then multiplies by its own packed copy."""
        key = tuple((_weight_key(m.weight), None if m.bias is None else _weight_key(m.bias)) for m in self.members)
        if self._packed_key != key:
            tensors = [t for m in self.members for t in (m.weight, m.bias) if t is not None]
            self._packed = self._bias = None
            if len({(t.dtype, t.device) for t in tensors}) == 1:
                with torch.no_grad():
                    self._packed = torch.ops.mkldnn._reorder_linear_weight(
                        torch.cat([m.weight.detach() for m in self.members]), None)
                    biases = [m.bias for m in self.members]
                    self._bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
            self._packed_key = key
        return self._packed

    def columns(self, index: int, x: Tensor, rows: Tensor) -> Tensor:  # [M, in] -> [M, out] of members[index]
        last = self._last  # read once: another thread may replace it
        if last is None or last[0] is not x or index not in last[2]:
            weight = self.packed_weight()
            if weight is None:
                member = self.members[index]
                return _multiply(rows, member.packed_weight(), None if member.bias is None else member.bias.detach())
            product = _multiply(rows, weight, self._bias)  # [M, sum of outs]
            last = (x, product.split(self.sizes, dim=-1), set(range(len(self.members))))
            self._last = last
        last[2].discard(index)
        if not last[2] and self._last is last:
            self._last = None
        return last[1][index]

    def __getstate__(self) -> dict:  # as PackedLinear's: a copy repacks at its first use
        return {**self.__dict__, "_packed": None, "_bias": None, "_packed_key": None, "_last": None}


def linear_of(weight: Tensor, bias: Tensor | None = None) -> nn.Linear:  # weight [out, in], bias [out]
    """A linear layer over existing tensors (no copy of them), packed where `pack_linears` would:
    for a slice of an LM head that a drafter multiplies by at every draft level."""
    layer = nn.Linear(1, 1, bias=False, device="meta")  # no memory; its tensors are replaced
    layer.in_features, layer.out_features = int(weight.shape[1]), int(weight.shape[0])
    layer.weight = nn.Parameter(weight, requires_grad=False)
    layer.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
    pack_linears(layer)
    return layer


def pack_linears(model: nn.Module) -> int:
    """Convert every `nn.Linear` of `model` whose weight is on the CPU in float32 or bf16 into a
    `PackedLinear` (in place); returns how many. 0, with one log line, where this PyTorch has no
    packed linear or the copies would not fit in memory."""
    linears = [m for m in model.modules() if type(m) is nn.Linear
               and m.weight.device.type == "cpu" and m.weight.dtype in PACKED_DTYPES]
    if not linears:
        return 0
    if not available():
        log.info("packed linear weights: this PyTorch has no oneDNN packed linear; using F.linear")
        return 0
    need = sum(m.weight.numel() * m.weight.element_size() for m in {id(m.weight): m for m in linears}.values())
    free = _free_bytes()
    if free is not None and need > free // 2:
        log.warning(f"packed linear weights: skipped (they would take {need / 2**20:.0f} MiB more, "
                    f"{free / 2**20:.0f} MiB is free); decoding runs unpacked, slower on a CPU")
        return 0
    for module in linears:
        module.__class__ = PackedLinear
        module._packed, module._packed_key, module._group = None, None, None
    grouped = _group_siblings(model)
    for module in linears:
        if module._group is None:
            module.packed_weight()  # now, not in the first decoding step
    for group in grouped:
        group.packed_weight()
    return len(linears)


# Sibling layers by name, as the model files of Llama, Qwen2, Mistral (and TAPS's draft heads,
# built from Llama's layer) name them, under a parent of the kind that calls them on one input.
SIBLINGS = {"Attention": ("q_proj", "k_proj", "v_proj"), "MLP": ("gate_proj", "up_proj")}


def _group_siblings(model: nn.Module) -> list[SiblingGroup]:
    """Stack the packed weights of each parent's sibling layers (`SIBLINGS`) where they can be
    stacked: all packed, none grouped yet, one input width, dtype and device, distinct weights,
    all with a bias or none."""
    groups = []
    for parent in model.modules():
        for kind, names in SIBLINGS.items():
            if not type(parent).__name__.endswith(kind):
                continue
            members = [getattr(parent, name, None) for name in names]
            if not all(type(m) is PackedLinear and m._group is None for m in members):
                continue
            weights = [m.weight for m in members]
            if (len({(m.in_features, w.dtype, w.device) for m, w in zip(members, weights)}) != 1
                    or len({w.data_ptr() for w in weights}) != len(weights)
                    or len({m.bias is None for m in members}) != 1):
                continue
            group = SiblingGroup(members)
            for index, m in enumerate(members):
                m._group, m._sibling = group, index
                m._packed, m._packed_key = None, None  # the group's copy replaces theirs
            groups.append(group)
    return groups
