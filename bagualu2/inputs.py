"""What users hand bagualu2, checked where it enters: ``enable``'s settings (``Options``, checked
once), models, fixed plans, the tokens per expert gates report, and budgets (resolved to bytes).
Every error names the argument, the gate or the callback, and the bad value."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import torch

from bagualu2.plan.planner import Choice, Plan
from bagualu2.runtime.frame import checked_choices
from bagualu2.runtime.gates import GateSpec
from bagualu2.runtime.recipes import is_plain
from bagualu2.shared import is_region_key


def host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not a POSIX host
        return 16 << 30


def local_processes() -> int:
    """Processes sharing this host's memory: torchrun's LOCAL_WORLD_SIZE, else 1."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def check_int(name: str, value: Any, low: int, also: str = "") -> None:
    """A numeric option: an int (not a bool) of at least ``low``; the error names it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r} must be an int >= {low}{also}")
    if value < low:
        raise ValueError(f"{name}={value} must be >= {low}{also}")


def check_policy(policy: Any, policies: Sequence[str]) -> None:
    """``enable``'s ``policy``: one of ``policies`` by name, a ``Plan`` or a mapping of keys to ``Choice``."""
    if isinstance(policy, str) and policy not in policies:
        raise ValueError(f"policy={policy!r}: use one of {policies} or a fixed Plan / mapping of keys to Choice")
    if not isinstance(policy, (str, Plan, Mapping)):
        raise TypeError(f"policy={policy!r}: use one of {policies} or a fixed Plan / mapping of keys to Choice")


RELEASES = ("reruns", "operators")  # how adaptive releases (``Options.releases``)


@dataclass(frozen=True)
class Options:
    """``enable``'s settings (its ``**options`` but the objects it wires: ``telemetry_path``,
    ``gates``, ``engine``, ``allocator``), as ``enable`` documents them. Checked once, as made:
    an error names the option and its value. Frozen: a provisioner decides with what it was
    enabled with (the budget and a fixed plan are what change, through ``Provisioner``)."""

    on_exceed: str = "record"
    min_bytes: int = 64 << 10
    arena_bytes: Optional[int] = None
    arena_max_bytes: Optional[int] = None
    reserve_bytes: int = 1 << 30
    profile_frames: int = 2
    calibrate_frames: int = 3
    recalibrate_every: int = 0
    margin: float = 0.02
    verify: Optional[str] = None  # None: what ``BAGUALU2_VERIFY`` says, else "off"
    on_mismatch: str = "raise"
    releases: str = "reruns"

    def __post_init__(self) -> None:
        if self.on_exceed not in ("record", "raise"):
            raise ValueError(f"on_exceed={self.on_exceed!r}: use 'record' or 'raise'")
        margin = self.margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0.0 <= margin < 0.5:
            raise ValueError(f"margin={margin!r} must be a number in [0, 0.5)")
        check_int("profile_frames", self.profile_frames, 1)
        check_int("calibrate_frames", self.calibrate_frames, 0)
        check_int("recalibrate_every", self.recalibrate_every, 0, " (0: never)")
        check_int("min_bytes", self.min_bytes, 0)
        check_int("reserve_bytes", self.reserve_bytes, 0)
        arena, most = self.arena_bytes, self.arena_max_bytes
        for name, value in (("arena_bytes", arena), ("arena_max_bytes", most)):
            if value is not None:
                check_int(name, value, 1, " or None")
        if arena is not None and most is not None and most < arena:
            raise ValueError(f"arena_max_bytes={most} must be >= arena_bytes={arena}")
        if self.releases not in RELEASES:
            raise ValueError(f"releases={self.releases!r}: use 'reruns' (rerun whole blocks where the model has "
                             f"them, untraced) or 'operators' (trace, and plan operator by operator)")


def check_materialized(model: torch.nn.Module) -> None:
    """Refuse a model whose parameters hold no data yet: on the meta device, or lazy."""
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if isinstance(p, torch.nn.parameter.UninitializedTensorMixin):
            raise ValueError(f"enable(): {name} is uninitialized (a lazy module): run one forward of the model "
                             f"without bagualu2 to initialize it, then enable")
        if p.device.type == "meta":
            raise ValueError(f"enable(): {name} is on the meta device (no data): materialize the model first "
                             f"(model.to_empty(device=...) and initialize its weights), then enable")


def checked_plan(plan: Mapping[str, Choice], model: torch.nn.Module, compiled: bool = False) -> Dict[str, Choice]:
    """A fixed plan's entries: every choice a ``Choice``, every key of the form
    ``'<module path>:<aten op>:<occurrence>'`` naming a module of ``model`` and an op torch has,
    or ``'<module path>:compiled'`` naming a compiled region (``compiled``: all of ``model`` is
    one, key ``':compiled'``)."""
    import difflib

    from bagualu2.runtime.regions import is_compiled

    choices = checked_choices(plan)
    modules = [name for name, _ in model.named_modules()]
    known = set(modules)
    regions = {name for name, m in model.named_modules() if is_compiled(m) or (not name and compiled)}
    for key in choices:
        if isinstance(key, str) and is_region_key(key):
            if key.partition(":")[0] not in regions:
                raise ValueError(f"plan key {key!r}: the model has no compiled region there (compiled regions: "
                                 f"{sorted(regions) or 'none'}; '<module path>:compiled' names one)")
            continue
        if not isinstance(key, str) or key.count(":") < 2:
            raise ValueError(f"plan key {key!r} is not an operator key '<module path>:<aten op>:<occurrence>' "
                             f"(see Frame.keys_seen or Provisioner.last_plan)")
        path, op, occurrence = key.rsplit(":", 2)
        module = path.partition("#")[0]
        if module not in known:
            hint = difflib.get_close_matches(module, modules, n=1)
            raise ValueError(f"plan key {key!r}: the model has no module {module!r}"
                             + (f" (did you mean {hint[0]!r}?)" if hint else ""))
        namespace, _, rest = op.partition(".")
        name, _, overload = rest.partition(".")
        packet = getattr(getattr(torch.ops, namespace, None), name, None) if name else None
        if packet is None or not hasattr(packet, overload or "default") or not occurrence.partition(".")[0].isdigit():
            raise ValueError(f"plan key {key!r}: {op!r} is not an op torch knows (keys look like "
                             f"'layers.0.attn:aten.mm.default:0')")
    return choices


def checked_counts(counts: Any, what: str, num_experts: Optional[int] = None,
                    limit: Optional[int] = None) -> List[int]:
    """Tokens per expert as reported by ``what`` (a gate's counts_fn, or on_gating): a 1-D
    tensor or sequence of finite non-negative integers, ``num_experts`` long where known, and
    no more token slots than ``limit`` where known; the error names ``what`` and the value."""
    if isinstance(counts, torch.Tensor):
        if counts.dim() != 1:
            raise ValueError(f"{what} returned a tensor of shape {tuple(counts.shape)}: tokens per expert must be "
                             f"1-D [num_experts]")
        if counts.is_floating_point() or counts.is_complex() or counts.dtype == torch.bool:
            raise TypeError(f"{what} returned a {counts.dtype} tensor: tokens per expert must be integers "
                            f"(torch.int64), got {counts.tolist()[:8]}")
        values = counts.tolist()
    elif isinstance(counts, (list, tuple)):
        values = []
        for c in counts:
            if isinstance(c, torch.Tensor) and c.dim() == 0 and not c.is_floating_point():
                c = c.item()
            if isinstance(c, bool) or not isinstance(c, int):
                raise TypeError(f"{what} returned {list(counts)[:8]}: tokens per expert must be integers, got {c!r}")
            values.append(c)
    else:
        raise TypeError(f"{what} returned {counts!r}: it must return tokens per expert, an int64 tensor "
                        f"[num_experts] or a sequence of ints")
    if not values or (num_experts is not None and len(values) != num_experts):
        raise ValueError(f"{what} returned {len(values)} counts {values[:8]}, the gate has "
                         f"{num_experts if num_experts is not None else 'at least 1'} experts")
    low = min(values)
    if low < 0:
        raise ValueError(f"{what} returned a negative count ({low}) in {values[:8]}")
    if limit is not None and sum(values) > limit:
        raise ValueError(f"{what} returned {sum(values)} token slots in all ({values[:8]}), more than the "
                         f"{limit} the gate's tokens times its top-k can route")
    return values


def token_slots(spec: GateSpec, args: tuple) -> Optional[int]:
    """The most token slots a gate can route, where known: the tokens its input holds (the
    rows of a float hidden-state tensor) times its top-k, times the ranks whose tokens its
    experts receive. None for a gate hooked before its module (its input is not the tokens)
    or without a top-k."""
    if not spec.top_k or spec.pre_hook or not args or not isinstance(args[0], torch.Tensor):
        return None
    x = args[0]
    if not x.is_floating_point() or x.dim() < 2:
        return None
    return x.numel() // max(1, x.shape[-1]) * spec.top_k * max(1, spec.ep_size)


def device_of(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def resolve_budget(budget: Union[str, int, float, None], device: torch.device, reserve: int,
                   whole: bool = False) -> Optional[int]:
    if isinstance(budget, bool):
        raise TypeError(f"budget must be 'auto', an int of bytes or a float fraction, got {budget!r}")
    if budget is None:
        return None
    if isinstance(budget, str):
        if budget != "auto":
            raise ValueError(f"budget={budget!r}: use 'auto', an int of bytes or a float in (0, 1]")
        if device.type != "cuda":
            return None  # no device limit on CPU: nothing to hold to
        free, total = torch.cuda.mem_get_info(device)
        # A whole-memory budget (an allocator view) counts what is allocated already itself.
        return max(0, total - (0 if whole else torch.cuda.memory_allocated(device)) - reserve)
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"budget={budget} as a fraction must be in (0, 1]; pass bytes as an int")
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
        else:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return int(total * budget)
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"budget={budget} bytes must be positive")
        return budget
    raise TypeError(f"budget must be 'auto', an int of bytes or a float fraction, got {type(budget).__name__}")


def input_bytes(args: tuple, kwargs: dict) -> int:
    """Bytes of the distinct storages of a forward's tensor arguments."""
    # Most forwards take tensors only, positionally: no tree to flatten (a provisioned forward
    # under a budget asks at every micro-batch).
    plain = not kwargs and all(type(a) is torch.Tensor for a in args)
    leaves = args if plain else torch.utils._pytree.tree_leaves((args, kwargs))
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                for t in leaves if isinstance(t, torch.Tensor) and is_plain(t)}
    return sum(storages.values())
