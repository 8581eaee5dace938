"""A released Qwen3.5 checkpoint is the multimodal ``qwen3_5`` model whose language model alone runs (as
a causal LM): the scoring job, in process and on Ray's driver and workers, decides "vision-language"
by the one rule loading uses (``vision_language_config``), not by the config's ``vision_config``."""
from __future__ import annotations

import types

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3_5Config, Qwen3_5ForConditionalGeneration

from helpers.scoring_rows import read_rows, write_jsonl
from invariant_infer import make_invariant, score_sequences
from invariant_infer.checkpoints.loading import is_vision_language_checkpoint, vision_language_config
from invariant_infer.cli import exit_codes
from invariant_infer.cli import score as scoring_cli
from invariant_infer.errors import JobError
from invariant_infer.scoring.job import backends
from invariant_infer.testing.random_checkpoints import random_config

ROWS = [{"id": "a", "input_ids": [5, 9, 11, 3, 7]}, {"id": "b", "input_ids": [8, 2]},
        {"id": "c", "input_ids": [4, 6, 1, 12, 13, 14, 2, 9, 10]}]


@pytest.fixture(scope="module")
def multimodal_checkpoint(tmp_path_factory):
    """A tiny ``Qwen3_5ForConditionalGeneration`` saved as released checkpoints are: a ``vision_config``,
    no image processor."""
    torch.manual_seed(0)
    text = random_config("qwen3_5_text", "tiny", num_hidden_layers=2).to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  temporal_patch_size=1, spatial_merge_size=1)
    path = tmp_path_factory.mktemp("qwen3_5-multimodal")
    Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).save_pretrained(path)
    return path


def test_the_one_rule_says_a_qwen3_5_checkpoint_is_not_vision_language(multimodal_checkpoint):
    config = AutoConfig.from_pretrained(multimodal_checkpoint)
    assert config.vision_config is not None  # control: a rule reading vision_config would say vision-language
    assert not vision_language_config(config) and not is_vision_language_checkpoint(str(multimodal_checkpoint))
    assert vision_language_config(random_config("qwen2_5_vl", "tiny"))


def test_score_scores_its_text_rows_as_the_language_model_does(multimodal_checkpoint, tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", [*ROWS, {"id": "image", "input_ids": [5, 6], "images": ["a.png"]}])
    code = scoring_cli.main(["--model", str(multimodal_checkpoint), "--input", inp, "--output",
                             str(tmp_path / "out.jsonl"), "--dtype", "fp32", "--device", "cpu"])
    assert code == exit_codes.ROW_ERRORS, capsys.readouterr().err  # the image row only
    rows = {row["id"]: row for row in read_rows(tmp_path / "out.jsonl")}
    assert "takes no images" in rows["image"]["error"]
    model = make_invariant(AutoModelForCausalLM.from_pretrained(multimodal_checkpoint, dtype=torch.float32).eval())
    alone = [score_sequences(model, [row["input_ids"]])[0] for row in ROWS]
    assert [rows[row["id"]]["digest"] for row in ROWS] == [result.digest for result in alone]


def test_the_ray_driver_loads_no_image_processor_for_it(multimodal_checkpoint, monkeypatch):
    """The driver decides from the raw config before Ray starts; a stand-in Ray (already initialized, no
    GPUs) keeps the test in process. The checkpoint has no image processor: asking for one would fail."""
    ray = types.SimpleNamespace(is_initialized=lambda: True, cluster_resources=lambda: {})
    monkeypatch.setattr(backends, "require_ray", lambda: ray)
    driver = backends.RayBackend(str(multimodal_checkpoint), device="cpu")
    assert driver.image_processor is None and driver.config.model_type == "qwen3_5"


def test_negative_control_the_vision_config_rule_fails_the_ray_driver(multimodal_checkpoint, monkeypatch):
    """Deciding from ``vision_config`` (the rule this replaced), the driver asks for an image processor the
    checkpoint does not have, and the job cannot start."""
    ray = types.SimpleNamespace(is_initialized=lambda: True, cluster_resources=lambda: {})
    monkeypatch.setattr(backends, "require_ray", lambda: ray)
    monkeypatch.setattr(backends, "vision_language_config",
                        lambda config: getattr(config, "vision_config", None) is not None)
    with pytest.raises(JobError, match="cannot load the image processor"):
        backends.RayBackend(str(multimodal_checkpoint), device="cpu")
