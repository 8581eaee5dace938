"""``invariant-infer score --lora NAME=PATH``: rows name their adapter in a ``lora`` field; each row's
result is bitwise ``score_sequences`` of the ``PeftModel`` holding that adapter (base rows: of the
base model), whatever ``--max-batch-tokens``; unknown adapters are error rows, bad flags fatal."""
from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from helpers.scoring_rows import read_rows, write_jsonl
from invariant_infer import make_invariant, score_sequences
from invariant_infer.cli import exit_codes, score as scoring_cli
from invariant_infer.testing.random_checkpoints import qwen2_config, random_model, save_random_checkpoint

CONFIG = qwen2_config("tiny", num_hidden_layers=1)
ADAPTERS = {"a": LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"], init_lora_weights=False),
            "b": LoraConfig(r=4, lora_alpha=4, target_modules=["v_proj", "up_proj"], init_lora_weights=False)}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    model_dir = save_random_checkpoint(tmp_path_factory.mktemp("score-lora-base"), CONFIG, seed=4)
    adapters = {}
    for seed, (name, config) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        adapters[name] = tmp_path_factory.mktemp(f"score-lora-{name}")
        get_peft_model(random_model(CONFIG, seed=4), copy.deepcopy(config)).save_pretrained(adapters[name])
    return model_dir, adapters


def test_score_rows_on_their_adapters(paths, tmp_path):
    model_dir, adapters = paths
    g = torch.Generator().manual_seed(0)
    rows = [{"id": i, "input_ids": torch.randint(1, 256, (4 + i % 4,), generator=g).tolist()} for i in range(6)]
    for row, lora in zip(rows, ["a", "b", None, "a", "b", None]):
        if lora:
            row["lora"] = lora
    rows.append({"id": "bad", "input_ids": [1, 2, 3], "lora": "nope"})
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    flags = ["--model", str(model_dir), "--input", inp, "--dtype", "fp32", "--device", "cpu",
             "--lora", f"a={adapters['a']}", f"b={adapters['b']}"]
    outputs = {}
    for budget in (16, 4096):
        out = tmp_path / f"out-{budget}.jsonl"
        assert scoring_cli.main([*flags, "--output", str(out), "--max-batch-tokens", str(budget)]) == 1  # the bad row
        outputs[budget] = {str(r["id"]): r for r in read_rows(out)}
    assert outputs[16] == outputs[4096]
    got = outputs[16]
    assert "unknown LoRA adapter 'nope'" in got["bad"]["error"]
    for lora in ("a", "b", None):
        model = random_model(CONFIG, seed=4)
        model = PeftModel.from_pretrained(model, adapters[lora]) if lora else model
        mine = [r for r in rows[:6] if r.get("lora") == lora]
        want = score_sequences(make_invariant(model), [r["input_ids"] for r in mine])
        for row, result in zip(mine, want):
            assert got[str(row["id"])]["token_logprobs"] == result.token_logprobs.tolist()
            assert got[str(row["id"])].get("lora") == lora
    base = make_invariant(random_model(CONFIG, seed=4))  # the adapter changed row 0's scores
    assert score_sequences(base, [rows[0]["input_ids"]])[0].token_logprobs.tolist() != got["0"]["token_logprobs"]


@pytest.mark.parametrize("flag", [["--lora", "no-equals"], ["--lora", "a=/nonexistent/adapter"]])
def test_bad_lora_flags_are_fatal(paths, tmp_path, flag):
    model_dir, _ = paths
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": 0, "input_ids": [1, 2, 3]}])
    code = scoring_cli.main(["--model", str(model_dir), "--input", inp, "--output", str(tmp_path / "o.jsonl"),
                             "--device", "cpu", *flag])
    assert code == exit_codes.REFUSED
