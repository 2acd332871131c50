"""``jscaler export``: a training checkpoint's parameters as a Hugging Face checkpoint."""

from __future__ import annotations

from pathlib import Path


def register(sub) -> None:
    ex = sub.add_parser(
        "export",
        help="write a checkpoint's parameters as a Hugging Face safetensors checkpoint",
        description="Read the parameters of a jscaler train checkpoint (the newest step, or "
        "--step) and write them to OUT/model.safetensors under PyTorch's names and "
        "layouts (what the Hugging Face Hub holds: 'transformer.h.0.mlp.c_fc.weight', "
        "Dense kernels transposed), which transformers loads in its PyTorch and Flax "
        "classes; with the model's config.json beside it, from_pretrained(OUT) builds "
        "the trained model. No model is built and no device holds the weights; "
        "optimizer state is left out.",
    )
    ex.add_argument(
        "--checkpoint-dir",
        required=True,
        metavar="CK",
        help="the --checkpoint-dir of a jscaler train run",
    )
    ex.add_argument(
        "--step", type=int, default=None, help="the step to export (default: the newest)"
    )
    ex.add_argument(
        "--format",
        choices=["safetensors"],
        default="safetensors",
        help="the output format (default safetensors)",
    )
    ex.add_argument("--out", required=True, metavar="DIR", help="the folder to write")
    ex.add_argument(
        "--hf-config",
        default=None,
        metavar="PATH",
        help="the model's Hugging Face config.json (or a folder holding one) to copy into "
        "OUT (default: CK/config.json, which train --init-from leaves there)",
    )
    ex.set_defaults(run=_export, devices=None)


def _export(args) -> int:
    from jscaler.runtime.checkpoint import read_params
    from jscaler.runtime.safetensors_io import write

    step, params = read_params(args.checkpoint_dir, args.step)
    config = args.hf_config
    if config is None and (Path(args.checkpoint_dir) / "config.json").is_file():
        config = Path(args.checkpoint_dir) / "config.json"
    path = write(args.out, params, config)
    size = sum(v.nbytes for v in params.values())
    print(
        f"exported step {step} of {args.checkpoint_dir}: {len(params)} tensors, "
        f"{size / 1e6:.2f} MB -> {path}"
    )
    if config is None:
        print(
            f"no config.json written: copy the model's into {args.out} (or pass --hf-config) "
            f"for from_pretrained({args.out!r})"
        )
    else:
        print(f"config: {Path(args.out) / 'config.json'} (from {config})")
    return 0
