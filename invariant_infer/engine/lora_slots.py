"""Multi-LoRA serving: the engine's adapter registry, its device slots and each step's rows per adapter.

    engine = Engine(model, tokenizer, max_loras=4, max_lora_rank=16)
    engine.add_lora("sql", "path/to/peft-adapter")          # a PEFT adapter folder, a PeftModel,
    engine.generate(prompts, params, lora=["sql", None])    # or a (LoraConfig, state_dict) pair

Every projection of the model gets ``max_loras`` slots (``invariant_infer.model.lora.SlotWeights``),
allocated once. An adapter is kept on the host and copied into a slot when a request that uses it is
admitted; a slot whose adapter no running request uses is reused, least recently used first, and a
request whose adapter finds no slot waits (first come, first served). Each step's rows are grouped by
adapter and each group runs its adapter at its own rank, through the same kernels and operations as
a ``PeftModel`` under ``make_invariant``: a row's logits are bitwise those of its request alone with
its adapter (and of ``score_sequences`` on the ``PeftModel``), whatever its neighbours, its slot, the
load order, ``max_loras`` or ``max_lora_rank``. Base rows run the base model's bits.

Adapters are held as PEFT holds them by default: in fp32 for a bf16/fp16 model, else in its dtype.
The prefix cache is keyed by the adapter's sha256 (weights and scaling), so no hit crosses adapters.
"""
from __future__ import annotations

import hashlib
import io
import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..model.executor import RankState, worker_command
from ..model.families import family_of
from ..model.latent_attention import KV_B_LORA_REASON, absorbed_kv_b_projections
from ..model.lora import REFUSED_OPTIONS, attach_slots, is_peft_model
from ..errors import InvalidArgumentError, LoraAdapterError, RequestError


@dataclass
class LoraAdapter:
    name: str
    rank: int                 # the largest rank of its layers
    sha256: str               # of its weights (names, shapes, bytes) and scalings
    slot: int | None = None   # the device slot holding it, if any
    weights: dict = field(default_factory=dict, repr=False)  # projection -> (A [r, K], B [N, r], scaling)

    def weights_bytes(self) -> bytes:
        """``weights`` as torch.save bytes, for the other ranks (their socket pickles tensors as
        shared-memory handles, which another process's authkey cannot open)."""
        buffer = io.BytesIO()
        torch.save(self.weights, buffer)
        return buffer.getvalue()


def _read_source(source):
    """(LoraConfig, PEFT state dict) of a PEFT adapter folder, a PeftModel, or a (config, state) pair."""
    try:
        import peft  # the engine needs PEFT only to read adapters
    except ImportError:
        raise LoraAdapterError("reading LoRA adapters needs PEFT: pip install -e \".[lora]\"") from None
    if is_peft_model(source):
        name = source.active_adapter
        return source.peft_config[name], peft.get_peft_model_state_dict(source, adapter_name=name)
    if isinstance(source, (str, Path)):
        if not (Path(source) / "adapter_config.json").is_file():
            raise LoraAdapterError(f"{source} is not a PEFT adapter folder (no adapter_config.json)")
        try:
            return peft.PeftConfig.from_pretrained(str(source)), peft.utils.load_peft_weights(str(source), device="cpu")
        except Exception as exc:  # noqa: BLE001  (a corrupt config or weights file)
            raise LoraAdapterError(f"cannot read the adapter at {source}: {type(exc).__name__}: {exc}") from None
    if isinstance(source, tuple) and len(source) == 2:
        return source
    raise LoraAdapterError("an adapter is a PEFT adapter folder, a PeftModel, or a (LoraConfig, state_dict) pair")


def _check_config(config) -> None:
    tuner = getattr(getattr(config, "peft_type", None), "value", None)
    if tuner != "LORA":
        raise LoraAdapterError(f"a PEFT {tuner} adapter; only LoRA adapters are served")
    for option, why in REFUSED_OPTIONS.items():
        if getattr(config, option, None):
            raise LoraAdapterError(why)
    if config.modules_to_save:
        raise LoraAdapterError(f"modules_to_save ({config.modules_to_save}) are not served (every row shares the base "
                               "modules); merge them or run the PeftModel itself")
    if config.alpha_pattern:
        raise LoraAdapterError("alpha_pattern is not supported here")


class LoraSlots:
    """The registry and slots of one engine (see the module's docstring)."""

    def __init__(self, runner, max_loras: int, max_lora_rank: int):
        if max_loras < 1 or max_lora_rank < 1:
            raise InvalidArgumentError("max_loras and max_lora_rank must be at least 1")
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        dtype = runner.model.get_output_embeddings().weight.dtype
        self.dtype = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
        # Under tensor parallelism every rank's runner gets the same slots over its shard.
        self.runner = runner
        self.slots = ModelSlots(runner.model, max_loras, max_lora_rank, self.dtype)
        runner.executor.collective_rpc(_attach_slots_on_rank,
                                       (runner.runner_id, max_loras, max_lora_rank, self.dtype), lambda: None)
        self.layers = self.slots.layers
        self.adapters: dict[str, LoraAdapter] = {}
        self.owners: list[str | None] = [None] * max_loras
        self._last_use = [0] * max_loras
        self._uses = itertools.count(1)

    # ---- the registry --------------------------------------------------------------------------------

    def add(self, name: str, source) -> LoraAdapter:
        if not isinstance(name, str) or not name:
            raise LoraAdapterError("an adapter needs a non-empty name")
        if name in self.adapters:
            raise LoraAdapterError(f"an adapter named {name!r} is already loaded (remove it first)")
        config, state = _read_source(source)
        _check_config(config)
        adapter = self._parse(name, config, state)
        self.adapters = {**self.adapters, name: adapter}  # a new dict: readers on other threads see one or the other
        return adapter

    def _parse(self, name: str, config, state: dict) -> LoraAdapter:
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in state.items():
            module, _, part = key.removeprefix("base_model.model.").rpartition(".lora_")
            if module in self.slots.refused:
                raise LoraAdapterError(f"adapter {name!r}: {module}: {self.slots.refused[module]}")
            if part not in ("A.weight", "B.weight") or module not in self.layers:
                raise LoraAdapterError(f"adapter {name!r}: {key} is not a LoRA A/B weight of a projection of this "
                                       "model (targets: attention and MLP projections)")
            pairs.setdefault(module, {})[part[0]] = tensor
        if not pairs:
            raise LoraAdapterError(f"adapter {name!r} has no LoRA weights")
        digest, weights = hashlib.sha256(), {}
        for module in sorted(pairs):
            missing = {"A", "B"} - pairs[module].keys()
            if missing:
                raise LoraAdapterError(f"adapter {name!r}: {module} lacks its lora_{missing.pop()}")
            a, b = pairs[module]["A"], pairs[module]["B"]
            slots = self.layers[module]
            n, k = slots.n, slots.k
            rank = a.shape[0]
            if a.dim() != 2 or b.dim() != 2 or a.shape[1] != k or b.shape != (n, rank):
                raise LoraAdapterError(f"adapter {name!r}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                                       f"this model needs A [r, {k}] and B [{n}, r]")
            if rank > self.max_lora_rank:
                raise LoraAdapterError(f"adapter {name!r}: {module} has rank {rank}, over max_lora_rank "
                                       f"{self.max_lora_rank}")
            scaling = config.lora_alpha / (math.sqrt(rank) if config.use_rslora else rank)
            for tensor in (a, b):
                digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            digest.update(f"{module}:{tuple(a.shape)}:{tuple(b.shape)}:{a.dtype}:{scaling!r};".encode())
            weights[module] = (a.detach().to("cpu", self.dtype).contiguous(),
                               b.detach().to("cpu", self.dtype).contiguous(), scaling)
        rank = max(a.shape[0] for a, _, _ in weights.values())
        return LoraAdapter(name, rank, digest.hexdigest(), weights=weights)

    def get(self, name: str) -> LoraAdapter:
        if name not in self.adapters:
            known = ", ".join(sorted(self.adapters)) or "none"
            raise RequestError(f"unknown LoRA adapter {name!r} (loaded: {known})", param="lora")
        return self.adapters[name]

    def remove(self, name: str, in_use: int) -> None:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise LoraAdapterError(f"no adapter named {name!r} is loaded")
        if in_use:
            raise LoraAdapterError(f"adapter {name!r} is in use by {in_use} unfinished requests; finish or abort them "
                                   "first")
        if adapter.slot is not None:
            self.owners[adapter.slot] = None
        self.adapters = {key: value for key, value in self.adapters.items() if key != name}

    # ---- slots and rows ------------------------------------------------------------------------------

    def can_admit(self, seq, running) -> bool:
        """Whether the sequence's adapter is in a slot, copying it into one if one is free or holds an
        adapter no sequence in ``running`` uses (the least recently used). The scheduler's admission rule."""
        if seq.lora is None:
            return True
        adapter = self.adapters[seq.lora]
        if adapter.slot is None:
            pinned = {s.lora for s in running}
            free = [s for s, owner in enumerate(self.owners) if owner is None or owner not in pinned]
            if not free:
                return False
            slot = min(free, key=lambda s: (self.owners[s] is not None, self._last_use[s]))
            if self.owners[slot] is not None:
                self.adapters[self.owners[slot]].slot = None
            executor = self.runner.executor
            weights = adapter.weights_bytes() if executor.tensor_parallel_size > 1 else None  # for the other ranks
            executor.collective_rpc(_load_slot_on_rank, (self.runner.runner_id, slot, weights),
                                    lambda: self.slots.load(slot, adapter.weights))
            self.owners[slot], adapter.slot = adapter.name, slot
        self._last_use[adapter.slot] = next(self._uses)
        return True

    def groups_for(self, chunks) -> list[tuple[int, list[int]]]:
        """(slot, packed row indices) of each adapter among the step's chunks."""
        rows: dict[int, list[int]] = {}
        offset = 0
        for chunk in chunks:
            if chunk.seq.lora is not None:
                rows.setdefault(self.adapters[chunk.seq.lora].slot, []).extend(
                    range(offset, offset + chunk.num_tokens))
            offset += chunk.num_tokens
        return sorted(rows.items())


class ModelSlots:
    """A model's adapter slots (on every rank): one ``SlotWeights`` per projection. Which rows run
    which slot is each step's (``StepContext.lora_groups``, which the model runner builds)."""

    def __init__(self, model, max_loras: int, max_lora_rank: int, dtype: torch.dtype):
        family = family_of(model.config)
        projections = {proj for layer in model.model.layers for proj in family.projections(layer).values()}
        absorbed = absorbed_kv_b_projections(model, family)  # read as weights: no slot could act there
        self.refused = {name: KV_B_LORA_REASON for name, module in model.named_modules() if module in absorbed}
        self.layers = {name: attach_slots(module, max_loras, max_lora_rank, dtype)
                       for name, module in model.named_modules() if module in projections - absorbed}

    def load(self, slot: int, weights: dict) -> None:
        """Copy an adapter's weights (projection -> (A, B, scaling)) into ``slot``; projections it
        does not adapt get rank 0 there."""
        for module, layer in self.layers.items():
            a, b, scaling = weights.get(module, (None, None, 0.0))
            layer.load(slot, a, b, scaling)


@worker_command
def _attach_slots_on_rank(rank: RankState, payload) -> None:
    runner_id, max_loras, max_lora_rank, dtype = payload
    runner = rank.held[runner_id][0]
    runner.loras = ModelSlots(runner.model, max_loras, max_lora_rank, dtype)


@worker_command
def _load_slot_on_rank(rank: RankState, payload) -> None:
    runner_id, slot, weights = payload
    rank.held[runner_id][0].loras.load(slot, torch.load(io.BytesIO(weights), weights_only=True))
