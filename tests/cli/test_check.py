"""``invariant-infer check``: PASS on a supported checkpoint, the device, versions and pinned compile
options printed; an unsupported architecture or model type refused by name before anything loads;
and its negative controls: a linear kernel whose BLOCK_K depends on M fails the probe, a forward hook
that reduces outside the kernels fails the audit, each with the failing check named."""
from __future__ import annotations

import sys

import pytest
import torch
import transformers
import triton
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

import invariant_infer.model.layer_forwards
from helpers.controls import m_dependent_linear
from helpers.servers import run_bounded
from helpers.unsupported_checkpoints import save_encoder_checkpoint, save_sequence_classification_checkpoint
from invariant_infer.checkpoints.loading import auto_class_for
from invariant_infer.cli import check as check_cli
from invariant_infer.cli import exit_codes, main
from invariant_infer.errors import UnsupportedModelError
from invariant_infer.testing.random_checkpoints import random_config, save_random_checkpoint

CHECKS = ("audit:", "left-padded batch", "right-padded batch", "decode step")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_random_checkpoint(tmp_path_factory.mktemp("check-qwen2"),
                                  random_config("qwen2", "tiny", num_hidden_layers=1), seed=2)


def check(capsys, path, *extra) -> tuple[int, str, str]:
    code = main(["check", "--model", str(path), "--dtype", "fp32", "--device", "cpu", *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def line_of(out: str, check_name: str) -> str:
    (line,) = [line for line in out.splitlines() if check_name in line and line.startswith(("PASS", "FAIL"))]
    return line


def test_a_supported_checkpoint_passes_every_check(checkpoint, capsys):
    code, out, _ = check(capsys, checkpoint)
    assert code == exit_codes.OK, out
    assert all(line_of(out, name).startswith("PASS") for name in CHECKS)
    assert "device:          cpu" in out
    for library, version in (("torch", torch.__version__), ("triton", triton.__version__),
                             ("transformers", transformers.__version__)):
        assert f"{library} {version}" in out
    assert "enable_fp_fusion=True" in out and "input_precision='ieee'" in out and "invariant-infer " in out


@pytest.mark.parametrize("save, named", [(save_sequence_classification_checkpoint, "Qwen3ForSequenceClassification"),
                                         (save_encoder_checkpoint, "model_type 'bert'")])
def test_an_unsupported_architecture_is_refused_by_name_before_loading(save, named, tmp_path, capsys, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("the checkpoint was loaded")
    monkeypatch.setattr(check_cli, "load_model", no_loading)
    code, out, err = check(capsys, save(tmp_path / "model"))
    assert code == exit_codes.UNSUPPORTED_MODEL and named in err
    assert "PASS" not in out and "FAIL" not in out


def with_architectures(config, *names):
    config.architectures = list(names)
    return config


def test_which_auto_class_loads_each_architecture_and_which_are_refused():
    """A causal LM loads as one, a vision-language family as image-text-to-text, and a multimodal Qwen3.5
    checkpoint as its language model (its own family); every other head or family is refused by name."""
    qwen3_5 = transformers.Qwen3_5Config(text_config=random_config("qwen3_5_text", "tiny").to_dict())
    runs = [(with_architectures(random_config("qwen2", "tiny"), "Qwen2ForCausalLM"), AutoModelForCausalLM),
            (random_config("qwen2", "tiny"), AutoModelForCausalLM),  # no architectures saved: the model type decides
            (with_architectures(random_config("qwen2_5_vl", "tiny"), "Qwen2_5_VLForConditionalGeneration"),
             AutoModelForImageTextToText),
            (with_architectures(qwen3_5, "Qwen3_5ForConditionalGeneration"), AutoModelForCausalLM)]
    for config, auto_class in runs:
        assert auto_class_for(config) is auto_class, config.architectures
    refused = [(with_architectures(random_config("qwen3", "tiny"), "Qwen3ForTokenClassification"),
                "Qwen3ForTokenClassification is not an architecture"),
               (with_architectures(random_config("qwen2_5_vl", "tiny"), "Qwen2_5_VLModel"), "Qwen2_5_VLModel"),
               (with_architectures(transformers.Gemma3Config(), "Gemma3ForConditionalGeneration"),
                "model_type 'gemma3'"),
               (with_architectures(transformers.BertConfig(), "BertModel"), "model_type 'bert'")]
    for config, named in refused:
        with pytest.raises(UnsupportedModelError, match=named):
            auto_class_for(config)


def test_negative_control_a_block_k_chosen_by_m_fails_the_probe(checkpoint, capsys, monkeypatch):
    """Rows of 1 and 3 tokens alone run BLOCK_K 16, in a batch 64: their logits change, and so do a
    decode step's (M = 1) against its prefill's. The kernel is still ours: the audit passes."""
    monkeypatch.setattr(invariant_infer.model.layer_forwards, "linear", m_dependent_linear)
    code, out, _ = check(capsys, checkpoint)
    assert code == exit_codes.NOT_INVARIANT
    assert line_of(out, "audit:").startswith("PASS")
    for name in CHECKS[1:]:
        assert line_of(out, name).startswith("FAIL") and "(max |Δ| " in line_of(out, name), name
    assert "not batch-invariant here" in out


def test_negative_control_a_stray_op_in_a_forward_hook_fails_the_audit(checkpoint, capsys, monkeypatch):
    """A hook that multiplies the MLP's output by the identity through torch's matmul: the values stay,
    so the probe may pass, but the product reduces outside the kernels and the audit names it."""
    load = check_cli.load_model

    def load_with_hook(*args, **kwargs):
        model = load(*args, **kwargs)
        mlp = model.model.layers[0].mlp
        mlp.register_forward_hook(lambda module, inputs, output: output @ torch.eye(output.shape[-1]))
        return model
    monkeypatch.setattr(check_cli, "load_model", load_with_hook)
    code, out, _ = check(capsys, checkpoint)
    audit_line = line_of(out, "audit:")
    assert code == exit_codes.NOT_INVARIANT and audit_line.startswith("FAIL")
    assert "stray op aten." in out and "in model.layers.0.mlp" in out


def test_a_refusal_at_the_first_forward_exits_refused_not_batch_variant(checkpoint, capsys, monkeypatch):
    """FP8 on a GPU before compute capability 8.9 is refused at its first launch, inside the checks: that
    is a refusal (exit 2, the message on stderr), not a batch-variant result. Control: any other error
    in a check stays a failed check."""
    from invariant_infer.errors import UnsupportedOperationError
    from invariant_infer.testing.invariance_check import run_checks

    def refused():
        raise UnsupportedOperationError("quantize_activations on a GPU of compute capability 8.0: refused")

    def broken():
        raise RuntimeError("a broken check")
    with pytest.raises(UnsupportedOperationError):
        run_checks([("audit", "audit", refused)])
    assert run_checks([("audit", "audit", broken)]).failed == ["audit"]
    monkeypatch.setattr(invariant_infer.model.layer_forwards, "linear", lambda *args, **kwargs: refused())
    code, out, err = check(capsys, checkpoint)
    assert code == exit_codes.REFUSED and "compute capability 8.0: refused" in err
    assert "not batch-invariant" not in out


@pytest.mark.heavy
def test_the_check_command_in_a_subprocess(checkpoint, tmp_path):
    command = [sys.executable, "-m", "invariant_infer.cli", "check", "--dtype", "fp32", "--device", "cpu", "--model"]
    run = run_bounded([*command, str(checkpoint)], timeout=300)
    assert run.returncode == exit_codes.OK, run.stdout + run.stderr
    assert all(line_of(run.stdout, name).startswith("PASS") for name in CHECKS)
    refused = run_bounded([*command, str(save_sequence_classification_checkpoint(tmp_path / "cls"))], timeout=300)
    assert refused.returncode == exit_codes.UNSUPPORTED_MODEL and "Qwen3ForSequenceClassification" in refused.stderr
