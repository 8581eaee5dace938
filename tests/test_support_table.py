"""The support table (``invariant_infer.model.support``): every "no" cell has a trigger that attempts
that kind (or feature) on that surface with a tiny model, at the point where the library refuses it,
and must raise the table's error with the table's message; the docs' copies are the generated one."""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import torch

from helpers.unsupported_checkpoints import save_encoder_checkpoint, save_sequence_classification_checkpoint
from invariant_infer import make_invariant
from invariant_infer.errors import InvalidArgumentError, InvariantInferError, JobError
from invariant_infer.model import support
from invariant_infer.model.families import FAMILIES
from invariant_infer.model.kinds import config_kinds, model_kinds
from invariant_infer.model.support import EVERY_SURFACE, ROWS, SURFACES, refusal, refusal_message, require
from invariant_infer.model.support_table import REGENERATE, markdown, with_table
from invariant_infer.testing.random_checkpoints import qwen2_config, random_config, random_model

ROOT = Path(__file__).resolve().parent.parent
DOCS_WITH_THE_TABLE = ["README.md", "docs/models.md"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 2}


def compressed_tensors(scheme: str) -> dict:
    """A ``quantization_config`` as llm-compressor writes it for a compressed-tensors preset scheme."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(scheme, ["Linear"])},
                                ignore=["lm_head"])
    return config.model_dump(mode="json")


TRANSFORMERS_FP8 = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128}


def tiny(family: str, **overrides):
    return random_model(random_config(family, "tiny", **overrides))


def with_quantization(model, quantization: dict):
    model.config.quantization_config = quantization
    return model


def vision_language(**text):
    model = tiny("qwen2_5_vl")
    for name, value in text.items():
        setattr(model.config.text_config, name, value)
    return model


def peft(model, targets=("q_proj",)):
    from peft import LoraConfig, get_peft_model
    return get_peft_model(model, LoraConfig(r=2, target_modules=list(targets)))


# ---- the points of refusal ---------------------------------------------------------------------

def tensor_parallel_before_start(config, tmp_path):
    """``TensorParallelRanks`` / ``--tensor-parallel-size``: refused from the config before any rank starts."""
    from invariant_infer.parallel.loading import check_tensor_parallel_size
    config.save_pretrained(tmp_path)
    check_tensor_parallel_size(str(tmp_path), 2, torch.device("cpu"))


def engine(model, **options):
    from invariant_infer.engine import Engine
    Engine(model, **options)


def engine_support(model, *, max_loras=0, tensor_parallel_size=1, speculative=None):
    from invariant_infer.engine.model_support import check_engine_support
    check_engine_support(model, "invariant", speculative, max_loras, tensor_parallel_size)


def sharded_check(model):
    """``make_invariant``'s check of a model transformers loaded with ``tp_plan`` (a PeftModel's: its base)."""
    from invariant_infer.model.checks import check_model
    check_model(model, sharded=True)


def trl_check(model):
    from invariant_infer.training.integrations.trl import check_trainable
    check_trainable(model)


def trl_aux_loss():
    from invariant_infer.training.integrations.trl import InvariantGRPOTrainer
    InvariantGRPOTrainer._get_per_token_logps_and_entropies(None, None, None, None, None, compute_aux_loss=True)


def score_cli(tmp_path, *options) -> tuple[int, str]:
    from invariant_infer.cli import exit_codes
    from invariant_infer.cli import score as scoring_cli
    rows = tmp_path / "in.jsonl"
    rows.write_text('{"id": 1, "input_ids": [5, 6, 7]}\n')
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        code = scoring_cli.main(["--model", str(tmp_path / "never-loaded"), "--input", str(rows),
                                 "--output", str(tmp_path / "out.jsonl"), *options])
    assert code == exit_codes.REFUSED
    return code, stderr.getvalue()


def videos_in_the_forward():
    model = make_invariant(vision_language())
    model(input_ids=torch.tensor([[5, 6]]), pixel_values_videos=torch.zeros(16, 1176),
          video_grid_thw=torch.tensor([[2, 4, 4]]))


def videos_in_a_request(surface_call):
    prompt = {"prompt_token_ids": [5, 6], "multi_modal_data": {"video": [torch.zeros(28, 28, 3)]}}
    surface_call(prompt)


def videos_in_the_engine():
    from invariant_infer.engine import Engine, SamplingParams
    videos_in_a_request(lambda prompt: Engine(vision_language()).generate([prompt], SamplingParams(max_tokens=1)))


def videos_in_scoring():
    from invariant_infer import score_sequences
    videos_in_a_request(lambda prompt: score_sequences(make_invariant(vision_language()), [prompt], prompt_lengths=[1]))


def trainable_tower_forward():
    model = make_invariant(vision_language())
    with torch.enable_grad():
        model.model.visual(torch.zeros(16, 1176), grid_thw=torch.tensor([[1, 4, 4]]))


def trainable_tower_trl():
    model = vision_language()
    model.model.visual.requires_grad_(True)
    trl_check(model)


def moe_backward():
    model = make_invariant(tiny("qwen3_moe"))
    with torch.enable_grad():
        model(input_ids=torch.tensor([[5, 6]]))


def gemma4_backward():
    model = make_invariant(tiny("gemma4_text"))
    with torch.enable_grad():
        model(input_ids=torch.tensor([[5, 6]]))


def latent_attention_backward():
    model = make_invariant(tiny("deepseek_v3"))
    with torch.enable_grad():
        model(input_ids=torch.tensor([[5, 6]]))


def command_check(save, surface: str, tmp_path):
    """A command's check of a saved checkpoint's architecture before it loads anything (serve, score --ray)."""
    from invariant_infer.checkpoints.loading import check_architecture
    check_architecture(str(save(tmp_path / "model")), surface)


def load_checkpoint(save, tmp_path):
    """Loading a saved checkpoint as every surface does (``load_model``): refused from its config."""
    from invariant_infer.checkpoints.loading import load_model
    load_model(str(save(tmp_path / "model")), device="cpu")


def fp8_on_an_ampere_gpu(tmp_path):
    """An FP8_DYNAMIC checkpoint's forward as a GPU of compute capability 8.0 would run it: the fp8
    launcher's own check refuses (the capability lookup faked, there being no GPU here)."""
    from unittest import mock

    from transformers import AutoModelForCausalLM

    from invariant_infer.kernels import fp8_support
    from invariant_infer.testing.quantized_checkpoints import save_quantized_checkpoint
    config = qwen2_config("tiny", hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2,
                          num_hidden_layers=1)
    model = make_invariant(AutoModelForCausalLM.from_pretrained(
        save_quantized_checkpoint(tmp_path / "fp8", config, "FP8_DYNAMIC"), dtype=torch.bfloat16).eval())
    with mock.patch.object(fp8_support, "device_capability", lambda device: (8, 0)):
        model(input_ids=torch.tensor([[5, 6]]))


def encoder():
    return random_model(random_config("bert", "tiny"))


def encoder_in_train_mode(grad: bool):
    model = make_invariant(encoder()).train()
    with torch.set_grad_enabled(grad):
        model(input_ids=torch.tensor([[5, 6]]))


def modernbert_backward():
    model = make_invariant(random_model(random_config("modernbert", "tiny")))
    with torch.enable_grad():
        model(input_ids=torch.tensor([[5, 6]]))


def sharded_encoder():
    """make_invariant on an encoder as transformers would have sharded it (``_tp_size``, a 1-D device mesh)."""
    import types
    model = encoder()
    model._tp_size = 2
    model._device_mesh = types.SimpleNamespace(size=lambda: 2, mesh_dim_names=None, get_local_rank=lambda: 0,
                                               get_group=lambda: None)
    make_invariant(model)


def encoder_packed_rows():
    with torch.no_grad():
        make_invariant(encoder())(input_ids=torch.tensor([[5, 6, 7]]), position_ids=torch.tensor([[0, 1, 0]]))


def softcap_in_attention(surface):
    from invariant_infer.engine.paged_batch import paged_stock_attention
    from invariant_infer.model.attention import invariant_attention
    call = invariant_attention if surface == "model" else paged_stock_attention
    call(None, None, None, None, None, softcap=30.0)


# (row, surface) -> trigger(tmp_path); surface "*" for a row refused on every surface (make_invariant
# refuses it, and every surface runs make_invariant first). A trigger raises, or returns a refused CLI
# run's (exit status, stderr).
TRIGGERS = {
    ("latent_attention", "tensor_parallel"):
        lambda tmp: tensor_parallel_before_start(random_config("deepseek_v3", "tiny"), tmp),
    ("latent_attention", "training"): lambda tmp: latent_attention_backward(),
    ("latent_attention", "trl"): lambda tmp: trl_check(tiny("deepseek_v3")),
    ("stock_engine_latent_attention", "engine"): lambda tmp: engine(tiny("deepseek_v3"), kernels="stock"),
    ("latent_attention_quantized", "*"):
        lambda tmp: make_invariant(with_quantization(tiny("deepseek_v3"), GPTQ)),
    ("moe", "tensor_parallel"): lambda tmp: tensor_parallel_before_start(random_config("qwen3_moe", "tiny"), tmp),
    ("moe", "training"): lambda tmp: moe_backward(),
    ("moe", "trl"): lambda tmp: trl_aux_loss(),
    ("hybrid", "speculative"): lambda tmp: engine(tiny("qwen3_5_text"), speculative=NGRAM),
    ("vision_language", "speculative"): lambda tmp: engine(vision_language(), speculative=NGRAM),
    ("vision_language", "tensor_parallel"):
        lambda tmp: tensor_parallel_before_start(random_config("qwen2_5_vl", "tiny"), tmp),
    ("fp8_dynamic", "tensor_parallel"):
        lambda tmp: tensor_parallel_before_start(qwen2_config(quantization_config=compressed_tensors("FP8_DYNAMIC")),
                                                 tmp),
    ("w8a8_int8", "tensor_parallel"):
        lambda tmp: tensor_parallel_before_start(qwen2_config(quantization_config=compressed_tensors("W8A8")), tmp),
    ("transformers_fp8", "tensor_parallel"):
        lambda tmp: tensor_parallel_before_start(qwen2_config(quantization_config=TRANSFORMERS_FP8), tmp),
    ("mxfp4", "*"): lambda tmp: make_invariant(tiny("gpt_oss", quantization_config={"quant_method": "mxfp4"})),
    ("lora", "ray"): lambda tmp: score_cli(tmp, "--lora", f"a={tmp}", "--ray"),
    ("stock_engine_hybrid", "engine"): lambda tmp: engine(tiny("qwen3_5_text"), kernels="stock"),
    ("stock_engine_vision_language", "engine"): lambda tmp: engine(vision_language(), kernels="stock"),
    ("stock_speculative", "speculative"): lambda tmp: engine(tiny("qwen2"), kernels="stock", speculative=NGRAM),
    ("hybrid_lora", "model"): lambda tmp: make_invariant(peft(tiny("qwen3_5_text"))),
    ("hybrid_lora", "engine"): lambda tmp: engine(tiny("qwen3_5_text"), max_loras=1),
    ("vision_language_lora", "engine"): lambda tmp: engine(vision_language(), max_loras=1),
    ("vision_language_lora", "scoring"): lambda tmp: __import__("invariant_infer.scoring.job.backends", fromlist=["_"])
        .LocalBackend(vision_language(), loras={"a": str(tmp)}),
    ("hybrid_quantized_tensor_parallel", "tensor_parallel"):
        lambda tmp: tensor_parallel_before_start(
            random_config("qwen3_5_text", "tiny", quantization_config=compressed_tensors("FP8_BLOCK")), tmp),
    ("peft_model_tensor_parallel", "tensor_parallel"): lambda tmp: sharded_check(peft(tiny("qwen2")).get_base_model()),
    ("quantized_lora_tensor_parallel", "tensor_parallel"):
        lambda tmp: engine_support(with_quantization(tiny("qwen2"), compressed_tensors("FP8_BLOCK")), max_loras=1,
                                   tensor_parallel_size=2),
    ("compressed_tensors_moe", "*"):
        lambda tmp: make_invariant(with_quantization(tiny("qwen3_moe"), compressed_tensors("FP8_BLOCK"))),
    ("fp8_before_sm89", "*"): fp8_on_an_ampere_gpu,
    ("videos", "model"): lambda tmp: videos_in_the_forward(),
    ("videos", "engine"): lambda tmp: videos_in_the_engine(),
    ("videos", "scoring"): lambda tmp: videos_in_scoring(),
    ("trainable_vision_tower", "training"): lambda tmp: trainable_tower_forward(),
    ("trainable_vision_tower", "trl"): lambda tmp: trainable_tower_trl(),
    ("vision_language_sliding_window", "*"): lambda tmp: make_invariant(vision_language(use_sliding_window=True)),
    ("logit_softcapping", "*"): lambda tmp: make_invariant(tiny("gemma3_text", final_logit_softcapping=30.0)),
    ("gemma4_text_training", "training"): lambda tmp: gemma4_backward(),
    ("gemma4_text_training", "trl"): lambda tmp: trl_check(tiny("gemma4_text")),
    ("gemma4_text_training", "tensor_parallel"):
        lambda tmp: tensor_parallel_before_start(random_config("gemma4_text", "tiny"), tmp),
    ("gemma4_text_training", "speculative"): lambda tmp: engine(tiny("gemma4_text"), speculative=NGRAM),
    ("gemma4_images_audio", "model"):
        lambda tmp: make_invariant(tiny("gemma4"))(input_ids=torch.tensor([[5, 6]]),
                                                   pixel_values=torch.zeros(1, 4, 768)),
    ("softcap_argument", "model"): lambda tmp: softcap_in_attention("model"),
    ("softcap_argument", "engine"): lambda tmp: softcap_in_attention("engine"),
    ("bidirectional_attention", "*"): lambda tmp: make_invariant(tiny("gemma3_text", use_bidirectional_attention=True)),
    ("architecture_not_causal_lm", "*"): lambda tmp: load_checkpoint(save_sequence_classification_checkpoint, tmp),
    ("unsupported_model_type", "*"): lambda tmp: load_checkpoint(save_encoder_checkpoint, tmp),
    ("tensor_parallel_ray", "ray"): lambda tmp: score_cli(tmp, "--tensor-parallel-size", "2", "--ray"),
    ("encoder", "generate"): lambda tmp: make_invariant(encoder()).generate(input_ids=torch.tensor([[5, 6]])),
    ("encoder", "engine"): lambda tmp: engine_support(encoder()),
    ("encoder", "speculative"): lambda tmp: engine_support(encoder(), speculative={"method": "ngram"}),
    ("encoder", "ray"): lambda tmp: command_check(save_encoder_checkpoint, "ray", tmp),
    ("encoder", "tensor_parallel"): lambda tmp: sharded_encoder(),
    ("encoder", "trl"): lambda tmp: trl_check(encoder()),
    ("encoder", "scoring"): lambda tmp: __import__("invariant_infer").score_sequences(make_invariant(encoder()),
                                                                                      [[5, 6, 7]]),
    ("encoder_packed_rows", "model"): lambda tmp: encoder_packed_rows(),
    ("encoder_train_mode", "model"): lambda tmp: encoder_in_train_mode(grad=False),
    ("encoder_train_mode", "training"): lambda tmp: encoder_in_train_mode(grad=True),
    ("modernbert_training", "training"): lambda tmp: modernbert_backward(),
}


def no_cells() -> list[tuple[str, str]]:
    """Every "no" cell; a row refused on every surface is one cell, "*"."""
    cells = []
    for row in ROWS:
        if set(row.refused) == set(EVERY_SURFACE):
            cells.append((row.name, "*"))
        else:
            cells += [(row.name, surface) for surface in row.refused]
    return cells


def test_every_no_cell_has_a_trigger():
    missing = [cell for cell in no_cells() if cell not in TRIGGERS]
    assert not missing, f"no cells without a trigger in tests/test_support_table.py: {missing}"
    assert not set(TRIGGERS) - set(no_cells()), "triggers of cells the table no longer refuses"


def assert_refused_as_the_table_says(name: str, surface: str, tmp_path) -> None:
    row = support.BY_NAME[name]
    cell = surface if surface != "*" else "model"
    expected = row.refused[cell]
    try:
        printed = TRIGGERS[(name, surface)](tmp_path)
    except InvariantInferError as exc:
        # the scoring job reports a refusal of the model it loads as its own JobError, with the table's message
        assert type(exc) is expected.error or (type(exc) is JobError and expected.error is not JobError), repr(exc)
        assert row.message(cell) in str(exc), str(exc)
        return
    assert printed is not None, f"{name} on {surface}: nothing was refused"
    _, stderr = printed
    assert expected.error is JobError and row.message(cell) in stderr, stderr


@pytest.mark.parametrize("name, surface", no_cells(), ids=[f"{n}-{s}" for n, s in no_cells()])
def test_the_trigger_raises_the_tables_error_and_message(name, surface, tmp_path):
    assert_refused_as_the_table_says(name, surface, tmp_path)


def test_negative_control_a_refusal_that_leaves_the_table_fails_its_cell(monkeypatch, tmp_path):
    """Without the table's MXFP4 row, make_invariant still refuses the checkpoint, but in other words
    (the quantization module's list of methods): the cell's test fails."""
    monkeypatch.setattr(support, "ROWS", [row for row in ROWS if row.name != "mxfp4"])
    with pytest.raises(AssertionError):
        assert_refused_as_the_table_says("mxfp4", "*", tmp_path)


def test_require_raises_nothing_where_the_table_says_yes():
    for surface in SURFACES:
        require({"dense", "windowed", "fp8_block", "w4a16_int4", "lora"} - ({"lora"} if surface == "ray" else set()),
                surface)
    require({"hybrid", "lora"}, "tensor_parallel")  # a combination refuses only on its own surfaces


def test_negative_control_a_yes_cell_would_not_raise():
    """A trigger of a surface the table marks yes does not raise: the triggers test the refusals, not
    their own failures."""
    engine_support(tiny("qwen2"), max_loras=1)  # LoRA adapter slots on a dense model: yes
    require(model_kinds(tiny("qwen3_5_text")), "tensor_parallel")  # the dense hybrid: yes


def test_an_unknown_kind_or_surface_is_refused():
    with pytest.raises(InvalidArgumentError, match="unknown kinds"):
        require({"dense", "mixture_of_experts"}, "model")
    with pytest.raises(InvalidArgumentError, match="unknown surface"):
        require("dense", "vllm")


def test_every_kind_a_model_or_config_shows_is_in_the_table():
    shown = set().union(*(config_kinds(random_config(family, "tiny")) for family in FAMILIES))
    shown |= model_kinds(peft(tiny("qwen2")))
    assert shown <= support.KNOWN_KINDS


def test_a_combination_row_needs_all_its_kinds():
    assert refusal({"hybrid"}, "model") is None and refusal({"lora"}, "model") is None
    row, _ = refusal({"hybrid", "lora"}, "model")
    assert row.name == "hybrid_lora"
    assert refusal_message(row, "model", "qwen3_5_text").startswith("qwen3_5_text: make_invariant does not run")


def test_config_kinds_of_the_families_and_formats():
    assert config_kinds(random_config("qwen3_next", "tiny")) >= {"hybrid", "moe"}
    assert config_kinds(random_config("gpt_oss", "tiny")) >= {"moe", "windowed"}
    assert "vision_language" in config_kinds(random_config("qwen3_vl", "tiny"))
    for scheme, kind in (("FP8_DYNAMIC", "fp8_dynamic"), ("FP8_BLOCK", "fp8_block"), ("W8A8", "w8a8_int8"),
                         ("W4A16", "w4a16_int4")):
        assert config_kinds(qwen2_config(quantization_config=compressed_tensors(scheme))) == {"dense", "quantized",
                                                                                            kind}


@pytest.mark.parametrize("path", DOCS_WITH_THE_TABLE)
def test_the_docs_hold_the_generated_table(path):
    text = (ROOT / path).read_text()
    assert with_table(text) == text, f"{path}'s support table is stale: run `{REGENERATE}`"


def test_negative_control_a_stale_copy_is_caught():
    text = (ROOT / "README.md").read_text()
    stale = with_table(text, markdown().replace("| no [", "| yes [", 1))
    assert with_table(stale) != stale
