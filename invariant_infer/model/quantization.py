"""Quantized checkpoints (compressed-tensors, transformers' fp8) kept compressed and run on the invariant quantized GEMM.

``AutoModelForCausalLM.from_pretrained`` of a compressed-tensors checkpoint leaves each quantized
layer an ``nn.Linear`` holding its compressed tensors (``weight`` in fp8/int8, or ``weight_packed``
int32 with ``weight_scale``), plus a pre-hook on the top-level model that would decompress every
layer to the float dtype on the first forward. ``quantized_layers`` reads each layer's scheme and
refuses what cannot run batch-invariantly here; ``make_invariant`` then removes that hook (the
packed tensors stay in memory) and gives each layer ``quantized_forward``.

Activations: a dynamic scale is computed per token (per 128-wide group for block formats), so a
row's numbers never depend on its batch. A checkpoint asking for a dynamic *per-tensor* scale,
the max over every token in the batch, gets a per-token one with a warning (``strict=True``
refuses it). Static scales are constants and kept.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ..errors import UnsupportedModelError
from ..kernels import QuantizedWeight, quantize_activations, quantized_linear, quantized_linear_autograd
from ..kernels.linear import combine_partials
from ..kernels.quantized_linear import QuantizedLinearConfig, quantized_linear_partials, quantized_tree_leaves
from ..kernels.quantized_weight import BLOCK
from . import tensor_parallel
from .module_state import state_of

SUPPORTED_SCHEMES = ("FP8_DYNAMIC (fp8 weights per channel, fp8 per-token activations)",
                     "FP8_BLOCK (fp8 128x128 weight blocks, fp8 activations per 128-group)",
                     "W8A8 (int8 weights per channel, int8 per-token activations)",
                     "FP8 (fp8 weights, a static activation scale)",
                     "W4A16 / W8A16 pack-quantized (scales per group along K, zero points if asymmetric)",
                     "transformers' fp8 (weight_block_size [128, 128] or per tensor, dynamic activations)")
_SUPPORTED = "supported quantized checkpoints: " + "; ".join(SUPPORTED_SCHEMES)
_FP8_MAX = 448.0


@dataclass(frozen=True)
class QuantizedLinearPlan:
    """How one layer runs: its compressed weight, and how activations are quantized (None: not)."""
    weight: QuantizedWeight
    activation_dtype: torch.dtype | None = None   # float8_e4m3fn or int8
    activation_group: int | None = None           # 128 for block formats, None per token
    static_scale: bool = False                    # the layer's own input_scale, a constant
    k_leaves: int = 1          # row-parallel layers: K reduced as a tree of this many leaves
    k_shards: int = 1          # tensor parallelism: the ranks the leaves are split over
    config: QuantizedLinearConfig | None = None  # a column shard's tiles: the whole weight's


def row_parallel_plan(plan: QuantizedLinearPlan, k: int) -> QuantizedLinearPlan:
    """A row-parallel layer's plan (o_proj, down_proj): group and block formats reduce K as a tree
    whose leaves hold whole scale groups (``quantized_tree_leaves``), at every TP size alike."""
    return replace(plan, k_leaves=quantized_tree_leaves(plan.weight, k))


def _refuse(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{what} is not supported; {_SUPPORTED}")


def _value(field) -> str:
    return str(getattr(field, "value", field)).lower()


def _checkpoint_config(model: nn.Module) -> dict:
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    if config is None:
        return {}
    return config if isinstance(config, dict) else config.to_dict()


def describe_quantization(model: nn.Module) -> str:
    """The checkpoint's quantization in a few words ("unquantized" for a dense model)."""
    config = _checkpoint_config(model)
    method = config.get("quant_method")
    if method == "fp8":
        return f"fp8 (transformers' format, weight blocks {config.get('weight_block_size') or 'per tensor'})"
    if method == "compressed-tensors":
        return f"compressed-tensors {config.get('format')}"
    return str(method or "unquantized")


def quantization_method(model: nn.Module) -> str | None:
    """The checkpoint's ``quant_method`` ("compressed-tensors", "fp8", ...), None for a dense model."""
    return _checkpoint_config(model).get("quant_method")


def is_quantized(model: nn.Module) -> bool:
    return bool(_checkpoint_config(model)) or getattr(model, "hf_quantizer", None) is not None


def _check_checkpoint(config: dict) -> None:
    method = config.get("quant_method")
    if method != "compressed-tensors":
        raise _refuse(f"quantization method {method!r}")
    if config.get("dequantize") or config.get("run_compressed") is False:
        raise UnsupportedModelError("the checkpoint was loaded with dequantize=True, which silently drops activation "
                                    "quantization: load it without a quantization_config override")
    if config.get("kv_cache_scheme"):
        raise _refuse("a quantized KV-cache scheme (kv_cache_scheme)")
    sparsity = config.get("sparsity_config") or {}
    if sparsity:
        raise _refuse(f"sparsity ({sparsity.get('format', 'sparse')}, e.g. 2:4)")
    if config.get("transform_config"):
        raise _refuse("a transform (rotation) config")


def _weight_of(name: str, module: nn.Linear, args) -> QuantizedWeight:
    kind, bits, strategy = _value(args.type), args.num_bits, _value(args.strategy)
    if kind == "float" and bits == 4:
        raise _refuse(f"{name}: fp4 weights (NVFP4/MXFP4)")
    if getattr(args, "actorder", None) is not None or hasattr(module, "weight_g_idx"):
        raise _refuse(f"{name}: GPTQ activation ordering (actorder with g_idx)")
    scale = local_tensor(module.weight_scale.data)
    if hasattr(module, "weight_packed"):
        if kind != "int" or bits not in (4, 8) or strategy not in ("group", "channel"):
            raise _refuse(f"{name}: pack-quantized {kind}{bits} {strategy} weights")
        group = args.group_size if strategy == "group" else None
        packed = module.weight_packed.data
        return QuantizedWeight("packed", local_tensor(packed), scale, local_shape(module, packed), bits=bits,
                               group_size=group, zero_point=_packed_zero_point(name, module, args, scale))
    shape = local_shape(module, getattr(module, "weight", None))
    if not args.symmetric or hasattr(module, "weight_zero_point") and module.weight_zero_point.abs().max() != 0:
        raise _refuse(f"{name}: asymmetric {kind}{bits} weights (zero points; supported for pack-quantized int4/int8)")
    weight = getattr(module, "weight", None)
    stored = None if weight is None else weight.dtype
    data = None if weight is None else local_tensor(weight.data)
    if kind == "float" and bits == 8 and stored == torch.float8_e4m3fn:
        if strategy == "block" and list(args.block_structure) == [128, 128]:
            return QuantizedWeight("fp8", data, scale, shape, block=True)
        if strategy in ("channel", "tensor"):
            return QuantizedWeight("fp8", data, _per_channel(scale, shape[0]), shape)
    if kind == "int" and bits == 8 and stored == torch.int8 and strategy in ("channel", "tensor"):
        return QuantizedWeight("int8", data, _per_channel(scale, shape[0]), shape)
    raise _refuse(f"{name}: {kind}{bits} {strategy} weights stored as {stored}")


def _packed_zero_point(name: str, module: nn.Linear, args, scale: torch.Tensor) -> torch.Tensor | None:
    # Kept as stored: int32 words packing 32 / bits zero points along N, one column per scale group.
    zero_point = getattr(module, "weight_zero_point", None)
    if isinstance(zero_point, DTensor) and not args.symmetric:
        raise _refuse(f"{name}: asymmetric pack-quantized weights at tensor-parallel size > 1")
    if args.symmetric:
        if zero_point is not None and zero_point.abs().max() != 0:
            raise _refuse(f"{name}: zero points on symmetric weights")
        return None
    expected = (-(-module.out_features * args.num_bits // 32), scale.shape[1])
    if zero_point is None or zero_point.dtype != torch.int32 or tuple(zero_point.shape) != expected:
        found = None if zero_point is None else (zero_point.dtype, tuple(zero_point.shape))
        raise _refuse(f"{name}: asymmetric weights need packed int32 zero points of shape {expected}, found {found}")
    return zero_point.data


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a tensor transformers sharded for tensor parallelism (else ``t``)."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_shape(module: nn.Linear, stored: torch.Tensor | None) -> tuple[int, int]:
    """The dense (N, K) of this rank's shard of ``module``'s weight, from how ``stored`` (a
    compressed tensor laid out [N, K or packed K]) is sharded: Shard(0) splits N, Shard(1) K."""
    n, k = module.out_features, module.in_features
    if not isinstance(stored, DTensor):
        return n, k
    local = stored.to_local()
    placement = tuple(stored.placements)
    if placement == (Shard(0),):
        return local.shape[0], k
    if placement == (Shard(1),):
        return n, k * local.shape[1] // stored.shape[1]
    return n, k


def _per_channel(scale: torch.Tensor, n: int) -> torch.Tensor:
    # A per-tensor weight scale is one value per channel, repeated (the same products).
    return scale.reshape(-1, 1).expand(n, 1).contiguous() if scale.numel() == 1 else scale.reshape(n, 1)


def _activations_of(name: str, module: nn.Linear, weight: QuantizedWeight, args, strict: bool) -> dict:
    if args is None:
        if weight.format != "packed" and weight.format != "fp8":
            raise _refuse(f"{name}: {weight.format} weights with float activations")
        return {}
    kind, bits, strategy = _value(args.type), args.num_bits, _value(args.strategy)
    target = {("float", 8): torch.float8_e4m3fn, ("int", 8): torch.int8}.get((kind, bits))
    if target is None or weight.format == "packed" or (target == torch.int8) != (weight.format == "int8"):
        raise _refuse(f"{name}: {kind}{bits} activations with {weight.format} weights")
    if not args.symmetric:
        raise _refuse(f"{name}: asymmetric activations")
    if not args.dynamic:
        if strategy != "tensor" or target != torch.float8_e4m3fn or weight.block:
            raise _refuse(f"{name}: static {kind}{bits} {strategy} activation scales")
        return {"activation_dtype": target, "static_scale": True}
    if strategy == "tensor":
        message = (f"{name}: the checkpoint asks for a dynamic per-tensor activation scale, the max over every token "
                   "in the batch, which makes each row depend on its batch")
        if strict:
            raise UnsupportedModelError(message + "; make_invariant(model, strict=False) uses per-token scales instead")
        _warn_once(message + "; using a per-token scale instead (pass strict=True to refuse)")
        strategy = "token"
    if strategy == "token" and not weight.block:
        return {"activation_dtype": target}
    if strategy == "group" and args.group_size == 128 and weight.block:
        return {"activation_dtype": target, "activation_group": 128}
    raise _refuse(f"{name}: dynamic {strategy} activations (group size {args.group_size}) with "
                  f"{'block' if weight.block else 'per-channel'} weights")


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    key = message.split(":", 1)[1]
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=4)


def quantized_layers(model: nn.Module, strict: bool = False) -> dict[nn.Module, QuantizedLinearPlan]:
    """Every compressed layer of a loaded compressed-tensors model with how it will run, or the
    reason it cannot (``UnsupportedModelError``). Empty for a model that is not quantized."""
    config = _checkpoint_config(model)
    if not config and getattr(model, "hf_quantizer", None) is None:
        return {}
    if config.get("quant_method") == "fp8":
        return _fp8_layers(model, config)
    _check_checkpoint(config)
    plans = {}
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        if type(module) is not nn.Linear or scheme.weights is None:
            raise _refuse(f"{name}: a quantized {type(module).__name__}" + ("" if scheme.weights else " without "
                                                                                   "weight quantization"))
        if getattr(scheme, "output_activations", None) is not None:
            raise _refuse(f"{name}: output activation quantization")
        status = _value(getattr(module, "quantization_status", "compressed"))
        if status != "compressed":
            raise UnsupportedModelError(f"{name} is {status}, not compressed: make_invariant runs a model as loaded, "
                                        "before its first stock forward decompresses it")
        weight = _weight_of(name, module, scheme.weights)
        plans[module] = QuantizedLinearPlan(weight, **_activations_of(name, module, weight,
                                                                      scheme.input_activations, strict))
        if plans[module].activation_dtype is None and getattr(model, "dtype", None) == torch.float32:
            raise UnsupportedModelError(f"{name}: weight-only quantized layers run in bf16 or fp16 activations, "
                                        "not float32: load with dtype=torch.bfloat16 (--dtype bf16)")
    return plans


def _fp8_layers(model: nn.Module, config: dict) -> dict[nn.Module, QuantizedLinearPlan]:
    """transformers' own ``fp8`` format: ``FP8Linear`` layers with fp8 weights and inverse scales
    (``weight_scale_inv``) per 128x128 block, or one per tensor; activations dynamic, per token
    and 128-wide group for blocks (as transformers' fp8 kernels quantize them), else per token."""
    if config.get("dequantize"):
        raise UnsupportedModelError("the fp8 checkpoint was loaded with dequantize=True, which drops activation "
                                    "quantization: load it without a quantization_config override")
    if config.get("scale_fmt", "float") != "float":
        raise _refuse(f"fp8 with {config['scale_fmt']} (MXFP8) scales")
    if config.get("modules_to_convert"):
        raise _refuse("fp8 embeddings (modules_to_convert)")
    plans = {}
    for name, module in model.named_modules():
        kind = type(module).__name__
        if not type(module).__module__.startswith("transformers.integrations.finegrained_fp8"):
            continue
        if kind == "FP8Experts":  # model.quantized_experts
            continue
        if kind != "FP8Linear":
            raise _refuse(f"{name}: a quantized {kind} (embeddings, grouped linears)")
        if module.weight.dtype != torch.float8_e4m3fn:
            raise _refuse(f"{name}: {module.weight.dtype} weights in the fp8 format (NVFP4/MXFP4)")
        if module.activation_scheme != "dynamic":
            raise _refuse(f"{name}: {module.activation_scheme} activation scales in transformers' fp8 format")
        shape, block = (module.out_features, module.in_features), module.block_size
        if block is None:
            weight = QuantizedWeight("fp8", module.weight.data, _per_channel(module.weight_scale_inv.data, shape[0]),
                                     shape)
            plans[module] = QuantizedLinearPlan(weight, torch.float8_e4m3fn)
        elif list(block) == [128, 128] and shape[1] % 128 == 0:
            weight = QuantizedWeight("fp8", module.weight.data, module.weight_scale_inv.data, shape, block=True)
            plans[module] = QuantizedLinearPlan(weight, torch.float8_e4m3fn, activation_group=128)
        else:
            raise _refuse(f"{name}: fp8 blocks {list(block)} with {shape[1]} input features (blocks [128, 128] "
                          "need a multiple of 128)")
    return plans


def dequantize_fp8(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The dense [N, K] weight of an fp8 one in ``dtype``: each value times its block's (or channel's)
    inverse scale in fp32, then cast, as transformers dequantizes its fp8 format; a last block of fewer
    than 128 rows or columns takes its own scale. Elementwise, once, outside any forward."""
    if weight.format != "fp8":
        raise _refuse(f"dequantizing {weight.format} weights")
    n, k = weight.shape
    scale = weight.scale.float()
    if weight.block:
        scale = scale.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    return (weight.data.float() * scale).to(dtype)


_COMPRESSED = ("weight", "weight_packed", "weight_scale", "weight_scale_inv", "weight_zero_point", "input_scale",
               "gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv")  # FP8Experts' last


def freeze_compressed(module: nn.Module) -> None:
    """Loaders mark every parameter trainable; a compressed weight has no gradient, so a plain
    forward with autograd on must not look like training it (one set trainable later is refused)."""
    for name in _COMPRESSED:
        param = getattr(module, name, None)
        if isinstance(param, torch.Tensor) and param.requires_grad:
            param.requires_grad_(False)


def quantized_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The layer on its compressed weight: quantize x per token (or by its static scale), then
    the invariant quantized GEMM; weight-only layers multiply in x's dtype. With autograd
    recording, x (and a trainable bias) get gradients; the compressed weight stays frozen."""
    if torch.is_grad_enabled():
        trainable = [name for name in _COMPRESSED if getattr(getattr(self, name, None), "requires_grad", False)]
        if trainable:
            raise UnsupportedModelError(
                f"quantized weights are frozen (no gradient for {', '.join(trainable)}): train LoRA adapters on "
                "them (QLoRA), freeze the base (PEFT does), or run under torch.no_grad()")
        if x.requires_grad or self.bias is not None and self.bias.requires_grad:
            plan = state_of(self).quantized
            return quantized_linear_autograd(x, plan.weight, self.bias, lambda x: _quantized_forward(self, x))
    return _quantized_forward(self, x)


def _quantized_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    state = state_of(self)
    plan: QuantizedLinearPlan = state.quantized
    bias = None if self.bias is None else local_tensor(self.bias).detach()
    x2 = x.reshape(-1, x.shape[-1])
    q, scale = x2, None
    if plan.activation_dtype is not None and plan.static_scale:
        q, scale = _static_fp8(x2, self.input_scale)
    elif plan.activation_dtype is not None:
        q, scale = quantize_activations(x2, plan.activation_dtype, plan.activation_group)
    if plan.k_leaves > 1:  # a row-parallel layer: its K tree, this rank's leaves when K is sharded
        parts = quantized_linear_partials(q, plan.weight, plan.k_leaves // plan.k_shards, x_scale=scale)
        if plan.k_shards > 1:
            y = tensor_parallel.exchange_partials(parts, bias, x.dtype, state.tensor_parallel)
        else:
            y = combine_partials(parts, bias, x.dtype)
    else:
        y = quantized_linear(q, plan.weight, bias, x_scale=scale, out_dtype=x.dtype, config=plan.config)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _static_fp8(x2: torch.Tensor, input_scale: torch.Tensor):
    # Elementwise with a constant scale: division and the fp8 cast are correctly rounded, so each
    # value depends on itself alone. Rounded through x's dtype as compressed-tensors does.
    scale = input_scale.reshape(()).to(x2.dtype).float()
    q = (x2.float() / scale).to(x2.dtype).float().clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.reshape(1, 1).expand(x2.shape[0], 1).contiguous()


def detach_decompression(model: nn.Module):
    """Remove compressed-tensors' decompress-on-first-forward hook; returns how to put it back."""
    quantizer = getattr(model, "hf_quantizer", None)
    compressor = getattr(quantizer, "compressor", None)
    if compressor is None or not hasattr(model, "ct_decompress_hook"):
        return None
    compressor.remove_decompression_hook(model)
    return lambda: compressor.add_decompress_hook(model)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters as held in memory (compressed tensors counted as stored), with
    the weights ``make_invariant`` dequantized beside them (an fp8 latent attention's kv_b_proj)."""
    seen, total = set(), 0
    kept = [state.dequantized_weight for state in map(state_of, model.modules())
            if state is not None and state.dequantized_weight is not None]
    for tensor in list(model.parameters()) + list(model.buffers()) + kept:
        if tensor.data_ptr() in seen:  # tied embeddings count once
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    return total


def prepare_for_peft(model: nn.Module) -> nn.Module:
    """Let ``peft.get_peft_model`` wrap compressed layers (QLoRA) as it wraps a dense model's. PEFT
    reads a base layer's ``weight`` (a packed layer has ``weight_packed`` instead), and gives the
    adapters the device of ``weight`` or GPTQ's ``qweight`` and the dtype of ``compute_dtype`` or
    ``weight`` (fp8 weights would round the initial adapters to fp8). Each compressed layer gets
    ``compute_dtype``, the model's float dtype, and a packed one also ``weight = None`` and
    ``qweight``, the packed tensor: plain attributes, not parameters, not saved. Returns the model."""
    dtype = model.get_input_embeddings().weight.dtype
    for module in model.modules():
        fp8_format = type(module).__name__ == "FP8Linear"  # transformers' fp8 format
        if not isinstance(module, nn.Linear) or (getattr(module, "quantization_scheme", None) is None
                                                 and not fp8_format):
            continue
        module.__dict__["compute_dtype"] = dtype
        packed = module._parameters.get("weight_packed")
        if packed is not None and "weight" not in module._parameters:
            module.__dict__["weight"], module.__dict__["qweight"] = None, packed
    return model
