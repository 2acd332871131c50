"""Your own model, your own tokens, a TOML config: Hugging Face's Flax GPT-2 trained by
``jscaler train``, its weights in from and out to Hugging Face safetensors.

``factory()`` is what ``--model examples/hf_gpt2.py:factory`` calls: it returns the
model's params, the loss and an example batch of ``{"tokens", "targets"}`` (the batch
``--data`` fills). Run as a script, this file makes what the rest of the walk-through
reads (in the current folder): ``train.npy`` and ``eval.npy``, byte-level tokens of
jscaler's own docs (ids below 256), and ``hf-gpt2-init/``, a Hugging Face checkpoint
(``config.json``, ``model.safetensors``) of the same shape, standing in for one you
downloaded::

    python examples/hf_gpt2.py
    jscaler train --config examples/hf_gpt2.toml          # loss, eval loss, checkpoint
    jscaler export --checkpoint-dir ckpt/hf-gpt2 --out hf-gpt2-trained
    python -c "import transformers as t; t.FlaxGPT2LMHeadModel.from_pretrained('hf-gpt2-trained')"
"""

from pathlib import Path

import numpy as np
import optax
import transformers
from transformers import FlaxGPT2LMHeadModel, GPT2Config

transformers.logging.set_verbosity_error()  # 4.5x logs that its Flax classes are deprecated

# A real checkpoint's model: GPT2Config.from_pretrained(DIR) instead of this config.
CONFIG = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4)
BATCH, SEQ = 8, 64
DOCS = Path(__file__).resolve().parent.parent / "docs"


def factory():
    """``(params, loss, batch)`` for ``jscaler train --model examples/hf_gpt2.py:factory``."""
    model = FlaxGPT2LMHeadModel(CONFIG, seed=0)  # random init, nothing downloaded

    def loss(params, batch):  # next-token prediction on a batch of --data's windows
        logits = model(batch["tokens"], params=params).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    ids = np.zeros((BATCH, SEQ), np.int32)
    return model.params, loss, {"tokens": ids, "targets": ids}


def main() -> None:
    text = [p.read_bytes() for p in sorted(DOCS.glob("*.md"))]
    held_out = text.pop(0)  # one document never trained on
    np.save("train.npy", np.frombuffer(b"".join(text), np.uint8).astype(np.int32))
    np.save("eval.npy", np.frombuffer(held_out, np.uint8).astype(np.int32))
    FlaxGPT2LMHeadModel(CONFIG, seed=1).save_pretrained("hf-gpt2-init", safe_serialization=True)
    print("wrote train.npy, eval.npy and hf-gpt2-init/ (config.json, model.safetensors)")


if __name__ == "__main__":
    main()
