"""`diloco export` and `diloco sample`: the trained model out of a job, and text from it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from diloco.settings import add_tls_arguments, env_default, load_security, load_token, load_training_config
from diloco.transport.tls import Role


def export(args: argparse.Namespace) -> int:
    from diloco.export import assemble, model_files

    try:
        if args.checkpoints:
            model = assemble.from_checkpoints(args.checkpoints)
        else:
            targets = [t.strip() for t in (args.syncers or "").split(",") if t.strip()]
            if not targets:
                raise ValueError("name the shards (--syncers, DILOCO_SYNCERS) or their --checkpoints")
            token, security = load_token(args.token_file), load_security(Role.CLIENT, args)
            model = assemble.from_shards(targets, token, security=security)
        training = load_training_config(args.config) if args.config else None
        named = args.model or env_default("INIT_FROM")  # a checkpoint folder trained on holds its configuration
        config = model_files.save(args.out, model, named, training, tokenizer=args.tokenizer)
    except (OSError, ValueError) as error:
        print(f"diloco export: {error}", file=sys.stderr)
        return 2
    if config["preset"]:
        kind = f"the {config['preset']} preset"
    elif config["model_type"]:
        kind = f"a {config['model_type']} model"
    else:  # no configuration named, none found: the tensors as the loop named them
        kind = "a model of one's own (--model names a transformers configuration for Hugging Face's layout)"
    print(
        f"exported {len(model.tensors)} tensors of {kind}, {len(model.fragments)} fragments at outer step "
        f"{model.outer_steps} ({model.tokens} tokens), to {args.out}"
    )
    return 0


def sample(args: argparse.Namespace) -> int:
    from diloco.export.sample import continue_text

    try:
        text = continue_text(
            args.model, args.prompt, args.tokens, temperature=args.temperature, top_k=args.top_k, seed=args.seed
        )
    except (OSError, ValueError) as error:
        print(f"diloco sample: {error}", file=sys.stderr)
        return 2
    print(text)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export",
        help="write the global model from the syncer shards (live or their checkpoints) in Hugging Face's layout",
        description="Assembles the job's global model from every syncer shard, live over gRPC (--syncers) or "
        "from their checkpoint files (--checkpoints), into OUT in Hugging Face's layout (config.json, "
        "model.safetensors, generation_config.json, the tokenizer) with the job's record in OUT/diloco.json.",
    )
    p.add_argument("out", type=Path, help="folder to write the model into, in Hugging Face's layout")
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--syncers", default=env_default("SYNCERS"), help="comma-separated shard addresses, in index order"
    )
    source.add_argument(
        "--checkpoints", type=Path, nargs="+", help="shard checkpoint files, or folders holding shard-*-of-*.pt"
    )
    p.add_argument("--token-file", help="file with the job token (else DILOCO_TOKEN_FILE or DILOCO_TOKEN)")
    p.add_argument("--config", help="the job's training config JSON, recorded in diloco.json")
    p.add_argument(
        "--model",
        default=env_default("MODEL"),
        help="the model as the trainer was given it (a preset, a transformers config.json or inline JSON); "
        "unset: the preset the tensors fit",
    )
    p.add_argument(
        "--tokenizer", default=env_default("TOKENIZER"), help="the tokenizer.json it read (default: its preset's)"
    )
    add_tls_arguments(p)
    p.set_defaults(func=export)

    s = subparsers.add_parser(
        "sample",
        help="generate text from an exported model",
        description="Continues a prompt with an exported model, loaded with transformers and its tokenizer.",
    )
    s.add_argument("model", type=Path, help="an export folder (diloco export, or out/run/<mode>/model)")
    s.add_argument("--prompt", default="", help="text to continue")
    s.add_argument("--tokens", type=int, default=200, help="tokens to generate (bytes, for tiny and small)")
    s.add_argument("--temperature", type=float, default=0.8, help="0: always the likeliest token")
    s.add_argument("--top-k", type=int, default=40)
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=sample)
