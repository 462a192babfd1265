"""lm-evaluation-harness against `pagedkv serve`, beside lm-eval's own
transformers backend on the same GGUF.

    pip install "lm_eval[api]"     # (a venv with --system-site-packages keeps torch)
    python tools/lm_eval_check.py [--model smollm2-135m-instruct] [--weights f32]

Starts the server on a loopback port and runs lm-eval's `local-completions`
model (echo with prompt logprobs, how lm-eval scores multiple choice through
an OpenAI-compatible server) on a multiple-choice task whose data lie in
tools/lm_eval_task (no download); then lm-eval's `hf` model on the GGUF
through transformers. Prints both accuracies and the largest difference
between the two backends' log-likelihoods of the same (question, choice).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import lm_eval
from lm_eval.tasks import TaskManager

from pagedkv.models import load
from pagedkv.models.fetch import fetch_gguf
from pagedkv.serve import ServerThread

TASK_DIR = Path(__file__).parent / "lm_eval_task"


def task_manager(folder: Path) -> TaskManager:
    """The task's YAML in folder, its data file named by absolute path."""
    data = (TASK_DIR / "questions.jsonl").resolve()
    text = (TASK_DIR / "pagedkv_mc.yaml").read_text().replace("questions.jsonl", str(data))
    (folder / "pagedkv_mc.yaml").write_text(text)
    return TaskManager(include_path=str(folder))


def loglikelihoods(result: dict) -> dict[tuple[int, int], float]:
    """(doc, choice) -> the log-likelihood lm-eval scored it with."""
    out = {}
    for sample in result["samples"]["pagedkv_mc"]:
        for choice, response in enumerate(sample["filtered_resps"]):
            out[(sample["doc_id"], choice)] = float(response[0])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--weights", default="f32", help="gguf, f32 or bf16")
    args = parser.parse_args()
    llm = load(args.model, weights=args.weights)
    gguf = Path(fetch_gguf(args.model))  # the file load() read (cached)
    with tempfile.TemporaryDirectory() as tmp:
        from transformers import AutoTokenizer

        tokenizer_dir = Path(tmp) / "tokenizer"
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(
            tokenizer_dir
        )
        tasks = task_manager(Path(tmp))
        with ServerThread(llm) as server:
            served = lm_eval.simple_evaluate(
                model="local-completions",
                model_args=(
                    f"base_url={server.url}/v1/completions,model={args.model},"
                    f"tokenizer={tokenizer_dir},num_concurrent=4,max_retries=1"
                ),
                tasks=["pagedkv_mc"],
                task_manager=tasks,
                log_samples=True,
            )
        reference = lm_eval.simple_evaluate(
            model="hf",
            model_args=(
                f"pretrained={gguf.parent},gguf_file={gguf.name},tokenizer={tokenizer_dir},"
                "dtype=float32,device=cpu"
            ),
            tasks=["pagedkv_mc"],
            task_manager=tasks,
            log_samples=True,
        )
    ours, theirs = loglikelihoods(served), loglikelihoods(reference)
    report = {
        "model": args.model,
        "weights": args.weights,
        "acc pagedkv serve (local-completions)": served["results"]["pagedkv_mc"]["acc,none"],
        "acc transformers (hf)": reference["results"]["pagedkv_mc"]["acc,none"],
        "choices scored": len(ours),
        "max |log-likelihood difference|": max(abs(ours[k] - theirs[k]) for k in ours),
        "same choice picked": sum(
            max(range(4), key=lambda c, d=d: ours[(d, c)])
            == max(range(4), key=lambda c, d=d: theirs[(d, c)])
            for d in {d for d, _ in ours}
        ),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
