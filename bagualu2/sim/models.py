"""Model presets and the analytic per-operator activation model of the simulator.

A model is data (:class:`ModelSpec`); what one pipeline *unit* (a transformer layer, the
embedding, the loss head) saves for backward and costs in forward comes from :data:`OP_TABLE`,
the one table of operator names the simulator uses. Names follow the runtime's short op
names; the runtime's full key is ``"<module path>:<aten op>:<occurrence>"`` (for example
``"layers.3.mlp.experts.5:aten.mm.default:0"``), the simulator's key is
``"<unit index>.<op name>"`` (for example ``"7.moe.expert.fc1"``).

Operator table (per micro-batch, per device; ``T`` = tokens of the micro-batch on this device
= mbs * seq / tp, ``R`` = routed token copies received by the most loaded expert-parallel rank
= T * top_k * load, ``h`` hidden size, ``H`` attention heads / tp; every op saves the tensor
listed, in bf16 unless said; recomputing it reruns the producer op named in "regen"):

=================  ===========  =========================================  ==================
op                 class        saved for backward                         regen (producer)
=================  ===========  =========================================  ==================
embed.lookup       memory       token ids (int64)                          -- (never released)
attn.norm          memory       layer input x [T, h]                       -- (checkpoint edge)
attn.qkv           matmul       norm output [T, h] (+ MLA latents)         attn.norm
attn.core          attention    q, k, v [T, H, dqk|dqk|dv]                 attn.qkv
attn.out           matmul       attention output [T, H*dv] (+ lse fp32)    attn.core
mlp.norm/moe.norm  memory       residual after attention [T, h]            attn.out
mlp.fc1            matmul       norm output [T, h]                         mlp.norm
mlp.act            memory       fc1 output [T, 2*ffn] (SwiGLU input)       mlp.fc1
mlp.fc2            matmul       act output [T, ffn]                        mlp.act
moe.router         matmul       norm output [T, h] + logits fp32 [T, E]    moe.norm
moe.permute        memory       routing map + probs [T, k] (int64, fp32)   moe.router
moe.dispatch       network      -- (all-to-all; nothing saved)             --
moe.expert.fc1     matmul       dispatched tokens [R, h]                   moe.dispatch
moe.expert.act     memory       fc1 output [R, 2*ffn_e]                    moe.expert.fc1
moe.expert.fc2     matmul       act output [R, ffn_e]                      moe.expert.act
moe.combine        network      expert outputs [R, h] (for prob grads)     moe.expert.fc2
moe.shared.fc1     matmul       -- (input is moe.router's saved tensor)    --
moe.shared.act     memory       fc1 output [T, 2*ffn_s]                    moe.shared.fc1
moe.shared.fc2     matmul       act output [T, ffn_s]                      moe.shared.act
head.norm          memory       final hidden [T, h]                        -- (checkpoint edge)
head.logits        matmul       norm output [T, h]                         head.norm
head.loss          memory       logits fp32 [T, V/tp]                      head.logits
=================  ===========  =========================================  ==================

Only ``moe.expert.*`` and ``moe.dispatch``/``moe.combine`` scale with the routed load; the
rest scale with ``T``. A multi-token-prediction (MTP) unit is a MoE layer followed by a head.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

__all__ = [
    "BF16",
    "MODEL_PRESETS",
    "ModelSpec",
    "OP_CLASSES",
    "OP_TABLE",
    "OpSpec",
    "UnitOps",
    "describe_models",
    "get_model",
    "unit_ops",
]

BF16 = 2
OP_CLASSES = ("matmul", "attention", "memory", "network")


@dataclass(frozen=True)
class OpSpec:
    """One operator of a pipeline unit, per micro-batch and device.

    Attributes:
        name: short operator name (a row of :data:`OP_TABLE`).
        op_class: ``matmul`` | ``attention`` | ``memory`` | ``network``.
        saved_fixed: saved bytes that do not depend on the routed load.
        saved_per_load: saved bytes per unit of load (routed ops; 0 otherwise).
        work_fixed: forward work independent of load (FLOPs, bytes moved, or bytes sent).
        work_per_load: forward work per unit of load.
        regen: name of the op whose forward recomputes the saved tensor ("" = not recomputable).
        releasable: whether the planner may release the saved tensor at all.
    """

    name: str
    op_class: str
    saved_fixed: float
    saved_per_load: float
    work_fixed: float
    work_per_load: float
    regen: str = ""
    releasable: bool = True


# name -> (class, regen) : the single table of operator names (documented above).
OP_TABLE: Dict[str, Tuple[str, str]] = {
    "embed.lookup": ("memory", ""),
    "attn.norm": ("memory", ""),
    "attn.qkv": ("matmul", "attn.norm"),
    "attn.core": ("attention", "attn.qkv"),
    "attn.out": ("matmul", "attn.core"),
    "mlp.norm": ("memory", "attn.out"),
    "mlp.fc1": ("matmul", "mlp.norm"),
    "mlp.act": ("memory", "mlp.fc1"),
    "mlp.fc2": ("matmul", "mlp.act"),
    "moe.norm": ("memory", "attn.out"),
    "moe.router": ("matmul", "moe.norm"),
    "moe.permute": ("memory", "moe.router"),
    "moe.dispatch": ("network", ""),
    "moe.expert.fc1": ("matmul", "moe.dispatch"),
    "moe.expert.act": ("memory", "moe.expert.fc1"),
    "moe.expert.fc2": ("matmul", "moe.expert.act"),
    "moe.combine": ("network", "moe.expert.fc2"),
    "moe.shared.fc1": ("matmul", ""),
    "moe.shared.act": ("memory", "moe.shared.fc1"),
    "moe.shared.fc2": ("matmul", "moe.shared.act"),
    "head.norm": ("memory", ""),
    "head.logits": ("matmul", "head.norm"),
    "head.loss": ("memory", "head.logits"),
}


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, dense and/or MoE, as data.

    Attributes:
        name: preset name.
        hidden: model width ``h``.
        layers: transformer layers (excluding MTP).
        dense_layers: the first ``dense_layers`` layers use a dense FFN.
        vocab: vocabulary size.
        heads: attention heads; kv_heads: key/value heads (GQA; ignored with MLA).
        head_dim: per-head dim for GQA attention.
        q_lora, kv_lora, qk_nope, qk_rope, v_head: MLA dims (``kv_lora > 0`` selects MLA).
        dense_ffn: FFN width of dense layers.
        experts, shared_experts, top_k, expert_ffn: MoE shape (expert_ffn per expert).
        mtp_layers: multi-token-prediction units (each a MoE layer plus a head).
        embed_units: True when embedding and loss head occupy pipeline units of their own
            (Megatron's account-for-embedding/loss-in-pipeline-split); otherwise they ride on
            the first / last transformer layer.
        seq: default sequence length; source: where the shape comes from.
    """

    name: str
    hidden: int
    layers: int
    dense_layers: int
    vocab: int
    heads: int
    kv_heads: int = 0
    head_dim: int = 128
    q_lora: int = 0
    kv_lora: int = 0
    qk_nope: int = 128
    qk_rope: int = 64
    v_head: int = 128
    dense_ffn: int = 0
    experts: int = 0
    shared_experts: int = 0
    top_k: int = 1
    expert_ffn: int = 0
    mtp_layers: int = 0
    embed_units: bool = True
    seq: int = 4096
    source: str = ""

    @property
    def mla(self) -> bool:
        """Whether attention is multi-head latent attention (DeepSeek-V2/V3)."""
        return self.kv_lora > 0

    def unit_kinds(self) -> List[str]:
        """Kinds of the pipeline units in order: embed, dense, moe, mtp, head."""
        kinds: List[str] = ["embed"] if self.embed_units else []
        for i in range(self.layers):
            kinds.append("dense" if i < self.dense_layers or self.experts == 0 else "moe")
        kinds += ["mtp"] * self.mtp_layers
        if self.embed_units:
            kinds.append("head")
        return kinds

    @property
    def units(self) -> int:
        """Number of pipeline units (what PP x VPP must divide)."""
        return len(self.unit_kinds())

    # -- parameters ------------------------------------------------------------------------------
    def attn_params(self) -> int:
        """Parameters of one attention block (projections + norm)."""
        h = self.hidden
        if self.mla:
            dqk = self.qk_nope + self.qk_rope
            q = (h * self.q_lora + self.q_lora * self.heads * dqk if self.q_lora
                 else h * self.heads * dqk)
            kv = (h * (self.kv_lora + self.qk_rope)
                  + self.kv_lora * self.heads * (self.qk_nope + self.v_head))
            return q + kv + self.heads * self.v_head * h + h
        kvh = self.kv_heads or self.heads
        return h * self.head_dim * (self.heads + 2 * kvh) + self.heads * self.head_dim * h + h

    def expert_params(self) -> int:
        """Parameters of one routed (or shared) expert (SwiGLU)."""
        return 3 * self.hidden * self.expert_ffn

    def params(self) -> Dict[str, int]:
        """Parameter counts: ``dense`` (replicated over EP), ``expert`` (sharded over EP),
        ``embed`` (embedding + untied head) and ``total`` (MTP excluded, as usually quoted);
        ``active`` = parameters touched per token."""
        h = self.hidden
        n_moe = sum(1 for k in self.unit_kinds() if k == "moe")
        n_dense = self.layers - n_moe
        dense_ffn = 3 * h * self.dense_ffn + h
        moe_dense = self.shared_experts * self.expert_params() + h * self.experts + h
        dense = (n_dense * (self.attn_params() + dense_ffn)
                 + n_moe * (self.attn_params() + moe_dense))
        expert = n_moe * self.experts * self.expert_params()
        embed = 2 * self.vocab * h
        active = dense + n_moe * self.top_k * self.expert_params() + embed
        return {"dense": dense, "expert": expert, "embed": embed,
                "total": dense + expert + embed, "active": active}


@dataclass(frozen=True)
class UnitOps:
    """The operators of one pipeline unit kind, for a given layout (per device)."""

    kind: str
    ops: Tuple[OpSpec, ...]

    def saved_bytes(self, load: float) -> float:
        """Bytes saved for backward by one micro-batch at this routed load, all kept."""
        return sum(o.saved_fixed + o.saved_per_load * load for o in self.ops)


def unit_ops(model: ModelSpec, kind: str, mbs: int, seq: int, tp: int) -> UnitOps:
    """Per-device operators of one unit ``kind`` for micro-batch ``mbs`` x ``seq`` at TP ``tp``.

    Work units: FLOPs for matmul/attention, bytes moved through device memory for memory ops,
    bytes sent per device for network ops (dispatch/combine all-to-all). Load enters linearly:
    at load ``f`` the most loaded expert-parallel rank receives ``T * top_k * f`` token copies.
    """
    h = model.hidden
    T = mbs * seq / tp
    H = model.heads / tp
    ops: List[OpSpec] = []

    def add(name: str, saved: float, work: float, saved_l: float = 0.0, work_l: float = 0.0,
            releasable: bool = True) -> None:
        cls, regen = OP_TABLE[name]
        ops.append(OpSpec(name, cls, float(saved), float(saved_l), float(work), float(work_l),
                          regen, releasable and bool(regen)))

    def attention() -> None:
        add("attn.norm", T * h * BF16, 2 * T * h * BF16, releasable=False)
        if model.mla:
            dqk = model.qk_nope + model.qk_rope
            latents = T * (model.q_lora + model.kv_lora + model.qk_rope) * BF16
            flops = 2 * T * (h * model.q_lora + model.q_lora * model.heads * dqk
                             + h * (model.kv_lora + model.qk_rope)
                             + model.kv_lora * model.heads * (model.qk_nope + model.v_head)) / tp
            add("attn.qkv", T * h * BF16 + latents, flops)
            qkv = T * H * (2 * dqk + model.v_head) * BF16
            core = T * seq * H * (dqk + model.v_head)  # causal: half of 2*(QK^T + AV)
            dv = model.v_head
        else:
            kvh = (model.kv_heads or model.heads) / tp
            d = model.head_dim
            add("attn.qkv", T * h * BF16, 2 * T * h * (H + 2 * kvh) * d)
            qkv = T * (H + 2 * kvh) * d * BF16
            core = T * seq * H * 2 * d
            dv = d
        add("attn.core", qkv, core)
        add("attn.out", T * H * dv * BF16 + T * H * 4, 2 * T * H * dv * h)

    if kind == "embed":
        add("embed.lookup", T * 8, T * h * BF16, releasable=False)
    elif kind in ("dense", "moe", "mtp"):
        attention()
        if kind == "dense":
            f = model.dense_ffn / tp
            add("mlp.norm", T * h * BF16, 2 * T * h * BF16)
            add("mlp.fc1", T * h * BF16, 2 * T * h * 2 * f)
            add("mlp.act", T * 2 * f * BF16, 3 * T * f * BF16)
            add("mlp.fc2", T * f * BF16, 2 * T * f * h)
        else:
            k, fe = model.top_k, model.expert_ffn
            R = T * k  # token copies at load 1.0
            add("moe.norm", T * h * BF16, 2 * T * h * BF16)
            add("moe.router", T * h * BF16 + T * model.experts * 4, 2 * T * h * model.experts)
            add("moe.permute", T * k * 12, 2 * R * h * BF16)
            add("moe.dispatch", 0, 0, work_l=R * h * BF16, releasable=False)
            add("moe.expert.fc1", 0, 0, saved_l=R * h * BF16, work_l=2 * R * h * 2 * fe)
            add("moe.expert.act", 0, 0, saved_l=R * 2 * fe * BF16, work_l=3 * R * fe * BF16)
            add("moe.expert.fc2", 0, 0, saved_l=R * fe * BF16, work_l=2 * R * fe * h)
            add("moe.combine", 0, 0, saved_l=R * h * BF16, work_l=R * h * BF16)
            if model.shared_experts:
                fs = model.shared_experts * fe
                add("moe.shared.fc1", 0, 2 * T * h * 2 * fs, releasable=False)
                add("moe.shared.act", T * 2 * fs * BF16, 3 * T * fs * BF16)
                add("moe.shared.fc2", T * fs * BF16, 2 * T * fs * h)
        if kind == "mtp":
            kind_head(add, model, T, tp)
    elif kind == "head":
        kind_head(add, model, T, tp)
    else:
        raise ValueError(f"unknown unit kind {kind!r}; expected embed, dense, moe, mtp or head")
    return UnitOps(kind, tuple(ops))


def kind_head(add, model: ModelSpec, T: float, tp: int) -> None:  # noqa: ANN001 - local helper
    """Append the loss-head operators (final norm, logits matmul, fp32 loss) via ``add``."""
    h, V = model.hidden, model.vocab / tp
    add("head.norm", T * h * BF16, 2 * T * h * BF16, releasable=False)
    add("head.logits", T * h * BF16, 2 * T * h * V)
    add("head.loss", T * V * 4, 3 * T * V * 4)


_DSV3 = dict(hidden=7168, layers=61, dense_layers=3, vocab=129280, heads=128, q_lora=1536,
             kv_lora=512, qk_nope=128, qk_rope=64, v_head=128, dense_ffn=18432, experts=256,
             shared_experts=1, top_k=8, expert_ffn=2048, mtp_layers=1, embed_units=True, seq=4096)
_DSV3_SRC = "DeepSeek-V3 technical report (arXiv:2412.19437) and its config.json"

MODEL_PRESETS: Dict[str, ModelSpec] = {
    "deepseek-v3-671b": ModelSpec(name="deepseek-v3-671b", source=_DSV3_SRC, **_DSV3),
    # Scalings of DeepSeek-V3 (same layer shapes, fewer / more routed experts) spanning the
    # 188B .. 1.04T range of the BaGuaLu-2 evaluation.
    "deepseek-v3-188b": ModelSpec(name="deepseek-v3-188b",
                                  source=_DSV3_SRC + "; scaled to 64 routed + 4 shared "
                                  "experts, top-6",
                                  **{**_DSV3, "experts": 64, "shared_experts": 4, "top_k": 6}),
    "deepseek-v3-1.04t": ModelSpec(name="deepseek-v3-1.04t",
                                   source="Kimi K2 (DeepSeek-V3 architecture scaled to 384 "
                                   "experts, 64 heads, 1 dense layer; "
                                   "moonshotai/Kimi-K2-Instruct config.json); "
                                   "counts 1.03T here, DeepSeek-V3's MTP unit kept",
                                   **{**_DSV3, "experts": 384, "heads": 64, "dense_layers": 1,
                                      "vocab": 163840}),
    "mixtral-8x7b": ModelSpec(name="mixtral-8x7b", hidden=4096, layers=32, dense_layers=0,
                              vocab=32000, heads=32, kv_heads=8, head_dim=128, experts=8,
                              shared_experts=0, top_k=2, expert_ffn=14336, embed_units=False,
                              seq=4096,
                              source="Mixtral of Experts (arXiv:2401.04088), config.json"),
    "qwen3-235b-a22b": ModelSpec(name="qwen3-235b-a22b", hidden=4096, layers=94, dense_layers=0,
                                 vocab=151936, heads=64, kv_heads=4, head_dim=128, experts=128,
                                 shared_experts=0, top_k=8, expert_ffn=1536, embed_units=True,
                                 seq=4096, source="Qwen3 technical report (arXiv:2505.09388), "
                                 "Qwen3-235B-A22B config.json"),
}


def get_model(name: str, **overrides: object) -> ModelSpec:
    """Preset by name (with field overrides), or a clear error listing the presets."""
    try:
        spec = MODEL_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of: "
                         f"{', '.join(sorted(MODEL_PRESETS))}") from None
    return dataclasses.replace(spec, **overrides) if overrides else spec


def describe_models(names: Sequence[str] = ()) -> List[str]:
    """One line per preset: name, parameters, shape (for ``--list``)."""
    lines = []
    for n in names or sorted(MODEL_PRESETS):
        m = MODEL_PRESETS[n]
        p = m.params()
        lines.append(f"{n:20s} {p['total'] / 1e9:7.1f}B total {p['active'] / 1e9:6.1f}B active  "
                     f"{m.layers} layers, {m.experts} experts top-{m.top_k}, "
                     f"{m.units} pipeline units")
    return lines
