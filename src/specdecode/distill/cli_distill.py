"""`specdecode distill`: train a draft for a target on the target's own answers (distill/run.py),
then print how to use and measure it."""

from __future__ import annotations

import argparse
import shlex
import sys

from specdecode.cli_args import add_kernel_arg, csv_list


def add_distill_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "distill",
        help="train a draft for its target on the target's own answers (LoRA adapters)",
        description="The target answers a prompt set (the bench suite's training split by "
        "default; its held-out prompts are never trained on), greedily and at each --temperatures "
        "value; the draft then learns the target's next-token distributions on those answers, as "
        "LoRA adapters, within --budget. Writes OUT/adapter and OUT/distill.json, then usable as "
        "--draft distilled:OUT (or distilled:OUT:int4). Interrupted or failed runs resume: run "
        "the same command again.",
    )
    parser.add_argument("--target", required=True, help="the target (as for generate)")
    parser.add_argument(
        "--draft",
        required=True,
        help="the draft model to train (a preset, folder or hub id; "
        "MODEL:int8 / MODEL:int4 speeds up the target's answers, training uses its own weights)",
    )
    parser.add_argument("--out", required=True, help="output folder (data, checkpoints, result)")
    parser.add_argument(
        "--prompts",
        default=None,
        help="a JSONL prompt file (bench format; default: the "
        "built-in suite), split into training and held-out prompts by id",
    )
    parser.add_argument("--categories", type=csv_list, default=None, help="comma-separated")
    parser.add_argument(
        "--self-prompts",
        type=int,
        default=None,
        metavar="N",
        help="also train on N prompts per category that the target writes itself, shown "
        "the category's training prompts as examples (and a seed topic, built-in categories)",
    )
    parser.add_argument(
        "--holdout",
        type=float,
        default=0.25,
        help="share of each category's prompts held out "
        "for measuring, never trained on (default 0.25: 2 of 8)",
    )
    parser.add_argument(
        "--temperatures",
        default="0,0.7",
        help="answers per prompt: 0 = greedy, others sampled "
        "(default 0,0.7: the temperatures to be served)",
    )
    parser.add_argument("--samples", type=int, default=1, help="answers per temperature > 0")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="per answer (128)")
    parser.add_argument("--top-k", type=int, default=32, help="target tokens kept per position")
    parser.add_argument("--no-chat", dest="chat", action="store_false", help="raw prompts")
    parser.add_argument(
        "--rows",
        type=int,
        default=8,
        help="answers (and self-written prompts) made at once by batched decoding of the "
        "target alone (default 8); 1: one at a time, sped up by --draft",
    )
    parser.add_argument(
        "--budget",
        default="30m",
        help="training time (90s, 30m, 1.5h) or trained tokens (200k, "
        "2M); a resumed run counts what ran before (default 30m)",
    )
    parser.add_argument(
        "--kind",
        choices=("lora", "eagle"),
        default="lora",
        help="what to train: lora (adapters on --draft; use as --draft distilled:OUT) or eagle "
        "(an EAGLE-3 head over three of the target's hidden states, written in the published "
        "speculators layout; --draft only speeds up the answers; use as --draft eagle3:OUT or "
        "eagle3:OUT:int4)",
    )
    parser.add_argument("--loss", choices=("kl", "tv"), default="kl", help="forward KL or TV")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--lora-alpha", type=float, default=None, help="default: 2 x rank")
    parser.add_argument("--lr", type=float, default=2e-4, help="learning rate (AdamW)")
    parser.add_argument("--batch-size", type=int, default=4, help="answers per step")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        help="the models' weights for answering (bfloat16); "
        "training keeps float32 weights, with bfloat16 autocast where this is bfloat16 and "
        "that is faster",
    )
    parser.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:N (default: cuda if present)"
    )
    parser.add_argument(
        "--autocast",
        choices=("auto", "bf16", "off"),
        default="auto",
        help="training in bfloat16 autocast: auto (when --dtype is bfloat16 and a measured "
        "linear layer trains faster so), bf16, off",
    )
    add_kernel_arg(parser, draft_vocab=False)  # it trains and measures drafts with every id
    parser.set_defaults(func=handle_distill, chat=True)
    return parser


def settings_from_args(args: argparse.Namespace):
    from specdecode.distill.settings import Budget, DistillSettings, parse_temperatures

    settings = DistillSettings(
        target=args.target,
        draft=args.draft,
        out=args.out,
        prompts=args.prompts,
        categories=args.categories,
        self_prompts=args.self_prompts,
        holdout=args.holdout,
        temperatures=parse_temperatures(args.temperatures),
        samples=args.samples,
        max_new_tokens=args.max_new_tokens,
        top_k=args.top_k,
        chat=args.chat,
        rows=args.rows,
        budget=Budget.parse(args.budget),
        loss=args.loss,
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lr=args.lr,
        batch_size=args.batch_size,
        checkpoint_every=args.checkpoint_every,
        seed=args.seed,
        dtype=args.dtype,
        device=args.device,
        autocast=args.autocast,
        kind=args.kind,
    )
    settings.validate()
    return settings


def handle_distill(args: argparse.Namespace) -> int:
    from specdecode.distill.run import run_distill
    from specdecode.distill.train import Interrupted
    from specdecode.models.files import DiskFull

    settings = settings_from_args(args)
    command = shlex.join(["specdecode", *getattr(args, "argv", [])])
    try:
        record = run_distill(settings, command=command)
    except Interrupted as err:
        print(f"specdecode: {err}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:  # while loading or writing the result: nothing half-done is kept
        print(
            f"specdecode: interrupted; the answers and checkpoints in {settings.out} are kept: "
            "run the same command again to continue",
            file=sys.stderr,
        )
        return 130
    except DiskFull as err:
        print(f"specdecode: error: {err}", file=sys.stderr)
        return 1
    print(summary(record, settings.out))
    return 0


def summary(record: dict, out: str) -> str:
    data, training = record["data"], record["training"]
    if record.get("kind") == "eagle":
        before, after = training["before"], training["after"]
        return "\n".join(
            [
                f"an EAGLE-3 head for {record['target']}: {data['answers']} answers "
                f"({data['tokens']} tokens); {len(data['heldout_prompt_ids'])} prompts held out",
                f"training: {training['steps']} steps, {training['tokens']} positions in "
                f"{training['seconds']:.0f} s; top-1 agreement with the target "
                f"{before['top1']:.3f} -> {after['top1']:.3f} (on {training['eval_answers']} "
                "training answers)",
                f"written: {out}/config.json, {out}/model.safetensors (the speculators "
                f"layout: vLLM and SGLang read it too), {out}/eagle.json",
                f"use it: --draft eagle3:{out} (or eagle3:{out}:int4)",
            ]
        )
    return "\n".join(
        [
            f"distilled {record['draft']} for {record['target']}: {data['answers']} answers "
            f"({data['tokens']} tokens) to {len(data['train_prompt_ids'])} prompts"
            + (f" + {len(data['self_prompt_ids'])} self-written" if data["self_prompt_ids"] else "")
            + f"; {len(data['heldout_prompt_ids'])} prompts held out",
            f"training: {training['steps']} steps, {training['tokens']} tokens in "
            f"{training['seconds']:.0f} s; {training['loss']} loss per token "
            f"{training['loss_before']:.4f} -> {training['loss_after']:.4f} (on "
            f"{training['eval_answers']} training answers)",
            f"written: {out}/adapter, {out}/distill.json",
            f"use it: --draft distilled:{out} (or distilled:{out}:int4)",
            f"measure it on the held-out prompts: python -m benchmarks.distill_gain {out}",
        ]
    )
