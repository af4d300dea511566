"""``stride diagnose --model PATH --a SPEC --b SPEC``: the first layer where two runs of one model part ways.

``b`` is the reference: it runs first, on its own greedy tokens, and ``a`` is fed the same ones. Prints a table per
point (each layer after attention and after the MLP, then the logits) and the verdict, or the JSON report
(``--json``, documented in ``docs/diagnose.md``); ``--plot`` draws the relative errors. Exit status 0 when nothing
diverged, 1 when a point left the band or a greedy token flipped away from a near tie, 2 for bad arguments.

    stride diagnose --a tp=3 --b tp=1                       # the default model, three ranks against one
    stride diagnose --model /ckpt/llama8b --a dtype=bfloat16,device=cuda --b hf,device=cuda
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from stride.diagnose.compare import diagnose, plot
from stride.diagnose.runs import Schedule
from stride.diagnose.spec import RunSpec
from stride.model.files import default_model_path

DEFAULT_PROMPTS = ("The capital of France is", "def fibonacci(n):\n    ")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="", help="HF checkpoint directory or GGUF file (default: SmolLM2-135M)")
    p.add_argument("--a", required=True, metavar="SPEC",
                   help="the run under test: hf, or tp=N,backend=torch|sdpa|triton,dtype=...,quantize=w4a16,"
                        "kv=auto|fp8,graphs=on|off,device=cpu|cuda")
    p.add_argument("--b", required=True, metavar="SPEC", help="the reference run, same form")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts", default="", metavar="FILE", help="prompts, one per line")
    p.add_argument("--prompt-ids", action="append", default=[], metavar="IDS",
                   help="a prompt as comma-separated token ids (repeatable; no tokenizer needed)")
    p.add_argument("--decode-steps", type=int, default=4)
    p.add_argument("--chunk", type=int, default=0, help="tokens per step of the chunked prefill (0: a third of "
                                                         "the shortest prompt)")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    p.add_argument("--plot", default="", metavar="PNG", help="also draw the relative error per point")


def _prompts(args: argparse.Namespace, model: str) -> tuple[tuple[int, ...], ...]:
    ids = [tuple(int(x) for x in text.split(",") if x.strip()) for text in args.prompt_ids]
    texts = list(args.prompt)
    if args.prompts:
        with open(args.prompts, encoding="utf-8") as f:
            texts += [line.rstrip("\n") for line in f if line.strip()]
    if not texts and not ids:
        texts = list(DEFAULT_PROMPTS)
    if texts:
        from stride.tokenizer.loader import load_tokenizer

        tok = load_tokenizer(model)
        ids += [tuple(tok.encode(t)) for t in texts]
    return tuple(ids)


def main(args: argparse.Namespace) -> int:
    try:
        a, b = RunSpec.parse(args.a), RunSpec.parse(args.b)
        model = args.model or default_model_path()
        if not os.path.exists(model):
            raise ValueError(f"model not found: {model}")
        schedule = Schedule(_prompts(args, model), args.decode_steps, args.chunk)
    except (ValueError, OSError) as e:
        print(f"stride diagnose: {e}", file=sys.stderr)
        return 2
    report = diagnose(a, b, model, schedule)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(report.text())
    if args.plot:
        plot(report, args.plot)
    return 1 if report.diverged else 0
