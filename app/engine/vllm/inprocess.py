"""Engine `vllm`: vLLM's AsyncLLM in this process.

Reads go as in app/engine/vllm/wire.py, every canvas of a `read()` submitted at once for vLLM's
scheduler to batch; images as vLLM multimodal data; `generate()`/`stream()` are vLLM's own block
diffusion, and the raw chat route is relayed to vLLM's OpenAI chat serving built in this process
(app/engine/vllm/chat_serving.py). vLLM is imported only when this engine starts. Where vLLM
differs from the hf engine (seeds, the sliding window): docs/design.md §4.5.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import shlex
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Sequence

from app.engine.base import (
    ChatTokenizer,
    EngineError,
    EngineInputError,
    EngineUnavailable,
    GenerateChunk,
    GenerateResult,
    GenerateSpec,
    Prompt,
    ReaderInfo,
    ReadResult,
    ReadSpec,
    RelayedResponse,
    collect,
    decode_images,
    describe,
    gather_or_cancel,
)
from app.engine.vllm.chat_serving import InProcessChat
from app.engine.vllm.checkpoint import CheckpointConfig, load_tokenizer
from app.engine.vllm.wire import (
    STOCK_LOGPROB_ID_CAP,
    CanvasAnswer,
    ChunkCutter,
    label_id_groups,
    merge_answers,
    read_extra_args,
    read_results,
)

if TYPE_CHECKING:
    from vllm import SamplingParams  # pyright: ignore[reportMissingImports]  # optional: vLLM
    from vllm.inputs import TokensPrompt  # pyright: ignore[reportMissingImports]  # optional: vLLM
    from vllm.v1.engine.async_llm import AsyncLLM  # pyright: ignore[reportMissingImports]  # optional: vLLM

log = logging.getLogger("djev.engine")

VLLM_MISSING = ("--engine vllm needs vLLM in this environment: pip install 'djev[vllm]' on a GPU box "
                "(or use the Docker image); on a CPU-only machine scripts/setup.sh --vllm builds .venv-vllm")


@dataclass(frozen=True)
class VLLMOptions:
    """What the vllm engine is told; built from Settings by `app.build.vllm_options` (defaults there)."""

    device: str
    canvas_length: int
    max_seqs: int
    max_model_len: int
    max_num_batched_tokens: int  # 0 = vLLM's default
    gpu_util: float
    kv_cache_gb: float
    attn: str  # "auto" = TRITON_ATTN on a GPU, vLLM's choice on CPU
    extra_args: str
    cache_dir: str
    torch_mem_fraction: float  # 0 = off
    max_prompt_tokens: int
    served_name: str
    tiny: bool


def engine_argv(checkpoint: Path, options: VLLMOptions, on_gpu: bool) -> list[str]:
    """vLLM engine flags, as `vllm serve` would take them (EXTRA_ARGS last, so they win)."""
    argv = [
        "--model", str(checkpoint),
        "--served-model-name", options.served_name or checkpoint.name,
        "--max-num-seqs", str(options.max_seqs),
        "--max-model-len", str(options.max_model_len),
        "--enable-prefix-caching",
        "--diffusion-config", json.dumps({"canvas_length": options.canvas_length}),
        "--seed", "0",
    ]
    if options.max_num_batched_tokens:
        argv += ["--max-num-batched-tokens", str(options.max_num_batched_tokens)]
    if on_gpu:
        argv += ["--gpu-memory-utilization", str(options.gpu_util),
                 "--kv-cache-memory-bytes", str(int(options.kv_cache_gb * 2**30)),
                 "--attention-backend", "TRITON_ATTN" if options.attn == "auto" else options.attn]
    else:
        # float32 on CPU, as the hf engine runs there (the engines agree to 1e-4 in float32).
        argv += ["--dtype", "float32", "--enforce-eager"]
        if options.attn != "auto":
            argv += ["--attention-backend", options.attn]
    return argv + shlex.split(options.extra_args)


def plugin_status() -> dict[str, Any]:
    """djev_vllm_patch's report for this process ({} when the plugin is not installed)."""
    try:
        import djev_vllm_patch
    except ImportError:
        return {}
    return djev_vllm_patch.status()


def load_vllm_reader(checkpoint: str | Path, options: VLLMOptions) -> "VLLMReader":
    """The engine over a local checkpoint; vLLM itself starts in `start()`. ImportError with what to
    install when vLLM is missing."""
    try:
        import vllm  # noqa: F401  # pyright: ignore[reportMissingImports]  # optional: vLLM
    except ImportError as exc:
        raise ImportError(f"{VLLM_MISSING} ({exc})") from None
    path = Path(checkpoint)
    config = CheckpointConfig.read(path)
    tokenizer, _ = load_tokenizer(path, config)
    info = ReaderInfo(model=options.served_name or path.name, engine="vllm", device="starting",
                      tiny=options.tiny, canvas_length=options.canvas_length, checkpoint=str(path))
    return VLLMReader(path, tokenizer, info, options, config.sliding_window)


class VLLMReader:
    stat_gauges = ("logprob_id_cap", "window_verified")  # levels, not counts (for /metrics)

    def __init__(self, checkpoint: Path, tokenizer: ChatTokenizer, info: ReaderInfo, options: VLLMOptions,
                 window: int) -> None:
        self.checkpoint = checkpoint
        self.tokenizer = tokenizer
        self.info = info
        self.options = options
        self.sliding_window = window
        self.counts: Counter[str] = Counter()
        self._engine: AsyncLLM | None = None
        self._ids = itertools.count()
        self._logprob_cap = STOCK_LOGPROB_ID_CAP
        # Whether djev_vllm_patch anchors the canvas window on every attention backend seen (set at
        # start from its status): only then do reads past the sliding window match the hf engine.
        self.window_verified = False
        self._chat: InProcessChat | None = None
        self._chat_error = "the engine is not running"

    # ------------------------------------------------------------------ life

    @property
    def ready(self) -> bool:
        return self._engine is not None and not getattr(self._engine, "errored", False)

    @property
    def degraded(self) -> str | None:
        return None  # vLLM runs as configured or does not start

    @property
    def stats(self) -> dict[str, float]:
        return {**self.counts, "logprob_id_cap": self._logprob_cap, "window_verified": int(self.window_verified)}

    async def start(self) -> None:
        if self._engine is not None:
            return
        on_gpu = self._on_gpu()
        if self.options.cache_dir:
            root = Path(self.options.cache_dir).expanduser().resolve()
            os.environ.setdefault("VLLM_CACHE_ROOT", str(root / "vllm"))
            os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
        if not on_gpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(self.options.kv_cache_gb))))
        if on_gpu and self.options.torch_mem_fraction > 0:
            import torch

            torch.cuda.set_per_process_memory_fraction(self.options.torch_mem_fraction)
        from vllm.engine.arg_utils import AsyncEngineArgs  # pyright: ignore[reportMissingImports]  # optional: vLLM
        from vllm.entrypoints.launchers.cli_args import make_arg_parser  # pyright: ignore[reportMissingImports]  # optional: vLLM
        from vllm.utils.argparse_utils import FlexibleArgumentParser  # pyright: ignore[reportMissingImports]  # optional: vLLM
        from vllm.v1.engine.async_llm import AsyncLLM  # pyright: ignore[reportMissingImports]  # optional: vLLM

        # vLLM's server parser (the engine's flags and the OpenAI serving's), so EXTRA_ARGS takes
        # anything `vllm serve` takes and the in-process chat serving is set up like vLLM's own.
        parser = make_arg_parser(FlexibleArgumentParser(prog="djev --engine vllm"))
        argv = engine_argv(self.checkpoint, self.options, on_gpu)
        log.info("starting vLLM in process: %s", shlex.join(argv))
        args = parser.parse_args(argv)
        assert args is not None  # vLLM's parse_args() returns argparse's Namespace (it leaves itself unannotated)
        self._engine = AsyncLLM.from_engine_args(AsyncEngineArgs.from_cli_args(args))
        try:
            self._chat = await InProcessChat.build(self._engine, args)
        except Exception as exc:  # noqa: BLE001 - reads work without it; the raw chat route then says why
            self._chat_error = describe(exc)
            log.warning("vLLM's chat serving did not start in process (%s): the raw chat route answers 502",
                        self._chat_error)
        status = plugin_status()
        if status.get("loaded") and status.get("max_logprob_token_ids"):
            self._logprob_cap = int(status["max_logprob_token_ids"])
        self.window_verified = bool(status.get("loaded") and "canvas_window" in status.get("patches", [])
                                    and not status.get("unverified_backends_seen"))
        if not status:
            log.warning("djev_vllm_patch is not installed: reads whose prompt + canvas passes the sliding window "
                        "(%d tokens) will not match the hf engine, and reads take at most %d label ids per request",
                        self.sliding_window, STOCK_LOGPROB_ID_CAP)
        elif not status.get("loaded"):
            log.warning("djev_vllm_patch did not patch this vLLM: %s", status.get("refused"))
        self.info = ReaderInfo(
            model=self.info.model, engine="vllm", device=self._device_name(on_gpu), tiny=self.info.tiny,
            canvas_length=self.info.canvas_length, checkpoint=self.info.checkpoint)

    async def stop(self) -> None:
        self._chat = None
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()

    def _on_gpu(self) -> bool:
        if self.options.device == "cpu":
            return False
        from vllm.platforms import current_platform  # pyright: ignore[reportMissingImports]  # optional: vLLM

        return bool(current_platform.is_cuda_alike())

    @staticmethod
    def _device_name(on_gpu: bool) -> str:
        if not on_gpu:
            return "cpu (vLLM)"
        import torch

        return torch.cuda.get_device_name(0)

    # ------------------------------------------------------------------ reads

    async def read(self, specs: Sequence[ReadSpec]) -> list[ReadResult]:
        engine = self._running()
        inputs = [await self._engine_input(spec.prompt, spec.width) for spec in specs]
        jobs = []
        for spec, prompt in zip(specs, inputs):
            # A spec's label ids are grouped (and its slots gathered) once, for all its canvases.
            groups, slots = label_id_groups(spec, self._logprob_cap), frozenset(spec.slots)
            jobs += [self._read_canvas(engine, spec, prompt, canvas, groups, slots) for canvas in spec.canvases]
        results = read_results(specs, await gather_or_cancel(jobs))
        for spec, result in zip(specs, results):
            self.warn_past_window(result.prompt_tokens + spec.width)
        self.counts["reads"] += len(specs)
        return results

    def warn_past_window(self, tokens: int) -> None:
        """Count (`reads_past_unverified_window`) and log a read of `tokens` prompt + canvas tokens
        that passes the sliding window while the window is not `window_verified`: its slot
        probabilities may differ from the hf engine's. `read` calls it for every read."""
        if self.window_verified or not self.sliding_window or tokens <= self.sliding_window:
            return
        self.counts["reads_past_unverified_window"] += 1
        log.warning("a read of %d prompt + canvas tokens passes the sliding window (%d) on an attention backend "
                    "djev_vllm_patch has not verified: its slot probabilities may differ from the hf engine's",
                    tokens, self.sliding_window)

    async def _read_canvas(self, engine: AsyncLLM, spec: ReadSpec, prompt: TokensPrompt, canvas: tuple[int, ...],
                           groups: Sequence[tuple[int, ...]], slots: frozenset[int]) -> CanvasAnswer:
        """One canvas, one request per group of label ids (`label_id_groups`), answers merged."""
        from vllm import SamplingParams  # pyright: ignore[reportMissingImports]  # optional: vLLM

        parts = []
        for ids in groups:
            params = SamplingParams(max_tokens=len(canvas), logprob_token_ids=list(ids),
                                    extra_args=read_extra_args(spec, canvas))
            parts.append(self._final(engine, prompt, params, slots))
        return merge_answers(await gather_or_cancel(parts))

    async def _final(self, engine: AsyncLLM, prompt: TokensPrompt, params: SamplingParams,
                     slots: frozenset[int]) -> CanvasAnswer:
        """One request's answer; only the `slots` positions' logprobs are converted (the rest stay
        empty: nothing reads them), on the event loop, for every canvas."""
        final = None
        try:
            async for output in engine.generate(prompt, params, f"djev-read-{next(self._ids)}"):
                final = output
        except Exception as exc:  # noqa: BLE001 - every vLLM failure becomes the contract's error
            raise engine_error("the read", exc) from None
        self.counts["requests"] += 1
        output = final.outputs[0] if final is not None and final.outputs else None
        logprobs = output.logprobs if output is not None else None
        if final is None or output is None or logprobs is None:
            raise EngineError("vLLM returned no logprobs for a read")
        maps: list[dict[int, float]] = []
        for index, position in enumerate(logprobs):
            if index not in slots:
                maps.append({})
            elif position is None:  # vLLM types a position's logprobs as optional
                raise EngineError(f"vLLM returned no logprobs at slot {index} of a read")
            else:
                maps.append({int(token): float(entry.logprob) for token, entry in position.items()})
        return CanvasAnswer(maps, [int(t) for t in output.token_ids], len(final.prompt_token_ids or ()))

    async def _engine_input(self, prompt: Prompt, width: int) -> TokensPrompt:
        """vLLM's input for a prompt; a prompt past MAX_PROMPT_TOKENS, or one that leaves no room for
        the canvas within MAX_MODEL_LEN, is the client's (400), not vLLM's failure."""
        limit = min(self.options.max_prompt_tokens, self.options.max_model_len - max(width, 1))
        if len(prompt.ids) > limit:
            raise EngineInputError(
                f"the prompt is {len(prompt.ids)} tokens; this server reads at most {limit} "
                f"(MAX_PROMPT_TOKENS {self.options.max_prompt_tokens}, MAX_MODEL_LEN {self.options.max_model_len} "
                f"less the canvas)", status=400, param="state", error_type="max_tokens_exceeded")
        engine_input: TokensPrompt = {"prompt_token_ids": list(prompt.ids)}
        if prompt.images:
            engine_input["multi_modal_data"] = {"image": await asyncio.to_thread(decode_images, prompt)}
        return engine_input

    def _running(self) -> AsyncLLM:
        engine = self._engine
        if engine is None or not self.ready:
            raise EngineUnavailable("the engine is not running")
        return engine

    # ------------------------------------------------------------------ raw chat

    async def relay_chat(self, body: dict) -> RelayedResponse:
        """The body to vLLM's own chat completions serving in this process, unchanged."""
        self._running()
        if self._chat is None:
            raise EngineError(f"vLLM's chat serving is not running here: {self._chat_error}")
        try:
            return await self._chat.relay(body)
        except Exception as exc:  # noqa: BLE001
            raise engine_error("the chat completion", exc) from None

    # ------------------------------------------------------------------ generation

    async def generate(self, spec: GenerateSpec) -> GenerateResult:
        return await collect(self.stream(spec))

    async def stream(self, spec: GenerateSpec) -> AsyncIterator[GenerateChunk]:
        """vLLM's block diffusion; each chunk is what vLLM committed since the last. The seed is not
        sent (vLLM refuses per-request seeds for diffusion models)."""
        from vllm import SamplingParams  # pyright: ignore[reportMissingImports]  # optional: vLLM
        from vllm.sampling_params import RequestOutputKind  # pyright: ignore[reportMissingImports]  # optional: vLLM

        engine = self._running()
        if spec.temperature != 1.0:
            raise EngineInputError("temperature: vLLM generates at the checkpoint's own temperature schedule only",
                                   status=400, param="temperature")
        prompt = await self._engine_input(spec.prompt, 0)
        params = SamplingParams(max_tokens=spec.max_tokens, stop_token_ids=list(spec.stop_ids), top_p=spec.top_p,
                                output_kind=RequestOutputKind.DELTA)
        cutter = ChunkCutter(spec)
        self.counts["generations"] += 1
        try:
            async for output in engine.generate(prompt, params, f"djev-generate-{next(self._ids)}"):
                cutter.prompt_tokens = len(output.prompt_token_ids or ()) or cutter.prompt_tokens
                choice = output.outputs[0]
                chunk = cutter.chunk(choice.token_ids, output.finished, choice.finish_reason)
                yield chunk
                if chunk.done:
                    return
        except Exception as exc:  # noqa: BLE001
            raise engine_error("the generation", exc) from None
        yield cutter.end()


def engine_error(what: str, exc: BaseException) -> EngineError:
    """vLLM's exception as the contract's: the engine core gone is a 503, anything else a 502 that
    says what vLLM said (its EngineGenerateError carries the reason only as its cause)."""
    reasons = []
    current: BaseException | None = exc
    while current is not None and len(reasons) < 4:
        reasons.append(describe(current))
        current = current.__cause__
    message = f"vLLM failed {what}: " + " <- ".join(reasons)
    if type(exc).__name__ == "EngineDeadError":
        return EngineUnavailable(message)
    return EngineError(message)
