"""Static configuration: the model's shapes, the runner's limits, the scheduler's pool.

Every config is a frozen dataclass (hashable, usable as a jit static argument) and
validates itself at construction: an invalid value raises ``ConfigError`` naming the
field and the bound.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from types import MappingProxyType
from typing import Any, Mapping

import jax.numpy as jnp

from pallas_kernels import PAGE_SIZE, TOPK
from pallas_kernels.topk_select_chunked import max_chunked_pages

DCP_INTERLEAVE = PAGE_SIZE  # MSA requires one block per DCP interleave unit
NULL_PAGE_ID = 0  # padded block-table entries point here; never allocated
DUMMY_PAGE_ID = 1  # dummy (warm-up / profiling) batches write here; never allocated
RESERVED_PAGES = (NULL_PAGE_ID, DUMMY_PAGE_ID)
# The index-K cache dtype allowed besides the model dtype (ModelConfig.index_cache_dtype):
# raw e4m3 values, no scale; the indexer upcasts them (half the bytes of its O(L) scan).
FP8_INDEX_CACHE_DTYPE = "float8_e4m3fn"
# XLA's command buffers (CUDA graphs that XLA builds from runs of a step's kernels), by name:
# the compile options of each choice. "xla": XLA's default kinds, custom calls included;
# "off": none; "no-custom-calls": XLA's kinds less custom calls, so the Pallas kernels launch
# on the stream, with programmatic dependent launch, while fusions and GEMMs stay in graphs;
# "control-flow": XLA's kinds plus conditionals and while loops as CUDA graph nodes (outside a
# graph, XLA reads a lax.cond's predicate on the host, which waits for the device).
COMMAND_BUFFERS = MappingProxyType({
    "xla": MappingProxyType({}),
    "off": MappingProxyType({"xla_gpu_enable_command_buffer": ""}),
    "no-custom-calls": MappingProxyType({"xla_gpu_enable_command_buffer":
                                         "FUSION,CUBLAS,CUBLASLT,CUDNN,DYNAMIC_SLICE_FUSION"}),
    "control-flow": MappingProxyType({"xla_gpu_enable_command_buffer":
                                      "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,"
                                      "DYNAMIC_SLICE_FUSION,CONDITIONAL,WHILE"}),
})


def xla_compile_options(command_buffers: str) -> dict[str, str] | None:
    """The ``compiler_options`` of ``jax.jit`` / ``Lowered.compile`` for the choice
    ``COMMAND_BUFFERS[command_buffers]``: a new dict, or None for XLA's defaults."""
    return dict(COMMAND_BUFFERS[command_buffers]) or None


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field and the bound."""


def require(cond: bool, field: str, msg: str) -> None:
    """Raises ``ConfigError("field: msg")`` unless ``cond``."""
    if not cond:
        raise ConfigError(f"{field}: {msg}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes of the model (hashable: a jit static argument)."""

    vocab_size: int = 512
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 16
    num_kv_heads: int = 1
    head_dim: int = 128
    rotary_dim: int = 64
    rope_theta: float = 5e6
    rms_norm_eps: float = 1e-6
    intermediate_size: int = 512
    num_index_heads: int = 1
    index_dim: int = 64
    sparse_attention_freq: tuple[int, ...] = (0, 1, 1, 1)
    topk_blocks: int = TOPK
    block_size: int = PAGE_SIZE
    init_blocks: int = 0
    local_blocks: int = 1
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # MoE MLP on the layers with moe_layer_freq[i] == 1 (None: exactly the MSA layers, as in
    # the released model); other layers use a dense MLP of intermediate_size.
    moe_layer_freq: tuple[int, ...] | None = None
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128  # per routed expert
    shared_intermediate_size: int = 128  # the one ungated shared expert; 0 = none
    routed_scaling_factor: float = 2.0
    use_routing_bias: bool = True  # e_score_correction_bias, added for choosing experts only
    tie_word_embeddings: bool = False
    dtype: str = "float32"
    # index-K cache: "auto" (= dtype, the default), dtype's own name, or "float8_e4m3fn"
    index_cache_dtype: str = "auto"

    def __post_init__(self):
        object.__setattr__(self, "sparse_attention_freq",
                           tuple(int(bool(f)) for f in self.sparse_attention_freq))
        moe = self.sparse_attention_freq if self.moe_layer_freq is None else self.moe_layer_freq
        object.__setattr__(self, "moe_layer_freq", tuple(int(bool(f)) for f in moe))

        require(len(self.sparse_attention_freq) == self.num_layers, "sparse_attention_freq",
            f"needs one entry per layer ({self.num_layers}), got {len(self.sparse_attention_freq)}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "num_index_heads", "index_dim"):
            require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        require(len(self.moe_layer_freq) == self.num_layers, "moe_layer_freq",
            f"needs one entry per layer ({self.num_layers}), got {len(self.moe_layer_freq)}")
        if any(self.moe_layer_freq):
            for name in ("num_experts", "moe_intermediate_size"):
                require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
            require(1 <= self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok",
                    f"must be in [1, num_experts={self.num_experts}], got {self.num_experts_per_tok}")
            require(self.shared_intermediate_size >= 0, "shared_intermediate_size",
                    f"must be >= 0 (0: no shared expert), got {self.shared_intermediate_size}")
            require(math.isfinite(self.routed_scaling_factor) and self.routed_scaling_factor > 0,
                    "routed_scaling_factor", f"must be finite and > 0, got {self.routed_scaling_factor}")
        require(self.num_heads % self.num_kv_heads == 0, "num_heads",
            f"must be a multiple of num_kv_heads={self.num_kv_heads}")
        require(self.rotary_dim % 2 == 0 and 0 < self.rotary_dim <= self.head_dim, "rotary_dim",
            f"must be even and in (0, head_dim={self.head_dim}], got {self.rotary_dim}")
        require(self.block_size == PAGE_SIZE, "block_size", f"must be {PAGE_SIZE}, got {self.block_size}")
        require(self.topk_blocks == TOPK, "topk_blocks", f"must be {TOPK}, got {self.topk_blocks}")
        if any(self.sparse_attention_freq):
            require(self.num_index_heads == self.num_kv_heads, "num_index_heads",
                f"must equal num_kv_heads={self.num_kv_heads} (one index head per KV group)")
            require(self.index_dim >= self.rotary_dim, "index_dim",
                f"must be >= rotary_dim={self.rotary_dim} (index q/k share the RoPE tables)")
        require(self.local_blocks == 1, "local_blocks", f"must be 1, got {self.local_blocks}")
        require(0 <= self.init_blocks < self.topk_blocks, "init_blocks",
                f"must be in [0, {self.topk_blocks}), got {self.init_blocks}")
        require(self.dtype in ("float32", "bfloat16"), "dtype", f"float32 or bfloat16, got {self.dtype}")
        require(self.index_cache_dtype in ("auto", self.dtype, FP8_INDEX_CACHE_DTYPE),
            "index_cache_dtype", f"one of 'auto', {self.dtype!r} (the model dtype) or "
            f"{FP8_INDEX_CACHE_DTYPE!r}, got {self.index_cache_dtype!r}")

    # ---- derived -------------------------------------------------------------------------
    @property
    def layer_is_msa(self) -> tuple[bool, ...]:
        return tuple(bool(f) for f in self.sparse_attention_freq)

    @property
    def layer_is_moe(self) -> tuple[bool, ...]:
        return tuple(bool(f) for f in self.moe_layer_freq)

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def index_cache_jnp_dtype(self):
        """dtype of the index-K cache pages ("auto": the model dtype)."""
        auto = self.index_cache_dtype == "auto"
        return self.jnp_dtype if auto else jnp.dtype(self.index_cache_dtype)

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def per_rank(self, tp: int) -> "ModelConfig":
        """Attention shapes of one tensor-parallel rank (heads split, KV/index heads too)."""
        if self.num_heads % tp or self.num_kv_heads % tp:
            raise ConfigError(f"tp: {tp} must divide num_heads={self.num_heads} and "
                              f"num_kv_heads={self.num_kv_heads}")
        return dataclasses.replace(self, num_heads=self.num_heads // tp,
                                   num_kv_heads=self.num_kv_heads // tp,
                                   num_index_heads=self.num_index_heads // tp)

    # ---- constructors ----------------------------------------------------------------------
    @classmethod
    def tiny(cls, **overrides) -> "ModelConfig":
        """Built-in small default: 4 layers (1 dense attention + dense MLP, 3 MSA + MoE of 8
        experts, top 2, one shared expert), 16 q / 1 kv heads of dim 128, index dim 64 (the
        released model: 128; smaller keeps the CPU demo quick). Without a ``moe_layer_freq``
        override, the MoE layers are the MSA layers."""
        return dataclasses.replace(cls(), **{"moe_layer_freq": None, **overrides})

    @classmethod
    def from_hf_config(cls, path_or_dict: str | os.PathLike | Mapping[str, Any], *,
                       num_layers: int | None = None, dtype: str = "bfloat16") -> "ModelConfig":
        """Build from a MiniMax-M3 ``config.json`` (a path, its directory, or a dict).

        A VL config's ``text_config`` is used. Two field-name schemes are read:
        - released (legacy): ``sparse_attention_config`` {``sparse_attention_freq``,
          ``sparse_num_index_heads``, ``sparse_index_dim``, ``sparse_block_size``,
          ``sparse_topk_blocks``, ``sparse_init_block``, ``sparse_local_block``,
          ``sparse_score_type``, ``use_sparse_attention``}, ``moe_layer_freq``,
          ``rotary_dim``, ``rope_theta``, ``n_shared_experts``, ``scoring_func``,
          ``use_routing_bias``;
        - transformers': ``layer_types`` ("full_attention" / "minimax_m3_sparse"),
          ``mlp_layer_types`` ("dense" / "sparse"), ``index_n_heads``, ``index_head_dim``,
          ``index_block_size``, ``index_topk_blocks``, ``index_local_blocks``,
          ``rope_parameters`` {``rope_theta``, ``partial_rotary_factor``}.
        Common: ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
        ``num_key_value_heads``, ``head_dim``, ``rms_norm_eps``, ``vocab_size``,
        ``dense_intermediate_size`` (dense MLP), ``intermediate_size`` (routed expert),
        ``shared_intermediate_size``, ``num_local_experts``, ``num_experts_per_tok``,
        ``routed_scaling_factor``, ``swiglu_alpha``, ``swiglu_limit``, ``tie_word_embeddings``.
        A field given in both schemes with different values is a ConfigError.
        ``num_layers`` truncates the stack (keeping the per-layer patterns of the first layers).
        """
        if isinstance(path_or_dict, Mapping):
            top = dict(path_or_dict)
        else:
            path = os.fspath(path_or_dict)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path) as f:
                top = json.load(f)
        cfg = dict(top["text_config"]) if isinstance(top.get("text_config"), Mapping) else top
        sparse = dict(cfg.get("sparse_attention_config") or {})
        for key in ("sparse_attention_freq", "sparse_num_index_heads", "sparse_index_dim",
                    "sparse_block_size", "sparse_topk_blocks", "sparse_init_block",
                    "sparse_local_block", "sparse_score_type"):
            if key not in sparse and key in cfg:  # tolerate flat layouts
                sparse[key] = cfg[key]

        def need(key):
            if key not in cfg:
                raise ConfigError(f"{key}: missing from the MiniMax-M3 config")
            return cfg[key]

        def either(legacy_key, new_key, default):
            """The value of the released name (in sparse_attention_config) or transformers'."""
            have_old, have_new = legacy_key in sparse, new_key in cfg
            if have_old and have_new and sparse[legacy_key] != cfg[new_key]:
                raise ConfigError(f"{new_key}: {cfg[new_key]!r} disagrees with "
                                  f"sparse_attention_config.{legacy_key}={sparse[legacy_key]!r}")
            return sparse[legacy_key] if have_old else cfg.get(new_key, default)

        def per_layer(field, values, names):
            out = []
            for i, v in enumerate(values):
                if v not in names:
                    raise ConfigError(f"{field}[{i}]: one of {tuple(names)}, got {v!r}")
                out.append(names[v])
            return tuple(out)

        n_layers = int(need("num_hidden_layers"))
        if "layer_types" in cfg:
            freq = per_layer("layer_types", cfg["layer_types"],
                             {"full_attention": 0, "minimax_m3_sparse": 1})
            if "sparse_attention_freq" in sparse and \
                    tuple(int(bool(f)) for f in sparse["sparse_attention_freq"]) != freq:
                raise ConfigError("layer_types: disagrees with "
                                  "sparse_attention_config.sparse_attention_freq")
        else:
            freq = tuple(int(bool(f)) for f in sparse.get("sparse_attention_freq", [0] * n_layers))
            if sparse.get("use_sparse_attention") is False:
                freq = (0,) * n_layers
        if "mlp_layer_types" in cfg:
            moe = per_layer("mlp_layer_types", cfg["mlp_layer_types"], {"dense": 0, "sparse": 1})
        elif "moe_layer_freq" in cfg:
            moe = tuple(int(bool(f)) for f in cfg["moe_layer_freq"])
        else:
            raise ConfigError("moe_layer_freq: missing from the MiniMax-M3 config (give "
                              "moe_layer_freq or mlp_layer_types)")
        if sparse.get("sparse_score_type", "max") != "max":
            raise ConfigError(f"sparse_score_type: only 'max' is supported, got "
                              f"{sparse['sparse_score_type']!r}")
        if cfg.get("scoring_func", "sigmoid") != "sigmoid":
            raise ConfigError(f"scoring_func: only 'sigmoid' is supported, got "
                              f"{cfg['scoring_func']!r}")
        if float(cfg.get("swiglu_beta", 1.0)) != 1.0:
            raise ConfigError(f"swiglu_beta: only 1.0 is supported, got {cfg['swiglu_beta']}")
        if cfg.get("attention_output_gate", False):
            raise ConfigError("attention_output_gate: only False is supported, got True")
        rope = dict(cfg.get("rope_parameters") or {})
        rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 1e4))
        head_dim = int(cfg.get("head_dim") or need("hidden_size") // need("num_attention_heads"))
        factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
        rotary_dim = cfg.get("rotary_dim")
        if factor is not None:
            from_factor = int(head_dim * float(factor))
            if rotary_dim is not None and int(rotary_dim) != from_factor:
                raise ConfigError(f"rotary_dim: {rotary_dim} disagrees with partial_rotary_factor="
                                  f"{factor} x head_dim={head_dim} = {from_factor}")
            rotary_dim = from_factor
        if rotary_dim is None:
            rotary_dim = head_dim // 2
        if num_layers is not None:
            n_layers, freq, moe = int(num_layers), freq[:int(num_layers)], moe[:int(num_layers)]
        num_kv = int(need("num_key_value_heads"))
        experts = {}
        if any(moe):
            inter = int(need("intermediate_size"))
            n_shared = int(cfg.get("n_shared_experts", 1))
            experts = dict(
                num_experts=int(cfg["num_experts"] if "num_experts" in cfg
                                else need("num_local_experts")),
                num_experts_per_tok=int(need("num_experts_per_tok")),
                moe_intermediate_size=inter,
                shared_intermediate_size=n_shared * int(cfg.get("shared_intermediate_size", inter)),
                routed_scaling_factor=float(need("routed_scaling_factor")),
                use_routing_bias=bool(cfg.get("use_routing_bias", True)))
        dense = {}
        if not all(moe):
            dense = dict(intermediate_size=int(cfg.get("dense_intermediate_size")
                                               or need("intermediate_size")))
        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            num_layers=n_layers,
            num_heads=int(need("num_attention_heads")),
            num_kv_heads=num_kv,
            head_dim=head_dim,
            rotary_dim=int(rotary_dim),
            rope_theta=float(rope_theta),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            num_index_heads=int(either("sparse_num_index_heads", "index_n_heads", num_kv)),
            index_dim=int(either("sparse_index_dim", "index_head_dim", 128)),
            sparse_attention_freq=freq,
            topk_blocks=int(either("sparse_topk_blocks", "index_topk_blocks", TOPK)),
            block_size=int(either("sparse_block_size", "index_block_size", PAGE_SIZE)),
            init_blocks=int(sparse.get("sparse_init_block", 0)),
            local_blocks=int(either("sparse_local_block", "index_local_blocks", 1)),
            swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
            moe_layer_freq=moe,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)
                                     or top.get("tie_word_embeddings", False)),
            dtype=dtype, **experts, **dense,
        )


# the longest context: as many pages as the Mosaic GPU select takes in a row (past 1024 pages the
# chunked select; longer rows would fall back to Triton)
MAX_MODEL_LEN = max_chunked_pages() * PAGE_SIZE


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    """Runner limits and the static bucket sizes (the CUDA-graph capture sizes)."""

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 64
    max_model_len: int = 8192
    num_spec_tokens: int = 0
    bucket_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    dcp_world_size: int = 1
    dcp_interleave: int = DCP_INTERLEAVE
    page_size: int = PAGE_SIZE
    tp_size: int = 1  # tensor-parallel ranks (mesh axis "tensor")
    ep_size: int = 1  # expert-parallel ranks (mesh axis "expert")
    command_buffers: str = "xla"  # XLA's CUDA graphs for the step: a key of COMMAND_BUFFERS

    def __post_init__(self):
        object.__setattr__(self, "bucket_sizes", tuple(sorted(set(int(b) for b in self.bucket_sizes))))
        require(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
                 f"must be >= 1, got {self.max_num_batched_tokens}")
        require(self.max_model_len >= 1, "max_model_len", f"must be >= 1, got {self.max_model_len}")
        require(self.max_model_len <= MAX_MODEL_LEN, "max_model_len",
                f"must be <= {MAX_MODEL_LEN} (the indexer's Mosaic GPU select holds "
                f"{MAX_MODEL_LEN // PAGE_SIZE} pages a row), got {self.max_model_len}")
        require(self.num_spec_tokens >= 0, "num_spec_tokens",
                 f"must be >= 0, got {self.num_spec_tokens}")
        require(self.page_size == PAGE_SIZE, "page_size",
                 f"MSA needs page_size == {PAGE_SIZE}, got {self.page_size}")
        require(len(self.bucket_sizes) > 0, "bucket_sizes", "must not be empty")
        require(self.bucket_sizes[0] >= 1, "bucket_sizes",
                 f"every bucket must be >= 1, got {self.bucket_sizes[0]}")
        require(self.bucket_sizes[-1] <= self.max_num_batched_tokens, "bucket_sizes",
                 f"bucket {self.bucket_sizes[-1]} is larger than "
                 f"max_num_batched_tokens={self.max_num_batched_tokens}")
        require(self.dcp_world_size >= 1, "dcp_world_size",
                 f"must be >= 1, got {self.dcp_world_size}")
        require(self.tp_size >= 1, "tp_size", f"must be >= 1, got {self.tp_size}")
        require(self.ep_size >= 1, "ep_size", f"must be >= 1, got {self.ep_size}")
        require(self.command_buffers in COMMAND_BUFFERS, "command_buffers",
                 f"must be one of {tuple(COMMAND_BUFFERS)}, got {self.command_buffers!r}")
        require(self.dcp_interleave == DCP_INTERLEAVE, "dcp_interleave",
                 f"MSA needs dcp_interleave == {DCP_INTERLEAVE} (one block per unit), "
                 f"got {self.dcp_interleave}")
        require(self.dcp_world_size == 1
                 or self.max_model_len > self.dcp_world_size * self.dcp_interleave,
                 "max_model_len",
                 f"must exceed the DCP dummy context dcp_world_size * dcp_interleave = "
                 f"{self.dcp_world_size * self.dcp_interleave} (context plus one query token), "
                 f"got {self.max_model_len}")
        require(1 + self.num_spec_tokens <= self.max_num_batched_tokens, "num_spec_tokens",
                 f"decode length 1 + {self.num_spec_tokens} exceeds max_num_batched_tokens="
                 f"{self.max_num_batched_tokens}")

    @property
    def dcp_dummy_context_len(self) -> int:
        """Fake context of a DCP dummy batch: W * I tokens (0 without DCP)."""
        return self.dcp_world_size * self.dcp_interleave if self.dcp_world_size > 1 else 0

    @property
    def uniform_decode_len(self) -> int:
        return 1 + self.num_spec_tokens

    @property
    def max_pages(self) -> int:
        """Block-table width: pages of the longest sequence.

        Every staged sequence (the DCP dummy context included) has seq_len <= max_model_len,
        and under DCP a row needs only ceil(seq_len / (128 * W)) rank-local pages, so this
        width covers every row of every batch.
        """
        return math.ceil(self.max_model_len / self.page_size)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's limits: a RunnerConfig's plus the KV pool (``from_runner``)."""

    max_num_seqs: int
    max_num_batched_tokens: int  # token budget of one step (<= the largest bucket)
    max_model_len: int
    num_pages: int  # physical pages incl. the reserved ones (per rank under DCP)
    dcp_world_size: int = 1  # W ranks: requests hold ceil(L / (PAGE_SIZE * W)) rank-local pages
    enable_prefix_caching: bool = True  # full pages keyed by their prefix, reused (prefix_cache)
    async_scheduling: bool = False  # the engine plans step N+1 while step N runs (engine)

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "dcp_world_size"):
            require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        require(self.num_pages > len(RESERVED_PAGES), "num_pages",
                f"need the reserved pages {RESERVED_PAGES} plus at least one page, "
                f"got {self.num_pages}")
        require(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching",
                f"must be a bool, got {self.enable_prefix_caching!r}")
        require(isinstance(self.async_scheduling, bool), "async_scheduling",
                f"must be a bool, got {self.async_scheduling!r}")

    @classmethod
    def from_runner(cls, rconfig: RunnerConfig, num_pages: int, *,
                    enable_prefix_caching: bool = True,
                    async_scheduling: bool = False) -> "SchedulerConfig":
        """The scheduler of a runner built from ``rconfig`` with ``num_pages`` pages (per rank)."""
        return cls(max_num_seqs=rconfig.max_num_seqs,
                   max_num_batched_tokens=rconfig.max_num_batched_tokens,
                   max_model_len=rconfig.max_model_len, num_pages=num_pages,
                   dcp_world_size=rconfig.dcp_world_size,
                   enable_prefix_caching=enable_prefix_caching,
                   async_scheduling=async_scheduling)
