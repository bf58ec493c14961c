"""A complete tiny DiffusionGemma checkpoint with random weights, built locally in seconds.

It has the real architecture's shape (sliding and full attention layers with K = V on the full
ones, mixture of experts beside a dense MLP, self-conditioning, a Gemma-4 vision tower), a small
byte-level BPE tokenizer with the real special tokens, and a chat template of the real format.
Every code path (templating, label-token checks, images, reads, generation) runs on it; its answers
are random, and everything that serves it says so.

The build is deterministic for a seed: the same seed writes the same files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import DiffusionGemmaConfig, PreTrainedTokenizerFast
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import DiffusionGemmaGenerationConfig

TINY_MODEL_NAME = "djev-tiny-random"

# The real special tokens (Gemma 4 chat format). Order fixes their ids in the tiny vocabulary.
SPECIAL_TOKENS = (
    "<pad>", "<eos>", "<bos>", "<unk>",
    "<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|think|>",
    "<|image>", "<|image|>", "<image|>",
    "<|audio>", "<|audio|>", "<audio|>", "<|video|>",
)

# A chat template of the real format (written here, not copied): `<|turn>role\n...<turn|>\n`,
# thinking on marks the system turn with `<|think|>`, thinking off closes the model's turn with an
# empty thought block, an image in a user turn renders as the image token.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set think = enable_thinking is defined and enable_thinking -%}"
    "{%- set start = 0 -%}"
    "{%- if messages and messages[0]['role'] in ['system', 'developer'] -%}"
    "{{ '<|turn>system\\n' }}{% if think %}{{ '<|think|>' }}{% endif %}"
    "{%- if messages[0]['content'] is string -%}{{ messages[0]['content'] }}"
    "{%- else -%}{%- for part in messages[0]['content'] -%}{{ part['text'] }}{%- endfor -%}{%- endif -%}"
    "{{ '<turn|>\\n' }}"
    "{%- set start = 1 -%}"
    "{%- elif think -%}{{ '<|turn>system\\n<|think|><turn|>\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages[start:] -%}"
    "{{ '<|turn>' }}{{ 'model' if message['role'] == 'assistant' else message['role'] }}{{ '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' -%}{{ '<|image|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<turn|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|turn>model\\n' }}"
    "{%- if not think -%}{{ '<|channel>thought\\n<channel|>' }}{%- endif -%}"
    "{%- endif -%}"
)


def _label_candidates() -> list[str]:
    upper = [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    lower = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pairs = [a + b for a in upper for b in upper]
    return ["yes", "no"] + [str(d) for d in range(10)] + upper + lower + pairs


def _corpus() -> list[str]:
    """Text the BPE merges are learned from: the answer formats with every label, and prose."""
    lines: list[str] = []
    labels = _label_candidates()
    for position in range(1, 300):
        for label in labels[position % 7::7]:
            lines.append(f"q{position}: {label}\nq{position}{label} ")
    for label in labels:
        lines.append(f"q1: {label}\nq2{label} q3{label} " * 4)
    lines.append(_PROSE * 8)
    return lines


_PROSE = """Answer a fixed set of questions about the state the user provides. Each question lists
its allowed answers; reply with exactly one label per question. Reply with one line per question, in
this order, formatted as "id: label". Reply on one line with each question's id immediately followed
by its label, separated by single spaces. A reply may cover only some of the questions; answer every
line that is present. Question yes no true false the customer needs a reply within the hour. Which
team owns this? billing outage service down feature. How angry is the customer? calm annoyed furious.
Everything is down and we have a demo at noon. Fix it now. ticket note state photo image frame camera.
You are the eyes of a person walking forward. Judge only the center of the image, a window about 30
degrees wide directly ahead. all clear ahead danger: stairs danger: wall ahead danger: object ahead
danger: pet ahead door ahead left half right half obstacle. Under the Cube Rule of food identification
a food's category depends only on where its structural starch sits. toast sandwich taco sushi quiche
calzone salad soup starch bottom top sides enclosed liquid bowl cup. The quick brown fox jumps over the
lazy dog. {"ticket": "text", "note": "one photo attached", "questions": [1, 2, 3]} Answers so far:
Before answering, think in one short sentence about what is within 2 meters straight ahead.
"""


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with the real special tokens, wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
    )


def build_config(tokenizer: PreTrainedTokenizerFast, canvas_length: int = 128) -> DiffusionGemmaConfig:
    from transformers import DiffusionGemmaConfig

    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,  # five sliding layers, then one full layer (the real 5:1 pattern)
        num_attention_heads=4,
        num_key_value_heads=2,
        # vLLM's CPU attention supports head sizes 32, 64, 80, ... (16 is refused), so the tiny model
        # keeps to sizes every engine runs.
        head_dim=32,
        global_head_dim=64,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        sliding_window=64,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
        enable_moe_block=True,
        max_position_embeddings=8192,
        use_bidirectional_attention="vision",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        initializer_range=0.3,  # wide enough that different inputs give visibly different answers
    )
    vision = dict(
        model_type="gemma4_vision",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        patch_size=TINY_PATCH_SIZE,
        pooling_kernel_size=TINY_POOLING_KERNEL,
        position_embedding_size=512,
        # vLLM sizes its multimodal budget from this (soft tokens per image); without it vLLM cannot
        # start with images on. 70 is the image processor's budget below.
        default_output_length=TINY_IMAGE_SOFT_TOKENS,
    )

    def ids(token: str) -> int:
        found = tokenizer.convert_tokens_to_ids(token)
        assert isinstance(found, int)  # one token, one id (the declared type covers lists of tokens)
        return found

    return DiffusionGemmaConfig(
        text_config=text,
        vision_config=vision,
        boi_token_id=ids("<|image>"),
        eoi_token_id=ids("<image|>"),
        image_token_id=ids("<|image|>"),
        canvas_length=canvas_length,
        initializer_range=0.3,
    )


# Soft tokens per image: the smallest budget Gemma 4 supports.
TINY_IMAGE_SOFT_TOKENS = 70
# The vision tower's patches (pixels a side) and pooling kernel, which its image processor shares.
TINY_PATCH_SIZE = 8
TINY_POOLING_KERNEL = 3


def build_generation_config(tokenizer: PreTrainedTokenizerFast) -> DiffusionGemmaGenerationConfig:
    """The sampler settings, written as numbers: vLLM reads generation_config.json and fails on nulls.
    The values are transformers' DiffusionGemma defaults, as the hf engine keeps them (imported here,
    not at the top: the tiny model's name and marker check need neither torch nor the engine)."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        DiffusionGemmaGenerationConfig,
        EntropyBoundSamplerConfig,
    )

    from app.engine.hf.runner import GENERATION_DEFAULTS

    sampler = dict(GENERATION_DEFAULTS)
    entropy_bound = sampler.pop("entropy_bound")
    return DiffusionGemmaGenerationConfig(
        **sampler,
        sampler_config=EntropyBoundSamplerConfig(entropy_bound=entropy_bound),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def write_tiny_model(directory: str | Path, seed: int = 0) -> Path:
    """Write a loadable tiny checkpoint (config, weights, tokenizer, chat template, image processor)."""
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = build_config(tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DiffusionGemmaForBlockDiffusion(config).eval()
    model.generation_config = build_generation_config(tokenizer)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    image_processor = Gemma4ImageProcessorPil(
        patch_size=TINY_PATCH_SIZE,
        pooling_kernel_size=TINY_POOLING_KERNEL,
        max_soft_tokens=TINY_IMAGE_SOFT_TOKENS,
    )
    image_processor.save_pretrained(path)
    (path / "djev.json").write_text(json.dumps({"tiny": True, "name": TINY_MODEL_NAME, "seed": seed}) + "\n")
    return path


def is_tiny_checkpoint(directory: str | Path) -> bool:
    marker = Path(directory) / "djev.json"
    if not marker.is_file():
        return False
    try:
        return bool(json.loads(marker.read_text()).get("tiny"))
    except (OSError, ValueError):
        return False
