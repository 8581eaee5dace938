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

from ..model.patch import make_invariant
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
    ``invariant`` is False (the stock baselines)."""
    where = resolve_device(device)
    auto_class = AutoModelForImageTextToText if is_vision_language(path) else AutoModelForCausalLM
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


def is_vision_language(path: str) -> bool:
    """Whether the checkpoint's config has a vision tower (``vision_config``)."""
    try:
        return getattr(AutoConfig.from_pretrained(path), "vision_config", None) is not None
    except Exception:  # noqa: BLE001  (from_pretrained reports a checkpoint it cannot load)
        return False


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

