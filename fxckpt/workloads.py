"""What ``fxckpt inspect`` plans: a causal LM from a Hugging Face ``config.json`` (built on
``meta``; only JSON is read, and remote code is never loaded), or a user's factory."""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from fxckpt.inspect import TargetError, Workload, split_inputs


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The JSON object in ``path`` (a ``config.json`` or a folder holding one); nothing runs."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        raise TargetError(f"cannot read the config {str(p)!r}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise TargetError(f"{str(p)!r} is not valid JSON: {e}") from None
    if isinstance(data, dict) and isinstance(data.get("_class_name"), str):
        raise TargetError(f"{str(p)!r} is a diffusers config ({data['_class_name']}); --hf-config "
                          "builds transformers causal LMs: plan a diffusers model with a factory "
                          "(docs/cli.md, 'Diffusers models')")  # fmt: skip
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise TargetError(f"{str(p)!r} has no 'model_type'; is it a transformers config.json?")
    return data


def hf_workload(
    path: str | Path, *, batch: int = 1, seq: int = 2048, dtype: str = "bfloat16"
) -> Workload:
    """A causal LM built on ``meta`` from a ``config.json``, and token inputs of (batch, seq).

    Only JSON is read: the config class comes from transformers' own registry by
    ``model_type``, and remote code (``auto_map``) is never loaded.
    """
    try:
        import transformers
    except ImportError:
        raise TargetError("--hf-config needs transformers: pip install 'fxckpt[hf]'") from None
    data = read_hf_config(path)
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise TargetError(f"unknown dtype {dtype!r}; use bfloat16, float16 or float32")
    if batch < 1 or seq < 1:
        raise TargetError(f"batch and seq must be >= 1, got batch={batch}, seq={seq}")
    model_type = data.pop("model_type")
    data.pop("auto_map", None)  # remote code is never loaded
    data["use_cache"] = False  # a training step; a KV cache under dynamo only gets in the way
    try:
        config = transformers.AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError):
        raise TargetError(_unknown_model_type(transformers, model_type)) from None
    dtype_kw = "dtype" if _hf_takes_dtype(transformers.__version__) else "torch_dtype"
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(
                config, attn_implementation="sdpa", **{dtype_kw: torch_dtype}
            )
    except ValueError as e:
        raise TargetError(f"cannot build a causal LM from {str(path)!r}: {e}") from None
    n_params = sum(p.numel() for p in model.parameters())
    size = f"{n_params / 1e9:.1f}B" if n_params >= 1e9 else f"{n_params / 1e6:.1f}M"
    desc = f"{type(model).__name__} ({size} params), batch {batch} x seq {seq}, {dtype}"

    def inputs_at(length: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        tokens = torch.zeros(batch, length, dtype=torch.long, device="meta")
        return (), {"input_ids": tokens, "labels": tokens}

    return Workload(model, *inputs_at(seq), None, desc, inputs_at=inputs_at, seq=seq)


def _unknown_model_type(transformers: Any, model_type: str) -> str:
    """One line: the model type, the nearest that transformers knows, where the whole list is
    (transformers' own error lists every model type, some 11,000 characters)."""
    known = sorted(getattr(transformers, "CONFIG_MAPPING", {}).keys())
    near = difflib.get_close_matches(model_type, known, n=3)
    hint = f"; did you mean {', '.join(map(repr, near))}?" if near else ""
    return (f"transformers {transformers.__version__} does not know model_type {model_type!r}"
            f"{hint} (all {len(known)}: python -c \"import transformers; "
            "print(*transformers.CONFIG_MAPPING)\")")  # fmt: skip


def _hf_takes_dtype(version: str) -> bool:
    """transformers 4.56 renamed ``torch_dtype`` to ``dtype`` (the old name warns since)."""
    parts = version.split(".")
    try:
        return (int(parts[0]), int(parts[1])) >= (4, 56)
    except (ValueError, IndexError):
        return True


def _import_target(spec: str) -> Any:
    module_part, sep, attr = spec.rpartition(":")
    if not sep or not module_part or not attr:
        raise TargetError(f"TARGET {spec!r} should be pkg.module:factory or path/model.py:factory")
    if module_part.endswith(".py") or "/" in module_part or "\\" in module_part:
        path = Path(module_part)
        if not path.is_file():
            raise TargetError(f"no such file: {module_part}")
        name = f"fxckpt_target_{path.stem}"
        loader_spec = importlib.util.spec_from_file_location(name, path)
        if loader_spec is None or loader_spec.loader is None:
            raise TargetError(f"cannot import {module_part}")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = module  # dataclasses and pickling look the module up by name
        sys.path.insert(0, str(path.resolve().parent))  # so it can import its neighbours
        loader_spec.loader.exec_module(module)
    else:
        # A console script's sys.path starts at its bin folder; like `python -m`, look in the
        # current directory first, so `fxckpt inspect mypkg.model:factory` works from a checkout.
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_part)
        except ModuleNotFoundError as e:
            raise TargetError(f"cannot import {module_part!r}: {e}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise TargetError(f"{module_part!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TargetError(f"{spec!r} is not callable")
    return obj


def load_factory(spec: str) -> Any:
    """Import and call a factory on the meta device; returns a :class:`Workload`.

    The factory returns ``(model, example_inputs)``, ``(model, example_inputs, loss_fn)`` or a
    dict with keys ``model``, ``example_inputs`` and optionally ``loss_fn``. This runs the
    user's code: TARGET is trusted the way ``python -c "import pkg.module"`` is.
    """
    factory = _import_target(spec)
    with torch.device("meta"):
        made = factory()
    if isinstance(made, dict):
        model, inputs, loss_fn = made.get("model"), made.get("example_inputs"), made.get("loss_fn")
    elif isinstance(made, (tuple, list)) and len(made) in (2, 3):
        model, inputs, loss_fn = made[0], made[1], made[2] if len(made) == 3 else None
    else:
        raise TargetError(f"{spec} should return (model, example_inputs[, loss_fn]); "
                          f"got {type(made).__name__}")  # fmt: skip
    if not isinstance(model, torch.nn.Module):
        raise TargetError(f"{spec} returned a {type(model).__name__} where an nn.Module belongs")
    config: Any = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False  # a training step; a KV cache under dynamo only gets in the way
    seq = inspect.signature(factory).parameters.get("seq")
    if seq is None:
        return Workload(model, *split_inputs(inputs), loss_fn, spec)

    def inputs_at(length: int) -> Any:  # the factory's inputs at another length (--max-seq)
        with torch.device("meta"):
            again = factory(seq=length)
        return split_inputs(again.get("example_inputs") if isinstance(again, dict) else again[1])

    start = seq.default if isinstance(seq.default, int) else None
    return Workload(model, *split_inputs(inputs), loss_fn, spec, inputs_at=inputs_at, seq=start)
