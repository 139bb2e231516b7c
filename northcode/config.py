"""Model configuration: the fields of a cohere2_moe `config.json` that change the math.

`ModelConfig.from_dict` follows transformers' `Cohere2MoeConfig` defaults and derivations
(layer_types from first_k_dense_replace and the window patterns, rope_parameters), and
rejects what northcode cannot serve with a ValueError that names the field and its value.
It does not know about devices, dtypes or engine settings.

The process environment is read here and nowhere else (section "the environment"): one function per
variable, read when called (a test or a benchmark may set one just before), each listed with its meaning in
docs/architecture.md's table. A value that cannot mean anything is a ValueError naming the variable.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LAYER_TYPES = ("full_attention", "sliding_attention")
MLP_LAYER_TYPES = ("dense", "sparse")
EXPERT_SELECTION_FNS = ("softmax", "sigmoid")
SHARED_EXPERT_STRATEGIES = ("average", "sum")

# Fields read from config.json that we keep for completeness but that do not change the math.
_IGNORED_FIELDS = {
    "architectures", "transformers_version", "torch_dtype", "dtype", "initializer_range",
    "use_cache", "attention_dropout", "output_router_logits", "auto_map", "_name_or_path",
    "router_aux_loss_coef", "router_z_loss_coef",
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The math of a cohere2_moe model. Defaults are transformers' Cohere2MoeConfig defaults."""

    vocab_size: int = 256000
    hidden_size: int = 8192
    intermediate_size: int = 22528  # per routed expert
    prefix_dense_intermediate_size: int | None = None  # dense (prefix) layers' MLP width
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    num_key_value_heads: int | None = None  # None: same as num_attention_heads
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 8192
    layer_norm_eps: float = 1e-5  # used only when rms_norm_eps is None (mean-centred LayerNorm)
    rms_norm_eps: float | None = None  # not None: RMSNorm
    logit_scale: float = 0.0625
    tie_word_embeddings: bool = True
    rope_theta: float = 10000.0
    attention_bias: bool = False
    sliding_window: int | None = 4096
    sliding_window_pattern: int = 4
    prefix_dense_sliding_window_pattern: int = 1
    first_k_dense_replace: int = 0
    layer_types: tuple[str, ...] | None = None  # derived when absent
    mlp_layer_types: tuple[str, ...] | None = None  # derived when absent
    num_experts: int = 8
    num_experts_per_tok: int = 2
    num_shared_experts: int = 0
    shared_expert_combination_strategy: str = "average"
    expert_selection_fn: str = "softmax"
    norm_topk_prob: bool = True
    use_parallel_block: bool = True
    use_qk_norm: bool = False
    pad_token_id: int | None = 0
    bos_token_id: int | None = 5
    eos_token_id: int | tuple[int, ...] | None = 255001
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # unknown fields, kept for writing back

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen dataclass)
        self._validate_layer_counts()  # before the derivations below divide by them
        if self.num_key_value_heads is None:
            set_("num_key_value_heads", self.num_attention_heads)
        if self.layer_types is None:
            set_("layer_types", self._derived_layer_types())
        else:
            set_("layer_types", tuple(self.layer_types))
        if self.mlp_layer_types is None:
            set_("mlp_layer_types", tuple(
                "dense" if i < self.first_k_dense_replace else "sparse" for i in range(self.num_hidden_layers)))
        else:
            set_("mlp_layer_types", tuple(self.mlp_layer_types))
        if isinstance(self.eos_token_id, list):
            set_("eos_token_id", tuple(self.eos_token_id))
        self._validate()

    # --- derived values ---

    def _derived_layer_types(self) -> tuple[str, ...]:
        """transformers' rule: prefix dense layers use their own window pattern, the rest theirs."""
        k = self.first_k_dense_replace
        prefix = ["sliding_attention" if (i + 1) % self.prefix_dense_sliding_window_pattern else "full_attention"
                  for i in range(k)]
        rest = ["sliding_attention" if (i + 1) % self.sliding_window_pattern else "full_attention"
                for i in range(self.num_hidden_layers - k)]
        return tuple(prefix + rest)

    @property
    def uses_rms_norm(self) -> bool:
        return self.rms_norm_eps is not None

    @property
    def norm_eps(self) -> float:
        return self.rms_norm_eps if self.rms_norm_eps is not None else self.layer_norm_eps

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def dense_intermediate_size(self) -> int:
        return self.prefix_dense_intermediate_size or self.intermediate_size

    @property
    def eos_token_ids(self) -> tuple:
        if self.eos_token_id is None:
            return ()
        return self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)

    def is_sliding(self, layer_idx: int) -> bool:
        return self.layer_types[layer_idx] == "sliding_attention" and self.sliding_window is not None

    def is_dense(self, layer_idx: int) -> bool:
        return self.mlp_layer_types[layer_idx] == "dense"

    def uses_rope(self, layer_idx: int) -> bool:
        """RoPE on sliding layers, and on dense layers when prefix_dense_sliding_window_pattern == 1
        (transformers' `force_rope`); full layers otherwise use no positional encoding (NoPE)."""
        force_rope = self.is_dense(layer_idx) and self.prefix_dense_sliding_window_pattern == 1
        return self.layer_types[layer_idx] == "sliding_attention" or force_rope

    def window(self, layer_idx: int) -> int | None:
        """Tokens a query at position p sees in this layer (p-window+1..p), or None for all."""
        return self.sliding_window if self.is_sliding(layer_idx) else None

    # --- validation ---

    def _validate_layer_counts(self) -> None:
        for name in ("num_hidden_layers", "sliding_window_pattern", "prefix_dense_sliding_window_pattern"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                _reject(name, value, "must be a positive integer")
        if not _is_int(self.first_k_dense_replace) or not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            _reject("first_k_dense_replace", self.first_k_dense_replace,
                    f"must be an integer from 0 to num_hidden_layers ({self.num_hidden_layers})")
        for name in ("layer_types", "mlp_layer_types"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (list, tuple)):
                _reject(name, value, "must be a list of strings")

    def _validate(self) -> None:
        self._validate_types()
        self._validate_geometry()
        self._validate_choices()

    def _validate_types(self) -> None:
        """Every field of the kind config.json must give (ints, numbers, booleans, ids)."""
        reject = _reject
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts",
                     "num_experts_per_tok", "max_position_embeddings"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                reject(name, value, "must be a positive integer")
        if self.prefix_dense_intermediate_size is not None and (
                not _is_int(self.prefix_dense_intermediate_size) or self.prefix_dense_intermediate_size <= 0):
            reject("prefix_dense_intermediate_size", self.prefix_dense_intermediate_size,
                   "must be a positive integer or null")
        if not _is_int(self.num_shared_experts):
            reject("num_shared_experts", self.num_shared_experts, "must be an integer")
        for name in ("logit_scale", "rope_theta", "layer_norm_eps"):
            if not isinstance(getattr(self, name), (int, float)) or isinstance(getattr(self, name), bool):
                reject(name, getattr(self, name), "must be a number")
        if self.rms_norm_eps is not None and (not isinstance(self.rms_norm_eps, (int, float))
                                              or isinstance(self.rms_norm_eps, bool)):
            reject("rms_norm_eps", self.rms_norm_eps, "must be a number or absent")
        for name in ("tie_word_embeddings", "norm_topk_prob", "use_parallel_block", "use_qk_norm", "attention_bias"):
            if not isinstance(getattr(self, name), bool):
                reject(name, getattr(self, name), "must be true or false")
        for name in ("bos_token_id", "pad_token_id"):
            if getattr(self, name) is not None and not _is_int(getattr(self, name)):
                reject(name, getattr(self, name), "must be an integer or null")
        if not all(_is_int(i) and i >= 0 for i in self.eos_token_ids):
            reject("eos_token_id", self.eos_token_id, "must be a token id, a list of token ids, or null")
        if self.sliding_window is not None and not _is_int(self.sliding_window):
            reject("sliding_window", self.sliding_window, "must be a positive integer or null")

    def _validate_geometry(self) -> None:
        """Shapes that fit together, and a layer plan of the right length and kinds."""
        reject = _reject
        if self.num_attention_heads % self.num_key_value_heads:
            reject("num_key_value_heads", self.num_key_value_heads,
                   f"must divide num_attention_heads ({self.num_attention_heads})")
        if self.head_dim % 2:
            reject("head_dim", self.head_dim, "must be even (RoPE rotates pairs)")
        if self.num_experts_per_tok > self.num_experts:
            reject("num_experts_per_tok", self.num_experts_per_tok, f"exceeds num_experts ({self.num_experts})")
        if len(self.layer_types) != self.num_hidden_layers:
            reject("layer_types", list(self.layer_types),
                   f"has {len(self.layer_types)} entries, num_hidden_layers is {self.num_hidden_layers}")
        for i, kind in enumerate(self.layer_types):
            if kind not in LAYER_TYPES:
                reject(f"layer_types[{i}]", kind, f"must be one of {list(LAYER_TYPES)}")
        if len(self.mlp_layer_types) != self.num_hidden_layers:
            reject("mlp_layer_types", list(self.mlp_layer_types),
                   f"has {len(self.mlp_layer_types)} entries, num_hidden_layers is {self.num_hidden_layers}")
        for i, kind in enumerate(self.mlp_layer_types):
            if kind not in MLP_LAYER_TYPES:
                reject(f"mlp_layer_types[{i}]", kind, f"must be one of {list(MLP_LAYER_TYPES)}")

    def _validate_choices(self) -> None:
        """The branches of cohere2_moe that northcode implements, and positive windows and epsilons."""
        reject = _reject
        if self.expert_selection_fn not in EXPERT_SELECTION_FNS:
            reject("expert_selection_fn", self.expert_selection_fn, f"must be one of {list(EXPERT_SELECTION_FNS)}")
        if self.shared_expert_combination_strategy not in SHARED_EXPERT_STRATEGIES:
            reject("shared_expert_combination_strategy", self.shared_expert_combination_strategy,
                   f"must be one of {list(SHARED_EXPERT_STRATEGIES)}")
        if self.num_shared_experts < 0:
            reject("num_shared_experts", self.num_shared_experts, "must be >= 0")
        if self.hidden_act != "silu":
            reject("hidden_act", self.hidden_act, "northcode serves SwiGLU experts with silu only")
        if self.attention_bias:
            reject("attention_bias", self.attention_bias, "attention projections with bias are not supported")
        if self.use_qk_norm:
            reject("use_qk_norm", self.use_qk_norm, "QK-norm is not part of cohere2_moe in transformers")
        if not self.use_parallel_block:
            reject("use_parallel_block", self.use_parallel_block,
                   "cohere2_moe layers are parallel blocks (attention and MLP read the same normed input)")
        if self.sliding_window is not None and self.sliding_window <= 0:
            reject("sliding_window", self.sliding_window, "must be a positive integer or null")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            reject("sliding_window", None, "layer_types has sliding_attention layers but no window is set")
        for name in ("rope_theta", "layer_norm_eps"):
            if not getattr(self, name) > 0:
                reject(name, getattr(self, name), "must be > 0")
        if self.rms_norm_eps is not None and not self.rms_norm_eps > 0:
            reject("rms_norm_eps", self.rms_norm_eps, "must be > 0 or absent")

    # --- reading and writing ---

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type != "cohere2_moe":
            raise ValueError(f"config.json: model_type = {model_type!r}: northcode serves 'cohere2_moe' only")
        values: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        for key, value in raw.items():
            if key in known:
                values[key] = value
            elif key not in _IGNORED_FIELDS | {"model_type", "rope_parameters", "rope_scaling"}:
                extra[key] = value
        values["rope_theta"] = _rope_theta(raw)
        return cls(**values, extra=extra)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"{path}: no config.json (is this a model folder?)") from None
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a JSON object")
        try:
            return cls.from_dict(raw)
        except TypeError as err:  # a field of the wrong kind that the dataclass could not take
            raise ValueError(f"{path}: {err}") from None

    def to_dict(self) -> dict[str, Any]:
        """A config.json that both northcode and transformers read back to the same model."""
        out: dict[str, Any] = {"architectures": ["Cohere2MoeForCausalLM"], "model_type": "cohere2_moe"}
        for f in dataclasses.fields(self):
            if f.name in ("extra", "rope_theta"):
                continue
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
        out.update(self.extra)
        return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _reject(name: str, value: Any, why: str) -> None:
    raise ValueError(f"config.json: {name} = {value!r}: {why}")


def _rope_theta(raw: dict[str, Any]) -> float:
    """rope_theta lives at top level (transformers 4) or in rope_parameters (transformers 5)."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling")
    for name, spec in (("rope_parameters", params), ("rope_scaling", scaling)):
        rope_type = (spec or {}).get("rope_type", (spec or {}).get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"config.json: {name}.rope_type = {rope_type!r}: only default RoPE is supported")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool):
        raise ValueError(f"config.json: rope_theta = {theta!r}: must be a number")
    return float(theta)


# --- the environment (docs/architecture.md, "Environment variables") ---


def _env(name: str) -> str:
    return os.environ.get(name, "").strip()


def env_data_home() -> str | None:
    """NORTHCODE_HOME: the data directory instead of the user's (models, kernels, sessions)."""
    return _env("NORTHCODE_HOME") or None


def env_cpu_threads() -> int | None:
    """OMP_NUM_THREADS when it is a positive integer: torch's CPU threads unless a setting names them."""
    chosen = _env("OMP_NUM_THREADS")
    return int(chosen) if chosen.isdigit() and int(chosen) > 0 else None


def env_torch_compile() -> bool | None:
    """NORTHCODE_TORCH_COMPILE=0/1: torch.compile the torch backend's decode step or not; None: unset."""
    chosen = _env("NORTHCODE_TORCH_COMPILE")
    if chosen and chosen not in ("0", "1"):
        raise ValueError(f"NORTHCODE_TORCH_COMPILE={chosen!r}: must be 0 or 1")
    return chosen == "1" if chosen else None


def env_cuda_homes() -> list[str]:
    """Where a CUDA toolkit may be, in order: $CUDA_HOME, $CUDA_PATH, /usr/local/cuda (nvcc is in its bin/)."""
    return [home for home in (_env("CUDA_HOME"), _env("CUDA_PATH"), "/usr/local/cuda") if home]


def env_api_key() -> str | None:
    """NORTHCODE_API_KEY: the agent's key for an endpoint started with `northcode serve --api-key` (as given)."""
    return os.environ.get("NORTHCODE_API_KEY") or None


def env_allow_private_fetch() -> bool:
    """NORTHCODE_ALLOW_PRIVATE_FETCH=1: the agent's webfetch may reach loopback, private and link-local addresses."""
    chosen = _env("NORTHCODE_ALLOW_PRIVATE_FETCH")
    if chosen and chosen not in ("0", "1"):
        raise ValueError(f"NORTHCODE_ALLOW_PRIVATE_FETCH={chosen!r}: must be 0 or 1")
    return chosen == "1"


def env_report_path() -> str | None:
    """NC_REPORT: a JSON-lines file the whole-step checks append their records to (lab/device_megakernel.sh)."""
    return _env("NC_REPORT") or None
