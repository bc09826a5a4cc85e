"""`llmgw kv hash` and `llmgw kv decode`: an operator's view of what a vLLM engine publishes.

`kv hash` computes the prefix-cache block hash chain of a token list exactly as a given vLLM
release does (llmgw.kv.hashing), and prints each full block's hash in the form the engine's
KV events carry it. `kv decode` reads a KV event payload (hex, a raw file, stdin, or a ZMQ pub
frame triple) and prints its events (llmgw.kv.events). Together they show why a block hash the
router expects is or is not in an engine's events.

Everything read here is untrusted: sizes are bounded, a bad input is one line naming the flag or
what is wrong (no traceback), and strings from a payload are escaped before they reach the
terminal."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from typing import Any, BinaryIO

from llmgw.admin_client.printable import printable
from llmgw.fleet.engine_cmd import KV_HASH_ALGO, KV_HASH_SEED
from llmgw.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventDecodeError,
    UnknownEvent,
    decode_batch,
    parse_pub_frames,
)
from llmgw.kv.hashing import (
    FIXED_NONE_SEED_SINCE,
    HASH_ALGOS,
    LORA_NAME_KEY_SINCE,
    TAGGED_KEYS_SINCE,
    HashContext,
    LoRA,
    VllmVersion,
    event_hash,
)

__all__ = ["MAX_INPUT_BYTES", "MAX_TOKENS", "main", "parser"]

DEFAULT_VERSION = "0.33.0"
# What the agent launches a kv_events vLLM with (tier 2's engines): the chain the router computes.
# vLLM's own defaults differ (sha256, PYTHONHASHSEED unset): --algo sha256 --no-seed give those.
DEFAULT_ALGO = KV_HASH_ALGO
DEFAULT_SEED = KV_HASH_SEED
MAX_TOKENS = 1_000_000  # a prompt far beyond any context window
MAX_TOKEN_ID = (1 << 63) - 1
MAX_BLOCK_SIZE = 1 << 16
MAX_INPUT_BYTES = 64 << 20  # a token file or a payload (vLLM batches are kilobytes)


class KvCliError(Exception):
    """A bad input: the message names the flag or what is wrong; exit status 1."""


# --------------------------------------------------------------------------- parser

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llmgw kv", description="Hash tokens and decode KV events the way vLLM does, to debug "
                                     "prefix-cache routing against a real engine.")
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    h = sub.add_parser("hash", help="the block hash chain of a token list",
                       description="Print the prefix-cache hash of each full block of a token list, "
                                   "as a vLLM release computes it and as its KV events carry it.")
    src = h.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokens", metavar="IDS", help="token ids, separated by commas or blanks (e.g. 1,2,3)")
    src.add_argument("--tokens-file", metavar="FILE",
                     help="read the token ids from FILE ('-': standard input); a JSON list works too")
    h.add_argument("--block-size", type=int, default=16, metavar="N",
                   help="the engine's --block-size (default: %(default)s)")
    h.add_argument("--algo", default=DEFAULT_ALGO, choices=sorted(HASH_ALGOS),
                   help="the engine's --prefix-caching-hash-algo (default: %(default)s, what llmgw's agent "
                        "launches a kv_events engine with; vLLM's own default is sha256)")
    seed = h.add_mutually_exclusive_group()
    seed.add_argument("--seed", metavar="PYTHONHASHSEED", default=DEFAULT_SEED,
                      help="the engine's PYTHONHASHSEED environment value (default: %(default)s, what llmgw's "
                           "agent gives a kv_events engine)")
    seed.add_argument("--no-seed", dest="seed", action="store_const", const=None, default=argparse.SUPPRESS,
                      help="the engine runs without PYTHONHASHSEED (vLLM's own default)")
    h.add_argument("--vllm-version", default=DEFAULT_VERSION, metavar="X.Y.Z",
                   help="the engine's vLLM release (default: %(default)s)")
    h.add_argument("--lora", metavar="NAME[:ID]",
                   help="the request's LoRA adapter: its name, and the int id vLLM gave it (needed before 0.12)")
    h.add_argument("--lora-path", metavar="PATH", help="the LoRA adapter's lora_path (hashed from vLLM 0.31)")
    h.add_argument("--cache-salt", metavar="S", help="the request's cache_salt")
    h.add_argument("--hash-form", choices=("int", "bytes"), default="int",
                   help="how events carry a hash: 'int' (the low 64 bits; VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, "
                        "vLLM's default) or 'bytes' (the full digest, shown as hex; the variable set to 0)")
    h.add_argument("-o", "--output", choices=("table", "json"), default="table", help="output format")
    d = sub.add_parser("decode", help="decode a KV event payload",
                       description="Decode a vLLM KV event batch (the payload frame of its ZMQ publisher) "
                                   "into readable events.")
    d.add_argument("payload", nargs="*", metavar="HEX",
                   help="the payload in hex ('-': hex from standard input); or three: topic, seq and payload "
                        "frames of a pub message, each in hex")
    d.add_argument("--file", metavar="FILE", help="read the raw payload bytes from FILE ('-': standard input)")
    d.add_argument("-o", "--output", choices=("table", "json"), default="table", help="output format")
    w = sub.add_parser("watch", help="live decoded events from an engine's KV event publisher",
                       description="Subscribe to a vLLM engine's KV event publisher (its kv-events-config "
                                   "endpoint) and print each batch as it arrives, with sequence gaps.")
    w.add_argument("endpoint", metavar="ENDPOINT", help="the publisher, e.g. tcp://10.0.0.5:5557")
    w.add_argument("--topic", default="", help="only this topic (default: every topic)")
    w.add_argument("--count", type=int, default=0, metavar="N", help="stop after N batches (default: no limit)")
    w.add_argument("--seconds", type=float, default=0.0, metavar="S",
                   help="stop after S seconds (default: no limit; Ctrl-C stops too)")
    w.add_argument("-o", "--output", choices=("table", "json"), default="table",
                   help="output format: table, or one JSON object a line")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    ns = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        if ns.action == "watch":
            return watch(ns, sys.stdout)
        lines = _hash(ns) if ns.action == "hash" else _decode(ns)
    except KvCliError as e:
        print(f"llmgw kv {ns.action}: {printable(str(e))}", file=sys.stderr)
        return 1
    sys.stdout.write("".join(line + "\n" for line in lines))
    return 0


# --------------------------------------------------------------------------- input

def _read(name: str, flag: str, binary_stdin: BinaryIO | None = None) -> bytes:
    """At most MAX_INPUT_BYTES from a file or ('-') standard input."""
    try:
        if name == "-":
            data = (binary_stdin or sys.stdin.buffer).read(MAX_INPUT_BYTES + 1)
        else:
            with open(name, "rb") as f:
                data = f.read(MAX_INPUT_BYTES + 1)
    except OSError as e:
        raise KvCliError(f"{flag}: cannot read {name}: {e.strerror}") from None
    if len(data) > MAX_INPUT_BYTES:
        raise KvCliError(f"{flag}: {name} is larger than {MAX_INPUT_BYTES} bytes")
    return data


def parse_tokens(text: str, flag: str) -> list[int]:
    """Token ids separated by commas and/or blanks, optionally in [brackets] (a JSON list)."""
    body = text.strip()
    if body.startswith("[") and body.endswith("]"):
        body = body[1:-1]
    words = [w for w in re.split(r"[,\s]+", body) if w]
    if not words:
        raise KvCliError(f"{flag}: no token ids given")
    if len(words) > MAX_TOKENS:
        raise KvCliError(f"{flag}: {len(words)} token ids; at most {MAX_TOKENS}")
    out = []
    for i, w in enumerate(words):
        if not w.isascii() or not w.isdigit() or len(w) > 19 or int(w) > MAX_TOKEN_ID:
            raise KvCliError(f"{flag}: token {i} is {printable(w[:40])!r}, not a token id "
                             f"(a whole number from 0 to {MAX_TOKEN_ID})")
        out.append(int(w))
    return out


# --------------------------------------------------------------------------- hash

def _lora(ns: argparse.Namespace, v: VllmVersion) -> LoRA | None:
    if ns.lora is None:
        if ns.lora_path is not None:
            raise KvCliError("--lora-path: needs --lora NAME")
        return None
    name, sep, ident = ns.lora.partition(":")
    if not name:
        raise KvCliError(f"--lora: {printable(ns.lora)!r} has no adapter name (expected NAME[:ID])")
    int_id = None
    if sep:
        if not (ident.isascii() and ident.isdigit()) or len(ident) > 18:
            raise KvCliError(f"--lora: the id in {printable(ns.lora)!r} is not a whole number")
        int_id = int(ident)
    if v < LORA_NAME_KEY_SINCE and int_id is None:
        raise KvCliError(f"--lora: vLLM {v} hashes the adapter's int id: give NAME:ID")
    if v >= TAGGED_KEYS_SINCE and ns.lora_path is None:
        raise KvCliError(f"--lora-path: vLLM {v} hashes the adapter's lora_path: give it")
    return LoRA(name, int_id, ns.lora_path)


def hash_context(ns: argparse.Namespace) -> HashContext:
    try:
        v = VllmVersion.parse(ns.vllm_version)
    except ValueError:
        raise KvCliError(f"--vllm-version: {printable(ns.vllm_version)!r} is not a version like 0.33.0") from None
    if not 0 < ns.block_size <= MAX_BLOCK_SIZE:
        raise KvCliError(f"--block-size: {ns.block_size} is not from 1 to {MAX_BLOCK_SIZE}")
    if ns.seed is None and (v < FIXED_NONE_SEED_SINCE or ns.algo.startswith("xxhash")):
        raise KvCliError(f"--no-seed: vLLM {v} with --algo {ns.algo} draws the first block's parent at random "
                         "when PYTHONHASHSEED is unset, so no one can reproduce its hashes; give the "
                         "engine's PYTHONHASHSEED with --seed (and set it on the engine)")
    try:
        return HashContext.create(v, ns.algo, ns.block_size, ns.seed)
    except ValueError as e:  # an algo or version the release doesn't support
        raise KvCliError(f"--algo/--vllm-version: {e}") from None
    except ImportError as e:  # xxhash* without the xxhash package
        raise KvCliError(f"--algo: {e}") from None


def _hash(ns: argparse.Namespace) -> list[str]:
    if ns.tokens is not None:
        tokens = parse_tokens(ns.tokens, "--tokens")
    else:
        raw = _read(ns.tokens_file, "--tokens-file")
        try:
            text = raw.decode()
        except UnicodeDecodeError:
            raise KvCliError(f"--tokens-file: {ns.tokens_file} is not text") from None
        tokens = parse_tokens(text, "--tokens-file")
    ctx = hash_context(ns)
    lora = _lora(ns, ctx.version)
    hasher = ctx.hasher(lora, ns.cache_salt)
    digests = hasher.extend(tokens)
    use_int = ns.hash_form == "int"
    bs = ctx.block_size
    blocks = [{"index": i, "start": i * bs, "end": (i + 1) * bs - 1,
               "hash": _jsonable(event_hash(d, use_int)), "digest": d.hex()} for i, d in enumerate(digests)]
    if ns.output == "json":
        return [json.dumps({"vllm_version": str(ctx.version), "algo": ctx.algo, "seed": ns.seed, "block_size": bs,
                            "hash_form": ns.hash_form, "none_hash": ctx.none_hash.hex(),
                            "tokens": len(tokens), "partial_tokens": len(tokens) - len(digests) * bs,
                            "blocks": blocks}, indent=2)]
    from llmgw.admin_client.rationale import text_table

    rows = [[str(b["index"]), f"{b['start']}-{b['end']}", str(b["hash"])] for b in blocks]
    seed = "PYTHONHASHSEED unset" if ns.seed is None else f"PYTHONHASHSEED={printable(ns.seed)}"
    out = [(f"vLLM {ctx.version}, {ctx.algo}, {seed}, block size {bs}, {ns.hash_form} hashes: {len(digests)} full "
            f"block(s) of {len(tokens)} tokens ({len(tokens) - len(digests) * bs} left over, not hashed)")]
    if rows:
        out += text_table(["BLOCK", "TOKENS", "EVENT HASH"], rows)
    return out


# --------------------------------------------------------------------------- decode

def _unhex(text: str, what: str) -> bytes:
    cleaned = re.sub(r"\s+", "", text)
    if cleaned[:2] in ("0x", "0X"):
        cleaned = cleaned[2:]
    if len(cleaned) > 2 * MAX_INPUT_BYTES:
        raise KvCliError(f"{what}: larger than {MAX_INPUT_BYTES} bytes")
    try:
        return bytes.fromhex(cleaned)
    except ValueError:
        raise KvCliError(f"{what}: not hex (give raw bytes with --file)") from None


def _payload(ns: argparse.Namespace) -> tuple[bytes, str | None, int | None]:
    """(payload, topic, seq): topic and seq only from a frame triple."""
    if ns.file is not None:
        if ns.payload:
            raise KvCliError("give the payload either as HEX or with --file, not both")
        return _read(ns.file, "--file"), None, None
    if len(ns.payload) == 1:
        text = ns.payload[0]
        if text == "-":
            text = _read("-", "HEX").decode("ascii", "replace")
        return _unhex(text, "HEX"), None, None
    if len(ns.payload) == 3:
        frames = [_unhex(x, f"frame {i}") for i, x in enumerate(ns.payload)]
        try:
            topic, seq, payload = parse_pub_frames(frames)
        except KVEventDecodeError as e:
            raise KvCliError(f"frames: {e}") from None
        return payload, topic, seq
    raise KvCliError(f"expected one HEX payload, or three (topic, seq, payload), or --file; got {len(ns.payload)}")


def _decode(ns: argparse.Namespace) -> list[str]:
    payload, topic, seq = _payload(ns)
    try:
        batch = decode_batch(payload)
    except KVEventDecodeError as e:
        raise KvCliError(f"not a KV event batch ({len(payload)} bytes): {e}") from None
    if ns.output == "json":
        doc: dict[str, Any] = {}
        if topic is not None:
            doc.update(topic=topic, seq=seq)
        doc.update(batch_json(batch))
        return [json.dumps(doc, indent=2)]
    head = f"ts {batch.ts!r}  data_parallel_rank {batch.data_parallel_rank}  {len(batch.events)} event(s)"
    if topic is not None:
        head = f"topic {printable(topic)!r}  seq {seq}  " + head
    return [head, *(f"  [{i}] {event_line(ev)}" for i, ev in enumerate(batch.events))]


def _jsonable(x: Any) -> Any:
    """Wire values for JSON: bytes as hex, tuples as lists, map keys as strings."""
    if isinstance(x, bytes):
        return x.hex()
    if isinstance(x, (list, tuple)):
        return [_jsonable(i) for i in x]
    if isinstance(x, dict):
        return {str(_jsonable(k)): _jsonable(v) for k, v in x.items()}
    return x


def _event_dict(ev: Any) -> dict[str, Any]:
    return {name: _jsonable(getattr(ev, name)) for name in ev.__slots__}


def batch_json(batch: EventBatch) -> dict[str, Any]:
    events = []
    for ev in batch.events:
        if isinstance(ev, UnknownEvent):
            events.append({"type": ev.type, "unknown": True, "raw": _jsonable(ev.raw)})
        else:
            events.append({"type": type(ev).__name__, **_event_dict(ev)})
    return {"ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank, "events": events}


def _short(x: Any, limit: int = 200) -> str:
    """A wire value for one line: bytes as hex, strings escaped, bounded in length."""
    text = printable(json.dumps(_jsonable(x), ensure_ascii=True, default=repr))
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def event_line(ev: Any) -> str:
    if isinstance(ev, BlockStored):
        parts = [f"BlockStored {len(ev.block_hashes)} block(s) hashes={_short(ev.block_hashes, 400)}",
                 f"parent={_short(ev.parent_block_hash)}", f"tokens={len(ev.token_ids)}",
                 f"block_size={ev.block_size}", f"medium={_short(ev.medium)}"]
        if ev.lora_id is not None or ev.lora_name is not None:
            parts.append(f"lora={_short(ev.lora_name)} (id {ev.lora_id})")
        skip = {"block_hashes", "parent_block_hash", "token_ids", "block_size", "medium", "lora_id", "lora_name"}
        parts += [f"{k}={_short(getattr(ev, k))}" for k in ev.__slots__
                  if k not in skip and getattr(ev, k) is not None]
        return "  ".join(parts)
    if isinstance(ev, BlockRemoved):
        parts = [f"BlockRemoved {len(ev.block_hashes)} block(s) hashes={_short(ev.block_hashes, 400)}",
                 f"medium={_short(ev.medium)}"]
        parts += [f"{k}={_short(getattr(ev, k))}" for k in ("group_idx", "locality", "ownership")
                  if getattr(ev, k) is not None]
        return "  ".join(parts)
    if isinstance(ev, AllBlocksCleared):
        return "AllBlocksCleared"
    return f"unknown event {_short(ev.type)} (a newer vLLM?): {_short(ev.raw, 400)}"


# --------------------------------------------------------------------------- watch

def watch(ns: argparse.Namespace, out: Any) -> int:
    """Print every batch the publisher sends until --count, --seconds or Ctrl-C. A sequence gap
    (events the SUB socket missed: its high-water mark, a slow reader) and a message that does
    not decode are printed as such, never skipped silently."""
    import time

    import zmq

    if ns.count < 0 or ns.seconds < 0:
        raise KvCliError("--count and --seconds must be >= 0")
    if not ns.endpoint.startswith(("tcp://", "ipc://")):
        raise KvCliError(f"ENDPOINT: expected tcp://HOST:PORT or ipc://PATH, got {ns.endpoint!r}")
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    sock.setsockopt(zmq.MAXMSGSIZE, 64 << 20)  # a larger message is dropped by ZMQ, not buffered
    try:
        sock.connect(ns.endpoint)
    except zmq.ZMQError as e:
        raise KvCliError(f"ENDPOINT: {e}") from None
    sock.setsockopt(zmq.SUBSCRIBE, ns.topic.encode())
    deadline = time.monotonic() + ns.seconds if ns.seconds else None
    seen, last = 0, None
    try:
        while not ns.count or seen < ns.count:
            wait = 200 if deadline is None else int(max(0.0, deadline - time.monotonic()) * 1000)
            if deadline is not None and wait == 0:
                break
            if not sock.poll(min(wait, 200)):
                continue
            frames = sock.recv_multipart()
            seen += 1
            try:
                topic, seq, payload = parse_pub_frames(frames)
                batch = decode_batch(payload)
            except KVEventDecodeError as e:
                out.write(f"undecodable message ({sum(len(f) for f in frames)} bytes): {printable(str(e))}\n")
                out.flush()
                continue
            if last is not None and seq != last + 1:
                out.write(f"gap: seq {seq} after {last} ({seq - last - 1} missed)\n" if seq > last
                          else f"seq {seq} after {last}: the publisher restarted\n")
            last = seq
            if ns.output == "json":
                out.write(json.dumps({"topic": topic, "seq": seq, **batch_json(batch)}) + "\n")
            else:
                out.write(f"topic {printable(topic)!r}  seq {seq}  ts {batch.ts!r}  {len(batch.events)} event(s)\n")
                out.writelines(f"  [{i}] {event_line(ev)}\n" for i, ev in enumerate(batch.events))
            out.flush()
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    return 0
