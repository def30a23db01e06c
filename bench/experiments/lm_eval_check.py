"""lm-evaluation-harness scores a served model as its ``hf`` model does.

One small multiple-choice task (``lm_eval_task/``: 20 questions of 4 choices, a local JSONL) run
twice through lm_eval's Python API: ``local-completions`` against a served pdserve and ``hf`` on
the same checkpoint (float32, CPU). lm_eval scores each (question, choice) pair over the wire
with the legacy OpenAI call (``echo``, ``logprobs`` 1, ``max_tokens`` 1, token-id prompts,
several a request) and reads ``token_logprobs[ctxlen:-1]``: the continuation's tokens, less the
one generated. Both runs must pick the same answers (acc and acc_norm equal) and give every pair
the same loglikelihood within ``TOLERANCE_PER_TOKEN`` times its continuation's length in tokens.

    python -m pdserve.bench.experiments.lm_eval_check --url http://127.0.0.1:8000 \\
        --model-dir /path/to/checkpoint --model checkpoint

Nothing comes from a hub: the data is local and the hub flags are set before lm_eval runs.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
import urllib.request
from pathlib import Path
from typing import Any, TypedDict

import yaml

TASK_YAML = Path(__file__).resolve().parent / "lm_eval_task" / "pdserve_mc.yaml"
TASK = "pdserve_mc"
# A token's logprob is float32 through the same math on both sides, summed in another order:
# tests/test_prompt_logprobs.py sees ~5e-7 and holds 1e-5. A pair's loglikelihood sums its
# continuation's tokens, so the errors add up to at most that many times the bound.
TOLERANCE_PER_TOKEN = 1e-5
# Both sides put BOS first, as this tokenizer does by default: `hf` follows the tokenizer, while
# `local-completions` adds special tokens only when told, so both are told.
ADD_BOS = True


class Figures(TypedDict):
    served_acc: float
    served_acc_norm: float
    hf_acc: float
    hf_acc_norm: float
    pairs: int  # (question, choice) pairs scored by each side
    max_abs_diff: float  # over pairs: |served - hf| loglikelihood
    max_diff_per_token: float  # over pairs: that over the continuation's tokens
    over_tolerance: int  # pairs past TOLERANCE_PER_TOKEN * tokens
    requests: int  # completions pdserve answered during the served run
    prompt_tokens: int  # prompt tokens pdserve admitted during it
    expected_prompt_tokens: int  # every pair's context + continuation, as lm_eval tokenizes


def stay_offline() -> None:
    """Hub access off. huggingface_hub and datasets read the variables once, on import; one
    imported earlier in this process (a test session's transformers) has its flag set too."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    import datasets.config
    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = True
    datasets.config.HF_DATASETS_OFFLINE = True


def task_config(cache_dir: str) -> dict[str, Any]:
    """The task YAML with its data path made absolute: lm_eval passes ``data_files`` to
    ``datasets.load_dataset`` as is, which reads a relative one from the working directory."""
    cfg: dict[str, Any] = yaml.safe_load(TASK_YAML.read_text())
    root = TASK_YAML.parents[3]  # the YAML's path is from the repository root
    files = cfg["dataset_kwargs"]["data_files"]
    cfg["dataset_kwargs"] = {
        "data_files": {split: str(root / path) for split, path in files.items()},
        "cache_dir": cache_dir,  # the Arrow copy datasets makes, thrown away after
    }
    return cfg


def served_counters(url: str) -> tuple[int, int]:
    """(successful requests, admitted prompt tokens) from pdserve's /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    pattern = r'^pdserve_requests_total\{model="[^"]*",outcome="success"\} (\S+)$'
    requests = sum(float(v) for v in re.findall(pattern, text, re.M))
    tokens = re.search(r"^pdserve_prompt_tokens_total (\S+)$", text, re.M)
    return (
        int(requests),
        int(float(tokens.group(1))) if tokens else 0,
    )


def evaluate(
    model: str, model_args: dict[str, Any], task: dict[str, Any], batch_size: int
) -> tuple[dict[str, float], dict[tuple[int, int], float], list[tuple[str, str]]]:
    """One lm_eval run: its metrics, each (doc_id, choice)'s loglikelihood, and the
    (context, continuation) pairs in that order."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    # Without include_defaults=False it indexes every built-in task first: ~7 s a run here.
    tasks = TaskManager(include_path=str(TASK_YAML.parent), include_defaults=False)
    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task],
        batch_size=batch_size,
        device="cpu",
        log_samples=True,
        task_manager=tasks,
    )
    metrics = out["results"][TASK]
    scores: dict[tuple[int, int], float] = {}
    pairs: list[tuple[str, str]] = []
    for sample in sorted(out["samples"][TASK], key=lambda s: s["doc_id"]):
        for choice, ((ll, _greedy), args) in enumerate(
            zip(sample["filtered_resps"], sample["arguments"], strict=True)
        ):
            scores[sample["doc_id"], choice] = float(ll)
            pairs.append((args[0], args[1]))
    return {k: float(metrics[f"{k},none"]) for k in ("acc", "acc_norm")}, scores, pairs


def token_counts(model_dir: Path, pairs: list[tuple[str, str]]) -> tuple[list[int], int]:
    """Each pair's continuation length in tokens, and all pairs' prompt tokens: lm_eval encodes
    context + continuation whole and splits it after the context's tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    lengths = [len(tok(ctx + cont).input_ids) for ctx, cont in pairs]
    context = [len(tok(ctx).input_ids) for ctx, _ in pairs]
    return [w - c for w, c in zip(lengths, context, strict=True)], sum(lengths)


def check(url: str, model_dir: Path, model: str, batch_size: int = 8) -> Figures:
    stay_offline()
    with tempfile.TemporaryDirectory(prefix="lm-eval-data-") as cache_dir:
        task = task_config(cache_dir)
        before = served_counters(url)
        served_args = {
            "model": model,
            "base_url": f"{url}/v1/completions",
            "tokenizer": str(model_dir),
            "tokenizer_backend": "huggingface",  # not "auto", which probes the server for one
            "tokenized_requests": True,
            "add_bos_token": ADD_BOS,
            "max_retries": 1,  # a refusal is a finding: fail on it, no backing off
        }
        served, served_ll, pairs = evaluate("local-completions", served_args, task, batch_size)
        after = served_counters(url)
        hf_args = {"pretrained": str(model_dir), "dtype": "float32", "add_bos_token": ADD_BOS}
        # batch 1: no padding, so each pair runs the same shapes as on the server
        hf, hf_ll, _ = evaluate("hf", hf_args, task, 1)
    lengths, prompt_tokens = token_counts(model_dir, pairs)
    diffs = [abs(served_ll[k] - hf_ll[k]) for k in hf_ll]
    return Figures(
        served_acc=served["acc"],
        served_acc_norm=served["acc_norm"],
        hf_acc=hf["acc"],
        hf_acc_norm=hf["acc_norm"],
        pairs=len(hf_ll),
        max_abs_diff=max(diffs),
        max_diff_per_token=max(d / n for d, n in zip(diffs, lengths, strict=True)),
        over_tolerance=sum(
            d > TOLERANCE_PER_TOKEN * n for d, n in zip(diffs, lengths, strict=True)
        ),
        requests=after[0] - before[0],
        prompt_tokens=after[1] - before[1],
        expected_prompt_tokens=prompt_tokens,
    )


def table(f: Figures) -> str:
    rows = [
        ("", "local-completions (pdserve)", "hf"),
        ("acc", f"{f['served_acc']:.4f}", f"{f['hf_acc']:.4f}"),
        ("acc_norm", f"{f['served_acc_norm']:.4f}", f"{f['hf_acc_norm']:.4f}"),
    ]
    lines = [f"{a:<10} {b:>28} {c:>10}" for a, b, c in rows]
    lines += [
        f"pairs {f['pairs']}: max |Δ loglikelihood| {f['max_abs_diff']:.3g}, "
        f"max per token {f['max_diff_per_token']:.3g} "
        f"(tolerance {TOLERANCE_PER_TOKEN:g} a token; {f['over_tolerance']} pairs past it)",
        f"pdserve: {f['requests']} requests, {f['prompt_tokens']} prompt tokens "
        f"(lm_eval's pairs hold {f['expected_prompt_tokens']})",
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="a served pdserve, e.g. http://127.0.0.1:8000")
    p.add_argument("--model-dir", required=True, type=Path, help="the served checkpoint")
    p.add_argument("--model", required=True, help="the served model's name")
    p.add_argument("--batch-size", type=int, default=8, help="pairs in one served request")
    a = p.parse_args()
    print(table(check(a.url.rstrip("/"), a.model_dir, a.model, a.batch_size)))


if __name__ == "__main__":
    main()
