"""Command lines of the simulated engines: `vllm serve`'s and `llama-server`'s flags as a launcher
passes them, plus `--sim-*` flags for what only a simulator has (capacity, costs, seed).

The point is that an agent can start `llmgw sim --engine vllm ...` with exactly the arguments it
would give `vllm serve`, so flags vLLM accepts and the simulator cannot use are accepted too."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from llmgw.inputs.nesting import json_loads

__all__ = ["SimOptions", "build_vllm_parser", "build_llamacpp_parser", "parse_kv_events_config",
           "parse_lora_modules", "add_sim_flags", "parse_lora_args"]


class ArgError(ValueError):
    pass


@dataclass(frozen=True)
class SimOptions:
    kv_blocks: int | None
    prefill_ms_per_token: float
    decode_ms_per_token: float
    decode_ms_per_seq: float
    output_len: int
    seed: int
    load_seconds: float
    vllm_version: str
    lora_require_path: bool
    lora_load_ms: float
    hash_seed: str | None = None  # hash KV blocks as if PYTHONHASHSEED were this (a misconfigured engine)
    start_seconds: float = 0.0  # process start-up before anything is bound (imports, CUDA init)
    kv_transfer_timeout_s: float | None = None  # vllm P/D: a prefill's kept blocks freed after (None: env/480)
    transfer_ms_per_block: float = 0.5  # vllm P/D: the modeled time of a decoder's pull, per block


def add_sim_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("simulator (llmgw sim only)")
    g.add_argument("--sim-kv-blocks", type=int, default=None,
                   help="KV cache capacity in blocks (vllm; default 8192 x gpu-memory-utilization/0.9)")
    g.add_argument("--sim-prefill-ms-per-token", type=float, default=0.05,
                   help="time to compute one uncached prompt token (default 0.05 ms: 20k tok/s)")
    g.add_argument("--sim-decode-ms-per-token", type=float, default=10.0,
                   help="time of one decode step, i.e. per output token of each sequence (default 10 ms)")
    g.add_argument("--sim-decode-ms-per-seq", type=float, default=0.05,
                   help="extra decode-step time per sequence in the batch (default 0.05 ms)")
    g.add_argument("--sim-output-len", type=int, default=64,
                   help="mean natural output length in tokens (where the model emits EOS; default 64)")
    g.add_argument("--sim-seed", type=int, default=0, help="seed of the simulated model's output")
    g.add_argument("--sim-start-seconds", type=_seconds, default=0.0,
                   help="process start-up before the engine binds anything: imports, CUDA init (default 0)")
    g.add_argument("--sim-load-seconds", type=_seconds, default=0.0,
                   help="model load time before the engine serves (default 0)")
    g.add_argument("--sim-vllm-version", default="0.33.0",
                   help="vLLM version to impersonate: wire formats, metric names, LoRA keys (default 0.33.0)")
    g.add_argument("--sim-lora-require-path", action="store_true",
                   help="LoRA paths must exist on disk (else any path loads; rank from adapter_config.json 'r')")
    g.add_argument("--sim-lora-load-ms", type=float, default=0.0,
                   help="time to load an adapter not in the worker's LoRA cache: in load_lora_adapter, or at its first use (default 0)")
    g.add_argument("--sim-hash-seed", default=None, metavar="SEED",
                   help="hash KV blocks as if PYTHONHASHSEED were SEED, whatever the environment says: an "
                        "engine whose hashes differ from the router's, to test tier 2's parity check")
    g.add_argument("--sim-zero-cost", action="store_true",
                   help="set every time cost to zero (throughput benchmarks of the surrounding system)")


def sim_options(ns: argparse.Namespace) -> SimOptions:
    zero = ns.sim_zero_cost
    return SimOptions(
        kv_blocks=ns.sim_kv_blocks,
        prefill_ms_per_token=0.0 if zero else ns.sim_prefill_ms_per_token,
        decode_ms_per_token=0.0 if zero else ns.sim_decode_ms_per_token,
        decode_ms_per_seq=0.0 if zero else ns.sim_decode_ms_per_seq,
        output_len=ns.sim_output_len,
        seed=ns.sim_seed,
        load_seconds=ns.sim_load_seconds,
        vllm_version=ns.sim_vllm_version,
        lora_require_path=ns.sim_lora_require_path,
        lora_load_ms=0.0 if zero else ns.sim_lora_load_ms,
        hash_seed=ns.sim_hash_seed,
        start_seconds=ns.sim_start_seconds,
        kv_transfer_timeout_s=getattr(ns, "sim_kv_transfer_timeout_s", None),
        transfer_ms_per_block=0.0 if zero else getattr(ns, "sim_transfer_ms_per_block", 0.5),
    )


def _seconds(text: str) -> float:
    return _finite(text, "seconds")


def _finite(text: str, unit: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of {unit}, got {text!r}") from None
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of {unit} ≥ 0, got {text}")
    return v


def _positive_int(text: str) -> int:
    v = int(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {v}")
    return v


class _BoolPair(argparse.Action):
    """vLLM's --enable-X / --no-enable-X / --disable-X flag families."""

    def __call__(self, parser: Any, ns: argparse.Namespace, values: Any, option_string: str | None = None) -> None:
        setattr(ns, self.dest, not (option_string or "").startswith(("--no-", "--disable-")))


def build_vllm_parser(prog: str = "llmgw sim --engine vllm") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Simulated vLLM OpenAI server (vllm serve flags).")
    p.add_argument("model_tag", nargs="?", help="model name or path (as `vllm serve MODEL`)")
    p.add_argument("--model", dest="model_flag", default=None, help="the same as MODEL")
    p.add_argument("--host", default=None, help="the address to listen on (default: all interfaces)")
    p.add_argument("--port", type=int, default=8000, help="the port to listen on (default: 8000; 0: any free port)")
    p.add_argument("--served-model-name", nargs="+", default=None, help="the model ids the API serves (default: MODEL)")
    p.add_argument("--block-size", type=_positive_int, default=None, help="tokens per KV cache block (default: 16)")
    p.add_argument("--enable-prefix-caching", "--no-enable-prefix-caching", "--disable-prefix-caching",
                   dest="enable_prefix_caching", action=_BoolPair, nargs=0, default=True,
                   help="automatic prefix caching (default: on)")
    p.add_argument("--prefix-caching-hash-algo", default="sha256",
                   choices=["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"],
                   help="how KV blocks are hashed, as KV events carry them (default: sha256)")
    p.add_argument("--kv-events-config", default=None, help="KVEventsConfig as JSON")
    p.add_argument("--kv-transfer-config", default=None,
                   help='KVTransferConfig as JSON: prefill/decode disaggregation, e.g. '
                        '{"kv_connector":"NixlConnector","kv_role":"kv_both"} (also the dotted form)')
    p.add_argument("--enable-lora", "--no-enable-lora", "--disable-lora", dest="enable_lora",
                   action=_BoolPair, nargs=0, default=False, help="serve LoRA adapters (default: off)")
    p.add_argument("--max-loras", type=_positive_int, default=1, help="adapters in one batch at most (default: 1)")
    p.add_argument("--max-lora-rank", type=_positive_int, default=16, help="the highest adapter rank (default: 16)")
    p.add_argument("--max-cpu-loras", type=_positive_int, default=None,
                   help="adapters kept loaded at most (default: --max-loras)")
    p.add_argument("--lora-modules", nargs="+", default=[],
                   help='adapters to load at start: NAME=PATH, or JSON {"name", "path", "base_model_name"}')
    p.add_argument("--max-num-seqs", type=_positive_int, default=256,
                   help="sequences in a batch at most (default: 256)")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=8192,
                   help="tokens in one scheduler step at most (default: 8192)")
    p.add_argument("--max-model-len", type=_positive_int, default=4096,
                   help="prompt plus output in tokens at most (default: 4096)")
    p.add_argument("--runner", choices=["auto", "generate", "pooling"], default="auto",
                   help="pooling serves /v1/embeddings (an embedding model) instead of generation")
    p.add_argument("--task", default=None, help="older spelling: embed = --runner pooling")
    p.add_argument("--gpu-memory-utilization", "--device-memory-utilization", type=float, default=0.92,
                   help="sizes the KV cache when --sim-kv-blocks is not given (default: 0.92)")
    p.add_argument("--api-key", default=None, help="require this bearer token on the API")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report cached prompt tokens in usage.prompt_tokens_details")
    p.add_argument("--enable-force-include-usage", action="store_true", help="include usage in every response")
    p.add_argument("--enable-server-load-tracking", action="store_true", help="as vLLM's (GET /load)")
    p.add_argument("--show-hidden-metrics-for-version", default=None,
                   help="also expose the metrics hidden since this version")
    # Accepted so that launch lines written for real vLLM run unchanged; they change nothing here.
    compat = p.add_argument_group("accepted as `vllm serve` accepts them, without effect in the simulator")
    for flag in ("--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp", "--data-parallel-size",
                 "-dp", "--dtype", "--seed", "--swap-space", "--quantization", "-q", "--kv-cache-dtype",
                 "--download-dir", "--chat-template", "--generation-config", "--uvicorn-log-level",
                 "--max-logprobs", "--tokenizer", "--revision", "--load-format", "--distributed-executor-backend",
                 "--cpu-offload-gb", "--compilation-config", "-O", "--tool-call-parser", "--reasoning-parser"):
        compat.add_argument(flag, dest="_ignored_" + flag.lstrip("-").replace("-", "_"), default=None, help="ignored")
    for flag in ("--trust-remote-code", "--enforce-eager", "--disable-log-requests", "--disable-log-stats",
                 "--enable-chunked-prefill", "--no-enable-chunked-prefill", "--enable-auto-tool-choice",
                 "--disable-frontend-multiprocessing", "--enable-log-requests"):
        compat.add_argument(flag, dest="_ignored_" + flag.lstrip("-").replace("-", "_"), action="store_true",
                            help="ignored")
    add_sim_flags(p)
    add_sim_kv_drop_flags(p)
    g = p.add_argument_group("simulated KV transfer (llmgw sim --engine vllm with --kv-transfer-config)")
    g.add_argument("--sim-kv-transfer-timeout-s", type=_seconds, default=None, metavar="S",
                   help="a prefill's blocks kept for a decoder are freed after S seconds unread (default: "
                        "VLLM_NIXL_ABORT_REQUEST_TIMEOUT, else 480)")
    g.add_argument("--sim-transfer-ms-per-block", type=_ms, default=0.5, metavar="MS",
                   help="modeled time of a decoder's KV pull per block (default 0.5 ms)")
    return p


def _ms(text: str) -> float:
    return _finite(text, "milliseconds")


def _seq_list(text: str) -> frozenset[int]:
    try:
        seqs = frozenset(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated sequence numbers, got {text!r}") from None
    if any(s < 0 for s in seqs):
        raise argparse.ArgumentTypeError(f"sequence numbers are >= 0, got {text!r}")
    return seqs


def add_sim_kv_drop_flags(p: argparse.ArgumentParser) -> None:
    """Faults of the KV-event stream on demand, so tests can make the sequence gaps a subscriber
    must handle (docs/simulator.md)."""
    g = p.add_argument_group("simulated KV-event faults (llmgw sim --engine vllm only)")
    g.add_argument("--sim-kv-drop-every", type=_positive_int, default=None, metavar="N",
                   help="do not send every Nth KV event batch (seq N-1, 2N-1, ...) on the PUB socket; it stays "
                        "in the replay buffer unless --sim-kv-drop-lost")
    g.add_argument("--sim-kv-drop-seqs", type=_seq_list, default=frozenset(), metavar="S1,S2,...",
                   help="do not send the KV event batches with these sequence numbers on the PUB socket")
    g.add_argument("--sim-kv-drop-lost", action="store_true",
                   help="the dropped batches are missing from the replay buffer too (a replay cannot cover them)")
    g.add_argument("--sim-kv-events-delay-ms", type=_ms, default=0.0, metavar="MS",
                   help="send each KV event batch on the PUB socket MS after it was made (a slow event path: "
                        "the router's index lags the engine's cache by that much); default 0")


KV_EVENTS_DEFAULTS: dict[str, Any] = {
    "enable_kv_cache_events": False, "publisher": None, "endpoint": "tcp://*:5557", "replay_endpoint": None,
    "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000, "topic": "",
}


def parse_kv_events_config(text: str | None, dotted: dict[str, str], version: tuple[int, ...]) -> dict[str, Any]:
    """KVEventsConfig from JSON and/or dotted flags, with the publisher default of the version."""
    cfg = dict(KV_EVENTS_DEFAULTS)
    if text:
        try:
            given = json_loads(text)
        except ValueError as e:  # not JSON, or nested too deeply
            raise ArgError(f"--kv-events-config: not valid JSON: {e}") from None
        if not isinstance(given, dict):
            raise ArgError("--kv-events-config: must be a JSON object")
        cfg.update(given)
    for k, v in dotted.items():
        cfg[k] = json.loads(v) if v in ("true", "false", "null") or v.lstrip("-").isdigit() else v
    unknown = set(cfg) - set(KV_EVENTS_DEFAULTS)
    if unknown:
        raise ArgError(f"--kv-events-config: unknown field(s) {sorted(unknown)}")
    if cfg["publisher"] is None:
        # 0.10/0.11 default to "null" (no events unless publisher is set); 0.12+ pick zmq when enabled.
        cfg["publisher"] = "zmq" if version >= (0, 12) and cfg["enable_kv_cache_events"] else "null"
    if cfg["publisher"] not in ("null", "zmq"):
        raise ArgError(f"--kv-events-config: publisher must be 'null' or 'zmq', got {cfg['publisher']!r}")
    return cfg


def split_dotted_kv_events(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """Pull `--kv-events-config.FIELD VALUE` pairs out of argv (vLLM's dotted form)."""
    return split_dotted(argv, "--kv-events-config")


def split_dotted(argv: list[str], flag: str) -> tuple[list[str], dict[str, str]]:
    """Pull `FLAG.FIELD VALUE` (or `FLAG.FIELD=VALUE`) pairs out of argv (vLLM's dotted form)."""
    rest: list[str] = []
    dotted: dict[str, str] = {}
    it = iter(argv)
    prefix = flag + "."
    for a in it:
        if a.startswith(prefix):
            key, _, val = a[len(prefix):].partition("=")
            if not _:
                val = next(it, "")
            dotted[key.replace("-", "_")] = val
        else:
            rest.append(a)
    return rest, dotted


@dataclass(frozen=True)
class LoraModule:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(items: list[str]) -> list[LoraModule]:
    out = []
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                d = json_loads(item)
                out.append(LoraModule(d["name"], d["path"], d.get("base_model_name")))
            except (ValueError, KeyError, TypeError) as e:
                raise ArgError(f"--lora-modules: invalid JSON module {item!r}: {e}") from None
        else:
            name, eq, path = item.partition("=")
            if not eq or not name or not path:
                raise ArgError(f"--lora-modules: expected name=path or JSON, got {item!r}")
            out.append(LoraModule(name, path))
    return out


class _Tagged(argparse.Action):
    """Appends (option, value) to one shared list, keeping the order of different flags."""

    def __call__(self, parser: Any, ns: argparse.Namespace, values: Any, option_string: str | None = None) -> None:
        setattr(ns, self.dest, [*getattr(ns, self.dest, []), (option_string, values)])


def parse_lora_args(items: list[tuple[str, str]]) -> list[tuple[str, float]]:
    """llama-server's --lora FILE[,FILE] (scale 1) and --lora-scaled FILE:SCALE[,...] as (path, scale),
    in command-line order: an adapter's id is its index here."""
    out: list[tuple[str, float]] = []
    for flag, item in items:
        for part in filter(None, item.split(",")):
            if flag == "--lora":
                out.append((part, 1.0))
                continue
            path, sep, scale = part.rpartition(":")
            try:
                if not sep or not path:
                    raise ValueError
                out.append((path, float(scale)))
            except ValueError:
                raise ArgError(f"--lora-scaled: expected FNAME:SCALE, got {part!r}") from None
    return out


def build_llamacpp_parser(prog: str = "llmgw sim --engine llamacpp") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Simulated llama.cpp llama-server.")
    p.add_argument("-m", "--model", default="models/sim.gguf",
                   help="the model file (nothing is read from it); its path is the model's id without --alias")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="the port to listen on (default: 8080; 0: any free port)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096,
                   help="context in tokens, shared by the slots (default: 4096)")
    p.add_argument("-np", "--parallel", type=_positive_int, default=1,
                   help="slots: requests served at once (default: 1)")
    p.add_argument("-b", "--batch-size", type=_positive_int, default=2048,
                   help="prompt tokens in one batch at most (default: 2048)")
    p.add_argument("--metrics", action="store_true", help="serve Prometheus metrics on /metrics")
    p.add_argument("--slots", "--no-slots", dest="slots", action=_BoolPair, nargs=0, default=True,
                   help="the /slots endpoint (default: on)")
    # One list in command-line order: adapter ids follow the order of --lora/--lora-scaled together.
    p.add_argument("--lora", dest="lora_args", action=_Tagged, default=[], help="FILE[,FILE...] at scale 1")
    p.add_argument("--lora-scaled", dest="lora_args", action=_Tagged, default=[], help="FILE:SCALE[,...]")
    p.add_argument("--api-key", default=None, help="require this bearer token on the API")
    p.add_argument("-a", "--alias", default=None, help="the model's id in the API (default: the --model path)")
    p.add_argument("--cache-ram", "-cram", type=int, default=8192,
                   help="MiB for prompts cached outside the slots (default: 8192; 0: none; -1: no limit)")
    p.add_argument("--slot-prompt-similarity", "-sps", type=float, default=0.1,
                   help="how much of a slot's prompt a new one must share to be given that slot (default: 0.1)")
    p.add_argument("--slot-save-path", default=None, help="directory for POST /slots/ID?action=save|restore")
    p.add_argument("--jinja", "--no-jinja", dest="jinja", action=_BoolPair, nargs=0, default=True,
                   help="apply the chat template with Jinja (default: on)")
    compat = p.add_argument_group("accepted as llama-server accepts them, without effect in the simulator")
    for flag in ("-t", "--threads", "-ngl", "--n-gpu-layers", "--chat-template", "--chat-template-file",
                 "-fa", "--flash-attn", "-ub", "--ubatch-size", "--seed", "-s",
                 "-ctk", "--cache-type-k", "-ctv", "--cache-type-v", "--timeout", "-to"):
        compat.add_argument(flag, dest="_ignored_" + flag.lstrip("-").replace("-", "_"), default=None, help="ignored")
    p.add_argument("--sim-kv-bytes-per-token", type=_positive_int, default=131072,
                   help="KV state size of one token, for the --cache-ram limit (default 128 KiB: an 8B GQA "
                        "model at f16)")
    p.add_argument("--sim-instant-abort", action="store_true",
                   help="free a slot as soon as any client leaves (llama-server notices a non-streaming "
                        "client only after 1 s without results for any request)")
    for flag in ("--cont-batching", "--no-cont-batching", "--mlock", "--no-mmap", "--lora-init-without-apply",
                 "--no-webui", "--verbose", "-v", "--log-disable"):
        compat.add_argument(flag, dest="_ignored_" + flag.lstrip("-").replace("-", "_"), action="store_true",
                            help="ignored")
    add_sim_flags(p)
    return p
