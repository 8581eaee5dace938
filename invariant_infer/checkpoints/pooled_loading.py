"""Loading a pooled checkpoint (an embedder, a classifier, a cross-encoder, a reward model) as a
``PooledModel``: its task read from the checkpoint's files, before any weight is loaded.

What each layout is taken for:
  * a sentence-transformers embedder (``modules.json``: Transformer, Pooling, optionally Normalize) ->
    "embed", pooled and normalised as its modules say;
  * a saved sentence-transformers CrossEncoder (``config_sentence_transformers.json`` model_type
    CrossEncoder, one Transformer of the "sequence-classification" task) -> "score" (one label),
    "classify" (several);
  * ``*ForSequenceClassification``: several labels -> "classify"; one label -> "score" on an encoder (a
    cross-encoder reranker), "reward" on a decoder (a reward model);
  * a base model (``BertModel``, ``Qwen3Model`` ...) -> "embed": an encoder's first token (cls), a
    decoder's last token (lasttoken), normalised (vLLM's defaults);
  * anything else (a causal LM ...) -> None: not a pooled checkpoint.
The files are read as JSON: sentence_transformers is not imported. Modules other than these (Dense,
Router, LogitScore ...) are refused by name, as are families no pooled model runs.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

from ..errors import CheckpointLoadError, UnsupportedModelError
from ..model.families import FAMILIES, encoder_family_of, is_vision_language
from ..model.families.encoder_adapter import ENCODER_FAMILIES, REFUSED_ENCODERS
from ..model.patch import make_invariant
from ..model.pooled_model import POOLING_TASKS, PooledModel
from ..model.pooling import POOLING_MODES
from .loading import load_tokenizer, resolve_device, resolve_dtype

HEAD_TASKS = ("classify", "score", "reward")
# sentence-transformers' Pooling config before v5: one boolean per mode.
_LEGACY_POOLING_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "lasttoken",
                        "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
                        "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                        "pooling_mode_weightedmean_tokens": "weightedmean"}
# A token count no real tokenizer limit reaches: transformers' "no limit" (int(1e30)).
_NO_LIMIT = 10 ** 12


@dataclass(frozen=True)
class PooledLayout:
    """What a checkpoint's files say, before any weight is loaded."""
    task: str | None                 # the inferred task; None: not a pooled checkpoint
    model_dir: Path                  # the Hugging Face model's folder (a sentence-transformers Transformer's path)
    model_type: str | None
    architecture: str | None
    encoder: bool                    # an encoder family (bidirectional) rather than a decoder
    has_head: bool                   # a sequence-classification head is stored
    num_labels: int
    pooling_mode: str | None = None  # a sentence-transformers Pooling module's mode
    normalize: bool | None = None    # whether a Normalize module follows it
    max_seq_length: int | None = None  # sentence-transformers' max_seq_length


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CheckpointLoadError(f"cannot read {path}: {exc}") from None


def _config(folder: Path) -> dict:
    config = _read_json(folder / "config.json")
    if not isinstance(config, dict):
        raise CheckpointLoadError(f"no config.json to read in {folder}")
    return config


def _num_labels(config: dict) -> int:
    if isinstance(config.get("id2label"), dict):
        return len(config["id2label"])
    return int(config.get("num_labels", 2))


def _is_encoder(model_type: str | None) -> bool:
    return model_type in ENCODER_FAMILIES or model_type in REFUSED_ENCODERS


def _head_task(num_labels: int, encoder: bool) -> str:
    return "classify" if num_labels > 1 else "score" if encoder else "reward"


def _pooling_mode(folder: Path, name: str) -> str:
    config = _read_json(folder / "config.json") or {}
    if "pooling_mode" in config:
        modes = [config["pooling_mode"]] if isinstance(config["pooling_mode"], str) else list(config["pooling_mode"])
    else:
        modes = [mode for key, mode in _LEGACY_POOLING_KEYS.items() if config.get(key)]
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        raise UnsupportedModelError(f"sentence-transformers module {name} (Pooling): pooling mode(s) {modes} are not "
                                    f"supported; pooled models take one of {POOLING_MODES}")
    if config.get("include_prompt", True) is False:
        raise UnsupportedModelError(f"sentence-transformers module {name} (Pooling) has include_prompt=False "
                                    "(prompt tokens excluded from pooling), which is not supported")
    return modes[0]


def _sentence_transformers_layout(path: Path, modules: list) -> PooledLayout:
    """The layout of a sentence-transformers folder (``modules.json`` read); refuses other modules by name."""
    kinds = []
    for module in modules:
        if not isinstance(module, dict) or not isinstance(module.get("type"), str):
            raise CheckpointLoadError(f"{path / 'modules.json'}: each module needs a 'type'")
        kinds.append((module["type"].rsplit(".", 1)[-1], str(module.get("name", module.get("idx", ""))),
                      path / module.get("path", "")))
    names = [kind for kind, _, _ in kinds]
    if not names or names[0] != "Transformer":
        raise UnsupportedModelError(f"sentence-transformers modules {names}: pooled models take a Transformer first")
    model_dir = kinds[0][2]
    transformer = _read_json(model_dir / "sentence_bert_config.json") or {}
    st_config = _read_json(path / "config_sentence_transformers.json") or {}
    config = _config(model_dir)
    model_type, architecture = config.get("model_type"), (config.get("architectures") or [None])[0]
    encoder, labels = _is_encoder(model_type), _num_labels(config)
    base = PooledLayout(None, model_dir, model_type, architecture, encoder,
                        bool(architecture and architecture.endswith("ForSequenceClassification")), labels,
                        max_seq_length=transformer.get("max_seq_length"))
    if st_config.get("model_type") == "CrossEncoder" or transformer.get("transformer_task") == "sequence-classification":
        if names != ["Transformer"]:
            raise UnsupportedModelError(f"sentence-transformers CrossEncoder modules {names[1:]} are not supported: "
                                        "pooled models take a CrossEncoder of one Transformer with a classification "
                                        "head (a causal LM's LogitScore is not served yet)")
        return replace(base, task="classify" if labels > 1 else "score")
    for kind, name, _ in kinds[1:]:
        if kind not in ("Pooling", "Normalize"):
            raise UnsupportedModelError(f"sentence-transformers module {name} ({kind}) is not supported: pooled "
                                        "embedders take Transformer, Pooling and Normalize modules")
    if names[1:] not in (["Pooling"], ["Pooling", "Normalize"]):
        raise UnsupportedModelError(f"sentence-transformers modules {names}: pooled embedders take Transformer, "
                                    "Pooling and optionally Normalize, in that order")
    if transformer.get("transformer_task", "feature-extraction") != "feature-extraction":
        raise UnsupportedModelError(f"sentence-transformers Transformer task {transformer['transformer_task']!r}: "
                                    "pooled embedders take a feature-extraction Transformer")
    return replace(base, task="embed", pooling_mode=_pooling_mode(kinds[1][2], kinds[1][1]),
                   normalize=names[-1] == "Normalize")


def pooled_layout(path) -> PooledLayout:
    """The checkpoint's layout as its files say; ``UnsupportedModelError`` names a sentence-transformers
    module no pooled model runs, ``CheckpointLoadError`` a folder without a config."""
    folder = Path(path)
    modules = _read_json(folder / "modules.json")
    if isinstance(modules, list):
        return _sentence_transformers_layout(folder, modules)
    config = _config(folder)
    model_type, architecture = config.get("model_type"), (config.get("architectures") or [None])[0]
    encoder, labels = _is_encoder(model_type), _num_labels(config)
    layout = PooledLayout(None, folder, model_type, architecture, encoder, False, labels)
    if architecture is None:
        return layout
    if architecture.endswith("ForSequenceClassification"):
        return replace(layout, task=_head_task(labels, encoder), has_head=True)
    if architecture.endswith("Model") and not architecture.endswith("PreTrainedModel"):
        return replace(layout, task="embed")
    return layout


def pooling_task_of(path) -> str | None:
    """The pooling task the checkpoint at ``path`` is for (one of ``POOLING_TASKS``), or None when it is
    not a pooled checkpoint (a causal LM ...). Reads its files only."""
    return pooled_layout(path).task


def _refuse_family(layout: PooledLayout, named: str) -> None:
    """Refuse, by name, a family no pooled model runs (before any weight is loaded)."""
    if layout.encoder:
        encoder_family_of(AutoConfig.for_model(layout.model_type))  # raises for an encoder refused by name
        return
    if layout.model_type not in FAMILIES:
        supported = sorted(ENCODER_FAMILIES) + sorted(t for t in FAMILIES if not _vision(t))
        raise UnsupportedModelError(f"{named}: model_type {layout.model_type!r} is not a family pooled models run "
                                    f"(supported: {', '.join(supported)})")
    if _vision(layout.model_type):
        raise UnsupportedModelError(f"{named}: vision-language models are not run as pooled models; run them as "
                                    "image-text-to-text models")


def _vision(model_type: str) -> bool:
    return is_vision_language(AutoConfig.for_model(model_type))


def check_pooled_architecture(path, task: str | None = None) -> tuple[PooledLayout, str]:
    """(the layout, the task it runs) of a pooled checkpoint, refused by name before any weight is loaded:
    a task the checkpoint cannot run, an architecture no pooling task serves, a family pooled models do not
    run. ``task``: overrides the inferred task (embed on a classification checkpoint or a causal LM pools its
    base model's states: last token, normalised; a head task needs a stored head)."""
    layout = pooled_layout(path)
    named = f"{path}: {layout.architecture or 'model_type ' + repr(layout.model_type)}"
    if task is not None and task not in POOLING_TASKS:
        raise UnsupportedModelError(f"pooling task {task!r} is not one of {POOLING_TASKS}")
    if task in HEAD_TASKS and not layout.has_head:
        raise UnsupportedModelError(f"{named}: the {task} task needs a sequence-classification head and this "
                                    "checkpoint stores none; run it with the embed task")
    causal_lm_embedding = task == "embed" and not layout.encoder and str(layout.architecture).endswith("ForCausalLM")
    if layout.task is None and not causal_lm_embedding:  # --task embed pools a causal LM's base model (as vLLM)
        raise UnsupportedModelError(f"{named} is not a pooled architecture: pooling tasks run base models "
                                    "(...Model), ...ForSequenceClassification and sentence-transformers embedders "
                                    "and cross-encoders (and a causal LM's base model with the embed task)")
    task = task or layout.task
    _refuse_family(layout, named)
    return layout, task


def _max_length(layout: PooledLayout, config, tokenizer) -> int:
    """The longest row the model takes: its positions, the tokenizer's limit, sentence-transformers'."""
    positions = config.max_position_embeddings
    if layout.model_type == "xlm-roberta":  # positions count from padding_idx + 1
        positions -= config.pad_token_id + 1
    limits = [positions, layout.max_seq_length]
    model_max = getattr(tokenizer, "model_max_length", None)
    limits.append(model_max if isinstance(model_max, int) and model_max < _NO_LIMIT else None)
    return min(limit for limit in limits if limit)


def _matryoshka(config, hidden: int) -> tuple[int, ...] | None:
    dims = getattr(config, "matryoshka_dimensions", None)
    if dims:
        return tuple(sorted({int(d) for d in dims if 1 <= int(d) <= hidden}))
    return tuple(range(1, hidden + 1)) if getattr(config, "is_matryoshka", False) else None


def _pooled_model(model, tokenizer, layout: PooledLayout, task: str, config) -> PooledModel:
    """The ``PooledModel`` of ``model`` (None: a description, before loading) running ``task``."""
    pad = tokenizer.pad_token_id
    if task != "embed" and not layout.encoder and config.pad_token_id is not None:
        pad = config.pad_token_id  # the decoder head finds each row's last token by it
    if pad is None:
        pad = config.pad_token_id if config.pad_token_id is not None else tokenizer.eos_token_id or 0
    if task != "embed" and config.pad_token_id is None:
        config.pad_token_id = pad  # transformers' decoder heads refuse batches without one
    common = dict(max_length=_max_length(layout, config, tokenizer), pad_token_id=pad,
                  padding_side=tokenizer.padding_side, config=config)
    if task == "embed":
        hidden = config.hidden_size
        return PooledModel(model, tokenizer, task, pooling_mode=layout.pooling_mode or (
                           "cls" if layout.encoder else "lasttoken"),
                           normalize=True if layout.normalize is None else layout.normalize,
                           matryoshka_dimensions=_matryoshka(config, hidden), dimensions=hidden, **common)
    labels = [config.id2label.get(i, f"LABEL_{i}") for i in range(config.num_labels)]
    return PooledModel(model, tokenizer, task, labels=labels, dimensions=config.num_labels, **common)


def describe_pooled_model(path, *, task: str | None = None) -> PooledModel:
    """The ``PooledModel`` of the checkpoint at ``path`` without its weights (``model`` None): its task,
    tokenizer and limits, for reading requests before any weight is loaded (a Ray job's driver)."""
    layout, task = check_pooled_architecture(path, task)
    try:
        config = AutoConfig.from_pretrained(layout.model_dir)
    except (OSError, ValueError) as exc:
        raise CheckpointLoadError(f"cannot load {path}: {exc}") from None
    return _pooled_model(None, load_tokenizer(str(layout.model_dir)), layout, task, config)


def load_pooled_model(path, *, task: str | None = None, dtype: str | None = None, device: str | None = None,
                      invariant: bool = True) -> PooledModel:
    """The pooled checkpoint at ``path`` as a ``PooledModel`` running ``task`` (default: the inferred one,
    ``pooling_task_of``), in ``dtype`` on ``device`` (as ``load_model``), made invariant unless
    ``invariant`` is False (the stock baseline). Refused by name before loading: ``check_pooled_architecture``."""
    layout, task = check_pooled_architecture(path, task)
    where = resolve_device(device)
    auto_class = AutoModel if task == "embed" else AutoModelForSequenceClassification
    try:
        model = auto_class.from_pretrained(layout.model_dir, dtype=resolve_dtype(dtype, where)).to(where).eval()
    except (OSError, ValueError) as exc:
        raise CheckpointLoadError(f"cannot load {path}: {exc}") from None
    pooled = _pooled_model(model, load_tokenizer(str(layout.model_dir)), layout, task, model.config)
    if invariant:
        pooled.model = make_invariant(model)
    return pooled
