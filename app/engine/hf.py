"""Engine `hf`: transformers' DiffusionGemmaForBlockDiffusion in this process, CPU or CUDA.

Reads and generations from every request go into one bounded queue; a single batching loop takes
what is waiting (up to a row budget), runs it on the one engine thread, and hands results back.
Reads that arrive together share one decoder pass (see `diffusion.py`), so N concurrent decisions
cost far fewer model calls than N.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from app.engine.base import (
    EngineError,
    EngineInputError,
    EngineUnavailable,
    GenerateResult,
    GenerateSpec,
    ReaderInfo,
    ReadResult,
    ReadSpec,
)

log = logging.getLogger("djev.engine")


@dataclass(frozen=True)
class HFOptions:
    """What the hf engine is told; built from Settings by `app.cli.hf_options` (defaults live there)."""

    device: str  # "auto", "cpu", "cuda", "cuda:1", ...
    max_prompt_tokens: int
    kv_cache_entries: int
    max_batch_rows: int
    queue_limit: int
    served_name: str
    canvas_length: int
    tiny: bool
    torch_threads: int  # 0 = torch's default
    cuda_graphs: bool  # replay decoder passes as CUDA graphs (CUDA only)


def pick_device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def load_hf_reader(checkpoint: str | Path, options: HFOptions) -> "HFReader":
    """Load a local DiffusionGemma checkpoint directory (config, weights, tokenizer, processor)."""
    import torch
    from transformers import AutoImageProcessor, AutoTokenizer, DiffusionGemmaForBlockDiffusion

    from app.engine.diffusion import DiffusionRunner
    from app.engine.tokenizer import HFChatTokenizer

    path = Path(checkpoint)
    if options.torch_threads > 0:
        torch.set_num_threads(options.torch_threads)
    device_name = pick_device(options.device)
    device = torch.device(device_name)
    on_cuda = device.type == "cuda"
    kwargs: dict[str, Any] = {"dtype": torch.bfloat16 if on_cuda else torch.float32, "attn_implementation": "sdpa"}
    if on_cuda:
        # The eager loop over experts is 13x slower on an H200 (spec/engine.md, appendix).
        kwargs["experts_implementation"] = "grouped_mm"
    log.info("loading %s on %s (%s)", path, device_name, kwargs["dtype"])
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(str(path), **kwargs).to(device).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(str(path))
    try:
        image_processor = AutoImageProcessor.from_pretrained(str(path), backend="pil")
    except Exception as exc:  # noqa: BLE001 - a checkpoint without an image processor still reads text
        log.warning("no image processor in %s (%s): image states will be refused", path, exc)
        image_processor = None
    tokenizer = HFChatTokenizer(
        hf_tokenizer, vocab_size=int(model.config.text_config.vocab_size), image_token_id=int(model.config.image_token_id)
    )
    runner = DiffusionRunner(
        model,
        image_processor,
        device=device,
        max_prompt_tokens=options.max_prompt_tokens,
        kv_entries=options.kv_cache_entries,
        max_rows=options.max_batch_rows,
        generation=_generation_settings(model),
        cuda_graphs=options.cuda_graphs,
    )
    device_label = torch.cuda.get_device_name(device) if on_cuda else "cpu"
    info = ReaderInfo(
        model=options.served_name or path.name,
        engine="hf",
        device=device_label,
        tiny=options.tiny,
        canvas_length=options.canvas_length,
        checkpoint=str(path),
    )
    return HFReader(runner, tokenizer, info, options)


def _generation_settings(model: Any) -> dict:
    config = getattr(model, "generation_config", None)
    settings: dict = {}
    for name in ("max_denoising_steps", "t_min", "t_max", "stability_threshold", "confidence_threshold"):
        value = getattr(config, name, None)
        if value is not None:
            settings[name] = value
    sampler = getattr(config, "sampler_config", None)
    bound = getattr(sampler, "entropy_bound", None) if sampler is not None else None
    if bound is not None:
        settings["entropy_bound"] = bound
    return settings


@dataclass
class _Job:
    kind: str  # "read" or "generate"
    payload: Any
    future: asyncio.Future
    rows: int


class HFReader:
    """The batching front of the hf engine."""

    def __init__(self, runner: Any, tokenizer: Any, info: ReaderInfo, options: HFOptions) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.info = info
        self.options = options
        self._queue: asyncio.Queue[_Job] | None = None
        self._task: asyncio.Task | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._carry: _Job | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None

    @property
    def stats(self) -> dict[str, int]:
        return dict(self.runner.stats)

    @property
    def ready(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is not None:
            if self._event_loop is not loop:
                raise RuntimeError("this reader already runs in another event loop; give each app its own reader")
            return
        self._event_loop = loop
        self._queue = asyncio.Queue(maxsize=self.options.queue_limit)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="djev-engine")
        self._task = asyncio.create_task(self._loop(), name="djev-batching-loop")

    async def stop(self) -> None:
        task, self._task = self._task, None
        self._event_loop = None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        if self._queue is not None:
            while not self._queue.empty():
                job = self._queue.get_nowait()
                if not job.future.done():
                    job.future.set_exception(EngineUnavailable("the engine stopped"))
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    async def read(self, specs: Sequence[ReadSpec]) -> list[ReadResult]:
        if not specs:
            return []
        rows = sum(len(spec.canvases) for spec in specs)
        return await self._submit(_Job("read", list(specs), asyncio.get_running_loop().create_future(), rows))

    async def generate(self, spec: GenerateSpec) -> GenerateResult:
        return await self._submit(_Job("generate", spec, asyncio.get_running_loop().create_future(), 1))

    async def _submit(self, job: _Job) -> Any:
        if self._queue is None or not self.ready:
            raise EngineUnavailable("the engine is not running")
        try:
            self._queue.put_nowait(job)
        except asyncio.QueueFull:
            raise EngineUnavailable("the engine queue is full") from None
        return await job.future

    async def _loop(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            job = self._carry or await self._queue.get()
            self._carry = None
            if job.future.done():  # the caller went away
                continue
            if job.kind == "generate":
                await self._run(loop, job, [job])
                continue
            batch = [job]
            rows = job.rows
            while not self._queue.empty():
                nxt = self._queue.get_nowait()
                if nxt.future.done():
                    continue
                if nxt.kind != "read" or rows + nxt.rows > self.options.max_batch_rows:
                    self._carry = nxt
                    break
                batch.append(nxt)
                rows += nxt.rows
            await self._run(loop, job, batch)

    async def _run(self, loop: asyncio.AbstractEventLoop, first: _Job, batch: list[_Job]) -> None:
        try:
            if first.kind == "generate":
                result = await loop.run_in_executor(
                    self._executor, self.runner.generate, first.payload, self.info.canvas_length
                )
                if not first.future.done():
                    first.future.set_result(result)
                return
            specs = [spec for job in batch for spec in job.payload]
            results = await loop.run_in_executor(self._executor, self.runner.read, specs)
            self.runner.stats["batches"] += 1
            offset = 0
            for job in batch:
                mine = results[offset:offset + len(job.payload)]
                offset += len(job.payload)
                if job.future.done():
                    continue
                failure = next((r for r in mine if isinstance(r, Exception)), None)
                if failure is not None:
                    job.future.set_exception(failure)
                else:
                    job.future.set_result(mine)
        except asyncio.CancelledError:
            for job in batch:
                if not job.future.done():
                    job.future.set_exception(EngineUnavailable("the engine stopped"))
            raise
        except EngineInputError as exc:
            for job in batch:
                if not job.future.done():
                    job.future.set_exception(exc)
        except Exception as exc:  # noqa: BLE001 - a model failure must reach every waiting request
            log.exception("engine failure")
            for job in batch:
                if not job.future.done():
                    job.future.set_exception(EngineError(f"engine failure: {type(exc).__name__}: {exc}"))
