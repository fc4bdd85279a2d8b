"""Train a tiny Llama with the Hugging Face Trainer under fxckpt; compare with an uncompiled run.

    FXCKPT_OPTIONS='{"segment_stride": 2, "offload": "all"}' python examples/hf_trainer.py

The Trainer cannot pass ``options=`` to ``torch.compile``, so fxckpt reads its options from
the ``FXCKPT_OPTIONS`` environment variable: a JSON object with the same keys as
``fxckpt.Options``, read when the backend first compiles a graph (explicit ``options=``
would win over it). This script sets a default for it when the variable is unset.

Two ways to hand the model to the Trainer:

- ``--via args``: ``TrainingArguments(torch_compile=True, torch_compile_backend="fxckpt")``.
  accelerate (>= 1.2) checks the backend name against its own ``DynamoBackend`` enum, which
  does not list fxckpt; ``fxckpt.register_with_accelerate()`` adds it, and this script calls
  it first.
- ``--via model`` (the default): compile the model yourself with
  ``torch.compile(model, backend="fxckpt")`` and give the compiled model to the Trainer with
  ``torch_compile`` left off, and ``remove_unused_columns=False`` (the Trainer would drop
  every batch key, since the compiled forward's signature is ``(*args, **kwargs)``).

The model is built from a small config: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
from typing import Any

import torch

import fxckpt

DEFAULT_OPTIONS = {"segment_stride": 2, "offload": "all", "min_offload_bytes": 0}


class TokenDataset(torch.utils.data.Dataset):
    """Random token sequences with labels equal to inputs (causal LM)."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def build_model(layers: int = 4, hidden: int = 64, vocab: int = 256) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return tf.LlamaForCausalLM(cfg)


def train(
    model: torch.nn.Module,
    data: torch.utils.data.Dataset,
    *,
    steps: int,
    via: str | None,
    grad_accum: int = 1,
    out_dir: str | None = None,
) -> list[float]:
    """Train ``steps`` optimizer steps; ``via`` None trains uncompiled. Returns the logged losses."""
    import transformers as tf

    compile_args: dict[str, Any] = {}
    if via == "args":
        fxckpt.register_with_accelerate()  # accelerate refuses backend names it does not list
        compile_args = {"torch_compile": True, "torch_compile_backend": "fxckpt"}
    elif via == "model":
        model = torch.compile(model, backend="fxckpt")  # options from FXCKPT_OPTIONS
    with tempfile.TemporaryDirectory() as tmp:
        args = tf.TrainingArguments(
            output_dir=out_dir or tmp,
            max_steps=steps,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=grad_accum,
            learning_rate=1e-3,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            seed=0,
            dataloader_num_workers=0,
            disable_tqdm=True,
            # The Trainer drops batch keys the model's forward signature does not name; a
            # compiled model's forward is (*args, **kwargs), which names none of them.
            remove_unused_columns=False,
            **compile_args,
        )
        trainer = tf.Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--via", choices=["model", "args"], default="model")
    args = parser.parse_args()
    os.environ.setdefault("FXCKPT_OPTIONS", json.dumps(DEFAULT_OPTIONS))
    print(f"FXCKPT_OPTIONS={os.environ['FXCKPT_OPTIONS']}")

    model = build_model()
    data = TokenDataset(4 * args.steps, args.seq, vocab=256)
    plain = train(copy.deepcopy(model), data, steps=args.steps, via=None)
    compiled = train(model, data, steps=args.steps, via=args.via)
    print("step  uncompiled  fxckpt")
    for i, (a, b) in enumerate(zip(plain, compiled, strict=True), 1):
        print(f"{i:4d}  {a:10.4f}  {b:6.4f}")
    for plan in fxckpt.last_plans():
        print(plan.summary())
    s = fxckpt.stats()
    print(f"offloaded {s['offloaded_bytes'] / 2**20:.2f} MiB, pool hits {s['pool_hits']}, misses {s['pool_misses']}")


if __name__ == "__main__":
    main()
