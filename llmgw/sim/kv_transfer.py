"""Prefill/decode disaggregation as vLLM's NixlConnector does it, without the I/O: the launch
config, the kv_transfer_params a request carries and a prefiller answers with, the blocks a
prefiller keeps for a decoder, and how many prompt tokens a decoder counts as computed.

Facts from vLLM (docs/vllm-pd-wire.md in the main tree; `nixl_connector.py`, `scheduler.py`):

- a request with ``do_remote_decode`` that finishes by its length cap (``max_tokens`` 1) keeps its
  blocks (not freed, not evictable) until the decoder has read them or a deadline passes, and its
  answer carries ``kv_transfer_params``; any other finish (EOS or a stop string first, abort)
  frees them at once and answers ``kv_transfer_params: null``;
- a request with ``do_remote_prefill`` loads ``len(prompt) - locally cached`` tokens from the
  prefiller (not block-aligned: the partial last block comes too), after which the scheduler steps
  ``num_computed_tokens`` back by one when the whole prompt was loaded, so the decoder computes
  the last prompt token itself and samples the first output token;
- ``kv_role`` does not matter to NixlConnector (the proxy decides who prefills), so the simulator
  acts on the request's parameters whatever the role, as vLLM does.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmgw.inputs.nesting import json_loads
from llmgw.sim.args import ArgError
from llmgw.sim.blockpool import ReqBlocks

__all__ = ["KvTransferConfig", "parse_kv_transfer_config", "default_engine_id", "RemotePrefill",
           "read_kv_transfer_params", "prefill_answer_params", "KvPins", "Pinned",
           "remote_prefill_computed", "parse_read_body", "NIXL", "READ_PATH", "DEFAULT_ABORT_TIMEOUT_S"]

NIXL = "NixlConnector"
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
POLICIES = ("recompute", "fail")
# KVTransferConfig's fields (vllm/config/kv_transfer.py); anything else is refused, as a typo would be.
_FIELDS = frozenset({"kv_connector", "engine_id", "kv_buffer_device", "kv_buffer_size", "kv_role", "kv_rank",
                     "kv_parallel_size", "kv_ip", "kv_port", "kv_connector_extra_config",
                     "kv_connector_module_path", "enable_permute_local_kv", "kv_load_failure_policy"})
# PR #34896 (merged 2026-02-19) changed the default from "recompute" to "fail"; the first release
# carrying it is not verified, 0.17 is the first cut after the merge.
FAIL_DEFAULT_FROM = (0, 17)
DEFAULT_ABORT_TIMEOUT_S = 480.0  # VLLM_NIXL_ABORT_REQUEST_TIMEOUT's default since PR #25897
# The simulator's stand-in for NIXL's side channel, on its own HTTP port.
READ_PATH = "/_sim/kv_transfer/read"


@dataclass(frozen=True)
class KvTransferConfig:
    kv_connector: str
    kv_role: str
    kv_load_failure_policy: str
    engine_id: str | None = None
    kv_buffer_device: str = "cuda"
    kv_connector_extra_config: Mapping[str, Any] = field(default_factory=dict)

    @property
    def modeled(self) -> bool:
        """The simulator models NixlConnector's pull; other connectors are accepted without effect."""
        return self.kv_connector == NIXL


def _dotted_value(v: str) -> Any:
    try:
        return json.loads(v)
    except ValueError:
        return v


def parse_kv_transfer_config(text: str | None, dotted: Mapping[str, str],
                             version: tuple[int, ...]) -> KvTransferConfig | None:
    """``--kv-transfer-config JSON`` (and its dotted form) as vLLM validates it; None when no
    connector is set (vLLM then is no KV-transfer instance). Errors name the flag."""
    if not text and not dotted:
        return None
    cfg: dict[str, Any] = {}
    if text:
        try:
            given = json_loads(text)
        except ValueError as e:
            raise ArgError(f"--kv-transfer-config: not valid JSON: {e}") from None
        if not isinstance(given, dict):
            raise ArgError("--kv-transfer-config: must be a JSON object")
        cfg.update(given)
    for k, v in dotted.items():
        cfg[k] = _dotted_value(v)
    unknown = set(cfg) - _FIELDS
    if unknown:
        raise ArgError(f"--kv-transfer-config: unknown field(s) {sorted(unknown)}")
    connector, role = cfg.get("kv_connector"), cfg.get("kv_role")
    if connector is not None and (not isinstance(connector, str) or not connector):
        raise ArgError(f"--kv-transfer-config: kv_connector must be a connector name, got {connector!r}")
    if role is not None and role not in KV_ROLES:
        raise ArgError(f"--kv-transfer-config: unsupported kv_role {role!r}; supported roles are "
                       f"{', '.join(KV_ROLES)}")
    policy = cfg.get("kv_load_failure_policy")
    if policy is not None and policy not in POLICIES:
        raise ArgError(f"--kv-transfer-config: kv_load_failure_policy must be 'recompute' or 'fail', got {policy!r}")
    extra = cfg.get("kv_connector_extra_config", {})
    if not isinstance(extra, dict):
        raise ArgError("--kv-transfer-config: kv_connector_extra_config must be a JSON object")
    engine_id = cfg.get("engine_id")
    if engine_id is not None and not isinstance(engine_id, str):
        raise ArgError(f"--kv-transfer-config: engine_id must be a string, got {engine_id!r}")
    device = cfg.get("kv_buffer_device", "cuda")
    if not isinstance(device, str):
        raise ArgError(f"--kv-transfer-config: kv_buffer_device must be a device name, got {device!r}")
    if connector is None:
        return None
    if role is None:
        raise ArgError(f"--kv-transfer-config: kv_role is required when kv_connector is set; supported "
                       f"roles are {', '.join(KV_ROLES)}")
    if policy is None:
        policy = "fail" if version >= FAIL_DEFAULT_FROM else "recompute"
    return KvTransferConfig(connector, role, policy, engine_id, device, extra)


def default_engine_id(seed: int, host: str, port: int) -> str:
    """vLLM draws a uuid4 when engine_id is unset; the simulator derives a stable one in that form."""
    h = hashlib.sha256(f"llmgw-sim:{seed}:{host}:{port}".encode()).hexdigest()
    return f"{h[:8]}-{h[8:12]}-4{h[13:16]}-a{h[17:20]}-{h[20:32]}"


@dataclass(frozen=True)
class RemotePrefill:
    """Where a decoder pulls a request's KV from (the prefiller's answer, passed on by the router)."""

    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: tuple[int, ...]


def _block_ids(v: Any) -> tuple[int, ...] | None:
    if isinstance(v, list) and v and all(isinstance(x, list) for x in v):
        v = v[0]  # the newest connector: one list per KV-cache group; the full-attention group first
    if isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return tuple(v)
    return None


def read_kv_transfer_params(obj: Any) -> tuple[str | None, RemotePrefill | None]:
    """What a request's ``kv_transfer_params`` asks: ("decode", None) for a prefill leg (keep the
    blocks for a remote decode), ("prefill", where) for a decode leg, (None, None) for nothing.
    A decode leg whose parameters are incomplete is ("invalid", None): vLLM warns and does an
    ordinary prefill. Raises ValueError when the field is not an object (vLLM's 400)."""
    if obj is None:
        return None, None
    if not isinstance(obj, dict):
        raise ValueError("'kv_transfer_params' must be an object")
    if obj.get("do_remote_prefill"):
        ids = _block_ids(obj.get("remote_block_ids"))
        host, port = obj.get("remote_host"), obj.get("remote_port")
        rid, eid = obj.get("remote_request_id"), obj.get("remote_engine_id")
        if (not ids or not isinstance(host, str) or not host or not isinstance(port, int) or isinstance(port, bool)
                or not isinstance(rid, str) or not isinstance(eid, str)):
            return "invalid", None
        return "prefill", RemotePrefill(eid, rid, host, port, ids)
    if obj.get("do_remote_decode"):
        return "decode", None
    return None, None


def prefill_answer_params(block_ids: Sequence[int], engine_id: str, request_id: str, host: str,
                          port: int) -> dict[str, Any]:
    """The prefiller's ``kv_transfer_params``, keys in the order of NixlConnector's dict (single-file
    connector, version 2; one tensor-parallel rank)."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": list(block_ids),
            "remote_engine_id": engine_id, "remote_request_id": request_id, "remote_host": host,
            "remote_port": port, "tp_size": 1}


@dataclass(slots=True)
class Pinned:
    req_id: str
    blocks: ReqBlocks  # emptied when freed
    block_ids: list[int]
    num_tokens: int  # tokens whose KV the blocks hold (the prompt, for a max_tokens=1 prefill)
    deadline: float


class KvPins:
    """Finished prefill requests' blocks kept for a decoder: held (a reference each, so neither free
    nor evictable, and counted in KV usage) until read or expired; then freed as a request's are."""

    def __init__(self, free: Callable[[ReqBlocks], None]) -> None:
        self._free = free
        self._pins: dict[str, Pinned] = {}  # insertion order = deadline order (one timeout for all)
        self.expired = 0  # requests whose blocks no decoder read in time
        self.read_count = 0

    def __len__(self) -> int:
        return len(self._pins)

    @property
    def num_blocks(self) -> int:
        return sum(len(p.block_ids) for p in self._pins.values())

    def pin(self, req_id: str, blocks: ReqBlocks, num_tokens: int, deadline: float) -> list[int]:
        p = self._pins[req_id] = Pinned(req_id, blocks, [b.block_id for b in blocks.blocks], num_tokens, deadline)
        return list(p.block_ids)

    def get(self, req_id: str) -> Pinned | None:
        return self._pins.get(req_id)

    def read(self, req_id: str, block_ids: Sequence[int] | None = None) -> Pinned | None:
        """A decoder read a request's blocks: free them. None when unknown (never pinned, read
        already, or expired). ValueError when ``block_ids`` are not among the request's blocks."""
        p = self._pins.get(req_id)
        if p is None:
            return None
        if block_ids is not None and not set(block_ids) <= set(p.block_ids):
            raise ValueError(f"blocks {sorted(set(block_ids) - set(p.block_ids))} are not held for request {req_id!r}")
        del self._pins[req_id]
        self._free(p.blocks)
        self.read_count += 1
        return p

    def next_deadline(self) -> float | None:
        return next(iter(self._pins.values())).deadline if self._pins else None

    def expire(self, now: float) -> list[Pinned]:
        out = []
        while self._pins:
            p = next(iter(self._pins.values()))
            if p.deadline > now:
                break
            del self._pins[p.req_id]
            self._free(p.blocks)
            out.append(p)
        self.expired += len(out)
        return out


def remote_prefill_computed(num_prompt: int, local_hit_tokens: int, remote_blocks: int,
                            block_size: int) -> tuple[int, int]:
    """(tokens counted as computed, tokens loaded from the prefiller) for a decode leg whose pull
    succeeded: everything the remote blocks cover beyond the local prefix-cache hit is loaded; when
    that is the whole prompt, the last prompt token is computed again (vLLM's scheduler steps back
    one), so the result is at most ``num_prompt - 1``."""
    covered = min(remote_blocks * block_size, num_prompt)
    external = max(0, covered - local_hit_tokens)
    computed = local_hit_tokens + external
    if computed >= num_prompt:
        computed = num_prompt - 1
    return computed, external


def parse_read_body(obj: Any) -> tuple[str, list[int] | None]:
    """The side channel's read request: {"remote_request_id": str, "remote_block_ids": [int] | null}."""
    if not isinstance(obj, dict):
        raise ValueError("the body must be a JSON object")
    rid = obj.get("remote_request_id")
    if not isinstance(rid, str) or not rid:
        raise ValueError("'remote_request_id' must be a non-empty string")
    raw = obj.get("remote_block_ids")
    if raw is None:
        return rid, None
    ids = _block_ids(raw)
    if ids is None:
        raise ValueError("'remote_block_ids' must be a list of integers")
    return rid, list(ids)
