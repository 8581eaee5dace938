"""``invariant-infer demo --model`` on a checkpoint it does not run: the exit status table's code and the
refusal on stderr, not a traceback; an architecture or model type is refused before any weight loads."""
from __future__ import annotations

import pytest

from helpers.unsupported_checkpoints import save_encoder_checkpoint, save_sequence_classification_checkpoint
from invariant_infer.cli import demo as demo_cli
from invariant_infer.cli import exit_codes, main
from invariant_infer.errors import UnsupportedModelError


def demo(capsys, path) -> tuple[int, str, str]:
    capsys.readouterr()  # what saving the checkpoint printed
    code = main(["demo", "--model", str(path), "--dtype", "fp32", "--device", "cpu"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def no_loading(*args, **kwargs):
    raise AssertionError("the checkpoint was loaded")


@pytest.mark.parametrize("save, named", [
    (save_sequence_classification_checkpoint,
     "Qwen3ForSequenceClassification is not an architecture invariant-infer runs"),
    (save_encoder_checkpoint, "model_type 'bert' (BertForMaskedLM) is not a supported model type")])
def test_an_unsupported_checkpoint_exits_6_by_name_before_loading(save, named, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(demo_cli, "load_model", no_loading)
    code, out, err = demo(capsys, save(tmp_path / "model"))
    assert code == exit_codes.UNSUPPORTED_MODEL
    assert err.startswith(f"invariant-infer demo: {tmp_path / 'model'}: ") and named in err
    assert "Traceback" not in err and "rows bitwise equal" not in out


def test_a_missing_checkpoint_exits_2(tmp_path, capsys):
    code, _, err = demo(capsys, tmp_path / "absent")
    assert code == exit_codes.REFUSED and "cannot read the config of" in err


def test_a_model_refused_after_loading_exits_2(tmp_path, capsys, monkeypatch):
    """A refusal that is not the architecture's (make_invariant's, say) is the shared 'refused' status."""
    def refused(*args, **kwargs):
        raise UnsupportedModelError("make_invariant does not run MXFP4 experts")
    monkeypatch.setattr(exit_codes, "architecture_refusal", lambda command, path: None)
    monkeypatch.setattr(demo_cli, "load_model", refused)
    code, _, err = demo(capsys, tmp_path / "model")
    assert code == exit_codes.REFUSED and "make_invariant does not run MXFP4 experts" in err


def test_negative_control_without_the_check_the_classification_head_loads(tmp_path, capsys, monkeypatch):
    """Without the architecture check the demo goes on to load the checkpoint: the refusal above is the
    check's, not an accident of loading."""
    monkeypatch.setattr(exit_codes, "architecture_refusal", lambda command, path: None)
    monkeypatch.setattr(demo_cli, "load_model", no_loading)
    with pytest.raises(AssertionError, match="the checkpoint was loaded"):
        demo(capsys, save_sequence_classification_checkpoint(tmp_path / "model"))
