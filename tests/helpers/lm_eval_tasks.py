"""Local lm-evaluation-harness tasks over JSON lines (no hub): a multiple-choice and a generate_until task."""
from __future__ import annotations

import json
import random
from itertools import product


def _lm_eval_words(count: int) -> list[str]:
    words = ["".join(w) for w in product("bdfgklmnprstvz", "aeiou", "bdgklmnprstxz")]
    random.Random(0).shuffle(words)
    return words[:count]


LM_EVAL_WORDS = _lm_eval_words(512 - 3)  # with the three special tokens, exactly the tiny models' vocab_size


def _text(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(LM_EVAL_WORDS) for _ in range(rng.randint(low, high)))


def write_local_tasks(root, rng: random.Random, *, mc_task: str, gen_task: str, docs: int, choices: int,
                      max_words: int, max_choice_words: int, max_gen_toks: int, stop: str):
    """A multiple-choice and a generate_until task over local JSON lines in ``root`` (no hub):
    (TaskManager, the multiple-choice docs)."""
    import yaml
    from lm_eval.tasks import TaskManager

    mc = [{"question": _text(rng, 1, max_words),
           "choices": [" " + _text(rng, 1, max_choice_words) for _ in range(choices)],
           "answer": rng.randrange(choices)} for _ in range(docs)]
    gen = [{"prompt": _text(rng, 1, max_words), "target": rng.choice(LM_EVAL_WORDS)} for _ in range(docs)]
    configs = {
        "mc": dict(task=mc_task, output_type="multiple_choice", doc_to_text="{{question}}",
                   doc_to_choice="{{choices}}", doc_to_target="answer", docs=mc, metric="acc"),
        "gen": dict(task=gen_task, output_type="generate_until", doc_to_text="{{prompt}}",
                    doc_to_target="{{target}}", docs=gen, metric="exact_match",
                    generation_kwargs=dict(until=[stop], max_gen_toks=max_gen_toks, do_sample=False)),
    }
    for name, config in configs.items():
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(doc) + "\n" for doc in config.pop("docs")))
        metric = config.pop("metric")
        config.update(dataset_path="json", test_split="test",
                      dataset_kwargs=dict(data_files=dict(test=str(data)), cache_dir=str(root / "datasets_cache")),
                      metric_list=[dict(metric=metric, aggregation="mean", higher_is_better=True)])
        (root / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return TaskManager(include_path=str(root), include_defaults=False), mc
