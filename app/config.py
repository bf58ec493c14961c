"""Settings: typed sections of frozen dataclasses, read from the environment (the reference system's
names where it had one) and overridden by command-line flags. Every default is defined here and
nowhere else; `.env.example` and docs/configuration.md are generated from these fields (a test keeps them
equal), and app/build.py makes every engine's and the decision core's options from them.

A setting's name is unique across sections, so flags (`--canvas`) and `Settings.of(canvas=64)` take
plain names; code reads them by section (`settings.decisions.canvas`).
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any, Iterator, Mapping

# The engines this build has.
ENGINES = ("hf", "vllm", "remote")
# DEBIAS's values (app/decisions/debias.py MODES, the request key's; a test keeps them equal).
DEBIAS_MODES = ("off", "canonical", "rotate", "prior", "canonical+prior", "rotate+prior")
MAX_DEBIAS_ROTATIONS = 32
LOG_FORMATS = ("text", "json")
# REPLICA_ID: what a header value and a HAProxy server name may both hold.
REPLICA_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


def _meta(env: str, help: str) -> dict:
    return {"env": env, "help": help}


@dataclass(frozen=True)
class ServerSettings:
    """The listeners, the key and the pages."""

    host: str = field(default="0.0.0.0", metadata=_meta("HOST", "interface the HTTP and HTTPS listeners bind"))
    port: int = field(default=8011, metadata=_meta("STRUCTURED_PORT", "HTTP port"))
    tls_port: int = field(default=0, metadata=_meta("TLS_PORT", "HTTPS port with a self-signed certificate; 0 = off"))
    cert_dir: str = field(default="certs", metadata=_meta(
        "CERT_DIR", "where djev's local certificate authority and the certificates it issues live"))
    api_key: str = field(default="", metadata=_meta("API_KEY", "bearer token POST routes require; empty = open"))
    pages: bool = field(default=True, metadata=_meta("TEST_PAGE", "1 serves the browser pages (/, /walk, /cube)"))
    replica_id: str = field(default="", metadata=_meta(
        "REPLICA_ID", "this replica's name behind a load balancer (docs/deploy.md): the x-djev-replica header on "
        "every response and websocket handshake, and `replica` in a camera session's ready message; letters, "
        "digits, . _ : - (at most 64); empty = no header"))

    def problems(self) -> list[str]:
        if self.replica_id and not REPLICA_ID.fullmatch(self.replica_id):
            return [f"REPLICA_ID must be 1 to 64 letters, digits, '.', '_', ':' or '-', not {self.replica_id!r}"]
        return []


@dataclass(frozen=True)
class RuntimeSettings:
    """Which checkpoint answers, through which engine, on which device."""

    model: str = field(default="", metadata=_meta(
        "MODEL", "checkpoint directory or Hugging Face id; empty = $MODELS_DIR/$MODEL_NAME, else the tiny model"))
    models_dir: str = field(default="./models", metadata=_meta("MODELS_DIR", "where checkpoints live"))
    model_name: str = field(default="dgemma", metadata=_meta("MODEL_NAME", "checkpoint folder under MODELS_DIR"))
    served_name: str = field(default="", metadata=_meta("SERVED_NAME", "model name in responses; empty = folder name"))
    engine: str = field(default="hf", metadata=_meta(
        "ENGINE", "hf: transformers in this process; vllm: vLLM in this process; remote: vLLM servers at UPSTREAM"))
    device: str = field(default="auto", metadata=_meta("DEVICE", "auto, cpu, cuda or cuda:N"))
    cache_dir: str = field(default="~/.cache/djev", metadata=_meta(
        "CACHE_DIR", "compiler caches kept across restarts: TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR and "
        "VLLM_CACHE_ROOT become its inductor, triton and vllm folders where the environment sets none; "
        "empty = the tools' defaults"))
    switch_interval_ms: float = field(default=0.2, metadata=_meta(
        "SWITCH_INTERVAL_MS", "ms a Python thread keeps the interpreter while another waits for it "
        "(sys.setswitchinterval; Python's own is 5): the engine thread lets it go at every torch op, so "
        "under a busy event loop a long interval stalls its eager passes (docs/design.md §5.2)"))

    def problems(self) -> list[str]:
        problems = []
        if self.engine not in ENGINES:
            problems.append(f"ENGINE must be one of {', '.join(ENGINES)}, not {self.engine!r}")
        if not 0.01 <= self.switch_interval_ms <= 100:
            problems.append(f"SWITCH_INTERVAL_MS must be from 0.01 to 100, not {self.switch_interval_ms}")
        return problems


@dataclass(frozen=True)
class DecisionSettings:
    """How decisions are read and answered, and the defaults of what a request leaves out."""

    canvas: int = field(default=128, metadata=_meta("CANVAS", "widest canvas a read may use, in tokens"))
    canvas_step: int = field(default=16, metadata=_meta("CANVAS_STEP", "canvas widths round up to this"))
    thought_placement: str = field(default="prompt", metadata=_meta(
        "THOUGHT_PLACEMENT", "prompt: the empty thought block ends the prompt; canvas: it opens the canvas"))
    confidence: str = field(default="djev", metadata=_meta(
        "CONFIDENCE", "djev: p of the answer; jev: Jev's concentration formulas"))
    isolate: bool = field(default=False, metadata=_meta("ISOLATE", "1 reads every question in its own canvas"))
    default_seed: int = field(default=42, metadata=_meta(
        "DEFAULT_SEED", "seed of a request that sends none (decisions and raw generation)"))
    auto_max: int = field(default=4, metadata=_meta(
        "AUTO_MAX", "reads in all when samples is auto and a read is unsure"))
    auto_threshold: float = field(default=0.1, metadata=_meta(
        "AUTO_THRESHOLD", "entropy (nats) of a label distribution past which auto reads again"))
    debias: str = field(default="off", metadata=_meta(
        "DEBIAS", "debias of a request that sends none: off, canonical, rotate, prior, canonical+prior "
        "or rotate+prior"))
    debias_rotations: int = field(default=8, metadata=_meta(
        "DEBIAS_ROTATIONS", "rotate reads at most this many shifts of a question's options (2 to 32)"))
    calibration: str = field(default="", metadata=_meta(
        "CALIBRATION", "a calibration file `djev calibrate` wrote, applied to every read before answers are formed "
        "(refused at start if fitted for another model, tokenizer, template, canvas or debias mode); empty = none"))

    def problems(self) -> list[str]:
        problems = []
        if self.thought_placement not in ("prompt", "canvas"):
            problems.append(f"THOUGHT_PLACEMENT must be prompt or canvas, not {self.thought_placement!r}")
        if self.confidence not in ("djev", "jev"):
            problems.append(f"CONFIDENCE must be djev or jev, not {self.confidence!r}")
        if not 16 <= self.canvas <= 4096:
            problems.append(f"CANVAS must be 16 to 4096 tokens, not {self.canvas}")
        if self.canvas_step < 1:
            problems.append("CANVAS_STEP must be at least 1")
        if self.auto_max < 1:
            problems.append("AUTO_MAX must be at least 1")
        if not self.auto_threshold >= 0:
            problems.append("AUTO_THRESHOLD must be at least 0")
        if self.debias not in DEBIAS_MODES:
            problems.append(f"DEBIAS must be one of {', '.join(DEBIAS_MODES)}, not {self.debias!r}")
        if not 2 <= self.debias_rotations <= MAX_DEBIAS_ROTATIONS:
            problems.append(f"DEBIAS_ROTATIONS must be 2 to {MAX_DEBIAS_ROTATIONS}, not {self.debias_rotations}")
        return problems


# MAX_SESSIONS=0 where the engine says nothing of the camera sessions it holds (`ReaderInfo.max_sessions`).
UNSAID_MAX_SESSIONS = 32


@dataclass(frozen=True)
class LimitSettings:
    """What one request, and the server at once, may ask for."""

    max_samples: int = field(default=32, metadata=_meta("MAX_SAMPLES", "cap on samples and auto_max"))
    max_questions: int = field(default=256, metadata=_meta("MAX_QUESTIONS", "questions per request"))
    max_id_length: int = field(default=256, metadata=_meta("MAX_ID_LENGTH", "characters per question id"))
    max_steps: int = field(default=8, metadata=_meta("MAX_STEPS", "denoise steps a read may ask for"))
    max_think: int = field(default=4096, metadata=_meta("MAX_THINK", "thought tokens a request's think may ask for"))
    max_thought_tokens: int = field(default=8192, metadata=_meta(
        "MAX_THOUGHT_TOKENS", "thought tokens one request may cost in all (think x the groups that think)"))
    max_body_bytes: int = field(default=32 * 1024 * 1024, metadata=_meta("MAX_BODY_BYTES", "request body limit"))
    max_images: int = field(default=8, metadata=_meta("MAX_IMAGES", "images per request"))
    max_image_bytes: int = field(default=8 * 1024 * 1024, metadata=_meta("MAX_IMAGE_BYTES", "bytes per image"))
    max_total_image_bytes: int = field(default=24 * 1024 * 1024, metadata=_meta(
        "MAX_TOTAL_IMAGE_BYTES", "bytes of all images of a request"))
    max_image_pixels: int = field(default=40_000_000, metadata=_meta("MAX_IMAGE_PIXELS", "pixels per image"))
    max_prompt_tokens: int = field(default=0, metadata=_meta(
        "MAX_PROMPT_TOKENS", "prompt tokens per read; 0 = the engine's (hf: 131072 on CUDA, 32768 on the CPU, "
        "each within what the KV store holds: PROMPT_CACHE_GB, logged at start and shown in /health)"))
    max_inflight: int = field(default=256, metadata=_meta(
        "MAX_INFLIGHT", "decisions at once; more get 529 with Retry-After"))
    max_inflight_cost: int = field(default=16384, metadata=_meta(
        "MAX_INFLIGHT_COST", "canvases plus thought tokens of the decisions in flight; more get 529"))
    request_timeout: float = field(default=120.0, metadata=_meta(
        "REQUEST_TIMEOUT", "seconds a decision or generation may take; then 504 and its queued work is dropped"))
    max_sessions: int = field(default=0, metadata=_meta(
        "MAX_SESSIONS", "camera sessions at once; more are refused with close code 1013; 0 = as many as the engine "
        f"holds (hf on CUDA: frames in flight in half the KV store, shown in /health; {UNSAID_MAX_SESSIONS} where "
        "the engine does not say); camera capacity admits fewer while it measures less"))

    def problems(self) -> list[str]:
        problems = []
        for f in fields(self):
            if f.name in ("max_think", "max_thought_tokens", "max_prompt_tokens", "max_sessions"):
                if getattr(self, f.name) < 0:
                    problems.append(f"{f.metadata['env']} must be at least 0")
            elif f.name != "request_timeout" and getattr(self, f.name) < 1:
                problems.append(f"{f.metadata['env']} must be at least 1")
        if not self.request_timeout > 0:
            problems.append("REQUEST_TIMEOUT must be more than 0 seconds")
        return problems


@dataclass(frozen=True)
class StreamSettings:
    """Camera sessions (/v1/stream): how fast each is paced, and how many the engine can keep fresh
    (app/web/pacing.py; docs/design.md, "Camera sessions: pacing and admission")."""

    min_session_fps: float = field(default=1.5, metadata=_meta(
        "MIN_SESSION_FPS", "answers/s each camera session is promised; one more session is refused (1013) "
        "once (sessions + 1) x this passes the capacity x SESSION_HEADROOM"))
    max_session_fps: float = field(default=4.0, metadata=_meta(
        "MAX_SESSION_FPS", "the fastest a camera session is asked to send (next_frame_ms never below 1000 / this)"))
    session_capacity_start: float = field(default=8.0, metadata=_meta(
        "SESSION_CAPACITY_START", "camera frames/s the engine is assumed to answer until it has been measured, "
        "where the engine measured less (or nothing) at start-up; more sessions are admitted as more is measured"))
    session_headroom: float = field(default=0.8, metadata=_meta(
        "SESSION_HEADROOM", "share of the measured camera capacity that admission may promise to sessions"))
    session_window: float = field(default=3.0, metadata=_meta(
        "SESSION_WINDOW", "seconds of answers (and at least 8) each camera-capacity measurement spans"))

    def problems(self) -> list[str]:
        problems = []
        if not 0 < self.min_session_fps <= self.max_session_fps:
            problems.append("MIN_SESSION_FPS must be more than 0 and at most MAX_SESSION_FPS")
        if not 0 < self.max_session_fps <= 1000:
            problems.append("MAX_SESSION_FPS must be more than 0 and at most 1000")
        if not self.session_capacity_start > 0:
            problems.append("SESSION_CAPACITY_START must be more than 0 frames/s")
        if not 0 < self.session_headroom <= 1:
            problems.append("SESSION_HEADROOM must be in (0, 1]")
        if not self.session_window > 0:
            problems.append("SESSION_WINDOW must be more than 0 seconds")
        return problems


# QUANTIZE's values: the checkpoint's own format, or FP8 quantized at load (app/engine/hf/quantize.py).
QUANTIZE_MODES = ("", "fp8")

# The fewest tokens an engine turn may hold (TURN_TOKENS): a widest default canvas beside the largest
# image of the full-size model's processor (128 + 280), with room for a prompt's tail.
MIN_TURN_TOKENS = 1024


@dataclass(frozen=True)
class HFSettings:
    """The hf engine (transformers in this process)."""

    max_batch_rows: int = field(default=64, metadata=_meta("MAX_BATCH_ROWS", "hf: canvases one engine turn reads"))
    batch_gather_ms: float = field(default=20.0, metadata=_meta(
        "BATCH_GATHER_MS", "hf: most ms a turn waits for more reads under load, ending once as many canvases as "
        "the last turn read are queued; 0 = never (docs/reliability.md)"))
    batch_gather_rows: int = field(default=32, metadata=_meta(
        "BATCH_GATHER_ROWS", "hf: the most canvases a turn's gather waits for (0 = as many as the last turn read); "
        "32 keeps 64 closed-loop clients in two cohorts that take turns, one planned while the other runs"))
    kv_cache_entries: int = field(default=64, metadata=_meta(
        "KV_CACHE_ENTRIES", "hf: images' vision features kept for reuse (at most 16; 0 = none), so a frame's later "
        "stage skips the vision tower"))
    prompt_cache_gb: float = field(default=0.0, metadata=_meta(
        "PROMPT_CACHE_GB", "hf: GiB of the KV store, which holds every prompt's keys and values in blocks shared "
        "by prompts that begin alike, and decides the longest state read (MAX_PROMPT_TOKENS within it, shown in "
        "/health); 0 = sized at start: on CUDA the memory the weights leave less 16 GiB for a turn's work "
        "(~16 GiB on an 80 GB card), 16 on the CPU, where it grows as it fills"))
    cuda_graphs: bool = field(default=True, metadata=_meta(
        "CUDA_GRAPHS", "hf: 1 replays each turn's forward between its attentions, and the vision tower, as CUDA "
        "graphs captured at start (CUDA only; 0 = eager)"))
    torch_compile: bool = field(default=True, metadata=_meta(
        "TORCH_COMPILE", "hf: 1 compiles the text layers' two bodies around their attention, and the vision "
        "layers, with torch.compile under the CUDA graphs, at start (CUDA only; 0 = eager kernels)"))
    fused_moe: bool = field(default=True, metadata=_meta(
        "FUSED_MOE", "hf: 1 runs the experts as djev's two Triton kernels (CUDA only, needs Triton; "
        "0 = transformers' grouped_mm)"))
    quantize: str = field(default="", metadata=_meta(
        "QUANTIZE", "hf: fp8 quantizes a bf16 checkpoint's text layers (attention and dense MLP projections, "
        "experts) to FP8 at load, a layer at a time (e4m3 weights with a scale per output channel, activations "
        "quantized per token); empty = the checkpoint's own format (a compressed-tensors FP8 checkpoint loads as "
        "FP8 either way). On the CPU FP8 runs a slow reference, for tests"))
    torch_threads: int = field(default=0, metadata=_meta(
        "TORCH_THREADS", "CPU threads torch may use; 0 = torch's default"))
    prefill_chunk: int = field(default=2048, metadata=_meta(
        "PREFILL_CHUNK", "hf: a prompt's tokens one engine turn writes at most; a longer prompt is written in "
        "chunks, taking turns with other reads (docs/design.md §2.2)"))
    turn_tokens: int = field(default=0, metadata=_meta(
        "TURN_TOKENS", "hf: the most new tokens (prompt chunks and canvases) one engine turn takes, in one forward; "
        f"what does not fit waits for the next turn in its place (at least {MIN_TURN_TOKENS}, and at least CANVAS "
        "beside the model's largest image, checked at start; 0 = 4096 on CUDA, 2048 on the "
        "CPU, where a turn of the tiny model costs ~0.3 ms a token: a steady client waits at most one turn)"))

    def problems(self) -> list[str]:
        problems = ["MAX_BATCH_ROWS must be at least 1"] if self.max_batch_rows < 1 else []
        if self.batch_gather_rows < 0:
            problems.append(f"BATCH_GATHER_ROWS must be at least 0, not {self.batch_gather_rows}")
        if self.prefill_chunk < 16:
            problems.append(f"PREFILL_CHUNK must be at least 16 tokens, not {self.prefill_chunk}")
        if self.turn_tokens and self.turn_tokens < MIN_TURN_TOKENS:
            problems.append(f"TURN_TOKENS must be at least {MIN_TURN_TOKENS} tokens (a widest canvas beside an image), not "
                            f"{self.turn_tokens}")
        if not self.prompt_cache_gb >= 0:
            problems.append(f"PROMPT_CACHE_GB must be at least 0, not {self.prompt_cache_gb}")
        if self.quantize not in QUANTIZE_MODES:
            problems.append(f"QUANTIZE must be empty or {' or '.join(filter(None, QUANTIZE_MODES))}, not {self.quantize!r}")
        return problems


@dataclass(frozen=True)
class RemoteSettings:
    """The remote engine (vLLM OpenAI servers at UPSTREAM)."""

    upstream: tuple[str, ...] = field(default=(), metadata=_meta(
        "UPSTREAM", "remote: vLLM OpenAI server base URLs (repeat --upstream; env: comma-separated)"))
    upstream_connect_timeout: float = field(default=5.0, metadata=_meta(
        "UPSTREAM_CONNECT_TIMEOUT", "remote: seconds to connect to an upstream"))
    upstream_read_timeout: float = field(default=300.0, metadata=_meta(
        "UPSTREAM_READ_TIMEOUT", "remote: seconds an upstream may take to answer a request"))
    upstream_health_interval: float = field(default=5.0, metadata=_meta(
        "UPSTREAM_HEALTH_INTERVAL", "remote: seconds between health checks of the upstreams"))

    def problems(self) -> list[str]:
        problems = []
        for url in self.upstream:
            if not url.startswith(("http://", "https://")):
                problems.append(f"UPSTREAM {url!r} must start with http:// or https://")
        for f in fields(self):
            if f.name != "upstream" and not getattr(self, f.name) > 0:
                problems.append(f"{f.metadata['env']} must be more than 0 seconds")
        return problems


@dataclass(frozen=True)
class VLLMSettings:
    """The vllm engine (vLLM in this process); names and defaults of the reference's container."""

    max_seqs: int = field(default=32, metadata=_meta("MAX_SEQS", "vllm: --max-num-seqs (canvases at once)"))
    max_model_len: int = field(default=4096, metadata=_meta(
        "MAX_MODEL_LEN", "vllm: prompt + canvas tokens per request (131072 in the long-context profile)"))
    max_num_batched_tokens: int = field(default=0, metadata=_meta(
        "MAX_NUM_BATCHED_TOKENS", "vllm: prefill chunk in tokens; 0 = vLLM's default"))
    gpu_util: float = field(default=0.40, metadata=_meta(
        "GPU_UTIL", "vllm: fraction of GPU memory vLLM plans for (0.45 in the long-context profile)"))
    kv_cache_gb: float = field(default=2.0, metadata=_meta(
        "KV_CACHE_GB", "vllm: fixed KV cache pool in GiB (24 in the long-context profile)"))
    attn: str = field(default="auto", metadata=_meta(
        "ATTN", "vllm: attention backend; auto = TRITON_ATTN on a GPU, vLLM's choice on CPU"))
    extra_args: str = field(default="", metadata=_meta(
        "EXTRA_ARGS", "vllm: more engine flags, as for `vllm serve` (e.g. --async-scheduling)"))
    torch_mem_fraction: float = field(default=0.0, metadata=_meta(
        "TORCH_MEM_FRACTION", "vllm: cap torch's share of GPU memory in this process; 0 = off"))

    def problems(self) -> list[str]:
        problems = []
        if not 0 < self.gpu_util <= 1 or not 0 <= self.torch_mem_fraction <= 1:
            problems.append("GPU_UTIL must be in (0, 1] and TORCH_MEM_FRACTION in [0, 1]")
        if self.kv_cache_gb < 0 or self.max_num_batched_tokens < 0:
            problems.append("KV_CACHE_GB and MAX_NUM_BATCHED_TOKENS must be at least 0")
        return problems


@dataclass(frozen=True)
class LogSettings:
    """What the server logs, and how."""

    log_level: str = field(default="info", metadata=_meta("LOG_LEVEL", "debug, info, warning"))
    log_format: str = field(default="text", metadata=_meta(
        "LOG_FORMAT", "text, or json: one JSON object per line with the request id"))

    def problems(self) -> list[str]:
        if self.log_format not in LOG_FORMATS:
            return [f"LOG_FORMAT must be one of {', '.join(LOG_FORMATS)}, not {self.log_format!r}"]
        return []


@dataclass(frozen=True)
class Settings:
    """Every setting, by section. `Settings()` is the defaults; `from_env` reads the environment."""

    server: ServerSettings = field(default_factory=ServerSettings)
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)
    decisions: DecisionSettings = field(default_factory=DecisionSettings)
    limits: LimitSettings = field(default_factory=LimitSettings)
    stream: StreamSettings = field(default_factory=StreamSettings)
    hf: HFSettings = field(default_factory=HFSettings)
    remote: RemoteSettings = field(default_factory=RemoteSettings)
    vllm: VLLMSettings = field(default_factory=VLLMSettings)
    logs: LogSettings = field(default_factory=LogSettings)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> "Settings":
        """Environment first, then explicit overrides by setting name (flags); a None override means
        'not given'. Refuses bad values with a ValueError that names each variable."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for _, f in setting_fields():
            raw = env.get(f.metadata["env"])
            if raw is not None and raw.strip() != "":
                values[f.name] = _convert(f, raw.strip())
        values.update({k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items() if v is not None})
        return cls().replace(**values)

    @classmethod
    def of(cls, **values: Any) -> "Settings":
        """The defaults with these settings changed, by name (`Settings.of(canvas=64)`); no environment."""
        return cls().replace(**values)

    def replace(self, **values: Any) -> "Settings":
        """A copy with these settings changed, by name, validated."""
        changes: dict[str, dict[str, Any]] = {}
        for name, value in values.items():
            section = SECTION_OF.get(name)
            if section is None:
                raise TypeError(f"no setting named {name!r}")
            changes.setdefault(section, {})[name] = value
        sections = {section: dataclasses.replace(getattr(self, section), **named) for section, named in changes.items()}
        settings = dataclasses.replace(self, **sections)
        settings.validate()
        return settings

    def validate(self) -> None:
        problems: list[str] = []
        for f in fields(self):
            problems.extend(getattr(self, f.name).problems())
        if self.runtime.engine == "remote" and not self.remote.upstream:
            problems.append("ENGINE remote needs at least one UPSTREAM (--upstream http://host:port)")
        if self.vllm.max_seqs < 1 or self.vllm.max_model_len < self.decisions.canvas + 1:
            problems.append(f"MAX_SEQS must be at least 1 and MAX_MODEL_LEN more than CANVAS ({self.decisions.canvas})")
        if problems:
            raise ValueError("; ".join(problems))


def setting_fields() -> Iterator[tuple[str, dataclasses.Field]]:
    """(section name, field) for every setting, in the order flags, .env.example and docs/configuration.md list them."""
    for section in fields(Settings):
        for f in fields(_section_type(section)):
            yield section.name, f


def _section_type(section: dataclasses.Field) -> type:
    factory = section.default_factory
    assert isinstance(factory, type)
    return factory


SECTION_OF = {f.name: section for section, f in setting_fields()}


def _convert(f: dataclasses.Field, raw: str) -> Any:
    kind = field_kind(f)
    if kind is bool:
        lowered = raw.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{f.metadata['env']} must be 1 or 0, not {raw!r}")
    if kind is int:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{f.metadata['env']} must be an integer, not {raw!r}") from None
    if kind is float:
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{f.metadata['env']} must be a number, not {raw!r}") from None
    if kind is tuple:
        return tuple(item for item in raw.replace(",", " ").split() if item)
    return raw


def field_kind(f: dataclasses.Field) -> type:
    """The Python type of a setting (annotations are strings under `from __future__ import annotations`)."""
    if isinstance(f.type, type):
        return f.type
    return {"int": int, "bool": bool, "str": str, "float": float, "tuple[str, ...]": tuple}.get(str(f.type), str)


def env_table() -> list[tuple[str, str, str]]:
    """(variable, default, meaning) for every setting: docs/configuration.md and .env.example are built on it."""
    rows = []
    for _, f in setting_fields():
        default = f.default
        if isinstance(default, bool):
            default = "1" if default else "0"
        elif isinstance(default, tuple):
            default = ",".join(default)
        rows.append((f.metadata["env"], str(default), f.metadata["help"]))
    return rows


def render_env_example() -> str:
    """The text of .env.example (kept equal to it by a test)."""
    lines = [
        "# djev settings. Every variable is optional; the values below are the defaults.",
        "# Flags of `djev serve` override these (see `djev serve --help`).",
        "",
    ]
    for env, default, meaning in env_table():
        lines.append(f"# {meaning}")
        lines.append(f"{env}={default}")
    return "\n".join(lines) + "\n"
