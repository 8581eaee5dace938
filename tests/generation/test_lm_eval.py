"""lm-evaluation-harness in process: ``HFLM(pretrained=make_invariant(model), tokenizer=tok, batch_size=N)``
gives bitwise the same per-sample results at batch size 1 and 8, for a multiple-choice task (loglikelihood:
right-padded batches, no attention mask) and a generate_until task (left-padded ``generate`` with
``max_length`` and stop strings). Everything is local: a random checkpoint, a word-level tokenizer
saved next to it, and JSON-lines tasks registered with ``TaskManager(include_path=...)``; sockets are
blocked while lm-eval runs. Every comparison is exact ``==``. One cell is a compressed-tensors FP8_BLOCK
checkpoint, whose control gives its quantized layers a per-tensor activation scale."""
from __future__ import annotations

import random
import socket
from dataclasses import replace

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

import invariant_infer.model.layer_forwards
from helpers.controls import per_tensor_scaled_quantized_forward
from helpers.lm_eval_tasks import LM_EVAL_WORDS, write_local_tasks
import lm_eval  # the test extra: lm-eval[hf]
from invariant_infer import make_invariant
from invariant_infer.kernels import linear
from invariant_infer.kernels.configs import linear_config
from invariant_infer.model import quantization
from invariant_infer.testing.quantized_checkpoints import save_quantized_checkpoint
from invariant_infer.testing.random_checkpoints import random_config, save_random_checkpoint
from lm_eval.models.huggingface import HFLM

MC_TASK, GEN_TASK = "invariant_mc", "invariant_gen"
FP8_BLOCK = "qwen2-fp8-block"  # a quantized checkpoint, in place of a family name
DOCS = 8
CHOICES = 3
MAX_GEN_TOKS = 4
STOP = "z"  # a letter of about one word in seven: some generations stop early, some run to max_gen_toks
EOS, PAD, UNK = "<eos>", "<pad>", "<unk>"


def _tokenizer() -> PreTrainedTokenizerFast:
    """Word level, ids 0..511: the three special tokens, then one id per word."""
    vocab = {token: i for i, token in enumerate([EOS, PAD, UNK, *LM_EVAL_WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, unk_token=UNK)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """Contexts of 1 to 16 words (every batch of 8 mixes lengths, so rows are padded), choices of
    1 to 3 words."""
    return write_local_tasks(tmp_path_factory.mktemp("lm_eval_tasks"), random.Random(1), mc_task=MC_TASK,
                             gen_task=GEN_TASK, docs=DOCS, choices=CHOICES, max_words=16, max_choice_words=3,
                             max_gen_toks=MAX_GEN_TOKS, stop=STOP)


@pytest.fixture(scope="module")
def task_manager(tasks):
    return tasks[0]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> a tiny random checkpoint with the word-level tokenizer saved next to it."""
    paths = {}

    def get(family: str):
        if family not in paths:
            # One layer: lm-eval runs each request alone at batch size 1, dozens of forwards through
            # Triton's interpreter; the model-level tests cover depth.
            folder = tmp_path_factory.mktemp(f"lm-eval-{family}")
            if family == FP8_BLOCK:  # every K a multiple of the 128-wide blocks
                config = random_config("qwen2", "tiny", num_hidden_layers=1, eos_token_id=0, pad_token_id=1,
                                       hidden_size=128, intermediate_size=256, num_attention_heads=2,
                                       num_key_value_heads=2)
                path = save_quantized_checkpoint(folder, config, "FP8_BLOCK")
            else:  # a hybrid keeps its two layers: one Gated DeltaNet, one attention
                layers = 2 if family == "qwen3_5_text" else 1
                config = random_config(family, "tiny", num_hidden_layers=layers, eos_token_id=0, pad_token_id=1)
                path = save_random_checkpoint(folder, config, seed=0)
            _tokenizer().save_pretrained(path)
            paths[family] = path
        return paths[family]
    return get


def load(path, dtype):
    """As users load a local model and its own tokenizer. (AutoTokenizer would not do: for
    model_type qwen2, transformers 5 builds a Qwen2Tokenizer whatever tokenizer_class says.)"""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return make_invariant(model), PreTrainedTokenizerFast.from_pretrained(path)


@pytest.fixture
def offline(monkeypatch):
    """lm-eval and datasets must not reach the network: hub flags on, and any connection fails."""
    import datasets.config
    import huggingface_hub.constants

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)

    def refuse(self, address, *args, **kwargs):
        raise AssertionError(f"lm-eval tried to connect to {address}")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)


def evaluate(model, tokenizer, task_manager, batch_size: int, tasks) -> dict[str, dict[int, list]]:
    """task -> doc_id -> that doc's per-request (resps, filtered_resps)."""
    out = lm_eval.simple_evaluate(model=HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size),
                                  tasks=list(tasks), task_manager=task_manager, log_samples=True,
                                  bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0)
    return {task: {s["doc_id"]: (s["resps"], s["filtered_resps"]) for s in out["samples"][task]} for task in tasks}


def check_shape(results):
    """The runs did what they claim: every doc, every choice, real numbers and text."""
    mc, gen = results[MC_TASK], results[GEN_TASK]
    assert sorted(mc) == sorted(gen) == list(range(DOCS))
    for resps, filtered in mc.values():
        assert len(resps) == CHOICES and len(filtered) == CHOICES
        for (logprob, greedy), in resps:
            assert isinstance(logprob, float) and logprob < 0 and isinstance(greedy, bool)
    texts = [filtered[0] for _, filtered in gen.values()]
    assert all(isinstance(t, str) and STOP not in t for t in texts)
    assert len(set(texts)) > 1, texts
    lengths = [len(t.split()) for t in texts]  # a word cut by the stop string still counts
    assert MAX_GEN_TOKS in lengths, f"no generation ran to max_gen_toks: {texts}"
    assert min(lengths) < MAX_GEN_TOKS, f"no generation stopped early: {texts}"
    assert sum(lengths) >= DOCS, f"generations are mostly empty: {texts}"


@pytest.fixture(scope="module")
def reference_store():
    """(family, dtype) -> the batch-size-1 results, reused by the negative control."""
    return {}


# One dense, one mixture-of-experts and one hybrid (Gated DeltaNet) family, and a compressed-tensors
# FP8_BLOCK checkpoint (fp8 weights in 128x128 blocks, fp8 activations scaled per token and group of
# 128): lm-eval has no family-specific path; every family and dtype is checked at model level (tests/model/), including
# right-padded batches without a mask.
@pytest.mark.parametrize("family, dtype", [("qwen2", torch.float32), ("mixtral", torch.bfloat16),
                                           (FP8_BLOCK, torch.bfloat16), ("qwen3_5_text", torch.bfloat16)],
                         ids=["qwen2-fp32", "mixtral-bf16", "qwen2-fp8-block-bf16", "qwen3_5_text-bf16"])
@pytest.mark.fast_cells(1)
def test_lm_eval_results_do_not_depend_on_batch_size(family, dtype, checkpoints, task_manager, offline,
                                                     reference_store):
    model, tokenizer = load(checkpoints(family), dtype)
    alone = evaluate(model, tokenizer, task_manager, 1, (MC_TASK, GEN_TASK))
    batched = evaluate(model, tokenizer, task_manager, 8, (MC_TASK, GEN_TASK))
    check_shape(alone)
    reference_store[(family, dtype)] = alone
    for task in (MC_TASK, GEN_TASK):
        for doc in range(DOCS):
            assert batched[task][doc] == alone[task][doc], f"{task} doc {doc}: batch 8 differs from batch 1"


def batch_keyed_linear(x, weight, bias=None, config=None):
    """Negative control: a smaller BLOCK_K once M (rows of the whole batch) passes 32, as M-keyed
    autotuners do. Every batch-size-1 request here has at most 32 tokens, so alone it is exactly
    the invariant linear; only the batched rows change their reduction order."""
    m = x.reshape(-1, x.shape[-1]).shape[0]
    config = config or linear_config(x.device.type, x.dtype, *weight.shape)
    if m > 32:
        config = replace(config, block_k=16)
    return linear(x, weight, bias, config=config)


def test_negative_control_batch_dependent_linear_is_caught(checkpoints, tasks, offline, reference_store,
                                                           monkeypatch):
    task_manager, mc_docs = tasks
    family, dtype = "qwen2", torch.float32
    model, tokenizer = load(checkpoints(family), dtype)
    alone = reference_store.get((family, dtype))
    if alone is None:  # run on its own
        alone = evaluate(model, tokenizer, task_manager, 1, (MC_TASK,))
    longest = max(len(tokenizer(doc["question"] + choice)["input_ids"]) for doc in mc_docs for choice in doc["choices"])
    assert longest <= 32, "batch size 1 must see the invariant linear"
    monkeypatch.setattr(invariant_infer.model.layer_forwards, "linear", batch_keyed_linear)
    batched = evaluate(model, tokenizer, task_manager, 8, (MC_TASK,))
    differ = [doc for doc in range(DOCS) if batched[MC_TASK][doc] != alone[MC_TASK][doc]]
    assert differ, "a batch-dependent linear should change some loglikelihood at batch size 8"


@pytest.mark.heavy
def test_negative_control_per_tensor_activation_scale_is_caught(checkpoints, task_manager, offline, reference_store,
                                                                monkeypatch):
    """The quantized layers with a dynamic per-tensor activation scale (the max over every token of
    the batch): lm-eval's batch-size-8 loglikelihoods change."""
    model, tokenizer = load(checkpoints(FP8_BLOCK), torch.bfloat16)
    alone = reference_store.get((FP8_BLOCK, torch.bfloat16))
    if alone is None:  # run on its own
        alone = evaluate(model, tokenizer, task_manager, 1, (MC_TASK,))
    monkeypatch.setattr(quantization, "_quantized_forward", per_tensor_scaled_quantized_forward)
    batched = evaluate(model, tokenizer, task_manager, 8, (MC_TASK,))
    assert [doc for doc in range(DOCS) if batched[MC_TASK][doc] != alone[MC_TASK][doc]]
