"""Loading a compressed-tensors FP8 checkpoint (the layout of RedHatAI/diffusiongemma-26B-A4B-it-FP8-dynamic)
straight onto the device, with no bf16 copy of the weights.

Such a checkpoint's config.json has a `quantization_config` of `quant_method` "compressed-tensors",
format "float-quantized": 8-bit float weights with one scale per output channel (symmetric, static)
and 8-bit float activations quantized per token at run time; its `ignore` list keeps the routers, the
vision tower, self-conditioning, embed_vision and the unembedding in bf16. Its safetensors hold each
quantized projection as `<module>.weight` (e4m3) with `<module>.weight_scale` ([out, 1], float32 or
bf16), and the experts one by one: `<layer>.experts.<e>.{gate,up,down}_proj.weight` and
`.weight_scale`. Tensors are named as the model's own state dict names them (the decoder's layers,
which the encoder's are tied to, or the encoder's: either name of a tied tensor fills it).

The model is built on the meta device (app/engine/hf/meta.py), its text layers given empty FP8
modules and banks (app/engine/hf/quantize.py), then one real tensor per distinct weight is made on the
device and filled as the shards are read, the experts packed into their banks expert by expert.
Every tensor the model needs must be in the checkpoint, in the shape and kind (FP8, scale, plain) it
expects; the errors name the tensor. A scheme other than the one above is refused, naming its field.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    from app.engine.base import StartupProgress

log = logging.getLogger("djev.engine")

QUANT_METHOD = "compressed-tensors"
FORMAT = "float-quantized"
# The one scheme loaded: each field of a config group's `weights` and `input_activations` as it must
# be. Fields not named here (the observer, its arguments, scale dtypes) do not change the stored format.
WEIGHTS = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
INPUT_ACTIVATIONS = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
# Fields that must be absent or empty where present (a group size, blocks, an activation order).
UNSET = ("group_size", "block_structure", "actorder")
# An experts bank of the model as its state dict names it.
BANK = re.compile(r"(?P<prefix>.+\.experts)\.(?P<bank>gate_up_proj|down_proj)(?P<scale>_scale)?")
PHASE = "loading the FP8 weights"
REPORT_EVERY = 1024  # tensors between two progress reports


class CheckpointFormatError(ValueError):
    """A checkpoint djev cannot load as FP8: the message names the field or the tensor."""


def quantization_config(checkpoint: str | Path) -> dict[str, Any] | None:
    """The checkpoint's `quantization_config` (config.json), or None where it has none."""
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    found = config.get("quantization_config")
    if found is None:
        return None
    if not isinstance(found, dict):
        raise CheckpointFormatError(f"config.json's quantization_config is a {type(found).__name__}, not an object")
    return found


def is_fp8_checkpoint(quantization: Mapping[str, Any] | None) -> bool:
    """Whether a checkpoint's `quantization_config` says compressed-tensors (checked in full by `check_scheme`)."""
    return quantization is not None and quantization.get("quant_method") == QUANT_METHOD


def scheme_problems(quantization: Mapping[str, Any]) -> list[str]:
    """What in a `quantization_config` is not the FP8 scheme djev loads, each naming its field."""
    problems: list[str] = []
    where = "quantization_config"

    def expect(section: Mapping[str, Any], name: str, want: Any, path: str) -> None:
        got = section.get(name)
        if got != want:
            problems.append(f"{path}.{name} is {got!r}: djev loads {want!r}")

    expect(quantization, "quant_method", QUANT_METHOD, where)
    expect(quantization, "format", FORMAT, where)
    status = quantization.get("quantization_status")
    if status is not None and status != "compressed":
        problems.append(f"{where}.quantization_status is {status!r}: djev loads 'compressed' weights")
    for name in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if quantization.get(name):
            problems.append(f"{where}.{name} is set: djev loads dense, untransformed FP8 weights with a plain KV cache")
    groups = quantization.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        problems.append(f"{where}.config_groups is {groups!r}: djev loads one or more groups of the FP8 scheme")
        return problems
    for name, group in groups.items():
        path = f"{where}.config_groups.{name}"
        if not isinstance(group, dict):
            problems.append(f"{path} is {group!r}, not an object")
            continue
        if group.get("format") is not None:
            expect(group, "format", FORMAT, path)
        expect(group, "targets", ["Linear"], path)
        if group.get("output_activations") is not None:
            problems.append(f"{path}.output_activations is set: djev quantizes no outputs")
        for part, scheme in (("weights", WEIGHTS), ("input_activations", INPUT_ACTIVATIONS)):
            args = group.get(part)
            if not isinstance(args, dict):
                problems.append(f"{path}.{part} is {args!r}: djev loads {scheme}")
                continue
            for key, want in scheme.items():
                expect(args, key, want, f"{path}.{part}")
            for key in UNSET:
                if args.get(key) is not None:
                    problems.append(f"{path}.{part}.{key} is {args[key]!r}: djev loads none")
    return problems


def check_scheme(quantization: Mapping[str, Any]) -> None:
    """Refuse a `quantization_config` other than the FP8 scheme djev loads (CheckpointFormatError naming each field)."""
    problems = scheme_problems(quantization)
    if problems:
        raise CheckpointFormatError("this compressed-tensors checkpoint is not one djev loads: " + "; ".join(problems))


# ---------------------------------------------------------------------------------------- the tensors

@dataclass
class Slot:
    """One tensor the checkpoint must hold: where it goes (a parameter, a buffer, or one expert's
    rows of a bank), the shape it has there, and its kind: "fp8" (e4m3), "scale" (per output channel,
    stored [out] or [out, 1]) or "plain" (a bf16/float tensor, converted to the model's dtype)."""

    target: torch.Tensor
    kind: str
    names: list[str] = field(default_factory=list)  # every name it goes by (tied tensors have several)
    filled: bool = False

    def problem(self, name: str, tensor: torch.Tensor) -> str | None:
        """Why `tensor`, read as `name`, cannot fill this slot; None when it can."""
        from app.engine.hf.fp8 import is_fp8

        want = tuple(self.target.shape)
        shape = tuple(tensor.shape)
        if self.kind == "fp8":
            if not is_fp8(tensor):
                return f"{name} is {tensor.dtype}: djev reads it as float8_e4m3fn"
        elif not tensor.is_floating_point() or is_fp8(tensor):
            return f"{name} is {tensor.dtype}: djev reads it as a {'scale' if self.kind == 'scale' else 'bf16 or float'} tensor"
        if self.kind == "scale" and shape in (want, (*want, 1)):
            return None
        if shape != want:
            return f"{name} has shape {list(shape)}: djev expects {list(want) if self.kind != 'scale' else [*want, 1]}"
        return None


def expected_slots(model: DiffusionGemmaForBlockDiffusion) -> dict[str, Slot]:
    """Every checkpoint name the FP8 model reads, to its slot (tied names share one): its state dict,
    with each FP8 experts bank opened into one tensor an expert and a projection (gate and up are the
    two halves of gate_up_proj's rows)."""
    from app.engine.hf import fp8
    from app.engine.hf.quantize import Fp8Linear

    scales = {id(module.weight_scale) for module in model.modules() if isinstance(module, Fp8Linear)}
    unique: dict[tuple[int, str], Slot] = {}
    names: dict[str, Slot] = {}

    def add(name: str, key: tuple[int, str], target: torch.Tensor, kind: str) -> None:
        slot = unique.setdefault(key, Slot(target, kind))
        slot.names.append(name)
        names[name] = slot

    for name, tensor in model.state_dict(keep_vars=True).items():
        bank = BANK.fullmatch(name)
        if bank is not None and fp8.is_fp8(getattr(model.get_submodule(bank["prefix"]), bank["bank"])):
            scale = bool(bank["scale"])
            kind, suffix = ("scale", "weight_scale") if scale else ("fp8", "weight")
            for expert in range(tensor.shape[0]):
                rows = tensor[expert]
                if bank["bank"] == "gate_up_proj":
                    half = rows.shape[0] // 2
                    parts = (("gate_proj", rows[:half]), ("up_proj", rows[half:]))
                else:
                    parts = (("down_proj", rows),)
                for projection, target in parts:
                    tail = f"{expert}.{projection}.{suffix}"
                    add(f"{bank['prefix']}.{tail}", (id(tensor), tail), target, kind)
            continue
        kind = "fp8" if fp8.is_fp8(tensor) else "scale" if id(tensor) in scales else "plain"
        add(name, (id(tensor), ""), tensor, kind)
    return names


def shards(checkpoint: Path) -> list[Path]:
    """The checkpoint's safetensors files (the index's, or the one file)."""
    index = checkpoint / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return [checkpoint / name for name in sorted(set(weight_map.values()))]
    single = checkpoint / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointFormatError(f"{checkpoint} has no model.safetensors and no model.safetensors.index.json")


def fill(checkpoint: Path, slots: dict[str, Slot], progress: StartupProgress | None = None) -> list[str]:
    """Read the shards one by one, tensor by tensor, into their slots (on the slots' device). Raises
    CheckpointFormatError naming a tensor of the wrong kind or shape, and naming what is missing.
    Returns the checkpoint's names the model has no place for (left unread)."""
    import torch
    from safetensors import safe_open

    unique = {id(slot): slot for slot in slots.values()}
    unexpected: list[str] = []
    done = 0
    with torch.no_grad():
        for shard in shards(checkpoint):
            with safe_open(str(shard), framework="pt", device="cpu") as tensors:
                for name in tensors.keys():
                    slot = slots.get(name)
                    if slot is None:
                        unexpected.append(name)
                        continue
                    tensor = tensors.get_tensor(name)
                    problem = slot.problem(name, tensor)
                    if problem is not None:
                        raise CheckpointFormatError(f"{shard.name}: {problem}")
                    if slot.kind == "fp8":  # the bytes as stored (no conversion kernel, on any device)
                        slot.target.view(torch.uint8).copy_(tensor.view(torch.uint8).reshape(slot.target.shape))
                    else:  # a scale to float32 ([out, 1] to [out]), the rest to the model's dtype
                        slot.target.copy_(tensor.reshape(slot.target.shape))
                    if not slot.filled:
                        slot.filled = True
                        done += 1
                        if progress is not None and done % REPORT_EVERY == 0:
                            progress(PHASE, done, len(unique))
    missing = [" = ".join(slot.names) for slot in unique.values() if not slot.filled]
    if missing:
        shown = "; ".join(missing[:8]) + (f"; and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise CheckpointFormatError(f"{checkpoint} lacks {len(missing)} tensor(s) the model needs: {shown}")
    if progress is not None:
        progress(PHASE, len(unique), len(unique))
    return unexpected


def load_fp8_checkpoint(checkpoint: str | Path, device: torch.device, dtype: torch.dtype,
                        progress: StartupProgress | None = None) -> DiffusionGemmaForBlockDiffusion:
    """The model of a compressed-tensors FP8 checkpoint on `device`: its text layers' projections
    and experts in FP8 as stored, everything else in `dtype`. Refuses another scheme, a missing
    tensor, a tensor of the wrong kind or shape (CheckpointFormatError, naming it)."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    from app.engine.hf.meta import materialise, parameters_on_meta
    from app.engine.hf.quantize import install_empty_fp8

    path = Path(checkpoint)
    quantization = quantization_config(path)
    if quantization is None:
        raise CheckpointFormatError(f"{path}/config.json has no quantization_config: not an FP8 checkpoint")
    check_scheme(quantization)
    config = DiffusionGemmaConfig.from_pretrained(str(path))
    if hasattr(config, "quantization_config"):  # djev makes the model FP8 itself: transformers' quantizers stay out
        delattr(config, "quantization_config")
    with parameters_on_meta():
        model = DiffusionGemmaForBlockDiffusion._from_config(config, dtype=dtype, attn_implementation="sdpa")
    install_empty_fp8(model)
    materialise(model, device)
    unexpected = fill(path, expected_slots(model), progress)
    if unexpected:
        log.warning("%s holds %d tensor(s) the model has no place for, left unread: %s", path, len(unexpected),
                    ", ".join(unexpected[:5]))
    generation = model.generation_config_class
    try:
        model.generation_config = generation.from_pretrained(str(path))
    except OSError:
        log.info("%s has no generation_config.json: the model's defaults", path)
    return model.eval()
