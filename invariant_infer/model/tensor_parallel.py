"""Tensor parallelism whose bits do not depend on the TP size: a model that transformers sharded
(``from_pretrained(..., tp_plan="auto")`` under ``torchrun``) gives, on every rank, the logits of
the single-process patched model, bitwise, at every TP size the sizes divide (tested end to end at
TP 2 and 4).

transformers' plan for the supported families, and what each sharded module runs here instead of
transformers' hooks (``make_invariant`` replaces the module's forward, hooks included):
  * ``colwise`` (q/k/v, gate/up): the local weight shard, with the tile config of the FULL weight
    shape (configs are keyed by shape): each output column is reduced whole, in the order a single
    process uses. The output stays this rank's shard of heads or of the intermediate width.
  * ``rowwise`` (o_proj, down_proj with the fused silu * up prologue): K is split across ranks. The
    layer's K tree (``kernels.configs.row_parallel_config``: ``tree_leaves(K)`` leaves of K / leaves
    inputs) puts a leaf boundary on every shard boundary, so a rank computes its own leaves in fp32
    from its K shard, the ranks all-gather those fp32 leaf sums (in rank order, which is leaf
    order), and every rank adds all of them in leaf order, then the bias: one process runs the
    same tree. transformers' all-reduce for these layers does not run.
  * ``colwise_gather_output`` (lm_head): the local vocabulary slice with the full shape's config,
    then an all-gather of the slices (copies only).
  * ``embedding_rowwise`` (embed_tokens): the rows this rank holds are looked up, every other
    position is exact zeros, and the ranks' results are summed as bytes (uint8): one rank holds
    each token, so the sum copies its bits (a float sum would turn -0.0 into +0.0). Gemma's scaled
    embedding then multiplies by its ``embed_scale``, as its own forward does.
  * ``replicated_with_grad_allreduce`` (Qwen3's q/k norms): replicated weights, nothing to do.
  * ``colwise_gather_output`` on a Gated DeltaNet layer's projections (Qwen3.5): each rank computes
    its slice of the output columns with the single-process config of the full shape (out_proj's
    row-parallel K tree included), and the slices are gathered (copies). The convolution, the scan
    and the gated norm then run on every rank over all heads, from the same bits.
Inference only: the tree exchanges values, not gradients.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from transformers.integrations.tensor_parallel import replace_layer_number_by_wildcard

from ..errors import NonInvariantInputError, UnsupportedModelError
from ..kernels.configs import TREE_LEAVES, linear_config, row_parallel_config, tree_leaves
from ..kernels.fused_linear import silu_mul_linear_partials
from ..kernels.linear import combine_partials, linear, linear_partials
from ..kernels.quantized_linear import quantized_linear_config
from ..kernels.gelu_tanh_mul import gelu_tanh_mul
from ..kernels.silu_mul import silu_mul
from .cache_specs import linear_attention_layers
from .module_state import module_state, state_of

# The styles a module may carry, by role (the families' ``tp_plan="auto"``); any other is refused.
COLWISE, ROWWISE, GATHER, VOCAB_EMBEDDING, REPLICATED_NORM = (
    "colwise", "rowwise", "colwise_gather_output", "embedding_rowwise", "replicated_with_grad_allreduce")
_ROLE_STYLES = {"colwise": {COLWISE}, "rowwise": {ROWWISE}, "lm_head": {GATHER, "colwise_rep"},
                "embedding": {VOCAB_EMBEDDING}, "head_norm": {REPLICATED_NORM}, "gathered": {GATHER}}


@dataclass(frozen=True)
class TPLayout:
    size: int
    rank: int
    mesh: object        # the 1-D "tp" DeviceMesh
    group: object       # its process group


def tp_size_of(model: nn.Module) -> int:
    """The tensor-parallel size transformers loaded ``model`` at (1: one process). The one reader
    of transformers' private ``_tp_size``."""
    return getattr(model, "_tp_size", None) or 1


def tp_layout(model: nn.Module) -> TPLayout | None:
    """The TP layout transformers set on ``model`` (None for a single-process model)."""
    size = tp_size_of(model)
    mesh = getattr(model, "_device_mesh", None)
    if size <= 1 or mesh is None:
        return None
    if mesh.size() != size:
        raise UnsupportedModelError(f"the model's device mesh {mesh} combines tensor parallelism with other "
                                    "parallel dimensions; make_invariant supports tensor parallelism alone")
    names = getattr(mesh, "mesh_dim_names", None)  # transformers 5.17 builds a 1-D mesh without names
    tp_mesh = mesh["tp"] if names and "tp" in names else mesh
    return TPLayout(size=size, rank=tp_mesh.get_local_rank(), mesh=tp_mesh, group=tp_mesh.get_group())


def supported_tp_sizes(config) -> list[int]:
    """The TP sizes whose shards the K trees and the heads allow for ``config``."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    leaves = (tree_leaves(heads * head_dim), tree_leaves(config.intermediate_size))
    return [t for t in range(1, TREE_LEAVES + 1)
            if heads % t == 0 and kv_heads % t == 0 and all(n % t == 0 for n in leaves)]


def tp_size_refusal(config, size: int) -> str | None:
    """Why TP ``size`` cannot be invariant for ``config`` (None when it can)."""
    if size in supported_tp_sizes(config):
        return None
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    why = []
    if heads % size or kv_heads % size:
        why.append(f"{heads} attention heads / {kv_heads} KV heads do not split into {size} equal shards")
    for name, k in (("o_proj", heads * head_dim), ("down_proj (intermediate_size)", config.intermediate_size)):
        if tree_leaves(k) % size:
            why.append(f"{name}'s K = {k} reduces as a tree of {tree_leaves(k)} leaves (the most, up to "
                       f"{TREE_LEAVES}, whose width K / leaves is a multiple of 16), which {size} ranks cannot share")
    return (f"tensor-parallel size {size}: {'; '.join(why)}. Sizes that work for this model: "
            f"{supported_tp_sizes(config)}")


def _style_of(plan: dict, name: str) -> str | None:
    return plan.get(replace_layer_number_by_wildcard(name))


def _check_param(name: str, param, placement) -> None:
    if not isinstance(param, DTensor) or tuple(param.placements) != (placement,):
        got = tuple(param.placements) if isinstance(param, DTensor) else type(param).__name__
        raise UnsupportedModelError(f"{name} is laid out as {got}, not ({placement},) as the tree expects")


def tp_forwards(model: nn.Module, adapter, base: nn.Module, layout: TPLayout,
                quantized: dict | None = None) -> dict[nn.Module, object]:
    """The forward each sharded module runs instead of transformers' TP hooks, after checking that
    the plan and the shards are ones the invariant trees serve (else ``UnsupportedModelError``).
    Quantized layers (``quantized``: {layer: plan}, updated in place) keep ``quantized_forward``,
    on their shards (see ``_quantized_shard_plan``)."""
    quantized = {} if quantized is None else quantized
    problem = (quantized_tp_size_refusal(model, adapter, base, quantized, layout.size) if quantized
               else tp_size_refusal(model.config, layout.size))
    if problem:
        raise UnsupportedModelError(problem)
    plan = dict(getattr(model, "tp_plan", None) or {})
    names = {module: name for name, module in model.named_modules()}
    roles: dict[nn.Module, str] = {}
    row_tree: set[nn.Module] = set()
    linear = set(linear_attention_layers(model.config))
    for index, layer in enumerate(base.layers):
        for proj_name, proj in adapter.projections(layer).items():
            if proj_name.startswith("linear_attn."):
                roles[proj] = "gathered"
                if proj_name in adapter.row_parallel:
                    row_tree.add(proj)
            else:
                roles[proj] = "rowwise" if proj_name in adapter.row_parallel else "colwise"
        if index in linear:
            continue
        for norm in adapter.head_norms:
            roles[getattr(layer.self_attn, norm)] = "head_norm"
    head = model.get_output_embeddings()
    if head is not None:
        roles[head] = "lm_head"
    roles[model.get_input_embeddings()] = "embedding"
    for name, module in model.named_modules():
        style = _style_of(plan, name)
        role = roles.get(module)
        if style is not None and (role is None or style not in _ROLE_STYLES[role]):
            allowed = sorted(_ROLE_STYLES[role]) if role else "none (the module is not sharded)"
            raise UnsupportedModelError(f"tp_plan shards {name} as {style!r}; make_invariant serves {allowed} "
                                        "there (the families' tp_plan='auto')")
        if role in ("colwise", "rowwise", "gathered") and style is None:
            raise UnsupportedModelError(f"tp_plan leaves {name} unsharded; make_invariant serves the families' "
                                        "tp_plan='auto', where it is " + role)
    forwards: dict[nn.Module, object] = {}
    for module, role in roles.items():
        name = names[module]
        style = _style_of(plan, name)
        if module in quantized:
            quantized[module] = _quantized_shard_plan(name, module, quantized[module], role, layout)
            module_state(module).tensor_parallel = layout
        elif role == "colwise":
            _check_param(f"{name}.weight", module.weight, Shard(0))
            forwards[module] = _colwise_forward
        elif role == "rowwise":
            _check_param(f"{name}.weight", module.weight, Shard(1))
            if module.bias is not None:
                _check_param(f"{name}.bias", module.bias, Replicate())
            forwards[module] = _rowwise_forward
        elif role == "gathered" or (role == "lm_head" and style is not None):
            _check_param(f"{name}.weight", module.weight, Shard(0))
            if module.bias is not None:
                _check_param(f"{name}.bias", module.bias, Shard(0))
            forwards[module] = _gathered_row_tree_forward if module in row_tree else _gathered_colwise_forward
        elif role == "embedding" and style is not None:
            _check_param(f"{name}.weight", module.weight, Shard(0))
            if type(module) is not nn.Embedding and not hasattr(module, "embed_scale"):
                raise UnsupportedModelError(f"{name} is a {type(module).__name__}; the vocabulary-parallel lookup serves "
                                            "nn.Embedding and Gemma's scaled embedding")
            forwards[module] = _vocab_parallel_embedding_forward
    for layer in base.layers:
        forwards[layer.mlp] = _rowwise_gelu_tanh_mlp_forward if adapter.mlp_activation == "gelu_tanh" \
            else _rowwise_mlp_forward
    for module in forwards:
        module_state(module).tensor_parallel = layout
    return forwards


# ---- quantized layers ------------------------------------------------------------------------------
# Column shards keep whole 128-row blocks (block formats) and run with the whole weight's tiles;
# row shards hold whole leaves of the layer's K tree (``quantization.row_parallel_plan``), each
# leaf whole scale groups, so the ranks' leaf sums are the one-process tree's.

QUANTIZED_TP_FORMATS = "compressed-tensors FP8_BLOCK, and symmetric pack-quantized W4A16 / W8A16 with groups"


def _quantized_tp_refusal(name: str, module: nn.Linear, plan) -> str | None:
    weight = plan.weight
    if getattr(module, "quantization_scheme", None) is None:
        return f"{name}: transformers' fp8 format"
    block = weight.block and plan.activation_group == 128
    grouped = (weight.format == "packed" and weight.group_size and plan.activation_dtype is None
               and weight.zero_point is None)
    if block or grouped:
        return None
    if weight.zero_point is not None:
        return f"{name}: asymmetric pack-quantized weights (zero points)"
    if not (weight.block or weight.group_size):
        return f"{name}: {weight.format} weights with per-channel scales"
    return f"{name}: {weight.format} weights with {plan.activation_dtype} activations"


def _fits(module: nn.Linear, plan, role: str, size: int) -> bool:
    n = module.out_features
    if role == "colwise":
        return n % size == 0 and (not plan.weight.block or (n // size) % 128 == 0)
    return plan.k_leaves % size == 0


def quantized_tp_size_refusal(model: nn.Module, adapter, base: nn.Module, quantized: dict, size: int) -> str | None:
    """Why a quantized model cannot run at TP ``size`` (None when it can): a format the shards do
    not serve, or sizes that split a scale group, a block or the heads; names the sizes that work."""
    roles = {proj: ("rowwise" if proj_name in adapter.row_parallel else "colwise")
             for layer in base.layers for proj_name, proj in adapter.projections(layer).items()}
    names = {module: name for name, module in model.named_modules()}
    for module, plan in quantized.items():
        problem = _quantized_tp_refusal(names[module], module, plan)
        if problem:
            return (f"quantized models at tensor-parallel size {size}: {problem} is not supported; supported: "
                    f"{QUANTIZED_TP_FORMATS} (other formats run at tensor-parallel size 1)")
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads

    def works(t: int) -> bool:
        dense_rows = [m for m, role in roles.items() if role == "rowwise" and m not in quantized]
        return (heads % t == 0 and kv_heads % t == 0 and all(tree_leaves(m.in_features) % t == 0 for m in dense_rows)
                and all(_fits(m, plan, roles[m], t) for m, plan in quantized.items() if m in roles))
    if works(size):
        return None
    sizes = [t for t in range(1, TREE_LEAVES + 1) if works(t)]
    bad = [m for m, plan in quantized.items() if m in roles and not _fits(m, plan, roles[m], size)]
    if not bad:
        why = f"{heads} attention heads / {kv_heads} KV heads do not split into {size} equal shards"
    elif roles[bad[0]] == "colwise":
        why = f"{names[bad[0]]}'s {bad[0].out_features} output rows would split a 128-row weight block"
    else:
        why = (f"{names[bad[0]]}'s K = {bad[0].in_features} reduces as a tree of {quantized[bad[0]].k_leaves} "
               "leaves of whole scale groups, which the ranks cannot share")
    return f"tensor-parallel size {size}: {why}. Sizes that work for this model: {sizes}"


def _quantized_shard_plan(name: str, module: nn.Linear, plan, role: str, layout: TPLayout):
    """The plan of one quantized layer's shard: its placements checked, then the whole weight's
    tiles (column shards) or this rank's share of the K tree (row shards)."""
    stored = module.weight_packed if hasattr(module, "weight_packed") else module.weight
    placement = Shard(0) if role == "colwise" else Shard(1)
    _check_param(f"{name}.{'weight_packed' if hasattr(module, 'weight_packed') else 'weight'}", stored, placement)
    _check_param(f"{name}.weight_scale", module.weight_scale, placement)
    if module.bias is not None:
        _check_param(f"{name}.bias", module.bias, Shard(0) if role == "colwise" else Replicate())
    if role == "colwise":
        whole = replace(plan.weight, shape=(module.out_features, module.in_features))
        return replace(plan, config=quantized_linear_config(stored.device.type, whole))
    return replace(plan, k_shards=layout.size)


# ---- forwards ------------------------------------------------------------------------------------

def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _refuse_grad(module: nn.Module, x: torch.Tensor) -> None:
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in module.parameters())):
        raise NonInvariantInputError("a tensor-parallel invariant model runs inference only: call it under "
                                     "torch.no_grad() or torch.inference_mode() (or requires_grad_(False))")


def _colwise_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    _refuse_grad(self, x)
    config = linear_config(x.device.type, x.dtype, *self.weight.shape)  # the full shape's tiles
    return linear(x, _local(self.weight), _local(self.bias), config=config)


def _gathered_colwise_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """This rank's slice of the output columns, then every rank's slice gathered (copies)."""
    return _gather_output(self, _colwise_forward(self, x))


def _gathered_row_tree_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """As ``_gathered_colwise_forward``, for a layer whose single-process forward reduces K as the
    row-parallel tree (a Gated DeltaNet's out_proj): each column is reduced whole, in that order."""
    _refuse_grad(self, x)
    config = row_parallel_config(x.device.type, x.dtype, *self.weight.shape)
    return _gather_output(self, linear(x, _local(self.weight), _local(self.bias), config=config))


def _gather_output(self: nn.Linear, y: torch.Tensor) -> torch.Tensor:
    """Every rank's slice of the output columns, gathered in rank order (copies). The slices are
    torch.chunk's (DTensor's Shard(0)): ceil(N / t) columns each, the last ones fewer or none."""
    layout = state_of(self).tensor_parallel
    columns, width = self.out_features, -(-self.out_features // layout.size)
    rows = y.reshape(-1, y.shape[-1])
    if rows.shape[-1] < width:
        rows = torch.nn.functional.pad(rows, (0, width - rows.shape[-1]))
    gathered = rows.new_empty((layout.size * rows.shape[0], width))
    _all_gather(gathered, rows.contiguous(), group=layout.group)
    full = gathered.view(layout.size, rows.shape[0], width).transpose(0, 1).reshape(rows.shape[0], -1)[:, :columns]
    return full.reshape(*y.shape[:-1], columns)


# torch 2.13 renames all_gather_into_tensor (and deprecates the old name); earlier releases have the old only.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def lora_layout(layer: nn.Linear) -> tuple[TPLayout | None, bool]:
    """(the TP layout of a projection ``tp_forwards`` serves, or None; whether its output columns
    are sharded, i.e. column-parallel) for the adapter slots on it (``lora.SlotWeights``)."""
    state = state_of(layer)
    layout = state.tensor_parallel if state is not None else None
    if layout is None:
        return None, False
    return layout, tuple(layer.weight.placements) == (Shard(0),)


def gather_columns(x: torch.Tensor, layout: TPLayout) -> torch.Tensor:
    """[M, K] from each rank's [M, K / t] (rank order is K order): copies."""
    gathered = x.new_empty((layout.size * x.shape[0], x.shape[1]))
    _all_gather(gathered, x.contiguous(), group=layout.group)
    return gathered.view(layout.size, *x.shape).permute(1, 0, 2).reshape(x.shape[0], -1)


def exchange_partials(parts: torch.Tensor, bias, dtype: torch.dtype, layout: TPLayout) -> torch.Tensor:
    """All-gather the ranks' fp32 leaf sums [leaves / t, M, N] into [leaves, M, N] (rank order is
    leaf order) and add them in leaf order, then the bias: the single-process tree's bits."""
    gathered = parts.new_empty((parts.shape[0] * layout.size, *parts.shape[1:]))
    _all_gather(gathered, parts.contiguous(), group=layout.group)
    return combine_partials(gathered, bias, dtype)


def _rank_config(self: nn.Linear, x: torch.Tensor, layout: TPLayout):
    """The layer's full K tree, restricted to this rank's leaves (same BLOCK_K, same leaf width)."""
    full = row_parallel_config(x.device.type, x.dtype, *self.weight.shape)
    return replace(full, k_chunks=full.k_chunks // layout.size)


def _rowwise_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    _refuse_grad(self, x)
    layout = state_of(self).tensor_parallel
    weight = _local(self.weight)
    parts = linear_partials(x, weight, _rank_config(self, x, layout))
    y = exchange_partials(parts, _local(self.bias), x.dtype, layout)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _rowwise_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    down = self.down_proj
    gate, up = self.gate_proj(x), self.up_proj(x)  # this rank's shards of the intermediate width
    _refuse_grad(down, gate)
    if getattr(down.forward, "__func__", None) is not _rowwise_forward:  # adapter slots need the product itself
        return down(silu_mul(gate, up))
    layout = state_of(self).tensor_parallel
    weight = _local(down.weight)
    parts = silu_mul_linear_partials(gate, up, weight, _rank_config(down, gate, layout))
    y = exchange_partials(parts, _local(down.bias), gate.dtype, layout)
    return y.reshape(*gate.shape[:-1], weight.shape[0])


def _rowwise_gelu_tanh_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)  # this rank's shards of the intermediate width
    _refuse_grad(self.down_proj, gate)
    return self.down_proj(gelu_tanh_mul(gate, up))  # the row-parallel tree's exchange


def _vocab_parallel_embedding_forward(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    layout = state_of(self).tensor_parallel
    local = _local(self.weight)
    vocab = self.weight.shape[0]
    start = layout.rank * -(-vocab // layout.size)  # torch.chunk's shards, as DTensor's Shard(0)
    if not torch.compiler.is_compiling() and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise NonInvariantInputError(f"token ids must lie in [0, {vocab}), got {int(ids.min())}..{int(ids.max())}")
    mine = (ids >= start) & (ids < start + local.shape[0])
    rows = torch.nn.functional.embedding((ids - start).clamp(0, max(local.shape[0] - 1, 0)), local)
    out = torch.where(mine[..., None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device)).contiguous()
    dist.all_reduce(out.view(torch.uint8), group=layout.group)  # one nonzero term per byte: a copy
    scale = getattr(self, "embed_scale", None)  # Gemma's sqrt(hidden), as its own forward applies it
    return out if scale is None else out * scale.to(local.dtype)
