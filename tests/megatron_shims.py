"""Test-only shims that let megatron-core 0.16.1 build and train tiny MoE models on a CPU-only
torch over gloo.

Nothing here is part of bagualu2, and nothing here runs on a GPU: Megatron-Core assumes CUDA in
places that have nothing to do with activation provisioning, and the tests work around exactly
those (listed in docs/engines.md):

- the RNG tracker (``model_parallel_cuda_manual_seed`` builds CUDA generator states):
  :func:`use_cpu` installs :class:`CpuRNGTracker`, whose forks keep the CPU generator as
  Megatron's keep the CUDA one (each named state its own, the default one restored after);
- ``torch.cuda.current_device()`` as the device of RoPE frequencies, router buffers,
  tensor-parallel buffers and collective outputs, ``torch.cuda.Stream`` / events / ``stream``
  in the alltoall dispatcher's device-to-host copies, ``torch.cuda.synchronize`` in the
  pipeline's p2p code, and ``device="cuda"`` tensors in the schedules: in those modules only,
  the name ``torch`` is a view of torch whose ``cuda`` has a current device of ``"cpu"``, no-op
  streams and events, and whose tensor factories turn ``device="cuda"`` into cpu;
- the RNG states Megatron's own activation recompute saves and restores
  (``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``, through
  ``torch.cuda.random`` and ``torch.cuda.default_generators``): on the CPU the generator they
  stand for is the CPU one, so they get and set its state;
- the alltoall dispatcher's split sizes: on a GPU its ``maybe_move_tensor_to_cpu`` turns them
  into numpy arrays for ``all_to_all_single``; on a CPU it leaves them as tensors, which
  ``all_to_all_single`` does not take: the dispatcher's copy converts them as the GPU path does.

- not CUDA but Transformer Engine: ``moe_utils.router_gating_linear`` tests
  ``te_general_gemm is not None``, a name 0.16.1 defines only when Transformer Engine imports;
  without it (as here) the name is set to None, which selects its plain ``torch.mm`` path.

Plus configuration, not shims (:func:`cpu_config_options`): ``use_cpu_initialization=True``,
``moe_grouped_gemm=False``, ``gradient_accumulation_fusion=False``, fusions off, the local
(no Transformer Engine) layer spec.
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Any, Dict

import torch

# Modules whose ``torch`` is replaced by the CPU view (each assumes CUDA in one of the ways the
# module note lists).
_CUDA_MODULES = (
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.utils",
    "megatron.core.transformer.utils",
)


class _NoStream:
    """A CUDA stream / event stand-in: work on the CPU is done when the call returns."""

    def wait_stream(self, other: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> "_NoStream":
        return self

    def synchronize(self) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass


_NO_STREAM = _NoStream()


class _CpuCuda:
    """``torch.cuda`` as the listed Megatron modules see it on a CPU-only torch."""

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def synchronize(*args: Any, **kwargs: Any) -> None:
        pass

    @staticmethod
    def Stream(*args: Any, **kwargs: Any) -> _NoStream:  # noqa: N802 (torch's name)
        return _NoStream()

    @staticmethod
    def Event(*args: Any, **kwargs: Any) -> _NoStream:  # noqa: N802
        return _NoStream()

    @staticmethod
    def current_stream(*args: Any, **kwargs: Any) -> _NoStream:
        return _NO_STREAM

    @staticmethod
    def stream(s: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


def _on_cpu(factory: Any) -> Any:
    def make(*args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)
    return make


class _CpuTorch:
    """``torch`` as the listed Megatron modules see it: everything torch has, with ``cuda``
    replaced and ``device="cuda"`` factories made on cpu."""

    cuda = _CpuCuda()
    zeros = staticmethod(_on_cpu(torch.zeros))
    ones = staticmethod(_on_cpu(torch.ones))
    empty = staticmethod(_on_cpu(torch.empty))
    full = staticmethod(_on_cpu(torch.full))
    tensor = staticmethod(_on_cpu(torch.tensor))
    arange = staticmethod(_on_cpu(torch.arange))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class CpuRNGTracker:
    """Megatron's ``CudaRNGStatesTracker`` over the CPU generator: ``add`` seeds a named state,
    ``fork`` runs under it and restores the default state (and saves the named one's progress)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.reset()

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: Dict[str, torch.Tensor] = {}
        self.seeds_: set = set()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> Dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"rng state {name!r} or seed {seed} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise KeyError(f"rng state {name!r} is not added")
        default = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(default)


def _split_sizes_as_numpy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """The alltoall dispatcher's ``maybe_move_tensor_to_cpu`` on a tensor already on the cpu:
    split sizes become numpy arrays, as the GPU path makes them."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def _cpu_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(new_state)


def use_cpu(seed: int = 1234) -> None:
    """Apply the shims (idempotent) and seed Megatron's RNG tracker on the CPU generator, as
    ``model_parallel_cuda_manual_seed(seed)`` would on CUDA (tensor-model-parallel rank 0, expert
    rank offsets as Megatron's). Call after ``initialize_model_parallel``."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    view = _CpuTorch()
    for name in _CUDA_MODULES:
        importlib.import_module(name).torch = view
    importlib.import_module("megatron.core.transformer.moe.token_dispatcher").maybe_move_tensor_to_cpu = \
        _split_sizes_as_numpy
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    mrandom._get_cuda_rng_state = _cpu_rng_state
    mrandom._set_cuda_rng_state = _set_cpu_rng_state

    tracker = CpuRNGTracker()
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    offset = seed + 2718
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    torch.manual_seed(seed)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, offset + tp_rank)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)


def cpu_config_options() -> Dict[str, Any]:
    """TransformerConfig options a CPU run needs (no Transformer Engine, no fused kernels)."""
    return dict(
        use_cpu_initialization=True, moe_grouped_gemm=False, gradient_accumulation_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, moe_permute_fusion=False,
        moe_router_fusion=False, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        deallocate_pipeline_outputs=False)
