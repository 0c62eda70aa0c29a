"""Conversion between hlat models and Hugging Face `LlamaForCausalLM` / `GPTNeoXForCausalLM` / `MixtralForCausalLM`
directories (config.json + safetensors), using only json and safetensors: transformers is not needed at run time.

Three layout differences need more than renaming:
* Mixtral's experts are one tensor per expert and matrix on disk (`block_sparse_moe.experts.{j}.w1.weight`, as
  every transformers release writes them), stacked per matrix in hlat; transformers 5 holds them fused in memory
  (`mlp.experts.gate_up_proj`, `down_proj`), which is read too.
* NeoX fuses q, k and v into one `query_key_value` matrix whose rows are ordered [head, (q, k, v), head_dim].
* Rotary pairs. Both rotate dimension j with j + half, but HF's partial rotary rotates the first rotary_dim
  dimensions of a head as a block (pairs (j, j + rotary_dim/2)) and passes the rest through, while hlat's
  zero-frequency table pairs (j, j + head_dim/2) across the whole head. Permuting the rows of q and k inside
  each head maps one onto the other; q.k is unchanged because q and k are permuted alike. For full rotary
  (all Llama models) the permutation is the identity: HF Llama already uses the rotate-half convention.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from hlat import HlatError
from hlat.fields import update
from hlat.models import build_model
from hlat.models.config import ModelConfig


@dataclass(frozen=True)
class _Family:
    model_type: str
    architecture: str
    prefix: str  # of the base model's tensors
    embedding: str
    final_norm: str
    output: str  # the key transformers writes; `output_aliases` are also read
    output_aliases: tuple[str, ...]
    layer: dict[str, str]  # hlat module -> HF module inside a layer (q, k, v are handled apart)
    fixed: dict  # config.json fields that hlat's architecture of this family implies


_FAMILIES = {
    "llama": _Family(
        "llama",
        "LlamaForCausalLM",
        "model.",
        "embed_tokens",
        "norm",
        "lm_head.weight",
        (),
        {
            "attention.wo": "self_attn.o_proj",
            "feed_forward.w1": "mlp.gate_proj",
            "feed_forward.w3": "mlp.up_proj",
            "feed_forward.w2": "mlp.down_proj",
            "attention_norm": "input_layernorm",
            "ffn_norm": "post_attention_layernorm",
        },
        {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False},
    ),
    "neox": _Family(
        "gpt_neox",
        "GPTNeoXForCausalLM",
        "gpt_neox.",
        "embed_in",
        "final_layer_norm",
        "embed_out.weight",
        ("lm_head.weight",),  # transformers 5 names it lm_head in memory, embed_out on disk
        {
            "attention.wo": "attention.dense",
            "feed_forward.w1": "mlp.dense_h_to_4h",
            "feed_forward.w2": "mlp.dense_4h_to_h",
            "attention_norm": "input_layernorm",
            "ffn_norm": "post_attention_layernorm",
        },
        {"hidden_act": "gelu", "attention_bias": True},
    ),
    "mixtral": _Family(  # the llama family with mixture-of-experts blocks
        "mixtral",
        "MixtralForCausalLM",
        "model.",
        "embed_tokens",
        "norm",
        "lm_head.weight",
        (),
        {
            "attention.wo": "self_attn.o_proj",
            "feed_forward.router": "block_sparse_moe.gate",
            "attention_norm": "input_layernorm",
            "ffn_norm": "post_attention_layernorm",
        },
        {"hidden_act": "silu", "router_jitter_noise": 0.0},
    ),
}
_EXPERTS = ("w1", "w2", "w3")  # hlat's stacked matrices, Mixtral's per-expert names alike
_LLAMA_QKV = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj"}
_NEOX_QKV = "attention.query_key_value"
# Buffers that older checkpoints saved alongside the weights.
_IGNORED = re.compile(r"\.(attention\.bias|attention\.masked_bias|rotary_emb\.inv_freq)$")


# --- configs ---------------------------------------------------------------------------------------


def _kind(cfg: ModelConfig) -> str:
    """The key of `_FAMILIES` a model converts as: its family, or mixtral for a llama of experts."""
    return "mixtral" if cfg.moe else cfg.family


def hf_config_to_model_config(hf_cfg: dict) -> ModelConfig:
    """The ModelConfig of a HF config.json dict (transformers 4 or 5 spelling of the rotary fields)."""

    def need(key: str):
        if key not in hf_cfg:
            raise HlatError(f"missing field {key!r}")
        return hf_cfg[key]

    model_type = need("model_type")
    kind = next((f for f, spec in _FAMILIES.items() if spec.model_type == model_type), None)
    if kind is None:
        raise HlatError(f"model_type {model_type!r} is not supported (supported: llama, gpt_neox, mixtral)")
    for field, value in _FAMILIES[kind].fixed.items():
        if hf_cfg.get(field, value) != value:
            raise HlatError(f"{field}={hf_cfg[field]!r} is not supported for {model_type} (only {value!r})")
    family = "neox" if kind == "neox" else "llama"
    has_bias = family == "neox"
    dim, n_heads = need("hidden_size"), need("num_attention_heads")
    if hf_cfg.get("head_dim") not in (None, dim // n_heads):
        raise HlatError(f"head_dim={hf_cfg['head_dim']} differs from hidden_size / num_attention_heads")

    # transformers 5 keeps the rotary settings in rope_parameters; 4 had them at the top level.
    rope = {**(hf_cfg.get("rope_scaling") or {}), **(hf_cfg.get("rope_parameters") or {})}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise HlatError(f"rope type {rope_type!r} is not supported (only unscaled 'default' rotary embeddings)")
    theta = rope.get("rope_theta", hf_cfg.get("rope_theta", hf_cfg.get("rotary_emb_base", 10000.0)))
    rotary_pct = rope.get("partial_rotary_factor", hf_cfg.get("rotary_pct", 0.25 if has_bias else 1.0))

    n_kv_heads = hf_cfg.get("num_key_value_heads") or n_heads
    fields = dict(
        family=family,
        dim=dim,
        n_layers=need("num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=0 if n_kv_heads == n_heads else n_kv_heads,
        ffn_dim=need("intermediate_size"),
        vocab_size=need("vocab_size"),
        max_seq_len=need("max_position_embeddings"),
        norm_eps=need("layer_norm_eps" if has_bias else "rms_norm_eps"),
        rope_theta=theta,
        rotary_pct=rotary_pct,
        tie_embeddings=hf_cfg.get("tie_word_embeddings", False),
        init_std=hf_cfg.get("initializer_range", ModelConfig.init_std),
    )
    if has_bias:
        fields["parallel_residual"] = hf_cfg.get("use_parallel_residual", True)
    if kind == "mixtral":
        fields.update(mixtral_fields(hf_cfg, need))
    return update(ModelConfig(), fields, "model.").validate()


def mixtral_fields(hf_cfg: dict, need) -> dict:
    """The expert fields of a Mixtral config (which attends to every earlier position: no sliding window)."""
    window = hf_cfg.get("sliding_window")
    if window is not None and window < need("max_position_embeddings"):
        raise HlatError(f"sliding_window={window} is not supported (only full attention: null)")
    return dict(
        n_experts=need("num_local_experts"),
        experts_per_token=need("num_experts_per_tok"),
        aux_loss_coef=hf_cfg.get("router_aux_loss_coef", 0.001),  # transformers' default
    )


def model_config_to_hf_config(cfg: ModelConfig) -> dict:
    """A config.json dict that transformers 5 (`rope_parameters`) and 4 (top-level rotary fields, which it
    would otherwise fill with its defaults without a word) both read as this model."""
    spec = _FAMILIES[_kind(cfg)]
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    hf = dict(
        architectures=[spec.architecture],
        model_type=spec.model_type,
        hidden_size=cfg.dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        intermediate_size=cfg.ffn_dim,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_seq_len,
        tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_std,
        rope_parameters=rope,
        rope_scaling=None,
        **spec.fixed,
    )
    if cfg.family == "llama":
        hf.update(
            num_key_value_heads=cfg.kv_heads,
            head_dim=cfg.head_dim,
            rms_norm_eps=cfg.norm_eps,
            rope_theta=cfg.rope_theta,
        )
    if cfg.moe:  # capacity is hlat's training alone: its inference routes every token, as transformers' does
        hf.update(
            num_local_experts=cfg.n_experts,
            num_experts_per_tok=cfg.experts_per_token,
            router_aux_loss_coef=cfg.aux_loss_coef,
            sliding_window=None,
        )
    else:
        rope["partial_rotary_factor"] = cfg.rotary_pct
        hf.update(
            layer_norm_eps=cfg.norm_eps,
            use_parallel_residual=cfg.parallel_residual,
            rotary_pct=cfg.rotary_pct,
            rotary_emb_base=cfg.rope_theta,
        )
    return hf


# --- weights ---------------------------------------------------------------------------------------


def _rotary_perm(cfg: ModelConfig) -> torch.Tensor:
    """hlat head dimension i holds HF head dimension perm[i] (see the module docstring)."""
    hd, rot = cfg.head_dim, cfg.rotary_dim
    half_rot, half_pass, d = rot // 2, (hd - rot) // 2, torch.arange(hd)
    return torch.cat([d[:half_rot], d[rot : rot + half_pass], d[half_rot:rot], d[rot + half_pass :]])


def _permute_heads(t: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Reorder the dimensions inside every head of a q/k weight [heads * head_dim, dim] or bias."""
    return t.unflatten(0, (-1, len(perm)))[:, perm].flatten(0, 1)


def _params(cfg: ModelConfig) -> tuple[str, ...]:
    return ("weight", "bias") if cfg.has_bias else ("weight",)


def _renames(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(hlat key, HF key) of every tensor that only changes its name: all but q, k and v."""
    spec, params = _FAMILIES[_kind(cfg)], _params(cfg)
    pairs = [("tok_embeddings.weight", f"{spec.prefix}{spec.embedding}.weight")]
    for i in range(cfg.n_layers):
        pairs += [
            (f"layers.{i}.{ours}.{p}", f"{spec.prefix}layers.{i}.{theirs}.{p}")
            for ours, theirs in spec.layer.items()
            for p in params
        ]
    pairs += [(f"norm.{p}", f"{spec.prefix}{spec.final_norm}.{p}") for p in params]
    if not cfg.tie_embeddings:
        pairs.append(("output.weight", spec.output))
    return pairs


def _get(state: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in state:
        raise HlatError(f"missing tensor {key!r}")
    return state[key]


def hlat_state_to_hf(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors from an hlat state dict (tensors are shared or views where no reordering is needed)."""
    spec, inverse = _FAMILIES[_kind(cfg)], torch.argsort(_rotary_perm(cfg))
    out = {theirs: _get(state, ours) for ours, theirs in _renames(cfg)}
    for i in range(cfg.n_layers if cfg.moe else 0):
        for w in _EXPERTS:
            stacked = _get(state, f"layers.{i}.feed_forward.experts.{w}")
            out.update({_expert_key(i, j, w): t for j, t in enumerate(stacked.unbind(0))})
    for i in range(cfg.n_layers):
        src, dst = f"layers.{i}.", f"{spec.prefix}layers.{i}."
        for p in _params(cfg):
            q, k, v = (_get(state, f"{src}attention.{w}.{p}") for w in ("wq", "wk", "wv"))
            q, k = _permute_heads(q, inverse), _permute_heads(k, inverse)
            if cfg.family == "llama":
                out.update({f"{dst}{_LLAMA_QKV[w]}.{p}": t for w, t in zip(("wq", "wk", "wv"), (q, k, v))})
            else:
                heads = [t.unflatten(0, (cfg.n_heads, cfg.head_dim)) for t in (q, k, v)]
                out[f"{dst}{_NEOX_QKV}.{p}"] = torch.stack(heads, dim=1).flatten(0, 2)
    return out


def _expert_key(layer: int, expert: int, matrix: str) -> str:
    return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{matrix}.weight"


def _unfused(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Mixtral's tensors as on disk, from transformers 5's fused ones in memory (`mlp.gate.weight`,
    `mlp.experts.gate_up_proj` [experts, 2 ffn, dim] and `mlp.experts.down_proj`); other tensors as they are."""
    out = {}
    for key, t in hf_state.items():
        layer, fused, name = key.partition(".mlp.")
        if not fused or not name.startswith(("gate.", "experts.")):
            out[key] = t
        elif name == "gate.weight":
            out[f"{layer}.block_sparse_moe.gate.weight"] = t
        else:
            i = int(layer.rsplit(".", 1)[1])
            matrices = dict(zip(("w1", "w3"), t.chunk(2, dim=1))) if name.endswith("gate_up_proj") else {"w2": t}
            for w, stacked in matrices.items():
                out.update({_expert_key(i, j, w): expert for j, expert in enumerate(stacked.unbind(0))})
    return out


def _check_hf_state(cfg: ModelConfig, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors the config calls for, after checking that none is missing, unexpected or misshapen."""
    spec = _FAMILIES[_kind(cfg)]
    hf_state = _unfused(hf_state) if cfg.moe else dict(hf_state)
    for alias in spec.output_aliases:
        if alias in hf_state:
            hf_state.setdefault(spec.output, hf_state.pop(alias))
    expected = hlat_state_to_hf(cfg, build_model(cfg).state_dict())  # shapes only: built on meta
    for key, t in expected.items():
        if key not in hf_state:
            raise HlatError(f"missing tensor {key!r}")
        if hf_state[key].shape != t.shape:
            raise HlatError(f"tensor {key!r} has shape {list(hf_state[key].shape)}, config implies {list(t.shape)}")
    # A tied checkpoint may still store the output matrix; it is the embedding again.
    extra = [k for k in hf_state if k not in expected and not _IGNORED.search(k) and k != spec.output]
    if extra:
        raise HlatError(f"unexpected tensor {extra[0]!r} ({len(extra)} unexpected in all)")
    return {k: hf_state[k] for k in expected}


def hf_state_to_hlat(cfg: ModelConfig, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An hlat state dict (loadable with strict=True) from HF tensors."""
    hf_state = _check_hf_state(cfg, hf_state)
    spec, perm = _FAMILIES[_kind(cfg)], _rotary_perm(cfg)
    out = {ours: hf_state[theirs] for ours, theirs in _renames(cfg)}
    for i in range(cfg.n_layers if cfg.moe else 0):
        for w in _EXPERTS:
            experts = [hf_state[_expert_key(i, j, w)] for j in range(cfg.n_experts)]
            out[f"layers.{i}.feed_forward.experts.{w}"] = torch.stack(experts)
    for i in range(cfg.n_layers):
        src, dst = f"{spec.prefix}layers.{i}.", f"layers.{i}."
        for p in _params(cfg):
            if cfg.family == "llama":
                q, k, v = (hf_state[f"{src}{_LLAMA_QKV[w]}.{p}"] for w in ("wq", "wk", "wv"))
            else:
                fused = hf_state[f"{src}{_NEOX_QKV}.{p}"].unflatten(0, (cfg.n_heads, 3, cfg.head_dim))
                q, k, v = (t.flatten(0, 1) for t in fused.unbind(1))
            out.update(
                {
                    f"{dst}attention.wq.{p}": _permute_heads(q, perm),
                    f"{dst}attention.wk.{p}": _permute_heads(k, perm),
                    f"{dst}attention.wv.{p}": v,
                }
            )
    if cfg.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


# --- directories -----------------------------------------------------------------------------------

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise HlatError(f"{path}: not found")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HlatError(f"{path}: invalid JSON: {e}") from None


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise HlatError(f"{path}: not found")
    try:
        return load_file(path)
    except (SafetensorError, OSError) as e:
        raise HlatError(f"{path}: unreadable safetensors file: {e}") from None


def read_hf_dir(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and hlat state dict of a HF model directory (model.safetensors or sharded with an index)."""
    path = Path(path)
    if not path.is_dir():
        raise HlatError(f"{path}: not a directory")
    config_file = path / "config.json"
    hf_cfg = _read_json(config_file)
    try:
        cfg = hf_config_to_model_config(hf_cfg)
    except HlatError as e:
        raise HlatError(f"{config_file}: {e}") from None
    if (path / SINGLE_FILE).is_file():
        files = [path / SINGLE_FILE]
    elif (path / INDEX_FILE).is_file():
        weight_map = _read_json(path / INDEX_FILE).get("weight_map")
        if not isinstance(weight_map, dict):
            raise HlatError(f"{path / INDEX_FILE}: missing field 'weight_map'")
        files = [path / name for name in sorted(set(weight_map.values()))]
    else:
        raise HlatError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors weights are supported)")
    hf_state = {}
    for file in files:
        hf_state.update(_load_safetensors(file))
    try:
        return cfg, hf_state_to_hlat(cfg, hf_state)
    except HlatError as e:
        raise HlatError(f"{path}: {e}") from None


def _save_weights(tensors: dict[str, torch.Tensor], file: Path) -> None:
    """A safetensors file with the permissions of the config.json beside it (the umask's): safetensors itself
    creates its files readable by their owner only."""
    save_file(tensors, file, metadata={"format": "pt"})  # transformers 4 refuses files without the format
    shutil.copymode(file.parent / "config.json", file)


def write_hf_dir(
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    path: str | Path,
    max_shard_bytes: int = 5 * 10**9,
    special_tokens: dict[str, int] | None = None,
) -> None:
    """Write config.json, generation_config.json and the weights in HF layout; sharded with an index past
    `max_shard_bytes`. `special_tokens` ({"bos_token_id": .., "eos_token_id": ..}) go into both configs."""
    path = Path(path)
    if (path / "config.json").exists() or any(path.glob("model*.safetensors*")):
        raise HlatError(f"{path}: already holds a model; export into a new directory")
    hf_state = {k: t.detach().cpu().contiguous() for k, t in hlat_state_to_hf(cfg, state).items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in hf_state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    path.mkdir(parents=True, exist_ok=True)
    hf_cfg = model_config_to_hf_config(cfg)
    hf_cfg["dtype"] = hf_cfg["torch_dtype"] = str(state["tok_embeddings.weight"].dtype).removeprefix("torch.")
    tokens = special_tokens or {}
    hf_cfg.update(tokens)
    (path / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    # generate() reads its defaults here: stop at end of text, pad with it (the model has no pad token). No
    # max_length: transformers would warn at every generate(max_new_tokens=...) that both are set
    generation = {**tokens, **({"pad_token_id": tokens["eos_token_id"]} if "eos_token_id" in tokens else {})}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if len(shards) == 1:
        _save_weights(shards[0], path / SINGLE_FILE)
        return
    weight_map = {}
    for n, shard in enumerate(shards, 1):
        name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        _save_weights(shard, path / name)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in hf_state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
