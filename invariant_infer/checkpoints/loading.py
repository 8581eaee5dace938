"""Loading checkpoints as every CLI and job does: the dtype and device choice, the model and its
tokenizer. One place, so the CLIs, the server, the tensor-parallel ranks and the Ray workers load
a checkpoint alike."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import (AutoConfig, AutoImageProcessor, AutoModelForCausalLM, AutoModelForImageTextToText,
                          AutoTokenizer, PreTrainedTokenizerFast)
from transformers.image_processing_base import ImageProcessingMixin
from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

from ..model import families
from ..model.families import FAMILIES
from ..model.patch import make_invariant
from ..model.support import require
from .quantized import quantized_loading
from ..errors import CheckpointLoadError, InvalidArgumentError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEVICES = ("cpu", "cuda")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def resolve_device(device: str | None = None) -> torch.device:
    """``device`` as given, else CUDA when present, else CPU."""
    if device is not None and device not in DEVICES:
        raise InvalidArgumentError(f"device must be one of {DEVICES}, not {device!r}")
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """``dtype`` by name ("bf16", "fp16", "fp32"); default bf16 on CUDA and fp32 on CPU (CPU bf16
    matmuls are slow and the interpreter gains nothing from them)."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise InvalidArgumentError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    return DTYPES[dtype]


def load_model(path: str, *, dtype: str | None = None, device: str | None = None, invariant: bool = True):
    """``AutoModelForCausalLM.from_pretrained(path)`` (``AutoModelForImageTextToText`` for a vision-language
    checkpoint) in ``dtype`` on ``device``, in eval mode, and wrapped by ``make_invariant`` unless
    ``invariant`` is False (the stock baselines). A checkpoint of another architecture or family is
    refused first (``check_architecture``)."""
    auto_class = check_architecture(path)
    where = resolve_device(device)
    with quantized_loading():  # quantized checkpoints load as stored, kept compressed
        model = auto_class.from_pretrained(path, dtype=resolve_dtype(dtype, where)).to(where).eval()
    return make_invariant(model) if invariant else model


def load_tokenizer(path: str):
    """The tokenizer saved at ``path`` (a directory or a hub id).

    Refuses a directory without tokenizer files (transformers 5 would build an empty tokenizer
    from ``config.json`` alone). A ``PreTrainedTokenizerFast`` config is loaded as that class:
    ``AutoTokenizer`` would build the model type's own tokenizer class around its files."""
    folder = Path(path)
    if folder.is_dir():
        if not any((folder / name).exists() for name in TOKENIZER_FILES):
            raise CheckpointLoadError(f"no tokenizer in {path}: none of {', '.join(TOKENIZER_FILES)} found")
        config = folder / "tokenizer_config.json"
        if config.exists():
            try:
                tokenizer_class = json.loads(config.read_text()).get("tokenizer_class")
            except ValueError:
                tokenizer_class = None
            if tokenizer_class == "PreTrainedTokenizerFast":
                return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def is_vision_language_checkpoint(path: str) -> bool:
    """Whether the checkpoint at ``path`` loads as a vision-language model (``vision_language_config``)."""
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception:  # noqa: BLE001  (from_pretrained reports a checkpoint it cannot load)
        return False
    return vision_language_config(config)


def _class_names(mapping: dict, model_type: str) -> set[str]:
    names = mapping.get(model_type, ())
    return {names} if isinstance(names, str) else set(names)


def _causal_lm_family(model_type: str) -> str | None:
    """The supported family of the model ``AutoModelForCausalLM`` builds for ``model_type``, when that is
    not the model type itself (a multimodal config whose causal LM is its language model: Qwen3.5)."""
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    try:
        inner = getattr(transformers, name).config_class.model_type if isinstance(name, str) else None
    except (AttributeError, ImportError):
        return None
    return inner if inner in FAMILIES else None


def vision_language_config(config) -> bool:
    """Whether a checkpoint of ``config`` loads as a vision-language model: a family with a vision tower.
    A multimodal config whose language model alone is supported (Qwen3.5's) loads as that causal LM.
    The model layer's one rule (``families.is_vision_language``): loading, the server and the scoring job (its
    driver and workers) all ask it."""
    return families.is_vision_language(config)


def auto_class_for(config, surface: str = "model"):
    """The auto class that loads a checkpoint of ``config``: ``AutoModelForImageTextToText`` for a
    vision-language family, else ``AutoModelForCausalLM``. A model type outside the supported families,
    and an architecture that is neither a causal LM nor an image-text-to-text model (sequence or token
    classification, an encoder, an unknown class), which loading as a causal LM would silently give a
    random LM head, are refused through the support table (``UnsupportedModelError``, naming the model
    type, the architecture and what runs for that model type). ``surface``: the support table's surface
    that loads it (an encoder's refusal names the command)."""
    model_type = getattr(config, "model_type", None)
    architectures = list(getattr(config, "architectures", None) or [])
    named = f"model_type {model_type!r}" + (f" ({', '.join(architectures)})" if architectures else "")
    if families.encoder_family_of(config) is not None:
        require("encoder", surface, named)
    if vision_language_config(config):
        auto_class, runs = AutoModelForImageTextToText, _class_names(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
                                                                      model_type)
    else:
        if model_type not in FAMILIES and _causal_lm_family(model_type) is None:
            _refuse_model_type(named)
        # A multimodal checkpoint's own class is accepted where its causal LM is what runs (Qwen3.5).
        auto_class = AutoModelForCausalLM
        runs = _class_names(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, model_type) | \
            _class_names(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, model_type)
    refused = [name for name in architectures if name not in runs]
    if refused:
        require("architecture_not_causal_lm", "model",
                f"{named}: {refused[0]} is not an architecture invariant-infer runs; for model_type {model_type!r} "
                f"it runs {', '.join(sorted(runs))}")
    return auto_class


def _refuse_model_type(named: str) -> None:
    require("unsupported_model_type", "model",
            f"{named} is not a supported model type (supported: {', '.join(sorted(FAMILIES))})")


def check_architecture(path: str, surface: str = "model"):
    """Read the checkpoint's config and return its auto class (``auto_class_for`` on ``surface``), before
    any weight is loaded. ``CheckpointLoadError`` when there is no config to read; ``UnsupportedModelError``
    names an architecture or model type that is not run."""
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001  (a missing folder, a config transformers does not know)
        unreadable = f"cannot read the config of {path}: {exc}"
    else:
        return auto_class_for(config, surface)
    model_type = _stored_model_type(path)
    if model_type is not None and model_type not in FAMILIES:
        _refuse_model_type(f"model_type {model_type!r}")
    raise CheckpointLoadError(unreadable)


def _stored_model_type(path: str) -> str | None:
    """``model_type`` as a local checkpoint's config.json states it (for one transformers cannot read)."""
    try:
        model_type = json.loads((Path(path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return model_type if isinstance(model_type, str) else None


@dataclass
class ImageProcessing:
    """A vision-language checkpoint's image processor and tokenizer, which is all ``Engine`` takes from a
    processor (``AutoProcessor`` also builds a video processor, which needs torchvision)."""
    image_processor: object
    tokenizer: object


def load_processor(path: str, tokenizer) -> ImageProcessing:
    """The image processor saved at ``path``, with ``tokenizer``."""
    return ImageProcessing(load_image_processor(path), tokenizer)


def load_image_processor(path: str):
    """``AutoImageProcessor.from_pretrained(path)``; where that class needs torchvision and it is not
    installed (transformers before 5.2x map Qwen-VL's processor to its torchvision class), the same
    processor's PIL class (``Qwen2VLImageProcessorPil``), whose pixels may round differently."""
    try:
        return AutoImageProcessor.from_pretrained(path)
    except ImportError:
        config, _ = ImageProcessingMixin.get_image_processor_dict(path)
        pil_class = getattr(transformers, f"{config.get('image_processor_type')}Pil", None)
        if pil_class is None:
            raise
        return pil_class.from_pretrained(path)


class LazyTokenizer:
    """Loads the tokenizer on first use, so jobs given only token ids need none. A load failure is
    kept and raised again (as ``OSError``) on every use, so each text row reports it."""

    def __init__(self, path: str):
        self.path, self._tokenizer, self._error = path, None, None

    def get(self):
        if self._tokenizer is None and self._error is None:
            try:
                self._tokenizer = load_tokenizer(self.path)
            except Exception as exc:
                self._error = f"no tokenizer loaded from {self.path} ({exc})"
        if self._error:
            raise CheckpointLoadError(self._error)
        return self._tokenizer

